"""The script's own ``torch.cuda`` memory readings under an estimate are the simulated GPU's
(:mod:`torchmem.fit.fakegpu._readings`).

- the GPT step that recorded its own readings per phase on an H100
  (``tests/data/gpu/gpt_phase_readings.json``, ``readings``) reads the same figures inside
  the estimate (allocated within 1%, reserved within 5%, the estimate's goals);
- on the CPU: ``reset_peak_memory_stats`` sets each peak to the current value, and the peaks,
  currents and counts of ``memory_stats`` match figures computed independently from the
  recorded trace (``torch.cuda.memory._snapshot()``) and by hand;
- ``_record_memory_history`` / ``_snapshot`` / ``_dump_snapshot`` give PyTorch's format, with
  call stacks; everything is restored after the estimate.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import gpu_cases
import torchmem
from torchmem.fit.run._engine import run_once

MiB = 1 << 20
KEYS = ("active_bytes.all.peak", "allocated_bytes.all.current", "allocated_bytes.all.peak",
        "reserved_bytes.all.current", "reserved_bytes.all.peak", "requested_bytes.all.current",
        "requested_bytes.all.peak", "num_alloc_retries", "num_ooms", "num_device_alloc",
        "num_device_free")


def test_gpt_phase_readings_match_the_h100() -> None:
    rec = gpu_cases.recorded("gpt_phase_readings")
    readings: list[dict[str, int]] = []
    e = torchmem.estimate(
        lambda b: gpu_cases.gpt_train(b, readings=readings),   # unmodified: it reads loss.item()
        gpu=gpu_cases.recorded_gpu("gpt_phase_readings"), batch_size=rec["batch_size"],
        steps=rec["steps"], margin=0,
    )
    assert e.fits
    reads = [a for a in e.assumed_values if "gpu_cases.py" in a["where"]]
    assert {a["value"] for a in reads} == {1.0} and sum(a["count"] for a in reads) == rec["steps"]
    want = rec["readings"]
    assert len(readings) == len(want) == rec["steps"]
    for step, (got, real) in enumerate(zip(readings, want)):
        for key, value in real.items():
            tol = 0.05 if "reserved" in key else 0.01
            assert got[key] == pytest.approx(value, rel=tol), (step, key, got[key], value)
    # the phases really are apart: the forward's peak is below the whole step's
    assert readings[1]["forward_max_allocated"] < e.peak_allocated_bytes
    assert readings[1]["backward_step_max_allocated"] == pytest.approx(e.peak_allocated_bytes, rel=1e-9)


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _apply(e: dict[str, Any], req: int, res: int) -> tuple[int, int]:
    """Requested and reserved bytes after trace entry ``e``."""
    if e["action"] == "alloc":
        req += e["size"]
    elif e["action"] == "free_completed":
        req -= e["size"]
    elif e["action"] in ("segment_alloc", "segment_map"):
        res += e["size"]
    elif e["action"] in ("segment_free", "segment_unmap"):
        res -= e["size"]
    return req, res


def _replay(trace: list[dict[str, Any]], stop: int) -> tuple[int, int, int]:
    """Requested bytes now, their peak and reserved bytes after ``trace[:stop]``, from the
    trace alone (the peak from ``start``, see :func:`_window_peak`)."""
    req = peak = res = 0
    for e in trace[:stop]:
        req, res = _apply(e, req, res)
        peak = max(peak, req)
    return req, peak, res


def _window_peak(trace: list[dict[str, Any]], start: int, stop: int) -> tuple[int, int]:
    """The peaks of requested and reserved bytes over ``trace[start:stop]``, each starting from
    its value at ``start`` (a reset at ``start`` sets the peak to the current value)."""
    req, _, res = _replay(trace, start)
    peak_req, peak_res = req, res
    for e in trace[start:stop]:
        req, res = _apply(e, req, res)
        peak_req, peak_res = max(peak_req, req), max(peak_res, res)
    return peak_req, peak_res


def test_reset_sets_each_peak_to_the_current_value() -> None:
    seen: dict[str, Any] = {}

    def build(batch: int) -> Any:
        torch.cuda.memory._record_memory_history(max_entries=100_000)

        def step() -> None:
            a = _empty(8 * MiB)
            b = _empty(4 * MiB + 1000)       # requested 4 MiB + 1000, a 4 MiB + 1024 block
            del b
            seen["before"] = (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated(),
                              torch.cuda.memory_stats())
            seen["mark1"] = len(torch.cuda.memory._snapshot()["device_traces"][0])
            torch.cuda.reset_peak_memory_stats()
            seen["after_reset"] = (torch.cuda.max_memory_allocated(),
                                   torch.cuda.max_memory_reserved(), torch.cuda.memory_stats())
            c = _empty(1000)
            seen["after"] = (torch.cuda.max_memory_allocated(), torch.cuda.memory_stats())
            seen["snapshot"] = torch.cuda.memory._snapshot()
            del a, c
        return step

    e = run_once(build, 1, "H100-80GB", steps=1)
    assert e.fits
    max_before, cur_before, s0 = seen["before"]
    # before the reset, the peak of the phase includes b
    assert max_before == 12 * MiB + 1024 and cur_before == 8 * MiB
    max_reset, max_res_reset, s1 = seen["after_reset"]
    # the reset: each peak is now the current value
    assert max_reset == s1["allocated_bytes.all.current"] == 8 * MiB
    assert max_res_reset == s1["reserved_bytes.all.current"]
    assert s1["active_bytes.all.peak"] == s1["active_bytes.all.current"] == 8 * MiB
    assert s1["requested_bytes.all.peak"] == s1["requested_bytes.all.current"] == 8 * MiB
    # after it, the peak is only what came since: a + c (a 1024-byte small block)
    max_after, s2 = seen["after"]
    assert max_after == 8 * MiB + 1024
    # the whole estimate's peak is not reset
    assert e.peak_allocated_bytes >= 12 * MiB + 1024
    # independently, from the trace recorded since the build started
    trace = seen["snapshot"]["device_traces"][0]
    mark = seen["mark1"]
    req0, peak0, res0 = _replay(trace, mark)
    assert (s0["requested_bytes.all.current"], s0["requested_bytes.all.peak"]) == (req0, peak0)
    assert s0["requested_bytes.all.peak"] == 12 * MiB + 1000
    assert s0["reserved_bytes.all.current"] == res0
    peak_req, peak_res = _window_peak(trace, mark, len(trace))
    assert s2["requested_bytes.all.peak"] == peak_req == 8 * MiB + 1000
    assert s2["reserved_bytes.all.peak"] == peak_res
    assert s2["num_device_alloc"] == sum(x["action"] == "segment_alloc" for x in trace)
    assert s2["num_device_free"] == sum(x["action"] == "segment_free" for x in trace)
    for key in KEYS:
        assert key in s2, key
    assert (s2["num_alloc_retries"], s2["num_ooms"]) == (0, 0)


def test_memory_stats_summary_and_mem_get_info_follow_the_simulator() -> None:
    seen: dict[str, Any] = {}

    def build(batch: int) -> Any:
        def step() -> None:
            x = _empty(30 * MiB)
            seen["info"] = torch.cuda.mem_get_info()
            seen["total"] = torch.cuda.get_device_properties(0).total_memory
            seen["summary"] = torch.cuda.memory_summary()
            seen["nested"] = torch.cuda.memory_stats_as_nested_dict()
            seen["module"] = torch.cuda.memory.memory_allocated()  # the torch.cuda.memory name too
            del x
            torch.cuda.empty_cache()
            seen["stats"] = torch.cuda.memory_stats()
        return step

    card = torchmem.fit.gpu("H100-80GB")
    e = run_once(build, 1, card, steps=1)
    assert e.fits
    free, total = seen["info"]
    assert total == seen["total"] == card.total_bytes
    assert free == card.total_bytes - card.context_bytes - 30 * MiB
    assert "Allocated memory" in seen["summary"] and "simulated by torchmem" in seen["summary"]
    assert "30720 KiB" in seen["summary"]
    assert seen["nested"]["allocated_bytes"]["all"]["current"] == 30 * MiB == seen["module"]
    s = seen["stats"]
    assert s["reserved_bytes.all.current"] == 0 and s["reserved_bytes.all.peak"] == 30 * MiB
    assert (s["num_device_alloc"], s["num_device_free"]) == (1, 1)
    assert s["reserved_bytes.all.allocated"] == s["reserved_bytes.all.freed"] == 30 * MiB


def test_snapshot_in_pytorchs_format_with_stacks(tmp_path: Any) -> None:
    path = tmp_path / "snap.pickle"
    seen: dict[str, Any] = {}

    def build(batch: int) -> Any:
        keep = _empty(MiB)
        torch.cuda.memory._record_memory_history()

        def step() -> None:
            y = _empty(3 * MiB)
            torch.cuda.memory._dump_snapshot(str(path))
            del y
            torch.cuda.memory._record_memory_history(enabled=None)
            seen["off"] = torch.cuda.memory._snapshot()
            seen["segments"] = torch.cuda.memory_snapshot()
            seen["keep"] = keep
        return step

    assert run_once(build, 1, "H100-80GB", steps=1).fits
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    # only what came after recording started: y's segment and allocation, not keep's
    assert [x["action"] for x in trace] == ["segment_alloc", "alloc"]
    assert trace[1]["size"] == 3 * MiB
    assert any(fr["filename"] == __file__ for fr in trace[1]["frames"])
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sorted(b["requested_size"] for b in blocks) == [MiB, 3 * MiB]
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    loaded = torchmem.load_snapshot(path)
    assert loaded.trace(0)[1].size == 3 * MiB
    # stopping drops the trace; the state stays
    assert seen["off"]["device_traces"] == [[]]
    assert sum(s["allocated_size"] for s in seen["segments"]) == MiB


def test_the_scripts_own_snapshot_while_the_estimate_keeps_stacks() -> None:
    # keep_snapshot=True (and `torchmem estimate -o`) records every block's stack; a block whose
    # stack no trace entry had interned yet made torch.cuda.memory_snapshot() raise IndexError
    seen: dict[str, Any] = {}

    def build(batch: int) -> Any:
        keep = _empty(MiB)

        def step() -> None:
            y = _empty(3 * MiB)
            seen["segments"] = torch.cuda.memory_snapshot()
            seen["keep"] = keep
            del y
        return step

    est = torchmem.estimate(build, gpu="H100-80GB", batch_size=1, steps=1, keep_snapshot=True)
    blocks = [b for s in seen["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sorted(b["requested_size"] for b in blocks) == [MiB, 3 * MiB]
    assert all(any(fr["filename"] == __file__ for fr in b["frames"]) for b in blocks)
    assert est.snapshot is not None and est.peak_requested_bytes == 4 * MiB


def test_everything_is_restored_after_the_estimate() -> None:
    names = ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "memory_stats",
             "memory_summary", "mem_get_info", "_record_memory_history", "_snapshot")
    before = {n: getattr(torch.cuda.memory, n) for n in names}
    before_cuda = {n: getattr(torch.cuda, n) for n in names if hasattr(torch.cuda, n)}
    run_once(lambda b: (lambda: torch.cuda.reset_peak_memory_stats()), 1, "T4", steps=1)
    assert {n: getattr(torch.cuda.memory, n) for n in names} == before
    assert {n: getattr(torch.cuda, n) for n in before_cuda} == before_cuda


def test_simulator_peaks_of_active_and_requested_bytes() -> None:
    """A block whose free waits for another stream stays active (and requested) until
    ``process_events``; its bytes count in those peaks, not in the allocated peak; a reset sets
    every peak to the current value."""
    from torchmem.sim import CachingAllocator

    a = CachingAllocator()
    x = a.malloc(1000)                      # a 1024-byte block
    a.record_stream(x, 1)
    a.free(x)                               # pending: allocated 0, active 1024, requested 1000
    y = a.malloc(3000)                      # a 3072-byte block
    s = a.memory_stats()
    assert (s["allocated_bytes.all.current"], s["allocated_bytes.all.peak"]) == (3072, 3072)
    assert (s["active_bytes.all.current"], s["active_bytes.all.peak"]) == (4096, 4096)
    assert (s["requested_bytes.all.current"], s["requested_bytes.all.peak"]) == (4000, 4000)
    a.process_events()
    a.reset_peak()
    s = a.memory_stats()
    assert s["active_bytes.all.peak"] == s["active_bytes.all.current"] == 3072
    assert s["requested_bytes.all.peak"] == s["requested_bytes.all.current"] == 3000
    a.free(y)
    s = a.memory_stats()
    assert (s["requested_bytes.all.current"], s["requested_bytes.all.peak"]) == (0, 3000)
    assert (s["allocated_bytes.all.allocated"], s["allocated_bytes.all.freed"]) == (4096, 4096)
    assert (s["requested_bytes.all.allocated"], s["requested_bytes.all.freed"]) == (4000, 4000)
