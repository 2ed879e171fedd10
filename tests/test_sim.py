"""torchmem.sim: the caching-allocator simulator against hand-computed layouts and a real trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError, TorchmemError
from torchmem.io import load_snapshot
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.sim import CachingAllocator, replay, round_size, segment_size

MiB = 1 << 20
DATA = Path(__file__).resolve().parent / "data"


def _segment_allocs(a: CachingAllocator) -> list[tuple[int, int]]:
    return [(size, stream) for act, _, size, stream in a.events if act == "segment_alloc"]


@pytest.mark.parametrize(
    ("size", "rounded"),
    [(1, 512), (511, 512), (512, 512), (513, 1024), (MiB, MiB), (MiB + 1, MiB + 512),
     (10 * MiB, 10 * MiB), (10 * MiB + 1, 10 * MiB + 512)],
)
def test_round_size(size: int, rounded: int) -> None:
    assert round_size(size) == rounded


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (21 * MiB, 22 * MiB), (22 * MiB, 22 * MiB)],
)
def test_segment_size(rounded: int, segment: int) -> None:
    assert segment_size(rounded) == segment


@pytest.mark.parametrize(
    ("size", "segment"),
    [(1, 2 * MiB), (MiB, 2 * MiB), (MiB + 1, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (10 * MiB + 1, 12 * MiB)],
)
def test_first_request_makes_one_segment_of_the_rule_size(size: int, segment: int) -> None:
    a = CachingAllocator()
    a.malloc(size)
    assert _segment_allocs(a) == [(segment, 0)]
    assert a.reserved_bytes == segment
    assert a.allocated_bytes == round_size(size)  # each of these leaves enough to split


def test_small_and_large_pools_do_not_share() -> None:
    a = CachingAllocator()
    a.malloc(MiB + 1)  # large pool (rounded 1 MiB + 512): 20 MiB segment, split
    a.malloc(MiB)  # small pool: a 2 MiB segment, although the large segment has 19 MiB free
    assert _segment_allocs(a) == [(20 * MiB, 0), (2 * MiB, 0)]
    a.malloc(1)  # reuses the small segment's free tail
    assert len(_segment_allocs(a)) == 2
    small = [seg for seg in a.layout() if seg[1] == 2 * MiB][0]
    assert small[3] == [(0, MiB, True), (MiB, 512, True), (MiB + 512, MiB - 512, False)]


def test_small_pool_splits_down_to_512_bytes() -> None:
    a = CachingAllocator()
    a.malloc(MiB)
    a.malloc(MiB - 512)
    assert a.layout()[0][3] == [(0, MiB, True), (MiB, MiB - 512, True), (2 * MiB - 512, 512, False)]
    a.malloc(1)  # takes the 512 B leftover, no new segment
    assert len(_segment_allocs(a)) == 1
    assert a.layout()[0][3] == [(0, MiB, True), (MiB, MiB - 512, True), (2 * MiB - 512, 512, True)]


def test_large_pool_splits_only_when_more_than_1_mib_is_left() -> None:
    a = CachingAllocator()
    a.malloc(19 * MiB)  # leftover exactly 1 MiB: not split, the block carries the slack
    assert a.layout()[0][3] == [(0, 20 * MiB, True)]
    assert a.allocated_bytes == 20 * MiB
    b = CachingAllocator()
    b.malloc(19 * MiB - 512)  # leftover 1 MiB + 512: split
    assert b.layout()[0][3] == [(0, 19 * MiB - 512, True), (19 * MiB - 512, MiB + 512, False)]
    c = CachingAllocator()
    c.malloc(10 * MiB + 1)  # 12 MiB segment, leftover 1.5 MiB - 512: split
    assert c.layout()[0][3] == [(0, 10 * MiB + 512, True), (10 * MiB + 512, 2 * MiB - 512, False)]


def test_free_merges_with_free_neighbours() -> None:
    a = CachingAllocator()
    x, y, z = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(4 * MiB)
    assert (y - x, z - y) == (4 * MiB, 4 * MiB)
    a.free(x)
    a.free(z)  # merges with the free tail
    assert a.layout()[0][3] == [(0, 4 * MiB, False), (4 * MiB, 4 * MiB, True), (8 * MiB, 12 * MiB, False)]
    a.free(y)  # merges with both neighbours: one free block, the whole segment
    assert a.layout()[0][3] == [(0, 20 * MiB, False)]
    assert a.events[-6:] == [
        ("free_requested", x, 4 * MiB, 0), ("free_completed", x, 4 * MiB, 0),
        ("free_requested", z, 4 * MiB, 0), ("free_completed", z, 4 * MiB, 0),
        ("free_requested", y, 4 * MiB, 0), ("free_completed", y, 4 * MiB, 0),
    ]


def test_best_fit_takes_the_smallest_fitting_block_then_the_lowest_address() -> None:
    a = CachingAllocator()
    p = [a.malloc(n * MiB) for n in (3, 1, 2, 1, 4)]
    # sizes 3, 1 (small pool), 2, 1 (small), 4 MiB: large segment holds 3 | 2 | 4 | 11 free
    a.free(p[0])  # free 3 MiB hole at offset 0
    a.free(p[4])  # 4 MiB merges with the tail: 15 MiB free at offset 5
    q = a.malloc(3 * MiB - 512)  # best fit: the 3 MiB hole (512 B left, not more than 1 MiB: not split)
    assert q == p[0]
    r = a.malloc(2 * MiB)  # the only fit is the 15 MiB tail, split
    assert r == p[2] + 2 * MiB
    big = a.layout()
    large = [s for s in big if s[1] == 20 * MiB][0]
    assert large[3] == [(0, 3 * MiB, True), (3 * MiB, 2 * MiB, True), (5 * MiB, 2 * MiB, True),
                        (7 * MiB, 13 * MiB, False)]


def test_best_fit_ties_go_to_the_lower_address() -> None:
    a = CachingAllocator()
    x1, _, x2, _ = a.malloc(2 * MiB), a.malloc(2 * MiB), a.malloc(2 * MiB), a.malloc(2 * MiB)
    a.free(x2)
    a.free(x1)
    assert a.malloc(2 * MiB) == x1
    assert a.malloc(2 * MiB) == x2


def test_streams_do_not_share_free_blocks() -> None:
    a = CachingAllocator()
    x = a.malloc(4 * MiB, stream=1)
    a.free(x)
    a.malloc(4 * MiB, stream=2)  # stream 1's free 20 MiB is not reused
    assert _segment_allocs(a) == [(20 * MiB, 1), (20 * MiB, 2)]
    a.malloc(4 * MiB, stream=1)  # stream 1 reuses its own
    assert len(_segment_allocs(a)) == 2
    s = CachingAllocator()
    s.malloc(512, stream=1)
    s.malloc(512, stream=2)
    assert _segment_allocs(s) == [(2 * MiB, 1), (2 * MiB, 2)]


def test_empty_cache_releases_only_whole_free_segments() -> None:
    a = CachingAllocator()
    x = a.malloc(4 * MiB)
    y = a.malloc(17 * MiB)  # more than the 16 MiB left: its own 18 MiB segment
    s = a.malloc(512)
    a.free(y)
    a.free(s)
    a.empty_cache()
    assert a.reserved_bytes == 20 * MiB
    assert [e for e in a.events if e[0] == "segment_free"] == [
        ("segment_free", y, 18 * MiB, 0), ("segment_free", s, 2 * MiB, 0),
    ]
    assert [seg[0] for seg in a.layout()] == [x]


def test_oom_empties_the_cache_and_retries_then_raises() -> None:
    a = CachingAllocator(capacity=40 * MiB)
    x = a.malloc(20 * MiB)  # 20 MiB segment
    a.free(x)  # cached, not returned
    y = a.malloc(30 * MiB)  # 20 + 30 > 40: empty cache, retry
    assert a.reserved_bytes == 30 * MiB
    assert [e[0] for e in a.events] == [
        "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free",
        "segment_alloc", "alloc",
    ]
    with pytest.raises(SimulatedOutOfMemoryError, match="request of 12582912 bytes") as info:
        a.malloc(12 * MiB)  # 30 + 12 > 40 and nothing is cached
    # PyTorch's oom entry: the device's free bytes (40 - 30 MiB) instead of an address, the
    # rounded request; nothing was released
    assert a.events[-1] == ("oom", 10 * MiB, 12 * MiB, 0)
    assert "reserved" in str(info.value) and "allocated" in str(info.value)
    assert "capacity 41943040" in str(info.value)
    assert isinstance(info.value, TorchmemError)
    assert a.reserved_bytes == 30 * MiB and a.allocated_bytes == 30 * MiB
    a.free(y)
    a.malloc(12 * MiB)  # the free 30 MiB block fits (no new segment)
    assert a.reserved_bytes == 30 * MiB


def test_bad_requests() -> None:
    a = CachingAllocator()
    with pytest.raises(InvalidInputError):
        a.malloc(0)
    with pytest.raises(InvalidInputError):
        a.free(123)
    with pytest.raises(InvalidInputError):
        CachingAllocator(capacity=-1)


def _entry(action: str, addr: int, size: int, stream: int = 0) -> dict[str, object]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


def test_replay_reports_the_first_divergence() -> None:
    base = 1 << 30
    snap = from_pytorch({"segments": [], "device_traces": [[
        _entry("segment_alloc", base, 20 * MiB), _entry("alloc", base, 4 * MiB),
        _entry("segment_alloc", base + (64 * MiB), 20 * MiB),  # the simulator reuses instead
        _entry("alloc", base + (64 * MiB), 4 * MiB),
    ]]})
    r = replay(snap)
    assert (r.segment_allocs_expected, r.segment_allocs_matched) == (2, 1)
    d = r.first_divergence
    assert d is not None
    assert {k: d[k] for k in ("index", "entry", "expected", "got")} == {
        "index": 1, "entry": 2, "expected": {"size": 20 * MiB, "stream": 0, "pool": "large"},
        "got": None,
    }


def test_replay_refuses_a_trace_that_contradicts_the_end_state() -> None:
    # the trace frees a block it never allocated and the snapshot has no segments to rebuild the
    # start from (tests/test_sim_replay.py covers mid-run traces with an end state)
    snap = from_pytorch({"segments": [], "device_traces": [[_entry("free_completed", 4096, 512)]]})
    with pytest.raises(InvalidInputError, match="cannot be rebuilt"):
        replay(snap)


def test_replay_matches_every_segment_alloc_of_a_real_trace() -> None:
    """DeComFL's trace (torch 2.9.1, default allocator settings, one stream) starts from empty:
    every segment_alloc the real allocator made is made by the simulator, and the final layout
    (segments, blocks, states) equals the snapshot's."""
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    r = replay(snap, device=0)
    assert r.segment_allocs_expected == 61
    assert r.segment_allocs_matched == r.segment_allocs_expected
    assert r.first_divergence is None
    assert r.final_layout_equal
