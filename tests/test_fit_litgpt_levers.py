"""The levers on a program shaped like litgpt's command line (issue 42): ``python -m litgpt
finetune_full CKPT --devices 1 ...``, a package whose commands build a Lightning ``Fabric``,
shard over ``--devices N`` themselves, load the checkpoint after ``setup_module`` and train
LoRA adapters in their own ``finetune_lora`` command. Each lever is the program's own option,
equal to that command written by hand; litgpt itself (not a test dependency) was run the same
way by hand (see the closing notes)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torchmem

pytest.importorskip("lightning")

MAIN = '''
import sys, torch
import lightning as L
from lightning.fabric.strategies import FSDPStrategy
from litgpt.args import iterations

command, args = sys.argv[1], sys.argv[2:]
def option(name, default):
    return int(args[args.index(name) + 1]) if name in args else default
devices, rank, micro = option("--devices", 1), option("--lora_r", 8), option("--micro", 4)
iters = iterations(global_batch=8, devices=devices, micro=micro)

class LoRALinear(torch.nn.Linear):
    def __init__(self, n, m, r):
        super().__init__(n, m)
        self.lora_A = torch.nn.Parameter(torch.zeros(r, n))
        self.lora_B = torch.nn.Parameter(torch.zeros(m, r))
    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.T) @ self.lora_B.T

class Attention(torch.nn.Module):
    def __init__(self, lora):
        super().__init__()
        self.qkv = LoRALinear(256, 768, rank) if lora else torch.nn.Linear(256, 768)
        self.proj = torch.nn.Linear(256, 256)
    def forward(self, x):
        q, k, v = self.qkv(x).split(256, dim=-1)
        return self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v))

class Block(torch.nn.Module):
    def __init__(self, lora):
        super().__init__()
        self.attn = Attention(lora)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                       torch.nn.Linear(1024, 256))
    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)

lora = command == "finetune_lora"
strategy = FSDPStrategy(auto_wrap_policy={Block}) if devices > 1 else "auto"
fabric = L.Fabric(devices=devices, strategy=strategy, precision="bf16-true")
fabric.launch()
with fabric.rank_zero_first():
    data = torch.randn(micro, 64, 256)
with fabric.init_module(empty_init=devices > 1):
    model = torch.nn.Sequential(*[Block(lora) for _ in range(4)])
if lora:
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
model = fabric.setup_module(model)
opt = fabric.setup_optimizers(torch.optim.AdamW(
    [p for p in model.parameters() if p.requires_grad], lr=1e-4))
# the checkpoint, loaded after setup as litgpt loads it (full-model keys, strict=False)
fabric.load_raw("ckpt.pth", model, strict=False)
for step in range(2):
    for _ in range(iters):
        fabric.backward(model(data.to(fabric.device)).float().pow(2).mean() / iters)
    opt.step()
    opt.zero_grad()
'''

ARGS = '''
def iterations(global_batch, devices, micro):
    iters = global_batch // (devices * micro)
    assert iters > 0
    return iters
'''


@pytest.fixture
def litgpt_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    pkg = tmp_path / "litgpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(MAIN)
    (pkg / "args.py").write_text(ARGS)
    torch.save(torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(256, 256)) for _ in range(1)]).state_dict(), tmp_path / "ckpt.pth")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "litgpt" or m.startswith("litgpt.")]:
        monkeypatch.delitem(sys.modules, name)
    yield pkg
    # the stand-in imported by the test goes too: a later test's `import litgpt` (the real
    # package, or its absence) must not find it
    for name in [m for m in sys.modules if m == "litgpt" or m.startswith("litgpt.")]:
        del sys.modules[name]


def _peaks(e: object) -> tuple[int, int, int]:
    return (e.peak_requested_bytes, e.peak_allocated_bytes,  # type: ignore[attr-defined]
            e.peak_reserved_bytes)  # type: ignore[attr-defined]


def test_litgpt_levers_are_its_own_devices_and_lora_command(litgpt_shape: Path) -> None:
    """``fsdp_2`` is the program's ``--devices 1 -> 2`` (its own FSDP around every block),
    ``lora`` its ``finetune_lora --lora_r 8`` (peft's adapters on the model, made before the
    program loaded its checkpoint, failed that load), each equal to the command written by
    hand and estimated as rank 0 of its ranks, all three peaks to the byte. ``fsdp_4``: the
    program's own assertion that its global batch covers the devices, named where it is (in
    the package's ``args.py``, not its ``__main__``)."""
    args = ["finetune_full", "ckpt", "--devices", "1"]
    e = torchmem.estimate_script("litgpt", args, "T4", module=True,
                                 what_if=["fsdp_2", "fsdp_4", "lora"])
    rows = {r.lever: r for r in e.what_if}
    fsdp = rows["fsdp_2"]
    assert fsdp.skipped is None, fsdp.skipped
    assert fsdp.applied == "sharded over 2 GPUs by the program: --devices 1 -> 2"
    by_hand = torchmem.estimate_script("litgpt", ["finetune_full", "ckpt", "--devices", "2"],
                                       "T4", module=True, world_size=2)
    assert _peaks(fsdp) == _peaks(by_hand)
    # rank 0 holds half of every block's flat parameters (bf16: 2 bytes each)
    block = 256 * 768 + 768 + 256 * 256 + 256 + 256 * 1024 + 1024 + 1024 * 256 + 256
    assert by_hand.model_state["parameter"] == 4 * block * 2 // 2

    lora = rows["lora"]
    assert lora.skipped is None, lora.skipped
    trainable = 4 * 8 * (256 + 768)
    assert lora.applied == (
        "LoRA r=8 by the program: finetune_full -> finetune_lora --lora_r 8 (4 layers of "
        f"_FabricModule): {trainable:,} of {4 * block + trainable:,} parameters trainable")
    lora_by_hand = torchmem.estimate_script(
        "litgpt", ["finetune_lora", "ckpt", "--devices", "1", "--lora_r", "8"], "T4",
        module=True)
    assert _peaks(lora) == _peaks(lora_by_hand)
    assert lora.peak_requested_bytes < e.peak_requested_bytes
    adapter = torchmem.estimate_script("litgpt", ["finetune_adapter", "ckpt", "--devices", "1"],
                                       "T4", module=True, what_if=["lora"]).what_if[0]
    assert (adapter.applied or "").startswith(
        "LoRA r=8 by the program: finetune_adapter -> finetune_lora --lora_r 8"), adapter
    assert _peaks(adapter) == _peaks(lora_by_hand)

    why = rows["fsdp_4"].skipped or ""
    assert why.startswith(
        "the step failed with it: the script raised AssertionError at "
        f"{litgpt_shape / 'args.py'}:4 (assert iters > 0)"), why


def test_lora_lever_on_a_program_that_already_trains_adapters_says_so(litgpt_shape: Path) -> None:
    """On ``finetune_lora`` the model trains its LoRA adapters only: the lever changes
    nothing, and says so with the counts (not "no attention projections")."""
    e = torchmem.estimate_script("litgpt", ["finetune_lora", "ckpt"], "T4", module=True,
                                 what_if=["lora"])
    block = 256 * 768 + 768 + 256 * 256 + 256 + 256 * 1024 + 1024 + 1024 * 256 + 256
    trainable = 4 * 8 * (256 + 768)
    assert e.what_if[0].skipped == (
        "no change: _FabricModule already trains LoRA adapters only "
        f"({trainable:,} of {4 * block + trainable:,} parameters)")
