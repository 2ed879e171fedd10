"""Checks on this CPU-only machine from the data a real GPU recorded (``tests/data/gpu/``).

Every reference snapshot was recorded from an empty allocator (see its README), so:
- torchmem's reading of each file must give the end state ``torch.cuda.memory_stats()`` reported
  at the same moment, and the trace's segment entries its cudaMalloc/cudaFree counts;
- the allocator simulator, replaying the trace from nothing, must put every allocation at its
  real address and reach the peaks the real allocator reported (allocated, reserved, requested);
- ``torchmem.estimate`` of the same build, run here under fake tensors, must be within the
  goals (peak allocated within 1%, reserved within 5%) on the cases listed in :data:`WITHIN_GOALS`.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import gpu_cases
import torchmem
from torchmem.analysis import stats
from torchmem.errors import SnapshotFormatError
from torchmem.sim import replay

GPU_DATA = Path(__file__).parent / "data" / "gpu"
CASE_NAMES = sorted(gpu_cases.CASES)
REPLAYED = CASE_NAMES  # expandable segments too (every mapping at its real address)


def _record(name: str) -> dict:
    path = GPU_DATA / f"{name}.json"
    if not path.exists():
        pytest.fail(f"reference file {path} is missing: record it with scripts/record_gpu_reference.py")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        pytest.fail(f"reference file {path} is not valid JSON (truncated?): {e}")


def _snapshot(name: str) -> torchmem.Snapshot:
    path = GPU_DATA / f"{name}.pickle"
    if not path.exists():
        pytest.fail(f"reference file {path} is missing: record it with scripts/record_gpu_reference.py")
    return torchmem.load_snapshot(path)


def _raw_actions(name: str) -> dict[str, int]:
    """Counts of each trace action, read from the pickle with plain ``pickle`` (not torchmem)."""
    with open(GPU_DATA / f"{name}.pickle", "rb") as f:
        raw = pickle.load(f)
    counts: dict[str, int] = {}
    for trace in raw["device_traces"]:
        for entry in trace:
            counts[entry["action"]] = counts.get(entry["action"], 0) + 1
    return counts


def test_every_case_was_recorded():
    index = json.loads((GPU_DATA / "index.json").read_text())
    assert sorted(index["cases"]) == CASE_NAMES
    for name in CASE_NAMES:
        rec = _record(name)
        assert rec["trace_complete"] and rec["steps"] == gpu_cases.CASES[name].steps
        assert rec["alloc_conf"] == gpu_cases.CASES[name].alloc_conf
        assert (rec["oom"] is not None) == gpu_cases.CASES[name].expect_oom


@pytest.mark.parametrize("name", CASE_NAMES)
def test_reading_matches_memory_stats(name):
    rec = _record(name)
    st = rec["memory_stats"]
    (dev,) = stats(_snapshot(name)).devices
    assert dev.allocated_bytes == st["allocated_bytes.all.current"]
    assert dev.reserved_bytes == st["reserved_bytes.all.current"]
    assert dev.active_bytes == st["active_bytes.all.current"]
    assert dev.requested_bytes == st["requested_bytes.all.current"]
    actions = _raw_actions(name)
    assert dev.trace_actions == actions
    if dev.expandable_segments:
        # expandable segments map and unmap pages instead of calling cudaMalloc per segment
        assert actions.get("segment_map", 0) >= 1
    else:
        assert actions.get("segment_alloc", 0) == st["num_device_alloc"]
        assert actions.get("segment_free", 0) == st["num_device_free"]
    assert actions.get("oom", 0) == st["num_ooms"]


@pytest.mark.parametrize("name", REPLAYED)
def test_replay_from_empty_matches_the_real_allocator(name):
    """Every allocation at its real address, and the real peaks, from an empty start."""
    rec = _record(name)
    st = rec["memory_stats"]
    r = replay(_snapshot(name))
    assert r.first_divergence is None, r.first_divergence
    assert r.allocs_expected == r.allocs_matched == _raw_actions(name)["alloc"]
    assert r.final_layout_equal
    assert r.peak_allocated_bytes == st["allocated_bytes.all.peak"]
    assert r.peak_reserved_bytes == st["reserved_bytes.all.peak"]
    assert r.peak_requested_bytes == st["requested_bytes.all.peak"]


def test_truncated_reference_file_is_named(tmp_path):
    src = GPU_DATA / "sdpa_flash.pickle"
    bad = tmp_path / "sdpa_flash.pickle"
    bad.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(SnapshotFormatError, match="sdpa_flash.pickle"):
        torchmem.load_snapshot(bad)


# The cases whose estimate meets the goals today (benchmarks/bench_gpu_truth.py prints all).
WITHIN_GOALS = ["accum2_fp32", "alloc_expandable", "alloc_max_split_64",
                "alloc_roundup4", "checkpoint_fp32", "empty_cache_midway", "gpt_bf16_b32",
                "gpt_bf16_b8", "gpt_bf16_near_limit", "gpt_bf16_weights", "gpt_fp32_b32",
                "gpt_fp32_b8", "gpt_fp32_fused_adamw", "gpt_fp32_near_limit",
                "gpt_fp32_per_parameter_adamw", "gpt_host_built_pinned_batches",
                "gpt_phase_readings", "hf_generate_4096", "hf_generate_512", "sdpa_efficient",
                "sdpa_flash"]


#: ... and whose peak allocated is the H100's to the byte (host memory kept apart: AdamW's step
#: counters, CPU scalars on a GPU too, are not device memory)
EXACT_ALLOCATED = sorted(set(WITHIN_GOALS) - {"gpt_bf16_weights"})


@pytest.mark.parametrize("name", WITHIN_GOALS)
def test_estimate_within_goals(name):
    st = _record(name)["stats"]
    est = gpu_cases.estimate_case(name)
    real_alloc, real_res = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
    assert abs(est.peak_allocated_bytes - real_alloc) <= 0.01 * real_alloc
    assert abs(est.peak_reserved_bytes - real_res) <= 0.05 * real_res
    assert est.fits
    assert gpu_cases.case_false_fits(name, est) is None  # (the default margin's verdict too)
    if name in EXACT_ALLOCATED:
        assert est.peak_allocated_bytes == real_alloc


def test_a_memory_fraction_set_by_the_program_limits_the_segments_as_on_the_h100():
    """``torch.cuda.set_per_process_memory_fraction(f)``, as the recorder called it: the
    allocator's segments fit within f x the device's whole memory (the CUDA context is not
    counted), and the collector of ``garbage_collection_threshold`` runs from then on. The
    estimate on the whole H100 (its program making the call) meets the recorded runs to the
    byte: the real OOM at the same request with the same peaks, and the collector's peak."""
    oom = _record("oom_fraction")
    est = gpu_cases.estimate_case("oom_fraction")
    st = oom["stats"]
    assert not est.fits and est.oom is not None
    assert gpu_cases.case_false_fits("oom_fraction", est) is None
    assert f"Tried to allocate {est.oom.requested_bytes / 2**20:.2f} MiB" in oom["oom"]
    assert est.oom.allocated_bytes == st["allocated_bytes.all.peak"]
    assert est.peak_allocated_bytes == st["allocated_bytes.all.peak"]
    assert est.peak_reserved_bytes == st["reserved_bytes.all.peak"]
    # the limit: 8% of the device's memory, as the real allocator's message says
    allowed = int(0.08 * oom["versions"]["total_memory"])
    assert f"{allowed} allowed by the memory fraction" in est.oom.message
    assert f"{allowed / 2**30:.2f} GiB allowed" in oom["oom"]
    gc = gpu_cases.estimate_case("alloc_gc0.6_fraction")
    st = _record("alloc_gc0.6_fraction")["stats"]
    assert gc.peak_reserved_bytes == st["reserved_bytes.all.peak"]
    assert gc.peak_allocated_bytes == st["allocated_bytes.all.peak"]
    assert gc.fits  # (its case is left out of WITHIN_GOALS: checked here, to the byte)
    assert gpu_cases.case_false_fits("alloc_gc0.6_fraction", gc) is None


def test_a_memory_fraction_in_the_allocator_settings_is_the_programs_call():
    """``PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:0.08`` limits as the call does:
    a fraction of the device's whole memory, not of what is left after the CUDA context."""
    c, rec = gpu_cases.CASES["oom_fraction"], _record("oom_fraction")
    est = torchmem.estimate(lambda bs: c.build(bs, **c.params),
                            gpu=gpu_cases.recorded_gpu("oom_fraction"),
                            batch_size=rec["batch_size"], steps=rec["steps"], margin=0,
                            alloc_conf="per_process_memory_fraction:0.08")
    assert est.oom is not None
    assert est.peak_reserved_bytes == rec["stats"]["reserved_bytes.all.peak"]
    assert est.oom.allocated_bytes == rec["stats"]["allocated_bytes.all.peak"]


#: The cases outside WITHIN_GOALS and the test that checks each one's verdict (no false fits).
VERDICT_ELSEWHERE = {
    "convnet": "test_estimate_gpu_reference.py::test_cudnn_convolution_workspaces_convnet",
    "two_streams": "test_estimate_gpu_reference.py::test_record_stream_two_streams_allocated",
    "hf_trainer": "test_math_attention_softmax_temporaries_as_on_the_h100",
    "oom_fraction": "test_a_memory_fraction_set_by_the_program_limits_the_segments_as_on_the_h100",
    "alloc_gc0.6_fraction": "test_a_memory_fraction_set_by_the_program_limits_the_segments_as_on_the_h100",
}


def test_every_cases_verdict_is_checked():
    """Issue 43: every recorded case's estimate is checked for a false "fits" (its verdict with
    the default margin against the real run), in one test or another: a new case cannot slip
    by."""
    assert set(WITHIN_GOALS) | set(VERDICT_ELSEWHERE) == set(gpu_cases.CASES)
    assert not set(WITHIN_GOALS) & set(VERDICT_ELSEWHERE)
    here = Path(__file__).read_text() + (Path(__file__).parent / "test_estimate_gpu_reference.py").read_text()
    for name, test in VERDICT_ELSEWHERE.items():
        assert f"def {test.split('::')[-1]}(" in here, (name, test)
        assert f'case_false_fits("{name}"' in here or name == "hf_trainer", name


def test_a_missing_reference_file_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_cases, "DATA", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"convnet\.json is missing: record it"):
        gpu_cases.recorded("convnet")
    (tmp_path / "convnet.json").write_text('{"batch_size": 6')
    with pytest.raises(ValueError, match=r"convnet\.json is not valid JSON \(truncated\?\)"):
        gpu_cases.recorded("convnet")


def test_the_recorder_refuses_to_run_without_a_gpu():
    import subprocess
    import sys

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU: the recorder would record")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "record_gpu_reference.py"),
                          "--out", "/nonexistent"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no CUDA GPU here" in out.stderr and "Traceback" not in out.stderr


def _runs(snap: torchmem.Snapshot, pattern: list[tuple[str, int]]) -> int:
    """How many times ``pattern`` (``(action, size)`` of allocs and completed frees, in a row)
    occurs in the first device's trace."""
    seq = [(e.action, e.size) for e in snap.trace(0) if e.action in ("alloc", "free_completed")]
    n = len(pattern)
    return sum(seq[i:i + n] == pattern for i in range(len(seq) - n + 1))


def test_math_attention_softmax_temporaries_as_on_the_h100():
    """SDPA's math path (fp32 with grouped KV heads, hf_trainer) calls ``_safe_softmax``, whose
    composite CUDA kernel allocates a bool -inf mask, its masked rows and a zero scalar after
    the softmax and frees them on return; the fake run's meta kernel allocates none of them.
    The H100 trace shows the run (B=8, H=4, S=256: 2 MiB, 8 KiB, 4 B) once per layer and
    forward; the estimate's trace must show it as often."""
    pytest.importorskip("transformers")
    name = "hf_trainer"
    c, rec = gpu_cases.CASES[name], _record(name)
    est = torchmem.estimate(lambda bs: c.build(bs, **c.params), gpu=gpu_cases.recorded_gpu(name),
                            batch_size=rec["batch_size"], steps=rec["steps"], margin=0,
                            keep_snapshot=True)
    b, h, s = rec["batch_size"], gpu_cases.HF_LLAMA["num_attention_heads"], 256
    mask, rows = b * h * s * s, b * h * s
    pattern = [("alloc", mask), ("alloc", rows), ("alloc", 4), ("free_completed", 4),
               ("free_completed", rows), ("free_completed", mask)]
    real = _runs(_snapshot(name), pattern)
    assert real == gpu_cases.HF_LLAMA["num_hidden_layers"] * 3  # 2 layers, 3 optimizer steps
    assert _runs(est.snapshot, pattern) == real
    # the 13.5% low reserved peak of this case (an 8 MiB block more in torch 2.11's attention
    # backward) stays within the default margin: no false fits
    assert gpu_cases.case_false_fits(name, est) is None
