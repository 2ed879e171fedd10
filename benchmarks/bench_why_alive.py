"""What a retention-path search and a host-memory sample cost, side by side with the alternatives.

1. ``why_alive`` (forward breadth-first search from the roots, whole reachable heap) against the
   usual hand-rolled alternative, a backward walk over ``gc.get_referrers`` from the tensor to a
   module's globals (what people write with objgraph-style helpers). Both on a tensor held by
   ``GLOBAL['k'][3]``; the backward walk cannot see autograd graphs (saved tensors are not
   Python references), so for a tensor saved by a loss kept in a list only ``why_alive`` finds
   a path.
2. A tensor held only by a reference cycle while ``--ring`` other garbage objects (one ring of
   objects each referring to the next) wait for the collector: ``why_alive`` finds the cycle
   among the collector's pending garbage (one strongly-connected-components pass; before it,
   a search per garbage object was quadratic in the ring); the backward walk finds no path.
3. A tensor nothing holds (the answer is "no path"; the whole heap is walked, then the pending
   garbage), asked three times in a row: each call's time, objects searched, and the cyclic
   garbage a call leaves behind (a search that leaves its own bookkeeping in a cycle makes the
   next call slower). ``--with-transformers`` first imports transformers' ``Trainer`` (and
   Lightning where installed), the heap of a real training process; a dict subclass there
   (transformers' lazy auto-mappings) imports every model module when its ``items()`` runs.
4. One ``host_memory()`` reading (RSS, USS, PSS of the process tree; reads smaps_rollup) against
   ``psutil.Process().memory_info()`` (RSS only).

Usage: ``PYTHONPATH=src python benchmarks/bench_why_alive.py [--repeats 5] [--ring 4000] [--with-transformers]`` (each search timed
as the best of ``--repeats``, each host-memory reading as the best of 4x that).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import types

import psutil
import torch

from torchmem.capture.host import host_memory
from torchmem.capture.retention import why_alive

GLOBAL: dict[str, list[object]] = {"k": [None, None, None, torch.zeros(1000)]}
LOSSES: list[torch.Tensor] = []


def backward_walk(target: object, max_depth: int = 8) -> list[str] | None:
    """Breadth-first over gc.get_referrers from ``target`` until a module's globals."""
    module_dicts = {id(vars(m)): name for name, m in list(sys.modules.items())
                    if isinstance(m, types.ModuleType)}
    frontier = [(target, [type(target).__name__])]
    seen = {id(target)}
    here = sys._getframe()
    for _ in range(max_depth):
        nxt = []
        for obj, chain in frontier:
            for r in gc.get_referrers(obj):
                if r is frontier or r is nxt or r is here or id(r) in seen:
                    continue
                if id(r) in module_dicts:
                    key = next((k for k, v in r.items() if v is obj), "?")
                    return [f"{module_dicts[id(r)]} global {key}", *chain]
                if isinstance(r, (list, dict, tuple)) or hasattr(r, "__dict__"):
                    seen.add(id(r))
                    nxt.append((r, [type(r).__name__, *chain]))
        frontier = nxt
    return None


def best_of(fn, n: int = 5) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class _Obj:
    pass


def _cycle_held(ring: int) -> torch.Tensor:
    """A tensor whose only holder is a two-object cycle, beside a ring of ``ring`` objects."""
    a, b = _Obj(), _Obj()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    a.data = torch.zeros(100)  # type: ignore[attr-defined]
    objs = [_Obj() for _ in range(ring)]
    for x, y in zip(objs, objs[1:] + objs[:1]):
        x.next = y  # type: ignore[attr-defined]
    return a.data  # type: ignore[attr-defined,no-any-return]


def cycle_case(ring: int, reps: int) -> None:
    gc.collect()
    gc.disable()  # the cycles wait for the collector, as between two automatic collections
    try:
        t = _cycle_held(ring)
        found = why_alive(t, timeout=600)
        t_fwd = best_of(lambda: why_alive(t, timeout=600), reps)
        t0 = time.perf_counter()  # once: each step of the walk scans the whole heap
        back = backward_walk(t)
        t_back = time.perf_counter() - t0
        print(f"tensor held by a reference cycle, {ring} more garbage objects in a ring:")
        print(f"  why_alive:      {t_fwd:9.3f} s  ratio {t_fwd / t_back:6.2f}  {found[0]}")
        print(f"  backward walk:  {t_back:9.3f} s  ratio {1.0:6.2f}  {back}")
    finally:
        gc.enable()


def freeable_case(calls: int = 3) -> None:
    modules = len(sys.modules)
    gc.collect()  # nothing pending before the first call
    print(f"a tensor nothing holds, {calls} calls in a row:")
    for i in range(calls):
        t0 = time.perf_counter()
        found = why_alive(torch.zeros(10), timeout=600)
        dt = time.perf_counter() - t0
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            left = gc.collect()
        finally:
            gc.set_debug(0)
        del gc.garbage[:]
        gc.collect()  # freed now (saved above only to be counted)
        print(f"  call {i + 1}: {dt:7.2f} s, {found.searched:,} objects searched, {left:,} cyclic "
              f"garbage objects left, {len(sys.modules) - modules} modules imported by the search")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="best of this many timings (default 5)")
    ap.add_argument("--ring", type=int, default=4000,
                    help="garbage objects in the ring of case 2 (default 4000)")
    ap.add_argument("--with-transformers", action="store_true",
                    help="import transformers' Trainer (and Lightning) first: a real heap")
    args = ap.parse_args()
    if args.with_transformers:
        import importlib.util

        from transformers import Trainer  # noqa: F401 - its import is the point
        if importlib.util.find_spec("lightning") is not None:
            import lightning  # noqa: F401

    reps = args.repeats
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(256, 256)
    LOSSES.append((x @ w).sum())
    held = GLOBAL["k"][3]
    print(f"objects tracked by gc: {len(gc.get_objects())}")
    t_fwd = best_of(lambda: why_alive(held, max_paths=1), reps)
    t_fwd_all = best_of(lambda: why_alive(held), reps)
    t_back = best_of(lambda: backward_walk(held), reps)
    print(f"{'tensor in GLOBAL[k][3]':<34} {'seconds':>9}  {'ratio':>6}  found")
    print(f"{'why_alive, first path':<34} {t_fwd:9.3f}  {t_fwd / t_back:6.2f}  "
          f"{str(why_alive(held, max_paths=1)[0])[:60]}")
    print(f"{'why_alive, all paths':<34} {t_fwd_all:9.3f}  {t_fwd_all / t_back:6.2f}")
    print(f"{'gc.get_referrers backward walk':<34} {t_back:9.3f}  {1.0:6.2f}  {backward_walk(held)}")
    print()
    print("tensor saved by a loss kept in LOSSES (through the autograd graph):")
    print(f"  why_alive:      {why_alive(x, max_paths=1)[0]}")
    print(f"  backward walk:  {backward_walk(x)}  (the graph is invisible to gc)")
    print()
    cycle_case(args.ring, reps)
    print()
    freeable_case()
    print()
    t_host = best_of(lambda: host_memory(), n=4 * reps)
    proc = psutil.Process()
    t_rss = best_of(lambda: proc.memory_info(), n=4 * reps)
    print(f"host_memory() (RSS+USS+PSS, process tree): {t_host * 1e3:.2f} ms; "
          f"psutil memory_info() (RSS): {t_rss * 1e3:.3f} ms; ratio {t_host / t_rss:.0f}x")
    print("at the default 0.2 s interval the sampler thread uses "
          f"{t_host / 0.2 * 100:.1f}% of one core")


if __name__ == "__main__":
    main()
