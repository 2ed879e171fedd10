"""Benchmark: ``torchmem diff`` of two runs vs what a user would otherwise run.

Tracker traces: two synthetic training runs of N events each (default 1,000,000; parameters
allocated up front, then per iteration activations made in forward and freed in backward,
gradients, temporaries, optimizer state, step markers; operators, modules and stacks as the
tracker records them; the second run's tensors 1.5x larger). Timed, min of --repeats:

1. ``torchmem.analysis.diff(a, b)`` at the peak (live groups by category, module, operator,
   call site, phase, and the per-iteration table) -- what ``torchmem diff a b`` computes;
2. the alternative without a diff: ``torchmem.analysis.summarize`` of each run (``torchmem
   summary`` twice), whose tables are then compared by eye.

Snapshots: two real CUDA snapshots from tests/data (LLM-inference, 1.3b and the OOM run): torchmem's
end-state diff by stack (``torchmem diff --at end``, load included) vs PyTorch's own
``torch.cuda._memory_viz compare`` (load included; it lists segments only, by address and size).

Times are wall clock and process CPU time (``time.process_time``); on a shared machine the CPU
time is the steadier figure.

Run:  python benchmarks/bench_diff.py [--events 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import pickle
import random
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from torchmem.analysis import diff, summarize  # noqa: E402
from torchmem.io import load_snapshot  # noqa: E402
from torchmem.model.events import Category, EventKind, Phase  # noqa: E402
from torchmem.model.trace import Trace  # noqa: E402

DATA = HERE.parent / "tests" / "data"


def make_run(n_events: int, scale: float, seed: int = 0) -> Trace:
    """A training run of about ``n_events`` events whose tensors are ``scale`` times larger."""
    rng = random.Random(seed)
    tr = Trace()
    layers = 24
    sites = [f"/home/user/project/model.py:{100 + i}:forward" for i in range(layers)]
    sid = 0
    sizes: dict[int, int] = {}

    def free(t: int, s: int, step: int) -> None:
        tr.append(EventKind.FREE, t, "cpu", sizes.pop(s), s, step=step)

    def alloc(t: int, n: int, op: str, mod: str, phase: Phase, cat: Category, step: int,
              site: str) -> int:
        nonlocal sid
        sid += 1
        sizes[sid] = int(n * scale)
        tr.append(EventKind.ALLOC, t, "cpu", sizes[sid], sid, op=op, module=mod, phase=phase,
                  category=cat, step=step, stack=("/home/user/project/train.py:40:main", site))
        return sid

    t = 0
    for i in range(layers):  # parameters
        alloc(0, 4 * 1024 * 1024, "", f"Model.layers.{i}", Phase.OTHER, Category.PARAMETER, 0,
              sites[i])
    step = 0
    while len(tr) < n_events:
        acts = []
        for i in range(layers):  # forward: an activation and a temporary per layer
            t += 1
            acts.append((alloc(t, rng.randint(1, 64) * 65536, "aten::mm", f"Model.layers.{i}",
                               Phase.FORWARD, Category.ACTIVATION, step, sites[i]), i))
            tmp = alloc(t, 65536, "aten::gelu", f"Model.layers.{i}", Phase.FORWARD,
                        Category.TEMPORARY, step, sites[i])
            free(t, tmp, step)
        for s, i in reversed(acts):  # backward: gradients once, activations freed
            t += 1
            if step == 0:
                alloc(t, 4 * 1024 * 1024, "aten::mm", f"Model.layers.{i}", Phase.BACKWARD,
                      Category.GRADIENT, step, sites[i])
            free(t, s, step)
        if step == 0:
            for i in range(layers):  # optimizer state, once
                alloc(t, 8 * 1024 * 1024, "aten::zeros_like", "optimizer:Adam", Phase.OPTIMIZER,
                      Category.OPTIMIZER_STATE, step, sites[i])
        tr.append(EventKind.MARK, t, "cpu", 0, 0, op="step", step=step)
        step += 1
    return tr


def best(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    wall = cpu = float("inf")
    out = None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    t0 = time.perf_counter()
    a, b = make_run(args.events, 1.0), make_run(args.events, 1.5)
    print(f"generated two runs of {len(a):,} / {len(b):,} events in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)

    dw, dc, d = best(lambda: diff(a, b), args.repeats)
    sw, sc, _ = best(lambda: (summarize(a), summarize(b)), args.repeats)
    cats = {g.name: g.delta_bytes for g in d.groups["category"]}
    print(f"traces, {len(a):,} events each: diff at the peak {dw:.2f} s wall / {dc:.2f} s CPU; "
          f"two summaries {sw:.2f} s / {sc:.2f} s; diff / two summaries = {dc / sc:.2f}x CPU")
    print(f"  live at the peak {d.before_bytes:,} -> {d.after_bytes:,} B; category changes "
          f"{cats}; {len(d.iterations)} iterations paired")

    pa = DATA / "LLM-inference__1.3b_snapshot_6a8eab0.pickle"
    pb = DATA / "LLM-inference__oom_snapshot_41810ba.pickle"
    tw, tc, sd = best(lambda: diff(load_snapshot(pa), load_snapshot(pb), at="end"), args.repeats)
    try:
        from torch.cuda import _memory_viz
    except ImportError as e:
        print(f"snapshots: torch.cuda._memory_viz not available ({e}); skipped")
        return

    def pytorch_compare() -> str:
        # compare() prints the addresses of the segments only in one file and hands folded
        # stacks to flamegraph.pl (downloaded on first use): kept as text here, output captured
        with open(pa, "rb") as fa, open(pb, "rb") as fb, redirect_stdout(io.StringIO()):
            return str(_memory_viz.compare(pickle.load(fa)["segments"],
                                           pickle.load(fb)["segments"],
                                           format_flamegraph=lambda text: text))

    pw, pc, _ = best(pytorch_compare, args.repeats)
    print(f"snapshots (LLM-inference 1.3b vs oom, load included): torchmem diff --at end "
          f"{tw * 1e3:.0f} ms wall / {tc * 1e3:.0f} ms CPU, {len(sd.rows)} stacks changed; "
          f"_memory_viz compare {pw * 1e3:.0f} ms / {pc * 1e3:.0f} ms (segments only); "
          f"torchmem / _memory_viz = {tc / pc:.2f}x CPU")


if __name__ == "__main__":
    main()
