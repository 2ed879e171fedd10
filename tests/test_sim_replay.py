"""torchmem.sim.replay on mid-run traces: the rebuilt start state, the real snapshots, the peaks.

Ground truth comes from elsewhere: the traces' own entries (their segment_alloc and alloc lists),
the files' end segments, ../shared/data/gpu-truth.md (figures measured by an independent block
replay of the same files), and runs of the simulator itself whose state at the cut is known.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from torchmem.errors import InvalidInputError
from torchmem.io import load_snapshot
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.model.snapshot import Snapshot
from torchmem.sim import AllocatorConfig, CachingAllocator, replay
from torchmem.sim.replay import TraceReplay, start_state

MiB = 1 << 20
DATA = Path(__file__).resolve().parent / "data"
TRACED = ["DeComFL__memory.pickle", "MAGMA27_a2__memory_snapshot.pickle",
          "notHanmin_a2__memory_snapshot_forward.pickle"]

# ../shared/data/gpu-truth.md: (peak allocated, peak requested, peak reserved) of each trace
GPU_TRUTH = {
    "DeComFL__memory.pickle": (1_790_894_592, 1_783_664_516, 1_897_922_560),
    "MAGMA27_a2__memory_snapshot.pickle": (13_927_832_064, 13_923_997_700, 14_180_941_824),
    # reserved is constant over the file (sized by earlier runs): the end state's segments
    "notHanmin_a2__memory_snapshot_forward.pickle": (44_634_833_408, 43_754_773_506, 47_234_154_496),
}


def _load(name: str) -> Snapshot:
    return load_snapshot(DATA / name)


@pytest.mark.parametrize("name", TRACED)
def test_every_decision_of_a_real_trace_is_reproduced(name: str) -> None:
    snap = _load(name)
    actions = [e.action for e in snap.trace(0)]
    r = replay(snap, 0)
    assert r.segment_allocs_expected == actions.count("segment_alloc")
    assert r.segment_allocs_matched == r.segment_allocs_expected
    assert r.allocs_expected == actions.count("alloc") > 1000
    assert r.allocs_matched == r.allocs_expected  # every block at its real address
    assert r.first_divergence is None
    assert r.final_layout_equal


@pytest.mark.parametrize("name", TRACED)
def test_peaks_equal_the_gpu_truth_figures(name: str) -> None:
    r = replay(_load(name), 0)
    assert (r.peak_allocated_bytes, r.peak_requested_bytes, r.peak_reserved_bytes) == GPU_TRUTH[name]


def test_decomfl_starts_empty_and_the_others_are_rebuilt() -> None:
    assert replay(_load(TRACED[0])).start == "empty"
    magma = replay(_load(TRACED[1]))
    assert (magma.start, magma.start_segments) == ("rebuilt", 216)
    assert "rebuilt" in magma.notes[0]


def _start_figures(snap: Snapshot) -> tuple[int, int, int]:
    segs = start_state(snap, 0)
    allocated = sum(b[1] for s in segs for b in s.blocks if not b[3])
    return len(segs), allocated, sum(s.size for s in segs)


def test_magma27_start_state_is_the_resident_state_of_gpu_truth() -> None:
    # gpu-truth.md: "Resident at the start of the recording: ... 1,377,753,600 B allocated,
    # 14,180,941,824 B reserved (216 segments)"
    assert _start_figures(_load(TRACED[1])) == (216, 1_377_753_600, 14_180_941_824)


def test_nothanmin_start_state_is_the_resident_state_of_gpu_truth() -> None:
    # gpu-truth.md: resident at its start ... 32,676,899,328 B allocated; 1,722 segments
    n, allocated, reserved = _start_figures(_load(TRACED[2]))
    assert (n, allocated, reserved) == (1722, 32_676_899_328, 47_234_154_496)


def test_the_previous_logits_are_live_at_the_start_and_freed_in_the_trace() -> None:
    # MAGMA27: the previous iteration's logits (327,680,000 B requested) are freed in the window
    snap = _load(TRACED[1])
    rows = [b for s in start_state(snap, 0) for b in s.blocks if b[2] == 327_680_000]
    assert len(rows) == 1 and rows[0][1] == 327_680_000  # a multiple of 512: no slack


@pytest.mark.parametrize("name", ["Attention__memory.pickle", "SketchKV2__my_snapshot.pickle",
                                  "LLM-inference__oom_snapshot_41810ba.pickle"])
def test_state_only_files_say_there_is_nothing_to_check(name: str) -> None:
    snap = _load(name)
    r = replay(snap, 0)
    assert (r.allocs_expected, r.segment_allocs_expected) == (0, 0)
    assert r.start_segments == len(snap.segments_of(0))
    assert r.notes and r.notes[0].startswith("nothing to check")


# ------------------------------------------------------------------ runs of the simulator itself


def _run(seed: int, n: int, cut: int) -> tuple[Snapshot, list[Any]]:
    """A random workload on the simulator, as a snapshot whose trace starts at entry ``cut``.

    Returns the snapshot (end state + trace suffix) and the simulator's layout at the cut, with
    requested sizes: [(address, size, stream, [(offset, size, requested)])].
    """
    rng = random.Random(seed)
    a = CachingAllocator()
    live: list[int] = []
    requested: dict[int, int] = {}
    at_cut: list[Any] = []
    for step in range(n):
        if len(a.events) >= cut and not at_cut:
            cut = len(a.events)  # a step boundary
            at_cut = [
                (addr, size, stream,
                 [(off, bs, requested[addr + off] if on else 0) for off, bs, on in blocks])
                for addr, size, stream, blocks in a.layout()
            ]
        if live and rng.random() < 0.45:
            p = live.pop(rng.randrange(len(live)))
            a.free(p)
            del requested[p]
        else:
            size = rng.choice([rng.randint(1, 8192), rng.randint(MiB, 9 * MiB),
                               rng.randint(10 * MiB, 40 * MiB)])
            p = a.malloc(size)
            live.append(p)
            requested[p] = size
        if step % 97 == 96:
            a.empty_cache()
    segments = []
    for addr, size, stream, blocks in a.layout():
        segments.append({
            "device": 0, "address": addr, "total_size": size, "stream": stream,
            "segment_type": "small" if size == 2 * MiB and blocks[0][1] <= MiB else "large",
            "blocks": [{"address": addr + off, "size": bs,
                        "requested_size": requested[addr + off] if on else 0,
                        "state": "active_allocated" if on else "inactive"}
                       for off, bs, on in blocks]})
    trace: list[dict[str, Any]] = []
    for act, addr, size, stream in a.events[cut:]:  # free_requested, then free_completed
        trace.append({"action": act, "addr": addr, "size": size, "stream": stream})
    return from_pytorch({"segments": segments, "device_traces": [trace]}), at_cut


@pytest.mark.parametrize("seed", [1, 2, 3, 14, 55])
def test_the_rebuilt_start_state_is_the_simulators_state_at_the_cut(seed: int) -> None:
    snap, at_cut = _run(seed, 1500, cut=900)
    assert at_cut  # the workload reached the cut
    segs = start_state(snap, 0)
    assert [(s.address, s.size, s.stream) for s in segs] == [x[:3] for x in at_cut]
    open_blocks = 0
    for seg, (_, _, _, truth) in zip(segs, at_cut):
        if not seg.open_slack:
            assert seg.layout() == truth
        else:  # the slack of a block freed in the trace before nothing landed after it is open
            open_blocks += len(seg.open_slack)
            assert [(b[0] - seg.address, b[2]) for b in seg.blocks] == [
                (off, req) for off, _, req in truth if req]
    assert open_blocks < len(segs)
    r = replay(snap, 0)  # whatever slack it chose, the replay agrees with every decision
    actions = [e.action for e in snap.trace(0)]
    assert r.start == "rebuilt"
    assert r.segment_allocs_expected == actions.count("segment_alloc") > 0
    assert r.segment_allocs_matched == r.segment_allocs_expected
    assert r.allocs_matched == r.allocs_expected == actions.count("alloc")
    assert r.final_layout_equal and r.first_divergence is None


def _seg(addr: int, size: int, blocks: list[tuple[int, int, int, str]], small: bool = False) -> dict[str, Any]:
    return {"device": 0, "address": addr, "total_size": size, "stream": 0,
            "segment_type": "small" if small else "large",
            "blocks": [{"address": a, "size": s, "requested_size": r, "state": st}
                       for a, s, r, st in blocks]}


def _e(action: str, addr: int, size: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0}


BASE = 1 << 32


def test_a_large_block_freed_in_the_trace_keeps_its_unsplittable_slack() -> None:
    # Before the trace: a 19 MiB request took a whole 20 MiB segment (the 1 MiB tail cannot be a
    # large-pool block). The trace frees it and allocates 4 MiB, which splits the merged block.
    snap = from_pytorch({
        "segments": [_seg(BASE, 20 * MiB, [(BASE, 4 * MiB, 4 * MiB, "active_allocated"),
                                           (BASE + 4 * MiB, 16 * MiB, 0, "inactive")])],
        "device_traces": [[_e("free_requested", BASE, 19 * MiB), _e("free_completed", BASE, 19 * MiB),
                           _e("alloc", BASE, 4 * MiB)]]})
    (seg,) = start_state(snap, 0)
    assert seg.blocks == [[BASE, 20 * MiB, 19 * MiB, False]]
    r = replay(snap)
    assert r.final_layout_equal and r.allocs_matched == 1
    assert r.peak_allocated_bytes == 20 * MiB and r.peak_requested_bytes == 19 * MiB


def test_a_pending_free_at_the_start_is_active_but_not_allocated() -> None:
    # the trace holds the free_completed but not the free_requested: pending at the start
    snap = from_pytorch({
        "segments": [_seg(BASE, 2 * MiB, [(BASE, 2 * MiB, 0, "inactive")], small=True)],
        "device_traces": [[_e("free_completed", BASE + 512, 100), _e("alloc", BASE, 512)
                           , _e("free_requested", BASE, 512), _e("free_completed", BASE, 512)]]})
    (seg,) = start_state(snap, 0)
    assert seg.blocks == [[BASE + 512, 512, 100, True]]
    tr = TraceReplay(snap)
    assert tr.allocated_bytes == 0 and tr.requested_bytes == 100
    tr.run()
    assert tr.result().final_layout_equal
    assert tr.peak_allocated_bytes == 512 and list(tr.block_sizes) == [0, 512, 0, 0]


def test_a_block_at_another_address_is_the_first_divergence_explained() -> None:
    # The end state says the alloc took the second free block, but best fit takes the first
    # (both 4 MiB: lowest address wins). The simulator must say so.
    blocks = [(BASE, 4 * MiB, 0, "inactive"), (BASE + 4 * MiB, 2 * MiB, 2 * MiB, "active_allocated"),
              (BASE + 6 * MiB, 4 * MiB, 4 * MiB, "active_allocated"),
              (BASE + 10 * MiB, 10 * MiB, 10 * MiB, "active_allocated")]
    snap = from_pytorch({"segments": [_seg(BASE, 20 * MiB, blocks)],
                         "device_traces": [[_e("alloc", BASE + 6 * MiB, 4 * MiB)]]})
    r = replay(snap)
    assert (r.allocs_expected, r.allocs_matched) == (1, 0)
    d = r.first_divergence
    assert d is not None and d["kind"] == "alloc" and d["entry"] == 0
    assert d["expected"] == {"address": BASE + 6 * MiB, "segment": BASE, "offset": 6 * MiB}
    assert d["got"] == {"address": BASE, "segment": BASE, "offset": 0}
    assert "4.00 MiB" in d["explanation"] and hex(BASE + 6 * MiB) in d["explanation"]
    assert not r.final_layout_equal


def test_a_missing_segment_alloc_is_explained_with_the_block_reused_instead() -> None:
    snap = from_pytorch({"segments": [], "device_traces": [[
        _e("segment_alloc", BASE, 20 * MiB), _e("alloc", BASE, 4 * MiB),
        _e("segment_alloc", BASE + 64 * MiB, 20 * MiB), _e("alloc", BASE + 64 * MiB, 4 * MiB)]]})
    d = replay(snap).first_divergence
    assert d is not None and d["kind"] == "segment_alloc" and d["entry"] == 2
    assert d["request"] == {"entry": 3, "size": 4 * MiB, "stream": 0}
    assert d["simulated"]["address"] == BASE + 4 * MiB and d["simulated"]["segment"] == BASE
    assert "made no new segment" in d["explanation"] and hex(BASE + 4 * MiB) in d["explanation"]


def test_a_trace_that_contradicts_the_end_state_is_refused_clearly() -> None:
    snap = from_pytorch({
        "segments": [_seg(BASE, 2 * MiB, [(BASE, 2 * MiB, 0, "inactive")], small=True)],
        "device_traces": [[_e("alloc", BASE, 512)]]})  # allocated, never freed, not live at the end
    with pytest.raises(InvalidInputError, match="neither freed later nor live at the end"):
        replay(snap)


def test_run_stops_anywhere_and_resumes() -> None:
    snap = _load(TRACED[1])
    whole = replay(snap)
    tr = TraceReplay(snap)
    tr.run(2000)
    assert tr.position == 2000
    tr.run()
    assert tr.result() == whole


# ------------------------------------------------------------------ torchmem replay (the CLI)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from torchmem.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_has_the_issue_schema_and_the_traces_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import pickle

    code, out, err = _cli(capsys, "replay", str(DATA / TRACED[0]), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert list(d) == ["devices"]
    (dev,) = d["devices"]
    assert list(dev)[:5] == ["device", "segment_allocs_expected", "segment_allocs_matched",
                             "final_layout_equal", "first_divergence"]
    with open(DATA / TRACED[0], "rb") as f:
        raw = pickle.load(f)
    n_seg = sum(e["action"] == "segment_alloc" for e in raw["device_traces"][0])
    assert n_seg == len(raw["segments"]) == 61  # complete from empty
    assert (dev["device"], dev["segment_allocs_expected"], dev["segment_allocs_matched"]) == (0, n_seg, n_seg)
    assert dev["final_layout_equal"] is True and dev["first_divergence"] is None
    assert dev["peak_reserved_bytes"] == GPU_TRUTH[TRACED[0]][2]


def test_cli_text_explains_the_first_divergence(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import pickle

    raw = {"segments": [], "device_traces": [[
        _e("segment_alloc", BASE, 20 * MiB), _e("alloc", BASE, 4 * MiB),
        _e("segment_alloc", BASE + 64 * MiB, 20 * MiB), _e("alloc", BASE + 64 * MiB, 4 * MiB)]]}
    for e in raw["device_traces"][0]:
        e["frames"] = []
    p = tmp_path / "div.pickle"
    p.write_bytes(pickle.dumps(raw))
    code, out, _ = _cli(capsys, "replay", str(p))
    assert code == 0
    assert "the simulator diverged" in out and "segment_allocs matched   1 of 2" in out
    assert "first divergence         at trace entry 2" in out
    assert "made no new segment: it reused the free memory at " + hex(BASE + 4 * MiB) in out


def test_cli_text_of_a_mid_run_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "replay", str(DATA / TRACED[1]))
    assert code == 0
    assert "reproduced the trace (from a rebuilt start state)" in out
    assert "allocs at real address   1721 of 1721" in out
    assert "allocated 12.97 GiB (13927832064 B)" in out


def test_cli_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle at all")
    code, out, err = _cli(capsys, "replay", str(bad))
    assert code == 2 and out == ""
    assert "torchmem replay: error:" in err and "Traceback" not in err
    code, _, err = _cli(capsys, "replay", str(tmp_path / "missing.pickle"))
    assert code == 2 and "no such file" in err
    code, _, err = _cli(capsys, "replay", str(DATA / TRACED[0]), "--device", "5")
    assert code == 2 and "device 5 has no segments or trace entries" in err


def test_a_capacity_stops_the_replay_at_the_request_that_does_not_fit() -> None:
    from torchmem.errors import SimulatedOutOfMemoryError

    a = CachingAllocator()
    x = a.malloc(600 * MiB)
    a.free(x)
    a.malloc(50 * MiB)
    snap = a.snapshot()  # trace: segment_alloc, alloc 600 MiB, free x2, alloc 50 MiB
    tr = TraceReplay(snap, capacity=500 * MiB, real_addresses=False)
    with pytest.raises(SimulatedOutOfMemoryError):
        tr.run()
    assert tr.position == 1 and snap.trace(0)[1].action == "alloc"  # the 600 MiB request
    ok = TraceReplay(snap, capacity=600 * MiB)
    ok.run()
    assert ok.result().final_layout_equal and ok.peak_reserved_bytes == 600 * MiB


def _run_conf(seed: int, config: str, n: int = 1500, cut: int = 900) -> tuple[Snapshot, list[Any]]:
    """Like _run, under ``config``, written by the simulator's own snapshot() and cut mid-way."""
    from torchmem.io.pytorch_snapshot import to_pytorch_dict

    rng = random.Random(seed)
    a = CachingAllocator(config=config)
    live: list[int] = []
    at_cut: list[Any] = []
    for step in range(n):
        if len(a.events) >= cut and not at_cut:
            cut = len(a.events)
            at_cut = a.layout()
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice([rng.randint(1, 8192), rng.randint(MiB, 9 * MiB),
                                             rng.randint(10 * MiB, 40 * MiB)])))
        if step % 97 == 96:
            a.empty_cache()
    raw = to_pytorch_dict(a.snapshot())
    raw["device_traces"][0] = raw["device_traces"][0][cut:]
    return from_pytorch(raw), at_cut


@pytest.mark.parametrize(("seed", "config"), [
    (4, "expandable_segments:True"), (5, "expandable_segments:True"), (6, "expandable_segments:True"),
    (4, "max_split_size_mb:64,roundup_power2_divisions:4"), (5, "large_segment_size_mb:32"),
])
def test_mid_run_traces_under_other_settings_replay_exactly(seed: int, config: str) -> None:
    snap, at_cut = _run_conf(seed, config)
    actions = [e.action for e in snap.trace(0)]
    if config.startswith("expandable"):
        assert "segment_map" in actions and "segment_unmap" in actions  # pages mapped and unmapped
    cfg = AllocatorConfig.from_settings(snap.allocator_settings)
    assert cfg.settings == config  # the file carries its settings
    segs = start_state(snap, 0, cfg)
    assert [(s.address, s.size, s.stream) for s in segs] == [x[:3] for x in at_cut]
    r = replay(snap, 0)
    assert r.start == "rebuilt" and r.allocs_expected == actions.count("alloc")
    assert r.allocs_matched == r.allocs_expected
    assert r.segment_allocs_matched == r.segment_allocs_expected
    assert r.final_layout_equal and r.first_divergence is None



def test_pages_mapped_below_the_start_state_open_the_range_there() -> None:
    # Two 40 MiB blocks in one expandable range; the first is freed and its pages unmapped.
    # The trace starts there: the range's lowest mapped page is 40 MiB above its real start,
    # which no state in the file shows, but the next 10 MiB request maps the range's first page:
    # the replay opens the range at the lowest page the trace maps and reproduces it (before,
    # the range began at its lowest run mapped at the start and the block landed 40 MiB higher).
    from torchmem.io.pytorch_snapshot import to_pytorch_dict

    a = CachingAllocator(config="expandable_segments:True")
    x = a.malloc(40 * MiB)
    a.malloc(40 * MiB)
    a.free(x)
    a.empty_cache()
    cut = len(a.events)
    z = a.malloc(10 * MiB)
    assert a.events[cut] == ("segment_map", z, 20 * MiB, 0) and z == x
    raw = to_pytorch_dict(a.snapshot())
    raw["device_traces"][0] = raw["device_traces"][0][cut:]
    r = replay(from_pytorch(raw))
    assert r.start == "rebuilt" and r.first_divergence is None
    assert (r.allocs_matched, r.allocs_expected) == (1, 1) and r.final_layout_equal
    assert not any(n.startswith("underdetermined") for n in r.notes)


def _oversize_release_snapshot() -> Snapshot:
    # max_split_size_mb:20, 80 MiB device: a 60 MiB block and a 100 kB one are freed (both
    # segments cached), then 25 MiB may not take the oversize 60 MiB block and a new 26 MiB
    # segment would exceed 80 MiB: the OOM retry releases only the oversize block, the cached
    # 2 MiB small segment stays (empty_cache would release it too).
    a = CachingAllocator(capacity=80 * MiB, config="max_split_size_mb:20")
    x = a.malloc(60 * MiB)
    y = a.malloc(100_000)
    a.free(x)
    a.free(y)
    a.malloc(25 * MiB)
    snap = a.snapshot()
    actions = [e.action for e in snap.trace(0)]
    assert actions[-3:] == ["segment_free", "segment_alloc", "alloc"]
    return snap


def test_an_oversize_release_is_replayed_as_the_retry_of_its_alloc() -> None:
    r = replay(_oversize_release_snapshot())  # the simulator itself gets no capacity
    assert r.segment_allocs_matched == r.segment_allocs_expected == 3 and r.allocs_matched == 3
    assert r.final_layout_equal and r.notes == ()  # the 2 MiB segment is still cached
    assert r.peak_reserved_bytes == 62 * MiB


def test_a_release_the_replay_cannot_reproduce_is_named() -> None:
    # the same trace read as if no max_split_size was set: its run of segment_free can only be
    # an empty_cache, which releases the small segment as well
    r = replay(_oversize_release_snapshot(), config="")
    assert not r.final_layout_equal
    assert any("released 1 cached segment(s), the replay 2" in n for n in r.notes)


@pytest.mark.parametrize("seed", [10, 13, 15, 18])
def test_runs_with_max_split_size_and_out_of_memory_retries_replay_exactly(seed: int) -> None:
    """A 400 MiB device with max_split_size_mb:64 and requests up to 120 MiB: many OOM retries
    (oversize releases, empty caches, failed requests). Replayed whole and from mid-way (oversize
    blocks freed in the trace may carry up to max_non_split_rounding of slack)."""
    from torchmem.errors import SimulatedOutOfMemoryError
    from torchmem.io.pytorch_snapshot import to_pytorch_dict

    rng = random.Random(seed)
    a = CachingAllocator(capacity=400 * MiB, config="max_split_size_mb:64")
    live: list[int] = []
    for _ in range(1500):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 8192), rng.randint(MiB, 9 * MiB),
                               rng.randint(10 * MiB, 120 * MiB)])
            try:
                live.append(a.malloc(size))
            except SimulatedOutOfMemoryError:
                pass
    raw = to_pytorch_dict(a.snapshot())
    trace = raw["device_traces"][0]
    actions = [e["action"] for e in trace]
    assert actions.count("oom") > 0 and actions.count("segment_free") > 10
    k = len(trace) * 3 // 4  # cut before an alloc and the segment entries of its retry
    while trace[k]["action"] != "alloc":
        k += 1
    while trace[k - 1]["action"] in ("segment_alloc", "segment_free"):
        k -= 1
    for cut in (0, k):
        raw["device_traces"][0] = trace[cut:]
        r = replay(from_pytorch(raw))
        assert r.start == ("empty" if cut == 0 else "rebuilt")
        assert r.allocs_matched == r.allocs_expected > 0
        assert r.segment_allocs_matched == r.segment_allocs_expected
        assert r.final_layout_equal and r.first_divergence is None


@pytest.mark.parametrize("seed", [1, 2])
def test_two_streams_with_deferred_frees_replay_exactly(seed: int) -> None:
    """Streams 0 and 5, blocks used on the other stream (record_stream): their frees complete
    later (free_requested ... free_completed), so some blocks are pending at the cut."""
    from torchmem.io.pytorch_snapshot import to_pytorch_dict

    rng = random.Random(seed)
    a = CachingAllocator()
    live: list[int] = []
    for step in range(1500):
        if live and rng.random() < 0.45:
            p = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3:
                a.record_stream(p, 5)
            a.free(p)
        else:
            size = rng.choice([rng.randint(1, 8192), rng.randint(MiB, 9 * MiB),
                               rng.randint(10 * MiB, 40 * MiB)])
            live.append(a.malloc(size, rng.choice([0, 0, 5])))
        if rng.random() < 0.05:
            a.process_events()
        if step % 97 == 96:
            a.empty_cache()
    raw = to_pytorch_dict(a.snapshot())
    trace = raw["device_traces"][0]
    deferred = [i for i, e in enumerate(trace[:-1]) if e["action"] == "free_requested"
                and trace[i + 1]["action"] != "free_completed"]
    assert len(deferred) > 20
    k = len(trace) // 2
    while trace[k]["action"] != "alloc":
        k += 1
    while trace[k - 1]["action"] in ("segment_alloc", "segment_free"):
        k -= 1
    for cut in (0, k):
        raw["device_traces"][0] = trace[cut:]
        r = replay(from_pytorch(raw))
        assert r.allocs_matched == r.allocs_expected > 0
        assert r.segment_allocs_matched == r.segment_allocs_expected
        assert r.final_layout_equal and r.first_divergence is None


def test_cli_names_a_device_that_is_not_cuda(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    from torchmem.io import write_snapshot

    snap = from_pytorch({"segments": [], "device_traces": [[
        _e("segment_alloc", 4096, 4096), _e("alloc", 4096, 4096)]]})
    snap.device_names = {0: "cpu"}  # as torchmem's CPU tracker writes it
    path = tmp_path / "cpu.json"
    write_snapshot(path, snap, format="json")
    code, out, _ = _cli(capsys, "replay", str(path))
    assert code == 0 and out.startswith("cpu: the simulator diverged")
    assert "cpu is not a CUDA device" in out
    code, out, _ = _cli(capsys, "replay", str(path), "--json")
    dev = json.loads(out)["devices"][0]
    assert dev["name"] == "cpu" and dev["segment_allocs_matched"] == 0


def test_a_mid_run_trace_that_releases_everything_is_rebuilt_without_end_segments() -> None:
    a = CachingAllocator()
    x = a.malloc(3 * MiB)  # a 20 MiB segment, split
    cut = len(a.events)
    a.free(x)
    a.empty_cache()
    snap = a.snapshot()
    assert snap.segments == []
    from torchmem.io.pytorch_snapshot import to_pytorch_dict

    raw = to_pytorch_dict(snap)
    raw["device_traces"][0] = raw["device_traces"][0][cut:]  # free_requested/completed, segment_free
    snap = from_pytorch(raw)
    (seg,) = start_state(snap, 0)
    assert (seg.size, seg.blocks) == (20 * MiB, [[x, 3 * MiB, 3 * MiB, False]])
    r = replay(snap)
    assert r.start == "rebuilt" and r.final_layout_equal and r.peak_reserved_bytes == 20 * MiB


def test_a_page_mapped_below_another_pools_range_does_not_open_the_range_there() -> None:
    # Mid-run: the small pool's range at S and the large pool's at L > S are mapped at the start;
    # the trace maps a large-pool page below S (a range the state does not show). Lowering the
    # large range to that page would swallow the small one (seeding failed with an overlap):
    # the range stays at its lowest run and the replay reports the divergence instead.
    import snapshot_synth as synth

    S, L = 0x1000000000, 0x2000000000
    N = L - 4000 * 20 * MiB  # a whole number of large pages below L, below S
    raw = {
        "segments": [
            synth._seg(0, N, 20 * MiB, [synth._b(N, 10 * MiB, 10 * MiB, "active_allocated"),
                                        synth._b(N + 10 * MiB, 10 * MiB, 0, "inactive")],
                       expandable=True),
            synth._seg(0, S, 2 * MiB, [synth._b(S, 512, 512, "active_allocated"),
                                       synth._b(S + 512, 2 * MiB - 512, 0, "inactive")],
                       segment_type="small", expandable=True),
            synth._seg(0, L, 20 * MiB, [synth._b(L, 20 * MiB, 20 * MiB, "active_allocated")],
                       expandable=True)],
        "device_traces": [[synth._e("segment_map", N, 20 * MiB), synth._e("alloc", N, 10 * MiB)]],
        "allocator_settings": {"expandable_segments": True},
    }
    r = replay(from_pytorch(raw))
    assert r.start == "rebuilt" and r.allocs_matched == 0
    assert r.first_divergence is not None and r.first_divergence["expected"]["address"] == N
    assert r.notes[0].startswith("underdetermined: the trace maps expandable-segment pages below")
