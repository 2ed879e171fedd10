"""Expandable segments: seeding mapped ranges, invariants on random request streams
(reserved bytes equal the mapped pages the events report, whole pages, merged free blocks), and
replays of expandable-segment traces at their real virtual addresses (a real H100 trace from
empty and cut mid-run, checked against its own entries and memory_stats; a hand-written one)."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest

import snapshot_synth
from torchmem.analysis._oom import oom_report
from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.io.pytorch_snapshot import from_pytorch, to_pytorch_dict
from torchmem.sim import CachingAllocator, replay
from torchmem.sim.replay import TraceReplay

MiB = 1 << 20
BASE = 1 << 40


def test_seeded_expandable_ranges_grow_in_place() -> None:
    a = CachingAllocator(capacity=400 * MiB, config="expandable_segments:True")
    # two mapped ranges of one large-pool range, 40 MiB apart: pages are 20 MiB
    got = a.add_segment(BASE, 20 * MiB, 0, [(0, 8 * MiB, 8 * MiB), (8 * MiB, 12 * MiB, 0)],
                        small=False, expandable=True)
    a.add_segment(BASE + 60 * MiB, 20 * MiB, 0, [(0, 20 * MiB, 20 * MiB)], small=False, expandable=True)
    assert got == [BASE] and a.reserved_bytes == 40 * MiB
    snap = a.snapshot()
    assert [(s.address, s.total_size, s.is_expandable) for s in snap.segments] == [
        (BASE, 20 * MiB, True), (BASE + 60 * MiB, 20 * MiB, True),
    ]
    x = a.malloc(30 * MiB)  # 12 MiB free + 18 MiB of the unmapped gap: one more page mapped
    assert x == BASE + 8 * MiB
    assert a.events == [("segment_map", BASE + 20 * MiB, 20 * MiB, 0), ("alloc", x, 30 * MiB, 0)]
    y = a.malloc(12 * MiB)  # 2 MiB free + the last gap page: the ranges join
    assert y == BASE + 38 * MiB
    assert a.layout() == [(BASE, 80 * MiB, 0, [
        (0, 8 * MiB, True), (8 * MiB, 30 * MiB, True), (38 * MiB, 12 * MiB, True),
        (50 * MiB, 10 * MiB, False), (60 * MiB, 20 * MiB, True),
    ])]
    with pytest.raises(InvalidInputError, match="whole pages of 20971520 bytes"):
        a.add_segment(BASE + 200 * MiB, 2 * MiB, 0, [(0, 2 * MiB, 0)], small=False, expandable=True)


def _check(a: CachingAllocator) -> None:
    mapped = 0
    for act, _, size, _ in a.events:
        if act == "segment_map":
            mapped += size
        elif act == "segment_unmap":
            mapped -= size
    assert mapped == a.reserved_bytes
    segs = a.snapshot().segments
    assert sum(s.total_size for s in segs) == a.reserved_bytes
    assert sum(b.size for s in segs for b in s.blocks if b.state == "active_allocated") == a.allocated_bytes
    for s in segs:
        assert s.is_expandable
        page = 2 * MiB if s.segment_type == "small" else 20 * MiB
        va_start = a._seg_of(s.address).addr  # the virtual range holding this mapped range
        assert (s.address - va_start) % page == 0 and s.total_size % page == 0
        states = [b.state for b in s.blocks]
        assert all(b.size % 512 == 0 and b.requested_size <= b.size for b in s.blocks)
        assert not any(p == q == "inactive" for p, q in zip(states, states[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_random_streams_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    conf = rng.choice(["expandable_segments:True", "expandable_segments:True,max_split_size_mb:40",
                       "expandable_segments:True,garbage_collection_threshold:0.5"])
    a = CachingAllocator(capacity=300 * MiB, config=conf, memory_fraction=0.9)
    live: list[int] = []
    ooms = 0
    for _ in range(800):
        r = rng.random()
        if r < 0.55 or not live:
            size = rng.choice((rng.randint(1, 1 << 20), rng.randint(1 << 20, 30 * MiB)))
            try:
                live.append(a.malloc(size, stream=rng.choice((0, 0, 1))))
            except SimulatedOutOfMemoryError:
                ooms += 1
        elif r < 0.9:
            a.free(live.pop(rng.randrange(len(live))))
        elif r < 0.95:
            a.record_stream(rng.choice(live), 3)
        elif r < 0.97:
            a.process_events()
        else:
            a.empty_cache()
        _check(a)
    for p in live:
        a.free(p)
    a.empty_cache()
    _check(a)
    assert a.reserved_bytes == 0 and a.layout() == []
    assert {"segment_map", "segment_unmap"} <= {e[0] for e in a.events}


def test_expandable_blocks_are_skipped_when_the_option_is_off() -> None:
    """PyTorch's get_free_block skips blocks of expandable segments when expandable_segments
    was turned off after they were made (e.g. for IPC); empty_cache still unmaps them."""
    a = CachingAllocator()
    a.add_segment(BASE, 20 * MiB, 0, [(0, 20 * MiB, 0)], small=False, expandable=True)
    a.add_segment(BASE + 100 * (1 << 30), 20 * MiB, 0, [(0, 4 * MiB, 1), (4 * MiB, 16 * MiB, 0)], small=False)
    x = a.malloc(6 * MiB)  # the expandable 20 MiB is skipped; the plain 16 MiB block is taken
    assert x == BASE + 100 * (1 << 30) + 4 * MiB
    y = a.malloc(12 * MiB)  # only the expandable block would fit: a new 12 MiB segment
    assert a.events[-2] == ("segment_alloc", y, 12 * MiB, 0)
    a.empty_cache()
    assert a.events[-1] == ("segment_unmap", BASE, 20 * MiB, 0)


# -- replaying expandable-segment traces at their real virtual addresses -----------------------

GPU_DATA = Path(__file__).resolve().parent / "data" / "gpu"


def _real_expandable() -> dict:
    with open(GPU_DATA / "alloc_expandable.pickle", "rb") as f:
        return pickle.load(f)


def _maps(entries: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return [e for e in entries if e[0] in ("segment_map", "segment_unmap")]


def test_real_expandable_trace_replays_at_every_real_address() -> None:
    # H100, torch 2.11, expandable_segments:True, recorded from an empty allocator
    # (tests/data/gpu/README.md); the real addresses of the two virtual ranges (large pool at
    # 0x302000000, small pool at 0x1948000000) are the driver's, not the simulator's.
    raw = _real_expandable()
    trace = raw["device_traces"][0]
    n_allocs = sum(e["action"] == "alloc" for e in trace)
    assert n_allocs == 2037
    r = TraceReplay(from_pytorch(raw))
    r.run()
    res = r.result()
    assert res.start == "empty" and res.first_divergence is None
    assert (res.allocs_matched, res.allocs_expected) == (n_allocs, n_allocs)
    assert res.final_layout_equal
    n_maps = sum(e["action"] == "segment_map" for e in trace)
    assert (res.segment_maps_matched, res.segment_maps_expected) == (n_maps, n_maps) == (148, 148)
    # every page mapped where and as the real allocator mapped it
    real = [(e["action"], e["addr"], e["size"]) for e in trace]
    assert _maps([e[:3] for e in r.allocator.events]) == _maps(real)
    # the peaks the real allocator's memory_stats recorded
    stats = json.loads((GPU_DATA / "alloc_expandable.json").read_text())["memory_stats"]
    assert (res.peak_allocated_bytes, res.peak_requested_bytes, res.peak_reserved_bytes) == (
        stats["allocated_bytes.all.peak"], stats["requested_bytes.all.peak"],
        stats["reserved_bytes.all.peak"])


@pytest.mark.parametrize("cut", [1, 3, 1000, 3000])
def test_real_expandable_trace_cut_mid_run_replays_exactly(cut: int) -> None:
    # The same trace without its first ``cut`` entries: the start state (mapped runs and live
    # blocks) is rebuilt from the end state; with cut 1 or 3 the small pool's range is opened
    # by the trace itself, at the real address.
    raw = _real_expandable()
    raw["device_traces"][0] = raw["device_traces"][0][cut:]
    n_allocs = sum(e["action"] == "alloc" for e in raw["device_traces"][0])
    res = replay(from_pytorch(raw))
    assert res.start == "rebuilt" and res.first_divergence is None
    assert (res.allocs_matched, res.allocs_expected) == (n_allocs, n_allocs) and n_allocs > 300
    assert res.final_layout_equal


def test_hand_written_expandable_trace_replays_exactly() -> None:
    # map, grow, unmap at empty_cache (the range is released), a new range at another address
    raw = snapshot_synth.expandable_ranges()
    trace = raw["device_traces"][0]
    r = TraceReplay(from_pytorch(raw))
    r.run()
    res = r.result()
    assert res.first_divergence is None and res.final_layout_equal
    assert (res.allocs_matched, res.allocs_expected) == (5, 5)
    assert (res.segment_maps_matched, res.segment_maps_expected) == (4, 4)
    real = [(e["action"], e["addr"], e["size"]) for e in trace]
    assert _maps([e[:3] for e in r.allocator.events]) == _maps(real)
    assert res.peak_reserved_bytes == 40 * MiB + 2 * MiB + 60 * MiB - 40 * MiB


def test_a_range_guessed_too_long_is_cut_before_the_next_real_range() -> None:
    # Without the device's size the simulator reserves 1.125 x 80 GiB per range; the real small
    # range starts 1 GiB above the large one here: the large range is cut to 1 GiB before it.
    e = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0}  # noqa: E731
    base = 1 << 40
    snap = from_pytorch({"segments": [], "device_traces": [[
        e("segment_map", base, 20 * MiB), e("alloc", base, 10 * MiB),
        e("segment_map", base + 1024 * MiB, 2 * MiB), e("alloc", base + 1024 * MiB, 512)]],
        "allocator_settings": {"expandable_segments": True}})
    r = TraceReplay(snap)
    r.run()
    assert r.result().allocs_matched == 2
    sizes = {s.addr: s.size for s in r.allocator._segs.values()}
    assert sizes[base] == 1020 * MiB  # whole 20 MiB pages below the small range


def test_a_page_mapped_otherwise_is_counted_and_reported() -> None:
    # the file maps two pages for a 10 MiB request, the allocator one (it maps the rounded
    # request): the block lands at the same address, but the maps differ
    from torchmem.cli.replay import _render

    e = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0}  # noqa: E731
    base = 1 << 40
    snap = from_pytorch({"segments": [], "device_traces": [[
        e("segment_map", base, 40 * MiB), e("alloc", base, 10 * MiB)]],
        "allocator_settings": {"expandable_segments": True}})
    res = replay(snap)
    assert res.allocs_matched == 1
    assert (res.segment_maps_matched, res.segment_maps_expected) == (0, 1)
    text = _render([res.to_dict()])
    assert "the simulator diverged" in text
    assert "segment_maps matched     0 of 1 (expandable pages: same address and size" in text


def _expandable_run(seed: int, release_all: bool) -> CachingAllocator:
    """A random program under expandable_segments:True on a 2000 MiB device, on two streams,
    with small and large requests and a few empty_cache calls, until it runs out of memory (then
    everything freed and released when ``release_all``)."""
    rng = random.Random(seed)
    a = CachingAllocator(capacity=2000 * MiB, config="expandable_segments:True")
    live: list[int] = []
    try:
        for _ in range(4000):
            r = rng.random()
            if r < 0.5 or not live:
                size = rng.choice([rng.randint(1, MiB), rng.randint(MiB, 200 * MiB),
                                   rng.randint(1, 4096), rng.randint(1, MiB),
                                   rng.randint(1, MiB // 2)])
                live.append(a.malloc(size, rng.choice([0, 0, 0, 7])))
            elif r < 0.97:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                a.empty_cache()
    except SimulatedOutOfMemoryError:
        pass
    if release_all:
        for x in live:
            a.free(x)
        a.empty_cache()
    return a


def _three_gpus(seed: int, release_all: bool) -> dict:
    """One file of three devices (each its own program), each trace cut at a random entry of its
    first half (a ring buffer), the addresses moved to a range of the driver's per device, as in
    a real multi-GPU snapshot."""
    raw: dict = {"segments": [], "device_traces": [],
                 "allocator_settings": {"expandable_segments": True}}
    for dev in range(3):
        a = _expandable_run(3 * seed + dev, release_all)
        one = to_pytorch_dict(a.snapshot())
        lowest = min(e[1] for e in a.events if e[0] == "segment_map")
        shift = 0x7F0000000000 + dev * (1 << 40) - lowest
        for e in one["device_traces"][0]:
            if e["action"] != "oom":
                e["addr"] += shift
        for seg in one["segments"]:
            seg["device"], seg["address"] = dev, seg["address"] + shift
            for b in seg["blocks"]:
                b["address"] += shift
        raw["segments"] += one["segments"]
        trace = one["device_traces"][0]
        raw["device_traces"].append(trace[random.Random(seed + dev).randrange(len(trace) // 2):])
    return raw


@pytest.mark.parametrize(("seed", "release_all"), [(2, True), (10, True), (17, True), (20, True),
                                                   (24, True), (3, False)])
def test_three_gpu_mid_run_expandable_traces_replay_at_every_real_address(
    seed: int, release_all: bool
) -> None:
    # Pages the trace unmaps were mapped at its start, in a pool no end segment shows when the
    # whole range was released: the blocks the trace frees there tell it (a request rounded to
    # at most 1 MiB is the small pool's), not the size of the unmapped run (small-pool runs of
    # 10 pages are 20 MiB too). The real addresses are the simulator's own from empty.
    raw = _three_gpus(seed, release_all)
    snap = from_pytorch(raw)
    for dev in range(3):
        res = replay(snap, dev)
        n_allocs = sum(e["action"] == "alloc" for e in raw["device_traces"][dev])
        assert res.start == "rebuilt" and res.first_divergence is None
        assert (res.allocs_matched, res.allocs_expected) == (n_allocs, n_allocs) and n_allocs > 30
        assert res.final_layout_equal
    # the out-of-memory report replays up to each device's OOM and offers what-ifs
    reports = oom_report(snap)
    oomed = [d for d, t in enumerate(raw["device_traces"]) if any(e["action"] == "oom" for e in t)]
    assert oomed and sorted(o.device for o in reports) == oomed
    for o in reports:
        assert o.simulated is not None and o.simulated["exact"] and o.simulated["start"] == "rebuilt"
        # replayed on a device of the same size with the same settings, the request fails too
        # (the seeded virtual ranges end where the real ones do), so the what-ifs are offered
        assert o.simulated["reproduces_oom"] and "did not reproduce" not in o.explanation
        assert len(o.alternatives) == 5
