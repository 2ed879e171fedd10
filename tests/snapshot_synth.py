"""Synthetic PyTorch-format snapshots for the cases the real files lack (built in tests, never
committed as binaries). Each builder returns the raw dict (or list) exactly as PyTorch would pickle
it, consistent between the segments at the end and the device trace.
"""

from __future__ import annotations

from typing import Any

MiB = 1024**2
F_TRAIN = {"filename": "/home/u/train.py", "line": 10, "name": "step"}
F_MODEL = {"filename": "/home/u/model.py", "line": 42, "name": "forward"}
F_TORCH = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1,
           "name": "_call_impl"}
F_CPP = {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}
STACK_A = [F_CPP, F_TORCH, F_MODEL, F_TRAIN]  # innermost first
STACK_B = [F_TRAIN]


def _e(action: str, addr: int, size: int, stream: int = 0, t: int = 0, frames=None) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t,
            "frames": frames if frames is not None else []}


def _seg(device: int, addr: int, total: int, blocks: list[dict], *, stream: int = 0,
         segment_type: str = "large", expandable: bool = False) -> dict:
    active = [b for b in blocks if b["state"] != "inactive"]
    return {
        "device": device, "address": addr, "total_size": total,
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": stream, "segment_type": segment_type, "segment_pool_id": (0, 0),
        "is_expandable": expandable, "frames": [], "blocks": blocks,
    }


def _b(addr: int, size: int, req: int, state: str, frames=None) -> dict:
    return {"address": addr, "size": size, "requested_size": req, "state": state,
            "frames": frames if frames is not None else []}


def two_streams() -> dict[str, Any]:
    """Stream 0: a small segment with one live block; stream 7: a large segment, b freed, c live."""
    s0, s7 = 0x10000000, 0x20000000
    trace = [
        _e("segment_alloc", s0, 2 * MiB, 0, 1, STACK_B),
        _e("alloc", s0, 1000, 0, 2, STACK_B),
        _e("segment_alloc", s7, 20 * MiB, 7, 3, STACK_A),
        _e("alloc", s7, 3 * MiB, 7, 4, STACK_A),
        _e("alloc", s7 + 3 * MiB, 5 * MiB - 100, 7, 5, STACK_A),
        _e("free_requested", s7, 3 * MiB, 7, 6, STACK_A),
        _e("free_completed", s7, 3 * MiB, 7, 7, STACK_A),
    ]
    segs = [
        _seg(0, s0, 2 * MiB, [_b(s0, 1024, 1000, "active_allocated", STACK_B),
                              _b(s0 + 1024, 2 * MiB - 1024, 0, "inactive")],
             segment_type="small"),
        _seg(0, s7, 20 * MiB, [_b(s7, 3 * MiB, 0, "inactive"),
                               _b(s7 + 3 * MiB, 5 * MiB, 5 * MiB - 100, "active_allocated", STACK_A),
                               _b(s7 + 8 * MiB, 12 * MiB, 0, "inactive")], stream=7),
    ]
    return {"segments": segs, "device_traces": [trace]}


def expandable() -> dict[str, Any]:
    """Expandable segment: map 20 MiB, alloc, map 20 MiB more, alloc, free, unmap the tail.

    At the end one contiguous mapped range of 20 MiB with one live 8 MiB block remains.
    """
    base = 0x7F0000000000
    trace = [
        _e("segment_map", base, 20 * MiB, 0, 1),
        _e("alloc", base, 8 * MiB, 0, 2, STACK_B),
        _e("segment_map", base + 20 * MiB, 20 * MiB, 0, 3),
        _e("alloc", base + 8 * MiB, 30 * MiB, 0, 4, STACK_A),
        _e("free_requested", base + 8 * MiB, 30 * MiB, 0, 5, STACK_A),
        _e("free_completed", base + 8 * MiB, 30 * MiB, 0, 6, STACK_A),
        _e("segment_unmap", base + 20 * MiB, 20 * MiB, 0, 7),
    ]
    segs = [_seg(0, base, 20 * MiB, [_b(base, 8 * MiB, 8 * MiB, "active_allocated", STACK_B),
                                     _b(base + 8 * MiB, 12 * MiB, 0, "inactive")],
                 expandable=True)]
    return {"segments": segs, "device_traces": [trace],
            "allocator_settings": {"expandable_segments": True, "max_split_size": -1}}


def expandable_ranges() -> dict[str, Any]:
    """Expandable segments at driver-chosen addresses, written by hand from the allocator's rules
    (20 MiB large pages, 2 MiB small pages, lowest-address mapping, 512 B splitting):

    map the large range's first page, alloc 8 MiB; a 4 KiB request opens the small range; 30 MiB
    grows the large range by a page (the free 12 MiB tail plus the new page, merged); both large
    blocks freed merge into one free 40 MiB block; ``empty_cache`` unmaps its two pages, so the
    large range is released (the small one keeps its live block); 50 MiB then opens a new large
    range at another address (three pages), and 1 MiB + 1 B (large pool) splits its free tail.
    """
    big, small, again = 0x302000000, 0x1948000000, 0x6000000000
    trace = [
        _e("segment_map", big, 20 * MiB, 0, 1),
        _e("alloc", big, 8 * MiB, 0, 2),
        _e("segment_map", small, 2 * MiB, 0, 3),
        _e("alloc", small, 4096, 0, 4),
        _e("segment_map", big + 20 * MiB, 20 * MiB, 0, 5),
        _e("alloc", big + 8 * MiB, 30 * MiB, 0, 6),
        _e("free_requested", big, 8 * MiB, 0, 7),
        _e("free_completed", big, 8 * MiB, 0, 8),
        _e("free_requested", big + 8 * MiB, 30 * MiB, 0, 9),
        _e("free_completed", big + 8 * MiB, 30 * MiB, 0, 10),
        _e("segment_unmap", big, 40 * MiB, 0, 11),
        _e("segment_map", again, 60 * MiB, 0, 12),
        _e("alloc", again, 50 * MiB, 0, 13),
        _e("alloc", again + 50 * MiB, MiB + 1, 0, 14),
    ]
    segs = [
        _seg(0, small, 2 * MiB, [_b(small, 4096, 4096, "active_allocated"),
                                 _b(small + 4096, 2 * MiB - 4096, 0, "inactive")],
             segment_type="small", expandable=True),
        _seg(0, again, 60 * MiB, [_b(again, 50 * MiB, 50 * MiB, "active_allocated"),
                                  _b(again + 50 * MiB, MiB + 512, MiB + 1, "active_allocated"),
                                  _b(again + 51 * MiB + 512, 9 * MiB - 512, 0, "inactive")],
             expandable=True),
    ]
    return {"segments": segs, "device_traces": [trace],
            "allocator_settings": {"expandable_segments": True, "max_split_size": -1}}


def oom(fragmented: bool) -> dict[str, Any]:
    """A 40 MiB segment with two live 10 MiB blocks and two free 10 MiB holes; then a 20 MiB
    request fails. ``fragmented``: the device still had 5 MiB free (10+10+5 >= 20: fragmentation);
    otherwise the request is 40 MiB (20+5 < 40: exhaustion)."""
    base = 0x30000000
    req = 20 * MiB if fragmented else 40 * MiB
    trace = [
        _e("segment_alloc", base, 40 * MiB, 0, 1),
        _e("alloc", base, 10 * MiB, 0, 2, STACK_A),
        _e("alloc", base + 10 * MiB, 10 * MiB, 0, 3, STACK_B),
        _e("alloc", base + 20 * MiB, 10 * MiB, 0, 4, STACK_A),
        _e("alloc", base + 30 * MiB, 10 * MiB, 0, 5, STACK_B),
        _e("free_requested", base + 10 * MiB, 10 * MiB, 0, 6, STACK_B),
        _e("free_completed", base + 10 * MiB, 10 * MiB, 0, 7, STACK_B),
        _e("free_requested", base + 30 * MiB, 10 * MiB, 0, 8, STACK_B),
        _e("free_completed", base + 30 * MiB, 10 * MiB, 0, 9, STACK_B),
        {"action": "oom", "device_free": 5 * MiB, "size": req, "stream": 0, "time_us": 10,
         "frames": STACK_A},
    ]
    segs = [_seg(0, base, 40 * MiB, [
        _b(base, 10 * MiB, 10 * MiB, "active_allocated", STACK_A),
        _b(base + 10 * MiB, 10 * MiB, 0, "inactive"),
        _b(base + 20 * MiB, 10 * MiB, 10 * MiB, "active_allocated", STACK_A),
        _b(base + 30 * MiB, 10 * MiB, 0, "inactive"),
    ])]
    return {"segments": segs, "device_traces": [trace]}


def pending_free_and_split() -> dict[str, Any]:
    """max_split_size set, one active_pending_free block (free_requested, not completed), and a
    trace that starts mid-run (a block freed in the trace was allocated before it started)."""
    base = 0x40000000
    trace = [
        _e("free_requested", base + 4 * MiB, 2 * MiB, 0, 1, STACK_B),
        _e("free_completed", base + 4 * MiB, 2 * MiB, 0, 2, STACK_B),
        _e("alloc", base + 6 * MiB, 3 * MiB - 7, 0, 3, STACK_A),
        _e("free_requested", base + 6 * MiB, 3 * MiB - 7, 0, 4, STACK_A),
    ]
    segs = [_seg(0, base, 10 * MiB, [
        _b(base, 4 * MiB, 4 * MiB - 512, "active_allocated", STACK_B),
        _b(base + 4 * MiB, 2 * MiB, 0, "inactive"),
        _b(base + 6 * MiB, 3 * MiB, 3 * MiB - 7, "active_pending_free", STACK_A),
        _b(base + 9 * MiB, 1 * MiB, 0, "inactive"),
    ])]
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:200", "max_split_size": 200 * MiB,
                "garbage_collection_threshold": 0.0, "expandable_segments": False,
                "roundup_power2_divisions": {"1": 0, "2": 4}}
    return {"segments": segs, "device_traces": [trace], "allocator_settings": settings,
            "external_annotations": [{"stage": "START", "name": "fwd", "device": 0, "time_us": 1}]}


def list_format() -> list[dict[str, Any]]:
    """The bare list of segments that ``torch.cuda.memory_snapshot()`` returns (two devices)."""
    return [
        _seg(0, 0x1000000, 2 * MiB, [_b(0x1000000, 512, 100, "active_allocated", STACK_B),
                                     _b(0x1000200, 2 * MiB - 512, 0, "inactive")],
             segment_type="small"),
        _seg(1, 0x5000000, 20 * MiB, [_b(0x5000000, 20 * MiB, 20 * MiB, "active_allocated")]),
    ]
