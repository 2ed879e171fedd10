"""Repeated calls replayed into the simulator (``torchmem.fit.run._repeat``): every estimate
equals the one that runs each call of the model (``replay_repeats=False``), to the byte."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchmem.fit.run import _repeat
from torchmem.fit.run._engine import run_once
from torchmem.fit.verdict._catalog import gpu as catalog_gpu

VOCAB, SEQ, STEPS, EVALS, MICRO = 1000, 64, 3, 6, 6


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.drop(self.att(h, h, h, need_weights=False)[0])
        return x + self.mlp(x)


class _GPT(nn.Module):
    """nanoGPT's shape: the loss inside forward when targets are given (``inside``)."""

    def __init__(self, inside: bool, d: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.inside = inside

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor | None = None) -> object:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        if tgt is not None and self.inside:
            return logits, F.cross_entropy(logits.view(-1, VOCAB), tgt.view(-1))
        return logits


def _build(kind: str):  # noqa: ANN202 - a build function
    """A training loop shaped like nanoGPT's: evaluation forwards under no_grad, then MICRO
    accumulation micro-steps (the next batch fetched while the graph is alive), AdamW."""

    def build(batch: int):  # noqa: ANN202
        model = _GPT(inside=kind != "outside").to("cuda")
        opt = torch.optim.AdamW(model.parameters(), fused=kind == "fused")
        scaler = torch.amp.GradScaler("cuda", enabled=kind == "amp")
        kept: list[torch.Tensor] = []

        def get() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, VOCAB, (batch, SEQ)).to("cuda", non_blocking=True)
            return x, torch.randint(0, VOCAB, (batch, SEQ)).to("cuda")

        X, Y = get()

        def step() -> None:
            nonlocal X, Y
            model.eval()
            with torch.no_grad():
                for _ in range(EVALS):
                    a, b = get()
                    model(a, b)
            model.train()
            for _ in range(MICRO):
                with torch.autocast("cuda", torch.float16, enabled=kind == "amp"):
                    if kind == "outside":  # the loss outside: its gradient arrives
                        loss = F.cross_entropy(model(X).view(-1, VOCAB), Y.view(-1))
                    else:
                        _, loss = model(X, Y)
                    loss = loss / MICRO
                X, Y = get()  # the inputs now live on only in the graph (embedding saves them)
                scaler.scale(loss).backward()
                if kind == "grow":  # something kept per micro-step: memory grows in replays
                    kept.append(torch.empty(1 << 18, device="cuda"))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        return step

    return build


_FIELDS = ("fits", "peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
           "by_category", "by_module", "workspace_bytes", "host_peak_bytes",
           "fragmentation_bytes", "assumed_values", "notes", "attention_kernel")


def _same(fast: object, full: object) -> None:
    for f in _FIELDS:
        assert getattr(fast, f) == getattr(full, f), f


# Calls replayed in STEPS=3 steps, counted by hand: a call is replayed once the two calls
# before it with the same signature did the same. Evaluations: step 1's first call differs
# (cuBLAS's workspace), calls 2 and 3 agree, so 4-6 replay (3), and all 6 of steps 2 and 3.
# Micro-steps: the first of each step finds no gradients (after zero_grad(set_to_none=True))
# and is its own signature, never twice the same (step 1's makes the backward's cuBLAS
# workspace); the others: step 1 records 2 and 3 and replays 4-6 (3), steps 2 and 3 replay
# all 5. 3 + 3 + (6 + 5) * 2 = 28.
_REPLAYED = 28


@pytest.mark.parametrize("kind", ["plain", "outside", "amp", "fused"])
def test_replayed_calls_give_the_full_runs_estimate(kind: str) -> None:
    fast = run_once(_build(kind), 16, "T4", steps=STEPS)
    full = run_once(_build(kind), 16, "T4", steps=STEPS, replay_repeats=False)
    assert full.calls_replayed == 0
    assert fast.calls_replayed == _REPLAYED
    _same(fast, full)
    n = sum(p.numel() for p in _GPT(True).parameters())
    # the weights, their gradients and AdamW's two states (fp32), with the logits beside
    assert fast.peak_requested_bytes > 4 * 4 * n + 16 * SEQ * VOCAB * 4


def test_an_out_of_memory_point_inside_a_replayed_call_is_the_full_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that keeps 1 MiB per micro-step: its replayed calls need new segments, and
    the card is sized so that one of them runs out of memory (the run stops there)."""
    sites: list[bool] = []
    site = _repeat.RepeatedCalls._site

    def spy(self: _repeat.RepeatedCalls, w: object, h: int) -> None:
        sites.append(True)
        site(self, w, h)  # type: ignore[arg-type]

    monkeypatch.setattr(_repeat.RepeatedCalls, "_site", spy)
    t4 = catalog_gpu("T4")
    full_peak = run_once(_build("grow"), 16, t4, steps=STEPS,
                         replay_repeats=False).peak_reserved_bytes
    card = dataclasses.replace(t4, total_bytes=t4.context_bytes + full_peak - 10 * 2**20)
    fast = run_once(_build("grow"), 16, card, steps=STEPS)
    full = run_once(_build("grow"), 16, card, steps=STEPS, replay_repeats=False)
    assert not fast.fits and fast.oom is not None and full.oom is not None
    assert 0 < fast.calls_replayed < _REPLAYED  # stopped inside the replays
    _same(fast, full)
    a, b = fast.oom.to_dict(), full.oom.to_dict()
    for key in ("requested_bytes", "op", "module", "phase", "allocated_bytes",
                "reserved_bytes", "message"):
        assert a[key] == b[key], key
    def below_test(stack: list[str]) -> list[str]:  # the frames below this test's own line
        i = next(i for i, f in enumerate(stack) if f.endswith(":" + name))
        return stack[i + 1:]

    name = "test_an_out_of_memory_point_inside_a_replayed_call_is_the_full_runs"
    assert below_test(a["stack"]) == below_test(b["stack"]) != []
    assert a["phase"] == "backward" and a["op"].startswith("aten::")
    assert sites == [True]  # the allocation that failed was a replayed one (in its backward)


def test_calls_that_keep_state_or_drop_their_graph_are_run() -> None:
    """A forward that caches a tensor on its module, and forwards whose graphs are dropped
    without a backward: nothing to replay; the estimate is the full run's."""

    class Caching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 256)
            self.cache: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.cache.append(y * 2)  # kept by the module: not one of its outputs
            return y

    def build(batch: int):  # noqa: ANN202
        cached, plain = Caching().to("cuda"), nn.Linear(256, 256).to("cuda")
        x = torch.randn(batch, 256, device="cuda")

        def step() -> None:
            for _ in range(6):
                with torch.no_grad():
                    cached(x)
                plain(x)  # grad enabled, no backward: each graph is dropped
        return step

    fast = run_once(build, 64, "T4", steps=2)
    full = run_once(build, 64, "T4", steps=2, replay_repeats=False)
    assert fast.calls_replayed == 0
    _same(fast, full)
    assert full.peak_requested_bytes >= 12 * 64 * 256 * 4  # the 12 cached tensors


def test_a_hooked_submodule_is_not_replayed() -> None:
    """A forward hook on a submodule would not run in a replay: such calls run."""
    seen: list[int] = []

    def build(batch: int):  # noqa: ANN202
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).to("cuda")
        model[0].register_forward_hook(lambda m, i, o: seen.append(1))
        x = torch.randn(batch, 64, device="cuda")

        def step() -> None:
            for _ in range(5):
                model(x).sum().backward()
        return step

    e = run_once(build, 8, "T4", steps=1)
    assert e.calls_replayed == 0 and len(seen) == 5


def test_the_cli_replays_a_scripts_calls_and_no_replay_runs_them(tmp_path: object) -> None:
    script = os.path.join(str(tmp_path), "acc.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent("""
            import torch
            model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                        torch.nn.Linear(2048, 512)).cuda()
            opt = torch.optim.AdamW(model.parameters())
            for it in range(3):
                for micro in range(8):
                    x = torch.randn(32, 512, device="cuda")
                    (model(x).square().mean() / 8).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        """))
    out = {}
    for flag in ([], ["--no-replay"]):
        r = subprocess.run([sys.executable, "-m", "torchmem", "estimate", "--json", *flag,
                            "--gpu", "T4", script], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        out[bool(flag)] = json.loads(r.stdout)
    fast, full = out[False], out[True]
    # two optimizer steps of 8 micro-steps: step 1 records 1 (no gradients), 2 and 3, and
    # replays 4-8; step 2 records its first (no gradients) and replays 2-8
    assert fast["calls_replayed"] == 5 + 7 and "calls_replayed" not in full
    for key in ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                "by_category", "by_module"):
        assert fast[key] == full[key], key
    text = subprocess.run([sys.executable, "-m", "torchmem", "estimate", "--gpu", "T4", script],
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "repeated calls: 12 model calls repeated earlier ones and were replayed" in text.stdout


@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_evaluation_calls_are_replayed_per_rank_too(plan: str) -> None:
    """Under the fake ranks (rank 0 of 2): FSDP2's all-gathers in the evaluation forwards (its
    hooks are in the record) and DDP's; training calls run (their backward reduces)."""
    from torch.distributed.fsdp import fully_shard

    def build(batch: int):  # noqa: ANN202
        model: nn.Module = _GPT(inside=True).to("cuda")
        if plan == "fsdp":
            for b in model.blocks:  # type: ignore[union-attr]
                fully_shard(b)
            fully_shard(model)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")

        def step() -> None:
            with torch.no_grad():
                for _ in range(EVALS):
                    model(x, x)
            for _ in range(4):
                (model(x, x)[1] / 4).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    fast = run_once(build, 8, "T4", steps=STEPS, world_size=2)
    full = run_once(build, 8, "T4", steps=STEPS, world_size=2, replay_repeats=False)
    # the evaluations: step 1 replays 4-6 (its first call makes cuBLAS's workspace), steps 2
    # and 3 all six under DDP; under FSDP2 the first evaluation after a backward finds the
    # root's unsharded parameters still registered (a signature of its own) and runs: five.
    # No training call (their backward reduces).
    assert fast.calls_replayed == 3 + 2 * (EVALS if plan == "ddp" else EVALS - 1)
    _same(fast, full)
    assert fast.collectives == full.collectives and fast.collectives
    assert fast.model_state == full.model_state
