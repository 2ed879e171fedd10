"""CachingAllocator.add_segment: seeding a mid-run state, checked against hand-computed layouts."""

from __future__ import annotations

import pytest

from torchmem.errors import InvalidInputError
from torchmem.sim import CachingAllocator

MiB = 1 << 20
BASE = 1 << 40


def test_seeded_blocks_are_allocated_and_free_blocks_are_reused() -> None:
    a = CachingAllocator()
    got = a.add_segment(
        BASE, 20 * MiB, 0, [(0, 4 * MiB, 4 * MiB - 100), (4 * MiB, 6 * MiB, 0), (10 * MiB, 10 * MiB, 1)],
        small=False,
    )
    assert got == [BASE, BASE + 10 * MiB]
    assert (a.allocated_bytes, a.reserved_bytes) == (14 * MiB, 20 * MiB)
    assert a.events == []  # the state was there before the simulation
    # best fit: the 6 MiB hole; leftover 2 MiB > 1 MiB is split off
    p = a.malloc(4 * MiB)
    assert p == BASE + 4 * MiB
    assert a.layout() == [(BASE, 20 * MiB, 0, [
        (0, 4 * MiB, True), (4 * MiB, 4 * MiB, True), (8 * MiB, 2 * MiB, False), (10 * MiB, 10 * MiB, True),
    ])]
    # freeing a seeded block merges with the free neighbour and keeps its requested size
    a.free(BASE + 10 * MiB)
    assert a.events[-1] == ("free_completed", BASE + 10 * MiB, 1, 0)
    assert a.layout()[0][3][-1] == (8 * MiB, 12 * MiB, False)


def test_new_segments_never_overlap_seeded_ones() -> None:
    a = CachingAllocator()
    low = 1 << 32  # where the simulator would put its first segment
    a.add_segment(low, 2 * MiB, 0, [(0, 2 * MiB, 5)], small=True)
    a.add_segment(low + 4 * MiB, 20 * MiB, 0, [(0, 20 * MiB, 20 * MiB)], small=False)
    q = a.malloc(512)  # small pool is full: a new 2 MiB segment
    assert q >= low + 24 * MiB
    ranges = sorted((addr, addr + size) for addr, size, _, _ in a.layout())
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ranges, ranges[1:]))


def test_seeded_stream_and_pool_are_respected() -> None:
    a = CachingAllocator()
    a.add_segment(BASE, 2 * MiB, 3, [(0, 2 * MiB, 0)], small=True)
    x = a.malloc(512, stream=0)  # stream 3's free block is not reused on stream 0
    assert x != BASE
    y = a.malloc(512, stream=3)
    assert y == BASE
    a.add_segment(BASE + 64 * MiB, 20 * MiB, 0, [(0, 20 * MiB, 0)], small=False)
    a.empty_cache()  # the free whole large segment is released
    assert ("segment_free", BASE + 64 * MiB, 20 * MiB, 0) in a.events


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ([], "blocks is empty"),
        ([(0, 2 * MiB, 1), (2 * MiB, 512, 0)], "cover 2097664 bytes"),
        ([(0, MiB, 0), (MiB, MiB, 0)], "both free"),
        ([(0, MiB, 1), (MiB + 512, MiB - 512, 0)], "starts at offset"),
        ([(0, 1000, 1), (1000, 2 * MiB - 1000, 0)], "multiple of 512"),
        ([(0, 2 * MiB, 2 * MiB + 1)], "requested size"),
        ([(0, 2 * MiB)], r"\(offset, size, requested\)"),
    ],
)
def test_bad_blocks_are_rejected(blocks: list[tuple[int, ...]], match: str) -> None:
    a = CachingAllocator()
    with pytest.raises(InvalidInputError, match=match):
        a.add_segment(BASE, 2 * MiB, 0, blocks, small=True)  # type: ignore[arg-type]
    assert a.layout() == [] and a.reserved_bytes == 0


def test_overlapping_and_misaligned_segments_are_rejected() -> None:
    a = CachingAllocator()
    a.add_segment(BASE, 2 * MiB, 0, [(0, 2 * MiB, 0)], small=True)
    with pytest.raises(InvalidInputError, match="overlaps the existing segment"):
        a.add_segment(BASE + MiB, 2 * MiB, 0, [(0, 2 * MiB, 0)], small=True)
    with pytest.raises(InvalidInputError, match="address must be"):
        a.add_segment(BASE + 3, 2 * MiB, 0, [(0, 2 * MiB, 0)], small=True)
    with pytest.raises(InvalidInputError, match="stream must be"):
        a.add_segment(BASE + 8 * MiB, 2 * MiB, -1, [(0, 2 * MiB, 0)], small=True)
