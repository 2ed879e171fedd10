"""``torchmem.compat.MemReporter().report()`` against a bare ``gc.collect()`` (issue 26).

The reporter collects garbage first (as torchlinops' did), then lists every live tensor, builds
the census and prints one row per tensor, so a bare ``gc.collect()`` over the same heap is its
floor; the goal is at most 2x that. Workload: 10,000 live ``torch.zeros(4)`` tensors in a
process that imported torch; the two alternate ``--repeats`` times in one process (the report
printed into a ``StringIO``) and the ratio of the minima is the figure (the machine is shared,
so the minima are the least disturbed runs), the ratio of the medians beside it.

Run:  python benchmarks/bench_memreporter.py [--tensors 10000] [--repeats 15] [--runs 3]
      (--runs: independent series in the same process, each printed: the spread between them
      shows how reliable one figure is)
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import statistics
import time

import torch

from torchmem.compat import MemReporter


def series(repeats: int) -> tuple[float, float, float, float]:
    """(min gc, min report, median gc, median report) in seconds, alternating."""
    g: list[float] = []
    m: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        g.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        MemReporter().report(file=io.StringIO())
        m.append(time.perf_counter() - t0)
    return min(g), min(m), statistics.median(g), statistics.median(m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    keep = [torch.zeros(4) for _ in range(args.tensors)]
    print(f"torch {torch.__version__}, {len(keep)} live tensors, {len(gc.get_objects())} gc objects, "
          f"load average {os.getloadavg()[0]:.2f}")
    for r in range(args.runs):
        gmin, mmin, gmed, mmed = series(args.repeats)
        print(f"run {r + 1}: gc.collect {gmin * 1e3:.1f} ms, MemReporter {mmin * 1e3:.1f} ms (minima of "
              f"{args.repeats}); ratio of minima {mmin / gmin:.2f}, of medians {mmed / gmed:.2f} "
              "(goal <= 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
