"""torchmem.sim.whatif / suggest and ``torchmem whatif``: the recorded requests under other settings.

Ground truth comes from elsewhere: the real snapshots' own entries and the peaks measured by an
independent block replay (../shared/data/gpu-truth.md, also pinned in test_sim_replay.py); runs
of the simulator itself whose OOM (or not) is raised by :class:`CachingAllocator` while the
snapshot is recorded; the allocator's rules applied by hand (segment sizes, best fit, splitting,
expandable pages of 20 MiB); and :func:`torchmem.estimate`'s own counters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmem.cli import main
from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.io import load_snapshot, save_trace
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.model.events import EventKind
from torchmem.model.snapshot import Snapshot
from torchmem.model.trace import Trace
from torchmem.sim import AllocatorConfig, CachingAllocator, WhatIf, replay, suggest, whatif
from torchmem.sim.whatif import SUGGESTED_CONFIGS, conf_string

MiB = 1 << 20
DATA = Path(__file__).resolve().parent / "data"
# the traces torchmem replay reproduces exactly, and their independent figures (gpu-truth.md):
# (peak allocated, peak reserved, segment_alloc entries)
EXACT = {
    "DeComFL__memory.pickle": (1_790_894_592, 1_897_922_560, 61),
    "MAGMA27_a2__memory_snapshot.pickle": (13_927_832_064, 14_180_941_824, 0),
    "notHanmin_a2__memory_snapshot_forward.pickle": (44_634_833_408, 47_234_154_496, 0),
}
STATE_ONLY = ["Attention__memory.pickle", "SketchKV2__my_snapshot.pickle",
              "LLM-inference__oom_snapshot_41810ba.pickle"]


def _fragmented_oom() -> Snapshot:
    """Two 20 MiB segments of three 6 MiB blocks each (2 MiB tails), the outer blocks freed:
    28 MiB cached but at most 8 MiB contiguous, and a 10 MiB request on a full 40 MiB device."""
    a = CachingAllocator(capacity=40 * MiB)
    xs = [a.malloc(6 * MiB) for _ in range(6)]
    for k in (0, 2, 3, 5):
        a.free(xs[k])
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(10 * MiB)
    return a.snapshot()


def _split_big_block_oom() -> Snapshot:
    """A cached 64 MiB segment split by a 4 MiB request, then 64 MiB again on a 100 MiB device."""
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(64 * MiB))
    a.malloc(4 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(64 * MiB)
    return a.snapshot()


# -- identity: the replay proof on real snapshots ---------------------------------------------


@pytest.mark.parametrize("name", sorted(EXACT))
def test_without_alloc_conf_the_whatif_equals_the_recorded_run(name: str) -> None:
    snap = load_snapshot(DATA / name)
    d = whatif(snap).devices[0]
    peak_alloc, peak_res, seg_allocs = EXACT[name]
    rec = d.recorded
    assert (rec.peak_allocated_bytes, rec.peak_reserved_bytes, rec.segment_allocs) == (
        peak_alloc, peak_res, seg_allocs)
    assert rec.segment_frees == [e.action for e in snap.trace(0)].count("segment_free")
    assert rec.oom is None and rec.alloc_retries == 0
    assert d.replay_exact is True and d.identical
    assert d.whatif.same_as(rec)
    # fragmentation at the peak adds up, and its blocks lie inside it
    assert rec.fragmentation_bytes == 0 or rec.fragmentation_bytes >= max(
        rec.largest_free_block_bytes.values())
    assert rec.inactive_split_bytes <= rec.fragmentation_bytes
    assert any("the replay proof" in n for n in d.notes)


def test_mid_run_traces_are_reported_as_such() -> None:
    d = whatif(load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle")).devices[0]
    assert d.start == "rebuilt"
    assert any("starts mid-run" in n and "216 segments" in n for n in d.notes)
    e = whatif(load_snapshot(DATA / "DeComFL__memory.pickle")).devices[0]
    assert e.start == "empty" and not any("mid-run" in n for n in e.notes)


def test_decomfl_expandable_segments_by_the_rules() -> None:
    """DeComFL under expandable segments: fewer cudaMalloc-like calls (page maps), lower peak
    reserved, no split bytes, and blocks no bigger than the recorded ones."""
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    d = whatif(snap, "expandable_segments:True").devices[0]
    assert not d.identical
    assert d.whatif.alloc_conf == "expandable_segments:True"
    assert d.whatif.peak_reserved_bytes < d.recorded.peak_reserved_bytes
    assert d.whatif.segment_allocs < d.recorded.segment_allocs
    # a mapped range is reserved only in whole pages of 2 MiB (small) or 20 MiB (large)
    assert d.whatif.peak_reserved_bytes % (2 * MiB) == 0
    assert d.whatif.inactive_split_bytes == 0  # PyTorch counts no split bytes in expandable ranges
    # the same rounding, and splits down to 512 B: no block is bigger than the recorded one,
    # none smaller than its request (gpu-truth's peak requested, 1,783,664,516 B)
    assert 1_783_664_516 <= d.whatif.peak_allocated_bytes <= d.recorded.peak_allocated_bytes


# -- hand-computed what-ifs: an OOM the recorded settings hit, avoided ------------------------


def test_expandable_segments_avoid_a_fragmentation_oom() -> None:
    snap = _fragmented_oom()
    d = whatif(snap, "expandable_segments:True").devices[0]
    rec, wi = d.recorded, d.whatif
    # recorded: 2 segments of 20 MiB, 36 MiB allocated at the peak (six 6 MiB blocks), two 2 MiB
    # tails free in split segments; the 10 MiB request fails on the full 40 MiB device
    assert (rec.peak_reserved_bytes, rec.peak_allocated_bytes) == (40 * MiB, 36 * MiB)
    assert rec.fragmentation_bytes == 4 * MiB and rec.inactive_split_bytes == 4 * MiB
    assert rec.largest_free_block_bytes == {"large": 2 * MiB, "small": 0}
    assert (rec.segment_allocs, rec.segment_frees, rec.alloc_retries) == (2, 0, 1)
    assert rec.oom is not None
    assert (rec.oom["request_bytes"], rec.oom["device_free_bytes"]) == (10 * MiB, 0)
    # the device is the one the OOM ran on: 40 MiB reserved + 0 B free
    assert d.capacity == 40 * MiB and "recorded OOM" in (d.capacity_source or "")
    # expandable: one range of two 20 MiB pages, the blocks back to back (36 MiB), a 4 MiB tail;
    # freeing 1, 3, 4, 6 leaves [12, 24) and [30, 40) MiB free: the 10 MiB request fits
    assert (wi.peak_reserved_bytes, wi.peak_allocated_bytes) == (40 * MiB, 36 * MiB)
    assert wi.largest_free_block_bytes == {"large": 4 * MiB, "small": 0}
    assert wi.inactive_split_bytes == 0
    assert (wi.segment_allocs, wi.alloc_retries, wi.oom) == (2, 0, None)
    assert d.recorded_oom_avoided is True


def test_max_split_size_avoids_splitting_the_big_cached_block() -> None:
    snap = _split_big_block_oom()
    d = whatif(snap, "max_split_size_mb:32").devices[0]
    rec, wi = d.recorded, d.whatif
    # recorded: the 4 MiB request splits the cached 64 MiB segment; 64 MiB more does not fit
    # next to it on 100 MiB (36 MiB free), and the split segment cannot be released
    assert (rec.peak_reserved_bytes, rec.segment_allocs, rec.alloc_retries) == (64 * MiB, 1, 1)
    assert rec.oom is not None and rec.oom["request_bytes"] == 64 * MiB
    assert d.capacity == 100 * MiB
    # max_split_size 32 MiB: the 4 MiB request may not take the 64 MiB block (>= 32 MiB), so it
    # gets a new 20 MiB segment; the second 64 MiB request takes the intact 64 MiB block
    assert (wi.peak_reserved_bytes, wi.segment_allocs, wi.oom) == (84 * MiB, 2, None)
    assert wi.peak_allocated_bytes == 68 * MiB and wi.fragmentation_bytes == 16 * MiB
    assert d.recorded_oom_avoided is True
    assert whatif(snap).devices[0].recorded_oom_avoided is False  # the recorded settings: again


def test_the_recorded_oom_is_reproduced_with_the_recorded_settings() -> None:
    d = whatif(_fragmented_oom()).devices[0]
    assert d.identical and d.recorded_oom_avoided is False
    assert d.whatif.oom is not None and d.whatif.oom["recorded"]
    assert d.whatif.alloc_retries == d.recorded.alloc_retries == 1


def test_the_allocators_own_release_before_an_oom_is_not_replayed_twice() -> None:
    """On a 40 MiB device: two 12 MiB segments, one freed; a 30 MiB request releases the cached
    one (a segment_free entry before the oom entry) and still does not fit (12 + 30 > 40)."""
    b = CachingAllocator(capacity=40 * MiB)
    x = b.malloc(12 * MiB)
    b.malloc(12 * MiB)
    b.free(x)
    with pytest.raises(SimulatedOutOfMemoryError):
        b.malloc(30 * MiB)
    snap = b.snapshot()
    assert [e.action for e in snap.trace(0)][-2:] == ["segment_free", "oom"]
    d = whatif(snap).devices[0]
    assert d.capacity == 40 * MiB  # 12 MiB reserved after the release + 28 MiB free
    assert d.identical and d.recorded_oom_avoided is False
    assert (d.whatif.segment_frees, d.whatif.alloc_retries) == (1, 1)


def test_a_capacity_moves_the_oom_and_says_where() -> None:
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB))  # a 12 MiB segment, cached
    a.malloc(14 * MiB)  # no fit: a new 14 MiB segment (26 MiB reserved)
    snap = a.snapshot()
    # 20 MiB: the 14 MiB request's cudaMalloc fails, the retry frees the cached 12 MiB segment
    d = whatif(snap, capacity=20 * MiB).devices[0]
    assert (d.whatif.peak_reserved_bytes, d.whatif.segment_frees, d.whatif.alloc_retries) == (
        14 * MiB, 1, 1)
    assert d.whatif.oom is None and d.recorded.peak_reserved_bytes == 26 * MiB
    # 13 MiB: 12 MiB fits, 14 MiB never does; entries: segment_alloc, alloc, free_requested,
    # free_completed, segment_alloc, alloc (the one that fails)
    d = whatif(snap, capacity="13 MiB").devices[0]
    assert d.whatif.oom is not None
    assert (d.whatif.oom["entry"], d.whatif.oom["request_bytes"]) == (5, 14 * MiB)
    assert d.whatif.oom["recorded"] is False and not d.whatif.complete
    assert d.recorded.oom is None and d.capacity_source == "given"
    assert not d.identical and any("no identity is claimed" in n for n in d.notes)


# -- suggestions -------------------------------------------------------------------------------


def test_suggestions_are_ranked_oom_first_then_reserved_then_cudamalloc() -> None:
    d = suggest(_fragmented_oom()).devices[0]
    ran = [s for s in d.suggestions if s.figures is not None]
    keys = [s.figures.key() for s in ran if s.figures is not None]
    assert keys == sorted(keys) and len(ran) == len(SUGGESTED_CONFIGS)
    assert d.best is not None and d.best.alloc_conf == "expandable_segments:True"
    assert d.best.avoids_oom and ran[0] is d.best
    # every other setting still runs out of memory here: the cached blocks are split
    assert all(s.figures is not None and s.figures.oom is not None for s in ran[1:])
    assert "allocation retries" in d.best.cost


def test_suggest_ranks_by_reserved_and_names_no_best_when_nothing_beats_the_recording() -> None:
    d = suggest(load_snapshot(DATA / "DeComFL__memory.pickle")).devices[0]
    ran = [s for s in d.suggestions if s.figures is not None]
    assert [s.figures.key() for s in ran if s.figures] == sorted(
        s.figures.key() for s in ran if s.figures)
    assert d.best is ran[0] and d.best.figures is not None
    assert d.best.saved_bytes == d.recorded.peak_reserved_bytes - d.best.figures.peak_reserved_bytes > 0
    # garbage collection needs the device's size; without one it is skipped with the reason
    skipped = [s for s in d.suggestions if s.figures is None]
    assert skipped and all("capacity" in (s.skipped or "") for s in skipped)
    # MAGMA27: no cudaMalloc in the window, nothing lowers the (constant) reserved bytes
    m = suggest(load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle")).devices[0]
    assert m.best is None


def test_suggestions_build_on_the_recorded_settings() -> None:
    a = CachingAllocator(config="max_split_size_mb:200")
    a.free(a.malloc(12 * MiB))
    a.malloc(14 * MiB)
    d = suggest(a.snapshot(), configs=["expandable_segments:True"]).devices[0]
    assert d.recorded.alloc_conf == "max_split_size_mb:200"
    assert d.suggestions[0].alloc_conf == "max_split_size_mb:200,expandable_segments:True"
    assert d.suggestions[0].line.startswith("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:200,")


# -- inputs: a torchmem trace, an estimate -----------------------------------------------------


def _tracked() -> Trace:
    tr = Trace()
    tr.append(EventKind.ALLOC, 1000, "cpu", 4096, 1)
    tr.append(EventKind.ALLOC, 2000, "cpu", 12 * MiB, 2)
    tr.append(EventKind.FREE, 3000, "cpu", 12 * MiB, 2)
    tr.append(EventKind.ALLOC, 4000, "cpu", 14 * MiB, 3)
    return tr


def test_a_torchmem_trace_is_simulated_from_its_requests(tmp_path: Path) -> None:
    d = whatif(_tracked(), "expandable_segments:True").devices[0]
    assert d.source == "trace" and d.replay_exact is None
    # default settings: a 2 MiB small segment (4 KiB), a 12 MiB segment, then a 14 MiB one
    assert (d.recorded.peak_reserved_bytes, d.recorded.segment_allocs) == (28 * MiB, 3)
    assert d.recorded.peak_allocated_bytes == 4096 + 14 * MiB
    # expandable: one 2 MiB small page; the large range maps one 20 MiB page for both
    assert (d.whatif.peak_reserved_bytes, d.whatif.segment_allocs) == (22 * MiB, 2)
    assert any("no caching allocator was recorded" in n for n in d.notes)
    p = tmp_path / "run.tmtrace"
    save_trace(_tracked(), p)
    loaded = whatif(load_snapshot(p), "expandable_segments:True").devices[0]
    assert loaded.whatif.same_as(d.whatif) and loaded.recorded.same_as(d.recorded)


def test_an_estimate_is_replayed_on_its_gpu() -> None:
    import torch

    import torchmem

    def build(batch: int):  # type: ignore[no-untyped-def]
        net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 256)).cuda()
        opt = torch.optim.Adam(net.parameters())
        x = torch.randn(batch, 256, device="cuda")

        def step() -> None:
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return step

    est = torchmem.estimate(build, gpu="T4", batch_size=16, keep_snapshot=True)
    d = whatif(est).devices[0]
    assert d.source == "estimate" and d.capacity == est.usable_bytes
    # the estimate's own counters are the ground truth of its run
    assert d.recorded.peak_reserved_bytes == est.peak_reserved_bytes
    assert d.recorded.peak_allocated_bytes == est.peak_allocated_bytes
    assert d.identical and d.replay_exact
    with pytest.raises(InvalidInputError, match="keep_snapshot=True"):
        whatif(torchmem.estimate(build, gpu="T4", batch_size=16))


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_option_is_named_with_the_valid_ones() -> None:
    snap = _fragmented_oom()
    with pytest.raises(InvalidInputError, match="'expandable_segment'.*known options:.*expandable_segments"):
        whatif(snap, "expandable_segment:True")
    with pytest.raises(InvalidInputError, match="max_split_size_mb: got 'lots'.*valid options: .*"
                                                "max_split_size_mb"):
        whatif(snap, "max_split_size_mb:lots")
    with pytest.raises(InvalidInputError, match="option expandable_segments: expected ':'.*valid"):
        whatif(snap, "expandable_segments")
    with pytest.raises(InvalidInputError, match="capacity must be > 0"):
        whatif(snap, capacity=0)


@pytest.mark.parametrize("name", STATE_ONLY)
def test_a_snapshot_without_history_says_how_to_record_it(name: str) -> None:
    with pytest.raises(InvalidInputError, match="what-if needs the allocator history: .*record with"):
        whatif(load_snapshot(DATA / name))


def test_a_trace_cut_short_is_reported_never_replayed_as_complete() -> None:
    e = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0}  # noqa: E731
    snap = from_pytorch({"segments": [], "device_traces": [[
        e("alloc", 1 << 30, 4096), e("free_completed", 2 << 30, 4096)]]})
    with pytest.raises(InvalidInputError, match="cut short .*dropped"):
        whatif(snap)


def test_gc_settings_need_a_capacity() -> None:
    snap = CachingAllocator().snapshot()
    a = CachingAllocator()
    a.malloc(100)
    with pytest.raises(InvalidInputError, match="needs the device's capacity"):
        whatif(a.snapshot(), "garbage_collection_threshold:0.8,per_process_memory_fraction:0.9")
    with pytest.raises(InvalidInputError, match="what-if needs the allocator history"):
        whatif(snap)
    with pytest.raises(InvalidInputError, match="got str"):
        whatif("snap.pickle")


def test_device_selection() -> None:
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    assert [d.device for d in whatif(snap, device=0).devices] == [0]
    with pytest.raises(InvalidInputError, match="device 3 is not in .*it has devices \\[0\\]"):
        whatif(snap, device=3)


def test_conf_string_round_trips() -> None:
    for text in ("", "expandable_segments:True", "max_split_size_mb:128,garbage_collection_threshold:0.6",
                 "roundup_power2_divisions:[256:1,512:2,>:4]", "large_segment_size_mb:64",
                 "per_process_memory_fraction:0.5,release_lock_on_cudamalloc:True"):
        c = AllocatorConfig.parse(text)
        assert AllocatorConfig.parse(conf_string(c)) == c


def _program(a: CachingAllocator) -> CachingAllocator:
    """The GPU test's workload, as allocator calls, three rounds: twelve 6 MiB blocks, every
    other one freed; a 64 MiB temporary (a cached segment once freed); then 10 MiB or more,
    which splits that cached block unless max_split_size_mb forbids it; a 60 MiB temporary
    (a whole cached segment for garbage collection to free)."""
    keep: list[int] = []
    for rnd in range(3):
        xs = [a.malloc(6 * MiB + 4096 * rnd) for _ in range(12)]
        for x in xs[0::2]:
            a.free(x)
        keep += xs[1::2]
        a.free(a.malloc(64 * MiB + MiB * rnd))
        keep.append(a.malloc(10 * MiB + MiB * rnd))
        a.free(a.malloc(60 * MiB + MiB * rnd))  # more than the 54 MiB rest: a new segment
    return a


@pytest.mark.parametrize("conf", ["expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4", "large_segment_size_mb:64"])
def test_the_whatif_equals_the_program_run_under_those_settings(conf: str) -> None:
    """Ground truth: the same program run directly on an allocator with the other settings."""
    capacity = 400 * MiB
    recorded = _program(CachingAllocator(capacity=capacity)).snapshot()
    direct = _program(CachingAllocator(capacity=capacity, config=conf))
    d = whatif(recorded, conf, capacity).devices[0]
    ups = sum(e[0] in ("segment_alloc", "segment_map") for e in direct.events)
    downs = sum(e[0] in ("segment_free", "segment_unmap") for e in direct.events)
    assert d.whatif.peak_reserved_bytes == direct.max_reserved_bytes
    assert d.whatif.peak_allocated_bytes == direct.max_allocated_bytes
    assert (d.whatif.segment_allocs, d.whatif.segment_frees) == (ups, downs)
    assert d.whatif.alloc_retries == direct.num_alloc_retries
    assert d.whatif.fragmentation_bytes is not None
    # each of these settings changes the run (so the comparison above is not the recorded one)
    assert not d.identical


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4"])
def test_a_run_recorded_under_any_settings_replays_to_itself(conf: str) -> None:
    a = _program(CachingAllocator(config=conf))
    d = whatif(a.snapshot()).devices[0]
    assert d.recorded.alloc_conf == conf and d.identical and d.replay_exact
    # the recorded column, from the trace's entries, is the allocator's own counters
    assert (d.recorded.peak_reserved_bytes, d.recorded.peak_allocated_bytes) == (
        a.max_reserved_bytes, a.max_allocated_bytes)


@pytest.mark.parametrize(("seed", "conf"), [
    (4, "expandable_segments:True"), (5, "expandable_segments:True"),
    (4, "max_split_size_mb:64,roundup_power2_divisions:4"), (5, "large_segment_size_mb:32"),
])
def test_mid_run_traces_under_any_settings(seed: int, conf: str) -> None:
    """Runs recorded under each setting and cut mid-way (test_sim_replay's): the identity holds
    (best fit breaks ties by address, so the recorded settings keep the real addresses), and
    every other setting replays from the rebuilt start (expandable ranges become plain segments
    without expandable segments)."""
    from test_sim_replay import _run_conf

    snap, _ = _run_conf(seed, conf)
    d = whatif(snap).devices[0]
    assert d.start == "rebuilt" and d.replay_exact and d.identical
    for other in ("", "expandable_segments:True", "max_split_size_mb:128"):
        w = whatif(snap, other).devices[0]
        f = w.whatif
        assert f.complete and f.oom is None
        assert f.peak_reserved_bytes >= f.peak_allocated_bytes > 0
        if AllocatorConfig.parse(other) == AllocatorConfig.parse(conf):
            assert w.identical
        if conf.startswith("expandable") and not other.startswith("expandable"):
            assert any("seeded as plain segments" in n for n in w.notes)


# -- a real GPU: the what-if against the real allocator under the other settings -------------

_GPU_SCRIPT = """
import json, sys, torch
out = sys.argv[1]
torch.cuda.init()
torch.cuda.memory._record_memory_history(max_entries=100000)
MiB = 1 << 20
keep = []
for rnd in range(3):  # the allocator calls of _program, in the same order
    xs = [torch.empty(6 * MiB + 4096 * rnd, dtype=torch.uint8, device="cuda") for _ in range(12)]
    for k in range(0, 12, 2):
        xs[k] = None
    keep += [x for x in xs if x is not None]
    del xs
    t = torch.empty(64 * MiB + MiB * rnd, dtype=torch.uint8, device="cuda")
    del t
    keep.append(torch.empty(10 * MiB + MiB * rnd, dtype=torch.uint8, device="cuda"))
    t = torch.empty(60 * MiB + MiB * rnd, dtype=torch.uint8, device="cuda")
    del t
torch.cuda.synchronize()
torch.cuda.memory._dump_snapshot(out)
s = torch.cuda.memory_stats()
print(json.dumps({"reserved": torch.cuda.max_memory_reserved(),
                  "allocated": torch.cuda.max_memory_allocated(),
                  "retries": s.get("num_alloc_retries", 0)}))
"""


def _gpu_run(tmp_path: Path, conf: str) -> tuple[Path, dict[str, int]]:
    import os
    import subprocess
    import sys

    script = tmp_path / "workload.py"
    script.write_text(_GPU_SCRIPT)
    out = tmp_path / f"snap-{len(conf)}.pickle"
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
    done = subprocess.run([sys.executable, str(script), str(out)], env=env, check=True,
                          capture_output=True, text=True)
    return out, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.cuda
def test_a_real_gpu_run_under_the_other_settings_matches_the_whatif(tmp_path: Path) -> None:
    snap_path, default = _gpu_run(tmp_path, "")
    _, expandable = _gpu_run(tmp_path, "expandable_segments:True")
    snap = load_snapshot(snap_path)
    d = whatif(snap).devices[0]
    assert d.identical and d.replay_exact
    assert d.recorded.peak_reserved_bytes == default["reserved"]
    assert d.recorded.peak_allocated_bytes == default["allocated"]
    e = whatif(snap, "expandable_segments:True").devices[0]
    assert e.whatif.peak_reserved_bytes == expandable["reserved"]
    assert e.whatif.peak_allocated_bytes == expandable["allocated"]
    assert e.whatif.alloc_retries == expandable["retries"]


# -- the CLI -----------------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["whatif", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_has_the_issue_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, str(DATA / "DeComFL__memory.pickle"), "--alloc-conf",
                        "expandable_segments:True", "--suggest", "--json")
    assert code == 0
    doc = json.loads(out)
    dev = doc["devices"][0]
    assert dev["device"] == 0
    for side in ("recorded", "whatif"):
        assert list(dev[side])[:6] == ["peak_reserved_bytes", "peak_allocated_bytes",
                                       "segment_allocs", "segment_frees", "alloc_retries", "oom"]
    assert dev["recorded"]["peak_reserved_bytes"] == EXACT["DeComFL__memory.pickle"][1]
    assert dev["whatif"]["oom"] is None
    for s in dev["suggestions"]:
        assert {"alloc_conf", "peak_reserved_bytes", "oom"} <= set(s)
    assert dev["best"]["alloc_conf"] == "expandable_segments:True"
    assert "requests fixed" in doc["limit"]


def test_cli_text_says_identity_and_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, str(DATA / "DeComFL__memory.pickle"))
    assert code == 0
    assert "the recorded settings replayed" in out and "the replay proof" in out
    assert "limit: a what-if keeps the program's requests fixed" in out
    assert "1.77 GiB" in out  # peak reserved, both columns


def test_cli_oom_avoided_and_gpu_size(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from torchmem.io import write_snapshot

    p = tmp_path / "oom.pickle"
    write_snapshot(p, _fragmented_oom())
    code, out, _ = _cli(capsys, str(p), "--alloc-conf", "expandable_segments:True")
    assert code == 0 and "the recorded OOM is AVOIDED" in out
    code, out, _ = _cli(capsys, str(p), "--suggest")
    assert "best: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    assert "avoids the OOM" in out
    code, out, _ = _cli(capsys, str(DATA / "DeComFL__memory.pickle"), "--gpu", "1GiB", "--json")
    dev = json.loads(out)["devices"][0]
    assert dev["whatif"]["oom"] is not None and not dev["whatif"]["oom"]["recorded"]
    assert "DeComFL" in dev["whatif"]["oom"]["where"]  # the program's frame, not torch's
    assert dev["capacity_bytes"] < 1 << 30 and "--gpu" in dev["capacity_source"]


def test_cli_bad_input_is_an_error_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, str(DATA / "DeComFL__memory.pickle"), "--alloc-conf", "bogus:1")
    assert code == 2 and "unrecognized allocator option 'bogus'" in err and "Traceback" not in err
    code, _, err = _cli(capsys, str(DATA / "Attention__memory.pickle"))
    assert code == 2 and "what-if needs the allocator history: " in err
    code, _, err = _cli(capsys, str(DATA / "DeComFL__memory.pickle"), "--gpu", "B9000")
    assert code == 2 and "unknown GPU 'B9000'" in err


def test_whatif_result_type_and_replay_agree() -> None:
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    w = whatif(snap)
    assert isinstance(w, WhatIf)
    r = replay(snap)
    assert (w.devices[0].recorded.peak_reserved_bytes, w.devices[0].recorded.peak_allocated_bytes) == (
        r.peak_reserved_bytes, r.peak_allocated_bytes)


def test_estimate_suggest_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "net.py"
    f.write_text(
        "import torch\n"
        "def build(batch):\n"
        "    net = torch.nn.Linear(512, 2048, device='cuda')\n"
        "    x = torch.randn(batch, 512, device='cuda')\n"
        "    return lambda: net(x).sum().backward()\n"
    )
    code = main(["estimate", f"{f}:build", "--gpu", "T4", "--batch-size", "8", "--suggest", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    dev = doc["whatif"]["devices"][0]
    # the estimate's run is what the what-if replays: its peaks, on the T4's usable bytes
    assert dev["recorded"]["peak_reserved_bytes"] == doc["peak_reserved_bytes"]
    assert dev["recorded"]["peak_allocated_bytes"] == doc["peak_allocated_bytes"]
    assert dev["identical"] and dev["capacity_bytes"] == doc["capacity_bytes"] - doc["overhead_bytes"]
    assert len(dev["suggestions"]) == len(SUGGESTED_CONFIGS)
    code = main(["estimate", f"{f}:build", "--gpu", "T4", "--batch-size", "8", "--suggest"])
    out = capsys.readouterr().out
    assert code == 0 and "FITS" in out and "suggestions (ranked" in out
