"""A smoke run of every benchmark (BENCHMARKS.md): each script runs as a subprocess with the
smallest sizes its options allow and must exit 0 and print the figures it is meant to print
(its table headers, ratios and verdict lines, with numbers in them). The figures themselves are
noise at these sizes; what is checked is that the benchmark runs end to end and still prints its
comparison. Competitors of the ``bench`` extra that are not installed must be reported as
skipped, not crash the run.

Run one benchmark:  pytest tests/test_benchmarks_smoke.py -k bench_copy
The quick ones only: pytest tests/test_benchmarks_smoke.py -m "not slow"   (about 2 minutes)
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

# The quick half (under ~20 s each on 2 loaded cores, about 2 minutes together) runs with
# ``-m "not slow"``; the rest is marked ``slow`` (about 12 more minutes).
slow = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
NUM = r"[0-9][0-9,]*(?:\.[0-9]+)?"  # a printed figure: 12, 1,234, 0.56
_FIG = itertools.count()


def R() -> str:
    """A printed figure that :func:`has` parses and requires to be a positive finite number:
    the headline ratios, speed-ups and times of each benchmark (``nan``, ``inf``, ``-1`` or
    ``0.00`` fail; NUM alone only requires digits)."""
    return rf"(?P<fig{next(_FIG)}>{NUM})"

# script -> the smoke options. Every script of benchmarks/ not starting with "_" must be here
# (test_every_benchmark_has_a_smoke_run).
SMOKE: dict[str, list[str]] = {
    "bench_aggregate.py": ["--events", "2000", "--speed-events", "2000"],
    "bench_checkpoint_load.py": ["--models", "tiny"],
    "bench_copy.py": ["--vocab", "1000", "--repeats", "1"],
    "bench_data_prep.py": ["--smoke"],
    "bench_diff.py": ["--events", "5000", "--repeats", "1"],
    "bench_estimate.py": ["--smoke"],
    "bench_estimate_floor.py": ["--smoke", "--steps", "1"],
    "bench_estimate_hf.py": ["--layers", "1", "--gpus", "RTX-4090"],
    "bench_fit_dist.py": ["--smoke", "--world-sizes", "2"],
    "bench_gpu.py": ["--mb", "8", "--repeats", "1", "--batch", "1"],
    "bench_gpu_truth.py": ["sdpa_flash"],
    "bench_growth.py": ["--events", "5000", "--repeats", "1"],
    "bench_ledger.py": ["--smoke"],
    "bench_live.py": ["--smoke"],
    "bench_memreporter.py": ["--tensors", "500", "--repeats", "2", "--runs", "1"],
    "bench_merge.py": ["--ranks", "2", "--events", "5000", "--baseline", "1", "--jobs", "2"],
    "bench_public_truth.py": ["adam8bit", "--max-steps", "1"],
    "bench_repeat.py": ["--smoke"],
    "bench_pytest_plugin.py": ["--rounds", "1", "--tests", "2"],
    "bench_qlora.py": ["--models", "tiny", "--seq", "64"],
    "bench_replay.py": ["--reps", "1"],
    "bench_script.py": ["--smoke"],
    "bench_search.py": ["--quick", "--layers", "1", "--gpus", "RTX-4090"],
    "bench_sim.py": ["--quick", "--decomfl-reps", "1", "--train-steps", "2",
                     "--ref-requests", "1000"],
    "bench_snapshot.py": ["--events", "5000", "--repeats", "1", "--theirs-repeats", "1",
                          "--segments", "10"],
    "bench_storage.py": ["--repeats", "1", "--sizes", "100,200"],
    "bench_tracker.py": ["--smoke"],
    "bench_transfer.py": ["--mb", "2", "--repeats", "1", "--chunks", "1", "--views", "plain",
                          "--offload-layers", "2", "--offload-width", "64",
                          "--offload-batch", "8"],
    "bench_viewer.py": ["--events", "5000", "--repeats", "1"],
    "bench_whatif_levers.py": ["--smoke"],
    "bench_whatif_public.py": ["adam8bit", "--max-steps", "1"],
    "bench_whatif.py": ["--reps", "1", "--requests", "5000",
                        "--files", "MAGMA27_a2__memory_snapshot.pickle"],
    "bench_why_alive.py": ["--repeats", "1", "--ring", "500"],
    "gpu_truth.py": ["--runs", "MAGMA27", "--steps", "1", "--batch", "1"],
}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _Warm:
    """``python SCRIPT ARGS`` forked from one process per test worker that has imported torch
    and torchmem already (tests/_warm_torchmem.py): each benchmark still runs in a process of
    its own, as ``python benchmarks/<script>`` from a shell, without paying for the import."""

    client: Any = None

    @classmethod
    def run(cls, script: Path, args: list[str], timeout: float) -> tuple[int, str]:
        import tempfile

        from _warm_torchmem import WarmClient

        if cls.client is None or not cls.client.alive():
            cls.client = WarmClient(_env(), ROOT)
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            code = cls.client.run({"script": str(script), "argv": args, "cwd": str(ROOT),
                                   "stdout": str(out), "stderr": str(err)}, timeout)
            text = out.read_text() + err.read_text()
        assert code is not None, f"{script.name} {' '.join(args)} ran over {timeout} s:\n{text[-6000:]}"
        return code, text


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def run(script: str, *args: str, expect_rc: int = 0, timeout: float = 600) -> str:
    """stdout + stderr of ``python benchmarks/<script> <args>`` from the repository root, with
    this checkout's ``src`` first on the path; fails with the output if the exit code differs."""
    code, out = _Warm.run(BENCH / script, list(args), timeout)
    assert code == expect_rc, (
        f"{script} {' '.join(args)} exited {code} (expected {expect_rc}):\n{out[-6000:]}")
    return out


BAD = (r"^Traceback", r" failed: ", r"\bERROR\b", r"DIFFERENT")


def has(out: str, *patterns: str, bad: tuple[str, ...] = BAD) -> None:
    """Every regex matches a line of ``out``; no line says that a method failed or that two
    results which must agree differ."""
    for pat in patterns:
        m = re.search(pat, out, re.M)
        assert m, f"no line matches {pat!r} in:\n{out[-6000:]}"
        for name, text in m.groupdict().items():
            if name.startswith("fig") and text is not None:
                x = float(text.replace(",", ""))
                assert math.isfinite(x) and x > 0, f"{text!r} is not a positive ratio: {m[0]!r}"
    for pat in bad:
        assert not re.search(pat, out, re.M), f"a line matches {pat!r} in:\n{out[-6000:]}"


def smoke(script: str, *extra: str) -> str:
    return run(script, *SMOKE[script], *extra)


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    named = set(re.findall(r"python benchmarks/([a-z_]+\.py)", (ROOT / "BENCHMARKS.md").read_text()))
    assert named <= scripts, f"BENCHMARKS.md names missing scripts: {sorted(named - scripts)}"
    assert scripts == set(SMOKE), (
        f"no smoke run: {sorted(scripts - set(SMOKE))}; not a script: {sorted(set(SMOKE) - scripts)}")


@slow
def test_bench_aggregate() -> None:
    out = smoke("bench_aggregate.py")
    has(out, r"^variant +events +rows held +held MiB +peak MiB +RSS MiB +peak RSS MiB",
        rf"^full +{NUM} +{NUM} ", rf"^aggregate +{NUM} +{NUM} ",
        rf"^agg-nosteps +{NUM} +{NUM} ", rf"^agg-nosteps-grad +{NUM} +{NUM} ",
        *(rf"^{m}: {NUM} events without a step marker, .* peak RSS growth -?{NUM} MiB"
          rf" = -?{NUM} B/event \(target <= 64 MiB: met\)" for m in ("agg-nosteps", "agg-nosteps-grad")),
        rf"^aggregate / full: held {R()}, peak {R()}, RSS {NUM}; CPU time per event {R()}x",
        r"target <= 64 MiB: met\); same peak as full: True")


def test_bench_data_prep() -> None:
    out = smoke("bench_data_prep.py")
    has(out, rf"^  plain run +{R()} s$",
        rf"^  under the estimate +{R()} s +\({R()}x the plain run\)$",
        rf"^  host peak: estimate ({NUM}) B, arithmetic .* ({NUM}) B$")
    m = re.search(r"host peak: estimate ([0-9,]+) B, arithmetic .* ([0-9,]+) B", out)
    assert m and m.group(1) == m.group(2), out  # the host memory equals the arithmetic


def test_bench_checkpoint_load() -> None:
    pytest.importorskip("transformers")
    out = smoke("bench_checkpoint_load.py")
    has(out, rf"^tiny +{NUM} G estimate, T4: load +{NUM} +{NUM} G +{NUM} G$",
        rf"^tiny +{NUM} G estimate, T4: config +{NUM} +{NUM} G +{NUM} G$",
        rf"^tiny +checkpoint / config: wall {R()}x, peak RSS {R()}x$")


def test_bench_qlora() -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    out = smoke("bench_qlora.py")
    has(out, rf"^tiny +qlora +{NUM} G +{NUM} G +True +{NUM} +{NUM} G$",
        rf"^tiny +lora-bf16 +{NUM} G +{NUM} G +True +{NUM} +{NUM} G$",
        rf"^tiny +4-bit load: {NUM} B estimated, {NUM} B by arithmetic \(equal\); accelerate "
        rf"estimate-memory int4: {NUM} B$",
        rf"^tiny +qlora / lora-bf16: loaded {R()}x, peak reserved {R()}x; estimator peak RSS / "
        rf"checkpoint: {R()}x$")


def test_bench_copy() -> None:
    out = smoke("bench_copy.py")
    has(out, r"^tool +time +RSS growth +/unique",
        rf"^torchmem\.memory_aware_deepcopy +{NUM}s +{NUM} [KMG]?i?B +{NUM} .* True +True +yes",
        rf"^copy\.deepcopy +{NUM}s ",
        rf"deep copy time, torchmem / copy\.deepcopy +: {R()}",
        rf"deep copy peak RSS growth / unique bytes +: {NUM}",
        rf"float16 move peak RSS growth, Module\.to / torchmem: {NUM}")
    if not installed("torchlinops"):
        has(out, r"^SKIP torchlinops\.memory_aware_deepcopy: torchlinops not installed")


def test_bench_diff() -> None:
    out = smoke("bench_diff.py")
    has(out, rf"diff at the peak {NUM} s wall / {NUM} s CPU; .* = {R()}x CPU",
        r"category changes \{'optimizer_state'",
        rf"torchmem diff --at end {NUM} ms wall .* torchmem / _memory_viz = {R()}x CPU")


@slow
def test_bench_estimate() -> None:
    out = smoke("bench_estimate.py")
    has(out, r"^method +seconds +peak RSS +requested +allocated +reserved +verdict",
        rf"^torchmem +{NUM} +{NUM} GiB .* H200 (fits|OOM)", rf"^memtracker +{NUM} ",
        rf"^formula +{NUM} ", rf"^torchmem reserved / memtracker figure: {R()} ",
        rf"^torchmem reserved / formula figure: {R()} ", rf"^torchmem: {NUM} s, peak RSS")


def test_bench_estimate_floor() -> None:
    out = smoke("bench_estimate_floor.py")
    has(out, r"^method +s/step +x meta", rf"^meta device +{R()} +1\.00",
        rf"^FakeTensorMode +{R()} +{R()}", rf"^torchmem\.estimate +{R()} +{R()}",
        rf"^torchmem / FakeTensorMode: {R()}x")


def test_bench_repeat() -> None:
    out = smoke("bench_repeat.py")
    has(out, r"^24 model calls in two optimizer steps",
        rf"^replayed \((1[0-9]|2[0-4]) calls replayed\): {R()} s, {R()} GiB peak RSS",
        rf"^every call run \(--no-replay\): +{R()} s", rf"^ratio: {R()}x faster",
        r"^peaks \(requested, allocated, reserved\) \[\d+, \d+, \d+\]: equal, split equal: True")


def test_bench_estimate_hf() -> None:
    out = smoke("bench_estimate_hf.py")
    has(out, rf"^RTX-4090 .*: longest context {NUM} tokens \(torchmem\) vs {NUM} \(arithmetic\); "
             rf"ratio {R()}; {R()} probes",
        rf"^  at {NUM} tokens: weights .* KV cache .* kernel \w+", rf"^total {NUM} s for RTX-4090")


@slow
def test_bench_fit_dist() -> None:
    out = smoke("bench_fit_dist.py")
    has(out, r"^world size 2$", rf"^  torchmem +{NUM} .* (fits|OOM) on H100-80GB",
        rf"^  fsdpmemtracker +{NUM} ", rf"^  formula +{NUM} ",
        rf"peak requested torchmem - FSDPMemTracker: -?{NUM} B; time torchmem / FSDPMemTracker: "
        rf"{R()}",
        rf"ZeRO-3 formula / torchmem model state: {R()}")


def test_bench_gpu() -> None:
    if torch.cuda.is_available():
        out = smoke("bench_gpu.py")
        has(out, r"^GPU: ", r'"transfers"', r'"overlap"', r'"tracker"', r"ms_per_step")
        assert '"error"' not in out, out
    else:
        out = smoke("bench_gpu.py")  # a benchmark that needs a GPU skips cleanly: exit 0
        has(out, r"^SKIP bench_gpu: needs a CUDA GPU \(torch\.cuda\.is_available\(\) is False\); "
                 r"nothing measured$")


def test_bench_gpu_truth() -> None:
    out = smoke("bench_gpu_truth.py")
    has(out, r"^real: NVIDIA .*; estimates: torch ",
        r"^case +real alloc +estimate +err +real reserved",
        rf"^sdpa_flash +{NUM} +{NUM} +[+-]{NUM}% +{NUM} +{NUM} +[+-]{NUM}% +- +{NUM}/{NUM} +{NUM} "
        r"+fits/ran ",
        r"^1 of 1 cases meet both goals",
        r"^0 cases with a range \(the GPU's run-time choices\): the real reserved peak inside it in 0",
        r"^verdicts with the default margin: 1 of 1 right, 0 false fits")


def test_bench_growth() -> None:
    out = smoke("bench_growth.py")
    has(out, rf"{NUM} events, {NUM} iterations: growth {NUM} s CPU .* growth / summarize = "
             rf"{R()}x; found \S+ \+{NUM} B/iteration")


@slow
def test_bench_ledger() -> None:
    out = smoke("bench_ledger.py")
    has(out, rf"^  torchmem\.Ledger +{R()} us/pair +{NUM} us/pair +x ?{R()} vs Ledger",
        rf"call-site tracking costs -?{NUM} us per pair",
        r"totals exact: True", rf"Ledger/hand-rolled x{R()}",
        rf"^  Ledger\.capture +{NUM} ms +x ?{R()} vs plain",
        rf"^  {NUM} bytes per counted storage",
        r"^  tensor then its view +allocated bytes +4000 +8000 +4000")


@slow
def test_bench_live() -> None:
    out = smoke("bench_live.py")
    has(out, rf"^one panel drawn in {R()} ms", rf"^mlp: untracked {NUM} ms, run {NUM} ms",
        rf"^transformer: untracked {NUM} ms",
        rf"--live / torchmem run \(default\) +{R()}x",
        rf"meter / track\(model, opt, stacks=False\) +{R()}x")


def test_bench_memreporter() -> None:
    out = smoke("bench_memreporter.py")
    has(out, r"^torch .*, 500 live tensors, \d+ gc objects, load average",
        rf"^run 1: gc.collect {NUM} ms, MemReporter {NUM} ms \(minima of 2\); ratio of minima "
        rf"(?P<fig_min>{NUM}), of medians (?P<fig_med>{NUM}) \(goal <= 2\)")


def test_bench_merge() -> None:
    out = smoke("bench_merge.py")
    has(out, rf"^merge of 2 ranks x 5,000 events from the files: {NUM} s wall / {NUM} s CPU",
        rf"^  with --jobs 2: {NUM} s wall", rf"merge / summaries = {R()}x CPU")


@slow
def test_bench_public_truth() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = smoke("bench_public_truth.py")
    has(out, r"^published: Tesla V100-SXM2 16 GB, 2022 .*; estimates: torch ",
        r"^variant +estimated MiB +published MiB +diff",
        rf"^adam8bit +{R()} +13085 +[+-]{NUM}% +{NUM}$",
        rf"^[01] of 1 within 5% \(largest difference {NUM}%\); order the same as published",
        r"^goals not judged: --max-steps 1 is not the published run")


@slow
def test_bench_whatif_levers() -> None:
    pytest.importorskip("transformers")
    out = smoke("bench_whatif_levers.py")
    has(out, r"^what if \(each lever alone, sorted by peak reserved; as written: ",
        rf"^  grad_accumulation_2 +{NUM} (MiB|GiB) +{NUM} (MiB|GiB)  yes ",
        # (the smoke model's peak is its optimizer step's, which checkpointing leaves as is)
        rf"^    activation_checkpointing: no change: checkpointed {NUM} blocks",
        r"^best: as written \(it fits; no lever needed\)$",
        rf"^one estimate {NUM} s; what-if table \({NUM} levers run, {NUM} skipped, best "
        rf"combination included\) {NUM} s = {NUM} estimates' time; peak RSS {NUM} GiB$")


@slow
def test_bench_whatif_public() -> None:
    pytest.importorskip("transformers")
    out = smoke("bench_whatif_public.py")
    has(out, rf"^vanilla \(as written\): +{NUM} MiB, published 14949$",
        rf"^adam8bit +optimizer_8bit +{NUM} +13085 +[+-]{NUM}%$",
        rf"^worst {NUM}% \(goal 5%: (met|NOT met)\); {NUM} s for the what-if$")


@slow
def test_bench_pytest_plugin() -> None:
    out = smoke("bench_pytest_plugin.py")
    has(out, r"^2 tests \(CPU forward/backward each\), sum of test times, best of 1:",
        rf"^  plain +{R()} ms +x ?{R()} of plain", rf"^  torchmem-idle +{R()} ms +x ?{R()}",
        rf"^  torchmem-marked +{R()} ms +x ?{R()}")
    if not installed("pytest_memray"):
        has(out, r"pytest-memray not installed")
    else:
        has(out, rf"torchmem-marked / memray-marked: x{NUM}")


def test_bench_replay() -> None:
    out = smoke("bench_replay.py")
    has(out, r"^file +entries +start_state +sim\.replay +lifetimes",
        *(rf"^{name} +{NUM} +{NUM}ms +{R()}ms +{NUM}ms +{R()}x  allocs (?P<allocs>{NUM})/(?P=allocs), .*final layout "
          r"equal" for name in ("DeComFL__memory\\.pickle", "MAGMA27_a2__memory_snapshot\\.pickle",
                                "notHanmin_a2__memory_snapshot_forward\\.pickle")))


def test_bench_script() -> None:
    out = smoke("bench_script.py")
    workloads = ("mlp", "trainer") if installed("transformers") else ("mlp",)
    has(out, r"^workload +build function +script +ratio +peaks equal",
        *(rf"^{w} +{R()}s +{R()}s +{R()}x  yes$" for w in workloads),
        rf"^goal \(script <= 1\.5x the build function\): (met|NOT met) \(worst ratio {NUM}x\)")


@slow
def test_bench_search() -> None:
    # The answers are not compared here: with 1 or 2 layers the estimated peak is not monotone in
    # seq_len above ~534k tokens on the RTX-4090 (540,000 does not fit, 600,000 and 833,024 do),
    # so the bisection can stop at another boundary. The full run (32 layers) gives the same one.
    out = smoke("bench_search.py")
    has(out, r"^Llama 1 x 1024, bf16",
        rf"^RTX-4090 +torchmem +{NUM} +{NUM} +{NUM} +\w+", rf"^RTX-4090 +torchmem/256 +{NUM}",
        rf"^RTX-4090 +bisection +{NUM}",
        rf"time ratio torchmem / bisection: {R()} \(probes {R()} vs {R()}, "
        r"(same answer|DIFFERENT ANSWERS)\)", r"rounded down to 256: (True|False)",
        bad=tuple(b for b in BAD if b != "DIFFERENT"))


def test_bench_sim() -> None:
    out = smoke("bench_sim.py")
    has(out, rf"^torchmem\.sim\.CachingAllocator: {NUM} requests in {NUM} s",
        rf"with expandable_segments:True: {NUM} s", rf"ratio: torchmem\.sim is {R()}x faster",
        r"event lists asserted equal")


def test_bench_snapshot() -> None:
    out = smoke("bench_snapshot.py")
    has(out, rf"^torchmem load\+stats\+peak \(min of 1\): {NUM} s wall",
        rf"^speed-up: {R()}x wall, {R()}x CPU time", rf"^tracemalloc: .* ratio {R()}x",
        rf"^peak RSS delta: .*ratio {NUM}x")


def test_bench_storage() -> None:
    out = smoke("bench_storage.py")
    has(out, rf"^torchmem\.same_storage +{NUM} us +-> True",
        r"^ +N +tm\+gc +tm default +census", rf"^ +200 +{NUM} s +{NUM} s +{NUM} s ",
        rf"torchmem all-live default: {R()}x time")
    if installed("torchlinops"):
        has(out, rf"ratio torchlinops / torchmem: {R()}x")
    else:
        has(out, r"^SKIP torchlinops: torchlinops not installed")
    if not installed("pytorch_memlab"):
        has(out, r"^SKIP pytorch_memlab: pytorch_memlab not installed")


@slow
def test_bench_tracker() -> None:
    out = smoke("bench_tracker.py")
    row = rf" +{NUM} +{NUM} +{NUM} +{NUM} +{NUM}$"
    has(out, r"^  variant +in-step ms +x untracked +x floor +end x +total x",
        *(rf"^  {k}{row}" for k in ("untracked", "floor", "memtracker", "torchmem",
                                      "torchmem-fast", "torchmem-lite")),
        rf"torchmem vs MemTracker: {R()}x faster \(total\)",
        rf"^mlp: torchmem mode='fast' {R()}x", rf"^transformer: torchmem mode='fast' {R()}x",
        rf"^tracker memory: {R()} bytes per held event",
        rf"^loading a 10,000-event trace \({NUM} MB\): {NUM} s")
    if not installed("memray"):
        has(out, r"^SKIP memray: not installed")


@slow
def test_bench_tracker_stream() -> None:
    out = smoke("bench_tracker.py", "--stream")
    has(out, r"^  variant +CPU ms/step +wall ms/step",
        rf"^  streamed +{NUM} +{NUM}$",
        rf"^  streamed / in memory: CPU {R()}x, wall {R()}x")


@slow
def test_bench_transfer() -> None:
    out = smoke("bench_transfer.py")
    has(out, r"^contiguous source, CPU -> CPU",
        rf"^x\.to\('cpu', copy=True\) +{NUM}ms +1\.00x +{NUM} [KMG]?i?B",
        rf"^chunked_transfer, 1\.00 MiB chunks +{R()}ms +{R()}x .* {NUM} [KMG]?i?B",
        rf"^offload_forward\(\.\.\., overlap=True\) +{R()}ms +{R()}x")


@slow
def test_bench_viewer() -> None:
    out = smoke("bench_viewer.py")
    has(out, r"^snapshot: 5,000 events",
        rf"^  torchmem view \(safe load \+ payload\) +{NUM} s +size .* = {R()}x the pickle",
        rf"^  ratio: torchmem's HTML is {R()}x smaller")
    if "browser figures skipped" not in out:  # no playwright or no chromium: it says so
        has(out, rf"time to interactive\): {NUM} s", r"JavaScript errors: 0")


@slow
def test_bench_viewer_real_file() -> None:
    out = run("bench_viewer.py", "--file", "tests/data/SketchKV2__my_snapshot.pickle",
              "--repeats", "1")
    has(out, rf"^snapshot: {NUM} events, {NUM} segments",
        rf"^  torchmem view \(safe load \+ payload\) +{NUM} s")


def test_bench_whatif() -> None:
    out = smoke("bench_whatif.py")
    has(out, r"^trace +entries +replay +whatif",
        rf"^MAGMA27_a2__memory_snapshot\.pickle +{NUM} +{R()}s +{R()}s +{R()}x .* yes +{NUM} -> "
        rf"{NUM} +{NUM}s +{NUM}x best ",
        rf"^generated, 5000 requests +{NUM} .* yes ")


@slow
def test_bench_why_alive() -> None:
    out = smoke("bench_why_alive.py")
    has(out, rf"^why_alive, first path +{NUM} +{NUM}  .*GLOBAL",
        rf"^gc\.get_referrers backward walk +{NUM} +1\.00",
        r"^  why_alive: .*LOSSES .*saved tensor",
        r"^tensor held by a reference cycle, 500 more garbage objects in a ring:$",
        rf"^  why_alive: +{NUM} s  ratio +{R()}  reference cycle waiting for the garbage "
        r"collector: <_Obj object> -> _Obj.other -> _Obj.other -> \(back to the start\)",
        rf"^  backward walk: +{NUM} s  ratio +1\.00  None$",
        r"^a tensor nothing holds, 3 calls in a row:$",
        *(rf"^  call {i}: +{NUM} s, {NUM} objects searched, 0 cyclic garbage objects left, 0 "
          r"modules imported by the search$" for i in (1, 2, 3)),
        rf"^host_memory\(\) .*: {NUM} ms; psutil memory_info\(\) \(RSS\): {NUM} ms; ratio {R()}x")


@slow
def test_gpu_truth() -> None:
    out = smoke("gpu_truth.py")
    def fig() -> str:  # real, torchmem, ratio, plain fake, ratio
        return rf" +{R()} +{R()} +{R()} +{R()} +{R()}$"

    has(out, r"^smoke run: ", r"^run +figure +real +torchmem +ratio +plain fake +ratio",
        rf"^MAGMA27 +requested{fig()}", rf"^MAGMA27 +allocated{fig()}",
        rf"^MAGMA27 +seconds +{R()} +{R()}$")
