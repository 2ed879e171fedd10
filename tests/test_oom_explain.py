"""``torchmem oom`` and :func:`torchmem.analysis.explain_oom`, checked against figures computed
another way: the real snapshots' own segments and blocks (read with plain ``pickle``), the peaks
of ../shared/data/gpu-truth.md, the trace's own ``segment_*`` entries, and scenarios worked out by
hand from the allocator's rules (../shared/docs/cuda-caching-allocator-2.13.md).

The shared snapshots hold no ``oom`` entry, so the OOM cases take DeComFL's complete trace and
end it the way PyTorch's allocator ends a trace at an OOM: the cached segments that are one free
block are released (``segment_free``, the retry's ``empty_cache``), then the ``oom`` entry. The
state at the OOM is then the file's own end state minus those segments.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from torchmem.analysis import creep, explain_oom
from torchmem.cli import main
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.io.snapshot_file import load_snapshot

DATA = Path(__file__).parent / "data"
MiB = 1 << 20
KEYS = ["device", "request_bytes", "stream", "device_free_bytes", "reserved_bytes",
        "allocated_bytes", "largest_free_block_bytes", "verdict", "missing_bytes", "fix", "text"]


def _raw(name: str) -> dict[str, Any]:
    with open(DATA / name, "rb") as f:
        d: dict[str, Any] = pickle.load(f)
    return d


def _census(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Reserved, allocated and the free blocks per (stream, pool), from the raw segment dicts."""
    free: dict[tuple[int, str], list[int]] = defaultdict(list)
    for s in segments:
        for b in s["blocks"]:
            if b["state"] == "inactive":
                free[(s["stream"], s["segment_type"])].append(b["size"])
    return {
        "reserved": sum(s["total_size"] for s in segments),
        "allocated": sum(b["size"] for s in segments for b in s["blocks"]
                         if b["state"] == "active_allocated"),
        "free": {k: (len(v), sum(v), max(v)) for k, v in free.items()},
    }


def _decomfl_oom(request: int, device_free: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """DeComFL's trace ended by an OOM; returns the raw dict and the released segments."""
    d = _raw("DeComFL__memory.pickle")
    whole = [s for s in d["segments"]
             if len(s["blocks"]) == 1 and s["blocks"][0]["state"] == "inactive"]
    d["segments"] = [s for s in d["segments"] if s not in whole]
    tr = d["device_traces"][0]
    t = tr[-1]["time_us"]
    for s in sorted(whole, key=lambda s: s["segment_type"] == "small"):  # large pool first
        t += 1
        tr.append({"action": "segment_free", "addr": s["address"], "size": s["total_size"],
                   "stream": 0, "time_us": t, "frames": []})
    tr.append({"action": "oom", "device_free": device_free, "size": request, "stream": 0,
               "time_us": t + 1, "frames": tr[-40]["frames"]})
    return d, whole


def test_fragmentation_at_a_real_trace_end_matches_its_own_blocks() -> None:
    d, released = _decomfl_oom(800 * MiB, 700 * MiB)
    c = _census(d["segments"])
    (e,) = explain_oom(from_pytorch(d))
    assert (e.reserved_bytes, e.allocated_bytes) == (c["reserved"], c["allocated"])
    assert (e.reserved_bytes, e.allocated_bytes) == (1_247_805_440, 1_014_430_208)
    n, free, largest = c["free"][(0, "large")]
    assert e.largest_free_block_bytes == largest == 76_515_328
    assert e.free_bytes == sum(v[1] for v in c["free"].values()) == 233_375_232
    assert e.free_blocks == sum(v[0] for v in c["free"].values())
    assert [(r["stream"], r["pool"], r["blocks"], r["free_bytes"], r["largest_free_block"])
            for r in e.pools] == sorted((k[0], k[1], *v) for k, v in c["free"].items())
    assert (e.other_streams_bytes, e.pending_free_bytes) == (0, 0)
    assert (e.released_segments, e.released_bytes) == (
        len(released), sum(s["total_size"] for s in released))
    assert e.request_bytes == e.alloc_bytes == 800 * MiB and e.pool == "large" and e.exact
    # 700 MiB free + 222.56 MiB cached free >= 800 MiB, but the largest block is 72.97 MiB
    assert e.verdict == "fragmentation" and e.missing_bytes == 0
    # a perfect packer needs allocated + request <= reserved + device free:
    assert c["allocated"] + 800 * MiB <= c["reserved"] + 700 * MiB
    assert e.fix is not None and e.fix in {a["alloc_conf"] for a in e.alternatives if a["avoided"]}
    assert f"PYTORCH_CUDA_ALLOC_CONF={e.fix}" in e.text
    assert e.stack and e.stack[0].startswith("run_client_jobs.py:")


def test_exhaustion_names_the_bytes_really_missing() -> None:
    d, _ = _decomfl_oom(1 << 30, 700 * MiB)
    c = _census(d["segments"])
    (e,) = explain_oom(from_pytorch(d))
    missing = (1 << 30) - 700 * MiB - (c["reserved"] - c["allocated"])
    assert missing == 106_363_392
    assert (e.verdict, e.missing_bytes, e.fix) == ("exhaustion", missing, None)
    assert all(a["avoided"] is False for a in e.alternatives)
    assert "101.44 MiB (106363392 B) were missing" in e.text


def test_other_streams_and_pending_frees_are_split_out() -> None:
    # by hand: stream 0 holds a 20 MiB segment (4 MiB used, 16 MiB free); stream 7 a 20 MiB
    # segment with 12 MiB free; a 2 MiB small segment on stream 0 with 1 MiB pending free.
    # A 30 MiB request on stream 0 fails with 10 MiB free on the device.
    def blk(addr: int, size: int, state: str) -> dict[str, Any]:
        return {"address": addr, "size": size, "requested_size": size if state != "inactive" else 0,
                "state": state}
    seg = lambda addr, size, stream, kind, blocks: {  # noqa: E731
        "device": 0, "address": addr, "total_size": size, "stream": stream,
        "segment_type": kind, "blocks": blocks}
    a, b, c = 1 << 32, 2 << 32, 3 << 32
    raw = {"segments": [
        seg(a, 20 * MiB, 0, "large", [blk(a, 4 * MiB, "active_allocated"),
                                      blk(a + 4 * MiB, 16 * MiB, "inactive")]),
        seg(b, 20 * MiB, 7, "large", [blk(b, 8 * MiB, "active_allocated"),
                                      blk(b + 8 * MiB, 12 * MiB, "inactive")]),
        seg(c, 2 * MiB, 0, "small", [blk(c, 1 * MiB, "active_pending_free"),
                                     blk(c + MiB, 1 * MiB, "active_allocated")]),
    ], "device_traces": [[{"action": "oom", "device_free": 10 * MiB, "size": 30 * MiB,
                           "stream": 0, "frames": []}]]}
    (e,) = explain_oom(from_pytorch(raw))
    assert (e.reserved_bytes, e.allocated_bytes) == (42 * MiB, 13 * MiB)
    assert e.largest_free_block_bytes == 16 * MiB  # stream 7's 12 MiB block is not for it
    assert (e.other_streams_bytes, e.pending_free_bytes) == (12 * MiB, 1 * MiB)
    assert (e.free_blocks, e.free_bytes) == (2, 28 * MiB)
    # 10 MiB free + 29 MiB reserved-but-unallocated >= 30 MiB: not exhaustion
    assert e.verdict == "fragmentation" and e.missing_bytes == 0
    assert e.released_segments == 0 and "found no whole cached segment" in e.text
    assert "1.00 MiB are freed but still in use by another stream" in e.text
    assert "12.00 MiB are cached for other streams only" in e.text


def _simulated_oom(conf: str | None, last: int) -> tuple[dict[str, Any], list[tuple[str, int, int, int]]]:
    """By hand on a 100 MiB device: two 30 MiB tensors, the first freed, then ``last`` bytes;
    the simulator runs out of memory. Returns the snapshot dict and the allocator's events."""
    from torchmem.errors import SimulatedOutOfMemoryError
    from torchmem.io.pytorch_snapshot import to_pytorch_dict
    from torchmem.sim import CachingAllocator

    a = CachingAllocator(capacity=100 * MiB, config=conf)
    x = a.malloc(30 * MiB)
    a.malloc(30 * MiB)
    a.free(x)
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(last)
    return to_pytorch_dict(a.snapshot()), list(a.events)


@pytest.mark.parametrize("settings", [True, False])
def test_an_expandable_oom_speaks_of_mapping_and_unmapping_pages(settings: bool) -> None:
    # 20 MiB pages: 30 MiB maps 2 pages, the second 30 MiB one more; the first tensor freed
    # leaves page 0 free (unmapped by the retry) and 10 MiB free on page 1. 70 MiB needs 4
    # pages (80 MiB) at the end of the range, but only 100 - 40 = 60 MiB are left.
    raw, events = _simulated_oom("expandable_segments:True", 70 * MiB)
    unmapped = [size for act, _, size, _ in events[:-1] if act == "segment_unmap"]
    assert [act for act, *_ in events[-2:]] == ["segment_unmap", "oom"] and unmapped == [20 * MiB]
    if not settings:  # no settings: the expandable segments alone tell it
        del raw["allocator_settings"]
    (e,) = explain_oom(from_pytorch(raw))
    assert e.expandable and e.alloc_bytes == 4 * 20 * MiB
    assert (e.released_segments, e.released_bytes) == (1, sum(unmapped))
    assert "the expandable segment was asked to map up to 80.00 MiB of pages" in e.text
    assert ("mapping up to 80.00 MiB of pages (cuMemMap) failed; unmapped 20.00 MiB of pages "
            "(cuMemUnmap, 1 free range) and retried; failed again with 60.00 MiB free") in e.text
    assert "cudaMalloc" not in e.text and "cached segment" not in e.text
    # the trace replays (its settings, or else its expandable segments, say how it ran), and the
    # setting it ran with is not offered as a what-if
    assert e.exact and "expandable_segments:True: already set in this run;" in e.text
    assert "max_split_size_mb:128: still OOM" in e.text


def test_a_normal_oom_speaks_of_cudamalloc_and_cached_segments() -> None:
    # the same program without expandable segments: two 30 MiB segments; the retry frees the
    # first, then 72 MiB does not fit in the 70 MiB left
    raw, events = _simulated_oom(None, 72 * MiB)
    freed = [size for act, _, size, _ in events[:-1] if act == "segment_free"]
    assert [act for act, *_ in events[-2:]] == ["segment_free", "oom"] and freed == [30 * MiB]
    (e,) = explain_oom(from_pytorch(raw))
    assert not e.expandable and e.alloc_bytes == 72 * MiB
    assert "cudaMalloc was asked for 72.00 MiB" in e.text
    assert ("cudaMalloc(72.00 MiB) failed; released 1 cached segment (30.00 MiB) and retried; "
            "failed again with 70.00 MiB free") in e.text
    assert "pages" not in e.text
    assert "expandable_segments:True: still OOM" in e.text and "already set" not in e.text


@pytest.mark.parametrize("name", ["LLM-inference__oom_snapshot_41810ba.pickle",
                                  "SketchKV2__my_snapshot.pickle"])
def test_a_state_only_snapshot_is_analysed_at_its_state(name: str) -> None:
    raw = _raw(name)
    c = _census(raw["segments"])
    (e,) = explain_oom(load_snapshot(DATA / name))
    assert e.closest and e.index is None and e.verdict is None and e.device_free_bytes is None
    assert (e.reserved_bytes, e.allocated_bytes) == (c["reserved"], c["allocated"])
    assert e.largest_free_block_bytes == max(v[2] for v in c["free"].values())
    assert {(r["stream"], r["pool"]): (r["blocks"], r["free_bytes"], r["largest_free_block"])
            for r in e.pools} == c["free"]


def test_the_oom_snapshot_numbers() -> None:
    (e,) = explain_oom(load_snapshot(DATA / "LLM-inference__oom_snapshot_41810ba.pickle"))
    assert (e.reserved_bytes, e.allocated_bytes) == (11_844_714_496, 11_840_159_744)
    assert e.largest_free_block_bytes == 2_080_768 and e.free_blocks == 3


@pytest.mark.parametrize("name, peak", [
    ("DeComFL__memory.pickle", 1_790_894_592),  # gpu-truth.md
    ("MAGMA27_a2__memory_snapshot.pickle", 13_927_832_064),
    ("notHanmin_a2__memory_snapshot_forward.pickle", 44_634_833_408),
])
def test_without_an_oom_the_analysis_is_at_the_peak(name: str, peak: int) -> None:
    snap = load_snapshot(DATA / name)
    (e,) = explain_oom(snap)
    assert e.closest and e.allocated_bytes == peak
    t = snap.trace(0)
    assert t[e.index].action == "alloc" and e.request_bytes == t.sizes[e.index]


def test_the_reserved_bytes_at_the_peak_are_the_traces_own() -> None:
    # DeComFL's trace is complete from empty: reserved after entry k is the sum of its
    # segment_alloc sizes minus its segment_free sizes up to k
    raw = _raw("DeComFL__memory.pickle")
    (e,) = explain_oom(from_pytorch(raw))
    assert e.index is not None
    entries = raw["device_traces"][0][: e.index + 1]
    reserved = sum(x["size"] for x in entries if x["action"] == "segment_alloc") - sum(
        x["size"] for x in entries if x["action"] == "segment_free")
    assert e.reserved_bytes == reserved


def test_cli_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = _decomfl_oom(800 * MiB, 700 * MiB)
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(d))
    assert main(["oom", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OOM on cuda:0 at trace entry 23123: a request of 800.00 MiB")
    assert "verdict       fragmentation" in out
    assert main(["oom", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (x,) = doc["explanations"]
    assert list(x)[: len(KEYS)] == KEYS
    assert (x["request_bytes"], x["device_free_bytes"], x["reserved_bytes"]) == (
        800 * MiB, 700 * MiB, 1_247_805_440)
    assert doc["closest_to_oom"] is False and x["verdict"] == "fragmentation"


def test_cli_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["oom", str(DATA / "DeComFL__memory.pickle"), "--device", "3"]) == 2
    err = capsys.readouterr().err
    assert "device 3 has no segments or trace entries" in err and "[0]" in err
    assert main(["oom", str(tmp_path / "none.pickle")]) == 2
    assert "no such file" in capsys.readouterr().err


def _drifting_trace(drift_from: int, iterations: int = 6) -> Any:
    """Two tensors live together each iteration; from ``drift_from`` one grows by 2 MiB per
    iteration and the other shrinks by as much: allocated stays at 160 MiB."""
    from torchmem.model.events import EventKind as K
    from torchmem.model.trace import Trace

    tr, us = Trace(), 1000
    for k in range(iterations):
        d = max(0, k - drift_from + 1) * 2 * MiB
        tr.append(K.ALLOC, us * (10 * k + 1), "cuda:0", 100 * MiB + d, 2 * k)
        tr.append(K.ALLOC, us * (10 * k + 2), "cuda:0", 60 * MiB - d, 2 * k + 1)
        tr.append(K.FREE, us * (10 * k + 3), "cuda:0", 0, 2 * k)
        tr.append(K.FREE, us * (10 * k + 4), "cuda:0", 0, 2 * k + 1)
        tr.append(K.MARK, us * (10 * k + 5), "cuda:0", 0, 0, op="step", step=k)
    return tr


def test_reserved_creeping_up_is_found_with_its_start(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # by hand: iterations 0-2 reuse the 100 and 60 MiB segments. Iteration 3 asks 102 MiB: no
    # cached block is big enough, a new 102 MiB segment; its 58 MiB fits the cached 60 MiB
    # (split). Iteration 4: 104 MiB, new segment; 5: 106 MiB. Reserved peaks 160, 160, 160,
    # 262, 366, 472 MiB; allocated peaks 160 MiB throughout.
    from torchmem.io.tmtrace import save_trace

    path = tmp_path / "creep.tmtrace"
    save_trace(_drifting_trace(3), path)
    (c,) = creep(load_snapshot(path))
    assert [i.peak_reserved_bytes // MiB for i in c.iterations] == [160, 160, 160, 262, 366, 472]
    assert [i.peak_allocated_bytes // MiB for i in c.iterations] == [160] * 6
    assert c.creeping and c.start_iteration == 3 and c.reserved_source == "simulated"
    (e,) = explain_oom(load_snapshot(path))
    assert e.closest and e.torchmem_trace and "a torchmem trace" in e.text
    assert (c.reserved_growth_bytes, c.allocated_growth_bytes) == (312 * MiB, 0)
    assert main(["oom", str(path)]) == 0
    out = capsys.readouterr().out
    assert "late OOMs     cuda:0: reserved memory creeps up while allocated does not" in out
    assert "fragmentation started to grow at iteration 3" in out
    assert main(["oom", str(path), "--json"]) == 0
    (j,) = json.loads(capsys.readouterr().out)["creep"]
    assert j["start_iteration"] == 3 and j["iterations"][5]["fragmentation_bytes"] == 312 * MiB


@pytest.mark.parametrize("settings", [True, False])
def test_creep_under_expandable_segments_does_not_suggest_them(settings: bool) -> None:
    # Written with the simulator under expandable_segments:True: each iteration two
    # temporaries of 100 + 4k and 107 + 4k MiB, then a 2 MiB tensor kept for good. The kept
    # tensors split the mapped range, so the growing temporaries map more pages: over
    # iterations 1-6 reserved grows by 160 MiB and allocated by 50 MiB. The run had the
    # setting (its allocator settings say so, or only its page mappings show it), so the
    # advice is not to turn it on.
    from torchmem.io.pytorch_snapshot import to_pytorch_dict
    from torchmem.sim import CachingAllocator

    a = CachingAllocator(config="expandable_segments:True")
    for k in range(7):
        tmps = [a.malloc((100 + 4 * k + 7 * j) * MiB, 0) for j in range(2)]
        a.malloc(2 * MiB, 0)
        for t in tmps:
            a.free(t)
    raw = to_pytorch_dict(a.snapshot())
    raw.pop("allocator_settings", None)
    if settings:
        raw["allocator_settings"] = {"expandable_segments": True}
    trace = raw["device_traces"][0]
    assert not any(e["action"] == "segment_alloc" for e in trace)  # pages mapped, not segments
    starts = [i for i, e in enumerate(trace) if e["action"] == "alloc"][3::3]  # iterations 1-6
    (c,) = creep(from_pytorch(raw), boundaries=starts)
    # by hand: iteration k's peak allocated is its pair (207 + 8k MiB) and k + 1 kept tensors;
    # reserved in iteration 0 is the pair's pages (20 MiB each: 100 + 120 MiB)
    assert [i.peak_allocated_bytes // MiB for i in c.iterations] == [209 + 10 * k for k in range(7)]
    assert c.iterations[0].peak_reserved_bytes == 220 * MiB
    assert c.allocated_growth_bytes == 50 * MiB  # iterations 1 to 6 (the first builds state)
    assert c.reserved_growth_bytes > 2 * c.allocated_growth_bytes
    assert c.creeping and c.reserved_source == "trace"
    assert "expandable_segments is already on in this run" in c.text
    assert "Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" not in c.text


def test_steady_iterations_do_not_creep() -> None:
    from torchmem.io.convert import snapshot_from_trace

    (c,) = creep(snapshot_from_trace(_drifting_trace(99)))
    assert not c.creeping and c.start_iteration is None
    assert [i.peak_reserved_bytes // MiB for i in c.iterations] == [160] * 6


def test_a_real_trace_is_split_at_its_own_annotations() -> None:
    # DeComFL annotates Optimizer.zero_grad twice: three iterations. Reserved per iteration from
    # the raw trace's segment entries, split at the annotations' times.
    from bisect import bisect_right

    raw = _raw("DeComFL__memory.pickle")
    (c,) = creep(from_pytorch(raw))
    times = sorted(a["time_us"] for a in raw["external_annotations"]
                   if a["stage"] == "START" and a["name"].startswith("Optimizer.zero_grad"))
    entries = raw["device_traces"][0]
    cuts = [0] + [bisect_right([e["time_us"] for e in entries], x) for x in times]
    running, reserved = [0], 0
    for e in entries:
        reserved += {"segment_alloc": e["size"], "segment_free": -e["size"]}.get(e["action"], 0)
        running.append(reserved)
    ends = cuts[1:] + [len(entries)]
    assert [(i.first_entry, i.end_entry) for i in c.iterations] == list(zip(cuts, ends))
    assert [i.peak_reserved_bytes for i in c.iterations] == [
        max(running[a:b + 1]) for a, b in zip(cuts, ends)]
    assert c.iterations[1].peak_allocated_bytes == 1_783_664_516  # gpu-truth: peak requested
    assert not c.creeping  # one rise only: the first iterations build the cache
    assert "'Optimizer.zero_grad#SGD.zero_grad'" in c.notes[0]


def test_a_trace_without_markers_says_so() -> None:
    (c,) = creep(load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle"))
    assert c.iterations == [] and "no iteration markers" in c.text


# --------------------------------------------------------------------------- oom_guard

#: The messages of PyTorch's allocators, as their sources write them (see OOM_MESSAGES).
REAL_MESSAGES = [
    ("cpu-windows", RuntimeError, "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
     "not enough memory: you tried to allocate 911360 bytes.", 911_360),
    ("cuda-allocator", "OutOfMemoryError", "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
     "capacity of 79.19 GiB of which 3.06 MiB is free.", 20 * MiB),
    ("cuda-runtime", RuntimeError, "CUDA error: out of memory\nCUDA kernel errors might be "
     "asynchronously reported", None),
    ("hip", "OutOfMemoryError", "HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
     "capacity of 63.98 GiB", 2 << 30),
    ("mps", RuntimeError, "MPS backend out of memory (MPS allocated: 7.64 GiB, other allocations: "
     "68.91 GiB, max allowed: 88.13 GiB). Tried to allocate 33.92 GiB on private pool. Use "
     "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
     "cause system failure).", int(33.92 * (1 << 30))),
    ("xpu", "OutOfMemoryError", "XPU out of memory. Tried to allocate 512.00 MiB. GPU 0 has a "
     "total capacity of 15.11 GiB of which 1.00 MiB is free.", 512 * MiB),
    ("cublas", RuntimeError, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
     "`cublasCreate(handle)`", None),
]


@pytest.mark.parametrize("kind, cls, message, size", REAL_MESSAGES, ids=[m[0] for m in REAL_MESSAGES])
def test_every_allocators_oom_is_recognised(kind: str, cls: Any, message: str, size: int | None) -> None:
    import torch

    from torchmem.capture.recording import is_oom_error, requested_bytes

    exc_type = getattr(torch, cls) if isinstance(cls, str) else cls
    exc = exc_type(message)
    assert is_oom_error(exc), kind
    assert requested_bytes(exc) == size


def test_errors_that_are_not_oom_pass_through() -> None:
    import torch

    from torchmem.capture.recording import is_oom_error

    try:
        torch.empty(1 << 62)  # the size computation overflows: not a memory error
    except RuntimeError as e:
        assert "overflow" in str(e) and not is_oom_error(e)
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("out of memory"))  # only PyTorch's error types


def test_oom_guard_catches_the_real_cpu_error_and_explains_it(tmp_path: Path) -> None:
    import psutil
    import torch

    from torchmem.capture.recording import oom_guard

    p = tmp_path / "cpu.pickle"
    guard = oom_guard(p, device="cpu")
    # 1 PiB of uint8: beyond any machine's address space, so the allocator fails at once
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
        with guard:
            keep = torch.empty(1000)
            torch.empty(1 << 50, dtype=torch.uint8)
    assert keep.numel() == 1000
    assert guard.written == str(p)
    assert guard.explained == [f"{p}.oom.txt", f"{p}.oom.json"]
    t = load_snapshot(p).trace(0)
    last = t[len(t) - 1]
    assert (last.action, last.size) == ("oom", 1 << 50)
    assert 0 < last.device_free <= psutil.virtual_memory().total
    doc = json.loads(Path(f"{p}.oom.json").read_text())
    (x,) = doc["explanations"]
    assert (x["verdict"], x["request_bytes"]) == ("exhaustion", 1 << 50)
    assert x["missing_bytes"] == (1 << 50) - last.device_free
    assert x["allocated_bytes"] == 4000  # the one tracked tensor
    assert Path(f"{p}.oom.txt").read_text() == x["text"]
    assert x["text"].startswith("Host out of memory on cpu at trace entry")


def test_oom_guard_without_explain_writes_only_the_snapshot(tmp_path: Path) -> None:
    from torchmem.capture.recording import oom_guard

    p = tmp_path / "plain.pickle"
    with pytest.raises(MemoryError):
        with oom_guard(p, device="cpu", explain=False):
            raise MemoryError("host ran out")
    assert p.exists() and not Path(f"{p}.oom.txt").exists()


@pytest.mark.cuda
def test_oom_guard_on_a_real_cuda_oom(tmp_path: Path) -> None:
    import torch

    from torchmem.capture.recording import oom_guard

    p = tmp_path / "cuda.pickle"
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError):
        with oom_guard(p, device="cuda"):
            keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            torch.empty(total * 2, dtype=torch.uint8, device="cuda")
    del keep
    snap = load_snapshot(p)
    t = snap.trace(0)
    oom = next(t[i] for i in range(len(t)) if t[i].action == "oom")
    assert oom.size >= total * 2  # PyTorch records the rounded request
    x = json.loads(Path(f"{p}.oom.json").read_text())["explanations"][0]
    assert x["verdict"] == "exhaustion" and x["missing_bytes"] > total
    assert x["device_free_bytes"] == oom.device_free


def test_a_device_oom_without_history_is_explained_from_its_message() -> None:
    # oom_guard around a CUDA OOM with no recorded history saves the allocator's state only;
    # the message gives the device, the request and the free memory. SketchKV2's real state,
    # with PyTorch 2.13's message for a 4 GiB request and 1.21 GiB free:
    from torchmem.capture.recording import append_device_oom

    raw = _raw("SketchKV2__my_snapshot.pickle")
    c = _census(raw["segments"])
    snap = from_pytorch(raw)
    message = ("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of "
               "23.65 GiB of which 1.21 GiB is free. Including non-PyTorch memory, this process "
               "has 22.43 GiB memory in use.")
    assert append_device_oom(snap, RuntimeError(message))
    (e,) = explain_oom(snap)
    free = int(1.21 * (1 << 30))
    assert (e.request_bytes, e.device_free_bytes) == (4 << 30, free)
    assert (e.reserved_bytes, e.allocated_bytes) == (c["reserved"], c["allocated"])
    missing = (4 << 30) - free - (c["reserved"] - c["allocated"])
    assert missing == 2_259_586_089  # 4,294,967,296 - 1,299,227,607 - 736,153,600 cached
    assert (e.verdict, e.missing_bytes) == ("exhaustion", missing)
    assert not append_device_oom(snap, RuntimeError("CUDA error: out of memory"))  # no figures
