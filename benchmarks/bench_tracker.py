"""Tracker overhead, memory per event and trace loading, side by side with PyTorch's tools.

Workloads (CPU, one thread):
  mlp          8 x (Linear(256, 256) + ReLU), batch 32, SGD step
  transformer  TransformerEncoder (2 layers, d_model 128, 4 heads, ff 256), batch 8 x seq 32, Adam

Variants, measured in the same process and interleaved round by round; time is the CPU time
of the calling thread (time.thread_time: preemption by other processes on the shared cores is not
counted); each figure is the minimum over rounds of the mean step time:
  untracked   the bare step
  floor       the step under a TorchDispatchMode that does nothing (the cost any dispatch-mode
              tracker pays before doing any work; PyTorch wraps its __torch_dispatch__ in
              torch._dynamo.disable, two Python frames per operator)
  floor-noguard  the same on torchmem.capture._fast_mode.FastDispatchMode, which skips that
              wrapper while no compiled code runs, as torchmem's own modes do
  profiler    torch.profiler with profile_memory=True (CPU activity), a lower-level capture
  memtracker  torch.distributed._tools.mem_tracker.MemTracker (reset_mod_stats every step,
              which it requires for repeated iterations)
  torchmem    torchmem.track(model, opt): ops, modules (forward and backward), phases,
              categories, step markers
  torchmem-nomod  torchmem.track(model, opt, modules=False): no module hooks
  torchmem-fast   torchmem.track(model, opt, mode="fast"): allocator-level capture in C++ (a
              wrapper around PyTorch's CPU allocator, RecordFunction callbacks for operators,
              module/optimizer hooks for module and phase), converted in C++ when the block ends
  torchmem-lite   torchmem.track_lite(): the profiler's allocator events converted to torchmem
              events when the block ends (no modules/categories/stacks)
  tf-floor    the step under a TorchFunctionMode that does nothing (the floor of a tracker
              built on __torch_function__ instead of __torch_dispatch__)
  alloc-only  the cheapest allocator-level capture that could name modules and phases: the
              profiler with allocation events and user/backward ranges only (no operator events,
              so no operator names), module ranges from global forward hooks
              (_RecordFunctionFast), and at the end one walk over the event tree (the least
              any conversion into torchmem events must do)
  memray      memray.Tracker (Python allocator off, no native traces), when memray is installed
              (pip install memray): the tool Python users pick for long runs

Every variant is charged twice: per step while the block runs ("in-step"), and for the work
it does when the block ends ("end", e.g. the profiler's own finalisation and a conversion),
divided by the steps recorded; "total" is the sum, what a run really costs.

Also: bytes the tracker holds per recorded event over a long run (tracemalloc delta of the
tracking session divided by its events; torch's tensor memory is not traced by tracemalloc),
and the time to load a 1,000,000-event trace file.

Streaming (``--stream``): torchmem.track(model, opt) against the same with ``path=`` (the trace
streamed to a file by a background thread every half second, as ``torchmem run`` does), each run
for at least 2 seconds so that several chunks are written; time is the CPU time of the whole
process (time.process_time: the writer thread's work counts) and the wall time, per step, minimum
over rounds; the final save when the block ends is reported separately.

Run:  python benchmarks/bench_tracker.py            (about 6 minutes on 2 busy cores)
      python benchmarks/bench_tracker.py --quick    (fewer rounds)
      python benchmarks/bench_tracker.py --stream   (streaming only, about 2 minutes)
      python benchmarks/bench_tracker.py --smoke [--stream]   (1 round of 2 steps, a 10,000-event
                                                    trace: checks that it runs, figures are noise)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import torchmem
from torchmem.capture._fast_mode import FastDispatchMode
from torchmem.capture._quiet import quiet_profiler
from torchmem.io.tmtrace import load_trace, save_trace
from torchmem.model.events import EventKind
from torchmem.model.trace import BYTES_PER_EVENT, Trace

# CPU time of this thread: other processes on the shared cores do not inflate it (CPU
# autograd runs backward on the calling thread, and torch uses one thread here).
_clock = time.thread_time


class NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class NoopFastMode(FastDispatchMode):
    """The do-nothing mode on torchmem's base: without torch's per-operator dynamo guard."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class NoopFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class AllocOnly:
    """Allocation events and module/phase ranges from the profiler, no operator events.

    The lower bound of an allocator-level tracker that names modules and phases: a real one
    would also have to pair frees with allocations and resolve categories when converting.
    """

    def __init__(self) -> None:
        from torch._C._profiler import _RecordFunctionFast

        self._rf = _RecordFunctionFast
        self._open: list[Any] = []
        self._names: dict[int, str] = {}
        self._hooks: list[Any] = []
        self.events = 0

    def _pre(self, m: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(m))
        if name is None:
            name = self._names[id(m)] = f"module::{type(m).__name__}.{len(self._names)}"
        r = self._rf(name)
        r.__enter__()
        self._open.append(r)

    def _post(self, m: torch.nn.Module, args: Any, out: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def __enter__(self) -> AllocOnly:
        from torch._C._profiler import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            RecordScope,
            _ExperimentalConfig,
        )
        from torch.nn.modules import module as nn_module

        cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                             _ExperimentalConfig())
        acts = {ProfilerActivity.CPU}
        with quiet_profiler():
            torch.autograd._prepare_profiler(cfg, acts)
            torch.autograd._enable_profiler(
                cfg, acts, {RecordScope.USER_SCOPE, RecordScope.BACKWARD_FUNCTION})
        self._hooks = [nn_module.register_module_forward_pre_hook(self._pre),
                       nn_module.register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        with quiet_profiler():
            res = torch.autograd._disable_profiler()
        stack = list(res.experimental_event_tree())
        n = 0
        while stack:
            e = stack.pop()
            n += 1
            stack.extend(e.children)
        self.events = n


def mlp() -> tuple[Callable[[], None], torch.nn.Module, torch.optim.Optimizer]:
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(32, 256)

    def step() -> None:
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()

    return step, net, opt


def transformer() -> tuple[Callable[[], None], torch.nn.Module, torch.optim.Optimizer]:
    layer = torch.nn.TransformerEncoderLayer(
        d_model=128, nhead=4, dim_feedforward=256, batch_first=True, dropout=0.0
    )
    net = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randn(8, 32, 128)

    def step() -> None:
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()

    return step, net, opt


def variants(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker

    def memtracker() -> Any:
        mt = MemTracker()
        mt.track_external(net, opt)
        return mt

    def profiler() -> Any:
        return torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )

    out = {
        "untracked": (contextlib.nullcontext, None),
        "floor": (NoopMode, None),
        "floor-noguard": (NoopFastMode, None),
        "tf-floor": (NoopFunctionMode, None),
        "alloc-only": (AllocOnly, None),
        "profiler": (profiler, None),
        "memtracker": (memtracker, lambda mt: mt.reset_mod_stats()),
        "torchmem": (lambda: torchmem.track(net, opt), None),
        "torchmem-nomod": (lambda: torchmem.track(net, opt, modules=False), None),
        "torchmem-lite": (torchmem.track_lite, None),
        "torchmem-fast": (lambda: torchmem.track(net, opt, mode="fast"), None),
    }
    if _memray_tracker() is not None:
        out["memray"] = (_memray_tracker(), None)
    return out


def _memray_tracker() -> Any:
    try:
        import memray
    except ImportError:
        return None
    tmp = tempfile.mkdtemp()

    def make() -> Any:
        path = os.path.join(tmp, "memray.bin")
        if os.path.exists(path):
            os.remove(path)
        return memray.Tracker(path, native_traces=False, trace_python_allocators=False)

    return make


def time_variant(step: Callable[[], None], factory: Any, per_step: Any, n: int) -> tuple[float, float]:
    """(mean in-step time, end-of-block time per recorded step)."""
    gc.collect()
    cm = factory()
    ctx = cm.__enter__()
    try:
        step()  # warm-up inside the context (optimizer state, caches)
        total = 0.0
        for _ in range(n):
            if per_step is not None:
                per_step(ctx)
            t0 = _clock()
            step()
            total += _clock() - t0
    finally:
        t1 = _clock()
        cm.__exit__(None, None, None)
        end = _clock() - t1
    return total / n, end / (n + 1)


def bench_workload(name: str, build: Any, rounds: int, n: int) -> dict[str, float]:
    # Each variant gets its own model and optimizer (same seed, same shapes): MemTracker leaves
    # state on the objects it tracked that slows later runs on them, and no variant should
    # pay for another's leftovers.
    instances: dict[str, tuple[Callable[[], None], Any, Any]] = {}
    for k in variants(*build()[1:]):
        torch.manual_seed(0)
        step, net, opt = build()
        instances[k] = (step, *variants(net, opt)[k])
    best = {k: float("inf") for k in instances}
    end = {k: float("inf") for k in instances}
    for r in range(rounds):
        for k, (step, factory, per_step) in instances.items():
            steps = max(3, n // 4) if k == "memtracker" else n
            t, e = time_variant(step, factory, per_step, steps)
            best[k] = min(best[k], t)
            end[k] = min(end[k], e)
        print(f"  {name}: round {r + 1}/{rounds} done", file=sys.stderr)
    return best, end


def bytes_per_event(steps: int) -> tuple[float, int]:
    torch.manual_seed(0)
    step, net, opt = mlp()
    step()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    with torchmem.track(net, opt) as tr:
        step()
        warm_events = len(tr)
        gc.collect()
        mid = tracemalloc.get_traced_memory()[0]
        for _ in range(steps):
            step()
        gc.collect()
        end = tracemalloc.get_traced_memory()[0]
        n = len(tr) - warm_events
    tracemalloc.stop()
    del base
    return (end - mid) / max(n, 1), n


def load_million(tmp: str, n: int = 1_000_000, reps: int = 5) -> tuple[float, int]:
    tr = Trace()
    kinds = [int(EventKind.ALLOC), int(EventKind.FREE)]
    tr.intern_device("cpu")
    op = tr.intern("aten::mm")
    mod = tr.intern("Net.layers.0")
    tr.kind.extend(kinds[i & 1] for i in range(n))
    tr.time_ns.extend(range(n))
    tr.device.extend([0] * n)
    tr.nbytes.extend([4096] * n)
    tr.storage.extend(i >> 1 for i in range(n))
    tr.op.extend([op] * n)
    tr.module.extend([mod] * n)
    tr.phase.extend([1] * n)
    tr.category.extend([4] * n)
    tr.step.extend(i // 1000 for i in range(n))
    tr.stack.extend([-1] * n)
    tr.thread.extend([0] * n)
    path = os.path.join(tmp, "million.tmtrace")
    save_trace(tr, path)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        back = load_trace(path)
        best = min(best, time.perf_counter() - t0)
        assert len(back) == n
    return best, os.path.getsize(path)


def bench_streaming(name: str, build: Any, rounds: int, tmp: str, seconds: float = 2.0,
                    min_steps: int = 20) -> None:
    """Per-step cost of streaming the trace to disk, against the same tracker without it."""
    torch.manual_seed(0)
    step, net, opt = build()
    step()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    n = max(min_steps, int(seconds / ((time.perf_counter() - t0) / 5)))  # seconds of steps per run
    best = {k: (float("inf"), float("inf")) for k in ("in memory", "streamed")}
    finish = float("inf")
    for r in range(rounds):
        for k in best:
            path = os.path.join(tmp, f"{name}.tmtrace")
            gc.collect()
            tr = torchmem.track(net, opt, path=path if k == "streamed" else None)
            with tr:
                step()
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(n):
                    step()
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                e0 = time.perf_counter()
            if k == "streamed":
                finish = min(finish, time.perf_counter() - e0)
            best[k] = (min(best[k][0], cpu / n), min(best[k][1], wall / n))
        print(f"  {name} streaming: round {r + 1}/{rounds} done", file=sys.stderr)
    (mc, mw), (sc, sw) = best["in memory"], best["streamed"]
    print(f"\n{name}: {n} steps per run ({len(tr)} events), min over {rounds} rounds")
    print(f"  {'variant':<12}{'CPU ms/step':>13}{'wall ms/step':>14}")
    for k, (c, w) in best.items():
        print(f"  {k:<12}{c * 1e3:>13.3f}{w * 1e3:>14.3f}")
    print(f"  streamed / in memory: CPU {sc / mc:.3f}x, wall {sw / mw:.3f}x; the complete file "
          f"written when the block ends: {finish * 1e3:.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stream", action="store_true", help="only the streaming comparison")
    ap.add_argument("--smoke", action="store_true",
                    help="1 round of 2 steps, a 10,000-event trace (tests: it runs, not its figures)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds, n = (1, 2) if args.smoke else (3, 10) if args.quick else (12, 20)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores (shared), 1 torch thread")
    if args.stream:
        with tempfile.TemporaryDirectory() as tmp:
            for name, build in (("mlp", mlp), ("transformer", transformer)):
                if args.smoke:
                    bench_streaming(name, build, 1, tmp, seconds=0.2, min_steps=3)
                else:
                    bench_streaming(name, build, 3 if args.quick else 5, tmp)
        return 0
    if importlib.util.find_spec("memray") is None:
        print("SKIP memray: not installed (pip install memray)")
    verdicts = []
    for name, build in (("mlp", mlp), ("transformer", transformer)):
        best, end = bench_workload(name, build, rounds, n)
        u, f = best["untracked"], best["floor"]
        tot = {k: best[k] + end[k] for k in best}
        print(f"\n{name}: untracked step {u * 1e3:.2f} ms (min over {rounds} rounds)")
        print(f"  {'variant':<16}{'in-step ms':>11}{'x untracked':>13}{'x floor':>9}"
              f"{'end x':>8}{'total x':>9}")
        for k, v in best.items():
            print(f"  {k:<16}{v * 1e3:>11.2f}{v / u:>13.2f}{v / f:>9.2f}{end[k] / u:>8.2f}"
                  f"{tot[k] / u:>9.2f}")
        print(
            f"  torchmem vs MemTracker: {tot['memtracker'] / tot['torchmem']:.1f}x faster (total); "
            f"torchmem / floor = {best['torchmem'] / f:.2f} (target <= 1.25); / floor-noguard "
            f"= {best['torchmem'] / best['floor-noguard']:.2f}"
        )
        print(
            f"  torchmem-lite: {best['torchmem-lite'] / u:.2f}x in-step, {tot['torchmem-lite'] / u:.2f}x "
            f"with the profiler's finalisation and the conversion when the block ends"
        )
        verdicts.append(
            f"{name}: torchmem mode='fast' {tot['torchmem-fast'] / u:.2f}x untracked in total "
            f"(target <= 1.2), {tot['memtracker'] / tot['torchmem-fast']:.1f}x faster than "
            f"MemTracker (target >= 5); mode='ops' {tot['torchmem'] / u:.2f}x; the profiler-based "
            f"alternatives: alloc-only {tot['alloc-only'] / u:.2f}x (no operator names), "
            f"track_lite {tot['torchmem-lite'] / u:.2f}x"
        )
        if "memray" in best:
            verdicts.append(f"{name}: memray {tot['memray'] / u:.2f}x untracked in total")
    print()
    for v in verdicts:
        print(v)
    per, nev = bytes_per_event(20 if args.smoke else 300 if args.quick else 1500)
    print(f"\ntracker memory: {per:.1f} bytes per held event over {nev} events "
          f"(columns alone: {BYTES_PER_EVENT} bytes/event; target <= 64)")
    events, reps = (10_000, 1) if args.smoke else (1_000_000, 5)
    with tempfile.TemporaryDirectory() as tmp:
        secs, size = load_million(tmp, events, reps)
    print(f"loading a {events:,}-event trace ({size / 1e6:.1f} MB): {secs:.3f} s "
          f"(min of {reps}; target <= 1 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
