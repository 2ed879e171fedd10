"""Estimates of two real GPU runs (../shared/data/gpu-truth.md), made on this CPU-only machine,
side by side with the real allocator's figures and with a fake run that does not follow CUDA.

Workloads (tests/cs336_lm.py, the CS336 Transformer LM as gpu-truth.md describes it):
  notHanmin  "xl" LM (2.0 B parameters), batch 4 x 256, hand-written AdamW; per step a
             bf16-autocast forward, logits.sum(), zero_grad, backward, step; 2 steps: the
             peak is the second step's forward (the recorded window). A100-80GB (sm80).
  MAGMA27    the small LM (129 M parameters), fp32, batch 32 x 256, hand-written
             cross-entropy, forward/loss/backward without zero_grad; 6 steps. RTX-3090
             (sm86, pre-Hopper like the recording's GPU).

Columns:
  real        the recorded allocator (gpu-truth.md; a trace's sizes are requested bytes)
  torchmem    torchmem.estimate with the CUDA emulation (torchmem.fit.fakegpu.kernels.CudaEmulation)
  plain fake  the same fake run without it: torch.autocast("cuda") switches itself off on a
              CPU-only build, so the forward runs in fp32 (what a FakeTensorMode-based tracker
              sees); no reduction scratch, per-parameter optimizer loop

Requested figures include the two cuBLAS workspaces (allocator blocks in the real run; the
estimate reports them separately). Both columns run torchmem.estimate's engine (which, like the
GPU, runs the gather/max backward scatters in place); "plain fake" only turns the CUDA emulation
off, so it misses the bf16 autocast policy (notHanmin) and the reductions' staging buffers
(MAGMA27). tests/test_gpu_truth.py checks every phase separately.

Run:  python benchmarks/gpu_truth.py        (a few minutes on our 2 cores)
      python benchmarks/gpu_truth.py --runs MAGMA27 --steps 1 --batch 1   (a smoke run: fewer
            steps or a smaller batch than the recording, so its ratios to "real" mean nothing)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torchmem
import torchmem.fit.run._engine as engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cs336_lm import build_magma27, build_nothanmin  # noqa: E402

REAL = {
    "notHanmin": {"requested": 43_754_773_506, "allocated": 44_634_833_408},
    "MAGMA27": {"requested": 13_923_997_700, "allocated": 13_927_832_064},
}


def run(build: Any, gpu: str, batch: int, steps: int, emulate: bool) -> tuple[int, int, float]:
    original = engine._emulation
    if not emulate:
        engine._emulation = lambda cc: None  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        est = torchmem.estimate(build, gpu=gpu, batch_size=batch, steps=steps)
        elapsed = time.perf_counter() - t
    finally:
        engine._emulation = original  # type: ignore[assignment]
    return est.peak_requested_bytes + est.workspace_bytes, est.peak_allocated_bytes, elapsed


def main() -> None:
    rows = [
        ("notHanmin", build_nothanmin, "A100-80GB", 4, 2),
        ("MAGMA27", build_magma27, "RTX-3090", 32, 6),
    ]
    names = [r[0] for r in rows]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(names),
                    help=f"comma-separated, of {', '.join(names)} (default both)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps of each run (default: the recording's; fewer: a smoke run)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch of each run (default: the recording's; smaller: a smoke run)")
    args = ap.parse_args()
    wanted = [r for r in args.runs.split(",") if r]
    if unknown := [r for r in wanted if r not in names]:
        ap.error(f"unknown run(s) {unknown}; the runs are {', '.join(names)}")
    rows = [(name, build, gpu, args.batch or batch, args.steps or steps)
            for name, build, gpu, batch, steps in rows if name in wanted]
    if args.steps is not None or args.batch is not None:
        print("smoke run: not the recorded steps and batch, so the ratios to 'real' mean nothing")
    print(f"{'run':<10} {'figure':<10} {'real':>16} {'torchmem':>16} {'ratio':>7} "
          f"{'plain fake':>16} {'ratio':>7}")
    for name, build, gpu, batch, steps in rows:
        ours = run(build, gpu, batch, steps, emulate=True)
        plain = run(build, gpu, batch, steps, emulate=False)
        for i, fig in enumerate(("requested", "allocated")):
            real = REAL[name][fig]
            print(f"{name:<10} {fig:<10} {real:>16,} {ours[i]:>16,} {ours[i] / real:>7.4f} "
                  f"{plain[i]:>16,} {plain[i] / real:>7.4f}")
        print(f"{name:<10} {'seconds':<10} {'':>16} {ours[2]:>16.1f} {'':>7} {plain[2]:>16.1f}")


if __name__ == "__main__":
    main()
