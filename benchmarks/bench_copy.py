"""Benchmark: memory-aware deep copy and dtype move vs copy.deepcopy, nn.Module.to, torchlinops 0.8.3.

Model (~222 MB of float32): an ``Embedding(50000, 1024)`` whose weight is tied to the output
head, four ``Linear(1024, 1024)``, and two buffers that *view* the embedding weight (its
transpose and its first 1000 rows). Its unique bytes are the embedding plus the linears.

Deep copy, side by side:
- ``torchmem.memory_aware_deepcopy``, ``copy.deepcopy``, torchlinops' ``memory_aware_deepcopy``;
- time: min of --repeats in this process;
- peak RSS growth: each tool in a fresh subprocess (build the model, then RSS before ->
  ``getrusage`` max RSS after, cross-checked by a 1 ms psutil sampler), divided by the model's
  unique bytes (target <= 1.05 for torchmem) ;
- what the copy holds: its unique bytes, whether the buffer still views the weight, whether it
  shares any storage with the original (it must not).

dtype move (float32 -> float16, in place): ``torchmem.memory_aware_to`` vs ``nn.Module.to``
(torchlinops' memory_aware_to takes no dtype), same measurements.

Run:  python benchmarks/bench_copy.py [--vocab 50000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import psutil  # noqa: I001
import torch
from torch import nn

import torchmem
from _competitors import torchlinops_device

DIM = 1024


class BigTied(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.body = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(4)])
        # built on meta, then tied: a real head weight would be a 200 MB transient that hides
        # the tools' peaks in getrusage's max RSS
        self.head = nn.Linear(DIM, vocab, bias=False, device="meta")
        self.head.weight = self.embed.weight
        self.register_buffer("embed_t", self.embed.weight.detach().t())
        self.register_buffer("first_rows", self.embed.weight.detach()[:1000])


def build(vocab: int) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        return BigTied(vocab)


def tools() -> dict[str, tuple[str, Callable[[nn.Module], Any] | None, str]]:
    """name -> (kind, fn or None, reason if None)."""
    tl, why = torchlinops_device()
    out: dict[str, tuple[str, Callable[[nn.Module], Any] | None, str]] = {
        "torchmem.memory_aware_deepcopy": ("copy", torchmem.memory_aware_deepcopy, ""),
        "copy.deepcopy": ("copy", copy.deepcopy, ""),
        "torchlinops.memory_aware_deepcopy": ("copy", tl.memory_aware_deepcopy if tl else None, why),
        "torchmem.memory_aware_to(float16)": (
            "move", lambda m: torchmem.memory_aware_to(m, dtype=torch.float16), ""),
        "nn.Module.to(float16)": ("move", lambda m: m.to(torch.float16), ""),
    }
    return out


def describe(orig_ids: set[int], m: nn.Module) -> dict[str, Any]:
    r = torchmem.inspect_memory(m)
    ids = {torchmem.storage_id(t) for t in m.state_dict(keep_vars=True).values()}
    return {
        "unique_bytes": r.total_unique_bytes,
        "buffer_views_weight": torchmem.same_storage(m.embed_t, m.embed.weight),
        "tied": m.head.weight is m.embed.weight,
        "shares_storage_with_original": bool(ids & orig_ids),
    }


def child(tool: str, vocab: int) -> None:
    kind, fn, _ = tools()[tool]
    assert fn is not None
    m = build(vocab)
    orig_ids = {torchmem.storage_id(t) for t in m.state_dict(keep_vars=True).values()}
    unique = torchmem.inspect_memory(m).total_unique_bytes
    gc.collect()
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [rss_before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    result = fn(m)
    stop.set()
    th.join()
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    growth = peak[0] - rss_before
    # getrusage's max RSS is exact but only usable when it was not already above the current RSS
    # (Linux children inherit the parent's high-water mark across fork/exec)
    maxrss_valid = maxrss_before <= rss_before + 4 * 1024 * 1024
    if maxrss_valid:
        growth = max(growth, maxrss_after - rss_before)
    info = describe(orig_ids if kind == "copy" else set(), result)
    print(json.dumps({
        "tool": tool, "unique": unique, "growth": growth, "maxrss_valid": maxrss_valid, **info,
    }))


def measure_rss(tool: str, vocab: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", tool, "--vocab", str(vocab)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        return {"tool": tool, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.vocab)
        return 0
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, torchmem {torchmem.__version__}, {os.cpu_count()} cpus (shared)")
    all_tools = tools()
    for name, (_, fn, why) in all_tools.items():
        if fn is None:
            print(f"SKIP {name}: {why}")
    # RSS first, while this parent process is small (children inherit its max-RSS mark)
    rows = {name: measure_rss(name, args.vocab) for name, (_, fn, _) in all_tools.items() if fn is not None}
    m = build(args.vocab)
    rep = torchmem.inspect_memory(m)
    unique = rep.total_unique_bytes
    print(f"model: unique bytes {torchmem.format_bytes(unique)} ({unique:,}); naive sum "
          f"{torchmem.format_bytes(rep.naive_bytes['cpu'])}")
    del m, rep
    times: dict[str, float] = {}
    for name, (_kind, fn, _why) in all_tools.items():
        if fn is None:
            continue
        best = float("inf")
        for _ in range(args.repeats):
            m = build(args.vocab)
            gc.collect()
            t0 = time.perf_counter()
            out = fn(m)
            best = min(best, time.perf_counter() - t0)
            del out, m
            gc.collect()
        times[name] = best
    print(f"\n== time (min of {args.repeats}) and peak RSS growth (fresh subprocess per tool)")
    print(f"{'tool':<36} {'time':>8} {'RSS growth':>12} {'/unique':>8} {'result unique':>14} "
          f"{'views kept':>10} {'tied':>5} {'independent':>11}")
    for name in times:
        r = rows[name]
        if "error" in r:
            print(f"{name:<36} {times[name]:>7.3f}s  ERROR {r['error']}")
            continue
        indep = "-" if all_tools[name][0] == "move" else ("no" if r["shares_storage_with_original"] else "yes")
        print(f"{name:<36} {times[name]:>7.3f}s {torchmem.format_bytes(r['growth']):>12} "
              f"{r['growth'] / unique:>8.3f} {torchmem.format_bytes(r['unique_bytes']):>14} "
              f"{str(r['buffer_views_weight']):>10} {str(r['tied']):>5} {indep:>11}"
              + ("" if r.get("maxrss_valid") else "  (sampled RSS only)"))
    ours, dc = "torchmem.memory_aware_deepcopy", "copy.deepcopy"
    print("\nratios:")
    print(f"  deep copy time, torchmem / copy.deepcopy      : {times[ours] / times[dc]:.2f}  (target <= 1.2)")
    tlname = "torchlinops.memory_aware_deepcopy"
    if tlname in rows and rows[tlname].get("shares_storage_with_original"):
        print("  torchlinops' copy shares storage with the original (not a deep copy; its time is not comparable)")
    if "growth" in rows.get(ours, {}):
        print(f"  deep copy peak RSS growth / unique bytes      : {rows[ours]['growth'] / unique:.3f}  (target <= 1.05)")
    if "growth" in rows.get(dc, {}):
        print(f"  copy.deepcopy peak RSS growth / unique bytes  : {rows[dc]['growth'] / unique:.3f}")
    a, b = "torchmem.memory_aware_to(float16)", "nn.Module.to(float16)"
    if "growth" in rows.get(a, {}) and "growth" in rows.get(b, {}):
        print(f"  float16 move peak RSS growth, Module.to / torchmem: {rows[b]['growth'] / max(rows[a]['growth'], 1):.2f}")
        print(f"  float16 move time, torchmem / Module.to          : {times[a] / times[b]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
