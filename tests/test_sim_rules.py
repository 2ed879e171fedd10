"""torchmem.sim.CachingAllocator's configured rules against numbers computed by hand from
PyTorch 2.13's allocator rules (../shared/docs/cuda-caching-allocator-2.13.md §3-§11)."""

from __future__ import annotations

import pytest

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.sim import AllocatorConfig, CachingAllocator, round_size, segment_size

MiB = 1 << 20
GiB = 1 << 30


def _acts(a: CachingAllocator, start: int = 0) -> list[tuple[str, int]]:
    return [(e[0], e[2]) for e in a.events[start:]]


# -- rounding ---------------------------------------------------------------------------------

D4 = AllocatorConfig.parse("roundup_power2_divisions:4")
DLIST = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,>:4]")


@pytest.mark.parametrize(
    ("size", "config", "rounded"),
    [
        # divisions 4: steps of a quarter of the power of two below the size
        (5 * MiB, D4, 5 * MiB),  # 4 MiB + 1 step of 1 MiB exactly
        (5 * MiB + 1, D4, 6 * MiB),
        (6 * MiB + 1, D4, 7 * MiB),
        (7 * MiB + 1, D4, 8 * MiB),
        (8 * MiB, D4, 8 * MiB),  # a power of two stays
        (9000, D4, 10240),  # small sizes too: 8192 + steps of 2048 (plain would be 9216)
        (2048, D4, 2048),  # not above 512 * 4: plain 512 B rounding
        (1000, D4, 1024),
        # divisions 8 over 1 MiB: steps of 128 KiB, into the large pool
        (MiB + 1, AllocatorConfig.parse("roundup_power2_divisions:8"), MiB + 128 * 1024),
        # the list form: 300 MiB is interval 8 (1: plain), 600 MiB interval 9 (2 divisions),
        # 1.5 GiB + 1 interval 10 (">": 4 divisions)
        (300 * MiB + 1, DLIST, 300 * MiB + 512),
        (600 * MiB, DLIST, 768 * MiB),
        (1536 * MiB, DLIST, 1536 * MiB),
        (1536 * MiB + 1, DLIST, 1792 * MiB),
    ],
)
def test_round_size_with_divisions(size: int, config: AllocatorConfig, rounded: int) -> None:
    assert round_size(size, config) == rounded
    a = CachingAllocator(config=config)
    a.malloc(size)
    assert a.events[-1] == ("alloc", a.events[-1][1], size, 0)
    assert a.allocated_bytes == rounded or a.allocated_bytes == segment_size(rounded, config)


def test_rounding_decides_pool_and_segment() -> None:
    # 1.5 MiB + 1 with 2 divisions rounds to 2 MiB: large pool, a 20 MiB segment, split
    a = CachingAllocator(config="roundup_power2_divisions:2")
    a.malloc(3 * MiB // 2 + 1)
    assert a.layout()[0][1] == 20 * MiB and a.layout()[0][3][0] == (0, 2 * MiB, True)
    # 700 KiB with 2 divisions: steps of 256 KiB over 512 KiB: 768 KiB, the small pool
    b = CachingAllocator(config="roundup_power2_divisions:2")
    b.malloc(700 * 1024)
    assert b.layout()[0][1] == 2 * MiB and b.allocated_bytes == 768 * 1024


def test_large_segment_size() -> None:
    a = CachingAllocator(config="large_segment_size_mb:32")
    a.malloc(3 * MiB)  # under 10 MiB: the configured 32 MiB segment
    a.malloc(12 * MiB)  # from the cached 29 MiB leftover
    a.malloc(20 * MiB)  # 14 MiB left: a new 20 MiB segment (>= 10 MiB: rounded to 2 MiB)
    assert [s for act, s in _acts(a) if act == "segment_alloc"] == [32 * MiB, 20 * MiB]


# -- max_split_size ---------------------------------------------------------------------------


def test_oversize_blocks_are_never_split() -> None:
    a = CachingAllocator(config="max_split_size_mb:40")
    x = a.malloc(40 * MiB + 1)  # rounded 40 MiB + 512, segment 42 MiB: 2 MiB - 512 left
    assert a.layout()[0][3] == [(0, 42 * MiB, True)]  # no split although > 1 MiB is left
    assert a.allocated_bytes == 42 * MiB
    b = CachingAllocator()
    b.malloc(40 * MiB + 1)  # without max_split it is split
    assert b.layout()[0][3] == [(0, 40 * MiB + 512, True), (40 * MiB + 512, 2 * MiB - 512, False)]
    a.free(x)
    a.malloc(5 * MiB)  # under max_split: never takes the cached 42 MiB block
    assert [s for act, s in _acts(a) if act == "segment_alloc"] == [42 * MiB, 20 * MiB]
    y = a.malloc(40 * MiB)  # >= max_split: takes it, 42 < 40 + 20 (max_non_split_rounding)
    assert y == x and a.allocated_bytes == 42 * MiB + 5 * MiB


def test_max_non_split_rounding_limits_reuse() -> None:
    for conf, reused in (("max_split_size_mb:40", False), ("max_split_size_mb:40,max_non_split_rounding_mb:30", True)):
        a = CachingAllocator(config=conf)
        a.free(a.malloc(64 * MiB))
        y = a.malloc(41 * MiB)  # 64 >= 41 + 20 (default): not taken; 64 < 41 + 30: taken
        assert (y == a.events[0][1]) is reused, conf
        assert len([e for e in a.events if e[0] == "segment_alloc"]) == (1 if reused else 2)


# -- the out-of-memory path -------------------------------------------------------------------


def test_oom_path_exact_sequence() -> None:
    a = CachingAllocator(capacity=100 * MiB, config="max_split_size_mb:40")
    x = a.malloc(42 * MiB)  # 42 MiB segment
    y = a.malloc(42 * MiB)  # 42 MiB segment: 84 reserved
    a.free(x)
    mark = len(a.events)
    c = a.malloc(5 * MiB)
    # the cached 42 MiB is oversize for 5 MiB; 84 + 20 > 100: release one cached oversize block
    # (the smallest >= max(5, 40) MiB: x's) and retry
    assert a.events[mark:] == [
        ("segment_free", x, 42 * MiB, 0),
        ("segment_alloc", a.events[mark + 1][1], 20 * MiB, 0),
        ("alloc", c, 5 * MiB, 0),
    ]
    assert a.num_alloc_retries == 0
    a.free(c)
    a.free(y)  # cached: y's 42 MiB and c's whole 20 MiB segment; 62 reserved
    mark = len(a.events)
    z = a.malloc(90 * MiB)
    # 62 + 90 > 100; no cached block >= 90 MiB: free oversize blocks from the largest down
    # (42, then 20 < 40 stops): 42 < 90, so that step fails; then release every cached
    # segment (the 20 MiB) and retry: 0 + 90 fits
    assert _acts(a, mark) == [
        ("segment_free", 42 * MiB), ("segment_free", 20 * MiB), ("segment_alloc", 90 * MiB),
        ("alloc", 90 * MiB),
    ]
    assert a.events[mark][1] == y and a.num_alloc_retries == 1
    mark = len(a.events)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(20 * MiB - 100)
    # nothing to release: the oom entry has the device's free bytes and the rounded size
    assert a.events[mark:] == [("oom", 10 * MiB, 20 * MiB, 0)]  # 20 MiB - 100 rounds to 20 MiB
    msg = str(info.value)
    assert "tried to allocate 20971520 bytes" in msg  # the segment size, as PyTorch reports
    assert "request of 20971420 bytes" in msg and "capacity 104857600" in msg
    assert "94371840 reserved, 94371840 allocated" in msg
    assert (a.num_ooms, a.num_alloc_retries) == (1, 2)
    a.free(z)
    mark = len(a.events)
    w = a.malloc(20 * MiB)
    # the cached 90 MiB block is oversize for a request under max_split; 90 + 20 > 100: the
    # smallest cached block >= max(20, 40) MiB (z's) is released, then a new segment
    assert a.events[mark:] == [("segment_free", z, 90 * MiB, 0), ("segment_alloc", w, 20 * MiB, 0),
                               ("alloc", w, 20 * MiB, 0)]


def test_oom_without_max_split_skips_the_oversize_step() -> None:
    a = CachingAllocator(capacity=50 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(8 * MiB)  # 30 MiB cached block fits: taken, split
    mark = len(a.events)
    with pytest.raises(SimulatedOutOfMemoryError, match="tried to allocate 27262976 bytes"):
        a.malloc(25 * MiB)  # a 26 MiB segment: 30 + 26 > 50; the 30 MiB segment is split
    # no oversize step without max_split_size, nothing whole to release: straight to the oom
    assert a.events[mark:] == [("oom", 20 * MiB, 25 * MiB, 0)]
    assert a.num_alloc_retries == 1


def test_memory_fraction_limits_before_capacity() -> None:
    a = CachingAllocator(capacity=100 * MiB, memory_fraction=0.5)
    a.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match="52428800 allowed by the memory fraction"):
        a.malloc(12 * MiB)  # 40 + 12 > 50 allowed, although the device has 60 MiB free
    assert a.events[-1] == ("oom", 60 * MiB, 12 * MiB, 0)


# -- garbage collection -----------------------------------------------------------------------


def _gc_setup(threshold: float) -> tuple[CachingAllocator, int, int]:
    a = CachingAllocator(capacity=200 * MiB, config=f"garbage_collection_threshold:{threshold}",
                         memory_fraction=0.5)  # 100 MiB allowed
    c = a.malloc(2 * MiB)  # large-pool call 1: a 20 MiB segment, split
    x = a.malloc(22 * MiB)  # call 2: 22 MiB segment
    y = a.malloc(24 * MiB)  # call 3: 24 MiB segment; 66 MiB reserved
    a.free(x)  # enters the pool at count 3
    for _ in range(3):  # calls 4-6, served by the 18 MiB tail of the first segment
        a.free(a.malloc(3 * MiB // 2))
    a.free(y)  # enters at count 6
    assert c == a.events[0][1]
    return a, x, y


def test_gc_frees_the_oldest_whole_segments_first() -> None:
    # threshold 0.5: GC when reserved > 50 MiB; 66 - 50 = 16 MiB to reclaim
    a, x, y = _gc_setup(0.5)
    mark = len(a.events)
    a.malloc(30 * MiB)  # call 7: no fit. Ages: x 7-3 = 4, y 7-6 = 1; average 2.5: x only
    assert a.events[mark:mark + 2] == [("segment_free", x, 22 * MiB, 0), ("segment_alloc", a.events[mark + 1][1], 30 * MiB, 0)]
    assert a.reserved_bytes == (66 - 22 + 30) * MiB


def test_gc_repeats_passes_until_the_target() -> None:
    # threshold 0.3: 66 - 30 = 36 MiB to reclaim: pass 1 frees x (22), pass 2 (average now 1)
    # frees y (24)
    a, x, y = _gc_setup(0.3)
    mark = len(a.events)
    a.malloc(30 * MiB)
    assert _acts(a, mark)[:3] == [("segment_free", 22 * MiB), ("segment_free", 24 * MiB), ("segment_alloc", 30 * MiB)]
    assert [a.events[mark][1], a.events[mark + 1][1]] == [x, y]


def test_gc_needs_both_fraction_and_threshold() -> None:
    for kwargs in ({"config": "garbage_collection_threshold:0.3"}, {"memory_fraction": 0.5}):
        a = CachingAllocator(capacity=200 * MiB, **kwargs)  # type: ignore[arg-type]
        a.malloc(2 * MiB)
        a.free(a.malloc(22 * MiB))
        a.malloc(30 * MiB)
        assert not [e for e in a.events if e[0] == "segment_free"], kwargs


# -- deferred cross-stream frees --------------------------------------------------------------


def test_record_stream_defers_the_free() -> None:
    a = CachingAllocator()
    x = a.malloc(4 * MiB)
    a.record_stream(x, 5)
    a.record_stream(x, 0)  # its own stream: ignored
    a.free(x)
    assert a.events[-1] == ("free_requested", x, 4 * MiB, 0)
    assert (a.allocated_bytes, a.active_bytes) == (0, 4 * MiB)
    y = a.malloc(4 * MiB)  # x is not free yet: y comes from the 16 MiB tail
    assert y == x + 4 * MiB
    snap = a.snapshot()
    assert [b.state for b in snap.segments[0].blocks] == ["active_pending_free", "active_allocated", "inactive"]
    a.process_events()
    assert a.events[-1] == ("free_completed", x, 4 * MiB, 0)
    assert a.layout()[0][3] == [(0, 4 * MiB, False), (4 * MiB, 4 * MiB, True), (8 * MiB, 12 * MiB, False)]
    with pytest.raises(InvalidInputError, match="not an allocated block"):
        a.record_stream(x, 1)


def test_empty_cache_synchronizes_first() -> None:
    a = CachingAllocator()
    x = a.malloc(4 * MiB)
    a.record_stream(x, 2)
    a.free(x)
    a.empty_cache()
    assert _acts(a)[-3:] == [("free_requested", 4 * MiB), ("free_completed", 4 * MiB), ("segment_free", 20 * MiB)]
    assert a.reserved_bytes == 0


def test_oom_retry_completes_pending_frees() -> None:
    a = CachingAllocator(capacity=40 * MiB)
    x = a.malloc(30 * MiB)
    a.record_stream(x, 1)
    a.free(x)
    with pytest.raises(InvalidInputError, match="double free"):
        a.free(x)
    a.malloc(20 * MiB)  # 30 + 20 > 40: release_cached_blocks synchronizes, frees x's segment
    assert _acts(a)[-5:] == [("free_requested", 30 * MiB), ("free_completed", 30 * MiB),
                             ("segment_free", 30 * MiB), ("segment_alloc", 20 * MiB), ("alloc", 20 * MiB)]


# -- expandable segments ----------------------------------------------------------------------


def test_expandable_maps_pages_on_demand() -> None:
    a = CachingAllocator(capacity=200 * MiB, config="expandable_segments:True")
    base = 1 << 32
    x = a.malloc(4 * MiB)  # maps one 20 MiB page of the large range
    y = a.malloc(30 * MiB)  # 16 MiB free + 14 MiB more: one more page, merged
    z = a.malloc(1000)  # small pool: its own range, 2 MiB pages
    va_large = 240 * MiB  # 1.125 x 200 MiB rounded up to 20 MiB pages
    assert a.events == [
        ("segment_map", base, 20 * MiB, 0), ("alloc", x, 4 * MiB, 0),
        ("segment_map", base + 20 * MiB, 20 * MiB, 0), ("alloc", y, 30 * MiB, 0),
        ("segment_map", base + va_large, 2 * MiB, 0), ("alloc", z, 1000, 0),
    ]
    assert (x, y, z) == (base, base + 4 * MiB, base + va_large)
    assert a.reserved_bytes == 42 * MiB
    # one segment per mapped range; large blocks split down to 512 B (6 MiB left here)
    assert a.layout() == [
        (base, 40 * MiB, 0, [(0, 4 * MiB, True), (4 * MiB, 30 * MiB, True), (34 * MiB, 6 * MiB, False)]),
        (base + va_large, 2 * MiB, 0, [(0, 1024, True), (1024, 2 * MiB - 1024, False)]),
    ]
    assert all(s.is_expandable for s in a.snapshot().segments)
    assert [(seg.is_expandable, seg.small) for seg in a.layout()] == [(True, False), (True, True)]
    a.free(y)
    a.empty_cache()  # free 36 MiB from offset 4: only the page [20, 40) MiB is whole
    assert a.events[-1] == ("segment_unmap", base + 20 * MiB, 20 * MiB, 0)
    assert a.layout()[0] == (base, 20 * MiB, 0, [(0, 4 * MiB, True), (4 * MiB, 16 * MiB, False)])
    a.free(x)
    a.free(z)
    a.empty_cache()
    assert _acts(a)[-2:] == [("segment_unmap", 20 * MiB), ("segment_unmap", 2 * MiB)]
    assert (a.reserved_bytes, a.layout()) == (0, [])


def test_expandable_splits_small_leftovers_and_uses_the_large_segment_size_as_page() -> None:
    a = CachingAllocator(capacity=1 * GiB, config="expandable_segments:True,large_segment_size_mb:32")
    a.malloc(31 * MiB + 1)  # 31 MiB + 512 in one 32 MiB page; 1 MiB - 512 left: split
    assert a.events[0] == ("segment_map", 1 << 32, 32 * MiB, 0)
    assert a.layout()[0][3] == [(0, 31 * MiB + 512, True), (31 * MiB + 512, MiB - 512, False)]


def test_expandable_page_mapping_hits_the_capacity() -> None:
    a = CachingAllocator(capacity=50 * MiB, config="expandable_segments:True")
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(45 * MiB)  # needs three 20 MiB pages: 60 MiB > 50
    assert a.events[-1] == ("oom", 50 * MiB, 45 * MiB, 0)
    a.malloc(35 * MiB)  # two pages fit
    assert a.reserved_bytes == 40 * MiB


def test_peaks_and_reset() -> None:
    a = CachingAllocator()
    x = a.malloc(30 * MiB)
    a.free(x)
    a.empty_cache()
    assert (a.max_allocated_bytes, a.max_reserved_bytes) == (30 * MiB, 30 * MiB)
    a.reset_peak()
    assert (a.max_allocated_bytes, a.max_reserved_bytes) == (0, 0)
    a.malloc(MiB)
    assert (a.max_allocated_bytes, a.max_reserved_bytes) == (MiB, 2 * MiB)


def test_bad_sizes() -> None:
    a = CachingAllocator()
    for bad in (0, -5, 1.5, "1", True):
        with pytest.raises(InvalidInputError, match="malloc size must be an int >= 1"):
            a.malloc(bad)  # type: ignore[arg-type]
    with pytest.raises(SimulatedOutOfMemoryError, match="more than 1 EiB"):
        a.malloc(1 << 60)
    assert a.events == []


def test_memory_stats_under_pytorchs_names() -> None:
    a = CachingAllocator(capacity=60 * MiB)
    x = a.malloc(30 * MiB)
    y = a.malloc(1000)
    a.record_stream(y, 1)
    a.free(y)  # pending: active and requested, not allocated
    a.free(x)
    a.malloc(40 * MiB)  # 30 + 2 + 40 > 60: the retry releases x's segment
    s = a.memory_stats()
    assert s["allocated_bytes.all.current"] == 40 * MiB
    assert s["allocated_bytes.all.peak"] == 40 * MiB
    # the retry synchronized (the pending small block completed), released the 30 MiB and the
    # 2 MiB segments, then made the 40 MiB one: the peak is 40, not 30 + 2 + 40
    assert s["reserved_bytes.all.current"] == s["reserved_bytes.all.peak"] == 40 * MiB
    assert s["requested_bytes.all.current"] == 40 * MiB
    assert (s["num_alloc_retries"], s["num_ooms"]) == (1, 0)
    assert (s["num_device_alloc"], s["num_device_free"]) == (3, 2)
    assert s["segment.all.current"] == 1


def test_expandable_request_larger_than_the_device_is_a_simulated_oom():
    """The virtual range is sized from the device (1.125 x capacity): a request that cannot fit
    in it, or any request on a device of 0 bytes, ends in the OOM path, not a crash."""
    from torchmem.errors import SimulatedOutOfMemoryError
    from torchmem.sim import CachingAllocator

    for cap, size in ((0, 1024), (100 << 20, 200 << 20)):
        a = CachingAllocator(capacity=cap, config="expandable_segments:True")
        with pytest.raises(SimulatedOutOfMemoryError):
            a.malloc(size)
        assert a.events == [("oom", cap, (size + 511) // 512 * 512, 0)]
        assert a.reserved_bytes == 0
