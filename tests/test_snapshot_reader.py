"""Reading snapshots: every real file, every format, safety, and clear errors."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import snapshot_synth as synth
from torchmem.errors import SnapshotFormatError, UnsafePickleError
from torchmem.io.pytorch_snapshot import to_pytorch_dict
from torchmem.io.snapshot_file import load_snapshot, write_snapshot
from torchmem.model.snapshot import Snapshot

DATA = Path(__file__).resolve().parent / "data"
REAL = sorted(p.name for p in DATA.glob("*.pickle"))


def test_all_seven_real_files_are_present() -> None:
    assert len(REAL) == 7


def _raw(name: str):
    with open(DATA / name, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("name", REAL)
def test_real_file_segments_and_blocks_match_plain_pickle(name: str) -> None:
    raw = _raw(name)
    segs = raw if isinstance(raw, list) else raw["segments"]
    snap = load_snapshot(DATA / name)
    assert len(snap.segments) == len(segs)
    by_addr = {s.address: s for s in snap.segments}
    for s in segs:
        ours = by_addr[s["address"]]
        assert ours.total_size == s["total_size"]
        assert ours.stream == s["stream"]
        assert len(ours.blocks) == len(s["blocks"])
        # PyTorch's own per-segment counters, against our sums over blocks
        assert ours.allocated_size == s["allocated_size"]
        assert ours.active_size == s["active_size"]
        assert ours.requested_size == s["requested_size"]
        addr = s["address"]
        for b, ob in zip(s["blocks"], ours.blocks):
            assert ob.size == b["size"] and ob.state == b["state"]
            # legacy blocks have no address: it is the running sum of sizes from the segment start
            assert ob.address == b.get("address", addr)
            addr += b["size"]
            frames = b.get("frames")
            if frames is None and b.get("history"):
                frames = b["history"][0]["frames"]
            assert [(f.filename, f.line, f.name) for f in ob.frames] == [
                (f["filename"], f["line"], f["name"]) for f in (frames or [])
            ]
    traces = [] if isinstance(raw, list) else raw["device_traces"]
    for dev, entries in enumerate(traces):
        t = snap.trace(dev)
        assert len(t) == len(entries)
        for e, ours in zip(entries, t):
            assert ours.action == e["action"] and ours.size == e["size"]
            assert ours.addr == e.get("addr", e.get("device_free"))
            assert ours.time_us == e.get("time_us")
            assert ours.compile_context == e.get("compile_context")
            assert ours.user_metadata == e.get("user_metadata")
            assert [f.name for f in ours.frames] == [f["name"] for f in e.get("frames", [])]


def test_format_features_detected() -> None:
    assert load_snapshot(DATA / "LLM-inference__oom_snapshot_41810ba.pickle").source.format == "legacy-history"
    magma = load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle")
    assert {"compile_context", "user_metadata", "time_us", "allocator_settings",
            "external_annotations"} <= set(magma.source.features)
    assert magma.allocator_settings["graph_capture_record_stream_reuse"] is False
    assert magma.allocator_settings["max_split_size"] == -1
    sk = load_snapshot(DATA / "SketchKV2__my_snapshot.pickle")
    assert sk.allocator_settings is not None and sk.external_annotations is None
    att = load_snapshot(DATA / "Attention__memory.pickle")
    assert att.num_trace_devices == 2 and all(len(t) == 0 for t in att.traces.values())
    assert "time_us" not in load_snapshot(DATA / "LLM-inference__1.3b_snapshot_6a8eab0.pickle").source.features


@pytest.mark.parametrize("name", ["DeComFL__memory.pickle", "MAGMA27_a2__memory_snapshot.pickle",
                                  "notHanmin_a2__memory_snapshot_forward.pickle"])
def test_to_pytorch_dict_round_trips_modern_files_exactly(name: str) -> None:
    raw = _raw(name)
    out = to_pytorch_dict(load_snapshot(DATA / name))
    out.pop("torchmem")
    assert out == raw


def test_legacy_file_becomes_modern_format_with_addresses() -> None:
    raw = _raw("LLM-inference__1.3b_snapshot_6a8eab0.pickle")
    d = to_pytorch_dict(load_snapshot(DATA / "LLM-inference__1.3b_snapshot_6a8eab0.pickle"))
    s0 = min((s for s in raw["segments"] if len(s["blocks"]) > 1), key=lambda s: s["address"])
    ours = next(s for s in d["segments"] if s["address"] == s0["address"])
    assert ours["address"] == s0["address"]
    assert [b["address"] for b in ours["blocks"]][:2] == [
        s0["address"], s0["address"] + s0["blocks"][0]["size"]]
    assert all("frames" in b and "address" in b for s in d["segments"] for b in s["blocks"])


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_every_pickle_protocol(tmp_path: Path, protocol: int) -> None:
    raw = synth.two_streams()
    p = tmp_path / f"p{protocol}.pickle"
    p.write_bytes(pickle.dumps(raw, protocol=protocol))
    snap = load_snapshot(p)
    assert snap.source.pickle_protocol == (protocol if protocol >= 2 else None)
    assert sum(s.total_size for s in snap.segments) == 22 * 1024**2
    assert [e.action for e in snap.trace(0)] == [e["action"] for e in raw["device_traces"][0]]


def test_list_format_and_without_time(tmp_path: Path) -> None:
    p = tmp_path / "list.pickle"
    p.write_bytes(pickle.dumps(synth.list_format(), protocol=2))
    snap = load_snapshot(p)
    assert snap.source.format == "list"
    assert snap.devices == [0, 1]
    assert [s.total_size for s in snap.segments] == [2 * 1024**2, 20 * 1024**2]
    assert snap.traces == {}


def test_json_round_trip_equals_pickle(tmp_path: Path) -> None:
    snap = load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle")
    write_snapshot(tmp_path / "m.json", snap, format="json")
    back = load_snapshot(tmp_path / "m.json")
    assert back.source.format == "torchmem-json"
    a, b = to_pytorch_dict(snap), to_pytorch_dict(back)
    a.pop("torchmem"), b.pop("torchmem")
    assert json.loads(json.dumps(a)) == json.loads(json.dumps(b))
    assert len(back.trace(0)) == 5163


def test_written_pickle_is_protocol_4_and_plain(tmp_path: Path) -> None:
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    write_snapshot(tmp_path / "d.pickle", snap)
    data = (tmp_path / "d.pickle").read_bytes()
    assert data[:2] == b"\x80\x04"
    from torchmem.io.snapshot_file import _scan_opcodes

    ops = _scan_opcodes(tmp_path / "d.pickle")
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ"}
    raw = pickle.loads(data)
    assert raw["segments"][0]["address"] == snap.segments[0].address


# ------------------------------------------------------------------------------ safety
def _evil_os_system(target: Path) -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {target}",))

    return pickle.dumps({"segments": [], "device_traces": [[Evil()]]}, protocol=2)


def _evil_eval(target: Path) -> bytes:
    class Evil:
        def __reduce__(self):
            import builtins

            return (builtins.eval, (f"open({str(target)!r}, 'w').write('pwned')",))

    return pickle.dumps(Evil(), protocol=4)


@pytest.mark.parametrize("maker,glob", [(_evil_os_system, "system"), (_evil_eval, "builtins.eval")])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path: Path, maker, glob: str) -> None:
    # control: the same payload really runs code under a plain pickle.load (in a subprocess)
    control_target = tmp_path / "control-pwned"
    control = tmp_path / "control.pickle"
    control.write_bytes(maker(control_target))
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(control)!r}, 'rb'))"],
                   check=False, capture_output=True)
    assert control_target.exists()

    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(maker(target))
    with pytest.raises(UnsafePickleError) as info:
        load_snapshot(evil)
    msg = str(info.value)
    assert str(evil) in msg and glob in msg and "nothing was executed" in msg
    assert not target.exists()


def test_persistent_id_is_refused(tmp_path: Path) -> None:
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "ext-1" if obj == "x" else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"segments": ["x"], "device_traces": []})
    p = tmp_path / "pid.pickle"
    p.write_bytes(buf.getvalue())
    with pytest.raises(UnsafePickleError, match="persistent"):
        load_snapshot(p)


def test_truncated_corrupt_and_not_a_snapshot(tmp_path: Path) -> None:
    good = (DATA / "SketchKV2__my_snapshot.pickle").read_bytes()
    t = tmp_path / "trunc.pickle"
    t.write_bytes(good[: len(good) // 2])
    with pytest.raises(SnapshotFormatError, match=r"trunc\.pickle.*(truncated|ends early)"):
        load_snapshot(t)
    c = tmp_path / "corrupt.pickle"
    c.write_bytes(b"\x80\x04garbage-garbage-garbage")
    with pytest.raises(SnapshotFormatError, match=r"corrupt\.pickle"):
        load_snapshot(c)
    e = tmp_path / "empty.pickle"
    e.write_bytes(b"")
    with pytest.raises(SnapshotFormatError, match=r"empty\.pickle.*empty"):
        load_snapshot(e)
    n = tmp_path / "model.pickle"
    n.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(SnapshotFormatError, match=r"model\.pickle: expected a PyTorch memory snapshot.*'weights'"):
        load_snapshot(n)
    b = tmp_path / "badseg.pickle"
    b.write_bytes(pickle.dumps({"segments": [{"address": 0}], "device_traces": []}))
    with pytest.raises(SnapshotFormatError, match=r"badseg\.pickle: segment 0 has no 'total_size'"):
        load_snapshot(b)
    j = tmp_path / "bad.json"
    j.write_text('{"format": "torchmem-snapshot", "version": 1, "snapshot": ')
    with pytest.raises(SnapshotFormatError, match=r"bad\.json.*JSON"):
        load_snapshot(j)
    with pytest.raises(SnapshotFormatError, match="no such file"):
        load_snapshot(tmp_path / "missing.pickle")


def test_tmtrace_file_loads_as_snapshot(tmp_path: Path) -> None:
    from torchmem.io.tmtrace import save_trace
    from torchmem.model.events import EventKind
    from torchmem.model.trace import Trace

    tr = Trace()
    tr.append(EventKind.ALLOC, 1000, "cpu", 4096, 1, op="aten::empty")
    tr.append(EventKind.ALLOC, 2000, "cpu", 1024, 2, op="aten::add")
    tr.append(EventKind.FREE, 3000, "cpu", 4096, 1)
    p = tmp_path / "t.tmtrace"
    save_trace(tr, p)
    snap = load_snapshot(p)
    assert snap.source.format == "torchmem-events"
    assert [b.size for s in snap.segments for b in s.blocks] == [1024]
    assert isinstance(snap, Snapshot)


def test_a_trace_slices_like_a_list_of_its_entries() -> None:
    raw = _raw("MAGMA27_a2__memory_snapshot.pickle")
    trace = load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle").traces[0]
    entries = list(trace)
    assert len(entries) == len(raw["device_traces"][0]) > 600
    for sl in (slice(None, 600), slice(-5, None), slice(10, 100, 7), slice(600, 10, -3),
               slice(len(entries) + 5, None)):
        got = trace[sl]
        assert [(e.index, e.action, e.addr, e.size) for e in got] == [
            (e.index, e.action, e.addr, e.size) for e in entries[sl]]
    # the plain pickle's own entries, by position
    assert [(e.action, e.size) for e in trace[:3]] == [
        (r["action"], r["size"]) for r in raw["device_traces"][0][:3]]
