"""Benchmark: replaying a real snapshot through the allocator simulator (``torchmem.sim.replay``).

For each real snapshot with a trace (``tests/data``: DeComFL from empty, MAGMA27 and notHanmin
mid-run), times, best of ``--reps``:

- ``start_state``: rebuilding the allocator's state at the start of the trace (backward walk);
- ``sim.replay``: the whole check (start state, seeding, every request through the simulator,
  the comparison);
- the alternative it is set beside: ``analysis.replay.DeviceReplay(...).lifetimes()``, the
  byte-level replay (live requested bytes only, no blocks, no segments) that the viewer and the
  analyses already run.

Prints the times, the ratio sim.replay / lifetimes (what the exact block model costs on top), and
the replay's own result (allocs matched, final layout) so a regression in exactness shows here too.

Run:  python benchmarks/bench_replay.py [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from torchmem.analysis.replay import DeviceReplay  # noqa: E402
from torchmem.io import load_snapshot  # noqa: E402
from torchmem.sim.replay import replay, start_state  # noqa: E402

FILES = [
    "DeComFL__memory.pickle",
    "MAGMA27_a2__memory_snapshot.pickle",
    "notHanmin_a2__memory_snapshot_forward.pickle",
]


def best(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    out = None
    t_best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t0)
    return t_best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'file':<46} {'entries':>8} {'start_state':>12} {'sim.replay':>11} {'lifetimes':>10} "
          f"{'ratio':>6}  result")
    for name in FILES:
        snap = load_snapshot(HERE.parent / "tests" / "data" / name)
        n = len(snap.trace(0))
        t_start, _ = best(lambda s=snap: start_state(s, 0), args.reps)
        t_sim, r = best(lambda s=snap: replay(s, 0), args.reps)
        t_life, _ = best(lambda s=snap: DeviceReplay(s, 0).lifetimes(), args.reps)
        res = (f"allocs {r.allocs_matched}/{r.allocs_expected}, segment_allocs "
               f"{r.segment_allocs_matched}/{r.segment_allocs_expected}, final layout "
               f"{'equal' if r.final_layout_equal else 'DIFFERENT'}")
        print(f"{name:<46} {n:>8} {t_start * 1e3:>10.1f}ms {t_sim * 1e3:>9.1f}ms "
              f"{t_life * 1e3:>8.1f}ms {t_sim / t_life:>5.1f}x  {res}")


if __name__ == "__main__":
    main()
