"""CachingAllocator.snapshot(): PyTorch's snapshot format, read back by torchmem and by
PyTorch's own torch.cuda._memory_viz, with figures compared against the simulator's counters."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from torchmem import analysis
from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.io import load_snapshot, write_snapshot
from torchmem.model.snapshot import Frame
from torchmem.sim import CachingAllocator

MiB = 1 << 20


def _run() -> tuple[CachingAllocator, dict[str, int]]:
    a = CachingAllocator(config="max_split_size_mb:64")
    f_model = [{"filename": "model.py", "line": 12, "name": "forward"}, {"filename": "train.py", "line": 40, "name": "step"}]
    f_opt = [Frame("optim.py", 7, "update")]
    w = a.malloc(30 * MiB, frames=f_model)
    x = a.malloc(3 * MiB + 5, frames=f_model)
    s = a.malloc(1000, frames=f_opt)
    t = a.malloc(70 * MiB)  # oversize: its own 70 MiB segment, no frames
    p = a.malloc(4096, stream=1)
    a.record_stream(x, 1)
    a.free(x)  # pending: active_pending_free
    a.free(t)
    return a, {"w": w, "x": x, "s": s, "p": p}


def test_snapshot_segments_blocks_and_trace() -> None:
    a, addr = _run()
    snap = a.snapshot(device=0)
    st = analysis.stats(snap).devices[0]
    assert st.reserved_bytes == a.reserved_bytes == (30 + 20 + 70 + 2 + 2) * MiB
    assert st.allocated_bytes == a.allocated_bytes == 30 * MiB + 1024 + 4096
    assert st.active_bytes == a.active_bytes == a.allocated_bytes + 3 * MiB + 512
    segs = {s.address: s for s in snap.segments}
    big = segs[addr["w"]]
    assert (big.total_size, big.segment_type, big.is_expandable, big.stream) == (30 * MiB, "large", False, 0)
    assert [(b.state, b.requested_size) for b in big.blocks] == [("active_allocated", 30 * MiB)]
    assert big.blocks[0].frames == (Frame("model.py", 12, "forward"), Frame("train.py", 40, "step"))
    mid = next(s for s in snap.segments if s.total_size == 20 * MiB)
    assert [(b.state, b.size) for b in mid.blocks] == [
        ("active_pending_free", 3 * MiB + 512), ("inactive", 17 * MiB - 512),
    ]
    small = [s for s in snap.segments if s.segment_type == "small"]
    assert sorted(s.stream for s in small) == [0, 1]
    # the trace: every event, time_us = index, frames on the allocs that had them
    trace = snap.trace(0)
    assert [(e.action, e.addr, e.size, e.stream) for e in trace] == a.events
    assert [e.time_us for e in trace] == list(range(len(a.events)))
    allocs = [e for e in trace if e.action == "alloc"]
    assert allocs[2].frames == (Frame("optim.py", 7, "update"),) and allocs[3].frames == ()
    assert snap.allocator_settings is not None
    assert snap.allocator_settings["max_split_size"] == 64 * MiB
    assert snap.allocator_settings["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    # torchmem's peak replays the trace's requested sizes; the simulator's peak counts blocks
    peak = analysis.peak(snap).devices[0]
    assert peak.peak_allocated_bytes == (30 + 3 + 70) * MiB + 5 + 1000 + 4096
    assert a.max_allocated_bytes == (30 + 3 + 70) * MiB + 512 + 1024 + 4096
    assert peak.peak_index == 9  # entry #9 (the tenth): the last alloc


def test_written_snapshot_reads_in_torchmem_and_pytorch(tmp_path: Path) -> None:
    mv = pytest.importorskip("torch.cuda._memory_viz")
    a, _ = _run()
    path = tmp_path / "sim.pickle"
    write_snapshot(path, a.snapshot())
    back = load_snapshot(path)
    assert len(back.segments) == len(a.layout())
    assert [(e.action, e.addr, e.size, e.stream) for e in back.trace(0)] == a.events
    with open(path, "rb") as fh:
        data = pickle.load(fh)
    text = mv.segsum(data)
    # segsum's totals: reserved = segment sizes; allocated = requested bytes of allocated blocks
    requested = 30 * MiB + 1000 + 4096
    assert f"segments: {len(a.layout())}\n" in text
    assert f"total_reserved: {mv.Bytes(a.reserved_bytes)}\n" in text
    assert f"total_allocated: {mv.Bytes(requested)}\n" in text
    assert "[aa] 30.0MiB allocated" in text  # segsum draws segments of 20 MiB and more
    html = mv.trace_plot(data)
    assert "<html" in html.lower() or "<script" in html.lower()
    assert mv.segment_plot(data)
    listing = mv.trace(data)  # PyTorch's text rendering of the trace
    assert f"{len(a.events)} entries" in listing
    assert listing.count("= cudaMalloc(") == sum(e[0] == "segment_alloc" for e in a.events) == 5
    assert "del d # 3.0MiB" in listing and "# free completed for h 70.0MiB" in listing


def test_bad_frames_and_device() -> None:
    a = CachingAllocator()
    a.malloc(512, frames=[{"filename": "a.py"}])
    with pytest.raises(InvalidInputError, match="a malloc frame must be a Frame or a dict"):
        a.snapshot()
    with pytest.raises(InvalidInputError, match="device must be an int >= 0"):
        CachingAllocator().snapshot(device=-1)


def test_decomfl_requests_give_the_real_runs_figures() -> None:
    """DeComFL's requests (a trace complete from empty, torch 2.9.1, default settings) through
    the simulator: its counters and its snapshot give the real run's figures
    (../shared/data/gpu-truth.md: peak allocated 1,790,894,592 B, peak requested 1,783,664,516 B,
    peak reserved 1,897,922,560 B, end allocated 1,014,430,208 B, end reserved 1,897,922,560 B)."""
    real = load_snapshot(Path(__file__).resolve().parent / "data" / "DeComFL__memory.pickle")
    a = CachingAllocator()
    live: dict[int, int] = {}
    for e in real.trace(0):
        if e.action == "alloc":
            live[e.addr] = a.malloc(e.size, e.stream)
        elif e.action == "free_completed":
            a.free(live.pop(e.addr))
    assert (a.max_allocated_bytes, a.max_reserved_bytes) == (1_790_894_592, 1_897_922_560)
    assert (a.allocated_bytes, a.reserved_bytes) == (1_014_430_208, 1_897_922_560)
    snap = a.snapshot()
    st = analysis.stats(snap).devices[0]
    assert (st.allocated_bytes, st.reserved_bytes) == (1_014_430_208, 1_897_922_560)
    assert analysis.peak(snap).devices[0].peak_allocated_bytes == 1_783_664_516  # requested bytes
    assert len(snap.segments) == len(real.segments) == 61
    assert sorted((s.total_size, s.segment_type) for s in snap.segments) == sorted(
        (s.total_size, s.segment_type) for s in real.segments
    )


def test_frames_follow_the_request_into_segment_and_oom_entries() -> None:
    a = CachingAllocator(capacity=64 * MiB)
    fwd = [{"filename": "m.py", "line": 3, "name": "fwd"}]
    big = [{"filename": "m.py", "line": 9, "name": "big"}]
    a.malloc(30 * MiB, frames=fwd)
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(40 * MiB, frames=big)
    snap = a.snapshot()
    rows = [(e.action, [f.name for f in e.frames]) for e in snap.trace(0)]
    assert rows == [("segment_alloc", ["fwd"]), ("alloc", ["fwd"]), ("oom", ["big"])]
    ooms = analysis.oom(snap)
    assert [(o.requested_bytes, o.device_free_bytes) for o in ooms] == [(40 * MiB, 34 * MiB)]
    assert analysis.flame(snap) == ["cuda:0;m.py:3:fwd 31457280"]


def test_expandable_snapshot_reads_in_pytorch(tmp_path: Path) -> None:
    mv = pytest.importorskip("torch.cuda._memory_viz")
    a = CachingAllocator(capacity=1 << 30, config="expandable_segments:True")
    x = a.malloc(30 * MiB)
    a.malloc(1000)
    a.free(x)
    a.empty_cache()  # the large range is unmapped again; the small one keeps its 2 MiB page
    path = tmp_path / "x.pickle"
    write_snapshot(path, a.snapshot())
    with open(path, "rb") as fh:
        data = pickle.load(fh)
    assert [(s["total_size"], s["is_expandable"], s["segment_type"]) for s in data["segments"]] == [
        (2 * MiB, True, "small"),
    ]
    text = mv.segsum(data)
    assert "segments: 1\n" in text and f"total_reserved: {mv.Bytes(2 * MiB)}\n" in text
    assert [e["action"] for e in data["device_traces"][0]] == [
        "segment_map", "alloc", "segment_map", "alloc", "free_requested", "free_completed",
        "segment_unmap",
    ]
    assert "7 entries" in mv.trace(data)
