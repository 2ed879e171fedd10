"""Property test: random request streams through the fast simulator and the linear-scan
reference model (``torchmem.sim._reference``) give identical event lists, layouts and errors."""

from __future__ import annotations

import random

import pytest

from torchmem.errors import SimulatedOutOfMemoryError
from torchmem.sim import AllocatorConfig, CachingAllocator
from torchmem.sim._reference import ReferenceAllocator

MiB = 1 << 20

CONFIGS: list[tuple[str, int | None, float | None]] = [
    ("", None, None),
    ("", 120 * MiB, None),
    ("max_split_size_mb:40", 160 * MiB, None),
    ("max_split_size_mb:24,max_non_split_rounding_mb:30", 200 * MiB, None),
    ("roundup_power2_divisions:4", None, None),
    ("roundup_power2_divisions:[1:2,4:8,>:2]", 150 * MiB, None),
    ("large_segment_size_mb:32", 150 * MiB, None),
    ("garbage_collection_threshold:0.5", 200 * MiB, 0.8),
    ("garbage_collection_threshold:0.3,max_split_size_mb:30", 240 * MiB, 0.6),
    ("", 300 * MiB, 0.5),
    ("expandable_segments:True", 300 * MiB, None),
    ("expandable_segments:True", None, None),
    ("expandable_segments:True,max_split_size_mb:40", 260 * MiB, None),
    ("expandable_segments:True,garbage_collection_threshold:0.5", 300 * MiB, 0.8),
    ("expandable_segments:True,large_segment_size_mb:32,roundup_power2_divisions:4", 400 * MiB, None),
]


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.45:
        return rng.randint(1, 64 << 10)  # small tensors
    if r < 0.7:
        return rng.randint(64 << 10, 2 * MiB)  # around the pool boundary
    if r < 0.93:
        return rng.randint(2 * MiB, 24 * MiB)  # large, under and over 10 MiB
    return rng.randint(24 * MiB, 64 * MiB)  # oversize


def _run(seed: int, conf: str, cap: int | None, frac: float | None, n: int = 1500) -> None:
    rng = random.Random(seed)
    fast = CachingAllocator(cap, AllocatorConfig.parse(conf), memory_fraction=frac)
    ref = ReferenceAllocator(cap, AllocatorConfig.parse(conf), memory_fraction=frac)
    live: list[tuple[int, int]] = []  # (fast address, reference address)
    ooms = 0
    for step in range(n):
        r = rng.random()
        if r < 0.52 or not live:
            size, stream = _size(rng), rng.choice((0, 0, 0, 1, 2))
            outcome = []
            for sim in (fast, ref):
                try:
                    outcome.append(sim.malloc(size, stream))
                except SimulatedOutOfMemoryError:
                    outcome.append(None)
            assert outcome[0] == outcome[1], (seed, step, size)
            if outcome[0] is None:
                ooms += 1
            else:
                live.append((outcome[0], outcome[1]))  # type: ignore[arg-type]
        elif r < 0.9:
            a, b = live.pop(rng.randrange(len(live)))
            fast.free(a)
            ref.free(b)
        elif r < 0.95:
            a, b = rng.choice(live)
            s = rng.choice((0, 1, 3))
            fast.record_stream(a, s)
            ref.record_stream(b, s)
        elif r < 0.985:
            which = rng.choice((None, [1], [3], [0, 1]))
            fast.process_events(which)
            ref.process_events(which)
        else:
            fast.empty_cache()
            ref.empty_cache()
        assert fast.events == ref.events, (seed, step)
    assert fast.layout() == ref.layout()
    assert (fast.allocated_bytes, fast.reserved_bytes) == (ref.allocated_bytes, ref.reserved_bytes)
    assert (fast.max_allocated_bytes, fast.max_reserved_bytes) == (
        ref.max_allocated_bytes, ref.max_reserved_bytes,
    )


@pytest.mark.parametrize(("conf", "cap", "frac"), CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_fast_and_reference_make_the_same_decisions(
    seed: int, conf: str, cap: int | None, frac: float | None
) -> None:
    _run(seed, conf, cap, frac)


def test_the_streams_exercise_every_path() -> None:
    """The random streams above reach the paths they claim to compare (not a vacuous test)."""
    rng = random.Random(0)
    seen: set[str] = set()
    for conf, cap, frac in CONFIGS:
        sim = CachingAllocator(cap, conf, memory_fraction=frac)
        live: list[int] = []
        for _ in range(1500):
            r = rng.random()
            if r < 0.52 or not live:
                try:
                    live.append(sim.malloc(_size(rng), rng.choice((0, 0, 0, 1, 2))))
                except SimulatedOutOfMemoryError:
                    pass
            elif r < 0.9:
                sim.free(live.pop(rng.randrange(len(live))))
            elif r < 0.95:
                sim.record_stream(rng.choice(live), 1)
            else:
                sim.empty_cache()
        seen.update(e[0] for e in sim.events)
        if sim.num_alloc_retries:
            seen.add("retry")
    assert {"oom", "segment_free", "free_requested", "free_completed", "retry", "segment_map",
            "segment_unmap"} <= seen
