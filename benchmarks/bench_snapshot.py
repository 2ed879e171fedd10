"""Benchmark: torchmem's snapshot load + stats + peak vs torch.cuda._memory_viz segsum + trace.

Generates a PyTorch-format snapshot with N trace entries (default 1,000,000; modern format with
time_us, compile_context, user_metadata; stacks shared between entries as PyTorch's own pickles
share them), then, in one run:

Times are wall clock and process CPU time (``time.process_time``), min of the repeats; on a
shared machine the CPU time is the steadier figure.

1. time (min of --repeats) of ``torchmem``: ``load_snapshot`` + ``snapshot_stats`` + ``snapshot_peak``
2. time of ``torch.cuda._memory_viz``: ``pickle.load`` + ``segsum`` + ``trace`` on the same file
3. memory of the load, in separate subprocesses:
   - tracemalloc: size of the object ``pickle.load`` returns (current after the load) vs the
     *peak* traced during ``load_snapshot`` (valid here: a snapshot is only pure-Python objects
     and ``array`` buffers, all allocated through Python's allocator);
   - peak RSS delta of each load: ``VmHWM`` after the load (the watermark is reset just before
     it through ``/proc/self/clear_refs``) minus ``VmRSS`` before it (Linux).

Run:  python benchmarks/bench_snapshot.py [--events 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

MiB = 1024**2
SLOT = MiB  # each slot is one 1 MiB block; 20 slots per 20 MiB segment
SEG = 20 * MiB


def _stacks(rng: random.Random, n: int) -> list[list[dict]]:
    files = [f"/home/user/project/{name}.py" for name in ("train", "model", "data", "optim", "layers")]
    torch_files = [
        "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
        "/venv/lib/python3.11/site-packages/torch/nn/functional.py",
    ]
    frames = [
        {"filename": rng.choice(files), "line": rng.randint(1, 900), "name": f"fn{i}"}
        for i in range(400)
    ] + [{"filename": f, "line": rng.randint(1, 2000), "name": "_call_impl"} for f in torch_files]
    out = []
    for _ in range(n):
        depth = rng.randint(6, 16)
        out.append([rng.choice(frames) for _ in range(depth)])
    return out


def generate(path: str, n_events: int, seed: int = 0, segments: int = 1000) -> None:
    """Write a consistent modern-format snapshot with ``n_events`` trace entries to ``path``."""
    rng = random.Random(seed)
    stacks = _stacks(rng, 300)
    base = 0x7F0000000000
    free_slots = list(range(segments * (SEG // SLOT)))
    rng.shuffle(free_slots)
    live: dict[int, tuple[int, list[dict]]] = {}
    entries: list[dict] = []
    t = 1_700_000_000_000_000
    target = len(free_slots) // 2
    while len(entries) < n_events:
        t += rng.randint(1, 50)
        grow = len(live) < target * (0.6 + 0.4 * rng.random()) and free_slots
        if grow or not live:
            slot = free_slots.pop()
            addr = base + slot * SLOT
            size = rng.randint(1, SLOT // 512) * 512 - rng.randint(0, 511)
            fr = rng.choice(stacks)
            live[addr] = (size, fr)
            entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                            "time_us": t, "compile_context": "N/A", "user_metadata": "",
                            "frames": fr})
        else:
            addr = rng.choice(list(live)) if len(live) < 64 else next(iter(live))
            size, fr = live.pop(addr)
            for action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": addr, "size": size, "stream": 0,
                                "time_us": t, "compile_context": "N/A", "user_metadata": "",
                                "frames": fr})
            free_slots.insert(rng.randrange(len(free_slots) + 1), (addr - base) // SLOT)
    segs = []
    for s in range(segments):
        saddr = base + s * SEG
        blocks = []
        for k in range(SEG // SLOT):
            a = saddr + k * SLOT
            if a in live:
                size, fr = live[a]
                blocks.append({"address": a, "size": SLOT, "requested_size": size,
                               "state": "active_allocated", "frames": fr})
            else:
                blocks.append({"address": a, "size": SLOT, "requested_size": 0,
                               "state": "inactive", "frames": []})
        act = [b for b in blocks if b["state"] != "inactive"]
        segs.append({"device": 0, "address": saddr, "total_size": SEG,
                     "allocated_size": sum(b["size"] for b in act),
                     "active_size": sum(b["size"] for b in act),
                     "requested_size": sum(b["requested_size"] for b in act),
                     "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                     "is_expandable": False, "frames": [], "blocks": blocks})
    data = {"segments": segs, "device_traces": [entries[:n_events]],
            "allocator_settings": {"max_split_size": -1, "expandable_segments": False},
            "external_annotations": []}
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=4)


def _ours(path: str) -> tuple[float, float, int]:
    from torchmem.analysis._peak import snapshot_peak
    from torchmem.analysis._stats import snapshot_stats
    from torchmem.io.snapshot_file import load_snapshot

    t0, c0 = time.perf_counter(), time.process_time()
    snap = load_snapshot(path)
    stats = snapshot_stats(snap)
    peak = snapshot_peak(snap)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert stats.devices[0].segments > 0
    return dt, dc, peak.devices[0].peak_allocated_bytes


def _theirs(path: str) -> tuple[float, float]:
    import io
    from contextlib import redirect_stdout

    from torch.cuda import _memory_viz

    t0, c0 = time.perf_counter(), time.process_time()
    with open(path, "rb") as f:
        data = pickle.load(f)
    _memory_viz.segsum(data)
    with redirect_stdout(io.StringIO()):
        _memory_viz.trace(data)
    return time.perf_counter() - t0, time.process_time() - c0


_MEM_CHILD = r"""
import sys, resource, tracemalloc, pickle, gc
sys.path.insert(0, {src!r})
mode, path = sys.argv[1], sys.argv[2]
if mode.startswith("ours"):
    from torchmem.io.snapshot_file import load_snapshot
gc.collect()
def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(key)
try:  # reset the peak-RSS watermark (Linux), so interpreter start-up does not count
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before = status_kib("VmRSS")
if mode.endswith("tracemalloc"):
    tracemalloc.start()
if mode.startswith("plain"):
    with open(path, "rb") as f:
        obj = pickle.load(f)
else:
    obj = load_snapshot(path)
if mode.endswith("tracemalloc"):
    cur, peak = tracemalloc.get_traced_memory()
    print(cur, peak)
else:
    print((status_kib("VmHWM") - before) * 1024, (status_kib("VmRSS") - before) * 1024)
"""


def _mem(mode: str, path: str) -> tuple[int, int]:
    code = _MEM_CHILD.format(src=str(HERE.parent / "src"))
    out = subprocess.run([sys.executable, "-c", code, mode, path], check=True,
                         capture_output=True, text=True).stdout.split()
    return int(out[0]), int(out[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--theirs-repeats", type=int, default=2)
    ap.add_argument("--segments", type=int, default=1000,
                    help="20 MiB segments in the generated snapshot (the real snapshots in "
                         "tests/data have 61 to 1722)")
    ap.add_argument("--keep", default=None, help="write the generated snapshot here and keep it")
    args = ap.parse_args(argv)

    tmp = tempfile.mkdtemp()
    path = args.keep or os.path.join(tmp, f"snap_{args.events}.pickle")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        generate(path, args.events, segments=args.segments)
        print(f"generated {path}: {os.path.getsize(path) / MiB:.1f} MiB in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{args.events} trace entries, {args.segments} segments, "
          f"{os.path.getsize(path) / MiB:.1f} MiB pickle; "
          f"machine: {os.cpu_count()} cores (shared), load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    if args.repeats < 1 or args.theirs_repeats < 1:
        print("nothing to time (repeats < 1)")
        return 0
    ours, ours_cpu, theirs, theirs_cpu = [], [], [], []
    peak = 0
    for _ in range(args.repeats):
        dt, dc, peak = _ours(path)
        ours.append(dt)
        ours_cpu.append(dc)
        print(f"  torchmem load+stats+peak: {dt:.2f} s wall, {dc:.2f} s CPU", flush=True)
    for _ in range(args.theirs_repeats):
        dt, dc = _theirs(path)
        theirs.append(dt)
        theirs_cpu.append(dc)
        print(f"  _memory_viz load+segsum+trace: {dt:.2f} s wall, {dc:.2f} s CPU", flush=True)
    print(f"torchmem load+stats+peak (min of {args.repeats}): {min(ours):.2f} s wall, "
          f"{min(ours_cpu):.2f} s CPU (target <= 5 s); peak allocated {peak} bytes")
    print(f"_memory_viz pickle.load+segsum+trace (min of {args.theirs_repeats}): "
          f"{min(theirs):.2f} s wall, {min(theirs_cpu):.2f} s CPU")
    print(f"speed-up: {min(theirs) / min(ours):.1f}x wall, {min(theirs_cpu) / min(ours_cpu):.1f}x "
          f"CPU time (target >= 10x); load average now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    plain_cur, _ = _mem("plain-tracemalloc", path)
    _, ours_peak = _mem("ours-tracemalloc", path)
    print(f"tracemalloc: plain pickle.load object {plain_cur / MiB:.0f} MiB; torchmem load peak "
          f"{ours_peak / MiB:.0f} MiB; ratio {ours_peak / plain_cur:.2f}x (target <= 3x)")
    plain_rss, plain_after = _mem("plain-rss", path)
    ours_rss, ours_after = _mem("ours-rss", path)
    print(f"peak RSS delta: plain pickle.load {plain_rss / MiB:.0f} MiB; torchmem load "
          f"{ours_rss / MiB:.0f} MiB (ratio {ours_rss / plain_rss:.2f}x, target <= 3x); "
          f"held after the load: plain {plain_after / MiB:.0f} MiB, torchmem "
          f"{ours_after / MiB:.0f} MiB")
    if not args.keep:
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
