"""Benchmark: the leak trend (``torchmem.analysis.growth``) on long traces, beside ``summarize``.

A generated tracker trace of N events (default 1,000,000): parameters up front, then per
iteration every layer makes an activation (random size) and a temporary in forward, backward
frees them, optimizer state once, a step marker, and one call site that keeps 4 KiB per
iteration (a leak). Operators, modules and stacks as the tracker records them.

Timed (process CPU time, min of --repeats) at N/4, N/2 and N events, to show that the analysis
is linear in events (time per million events stays flat):

1. ``growth(trace)``: the trend and the growing call sites and modules;
2. ``summarize(trace)``: the whole summary ``torchmem summary`` prints, which now includes (1);
   the ratio says what share of the summary the leak analysis costs.

Run:  python benchmarks/bench_growth.py [--events 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from torchmem.analysis import growth, summarize  # noqa: E402
from torchmem.model.events import Category, EventKind, Phase  # noqa: E402
from torchmem.model.trace import Trace  # noqa: E402

LAYERS = 16
LEAK = 4096


def leaky_run(n_events: int, seed: int = 0) -> Trace:
    """A training run of about ``n_events`` events that keeps ``LEAK`` bytes per iteration."""
    rng = random.Random(seed)
    tr = Trace()
    stacks = [("/p/train.py:30:main", f"/p/model.py:{50 + i}:forward") for i in range(LAYERS)]
    leak_stack = ("/p/train.py:30:main", "/p/train.py:41:main")
    ids = iter(range(1, 1 << 62))
    for i in range(LAYERS):
        tr.append(EventKind.ALLOC, 0, "cpu", 1 << 20, next(ids), module=f"Net.l{i}",
                  category=Category.PARAMETER, stack=stacks[i])
    t = step = 0
    while len(tr) < n_events:
        made = []
        for i in range(LAYERS):
            t += 1
            s, n = next(ids), rng.randint(1, 32) << 14
            tr.append(EventKind.ALLOC, t, "cpu", n, s, op="aten::addmm", module=f"Net.l{i}",
                      phase=Phase.FORWARD, category=Category.ACTIVATION, step=step,
                      stack=stacks[i])
            made.append((s, n))
            tmp = next(ids)
            tr.append(EventKind.ALLOC, t, "cpu", 8192, tmp, op="aten::relu", module=f"Net.l{i}",
                      phase=Phase.FORWARD, category=Category.TEMPORARY, step=step,
                      stack=stacks[i])
            tr.append(EventKind.FREE, t, "cpu", 8192, tmp, step=step)
        for s, n in reversed(made):
            t += 1
            tr.append(EventKind.FREE, t, "cpu", n, s, step=step)
        if step == 0:
            for i in range(LAYERS):
                tr.append(EventKind.ALLOC, t, "cpu", 2 << 20, next(ids), op="aten::zeros_like",
                          module="optimizer:Adam", phase=Phase.OPTIMIZER,
                          category=Category.OPTIMIZER_STATE, step=step, stack=stacks[i])
        tr.append(EventKind.ALLOC, t, "cpu", LEAK, next(ids), op="aten::zeros", step=step,
                  stack=leak_stack)
        tr.append(EventKind.MARK, t, "cpu", 0, 0, op="step", step=step)
        step += 1
    return tr


def cpu_best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The least process CPU time of ``repeats`` calls, and the last result."""
    best = float("inf")
    out = None
    for _ in range(repeats):
        c0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - c0)
    return best, out


def main() -> None:
    """Print one line per size and the ratio at the largest.

    Example:
        >>> callable(main)
        True
    """
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for n in (args.events // 4, args.events // 2, args.events):
        t0 = time.perf_counter()
        tr = leaky_run(n)
        print(f"generated {len(tr):,} events in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        gc, r = cpu_best(lambda tr=tr: growth(tr), args.repeats)
        sc, s = cpu_best(lambda tr=tr: summarize(tr), args.repeats)
        assert r.leak and s.leak_suspect and r.bytes_per_iteration == LEAK
        site = r.growing[0]
        per_m = 1e6 / len(tr)
        print(f"{len(tr):>9,} events, {len(r.end_bytes):,} iterations: growth {gc:.2f} s CPU "
              f"({gc * per_m:.2f} s per M events); summarize {sc:.2f} s ({sc * per_m:.2f} s per "
              f"M); growth / summarize = {gc / sc:.2f}x; found {site.name} "
              f"+{site.bytes_per_iteration} B/iteration from step {site.start_step}")


if __name__ == "__main__":
    main()
