"""``estimate(..., what_if=True)`` / ``torchmem estimate --what-if``: each lever, applied by
torchmem to the user's own model and optimizer, equals the same change written by hand (all
three peaks, to the byte); levers a step cannot take say why; the table, the best combination
and the JSON shape."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torchmem
from torchmem.errors import InvalidInputError
from torchmem.fit import Adam8bitStandIn
from torchmem.fit.levers._whatif import LEVERS, _lever_run, check_levers, what_if_lines
from torchmem.fit.run._engine import run_once

D, SEQ, BATCH = 128, 64, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, 4 * D)
        self.b = torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(torch.nn.Module):
    def __init__(self, ckpt: bool = False, block: type = Block) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(block() for _ in range(3))
        self.head = torch.nn.Linear(D, 10)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return self.head(x)


def as_written(batch: int) -> object:
    """The user's step: nothing memory-saving in it."""
    net = Net().cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    return _steps(net, opt, torch.randn(batch, SEQ, D, device="cuda"))


def _steps(net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> object:
    def step() -> None:
        net(x).float().sum().backward()
        opt.step()
        opt.zero_grad()

    return step


class HostAdamW:
    """ZeRO-Offload's optimizer written by hand (as DeepSpeed's and torchao's
    CPUOffloadOptimizer do it): AdamW's state and step on the host, on pinned host copies of
    the parameters; after backward the gradients are copied into pinned host gradients, the
    host AdamW steps, and the updated parameters are copied back to the GPU."""

    def __init__(self, params: object, lr: float) -> None:
        self.pairs = []
        for p in params:
            with torch.no_grad():
                h = torch.empty_like(p, device="cpu", pin_memory=True)
                h.copy_(p.detach())
                h.grad = torch.empty_like(h, pin_memory=True)
            self.pairs.append((p, h))
        self.opt = torch.optim.AdamW([h for _, h in self.pairs], lr=lr)

    @torch.no_grad()
    def step(self) -> None:
        for p, h in self.pairs:
            h.grad.copy_(p.grad)
        self.opt.step()
        for p, h in self.pairs:
            p.copy_(h)

    def zero_grad(self) -> None:
        for p, _ in self.pairs:
            p.grad = None


def by_hand(ckpt: bool = False, opt_kw: dict | None = None, bf16: bool = False, micro: int = 1,
            autocast: torch.dtype | None = None, opt_cls: type | None = None,
            shard: str | None = None, scaler: bool = False,
            host_opt: bool = False):  # noqa: ANN201
    """The same step with one change written by hand (``scaler``: fp16's gradient scaler
    loop, ``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()``;
    ``host_opt``: :class:`HostAdamW`)."""
    def build(batch: int) -> object:
        net = Net(ckpt=ckpt).cuda()
        if bf16:
            net.to(torch.bfloat16)
        if shard is not None:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            kw = {"offload_policy": CPUOffloadPolicy()} if shard == "offload" else {}
            for layer in net.layers:
                fully_shard(layer, **kw)
            fully_shard(net, **kw)
        opt = (HostAdamW(net.parameters(), lr=1e-3) if host_opt else
               (opt_cls or torch.optim.AdamW)(net.parameters(), lr=1e-3, **(opt_kw or {})))
        x = torch.randn(batch, SEQ, D, device="cuda")
        grad_scaler = torch.amp.GradScaler("cuda") if scaler else None

        def fwd() -> torch.Tensor:
            if autocast is not None:
                with torch.autocast("cuda", dtype=autocast):
                    return net(x)
            return net(x.to(torch.bfloat16) if bf16 else x)

        def micro_step() -> None:
            loss = fwd().float().sum()
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()

        def step() -> None:
            for _ in range(micro):
                micro_step()
            if grad_scaler is not None:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
            opt.zero_grad()

        return step
    return build


def figures(e: torchmem.fit.Estimate) -> tuple[int, int, int, int]:
    return (e.peak_requested_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes,
            e.host_peak_bytes)


BY_NAME = {lv.name: lv for lv in LEVERS}
CASES = {
    "activation_checkpointing": (by_hand(ckpt=True), BATCH, None),
    "grad_accumulation_2": (by_hand(micro=2), BATCH // 2, None),
    "grad_accumulation_4": (by_hand(micro=4), BATCH // 4, None),
    "bf16_autocast": (by_hand(autocast=torch.bfloat16), BATCH, None),
    "fp16_autocast": (by_hand(autocast=torch.float16, scaler=True), BATCH, None),
    "bf16_weights": (by_hand(bf16=True), BATCH, None),
    "optimizer_fused": (by_hand(opt_kw={"fused": True, "foreach": False}), BATCH, None),
    "optimizer_foreach": (by_hand(opt_kw={"foreach": True}), BATCH, None),
    "optimizer_per_parameter": (by_hand(opt_kw={"foreach": False}), BATCH, None),
    "optimizer_8bit": (by_hand(opt_cls=Adam8bitStandIn), BATCH, None),
    "adafactor": (by_hand(opt_cls=torch.optim.Adafactor), BATCH, None),
    "fsdp_2": (by_hand(shard="fsdp"), BATCH, 2),
    "cpu_offload": (by_hand(shard="offload"), BATCH, 1),
    "cpu_offload_optimizer": (by_hand(host_opt=True), BATCH, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_lever_equals_the_change_written_by_hand(name: str) -> None:
    hand, batch, world = CASES[name]
    lv = BY_NAME[name]
    lr = _lever_run([lv])
    lever = run_once(as_written, BATCH, "A100-80GB", levers=lr, world_size=world)
    written = run_once(hand, batch, "A100-80GB", world_size=world)
    assert figures(lever) == figures(written)
    plain = run_once(as_written, BATCH, "A100-80GB", world_size=world)
    if name in ("optimizer_foreach",):  # AdamW's default on a GPU is foreach: the same step
        assert figures(lever) == figures(plain)
    elif name != "optimizer_per_parameter":
        assert figures(lever) != figures(plain)  # the lever changed something


def test_fp16_lever_runs_the_gradient_scaler_loop_written_by_hand() -> None:
    """fp16_autocast (a T4: no bf16) also scales the loss and steps through a GradScaler; it
    equals the hand-written scaler loop, alone and under accumulation, and holds the scaler's
    own GPU scalars at the peak: its scale (fp32), growth tracker (int32) and unscale's
    found_inf (fp32), 4 bytes each, each in its own 512-byte block."""
    lr = _lever_run([BY_NAME["fp16_autocast"]])
    lever = run_once(as_written, BATCH, "T4", levers=lr)
    assert figures(lever) == figures(run_once(by_hand(autocast=torch.float16, scaler=True),
                                              BATCH, "T4"))
    assert lr.scaled == ["AdamW"]
    no_scaler = run_once(by_hand(autocast=torch.float16), BATCH, "T4")
    assert lever.peak_requested_bytes - no_scaler.peak_requested_bytes == 3 * 4
    assert lever.peak_allocated_bytes - no_scaler.peak_allocated_bytes == 3 * 512
    row = torchmem.estimate(as_written, gpu="T4", batch_size=BATCH,
                            what_if=["fp16_autocast"]).what_if[0]
    assert row.applied == ("autocast to float16 around Net; a GradScaler scales the loss and "
                           "steps AdamW")
    assert row.peak_requested_bytes == lever.peak_requested_bytes
    # a step with its own scaler loop keeps it alone (the lever adds no second scaler)
    own = by_hand(autocast=torch.float16, scaler=True)
    assert figures(run_once(own, BATCH, "T4", levers=_lever_run([BY_NAME["fp16_autocast"]]))
                   ) == figures(lever)
    combo = run_once(as_written, BATCH, "T4",
                     levers=_lever_run(check_levers(["fp16_autocast+grad_accumulation_2"])))
    assert figures(combo) == figures(run_once(
        by_hand(autocast=torch.float16, scaler=True, micro=2), BATCH // 2, "T4"))


def test_cpu_offload_optimizer_moves_the_state_to_the_host_as_written_by_hand() -> None:
    """The optimizer's state leaves the GPU (AdamW's two moments: 2 x the parameters' bytes at
    the peak) and the host holds the parameters' copies, their gradients and the moments
    (4 x); combined with accumulation and checkpointing it equals both written by hand."""
    param_bytes = sum(p.numel() * 4 for p in Net().parameters())
    lr = _lever_run([BY_NAME["cpu_offload_optimizer"]])
    lever = run_once(as_written, BATCH, "A100-80GB", levers=lr)
    plain = run_once(as_written, BATCH, "A100-80GB")
    assert lr.offloaded == [("AdamW", 2 * 3 + 2 + 2 * 3, param_bytes)]  # 14 tensors
    assert plain.by_category["optimizer_state"] == 2 * param_bytes
    assert lever.by_category["optimizer_state"] == 0
    assert plain.peak_requested_bytes - lever.peak_requested_bytes == 2 * param_bytes
    assert lever.host_peak_bytes >= 4 * param_bytes > plain.host_peak_bytes
    for combo, hand, batch in (
            ("cpu_offload_optimizer+grad_accumulation_2", by_hand(host_opt=True, micro=2),
             BATCH // 2),
            ("cpu_offload_optimizer+activation_checkpointing",
             by_hand(host_opt=True, ckpt=True), BATCH)):
        got = run_once(as_written, BATCH, "A100-80GB", levers=_lever_run(check_levers([combo])))
        assert figures(got) == figures(run_once(hand, batch, "A100-80GB")), combo
    for other in ("fsdp_2", "cpu_offload", "optimizer_fused", "adafactor", "fp16_autocast"):
        with pytest.raises(InvalidInputError, match=f"cpu_offload_optimizer and {other} cannot"):
            check_levers([f"cpu_offload_optimizer+{other}"])


def test_cpu_offload_optimizer_row_names_the_host_bytes() -> None:
    e = torchmem.estimate(as_written, gpu="A100-80GB", batch_size=BATCH,
                          what_if=["cpu_offload_optimizer"])
    row = e.what_if[0]
    param_bytes = sum(p.numel() * 4 for p in Net().parameters())
    assert row.skipped is None and row.applied.startswith(
        "AdamW on pinned host copies of 14 parameters (")
    assert row.cost["host_peak_bytes"] == row.estimate.host_peak_bytes >= 4 * param_bytes
    assert row.cost["host_transfer_bytes_per_step"] == 2 * param_bytes
    from torchmem.units import format_bytes

    assert f"host {format_bytes(row.estimate.host_peak_bytes)}" in row.cost_words()

    def no_optimizer(batch: int) -> object:
        net = Net().cuda()
        x = torch.randn(batch, SEQ, D, device="cuda")
        return lambda: net(x).sum().backward()

    e = torchmem.estimate(no_optimizer, gpu="A100-80GB", batch_size=2,
                          what_if=["cpu_offload_optimizer"])
    assert "no torch.optim optimizer" in e.what_if[0].skipped


def test_checkpointing_names_the_blocks_and_counts_the_recomputed_flops() -> None:
    lr = _lever_run([BY_NAME["activation_checkpointing"]])
    run_once(as_written, BATCH, "A100-80GB", levers=lr, steps=1)
    assert lr.wrapped == ["layers.0", "layers.1", "layers.2"]
    base = _lever_run([])
    run_once(as_written, BATCH, "A100-80GB", levers=base, steps=1)
    # the recomputed forward of the three blocks, up to what backward needs (non-reentrant
    # checkpoint stops early): block.a's matmul (2*m*k*n FLOPs) and the relu; block.b's output
    # is needed by nothing, so its matmul is not rerun
    assert lr.flops - base.flops == 3 * 2 * (BATCH * SEQ) * D * (4 * D)


def test_what_if_table_best_and_json() -> None:
    # batch 64 on an H100-sized context with 120 MiB usable: as written needs 150 MiB reserved
    e = torchmem.estimate(as_written, gpu="650 MiB", batch_size=64, margin=0,
                          what_if=["activation_checkpointing", "adafactor", "lora",
                                   "grad_accumulation_4", "allocator",
                                   "grad_accumulation_4+activation_checkpointing"])
    assert not e.fits and e.oom is not None  # the step as written runs out, and says where
    # found by its rerun on the card, which ran in the pool beside the levers: the same site,
    # stack included, as the estimate without levers finds
    plain = torchmem.estimate(as_written, gpu="650 MiB", batch_size=64, margin=0)
    assert plain.oom is not None
    assert e.oom.to_dict() == plain.oom.to_dict()
    usable = e.usable_bytes
    rows = {r.lever: r for r in e.what_if}
    assert set(rows) == {"activation_checkpointing", "adafactor", "lora", "grad_accumulation_4",
                         "allocator", "grad_accumulation_4 + activation_checkpointing"}
    done = [r for r in e.what_if if r.skipped is None]
    assert [r.peak_reserved_bytes for r in done] == sorted(r.peak_reserved_bytes for r in done)
    for r in done:  # each row's verdict is its own run's, on this GPU
        assert r.fits == (r.peak_reserved_bytes <= usable and r.estimate.oom is None)
        assert r.headroom_bytes == usable - r.peak_reserved_bytes
        # and equals the same levers' run made directly on that card
        direct = run_once(as_written, 64, "650 MiB",
                          levers=_lever_run(check_levers([r.lever.replace(" + ", "+")])))
        if r.fits:
            assert figures(direct)[:3] == (r.peak_requested_bytes, r.peak_allocated_bytes,
                                           r.peak_reserved_bytes)
        else:
            assert direct.oom is not None
    assert rows["activation_checkpointing"].fits and rows["grad_accumulation_4"].fits
    assert not rows["adafactor"].fits
    # the cheapest that fits: checkpointing (recomputation) before accumulation (more steps)
    assert e.what_if_best.lever == "activation_checkpointing"
    assert rows["lora"].skipped and "no attention projections" in rows["lora"].skipped
    d = json.loads(json.dumps(e.to_dict()))
    assert {"lever", "applied", "peak_requested_bytes", "peak_allocated_bytes",
            "peak_reserved_bytes", "fits", "headroom_bytes", "cost"} <= set(d["what_if"][0])
    assert d["what_if_best"]["lever"] == "activation_checkpointing"
    text = "\n".join(what_if_lines(e.what_if, e.what_if_best, e))
    assert "lora: no attention projections in Net" in text
    assert "best: activation_checkpointing (fits" in text
    page = e._repr_html_()  # the notebook's display: the same table
    assert "best:</b> activation_checkpointing (fits" in page
    assert "lora</b>: no attention projections in Net" in page


def _html_cells(page: str) -> list[list[str]]:
    import html
    import re

    return [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", page)]


def test_best_is_as_written_when_the_step_fits() -> None:
    e = torchmem.estimate(as_written, gpu="H100-80GB", batch_size=8,
                          what_if=["adafactor", "optimizer_per_parameter", "lora"])
    assert e.fits and e.what_if_best.lever == "as_written"
    assert e.what_if_best.peak_reserved_bytes == e.peak_reserved_bytes
    # the notebook's display holds the table: each row's lever and its figures, in its cells
    from torchmem.units import format_bytes

    cells = {c[0]: c for c in _html_cells(e._repr_html_()) if c}
    for r in e.what_if:
        if r.skipped is None:
            assert cells[r.lever][1:5] == [format_bytes(r.peak_reserved_bytes),
                                           format_bytes(r.peak_allocated_bytes), "yes",
                                           format_bytes(r.headroom_bytes)]
            assert cells[r.lever][6] == r.applied
    assert {"adafactor", "optimizer_per_parameter"} <= set(cells)
    assert "as written (it fits; no lever needed)" in e._repr_html_()


def test_levers_a_step_cannot_take_say_why() -> None:
    def no_blocks(batch: int) -> object:
        net = torch.nn.Linear(D, D).cuda()
        x = torch.randn(batch, D, device="cuda")
        return lambda: net(x).sum().backward()

    e = torchmem.estimate(no_blocks, gpu="T4", batch_size=3,
                          what_if=["activation_checkpointing", "grad_accumulation_2",
                                   "optimizer_fused", "bf16_autocast", "fsdp_2"])
    why = {r.lever: r.skipped for r in e.what_if}
    assert "no repeated blocks" in why["activation_checkpointing"]
    assert "no optimizer" in why["grad_accumulation_2"]
    assert "no torch.optim optimizer" in why["optimizer_fused"]
    assert "no bfloat16" in why["bf16_autocast"]  # a T4 is compute capability 7.5
    assert "no optimizer" in why["fsdp_2"]
    assert all(r.peak_reserved_bytes is None for r in e.what_if)


def test_an_optimizer_kernel_the_step_already_uses_says_no_change() -> None:
    """A step that makes ``AdamW(fused=True)`` itself (nanoGPT does): the ``optimizer_fused``
    lever changes nothing, and its row says so (its peaks equal the step as written's, checked
    here too) instead of looking like a lever to take; the other kernels are real rows."""
    build = by_hand(opt_kw={"fused": True})
    base = torchmem.estimate(build, gpu="T4", batch_size=BATCH)
    e = torchmem.estimate(build, gpu="T4", batch_size=BATCH,
                          what_if=["optimizer_fused", "optimizer_per_parameter"])
    rows = {r.lever: r for r in e.what_if}
    why = rows["optimizer_fused"].skipped
    assert why == ("no change: the step already makes AdamW(fused=True), and its GPU peaks "
                   "equal the step as written's to the byte"), why
    per = rows["optimizer_per_parameter"]
    assert per.skipped is None
    assert per.peak_allocated_bytes != base.peak_allocated_bytes  # it does change the step
    # the same lever on a step written without fused=True is a row of its own
    plain = torchmem.estimate(by_hand(), gpu="T4", batch_size=BATCH, what_if=["optimizer_fused"])
    assert plain.what_if[0].skipped is None
    assert plain.what_if[0].peak_allocated_bytes == base.peak_allocated_bytes


def test_unknown_lever_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="unknown lever 'turbo'"):
        check_levers(["turbo"])
    with pytest.raises(InvalidInputError, match="unknown lever"):
        torchmem.estimate(as_written, gpu="T4", what_if=["turbo"])


def test_cli_what_if(tmp_path, capsys) -> None:  # noqa: ANN001
    from torchmem.cli import main

    f = tmp_path / "m.py"
    f.write_text(
        "import torch\n"
        "def build(batch):\n"
        "    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).cuda()\n"
        "    opt = torch.optim.AdamW(net.parameters())\n"
        "    x = torch.randn(batch, 64, device='cuda')\n"
        "    def step():\n"
        "        net(x).sum().backward(); opt.step(); opt.zero_grad()\n"
        "    return step\n"
    )
    code = main(["estimate", f"{f}:build", "--gpu", "T4", "--batch-size", "4", "--json",
                 "--what-if", "--levers", "activation_checkpointing,adafactor"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {r["lever"]: r for r in d["what_if"]}
    # three 64-wide layers at batch 4: the peak is the optimizer's, which checkpointing
    # leaves as it is: the lever applies and says it changes no peak
    assert rows["activation_checkpointing"]["skipped"].startswith(
        "no change: checkpointed 3 blocks"), rows["activation_checkpointing"]
    assert rows["adafactor"]["applied"] == "AdamW -> torch.optim.Adafactor"
    assert d["what_if_best"]["fits"] is True
    assert main(["estimate", f"{f}:build", "--what-if", "--levers", "nope"]) == 2
    assert "unknown lever 'nope'" in capsys.readouterr().err
    assert main(["estimate", f"{f}:build", "--levers", "adafactor"]) == 2
    assert "add --what-if" in capsys.readouterr().err
    # a script: torchmem's options before it, its own after it
    s = tmp_path / "train.py"
    s.write_text(SCRIPT)
    code = main(["estimate", "--gpu", "A100-80GB", "--json", "--what-if", "--levers",
                 "adafactor,grad_accumulation_2", str(s), "--batch-size", "4"])
    d = json.loads(capsys.readouterr().out)
    rows = {r["lever"]: r for r in d["what_if"]}
    assert code == 0 and rows["adafactor"]["applied"] == "AdamW -> torch.optim.Adafactor"
    assert rows["grad_accumulation_2"]["applied"] == ("batch as 2 micro-batches, gradients "
                                                      "accumulated")
    assert rows["grad_accumulation_2"]["peak_requested_bytes"] < d["peak_requested_bytes"]


SCRIPT = """
import argparse, torch
p = argparse.ArgumentParser(); p.add_argument("--batch-size", type=int, default=8)
a = p.parse_args()
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.a = torch.nn.Linear(128, 512); self.b = torch.nn.Linear(512, 128)
    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))
net = torch.nn.Sequential(*[Block() for _ in range(3)]).cuda()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
for i in range(100):
    x = torch.randn(a.batch_size, 64, 128, device="cuda")
    loss = net(x).float().sum()
    loss.backward(); opt.step(); opt.zero_grad()
    print(f"step {i} loss {loss.item():.3f}")
"""


def test_what_if_on_an_unmodified_script(tmp_path) -> None:  # noqa: ANN001
    """The levers apply to a script's own model and optimizer; each row equals the script
    estimated with the change written into it."""
    f = tmp_path / "train.py"
    f.write_text(SCRIPT)
    e = torchmem.estimate_script(str(f), ["--batch-size", "8"], "A100-80GB",
                                 what_if=["activation_checkpointing", "adafactor",
                                          "grad_accumulation_2", "fsdp_2"])
    rows = {r.lever: r for r in e.what_if}
    assert rows["activation_checkpointing"].applied.startswith("checkpointed 3 blocks: 0, 1, 2")
    # accumulation: the script's --batch-size halved, every second optimizer step made; equal
    # to the script with the accumulation loop written into it, run with --batch-size 4
    loop = "    loss.backward(); opt.step(); opt.zero_grad()\n"
    assert loop in SCRIPT
    accum = tmp_path / "train_accum.py"
    accum.write_text(SCRIPT.replace(loop, "    loss.backward()\n    if (i + 1) % 2 == 0:\n"
                                          "        opt.step(); opt.zero_grad()\n"))
    h = torchmem.estimate_script(str(accum), ["--batch-size", "4"], "A100-80GB")
    r = rows["grad_accumulation_2"]
    assert r.skipped is None and h.script.steps_run == 2
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert r.peak_requested_bytes < e.peak_requested_bytes
    # without the batch option in its arguments: the script's own default (argparse's 8)
    bare = torchmem.estimate_script(str(f), [], "A100-80GB", what_if=["grad_accumulation_2"])
    r = bare.what_if[0]
    assert r.skipped is None and (r.peak_requested_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_reserved_bytes)
    # a script without a batch option: listed, not run
    fixed = tmp_path / "fixed.py"
    fixed.write_text(SCRIPT.replace('"--batch-size", type=int', '"--width", type=int')
                     .replace("a.batch_size", "8"))
    none = torchmem.estimate_script(str(fixed), [], "A100-80GB", what_if=["grad_accumulation_2"])
    assert none.what_if[0].skipped.startswith("no batch option in the script's arguments or "
                                              "defaults")
    assert e.script.steps_run == 2
    by_hand = tmp_path / "train_adafactor.py"
    by_hand.write_text(SCRIPT.replace("torch.optim.AdamW(", "torch.optim.Adafactor("))
    h = torchmem.estimate_script(str(by_hand), ["--batch-size", "8"], "A100-80GB")
    r = rows["adafactor"]
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    # FSDP: the script runs as rank 0 of 2; the same script with fully_shard written into it
    # (each block, then the model), run as rank 0 of 2
    from torchmem.fit.targets._script import _find, _Run

    sharded = tmp_path / "train_fsdp.py"
    made = "net = torch.nn.Sequential(*[Block() for _ in range(3)]).cuda()\n"
    assert made in SCRIPT
    sharded.write_text(SCRIPT.replace(made, made + "from torch.distributed.fsdp import "
                                      "fully_shard\nfor b in net: fully_shard(b)\n"
                                      "fully_shard(net)\n"))
    run = _Run(_find(str(sharded), False), ["--batch-size", "8"], 2, 600)
    h = run.finish(run_once(run.build, 1, "A100-80GB", steps=1, world_size=2))
    r = rows["fsdp_2"]
    assert r.skipped is None and r.applied.startswith("fully_shard over 2 GPUs")
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert h.peak_requested_bytes < e.peak_requested_bytes  # sharding saved memory


def test_the_step_as_written_is_the_plain_estimate_when_the_script_inspects_signatures(
        tmp_path, capfd) -> None:  # noqa: ANN001
    """Under ``--what-if`` the classes the levers adjust keep their signatures: a script that
    passes ``fused=True`` only where ``inspect.signature(torch.optim.AdamW)`` names it (nanoGPT,
    litgpt) takes the same path, so the step as written equals the plain estimate to the byte
    (and fused AdamW's peaks differ from the foreach path's: the check can fail). The levers'
    reruns do not print the script's output again."""
    check = ("import inspect\n"
             "fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters\n"
             "opt = torch.optim.AdamW(net.parameters(), lr=1e-3, **({'fused': True} if fused "
             "else {}))\nprint('fused', fused)\n")
    made = "opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n"
    assert made in SCRIPT
    f = tmp_path / "train.py"
    f.write_text(SCRIPT.replace(made, check))
    plain = torchmem.estimate_script(str(f), ["--batch-size", "8"], "A100-80GB")
    capfd.readouterr()
    e = torchmem.estimate_script(str(f), ["--batch-size", "8"], "A100-80GB",
                                 what_if=["adafactor"])
    # the script's output once: the step as written's run; the lever's rerun is quiet
    assert capfd.readouterr().out.count("fused True") == 1
    peaks = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
             "host_peak_bytes")
    assert [getattr(e, k) for k in peaks] == [getattr(plain, k) for k in peaks]
    assert e.by_category == plain.by_category
    foreach = tmp_path / "foreach.py"
    foreach.write_text(SCRIPT)
    h = torchmem.estimate_script(str(foreach), ["--batch-size", "8"], "A100-80GB")
    assert h.peak_requested_bytes != plain.peak_requested_bytes


NANO = """
import torch
batch_size = 8
gradient_accumulation_steps = 2 * 2  # nanoGPT's spelling: a product
n_embd = 128
for arg in __import__("sys").argv[1:]:          # nanoGPT's configurator: --key=value only
    key, val = arg.split("=")
    assert key[2:] in globals(), f"unknown config key {key}"
    globals()[key[2:]] = type(globals()[key[2:]])(val)
net = torch.nn.Sequential(torch.nn.Linear(n_embd, 4 * n_embd), torch.nn.GELU(),
                          torch.nn.Linear(4 * n_embd, n_embd)).cuda()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
for it in range(10):
    for micro in range(gradient_accumulation_steps):
        x = torch.randn(batch_size, 256, n_embd, device="cuda")
        loss = net(x).square().mean() / gradient_accumulation_steps
        loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
"""


def test_accumulation_on_a_configurator_script_uses_its_own_options(tmp_path) -> None:  # noqa: ANN001
    """nanoGPT-style: the batch and the accumulation are globals a ``--key=value`` configurator
    sets (no batch option in the arguments). ``grad_accumulation_2`` halves ``--batch_size`` and
    doubles the script's own ``--gradient_accumulation_steps`` (its default ``2 * 2`` read as
    4): the row equals the script run with ``--batch_size=4 --gradient_accumulation_steps=8``
    by hand, and says so; given on the command line, the values given are the ones changed."""
    f = tmp_path / "train.py"
    f.write_text(NANO)
    e = torchmem.estimate_script(str(f), [], "A100-80GB", what_if=["grad_accumulation_2"])
    r = e.what_if[0]
    assert r.skipped is None, r.skipped
    assert r.applied.endswith("accumulated by the script: --gradient_accumulation_steps=4 -> 8")
    h = torchmem.estimate_script(str(f), ["--batch_size=4", "--gradient_accumulation_steps=8"],
                                 "A100-80GB")
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert h.peak_requested_bytes < e.peak_requested_bytes
    given = torchmem.estimate_script(str(f), ["--batch_size=16", "--gradient_accumulation_steps=1"],
                                     "A100-80GB", what_if=["grad_accumulation_4"])
    g = given.what_if[0]
    assert g.applied.endswith("--gradient_accumulation_steps=1 -> 4")
    h4 = torchmem.estimate_script(str(f), ["--batch_size=4", "--gradient_accumulation_steps=4"],
                                  "A100-80GB")
    assert (g.peak_requested_bytes, g.peak_reserved_bytes) == (h4.peak_requested_bytes,
                                                               h4.peak_reserved_bytes)


def test_accumulation_on_a_litgpt_style_micro_batch_divides_it_alone(tmp_path) -> None:  # noqa: ANN001
    """litgpt-style: ``--train.micro_batch_size`` under a fixed ``--train.global_batch_size``;
    the program derives its accumulation, so the lever divides the micro-batch and changes
    nothing else: the row equals the program run with the smaller micro-batch by hand."""
    lit = NANO.split("for arg in")[0] + (
        "import argparse\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--train.micro_batch_size', dest='micro', type=int, default=4)\n"
        "p.add_argument('--train.global_batch_size', dest='glob', type=int, default=16)\n"
        "a = p.parse_args()\n"
        "batch_size, gradient_accumulation_steps = a.micro, a.glob // a.micro\n"
        "net = " + NANO.split("net = ", 1)[1])
    f = tmp_path / "finetune.py"
    f.write_text(lit)
    e = torchmem.estimate_script(str(f), ["--train.micro_batch_size", "4"], "A100-80GB",
                                 what_if=["grad_accumulation_2"])
    r = e.what_if[0]
    assert r.skipped is None and "by the program: --train.micro_batch_size divided" in r.applied
    h = torchmem.estimate_script(str(f), ["--train.micro_batch_size", "2"], "A100-80GB")
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert h.peak_requested_bytes < e.peak_requested_bytes


def test_largest_batch_per_lever_equals_the_search_on_the_change_written_by_hand() -> None:
    """``--what-if --max batch_size``: the largest batch as written and with each top lever
    equal :func:`torchmem.estimate`'s own search on the step written that way."""
    e = torchmem.estimate(as_written, gpu="650 MiB", batch_size=8, margin=0,
                          what_if=["adafactor"], maximize="batch_size")
    plain = torchmem.estimate(as_written, gpu="650 MiB", margin=0, max_batch_size=True)
    assert e.max_batch_size == plain.max_batch_size
    row = e.what_if[0]
    hand = torchmem.estimate(by_hand(opt_cls=torch.optim.Adafactor), gpu="650 MiB", margin=0,
                             max_batch_size=True)
    assert row.cost["maximized"] == "batch_size"
    assert row.cost["max_value"] == hand.max_batch_size
    assert hand.max_batch_size > plain.max_batch_size  # Adafactor's smaller state leaves room


# -- lora: peft's get_peft_model on the attention projections, equal to it written by hand --

peft = pytest.importorskip("peft")


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(D, D)
        self.v_proj = torch.nn.Linear(D, D)
        self.dense = torch.nn.Linear(D, D)  # a name the MLP uses too: not targeted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.q_proj(x) @ x.transpose(-1, -2) / D ** 0.5, -1)
        return self.dense(w @ self.v_proj(x))


class AttnBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.dense = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.dense(torch.relu(x))


class AttnNet(Net):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__(ckpt, AttnBlock)


def _lora(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def attn_step(lora: list[str] | None = None, ckpt: bool = False, all_params: bool = False,
              host_opt: bool = False):  # noqa: ANN201
    """The step with an attention model; ``lora``: get_peft_model written by hand, the
    optimizer given the trainable parameters (``all_params``: ``model.parameters()``;
    ``host_opt``: :class:`HostAdamW`)."""
    def build(batch: int) -> object:
        net: torch.nn.Module = AttnNet(ckpt=ckpt).cuda()
        if lora is not None:
            net = _lora(net, lora)
        params = (net.parameters() if lora is None or all_params
                  else [p for p in net.parameters() if p.requires_grad])
        opt = HostAdamW(params, lr=1e-3) if host_opt else torch.optim.AdamW(params, lr=1e-3)
        return _steps(net, opt, torch.randn(batch, SEQ, D, device="cuda"))
    return build


LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 64}


def llama_step(lora: bool = False, bf16: bool = False):  # noqa: ANN201
    def build(batch: int) -> object:
        from transformers import LlamaConfig, LlamaForCausalLM

        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**LLAMA)).cuda()
        if bf16:
            model.to(torch.bfloat16)
        if lora:
            model = _lora(model, ["k_proj", "o_proj", "q_proj", "v_proj"])
        return _lm_steps(model, batch)
    return build


def _lm_steps(model: torch.nn.Module, batch: int) -> object:
    """A causal LM's training step, AdamW on its trainable parameters."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 512, (batch, 32), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def test_lora_equals_get_peft_model_written_by_hand_on_a_model_of_ones_own() -> None:
    lr = _lever_run([BY_NAME["lora"]])
    lever = run_once(attn_step(), BATCH, "A100-80GB", levers=lr)
    hand = run_once(attn_step(["q_proj", "v_proj"]), BATCH, "A100-80GB")
    assert figures(lever) == figures(hand)
    # the optimizer given model.parameters() (frozen ones have no gradient: AdamW skips them)
    assert figures(run_once(attn_step(["q_proj", "v_proj"], all_params=True), BATCH,
                            "A100-80GB")) == figures(hand)
    assert figures(lever) != figures(run_once(attn_step(), BATCH, "A100-80GB"))
    # 3 blocks x 2 projections x (A: 8 x 128, B: 128 x 8) trainable, of the model's own
    own = sum(p.numel() for p in AttnNet().parameters())
    assert lr.adapted == [("AttnNet", ["q_proj", "v_proj"], 6, 6 * 2 * 8 * D,
                           own + 6 * 2 * 8 * D)]
    assert lr.optimizers == ["AdamW"]


def test_lora_equals_get_peft_model_written_by_hand_on_a_transformers_llama() -> None:
    lr = _lever_run([BY_NAME["lora"]])
    lever = run_once(llama_step(), 2, "A100-80GB", levers=lr)
    hand = run_once(llama_step(lora=True), 2, "A100-80GB")
    assert figures(lever) == figures(hand)
    assert figures(lever) != figures(run_once(llama_step(), 2, "A100-80GB"))
    cls, targets, layers, trainable, total = lr.adapted[0]
    assert (cls, targets, layers) == ("LlamaForCausalLM", ["k_proj", "o_proj", "q_proj",
                                                            "v_proj"], 8)
    # per layer: q (64 -> 64), k and v (64 -> 32: 2 of 4 heads), o (64 -> 64); A is r x in,
    # B is out x r
    assert trainable == 2 * 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))


def test_lora_on_gpt2s_conv1d_equals_get_peft_model_written_by_hand() -> None:
    """GPT-2's attention projection is one Conv1D, c_attn (its c_proj is in the MLP too)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def build(lora: bool):  # noqa: ANN202
        def b(batch: int) -> object:
            model: torch.nn.Module = GPT2LMHeadModel(
                GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)).cuda()
            if lora:
                model = peft.get_peft_model(model, peft.LoraConfig(
                    r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0,
                    fan_in_fan_out=True))
            return _lm_steps(model, batch)
        return b

    lr = _lever_run([BY_NAME["lora"]])
    lever = run_once(build(False), 2, "A100-80GB", levers=lr)
    assert figures(lever) == figures(run_once(build(True), 2, "A100-80GB"))
    # per layer: A is 8 x 64, B is 192 x 8 (q, k and v in one)
    assert lr.adapted[0][:4] == ("GPT2LMHeadModel", ["c_attn"], 2, 2 * 8 * (64 + 192))


def test_lora_with_other_levers_equals_both_written_by_hand() -> None:
    lever = run_once(attn_step(), BATCH, "A100-80GB",
                     levers=_lever_run(check_levers(["lora+activation_checkpointing"])))
    hand = run_once(attn_step(["q_proj", "v_proj"], ckpt=True), BATCH, "A100-80GB")
    assert figures(lever) == figures(hand)
    lever = run_once(llama_step(), 2, "A100-80GB",
                     levers=_lever_run(check_levers(["bf16_weights+lora"])))
    assert figures(lever) == figures(run_once(llama_step(lora=True, bf16=True), 2,
                                              "A100-80GB"))
    lever = run_once(attn_step(), BATCH, "A100-80GB",
                     levers=_lever_run(check_levers(["lora+cpu_offload_optimizer"])))
    assert figures(lever) == figures(run_once(attn_step(["q_proj", "v_proj"], host_opt=True),
                                              BATCH, "A100-80GB"))
    with pytest.raises(InvalidInputError, match="fsdp_2 and lora cannot be combined"):
        check_levers(["fsdp_2+lora"])


def test_lora_row_names_the_adapters_and_the_trainable_share() -> None:
    e = torchmem.estimate(attn_step(), gpu="A100-80GB", batch_size=BATCH, what_if=["lora"])
    row = e.what_if[0]
    assert row.skipped is None
    assert row.applied.startswith("LoRA r=8 on q_proj, v_proj (6 layers) of AttnNet: 12,288 of ")
    total = sum(p.numel() for p in AttnNet().parameters()) + 12288
    assert row.cost["trainable_share"] == round(12288 / total, 6)
    assert f"trains {12288 / total:.2%} of the parameters" in "\n".join(
        what_if_lines(e.what_if, e.what_if_best, e))
    plain = torchmem.estimate(as_written, gpu="A100-80GB", batch_size=BATCH, what_if=["lora"])
    assert "no attention projections in Net" in plain.what_if[0].skipped


def test_hf_config_train_what_if_lora_equals_the_build_written_by_hand(tmp_path, capsys) -> None:  # noqa: ANN001
    """``torchmem estimate --hf-config config.json --task train --what-if``: the levers apply to
    the model the config builds; the lora row equals that training step written by hand with
    get_peft_model (estimate_hf's train step: AdamW(lr=1e-5), labels = inputs, 2 steps)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from torchmem.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", **LLAMA}))
    code = main(["estimate", "--hf-config", str(cfg), "--task", "train", "--gpu", "A100-80GB",
                 "--batch-size", "2", "--set", "seq_len=32", "--json", "--what-if",
                 "--levers", "lora"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0
    row = d["what_if"][0]
    assert row["applied"].startswith("LoRA r=8 on k_proj, o_proj, q_proj, v_proj (8 layers) "
                                     "of LlamaForCausalLM")

    def hand(batch: int) -> object:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32)
        model.to("cuda")
        ids = torch.zeros((batch, 32), dtype=torch.long, device="cuda")
        model.train()
        model = _lora(model, ["k_proj", "o_proj", "q_proj", "v_proj"])
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    h = torchmem.estimate(hand, gpu="A100-80GB", batch_size=2, steps=2)
    assert (row["peak_requested_bytes"], row["peak_allocated_bytes"],
            row["peak_reserved_bytes"]) == (h.peak_requested_bytes, h.peak_allocated_bytes,
                                            h.peak_reserved_bytes)
    assert row["peak_reserved_bytes"] != d["peak_reserved_bytes"]  # the lever changed it
    # the inference tasks take no levers: a clear error, not a silent table
    assert main(["estimate", "--hf-config", str(cfg), "--task", "generate", "--what-if"]) == 2
    err = capsys.readouterr().err
    assert "got --hf-config with --task generate" in err and "fix: --task train" in err
    with pytest.raises(InvalidInputError, match="got task 'forward'.*fix: task='train'"):
        torchmem.estimate_hf(LLAMA | {"model_type": "llama"}, task="forward", what_if=True)


def test_best_prefers_precision_and_optimizer_levers_to_lora() -> None:
    """LoRA changes what trains: where bf16 weights or Adafactor fit too, they are the best."""
    from torchmem.fit import WhatIfRow
    from torchmem.fit.levers._whatif import best_combination

    rows = [WhatIfRow("lora", "", 10, 20, 30, True, 90), WhatIfRow("adafactor", "", 40, 50, 60,
                                                                   True, 60)]
    assert best_combination(None, None, rows).lever == "adafactor"
    assert best_combination(None, None, rows[:1]).lever == "lora"


TRAINER_SCRIPT = """
import argparse, torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
p = argparse.ArgumentParser()
p.add_argument("--per_device_train_batch_size", type=int, default=8)
p.add_argument("--gradient_accumulation_steps", type=int, default=1)
a = p.parse_args()
cfg = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=256, vocab_size=1000)
model = BertForSequenceClassification(cfg).to("cuda")
rows = [{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.tensor(0)} for _ in range(64)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=a.per_device_train_batch_size,
                         gradient_accumulation_steps=a.gradient_accumulation_steps, max_steps=4,
                         logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=rows).train()
"""


def test_accumulation_on_an_unmodified_trainer_script(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A `Trainer` script's accumulation row: its per-device batch halved and the Trainer's own
    gradient_accumulation_steps doubled, equal to the script run that way by hand."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "trainer_script.py"
    f.write_text(TRAINER_SCRIPT)
    e = torchmem.estimate_script(str(f), ["--per_device_train_batch_size", "8"], "T4",
                                 what_if=["grad_accumulation_2"])
    h = torchmem.estimate_script(str(f), ["--per_device_train_batch_size", "4",
                                          "--gradient_accumulation_steps", "2"], "T4")
    r = e.what_if[0]
    assert r.skipped is None and h.script.steps_run == 2
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert r.peak_requested_bytes < e.peak_requested_bytes


TRAINER_IN_CODE = """
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
cfg = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=256, vocab_size=1000)
model = BertForSequenceClassification(cfg).to("cuda")
rows = [{{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.tensor(0)}} for _ in range(64)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size={b},
                         gradient_accumulation_steps={k}, max_steps=4,
                         logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=rows).train()
"""


def test_accumulation_on_a_trainer_whose_batch_is_set_in_code(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """No batch option (TRL's SFTConfig(per_device_train_batch_size=8) written in the script):
    the Trainer's own batch is divided where its arguments reach it, equal to the script with
    per_device_train_batch_size=4, gradient_accumulation_steps=2 written by hand; a script
    that makes no Trainer says so in its row."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "as_written.py").write_text(TRAINER_IN_CODE.format(b=8, k=1))
    (tmp_path / "by_hand.py").write_text(TRAINER_IN_CODE.format(b=4, k=2))
    e = torchmem.estimate_script(str(tmp_path / "as_written.py"), [], "T4",
                                 what_if=["grad_accumulation_2", "grad_accumulation_4"])
    h = torchmem.estimate_script(str(tmp_path / "by_hand.py"), [], "T4")
    rows = {r.lever: r for r in e.what_if}
    r = rows["grad_accumulation_2"]
    assert r.skipped is None and h.script.steps_run == 2
    assert "per_device_train_batch_size=8 -> 4, gradient_accumulation_steps=1 -> 2" in r.applied
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert r.peak_requested_bytes < e.peak_requested_bytes
    assert "per_device_train_batch_size=8 -> 2" in rows["grad_accumulation_4"].applied
    # transformers imported, a Trainer named in a comment, none made: the row says why
    (tmp_path / "loop.py").write_text(
        "import transformers  # its Trainer is not used here\nimport torch\n"
        "m = torch.nn.Linear(64, 64).cuda()\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    m(torch.randn(8, 64, device='cuda')).sum().backward(); opt.step()\n")
    loop = torchmem.estimate_script(str(tmp_path / "loop.py"), [], "T4",
                                    what_if=["grad_accumulation_2"]).what_if[0]
    assert "made no transformers Trainer" in (loop.skipped or ""), loop


TRAINER = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=64)
model = LlamaForCausalLM(cfg)
# by hand
rows = [{"input_ids": torch.randint(0, 512, (32,)), "labels": torch.randint(0, 512, (32,))}
        for _ in range(16)]
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=4,
                         logging_steps=1, save_strategy="no", report_to="none",
                         dataloader_num_workers=0, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=rows).train()
"""


def test_lora_on_an_unmodified_trainer_equals_the_trainer_given_a_peft_model(tmp_path,
                                                                            capsys) -> None:  # noqa: ANN001
    """``torchmem estimate --what-if --levers lora train.py``: a tiny Llama trained by an
    unmodified ``Trainer.train()``; the row equals the same script with ``get_peft_model``
    written in before the Trainer is made (the four peaks: the adapters are made on the host,
    where the model is, before the Trainer moves it to the GPU)."""
    from torchmem.cli import main

    plain = tmp_path / "train.py"
    plain.write_text(TRAINER)
    hand = tmp_path / "train_lora.py"
    hand.write_text(TRAINER.replace("# by hand", (
        "from peft import LoraConfig, get_peft_model\n"
        "model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,\n"
        "    target_modules=['k_proj', 'o_proj', 'q_proj', 'v_proj']))")))
    out = str(tmp_path / "out")
    code = main(["estimate", "--gpu", "A100-80GB", "--json", "--what-if", "--levers", "lora",
                 str(plain), out])
    d = json.loads(capsys.readouterr().out)
    assert code == 0
    row = d["what_if"][0]
    from transformers import LlamaConfig, LlamaForCausalLM

    # 2 layers; per layer: q (64 -> 64), k and v (64 -> 32), o (64 -> 64), A (8 x in) + B
    # (out x 8) each
    trainable = 2 * 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))
    total = trainable + sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**LLAMA)).parameters())
    assert row["applied"] == ("LoRA r=8 on k_proj, o_proj, q_proj, v_proj (8 layers) of "
                              f"LlamaForCausalLM: {trainable:,} of {total:,} parameters trainable")
    h = torchmem.estimate_script(str(hand), [out], "A100-80GB")
    assert h.script.steps_run == 2
    assert (row["peak_requested_bytes"], row["peak_allocated_bytes"],
            row["peak_reserved_bytes"], row["cost"]["host_peak_bytes"]) == figures(h)
    assert row["peak_requested_bytes"] < d["peak_requested_bytes"]  # the lever changed it


def test_a_card_run_that_fits_after_the_pool_makes_the_step_as_written_the_answer() -> None:
    # what_if's site job: the step as written rerun on the card in the pool; where that run
    # fits (the provisional base, from the unbounded card, did not), the answer is "as
    # written" and the allocator's replays start from the card run's snapshot
    from torchmem.fit import gpu
    from torchmem.fit.levers._whatif import what_if

    card = gpu("A100-80GB")

    def run(levers, world_size=None, alloc_conf=None, snap=False):  # noqa: ANN001, ANN202
        lr = _lever_run(levers)
        return run_once(as_written, BATCH, card, levers=lr, keep_snapshot=snap,
                        alloc_conf=alloc_conf), lr

    fitting, fitting_lr = run([], snap=True)
    provisional = run_once(as_written, BATCH, card)
    provisional.fits = False  # as the unbounded card's run reads when its cache passes
    seen: list[object] = []

    def suggest(e):  # noqa: ANN001, ANN202
        seen.append(e)
        return None

    rows, best = what_if(run, provisional, fitting_lr, card, check_levers(["adafactor",
                         "allocator"]), BATCH, suggest=suggest,
                         site=lambda: (fitting, fitting_lr),
                         on_site=lambda res: res)
    assert fitting.fits and best is not None and best.lever == "as_written"
    assert best.peak_reserved_bytes == fitting.peak_reserved_bytes
    assert seen[-1] is fitting  # the allocator's row was made again from the card's run
    assert {r.lever for r in rows} == {"adafactor", "allocator"}


POOL_AFTER_OPENMP = """
import torch
from torchmem.fit.levers._pool import run_all
torch.set_num_threads(2)
x = torch.ones(1024, 1024).tril()  # a parallel region: the parent's OpenMP threads are made
sums = run_all(lambda k: int(torch.ones(1024, 1024).tril().sum()) * k, [1, 2], workers=2)
print("SUMS", sums)
"""


def test_forked_workers_after_the_parent_used_openmp_do_not_hang(tmp_path) -> None:  # noqa: ANN001
    """A script that ran a parallel CPU operator for real before the levers' workers were
    forked (TRL's collator builds its masks with ``tril`` on host tensors): each worker's
    next parallel region waited forever for the parent's OpenMP threads, which a forked
    child does not have (every lever of a TRL ``SFTTrainer`` script hung, no CPU used). The
    workers run one thread each now, and come back with the right answers."""
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(POOL_AFTER_OPENMP)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    n = 1024 * 1025 // 2  # ones on and below the diagonal
    assert f"SUMS [{n}, {2 * n}]" in out.stdout, out.stderr[-2000:]


def test_a_lever_whose_worker_dies_ends_as_a_failed_row_and_the_table_comes_back(
        monkeypatch) -> None:  # noqa: ANN001
    """A lever's run that kills its worker process (a crash in native code aborts it) ends
    that row as failed with the reason; the other levers' rows and the table still come back
    (before, the pool waited forever for the lost job)."""
    import faulthandler
    import os

    from torchmem.fit.levers import _pool

    monkeypatch.setattr(_pool, "default_workers", lambda: 2)  # forked workers, as on a GPU box

    def build(batch_size: int):
        net = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.AdamW(net.parameters())

        def step():
            if type(opt).__name__ == "Adafactor":
                faulthandler.disable()  # pytest's, which would print the abort's stack
                os.abort()
            net(torch.randn(batch_size, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        return step

    e = torchmem.estimate(build, gpu="T4", batch_size=8, what_if=["adafactor",
                                                                  "grad_accumulation_2"])
    rows = {r.lever: r for r in e.what_if}
    assert rows["adafactor"].skipped == ("failed: its worker process ended without a result "
                                         "(killed by SIGABRT)")
    r = rows["grad_accumulation_2"]
    assert r.skipped is None and r.applied.startswith("batch as 2 micro-batches")
    assert r.peak_requested_bytes > 64 * 64 * 4 * 4  # weights, gradients, two AdamW moments


AMP = """
import torch
net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                          torch.nn.Linear(1024, 256)).cuda()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
for i in range(5):
    x = torch.randn(32, 128, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = net(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
"""


def test_a_lever_that_changes_no_peak_says_so_instead_of_a_row(tmp_path) -> None:  # noqa: ANN001
    """A script already in float16 autocast with its own GradScaler: ``fp16_autocast`` leaves
    every peak as the step as written has it, so its row says "no change" and why, instead of a
    row that looks like a lever to take; the same lever on the script without autocast is a
    row with lower peaks."""
    f = tmp_path / "amp.py"
    f.write_text(AMP)
    e = torchmem.estimate_script(str(f), [], "T4", what_if=["fp16_autocast"])
    assert e.what_if[0].skipped == (
        "no change: autocast to float16 around Sequential; a GradScaler scales the loss and "
        "steps AdamW, and its peaks equal the step as written's to the byte (the step already "
        "computes in float16 where autocast would)")
    plain = tmp_path / "fp32.py"
    plain.write_text(AMP.replace('    with torch.autocast("cuda", dtype=torch.float16):\n'
                                 '        loss =', '    if True:\n        loss ='))
    p = torchmem.estimate_script(str(plain), [], "T4", what_if=["fp16_autocast"])
    r = p.what_if[0]
    assert r.skipped is None and r.peak_requested_bytes < p.peak_requested_bytes


def test_a_lever_the_script_fails_with_names_the_script_not_its_whole_command(tmp_path) -> None:  # noqa: ANN001
    """A script that fails under one lever: its row says why in a short line ("the script
    raised ...", where it raised and the message), not the command line again."""
    f = tmp_path / "train.py"
    f.write_text(SCRIPT.replace(
        "for i in range(100):",
        "if type(opt).__name__ == 'Adafactor':\n    raise ValueError('this script wants AdamW')\n"
        "for i in range(100):"))
    e = torchmem.estimate_script(str(f), ["--batch-size", "8"], "A100-80GB",
                                 what_if=["adafactor"])
    why = e.what_if[0].skipped
    assert why.startswith("the step failed with it: the script raised ValueError at "
                          f"{f}:"), why
    assert "this script wants AdamW" in why and "--batch-size" not in why
    # the pointer to TORCHMEM_DEBUG is said once under the table, not on each row
    assert "TORCHMEM_DEBUG" not in why, why
    from torchmem.fit.levers._whatif import what_if_lines

    lines = what_if_lines(e.what_if, e.what_if_best, e)
    assert sum("TORCHMEM_DEBUG=1" in line for line in lines) == 1, lines
    assert lines.index(f"    adafactor: {why}") < len(lines) - 2


def test_what_if_with_max_on_a_script_equals_the_searches_written_by_hand(tmp_path) -> None:  # noqa: ANN001
    """``--what-if`` with ``--max`` on a script: the largest batch as written equals the
    script's own ``--max`` search, and a lever's largest batch equals the search on the script
    with that change written into it (the script's --batch-size is the option searched, from
    the value it is given)."""
    long = SCRIPT.replace("torch.randn(a.batch_size, 64, 128", "torch.randn(a.batch_size, 4096, 128")
    assert long != SCRIPT
    f = tmp_path / "train.py"
    f.write_text(long)
    e = torchmem.estimate_script(str(f), ["--batch-size", "8"], "T4", what_if=["adafactor"],
                                 maximize="batch-size")
    plain = torchmem.estimate_script(str(f), ["--batch-size", "8"], "T4", maximize="batch-size")
    assert e.max_batch_size == plain.max_batch_size and plain.max_batch_size > 8
    by_hand = tmp_path / "train_adafactor.py"
    by_hand.write_text(long.replace("torch.optim.AdamW(", "torch.optim.Adafactor("))
    h = torchmem.estimate_script(str(by_hand), ["--batch-size", "8"], "T4",
                                 maximize="batch-size")
    assert e.what_if[0].cost["max_value"] == h.max_batch_size >= plain.max_batch_size


DDP_SCRIPT = """
import os, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.a = torch.nn.Linear(128, 512); self.b = torch.nn.Linear(512, 128)
    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))
ddp = int(os.environ.get("RANK", -1)) != -1       # nanoGPT's test for a torchrun launch
if ddp:
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
net = torch.nn.Sequential(*[Block() for _ in range(3)]).cuda()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
WRAP
for i in range(10):
    net(torch.randn(8, 64, 128, device="cuda")).sum().backward()
    opt.step(); opt.zero_grad()
"""


def test_sharding_levers_on_a_script_that_wraps_its_model_in_ddp(tmp_path) -> None:  # noqa: ANN001
    """nanoGPT-style: the script wraps its model in DDP when launched with ranks. Under the
    sharding levers its parameters are FSDP's DTensors before the wrap; DDP then adds no
    buckets (FSDP reduces the gradients), as with fully_shard written in place of DDP: each row
    equals the same lever on the script without the DDP wrap (before, DDP's bucket copy mixed
    plain tensors and DTensors and the row failed)."""
    wrapped = tmp_path / "ddp.py"
    wrapped.write_text(DDP_SCRIPT.replace("WRAP", "if ddp:\n    net = DDP(net)"))
    plain = tmp_path / "plain.py"
    plain.write_text(DDP_SCRIPT.replace("WRAP", ""))
    levers = ["cpu_offload", "fsdp_2"]
    a = {r.lever: r for r in torchmem.estimate_script(str(wrapped), [], "A100-40GB",
                                                       what_if=levers).what_if}
    b = {r.lever: r for r in torchmem.estimate_script(str(plain), [], "A100-40GB",
                                                       what_if=levers).what_if}
    for name in levers:
        assert a[name].skipped is None and b[name].skipped is None, (a[name], b[name])
        assert (a[name].peak_requested_bytes, a[name].peak_allocated_bytes,
                a[name].peak_reserved_bytes, a[name].cost["host_peak_bytes"]) == (
            b[name].peak_requested_bytes, b[name].peak_allocated_bytes,
            b[name].peak_reserved_bytes, b[name].cost["host_peak_bytes"])


def test_checkpointing_and_fp16_on_a_trainer_equal_its_own_options_written_by_hand(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """On an unmodified ``Trainer`` script the checkpointing and float16 rows equal the
    Trainer's own options written into its ``TrainingArguments`` by hand
    (``gradient_checkpointing=True``, ``fp16=True``), all three GPU peaks to the byte."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "trainer_script.py"
    f.write_text(TRAINER_SCRIPT)
    args = ["--per_device_train_batch_size", "8"]
    e = torchmem.estimate_script(str(f), args, "T4",
                                 what_if=["activation_checkpointing", "fp16_autocast"])
    rows = {r.lever: r for r in e.what_if}
    for lever, option in (("activation_checkpointing", "gradient_checkpointing=True"),
                          ("fp16_autocast", "fp16=True")):
        hand = tmp_path / f"{lever}.py"
        hand.write_text(TRAINER_SCRIPT.replace("max_steps=4,", f"max_steps=4, {option},"))
        h = torchmem.estimate_script(str(hand), args, "T4")
        r = rows[lever]
        assert r.skipped is None and (r.peak_requested_bytes, r.peak_allocated_bytes,
                                      r.peak_reserved_bytes) == (
            h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes), lever
        assert h.peak_requested_bytes < e.peak_requested_bytes



ACCELERATE_LOOP = """
import argparse, torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel
p = argparse.ArgumentParser()
p.add_argument("--per_device_train_batch_size", type=int, default=8)
p.add_argument("--gradient_accumulation_steps", type=int, default=1)
a = p.parse_args()
accelerator = Accelerator(gradient_accumulation_steps=a.gradient_accumulation_steps)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128))
rows = [{"input_ids": torch.randint(0, 1000, (128,))} for _ in range(64)]
dl = DataLoader(rows, batch_size=a.per_device_train_batch_size, shuffle=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, opt, dl = accelerator.prepare(model, opt, dl)
model.train()
for step, batch in enumerate(dl):
    with accelerator.accumulate(model):
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        accelerator.backward(out.loss)
        opt.step(); opt.zero_grad()
"""


def test_accumulation_on_an_accelerate_loop_multiplies_its_own_option(tmp_path) -> None:  # noqa: ANN001
    """An accelerate loop (``Accelerator(gradient_accumulation_steps=...)`` fed by the
    script's own option, run_clm_no_trainer's shape): the accumulation row halves the batch and
    doubles that option, equal to the script run so by hand, all three GPU peaks."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    f = tmp_path / "loop.py"
    f.write_text(ACCELERATE_LOOP)
    e = torchmem.estimate_script(str(f), ["--per_device_train_batch_size", "8"], "T4",
                                 what_if=["grad_accumulation_2"])
    r = e.what_if[0]
    assert r.applied.endswith("accumulated by the script: --gradient_accumulation_steps=1 -> 2")
    h = torchmem.estimate_script(str(f), ["--per_device_train_batch_size", "4",
                                          "--gradient_accumulation_steps", "2"], "T4")
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert h.peak_requested_bytes < e.peak_requested_bytes



#: the accelerate loop with accelerate's own settings written by hand (what ``accelerate launch``
#: with them gives): mixed precision and the FSDP2 plugin
ACCELERATE_BY_HAND = ACCELERATE_LOOP.replace(
    "a = p.parse_args()\n",
    "p.add_argument('--mixed_precision', default=None)\n"
    "p.add_argument('--fsdp', default='')\n"
    "a = p.parse_args()\n"
    "from accelerate.utils import FullyShardedDataParallelPlugin\n"
    "kw = {'fsdp_plugin': FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=a.fsdp == "
    "'offload')} if a.fsdp else {}\n").replace(
    "Accelerator(gradient_accumulation_steps=a.gradient_accumulation_steps)",
    "Accelerator(gradient_accumulation_steps=a.gradient_accumulation_steps, "
    "mixed_precision=a.mixed_precision, **kw)")


def test_accelerate_loop_levers_are_accelerates_own_settings(tmp_path) -> None:  # noqa: ANN001
    """run_clm_no_trainer's shape (an ``Accelerator`` of the script's own, ``prepare``, a
    shuffled data loader): ``fp16_autocast`` is accelerate's ``mixed_precision="fp16"`` (its
    autocast keeps the logits it returns in float32: 2,048,000 bytes more than torchmem's
    autocast around the model, which is what the GPU holds), ``fsdp_2`` and ``cpu_offload`` its
    FSDP2 plugin (torchmem's ``fully_shard`` before ``prepare`` made DTensor parameters that
    accelerate then handed to DDP, which refused them; and under the fake ranks accelerate's
    shuffled loader failed on the random state it broadcasts). Each row equals those settings
    written into the script by hand and estimated as rank 0 of its ranks, all three GPU peaks."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    loop, hand = tmp_path / "loop.py", tmp_path / "hand.py"
    loop.write_text(ACCELERATE_LOOP)
    hand.write_text(ACCELERATE_BY_HAND)
    e = torchmem.estimate_script(str(loop), ["--per_device_train_batch_size", "8"], "T4",
                                 what_if=["fp16_autocast", "fsdp_2", "cpu_offload"])
    rows = {r.lever: r for r in e.what_if}
    plugin = "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2"
    for lever, option, world, said in (
            ("fp16_autocast", ["--mixed_precision", "fp16"], None,
             "mixed precision by accelerate: Accelerator(mixed_precision='fp16')"),
            ("fsdp_2", ["--fsdp", "shard"], 2, f"sharded over 2 GPUs by accelerate: {plugin}))"),
            ("cpu_offload", ["--fsdp", "offload"], 1,
             f"sharded over 1 GPU by accelerate: {plugin}, cpu_offload=True))")):
        r = rows[lever]
        assert r.skipped is None, r.skipped
        assert r.applied == said
        h = torchmem.estimate_script(str(hand), option, "T4", world_size=world)
        assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
            h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes), lever


def test_accumulation_with_a_closure_step_runs_the_skipped_steps_closures() -> None:
    """A step that calls ``optimizer.step(closure)`` (the forward and backward inside the
    closure, as Lightning and LBFGS call it): under ``grad_accumulation_2`` the skipped step
    still runs its closure, so the row equals the accumulation written by hand (two closures'
    backward, then one step); before, the skipped call ran nothing."""
    def closure_step(batch_size: int, accumulate: int = 1):
        net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                  torch.nn.Linear(1024, 256)).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

        def closure():
            loss = net(torch.randn(batch_size, 256, device="cuda")).square().mean()
            loss.backward()
            return loss

        def step():
            for _ in range(accumulate - 1):
                closure()
            opt.step(closure)
            opt.zero_grad()
        return step

    e = torchmem.estimate(closure_step, gpu="T4", batch_size=64, what_if=["grad_accumulation_2"])
    r = e.what_if[0]
    h = torchmem.estimate(lambda b: closure_step(b, accumulate=2), gpu="T4", batch_size=32)
    assert r.skipped is None
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)


@pytest.mark.parametrize(("lever", "option", "applied", "needs"), [
    ("adafactor", "adafactor", "AdamW -> the Trainer's optim='adafactor' (transformers' Adafactor)",
     "transformers"),
    ("optimizer_8bit", "adamw_bnb_8bit",
     "AdamW -> the Trainer's optim='adamw_bnb_8bit' (bitsandbytes' 8-bit AdamW)", "bitsandbytes"),
])
def test_optimizer_levers_on_a_trainer_are_its_own_optim_option(  # noqa: PLR0913
        tmp_path, monkeypatch, lever, option, applied, needs) -> None:  # noqa: ANN001
    """On an unmodified ``Trainer`` script the ``adafactor`` row is the Trainer's own
    ``optim="adafactor"`` (transformers' Adafactor, not torch's), and with bitsandbytes
    installed the ``optimizer_8bit`` row is its own ``optim="adamw_bnb_8bit"`` (bitsandbytes'
    8-bit AdamW, run under the estimate): each equal to that option written into its
    ``TrainingArguments`` by hand, all three GPU peaks, with less optimizer state than AdamW's."""
    pytest.importorskip("transformers")
    pytest.importorskip(needs)
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "trainer_script.py"
    f.write_text(TRAINER_SCRIPT)
    args = ["--per_device_train_batch_size", "8"]
    e = torchmem.estimate_script(str(f), args, "T4", what_if=[lever])
    r = e.what_if[0]
    assert r.applied == applied
    hand = tmp_path / "hand.py"
    hand.write_text(TRAINER_SCRIPT.replace("max_steps=4,", f"max_steps=4, optim='{option}',"))
    h = torchmem.estimate_script(str(hand), args, "T4")
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)
    assert h.by_category["optimizer_state"] < e.by_category["optimizer_state"]


GPT2_TRAINER = """
import argparse, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
p = argparse.ArgumentParser()
p.add_argument("--fsdp", default="")
a = p.parse_args()
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                   n_positions=128)).to("cuda")
rows = [{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.randint(0, 1000, (64,))}
        for _ in range(64)]
kw = dict(fsdp=True, fsdp_config={"cpu_offload": True} if "offload" in a.fsdp else {}) if a.fsdp else {}
args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, max_steps=4,
                         report_to=[], save_strategy="no", disable_tqdm=True, **kw)
Trainer(model=model, args=args, train_dataset=rows).train()
"""


def test_sharding_levers_on_a_trainer_are_its_own_fsdp_option(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """On an unmodified ``Trainer`` script (run_clm's shape: GPT-2) the sharding rows are the
    Trainer's own FSDP (``fsdp=True``: FSDP2 through accelerate's preparation), not torchmem's
    ``fully_shard`` on a model the Trainer then hands to DDP (which refused its DTensors):
    ``fsdp_2`` equals ``fsdp=True`` written by hand and estimated as rank 0 of 2, and
    ``cpu_offload`` equals ``fsdp_config={"cpu_offload": True}`` on one GPU, all three GPU
    peaks and the host peak to the byte; sharding lowers the requested peak."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "trainer_script.py"
    f.write_text(GPT2_TRAINER)
    e = torchmem.estimate_script(str(f), [], "T4", what_if=["fsdp_2", "cpu_offload"])
    rows = {r.lever: r for r in e.what_if}
    for lever, option, world in (("fsdp_2", "full_shard", 2), ("cpu_offload", "offload", 1)):
        r = rows[lever]
        assert r.skipped is None, r.skipped
        assert "by the Trainer: fsdp=True" in (r.applied or "")
        h = torchmem.estimate_script(str(f), ["--fsdp", option], "T4", world_size=world)
        assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes,
                r.cost["host_peak_bytes"]) == (
            h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes,
            h.host_peak_bytes), lever
        assert r.peak_requested_bytes < e.peak_requested_bytes


def test_a_sharding_row_the_script_refuses_gives_the_scripts_own_error(tmp_path) -> None:  # noqa: ANN001
    """nanoGPT's torchrun path: launched with ranks (``RANK`` set, as the sharding levers run
    it), the script asserts that its accumulation divides the world size before it puts
    anything on the GPU (having made a host tensor). The row gives that assertion, where the
    script made it, not "put nothing on the GPU" (the same script without the lever runs and
    fits)."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, torch\n"
        "gradient_accumulation_steps = 1\n"
        "seeds = torch.zeros(4)  # a host tensor before the check\n"
        "if int(os.environ.get('RANK', -1)) != -1:\n"
        "    ddp_world_size = int(os.environ['WORLD_SIZE'])\n"
        "    assert gradient_accumulation_steps % ddp_world_size == 0\n"
        "net = torch.nn.Linear(64, 64, device='cuda')\n"
        "opt = torch.optim.AdamW(net.parameters())\n"
        "for _ in range(2):\n"
        "    net(torch.randn(8, 64, device='cuda')).sum().backward()\n"
        "    opt.step(); opt.zero_grad()\n")
    e = torchmem.estimate_script(str(script), [], "T4", what_if=["fsdp_2"])
    assert e.fits and e.script.steps_run == 2
    why = e.what_if[0].skipped or ""
    assert why.startswith("the step failed with it: the script raised AssertionError at "
                          f"{script}:6 (assert gradient_accumulation_steps % ddp_world_size "
                          "== 0)"), why
    assert "nothing on the GPU" not in why.replace("before it put anything on the GPU", "")


HF_PARSER_TRAINER = """
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer,
                          TrainingArguments)
(args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                   n_positions=128))
rows = [{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.randint(0, 1000, (64,))}
        for _ in range(64)]
Trainer(model=model, args=args, train_dataset=rows).train()
"""


def test_trainer_levers_are_its_own_command_line_options(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """run_clm's shape (``HfArgumentParser`` reads ``TrainingArguments`` from the command
    line; the model made on the host, the Trainer moves it): accumulation, float16 autocast,
    activation checkpointing and Adafactor are the Trainer's own options, each row equal to the
    option written on the command line by hand (``--per_device_train_batch_size 4
    --gradient_accumulation_steps 2``, ``--fp16``, ``--gradient_checkpointing``, ``--optim
    adafactor``), all three GPU peaks to the byte, and saying so."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "clm_script.py"
    f.write_text(HF_PARSER_TRAINER)
    base = ["--output_dir", "out", "--max_steps", "4", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true"]
    e = torchmem.estimate_script(
        str(f), [*base, "--per_device_train_batch_size", "8"], "T4",
        what_if=["grad_accumulation_2", "fp16_autocast", "activation_checkpointing",
                 "adafactor", "optimizer_fused"])
    rows = {r.lever: r for r in e.what_if}
    # the Trainer's default optimizer on a GPU is already fused AdamW (adamw_torch_fused); its
    # host peak in a forked worker is 144 bytes below the first run's (something transformers
    # makes once per process), which must not turn "no change" into a row
    import transformers

    default = transformers.TrainingArguments(output_dir="out").optim
    if getattr(default, "value", default) == "adamw_torch_fused":  # its default with torch 2.8+
        assert rows["optimizer_fused"].skipped == (
            "no change: the step already makes AdamW(fused=True), and its GPU peaks equal the "
            "step as written's to the byte"), rows["optimizer_fused"]

    checkpointing = ("activation_checkpointing" if int(transformers.__version__.split(".")[0]) >= 5
                     else "gradient_checkpointing")
    by_hand = {
        "grad_accumulation_2": (["--per_device_train_batch_size", "4",
                                 "--gradient_accumulation_steps", "2"],
                                "batch as 2 micro-batches, accumulated by the Trainer: "
                                "gradient_accumulation_steps=1 -> 2"),
        "fp16_autocast": (["--fp16"], "mixed precision by the Trainer: fp16=True"),
        "activation_checkpointing": (["--gradient_checkpointing"],
                                     f"checkpointed by the Trainer: {checkpointing}=True"),
        "adafactor": (["--optim", "adafactor"],
                      "AdamW -> the Trainer's optim='adafactor' (transformers' Adafactor)"),
    }
    for lever, (option, said) in by_hand.items():
        r = rows[lever]
        assert r.skipped is None, r.skipped
        assert r.applied == said, lever
        batch = [] if "--per_device_train_batch_size" in option else [
            "--per_device_train_batch_size", "8"]
        h = torchmem.estimate_script(str(f), [*base, *batch, *option], "T4")
        assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
            h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes), lever


class _SelfCheckpointed(torch.nn.Module):
    """Four blocks the model checkpoints itself (as TRL's ``SFTConfig`` has the Trainer do by
    default)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return x


def test_checkpointing_a_step_that_checkpoints_already_says_no_change() -> None:
    """A step whose blocks are checkpointed already: the lever's row equals the step as
    written on every GPU peak, so it says "no change" (a TRL ``SFTTrainer`` script showed it
    as a lever to take); the same blocks unchecked take the lever as a real row."""
    def build(checkpointed: bool):
        def make(batch_size: int):
            net = (_SelfCheckpointed() if checkpointed else
                   torch.nn.Sequential(*_SelfCheckpointed().blocks)).cuda()
            opt = torch.optim.AdamW(net.parameters())
            x = torch.randn(batch_size, 256, device="cuda")

            def step() -> None:
                net(x).sum().backward()
                opt.step()
                opt.zero_grad()
            return step
        return make

    e = torchmem.estimate(build(True), gpu="T4", batch_size=512,
                          what_if=["activation_checkpointing"])
    assert e.what_if[0].skipped == (
        "no change: checkpointed 4 blocks: blocks.0, blocks.1, blocks.2 (+1 more), and its GPU "
        "peaks equal the step as written's to the byte (the step checkpoints them already, or "
        "its peaks are outside their forward and backward)")
    plain = torchmem.estimate(build(False), gpu="T4", batch_size=512,
                              what_if=["activation_checkpointing"])
    r = plain.what_if[0]
    assert r.skipped is None and r.peak_allocated_bytes < plain.peak_allocated_bytes
    assert r.peak_allocated_bytes == e.peak_allocated_bytes  # checkpointed either way


SCHEDULED = """
import torch
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                        torch.nn.Linear(256, 256)).cuda()
opt = torch.optim.AdamW(m.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # wraps opt.step, reads __func__
for _ in range(4):
    m(torch.randn(32, 256, device="cuda")).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
"""


def test_levers_that_wrap_the_optimizers_step_leave_a_scheduler_working(tmp_path) -> None:  # noqa: ANN001
    """fp16's gradient scaler and the host offload replace ``opt.step``; a learning-rate
    scheduler made after the optimizer wraps it through ``opt.step.__func__`` (transformers'
    run_clm_no_trainer.py failed there with both levers): the replacements are bound methods."""
    f = tmp_path / "scheduled.py"
    f.write_text(SCHEDULED)
    e = torchmem.estimate_script(str(f), [], "T4",
                                 what_if=["fp16_autocast", "cpu_offload_optimizer"])
    rows = {r.lever: r for r in e.what_if}
    assert all(r.skipped is None for r in rows.values()), rows
    # AdamW's two fp32 states of the 2 x (256 x 256 + 256) parameters leave the GPU
    states = 2 * 2 * (256 * 256 + 256) * 4
    off = rows["cpu_offload_optimizer"]
    assert off.peak_requested_bytes is not None
    assert e.peak_requested_bytes - off.peak_requested_bytes >= states
