"""Benchmark: torchmem.sim.CachingAllocator vs the simplest correct model (linear-scan best fit).

The request stream (alloc/free only, as a real program issues them):

1. DeComFL's real trace (``tests/data/DeComFL__memory.pickle``, 7,946 allocs and 7,549 frees from
   an empty allocator), replayed ``--decomfl-reps`` times; the blocks still live at the end of
   each pass are freed before the next;
2. a synthetic training loop (``--train-steps`` steps of a 24-layer model: persistent weights,
   forward activations and temporaries, backward in reverse with gradient buffers, an
   optimizer step with temporaries, a side stream for prefetches).

Both models run in this process on the same stream: the fast simulator on all of it, the
reference model (``torchmem.sim._reference.ReferenceAllocator``, every search a linear scan of a
plain list of blocks) on the first ``--ref-requests`` requests (its cost grows with the number of
blocks, so all of it would take minutes); their event lists on that prefix are asserted equal,
and the fast one's events on the prefix are those of the full run. Prints requests/s for each,
the ratio, and the peak RSS of the process; also the fast simulator's speed with
``expandable_segments:True`` on the whole stream.

Run:  python benchmarks/bench_sim.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from torchmem.io import load_snapshot  # noqa: E402
from torchmem.sim import CachingAllocator  # noqa: E402
from torchmem.sim._reference import ReferenceAllocator  # noqa: E402

MiB = 1 << 20
# one request: (is_malloc, handle, size, stream); a free names the handle of its malloc
Op = tuple[bool, int, int, int]


def decomfl_ops(reps: int) -> list[Op]:
    snap = load_snapshot(HERE.parent / "tests" / "data" / "DeComFL__memory.pickle")
    trace = snap.trace(0)
    one: list[tuple[str, int, int, int]] = [
        (e.action, e.addr, e.size, e.stream) for e in trace if e.action in ("alloc", "free_completed")
    ]
    ops: list[Op] = []
    handle = 0
    for _ in range(reps):
        live: dict[int, int] = {}
        for action, addr, size, stream in one:
            if action == "alloc":
                live[addr] = handle
                ops.append((True, handle, size, stream))
                handle += 1
            else:
                ops.append((False, live.pop(addr), 0, 0))
        for h in live.values():
            ops.append((False, h, 0, 0))
    return ops


def training_ops(steps: int, first_handle: int, seed: int = 0) -> list[Op]:
    rng = random.Random(seed)
    ops: list[Op] = []
    handle = first_handle

    def alloc(size: int, stream: int = 0) -> int:
        nonlocal handle
        ops.append((True, handle, size, stream))
        handle += 1
        return handle - 1

    def free(h: int) -> None:
        ops.append((False, h, 0, 0))

    layers = 24
    hidden, batch_tokens = 2048, 4096
    weights = [alloc(4 * hidden * hidden * rng.choice((1, 3, 4))) for _ in range(layers)]
    weights += [alloc(4 * hidden) for _ in range(2 * layers)]
    grads: list[int] = []
    for step in range(steps):
        acts: list[int] = []
        for _layer in range(layers):
            x = alloc(2 * batch_tokens * hidden)
            tmp = [alloc(rng.choice((4, 8, 512, 4096, 2 * batch_tokens * hidden // 8))) for _ in range(3)]
            acts.append(x)
            acts.append(alloc(2 * batch_tokens * hidden * rng.choice((1, 4))))
            for t in tmp:
                free(t)
            if rng.random() < 0.2:  # a prefetch on a side stream
                free(alloc(rng.randint(1, 8) * MiB + rng.randint(0, 4096), stream=1))
        loss = alloc(4)
        for a in reversed(acts):
            g = alloc(rng.choice((512, 2 * batch_tokens * hidden)))
            free(a)
            free(g)
        free(loss)
        if step == 0:
            grads = [alloc(4 * hidden * hidden) for _ in range(layers)]
        for _g in grads:
            t = alloc(4 * hidden * hidden)
            free(t)
    for h in weights + grads:
        free(h)
    return ops


def drive(sim: CachingAllocator | ReferenceAllocator, ops: list[Op]) -> float:
    handles: dict[int, int] = {}
    malloc, free = sim.malloc, sim.free
    gc.disable()
    t0 = time.perf_counter()
    for is_malloc, h, size, stream in ops:
        if is_malloc:
            handles[h] = malloc(size, stream)
        else:
            free(handles.pop(h))
    dt = time.perf_counter() - t0
    gc.enable()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (about 100k requests)")
    ap.add_argument("--decomfl-reps", type=int, default=None)
    ap.add_argument("--train-steps", type=int, default=None)
    ap.add_argument("--ref-requests", type=int, default=None)
    args = ap.parse_args()
    reps = args.decomfl_reps if args.decomfl_reps is not None else (4 if args.quick else 40)
    steps = args.train_steps if args.train_steps is not None else (15 if args.quick else 1000)
    ref_n = args.ref_requests if args.ref_requests is not None else (15_000 if args.quick else 60_000)

    ops = decomfl_ops(reps)
    n_decomfl = len(ops)
    ops += training_ops(steps, first_handle=len(ops) + 1)
    n = len(ops)
    print(f"request stream: {n:,} requests ({n_decomfl:,} from {reps} passes of DeComFL's trace, "
          f"{n - n_decomfl:,} from a {steps}-step synthetic training loop)")

    fast = CachingAllocator()
    dt = drive(fast, ops)
    print(f"torchmem.sim.CachingAllocator: {n:,} requests in {dt:.2f} s = {n / dt:,.0f} requests/s "
          f"({len(fast.events):,} events, peak reserved {fast.max_reserved_bytes / MiB:,.0f} MiB)")

    head = fast.events[: 4 * ref_n]  # enough to cover the reference's prefix
    del fast
    gc.collect()
    fast_x = CachingAllocator(config="expandable_segments:True")
    dt_x = drive(fast_x, ops)
    print(f"  with expandable_segments:True: {dt_x:.2f} s = {n / dt_x:,.0f} requests/s "
          f"({len(fast_x.events):,} events, peak reserved {fast_x.max_reserved_bytes / MiB:,.0f} MiB)")

    prefix = ops[:ref_n]
    fast_p = CachingAllocator()
    dt_fast_p = drive(fast_p, prefix)
    ref = ReferenceAllocator()
    dt_ref = drive(ref, prefix)
    assert ref.events == fast_p.events, "the reference model and the simulator disagree"
    assert head[: len(fast_p.events)] == fast_p.events
    print(f"on the first {len(prefix):,} requests (event lists asserted equal, "
          f"{len(ref.events):,} events):")
    print(f"  reference (linear scan):  {dt_ref:.2f} s = {len(prefix) / dt_ref:,.0f} requests/s")
    print(f"  torchmem.sim:             {dt_fast_p:.3f} s = {len(prefix) / dt_fast_p:,.0f} requests/s")
    print(f"  ratio: torchmem.sim is {dt_ref / dt_fast_p:,.1f}x faster")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {rss:,.0f} MiB (mostly the {n:,}-request stream and one "
          "run's event list, held at once)")


if __name__ == "__main__":
    main()
