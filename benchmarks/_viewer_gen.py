"""A synthetic training-loop snapshot in PyTorch's modern format, of any number of events.

Shapes follow the real files in tests/data: trace entries ``{action, addr, size, stream,
time_us, frames}`` with frames shared per stack (as in PyTorch's own pickles), blocks with
``address/size/requested_size/state/frames``. Used by benchmarks/bench_viewer.py and the
viewer's scaling test.
"""

from __future__ import annotations

import random
from typing import Any

MiB = 1 << 20


def make_snapshot(n_events: int, *, seed: int = 0, n_stacks: int = 300) -> dict[str, Any]:
    """Weights allocated once, then iterations that allocate activations and free them (LIFO-ish)
    with some temporaries, giving about ``n_events`` alloc/free_requested/free_completed entries.
    Segments at the end hold every live block (one segment per block, exact end state)."""
    rng = random.Random(seed)
    files = [f"/work/project/model/layer{i}.py" for i in range(40)]
    stacks = []
    for s in range(n_stacks):
        depth = rng.randint(4, 14)
        stacks.append([
            {"name": f"fn_{s}_{d}", "filename": rng.choice(files), "line": rng.randint(1, 900)}
            for d in range(depth)
        ])
    trace: list[dict[str, Any]] = []
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, stack)
    next_addr = 0x7F0000000000
    t = 1_700_000_000_000_000

    def alloc(size: int, st: int) -> int:
        nonlocal next_addr, t
        addr = next_addr
        next_addr += (size + 511) // 512 * 512 + 512
        t += rng.randint(1, 40)
        trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                      "time_us": t, "frames": stacks[st]})
        live[addr] = (size, st)
        return addr

    def free(addr: int) -> None:
        nonlocal t
        size, st = live.pop(addr)
        for action in ("free_requested", "free_completed"):
            t += rng.randint(1, 20)
            trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                          "time_us": t, "frames": stacks[st]})

    for _ in range(50):  # weights
        alloc(rng.choice([4, 16, 64]) * MiB, rng.randrange(n_stacks))
    while len(trace) < n_events:
        acts = []
        for _ in range(rng.randint(20, 200)):  # forward: activations pile up
            acts.append(alloc(rng.randint(1, 8 * MiB), rng.randrange(n_stacks)))
            if rng.random() < 0.3:  # a temporary
                free(alloc(rng.randint(512, MiB), rng.randrange(n_stacks)))
            if len(trace) >= n_events:
                break
        while acts and len(trace) < n_events:  # backward: freed in reverse
            free(acts.pop())
    segments = []
    for addr, (size, st) in sorted(live.items()):
        bsize = (size + 511) // 512 * 512
        segments.append({
            "device": 0, "address": addr, "total_size": bsize, "allocated_size": bsize,
            "active_size": bsize, "requested_size": size, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "blocks": [{"address": addr, "size": bsize, "requested_size": size,
                        "state": "active_allocated", "frames": stacks[st]}],
        })
    return {"segments": segments, "device_traces": [trace]}
