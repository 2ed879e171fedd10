"""Tracker memory over a long run: aggregated mode against the full trace (issue 12).

Workload (CPU): many small tensors per step: each step makes 50 new tensors of 8 floats
(``torch._foreach_add`` over 50 tensors made before tracking: one operator, 50 allocations),
drops them and ends with ``tracker.step()``: 101 events per step, so 10,000,000 events are
99,010 steps. Tracked with ``torchmem.track(step_marker="manual")``
(the default options otherwise: no stacks) in two variants:

  full        every event held (``aggregate=False``, the default of ``torchmem.track``)
  aggregate   ``aggregate=True`` (fold and compact every 262,144 events, keep the last 5
              iterations and the peak's)

and without step markers (issue 26: an inference loop), the same events but no ``tracker.step()``:

  agg-nosteps       ``aggregate=True``, never a step marker: the iteration in progress is
                    compacted every ``Aggregate.within`` rows (262,144) instead
  agg-nosteps-grad  50 allocations per forward too, with autograd on: a tensor that requires
                    grad through ``Sequential`` of 50 modules that each add 1 (each output
                    frees the one before it): the tracker's map from autograd nodes to modules
                    gains an entry at every module too (now kept to ``within`` entries)

Each variant runs in a fresh process (forked from the benchmark's, which has imported torch and
torchmem once; a subprocess where there is no fork). Memory: Python's tracemalloc (the trace's columns are
``array`` buffers and the aggregate's tables are Python objects: all of it is traced; torch's
tensor memory is not), measured from just before the block to after it (``held``: what the
tracker keeps once the run is over, the trace and the aggregate; ``peak``: the most at any
moment, compaction's transient copies included), the process's RSS growth over the run
(psutil) and its peak RSS growth (``VmHWM`` of /proc/self/status, reset through
/proc/self/clear_refs just before the block, minus the RSS there). Time: CPU time of the run
per event, in separate processes without tracemalloc (which slows Python allocations), over
``--speed-events`` events (default 2,000,000).
Each child first runs a short tracked block, so the modules the tracker imports on first use are
not counted as its memory.

Run:  python benchmarks/bench_aggregate.py                    (10M events, about 20 minutes on
                                                               2 busy cores)
      python benchmarks/bench_aggregate.py --events 1000000 --speed-events 500000  (quick look)
      python benchmarks/bench_aggregate.py --variants agg-nosteps,agg-nosteps-grad  (no steps)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PER_STEP = 50  # tensors per step: 100 events with their frees, and the step marker
BUDGET_MIB = 64.0
VARIANTS = ("full", "aggregate", "agg-nosteps", "agg-nosteps-grad")


def _peak_rss_reset() -> bool:
    """Reset the process's peak RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """The process's peak RSS in bytes (``VmHWM``), 0 where /proc is missing."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) * 1024 if m else 0


def child(mode: str, events: int, traced: bool) -> dict[str, Any]:
    import tracemalloc

    import psutil
    import torch

    import torchmem

    steps = max(1, events // (2 * PER_STEP + 1))
    proc = psutil.Process()
    stepped = mode in ("full", "aggregate")
    grad = mode == "agg-nosteps-grad"
    xs = [torch.ones(8) for _ in range(PER_STEP)]

    class AddOne(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t + 1

    net = torch.nn.Sequential(*(AddOne() for _ in range(PER_STEP)))
    x = torch.ones(8, requires_grad=True)
    targets = (net,) if grad else ()
    with torchmem.track(*targets, step_marker="manual", aggregate=1) as warm:  # first-use imports
        for _ in range(3):
            ys = net(x) if grad else torch._foreach_add(xs, 1.0)
            del ys
            warm.step()
    torchmem.analysis.summarize(warm.trace)
    del warm
    if traced:
        tracemalloc.start()
    rss0 = proc.memory_info().rss
    hwm = _peak_rss_reset()
    base = tracemalloc.get_traced_memory()[0] if traced else 0
    t0 = time.process_time()
    report = max(1, steps // 10)
    with torchmem.track(*targets, step_marker="manual", aggregate=(mode != "full")) as tr:
        for i in range(steps):
            ys = net(x) if grad else torch._foreach_add(xs, 1.0)
            del ys
            if stepped:
                tr.step()
            if i % report == 0:
                print(f"  {mode}: step {i:,} of {steps:,}", file=sys.stderr, flush=True)
    cpu = time.process_time() - t0
    out: dict[str, Any] = {"mode": mode, "steps": steps, "cpu_s": cpu}
    agg = tr.trace.aggregate
    out["events"] = agg.events if agg is not None else len(tr.trace)
    out["rows_held"] = len(tr.trace)
    out["peak_bytes"] = tr.peak()["cpu"]
    if traced:
        cur, peak = tracemalloc.get_traced_memory()
        out["held_mib"] = (cur - base) / 2**20
        out["peak_mib"] = (peak - base) / 2**20
        out["rss_mib"] = (proc.memory_info().rss - rss0) / 2**20
        out["peak_rss_mib"] = (_peak_rss() - rss0) / 2**20 if hwm else float("nan")
    if agg is not None:
        summary = torchmem.analysis.summarize(tr.trace)
        out["summary_iterations"] = len(summary.iterations)
    return out


_WARM: list[bool] = []


def _spawn(mode: str, events: int, traced: bool) -> dict[str, Any]:
    if hasattr(os, "fork"):
        # a fresh process forked from this one, which imported torch and torchmem once (the
        # child still warms the tracker's first-use imports before it measures)
        if not _WARM:  # the tracker's first-use imports, once, before any child is forked
            import contextlib
            import io

            with contextlib.redirect_stderr(io.StringIO()):
                for m in ("full", "agg-nosteps-grad"):
                    child(m, 2 * PER_STEP + 1, False)
            _WARM.append(True)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                data = json.dumps(child(mode, events, traced)).encode()
                with os.fdopen(w, "wb") as f:
                    f.write(data)
            except BaseException:  # noqa: BLE001 - reported by the parent through the exit code
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not data:
            raise SystemExit(f"the {mode} child failed (exit {os.waitstatus_to_exitcode(status)})")
        forked: dict[str, Any] = json.loads(data)
        return forked
    cmd = [sys.executable, __file__, "--child", mode, "--events", str(events)]
    if not traced:
        cmd.append("--untraced")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--speed-events", type=int, default=2_000_000)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--child", choices=VARIANTS, default=None)
    ap.add_argument("--untraced", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.events, not args.untraced)))
        return
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: unknown {bad or 'empty list'}; expected some of {', '.join(VARIANTS)}")
    print(f"tracker memory over {args.events:,} events ({PER_STEP * 2 + 1} events per step)",
          file=sys.stderr)
    mem = {m: _spawn(m, args.events, True) for m in variants}
    speed = {m: _spawn(m, args.speed_events, False) for m in variants}
    print(f"\n{'variant':<17} {'events':>11} {'rows held':>10} {'held MiB':>9} {'peak MiB':>9} "
          f"{'RSS MiB':>8} {'peak RSS MiB':>12} {'us/event':>9}   "
          f"(us/event: CPU over {args.speed_events:,} events)")
    for m in variants:
        r, s = mem[m], speed[m]
        print(f"{m:<17} {r['events']:>11,} {r['rows_held']:>10,} {r['held_mib']:>9.1f} "
              f"{r['peak_mib']:>9.1f} {r['rss_mib']:>8.1f} {r['peak_rss_mib']:>12.1f} "
              f"{1e6 * s['cpu_s'] / s['events']:>9.2f}")
    for m in ("agg-nosteps", "agg-nosteps-grad"):
        if m in mem:
            r = mem[m]
            ok = r["peak_mib"] <= BUDGET_MIB and r["held_mib"] <= BUDGET_MIB
            print(f"{m}: {r['events']:,} events without a step marker, {r['rows_held']:,} rows "
                  f"held, held {r['held_mib']:.1f} MiB, peak {r['peak_mib']:.1f} MiB, peak RSS "
                  f"growth {r['peak_rss_mib']:.1f} MiB = {r['peak_rss_mib'] * 2**20 / r['events']:.2f}"
                  f" B/event (target <= {BUDGET_MIB:.0f} MiB: {'met' if ok else 'NOT met'})")
    if "full" not in mem or "aggregate" not in mem:
        return
    f, a = mem["full"], mem["aggregate"]
    print(f"\naggregate / full: held {a['held_mib'] / f['held_mib']:.3f}, "
          f"peak {a['peak_mib'] / f['peak_mib']:.3f}, RSS {a['rss_mib'] / max(f['rss_mib'], 1):.3f}; "
          f"CPU time per event {speed['aggregate']['cpu_s'] / speed['full']['cpu_s']:.2f}x")
    ok = a["peak_mib"] <= BUDGET_MIB and a["held_mib"] <= BUDGET_MIB
    print(f"aggregated tracker memory after {a['events']:,} events: held {a['held_mib']:.1f} MiB, "
          f"peak {a['peak_mib']:.1f} MiB (target <= {BUDGET_MIB:.0f} MiB: "
          f"{'met' if ok else 'NOT met'}); same peak as full: {a['peak_bytes'] == f['peak_bytes']}")


if __name__ == "__main__":
    main()
