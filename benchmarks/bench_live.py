"""What ``torchmem run --live`` and the trainer callbacks' per-step meter add to the tracker.

Workloads: the MLP and the TransformerEncoder of ``bench_tracker.py`` (CPU, one thread).

Variants, interleaved round by round in one process; each figure is the minimum over rounds of
the mean CPU time of the training thread per step (time.thread_time: the shared cores' other
jobs do not inflate it). The panel itself is drawn by rich's refresh thread, twice a second; its
cost is measured apart (the time to draw one panel) and added as a share of each 500 ms.
  untracked   the bare step
  run         the tracker as ``torchmem run`` starts it by default: stacks (6 frames) and the
              leak watch's listener
  run-live    the same plus ``--live``: the LiveCounter listener on every event, and the rich
              Live panel redrawn twice a second on a terminal console (written to /dev/null)
  bare        torchmem.track(stacks=False): ``torchmem run --no-stacks --why 0``
  bare-live   the same plus ``--live`` (its listener takes the tracker off its listener-free
              fast path)
  track-objs  track(model, opt, stacks=False): the trainer meter's baseline
  meter       the trainer callbacks' StepMeter (the same tracker + the per-step listener and
              the CUDA allocator follower; begin_step/end_step around each step)

Run:  python benchmarks/bench_live.py            (about 2 minutes on 2 busy cores)
      python benchmarks/bench_live.py --quick
      python benchmarks/bench_live.py --smoke      (1 round of 2 steps: checks that it runs)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchmem  # noqa: E402
from bench_tracker import mlp, transformer  # noqa: E402
from torchmem.cli._live import LiveView  # noqa: E402
from torchmem.integrations._meter import StepMeter  # noqa: E402
from torchmem.render.live import live_panel  # noqa: E402


def _terminal_console() -> Any:
    from rich.console import Console

    return Console(file=open(os.devnull, "w"), force_terminal=True, width=100, height=40)


def _run_tracker(stacks: bool, live: bool) -> Any:
    """The tracker ``torchmem run`` starts (with ``--no-stacks --why 0`` when not ``stacks``)."""
    from torchmem.cli._leaks import LeakWatch

    listeners = [LeakWatch().on_event] if stacks else []
    view = LiveView("bench", console=_terminal_console()) if live else None
    if view is not None:
        listeners.append(view.on_event)
    tracker = torchmem.track(stacks=stacks, stack_depth=6, listeners=listeners)
    stack = contextlib.ExitStack()
    stack.enter_context(tracker)
    if view is not None:
        stack.enter_context(view)
    return stack


@contextlib.contextmanager
def meter_run(net: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    meter = StepMeter(net, opt).start()
    try:
        yield meter
    finally:
        meter.stop()


def variants(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "untracked": (contextlib.nullcontext, None),
        "run": (lambda: _run_tracker(True, False), None),
        "run-live": (lambda: _run_tracker(True, True), None),
        "bare": (lambda: _run_tracker(False, False), None),
        "bare-live": (lambda: _run_tracker(False, True), None),
        "track-objs": (lambda: torchmem.track(net, opt, stacks=False), None),
        "meter": (lambda: meter_run(net, opt), "meter"),
    }


def time_variant(step: Callable[[], None], factory: Any, kind: Any, n: int) -> float:
    gc.collect()
    with factory() as ctx:
        step()
        t0 = time.thread_time()
        for _ in range(n):
            if kind == "meter":
                ctx.begin_step()
                step()
                ctx.end_step()
            else:
                step()
        return (time.thread_time() - t0) / n


def bench_workload(name: str, build: Any, rounds: int, n: int) -> dict[str, float]:
    def fresh(k: str) -> tuple[Any, ...]:  # each variant its own model (same seed and shapes)
        torch.manual_seed(0)
        step, net, opt = build()
        return (step, *variants(net, opt)[k])

    instances = {k: fresh(k) for k in variants(*build()[1:])}
    best = dict.fromkeys(instances, float("inf"))
    for r in range(rounds):
        for k, instance in instances.items():
            best[k] = min(best[k], time_variant(*instance, n))
        print(f"  {name}: round {r + 1}/{rounds} done", file=sys.stderr)
    return best


def panel_draw_ms(draws: int = 50) -> float:
    step, net, opt = transformer()
    view = LiveView("bench", console=_terminal_console())
    with torchmem.track(stacks=False, listeners=[view.on_event]):
        for _ in range(3):
            step()
    console = _terminal_console()
    t0 = time.perf_counter()
    for _ in range(draws):
        console.print(live_panel(view.state()))
    return (time.perf_counter() - t0) / draws * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    ap.add_argument("--smoke", action="store_true", help="1 round of 2 steps (tests: it runs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds, n = (1, 2) if args.smoke else (2, 10) if args.quick else (5, 30)
    print(f"torch {torch.__version__}, {rounds} rounds x {n} steps, thread CPU time per step")
    draw = panel_draw_ms(5 if args.smoke else 50)
    share = draw / 500.0  # drawn twice a second: this share of the process's time
    print(f"one panel drawn in {draw:.2f} ms: {100 * share:.2f}% of the time at 2 draws a second")
    for name, build in (("mlp", mlp), ("transformer", transformer)):
        best = bench_workload(name, build, rounds, n)
        ms = {k: v * 1e3 for k, v in best.items()}
        print(f"\n{name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
        for with_live, base, what in (("run-live", "run", "torchmem run (default)"),
                                      ("bare-live", "bare", "torchmem run --no-stacks --why 0")):
            ratio = best[with_live] / best[base] * (1 + share)
            print(f"  --live / {what:<33} {ratio:.3f}x (panel drawing included)")
        print(f"  meter / track(model, opt, stacks=False)  "
              f"{best['meter'] / best['track-objs']:.3f}x (the trainer callbacks' meter)")
        print(f"  run / untracked                          {best['run'] / best['untracked']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
