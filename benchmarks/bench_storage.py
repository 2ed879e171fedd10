"""Benchmark: storage identity and live-tensor reports, torchmem vs torchlinops 0.8.3 / pytorch_memlab.

In one run, same process, min of several repeats, printed as ratios:

1. ``same_storage`` on a 1M-element float32 tensor and a view of it (``x[1000:]``):
   ``torchmem.same_storage`` vs torchlinops' ``same_storage`` (which lists every element's
   data pointer). Target: >= 1000x.
2. A report over N live tensors (N = 1k, 2k, 5k, 10k small tensors, plus whatever the
   interpreter already holds): ``torchmem.inspect_memory(all_live=True)`` vs torchlinops'
   ``MemReporter().report()`` vs pytorch_memlab's ``MemReporter().report()`` (both print; their
   output goes to /dev/null). Every tool does its own ``gc.collect()`` + ``gc.get_objects()``.
   Target: >= 50x vs torchlinops at 10k, near-linear growth 1k -> 10k. The census alone
   (``inspect_memory(tensors=...)``, no gc scan) is timed too, to show its linear growth, and
   and so is torchmem's default all-live report, which does not run ``gc.collect()`` ("no-gc",
   a full collection of the interpreter's ~200k objects is most of the time and has side
   effects; torchlinops always collects, pytorch_memlab only with pre_collect=True, used here).

Run:  python benchmarks/bench_storage.py [--repeats 5] [--sizes 1000,2000,5000,10000]
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import sys
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: I001

import torchmem
from _competitors import memlab, torchlinops_device


def best(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """Min over ``repeats`` of the mean time of ``inner`` calls, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    return run


def bench_same_storage(tl: Any, repeats: int) -> None:
    print("== same_storage: 1M-element float32 tensor vs its view x[1000:]")
    x = torch.zeros(1_000_000)
    v = x[1000:]
    ours = best(lambda: torchmem.same_storage(x, v), repeats, inner=10000)
    print(f"torchmem.same_storage      {ours * 1e6:10.3f} us   -> {torchmem.same_storage(x, v)}")
    if tl is None:
        return
    theirs = best(lambda: tl.same_storage(x, v), max(2, repeats // 2))
    print(f"torchlinops.same_storage   {theirs * 1e6:10.0f} us   -> {tl.same_storage(x, v)}")
    print(f"ratio torchlinops / torchmem: {theirs / ours:,.0f}x  (target >= 1000x)")


def bench_reports(tl: Any, memlab_cls: Any, sizes: list[int], repeats: int) -> None:
    print("\n== report over N live tensors (each tool: gc.collect + gc.get_objects + report)")
    gc.collect()
    base_live = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    print(f"(interpreter already holds {base_live} tensors; {len(gc.get_objects()):,} gc objects)")
    header = f"{'N':>7} {'tm+gc':>11} {'tm default':>10} {'census':>10} {'torchlinops':>12} {'memlab':>10} {'tl/ours':>9} {'memlab/ours':>12}"
    print(header)
    results: dict[int, dict[str, float]] = {}
    for n in sizes:
        keep = [torch.zeros(4) for _ in range(n)]
        row: dict[str, float] = {}
        r = torchmem.inspect_memory(all_live=True)
        assert sum(1 for t in r.tensors if t.shape == (4,)) >= n
        row["ours"] = best(lambda: torchmem.inspect_memory(all_live=True, collect_garbage=True), repeats)
        row["census"] = best(lambda keep=keep: torchmem.inspect_memory(tensors=keep), repeats)
        gc.collect()
        row["nogc"] = best(lambda: torchmem.inspect_memory(all_live=True), repeats)  # the default
        if tl is not None:
            # MemReporter accumulates tensors across calls: a fresh reporter per call, as a user would
            row["tl"] = best(quiet(lambda: tl.MemReporter().report()), 1 if n >= 5000 else 2)
        if memlab_cls is not None:
            row["memlab"] = best(quiet(lambda: memlab_cls(pre_collect=True).report()), repeats)
        results[n] = row
        tl_s = f"{row['tl']:.3f} s" if "tl" in row else "skipped"
        ml_s = f"{row['memlab']:.3f} s" if "memlab" in row else "skipped"
        r1 = f"{row['tl'] / row['ours']:.0f}x" if "tl" in row else "-"
        r2 = f"{row['memlab'] / row['ours']:.1f}x" if "memlab" in row else "-"
        print(f"{n:>7} {row['ours']:>9.4f} s {row['nogc']:>8.4f} s {row['census']:>8.4f} s {tl_s:>12} {ml_s:>10} {r1:>9} {r2:>12}")
        del keep
        gc.collect()
    lo, hi = min(sizes), max(sizes)
    print(f"\ngrowth {lo} -> {hi} tensors ({hi / lo:.0f}x more):")
    print(f"  torchmem all-live + gc   : {results[hi]['ours'] / results[lo]['ours']:.1f}x time")
    print(f"  torchmem all-live default: {results[hi]['nogc'] / results[lo]['nogc']:.1f}x time")
    print(f"  torchmem census alone    : {results[hi]['census'] / results[lo]['census']:.1f}x time")
    if "tl" in results[hi]:
        print(f"  torchlinops MemReporter  : {results[hi]['tl'] / results[lo]['tl']:.1f}x time")
        print(f"ratio torchlinops / torchmem at {hi}, both with gc.collect: "
              f"{results[hi]['tl'] / results[hi]['ours']:,.0f}x  (target >= 50x)")
        print(f"ratio torchlinops / torchmem at {hi}, torchmem default (no gc.collect): "
              f"{results[hi]['tl'] / results[hi]['nogc']:,.0f}x")
    if hasattr(os, "getloadavg"):
        print(f"load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="1000,2000,5000,10000")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, torchmem {torchmem.__version__}, python {sys.version.split()[0]}")
    tl, why = torchlinops_device()
    if tl is None:
        print(f"SKIP torchlinops: {why}")
    ml, why_ml = memlab()
    if ml is None:
        print(f"SKIP pytorch_memlab: {why_ml}")
    bench_same_storage(tl, args.repeats)
    bench_reports(tl, ml, sizes, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
