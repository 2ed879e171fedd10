"""How fast can an estimate step be? One GPT-2 124M training step timed three ways, side by side
in one process: on the meta device (PyTorch's own shape functions, no tensor subclass), under a
bare ``FakeTensorMode`` (what every fake-tensor tool pays), and inside ``torchmem.estimate`` (the
fake GPU, the tracker and the simulated caching allocator on top). The ratios say how much of an
estimate's time is torchmem's and what even a free estimator would still spend per step: why a
script that repeats its step hundreds of times (nanoGPT: 400 evaluation forwards and 80
micro-steps) needs repeated iterations skipped, not only a faster operator path.

Workload: transformers' ``GPT2LMHeadModel`` at GPT-2 124M (12 layers, 768 wide, vocabulary 50257),
batch 12 x 1024 tokens (nanoGPT's defaults), forward with labels and backward (no optimizer);
``--smoke``: 1 layer, 64 wide, batch 2 x 32 (checks that it runs; the figures mean nothing).
Each method: one warm-up step, then the mean of ``--steps`` steps.

Run:  python benchmarks/bench_estimate_floor.py            (about 1 minute on our 2 cores)
      python benchmarks/bench_estimate_floor.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch


def _config(smoke: bool) -> tuple[Any, int, int]:
    from transformers import GPT2Config

    if smoke:
        return GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=32), 2, 32
    return GPT2Config(), 12, 1024


def _timed(step: Callable[[], None], steps: int) -> float:
    step()  # warm-up: first-call caches (FakeTensor's dispatch cache, lazy imports)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def _plain(device: str, mode: Any, smoke: bool, steps: int) -> float:
    from transformers import GPT2LMHeadModel

    cfg, batch, seq = _config(smoke)
    with mode or contextlib.nullcontext():
        with torch.device(device):
            model = GPT2LMHeadModel(cfg)
            ids = torch.zeros(batch, seq, dtype=torch.long)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        return _timed(step, steps)


def _torchmem(smoke: bool, steps: int) -> float:
    import torchmem

    times: list[float] = []

    def build(batch_size: int) -> Callable[[], None]:
        from transformers import GPT2LMHeadModel

        cfg, batch, seq = _config(smoke)
        model = GPT2LMHeadModel(cfg).cuda()
        ids = torch.zeros(batch, seq, dtype=torch.long, device="cuda")

        def step() -> None:
            t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - t)
        return step

    torchmem.estimate(build, gpu="A100-40GB", batch_size=1, steps=steps + 1, margin=0)
    return sum(times[1:]) / max(1, len(times) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT-2 (tests: it runs)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per method (default 3)")
    a = ap.parse_args()
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = _plain("meta", None, a.smoke, a.steps)
    fake = _plain("cpu", FakeTensorMode(), a.smoke, a.steps)
    ours = _torchmem(a.smoke, a.steps)
    print(f"GPT-2 {'smoke' if a.smoke else '124M'} forward+backward, mean of {a.steps} steps")
    print(f"{'method':<22}{'s/step':>10}{'x meta':>10}")
    for name, t in (("meta device", meta), ("FakeTensorMode", fake), ("torchmem.estimate", ours)):
        print(f"{name:<22}{t:>10.3f}{t / meta:>10.2f}")
    print(f"torchmem / FakeTensorMode: {ours / fake:.2f}x")


if __name__ == "__main__":
    main()
