"""Snapshot analyses checked against values computed another way (plain pickle.load + loops,
torch.cuda._memory_viz where it is right)."""

from __future__ import annotations

import io
import pickle
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from torch.cuda import _memory_viz

import snapshot_synth as synth
from torchmem.analysis._diff import snapshot_diff
from torchmem.analysis._events import snapshot_trace
from torchmem.analysis._flame import folded_stacks
from torchmem.analysis._oom import oom_report
from torchmem.analysis._peak import snapshot_peak
from torchmem.analysis._stats import snapshot_stats
from torchmem.analysis.frames import stack_key
from torchmem.analysis.replay import initial_live, replay
from torchmem.errors import InvalidInputError
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.io.snapshot_file import load_snapshot
from torchmem.model.snapshot import Frame, Snapshot
from torchmem.render.snapshot_text import render_diff, render_oom, render_peak, render_stats

DATA = Path(__file__).resolve().parent / "data"
REAL = sorted(p.name for p in DATA.glob("*.pickle"))
MiB = 1024**2


def _raw(name: str):
    with open(DATA / name, "rb") as f:
        return pickle.load(f)


def _snap(raw) -> Snapshot:
    # through a real pickle file path-less stream, like a user's file
    return load_snapshot(io.BytesIO(pickle.dumps(raw, protocol=4)))


# ------------------------------------------------------------------------------ stats
@pytest.mark.parametrize("name", REAL)
def test_stats_equal_plain_loops_over_the_raw_pickle(name: str) -> None:
    raw = _raw(name)
    segs = raw if isinstance(raw, list) else raw["segments"]
    blocks = [b for s in segs for b in s["blocks"]]
    d = snapshot_stats(load_snapshot(DATA / name)).devices[0]
    assert d.reserved_bytes == sum(s["total_size"] for s in segs)
    assert d.allocated_bytes == sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    assert d.active_bytes == sum(b["size"] for b in blocks if b["state"] != "inactive")
    assert d.requested_bytes == sum(s["requested_size"] for s in segs)  # PyTorch's own counter
    assert d.free_bytes == sum(b["size"] for b in blocks if b["state"] == "inactive")
    assert d.largest_free_block == max([b["size"] for b in blocks if b["state"] == "inactive"] or [0])
    assert d.segments == len(segs) and d.blocks == len(blocks)
    assert d.rounding_slack_bytes == sum(
        b["size"] - b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    small = [s for s in segs if s["segment_type"] == "small"]
    assert d.pools.get("small", None) is None or d.pools["small"].reserved_bytes == sum(
        s["total_size"] for s in small)
    assert d.reserved_bytes == d.allocated_bytes + d.free_bytes + (d.active_bytes - d.allocated_bytes)


def test_stats_reserved_matches_memory_viz_segsum() -> None:
    raw = _raw("notHanmin_a2__memory_snapshot_forward.pickle")
    text = _memory_viz.segsum(raw)
    line = next(ln for ln in text.splitlines() if ln.startswith("total_reserved:"))
    d = snapshot_stats(load_snapshot(DATA / "notHanmin_a2__memory_snapshot_forward.pickle")).devices[0]
    assert line == f"total_reserved: {_memory_viz.Bytes(d.reserved_bytes)}"
    assert f"segments: {d.segments}" in text


def test_two_streams_and_pools() -> None:
    d = snapshot_stats(_snap(synth.two_streams())).devices[0]
    assert set(d.streams) == {0, 7}
    assert d.streams[7].reserved_bytes == 20 * MiB and d.streams[0].reserved_bytes == 2 * MiB
    assert d.streams[7].allocated_bytes == 5 * MiB and d.streams[0].allocated_bytes == 1024
    assert d.pools["small"].segments == 1 and d.pools["large"].segments == 1
    assert d.largest_free_block == 12 * MiB
    assert d.free_bytes == (2 * MiB - 1024) + 3 * MiB + 12 * MiB
    assert d.rounding_slack_bytes == 24 + 100
    assert "stream 7" in render_stats(snapshot_stats(_snap(synth.two_streams())))


def test_pending_free_and_max_split_size() -> None:
    raw = synth.pending_free_and_split()
    st = snapshot_stats(_snap(raw))
    d = st.devices[0]
    assert d.pending_free_bytes == 3 * MiB
    assert d.allocated_bytes == 4 * MiB and d.active_bytes == 7 * MiB
    assert st.allocator_settings["max_split_size"] == 200 * MiB
    text = render_stats(st)
    assert "max_split_size = 209715200" in text and "roundup_power2_divisions = {'2': 4}" in text


def test_expandable_segments_flag_and_replayed_reserved() -> None:
    snap = _snap(synth.expandable())
    d = snapshot_stats(snap).devices[0]
    assert d.expandable_segments is True and d.reserved_bytes == 20 * MiB
    rows = list(snapshot_trace(snap))
    # mapped memory: 20 MiB, then 40 MiB, then unmapped back to 20 MiB; starts from 0
    assert [r.reserved_bytes for r in rows] == [20 * MiB] * 2 + [40 * MiB] * 4 + [20 * MiB]
    assert [r.allocated_bytes for r in rows] == [0, 8 * MiB, 8 * MiB, 38 * MiB, 38 * MiB,
                                                 8 * MiB, 8 * MiB]
    assert snapshot_peak(snap).devices[0].peak_allocated_bytes == 38 * MiB


# ------------------------------------------------------------------------------ peak / replay
def _independent_peak(raw) -> tuple[int, int]:
    """Forward replay written separately: start = end active requested - allocs + frees."""
    entries = raw["device_traces"][0]
    end = sum(b["requested_size"] for s in raw["segments"] for b in s["blocks"]
              if b["state"] != "inactive")
    start = end
    for e in entries:
        if e["action"] == "alloc":
            start -= e["size"]
        elif e["action"] == "free_completed":
            start += e["size"]
    cur = best = start
    for e in entries:
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        best = max(best, cur)
    assert cur == end
    return best, start


@pytest.mark.parametrize("name", REAL)
def test_peak_equals_independent_replay(name: str) -> None:
    raw = _raw(name)
    if isinstance(raw, list):
        pytest.skip("no trace")
    p = snapshot_peak(load_snapshot(DATA / name)).devices[0]
    best, start = _independent_peak(raw)
    assert p.peak_allocated_bytes == best
    assert p.initial_allocated_bytes == start
    assert p.consistent
    # the groups at the peak add up to the peak (top=None lists every group)
    full = snapshot_peak(load_snapshot(DATA / name), top=None).devices[0]
    assert sum(g.bytes for g in full.at_peak) == best
    assert sum(g.bytes for g in full.at_end) == p.end_allocated_bytes


def test_decomfl_complete_trace_replays_from_empty_to_the_active_blocks() -> None:
    raw = _raw("DeComFL__memory.pickle")
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    assert initial_live(snap, 0) == {}
    final = replay(snap, 0, {})
    active = {b["address"]: b["requested_size"] for s in raw["segments"] for b in s["blocks"]
              if b["state"] != "inactive"}
    assert {a: v[0] for a, v in final.items()} == active
    assert len(active) == 397


@pytest.mark.parametrize("name", ["DeComFL__memory.pickle", "MAGMA27_a2__memory_snapshot.pickle",
                                  "notHanmin_a2__memory_snapshot_forward.pickle"])
def test_fast_live_set_equals_step_by_step_backward_walk(name: str) -> None:
    from torchmem.analysis.replay import DeviceReplay

    snap = load_snapshot(DATA / name)
    n = len(snap.trace(0))
    for k in (0, 1, n // 3, n // 2, n - 1, n):
        slow = dict(DeviceReplay(snap, 0).end_live())
        assert DeviceReplay(snap, 0).undo(slow, k) == 0
        # the same blocks and sizes (their stacks: see the allocation-site test below)
        assert {a: v[0] for a, v in DeviceReplay(snap, 0).live_at(k).items()} == \
            {a: v[0] for a, v in slow.items()}
    assert {a: v[0] for a, v in DeviceReplay(snap, 0).live_at(0).items()} == \
        {a: v[0] for a, v in initial_live(snap, 0).items()}


def test_mid_run_trace_peak_and_groups() -> None:
    snap = _snap(synth.pending_free_and_split())
    p = snapshot_peak(snap, depth=2).devices[0]
    assert p.initial_allocated_bytes == (4 * MiB - 512) + 2 * MiB
    assert p.peak_allocated_bytes == (4 * MiB - 512) + 3 * MiB - 7
    assert p.peak_index == 2 and p.end_allocated_bytes == p.peak_allocated_bytes  # entry #2
    # pending-free blocks are still held at the end
    assert {g.stack: g.bytes for g in p.at_end} == {
        ("train.py:10:step",): 4 * MiB - 512, ("model.py:42:forward", "train.py:10:step"): 3 * MiB - 7}
    assert "peak allocated" in render_peak(snapshot_peak(snap))


def test_blocks_live_at_the_peak_are_grouped_by_where_they_were_allocated() -> None:
    """A snapshot recorded with ``context="all"`` (DeComFL's) gives each free the stack of the
    code that freed it; a block live at the peak belongs to the code that allocated it. Checked
    against a plain walk of the raw trace: each address live at the peak, its last ``alloc``."""
    raw = _raw("DeComFL__memory.pickle")
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    p = snapshot_peak(snap, depth=1, top=None).devices[0]
    trace = raw["device_traces"][0]
    k = p.peak_index + 1                      # entries before the peak's end
    live: dict[int, dict] = {}
    for e in trace[:k]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    expected: dict[tuple[str, ...], int] = {}
    for e in live.values():
        frames = [Frame(f["filename"], f["line"], f["name"]) for f in e["frames"]]
        key = stack_key(frames, depth=1)
        expected[key] = expected.get(key, 0) + e["size"]
    got = {g.stack: g.bytes for g in p.at_peak}
    # what the trace allocated is grouped by its allocation site (blocks from before the trace
    # started keep the end state's or their free's stack)
    assert all(got.get(key, 0) >= n for key, n in expected.items()), (expected, got)
    assert sum(expected.values()) > 0.9 * p.peak_allocated_bytes
    # and the free sites differ from the allocation sites for some of them: the rule matters
    frees = {e["addr"]: e for e in trace[k:] if e["action"] == "free_completed"}
    assert any(stack_key([Frame(f["filename"], f["line"], f["name"]) for f in frees[a]["frames"]],
                         depth=1) != stack_key([Frame(f["filename"], f["line"], f["name"])
                                                for f in e["frames"]], depth=1)
               for a, e in live.items() if a in frees)


def test_stack_key_filters_torch_internals() -> None:
    snap = _snap(synth.two_streams())
    live = snap.segments[1].blocks[1]
    assert stack_key(live.frames, depth=1) == ("model.py:42:forward",)
    assert stack_key(live.frames, depth=0, filter_internal=False)[0] == "??:0:torch::unwind::unwind()"


# ------------------------------------------------------------------------------ trace
def test_trace_running_totals_are_right_where_memory_viz_is_wrong() -> None:
    raw = _raw("DeComFL__memory.pickle")
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    rows = list(snapshot_trace(snap))
    assert len(rows) == 23105
    end_alloc = sum(b["requested_size"] for s in raw["segments"] for b in s["blocks"]
                    if b["state"] != "inactive")
    assert rows[-1].allocated_bytes == end_alloc == 1011485828
    assert rows[-1].reserved_bytes == sum(s["total_size"] for s in raw["segments"])
    assert max(r.allocated_bytes for r in rows) == snapshot_peak(snap).devices[0].peak_allocated_bytes
    # _memory_viz.trace reuses `count` as both the loop index (enumerate) and the byte total, so
    # each iteration overwrites the total with the entry index: its TOTAL MEM is the last index
    # plus or minus the last entry's size, not the memory in use.
    with redirect_stdout(io.StringIO()):
        text = _memory_viz.trace(raw)
    total = text.rstrip().splitlines()[-1]
    last = raw["device_traces"][0][-1]
    assert last["action"] == "free_completed"
    wrong = (len(rows) - 1) - last["size"]
    assert total == f"TOTAL MEM: {_memory_viz.Bytes(wrong)}"
    assert total != f"TOTAL MEM: {_memory_viz.Bytes(end_alloc)}"


def test_trace_of_mid_run_starts_from_derived_totals() -> None:
    rows = list(snapshot_trace(_snap(synth.pending_free_and_split())))
    start = (4 * MiB - 512) + 2 * MiB
    assert [r.allocated_bytes for r in rows] == [start, start - 2 * MiB, start - 2 * MiB + 3 * MiB - 7,
                                                 start - 2 * MiB + 3 * MiB - 7]
    assert all(r.reserved_bytes == 10 * MiB for r in rows)


# ------------------------------------------------------------------------------ flame
@pytest.mark.parametrize("name", ["DeComFL__memory.pickle", "LLM-inference__1.3b_snapshot_6a8eab0.pickle"])
def test_folded_stacks_sum_to_active_bytes(name: str) -> None:
    raw = _raw(name)
    lines = folded_stacks(load_snapshot(DATA / name))
    total = sum(int(ln.rsplit(" ", 1)[1]) for ln in lines)
    assert total == sum(b["size"] for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive")
    assert all(ln.startswith("cuda:0;") and ";" in ln for ln in lines)
    assert len(set(ln.rsplit(" ", 1)[0] for ln in lines)) == len(lines)


def test_folded_stacks_root_first_and_at_peak() -> None:
    snap = _snap(synth.pending_free_and_split())
    assert folded_stacks(snap) == [
        f"cuda:0;train.py:10:step {4 * MiB}",
        f"cuda:0;train.py:10:step;model.py:42:forward {3 * MiB}",
    ]
    peak = folded_stacks(snap, at="peak")
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in peak) == snapshot_peak(snap).devices[0].peak_allocated_bytes


# ------------------------------------------------------------------------------ diff
def test_diff_between_two_real_snapshots() -> None:
    a = load_snapshot(DATA / "LLM-inference__1.3b_snapshot_6a8eab0.pickle")
    b = load_snapshot(DATA / "LLM-inference__oom_snapshot_41810ba.pickle")
    d = snapshot_diff(a, b)
    ra, rb = _raw("LLM-inference__1.3b_snapshot_6a8eab0.pickle"), _raw("LLM-inference__oom_snapshot_41810ba.pickle")

    def alloc(raw):
        return sum(x["size"] for s in raw["segments"] for x in s["blocks"] if x["state"] == "active_allocated")

    assert sum(r.delta_bytes for r in d.rows) == alloc(rb) - alloc(ra)
    assert d.totals[0]["allocated_bytes_delta"] == alloc(rb) - alloc(ra)
    assert d.totals[0]["reserved_bytes_delta"] == sum(s["total_size"] for s in rb["segments"]) - sum(
        s["total_size"] for s in ra["segments"])
    assert abs(d.rows[0].delta_bytes) >= abs(d.rows[-1].delta_bytes)
    assert "only before" in render_diff(d)


def test_memory_viz_compare_crashes_on_snapshot_dicts_but_diff_works() -> None:
    raw = _raw("SketchKV2__my_snapshot.pickle")
    with pytest.raises(TypeError), redirect_stdout(io.StringIO()):
        _memory_viz.compare(raw, raw, format_flamegraph=lambda s: s)
    d = snapshot_diff(load_snapshot(DATA / "SketchKV2__my_snapshot.pickle"),
                      load_snapshot(DATA / "SketchKV2__my_snapshot.pickle"))
    assert d.rows == [] and d.totals[0]["reserved_bytes_delta"] == 0


# ------------------------------------------------------------------------------ OOM
def test_oom_fragmentation_vs_full_device() -> None:
    frag = oom_report(_snap(synth.oom(fragmented=True)))
    full = oom_report(_snap(synth.oom(fragmented=False)))
    assert len(frag) == 1 and len(full) == 1
    f, g = frag[0], full[0]
    assert (f.requested_bytes, f.device_free_bytes, f.cached_free_bytes) == (20 * MiB, 5 * MiB, 20 * MiB)
    assert f.largest_free_block == 10 * MiB and f.verdict == "fragmentation"
    assert g.requested_bytes == 40 * MiB and g.verdict == "exhaustion"
    assert f.reserved_bytes == 40 * MiB and f.allocated_bytes == 20 * MiB
    assert "fragmentation" in render_oom(frag) and "truly full" in render_oom(full)


def test_real_files_have_no_oom_entries() -> None:
    for name in REAL:
        assert oom_report(load_snapshot(DATA / name)) == []


def test_device_selection_checks_the_index() -> None:
    # Regression: an index with no data gave an all-zero peak / empty trace and flame graph.
    raw = {
        "segments": [
            synth._seg(0, 0, 2 * MiB, [synth._b(0, 2 * MiB, 2 * MiB - 10, "active_allocated")]),
            synth._seg(2, 0, 4 * MiB, [synth._b(0, 4 * MiB, 3 * MiB, "active_allocated")]),
        ],
        "device_traces": [[], [], []],
    }
    snap = from_pytorch(raw)
    assert snap.devices == [0, 2]
    # a device that exists: its own numbers (requested bytes of its one active block)
    assert snapshot_peak(snap, device=2).devices[0].end_allocated_bytes == 3 * MiB
    assert [ln.rsplit(" ", 1)[1] for ln in folded_stacks(snap, device=2)] == [str(4 * MiB)]
    for call in (lambda: snapshot_peak(snap, device=1), lambda: list(snapshot_trace(snap, device=1)),
                 lambda: folded_stacks(snap, device=7)):
        with pytest.raises(InvalidInputError, match="expected one of: 0, 2"):
            call()
