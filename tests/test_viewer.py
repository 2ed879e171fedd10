"""The offline viewer's payload and page, checked against the real snapshot files (no browser).

Ground truth is computed here from the raw pickles, independently of the viewer's code: sums of
block sizes, PyTorch's own per-segment counters (``allocated_size``, ``active_size``,
``requested_size``), and a separate replay of the trace.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import struct
import zlib
from array import array
from pathlib import Path
from typing import Any

import pytest

from torchmem.cli import main
from torchmem.errors import InvalidInputError, SnapshotFormatError, UnsafePickleError
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.io.snapshot_file import load_snapshot
from torchmem.render.viewer.html import render_html, write_viewer
from torchmem.render.viewer.payload import KIND_NAMES, encode_payload
from torchmem.render.viewer.payload import build_payload as _build_payload


def build_payload(raw: Any) -> dict[str, Any]:
    """The payload of an unpickled PyTorch snapshot (the viewer takes model objects)."""
    return _build_payload(from_pytorch(raw))

DATA = Path(__file__).resolve().parent / "data"
FILES = sorted(DATA.glob("*.pickle"))
LEGACY = [p for p in FILES if p.name.startswith("LLM-inference")]


def _raw(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)  # the files in tests/data hold only plain containers (README)


def test_all_real_files_are_present() -> None:
    assert len(FILES) >= 7 and len(LEGACY) == 2


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_stats_match_pytorchs_own_segment_counters(path: Path) -> None:
    raw = _raw(path)
    st = [d["stats"] for d in build_payload(raw)["devices"]]  # torchmem.analysis's figures
    assert [s["device"] for s in st] == sorted({s["device"] for s in raw["segments"]})
    d = st[0]
    segs = [s for s in raw["segments"] if s["device"] == d["device"]]
    # PyTorch wrote these per-segment counters itself; the viewer sums the blocks instead.
    assert d["reserved_bytes"] == sum(s["total_size"] for s in segs)
    assert d["allocated_bytes"] == sum(s["allocated_size"] for s in segs)
    assert d["active_bytes"] == sum(s["active_size"] for s in segs)
    assert d["segments"] == len(segs)
    assert d["blocks"] == sum(len(s["blocks"]) for s in segs)
    free = [b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive"]
    assert d["free_bytes"] == sum(free) == d["reserved_bytes"] - d["active_bytes"]
    assert d["largest_free_block"] == max(free, default=0)


def test_payload_of_a_complete_trace_matches_an_independent_replay() -> None:
    raw = _raw(DATA / "DeComFL__memory.pickle")
    trace = raw["device_traces"][0]
    dev = build_payload(raw)["devices"][0]
    cols = dev["columns"]
    # Every alloc in the trace is one allocation; this trace starts from empty (README).
    assert dev["n_events"] == len(trace) == 23105
    assert dev["n_allocs"] == sum(e["action"] == "alloc" for e in trace) == 7946
    assert dev["n_pre"] == 0
    assert [KIND_NAMES[k] for k in cols["ev_kind"][:50]] == [e["action"] for e in trace[:50]]
    # Independent replay: running total of trace sizes, alloc to free_completed.
    live: dict[int, int] = {}
    total = peak = 0
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            peak = max(peak, total)
        elif e["action"] == "free_completed":
            total -= live.pop(e["addr"])
    assert dev["stats"]["timeline_peak_bytes"] == peak
    still = [a for a in range(dev["n_allocs"]) if cols["al_end"][a] == dev["n_events"]]
    assert sorted(int(cols["al_addr"][a]) for a in still) == sorted(live)
    assert sum(int(cols["al_size"][a]) for a in still) == sum(live.values())
    # Each end-state active block is linked to the allocation that is still live at its address.
    linked = [
        (int(cols["blk_addr"][b]), int(cols["al_addr"][cols["blk_alloc"][b]]))
        for b in range(dev["n_blocks"])
        if cols["blk_state"][b]
    ]
    assert len(linked) == 397 and all(a == b for a, b in linked)
    # Lifetimes: the free_completed event of each allocation is at the index the payload says.
    first = next(a for a in range(dev["n_allocs"]) if cols["al_end"][a] < dev["n_events"])
    s, e = cols["al_start"][first], cols["al_end"][first]
    assert trace[s]["action"] == "alloc" and trace[e]["action"] == "free_completed"
    assert trace[s]["addr"] == trace[e]["addr"] == int(cols["al_addr"][first])


@pytest.mark.parametrize("path", LEGACY, ids=lambda p: p.stem)
def test_legacy_history_blocks_get_addresses_and_frames(path: Path) -> None:
    raw = _raw(path)
    p = build_payload(raw)
    dev = p["devices"][0]
    cols = dev["columns"]
    active = [b for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive"]
    # 2.0-era blocks have no address: the viewer sums sizes from the segment start. The
    # history entry of an active block records the same address (ground truth in the file).
    addrs = {int(cols["blk_addr"][i]) for i in range(dev["n_blocks"])}
    hist_addrs = {b["history"][-1]["addr"] for b in active if b.get("history")}
    assert hist_addrs and hist_addrs <= addrs
    # Every active block predates the (one-entry) trace, so each is an allocation from the start.
    assert dev["n_pre"] >= len(active)
    names = {f["name"] for b in active for h in b.get("history") or [] for f in h["frames"]}
    assert names and names <= {f[0] for f in p["frames"]}


def test_list_format_and_empty_inputs() -> None:
    raw = _raw(DATA / "SketchKV2__my_snapshot.pickle")
    as_list = build_payload(raw["segments"])  # torch.cuda.memory_snapshot() returns this list
    dev = as_list["devices"][0]
    assert dev["n_events"] == 0
    assert dev["n_segments"] == len(raw["segments"])
    active = [b for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive"]
    assert dev["n_allocs"] == dev["n_pre"] == len(active)
    assert build_payload({"segments": [], "device_traces": [[], []]})["devices"] == []
    with pytest.raises(InvalidInputError, match="expected a memory snapshot"):
        _build_payload({"something": 1})
    with pytest.raises(SnapshotFormatError):
        build_payload({"segments": "not a list", "device_traces": []})


def test_encoded_payload_round_trips() -> None:
    raw = _raw(DATA / "MAGMA27_a2__memory_snapshot.pickle")
    p = build_payload(raw)
    blob = zlib.decompress(base64.b64decode(encode_payload(p)))
    n = struct.unpack("<I", blob[:4])[0]
    head = json.loads(blob[4 : 4 + n])
    base = 4 + n
    assert base % 8 == 0
    dev = head["devices"][0]
    for name, (code, off, length) in dev["columns"].items():
        assert off % 8 == 0
        arr = array(code)
        arr.frombytes(blob[base + off : base + off + length * arr.itemsize])
        assert arr == p["devices"][0]["columns"][name], name
    assert head["frames"] == p["frames"] and head["stacks"] == p["stacks"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_page_is_self_contained_and_smaller_than_the_pickle(path: Path, tmp_path: Path) -> None:
    out = write_viewer(load_snapshot(path), tmp_path / "r.html")
    page = out.read_text("utf-8")
    assert out.stat().st_size <= path.stat().st_size
    # No URL with a scheme other than data:/blob:, no external script, style, image or link.
    assert not re.search(r"(?i)\b(?:https?|ftp|wss?):", page)
    assert not re.search(r"(?i)<(?:script|img|iframe|link|source)[^>]+\b(?:src|href)\s*=", page)
    assert "@import" not in page and "url(" not in page
    assert "default-src 'none'" in page  # the page forbids itself any fetch


def test_frames_are_interned_once() -> None:
    raw = _raw(DATA / "notHanmin_a2__memory_snapshot_forward.pickle")
    p = build_payload(raw)
    table = [tuple(f) for f in p["frames"]]
    assert len(set(table)) == len(table)  # each distinct frame stored once
    assert len({tuple(s) for s in p["stacks"]}) == len(p["stacks"])
    allocs = [e for e in raw["device_traces"][0] if e["action"] == "alloc"]
    wanted = {(f["name"], f["filename"], f["line"]) for e in allocs for f in e["frames"]}
    assert wanted <= set(table)
    # The stack of an allocation is the alloc entry's frames, in order.
    cols = p["devices"][0]["columns"]
    for a in (0, 100, len(allocs) - 1):
        aid = p["devices"][0]["n_pre"] + a
        got = [tuple(p["frames"][f]) for f in p["stacks"][cols["al_stack"][aid]]]
        assert got == [(f["name"], f["filename"], f["line"]) for f in allocs[a]["frames"]]


def test_unsafe_pickle_is_refused_and_nothing_is_written(tmp_path: Path, capsys: Any) -> None:
    evil = tmp_path / "evil.pickle"
    marker = tmp_path / "pwned"
    evil.write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    out = tmp_path / "r.html"
    with pytest.raises(UnsafePickleError):
        write_viewer(load_snapshot(evil), out)
    assert main(["view", str(evil), "-o", str(out), "-q"]) == 2
    assert "refused" in capsys.readouterr().err
    assert not marker.exists() and not out.exists()


def test_cli_writes_the_page(tmp_path: Path, capsys: Any) -> None:
    src = DATA / "Attention__memory.pickle"
    out = tmp_path / "a.html"
    assert main(["view", str(src), "-o", str(out), "--title", "attn <b>", "-q"]) == 0
    assert "wrote" in capsys.readouterr().out
    page = out.read_text("utf-8")
    assert "<title>attn &lt;b&gt; - torchmem viewer</title>" in page
    assert main(["view", str(tmp_path / "missing.pickle"), "-o", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_render_html_accepts_snapshot_objects() -> None:
    from torchmem.io.snapshot_file import load_snapshot

    snap = load_snapshot(DATA / "MAGMA27_a2__memory_snapshot.pickle")
    page = render_html(snap, title="magma")
    assert page.count("__PAYLOAD__") == 0 and "<title>magma" in page


MiB = 1 << 20


def synthetic_snapshot() -> dict[str, Any]:
    """Cases the real files lack: two streams, an expandable segment grown by segment_map, an
    ``active_pending_free`` block at the end, and an ``oom`` entry."""
    f = [[{"name": f"fn{i}", "filename": f"/src/m{i}.py", "line": 10 * i}] for i in range(5)]
    a, b = 0x1000000, 0x2000000
    trace = [
        {"action": "segment_alloc", "addr": a, "size": 2 * MiB, "stream": 0, "frames": f[0]},
        {"action": "alloc", "addr": a, "size": 500, "stream": 0, "frames": f[1]},
        {"action": "alloc", "addr": a + 512, "size": 1024, "stream": 0, "frames": f[2]},
        {"action": "segment_map", "addr": b, "size": 2 * MiB, "stream": 7, "frames": f[0]},
        {"action": "alloc", "addr": b, "size": 2 * MiB, "stream": 7, "frames": f[3]},
        {"action": "alloc", "addr": a + 1536, "size": 4096, "stream": 0, "frames": f[4]},
        {"action": "free_requested", "addr": a + 1536, "size": 4096, "stream": 0, "frames": f[4]},
        {"action": "free_completed", "addr": a + 1536, "size": 4096, "stream": 0, "frames": f[4]},
        {"action": "free_requested", "addr": a + 512, "size": 1024, "stream": 0, "frames": f[2]},
        {"action": "segment_map", "addr": b + 2 * MiB, "size": 2 * MiB, "stream": 7, "frames": []},
        {"action": "oom", "device_free": 1 * MiB, "size": 8 * MiB, "stream": 0, "frames": f[1]},
    ]
    for i, e in enumerate(trace):
        e["time_us"] = 1_000_000 + 10 * i
    segments = [
        {"device": 0, "address": a, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "is_expandable": False, "frames": [], "blocks": [
             {"address": a, "size": 512, "requested_size": 500, "state": "active_allocated",
              "frames": f[1]},
             {"address": a + 512, "size": 1024, "requested_size": 1024,
              "state": "active_pending_free", "frames": f[2]},
             {"address": a + 1536, "size": 2 * MiB - 1536, "requested_size": 0,
              "state": "inactive", "frames": []}]},
        {"device": 0, "address": b, "total_size": 4 * MiB, "stream": 7, "segment_type": "large",
         "is_expandable": True, "frames": [], "blocks": [
             {"address": b, "size": 2 * MiB, "requested_size": 2 * MiB,
              "state": "active_allocated", "frames": f[3]},
             {"address": b + 2 * MiB, "size": 2 * MiB, "requested_size": 0, "state": "inactive",
              "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_synthetic_streams_expandable_pending_and_oom() -> None:
    snap = synthetic_snapshot()
    st = build_payload(snap)["devices"][0]["stats"]
    assert st["reserved_bytes"] == 6 * MiB
    assert st["allocated_bytes"] == 512 + 2 * MiB
    assert st["active_bytes"] == 512 + 1024 + 2 * MiB
    assert st["requested_bytes"] == 500 + 1024 + 2 * MiB
    assert (st["streams"]["0"]["segments"], st["streams"]["0"]["reserved_bytes"]) == (1, 2 * MiB)
    assert (st["streams"]["7"]["segments"], st["streams"]["7"]["reserved_bytes"]) == (1, 4 * MiB)
    assert st["expandable_segments"] is True and st["pending_free_bytes"] == 1024
    assert st["largest_free_block"] == 2 * MiB and st["free_bytes"] == 4 * MiB - 1536
    dev = build_payload(snap)["devices"][0]
    cols = dev["columns"]
    assert dev["ooms"] == [{"event": 10, "size": 8 * MiB, "device_free": MiB, "stack": 1}]
    assert dev["streams"] == ["0", "7"]
    assert dev["n_allocs"] == 4 and dev["n_pre"] == 0
    # The pending block: free requested at event 8, never completed -> live at the end.
    assert (cols["al_start"][1], cols["al_req"][1], cols["al_end"][1]) == (2, 8, 11)
    assert (cols["al_start"][3], cols["al_req"][3], cols["al_end"][3]) == (5, 6, 7)
    assert list(cols["al_stream"]) == [0, 0, 1, 0]
    # Trace sizes are requested sizes (as PyTorch records them): the peak is in those units.
    assert dev["stats"]["timeline_peak_bytes"] == 500 + 1024 + 2 * MiB + 4096
    assert dev["stats"]["peak_allocated_bytes"] == 500 + 1024 + 2 * MiB + 4096
    # one numbering: the 0-based trace entry (the alloc of 4096 B), as `torchmem trace` prints it
    assert dev["stats"]["peak_index"] == dev["stats"]["peak_event"] == 5
    assert dev["stats"]["consistent"] is True
    verdict = dev["stats"]["oom_reports"][0]
    assert verdict["index"] == 10 and verdict["requested_bytes"] == 8 * MiB


@pytest.mark.parametrize(
    "name",
    ["DeComFL__memory.pickle", "MAGMA27_a2__memory_snapshot.pickle",
     "notHanmin_a2__memory_snapshot_forward.pickle"],
)
def test_page_figures_come_from_the_analysis_and_agree_with_the_timeline(name: str) -> None:
    raw = _raw(DATA / name)
    dev = build_payload(raw)["devices"][0]
    st = dev["stats"]
    # torchmem.analysis's stats (the ones the page shows) equal PyTorch's own counters...
    assert st["allocated_bytes"] == sum(s["allocated_size"] for s in raw["segments"])
    assert st["reserved_bytes"] == sum(s["total_size"] for s in raw["segments"])
    assert st["trace_entries"] == len(raw["device_traces"][0])
    # ...and the analysis's peak (replayed backwards from the end state) equals the peak of the
    # timeline drawn by the page (replayed forwards from the allocations it found).
    assert st["peak_allocated_bytes"] == st["timeline_peak_bytes"]
    assert st["at_peak"] and sum(g["bytes"] for g in st["at_peak"]) <= st["peak_allocated_bytes"]


def test_view_command_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "r.html"
    code = (
        "import sys\n"
        "from torchmem.cli import main\n"
        f"rc = main(['view', {str(DATA / 'DeComFL__memory.pickle')!r}, '-o', {str(out)!r}, '-q'])\n"
        "assert rc == 0, rc\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip().splitlines()[-1] == "[]"
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(
    "name",
    ["DeComFL__memory.pickle", "MAGMA27_a2__memory_snapshot.pickle",
     "notHanmin_a2__memory_snapshot_forward.pickle"],
)
def test_block_sizes_of_the_state_history_are_the_files_blocks(name: str) -> None:
    """The simulated block size of every allocation live at the end equals the size of its block
    in the file (slack included), and the page is told the state is simulated."""
    raw = _raw(DATA / name)
    dev = build_payload(raw)["devices"][0]
    cols = dev["columns"]
    assert dev["stats"]["allocator_state"].startswith("simulated: every alloc replayed")
    size_of = {b["address"]: b["size"] for s in raw["segments"] for b in s["blocks"]
               if b["state"] != "inactive"}
    live = [(int(cols["al_addr"][i]), cols["al_bsize"][i]) for i in range(dev["n_allocs"])
            if cols["al_end"][i] == dev["n_events"]]
    assert len(live) == len(size_of)
    assert all(size_of[addr] == bsize for addr, bsize in live)
    # every block holds its rounded request; some carry large-pool slack that rounding misses
    rounded = [max(512, -(-int(cols["al_size"][i]) // 512) * 512) for i in range(dev["n_allocs"])]
    assert all(r <= cols["al_bsize"][i] for i, r in enumerate(rounded))
    assert any(r < cols["al_bsize"][i] for i, r in enumerate(rounded))


def test_a_trace_the_simulator_cannot_reproduce_falls_back_to_rounding() -> None:
    # a 40 MiB segment for a 10 MiB request: not what the allocator does
    raw = {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": 1 << 30, "size": 40 << 20, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 1 << 30, "size": 10 << 20, "stream": 0, "frames": []}]]}
    dev = build_payload(raw)["devices"][0]
    assert len(dev["columns"]["al_bsize"]) == 0
    assert dev["stats"]["allocator_state"].startswith("approximate (request rounded to 512 B)")


def test_torchmem_trace_payload_carries_origin_and_the_storages_figures() -> None:
    """A tracked run (no caching allocator): category, phase and module per allocation, block
    sizes equal to the storages, and the Stats figures worked out here by hand."""
    from torchmem.io.convert import snapshot_from_events
    from torchmem.model.events import Category, Event, EventKind, Phase

    A, F = EventKind.ALLOC, EventKind.FREE
    ev = [  # (kind, time_ns, bytes, storage, category, phase, module)
        (A, 5_000_000, 4096, 1, Category.PARAMETER, Phase.OTHER, "fc"),
        (A, 6_000_000, 1000, 2, Category.ACTIVATION, Phase.FORWARD, "fc"),
        (A, 7_500_000, 3000, 3, Category.TEMPORARY, Phase.FORWARD, "act"),
        (F, 8_000_000, 3000, 3, Category.TEMPORARY, Phase.FORWARD, "act"),
        (A, 9_000_000, 4096, 4, Category.GRADIENT, Phase.BACKWARD, "fc"),
        (F, 9_500_000, 1000, 2, Category.ACTIVATION, Phase.BACKWARD, "fc"),
    ]
    snap = snapshot_from_events([
        Event(i, k, t, "cpu", b, s, module=m, phase=ph, category=c)
        for i, (k, t, b, s, c, ph, m) in enumerate(ev)])
    dev = _build_payload(snap)["devices"][0]
    cols, st = dev["columns"], dev["stats"]
    assert dev["tracked"] is True
    names = _build_payload(snap)["category_names"]
    assert [names[c] for c in cols["al_cat"]] == ["parameter", "activation", "temporary", "gradient"]
    assert list(cols["al_phase"]) == [0, 1, 1, 2]
    texts = _build_payload(snap)["texts"]
    assert [texts[m] for m in cols["al_module"]] == ["fc", "fc", "act", "fc"]
    assert list(cols["al_bsize"]) == [4096, 1000, 3000, 4096]  # the storages, not 512-rounded
    assert st["allocator_state"].startswith("exact: one segment per storage")
    f = st["tracked"]
    # live: 4096, 5096, 8096 (peak, after the third alloc), 5096, 9192 (a new peak), 8192
    assert (f["peak_bytes"], f["live_end_bytes"]) == (9192, 8192)
    # each event is segment_alloc + alloc or free_requested + free_completed + segment_free:
    # the gradient's alloc is entry 2*3 + 3 + 1 = 10
    assert f["peak_event"] == st["peak_event"] == 10
    assert f["peak_time_s"] == st["peak_time_s"] == pytest.approx(0.004)  # 9.0 ms - 5.0 ms
    assert f["duration_s"] == pytest.approx(0.0045)
    assert (f["storages_end"], f["allocations"], f["frees"]) == (2, 4, 2)
    assert f["by_category"] == {"gradient": {"peak": 4096, "end": 4096},
                                "parameter": {"peak": 4096, "end": 4096},
                                "activation": {"peak": 1000, "end": 0}}
    assert f["by_phase"] == {"backward": 4096, "other": 4096, "forward": 1000}
    assert f["modules"] == {"fc": 9192}


def test_peak_event_is_the_0_based_entry_of_the_peak() -> None:
    """The page names entries as ``torchmem trace`` does (0-based): for DeComFL (a trace from
    empty) the peak's entry is where a running sum of alloc/free_completed first peaks."""
    raw = _raw(DATA / "DeComFL__memory.pickle")
    trace = raw["device_traces"][0]
    live, best, at = 0, 0, -1
    for i, e in enumerate(trace):
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if live > best:
            best, at = live, i
    st = build_payload(raw)["devices"][0]["stats"]
    assert (st["peak_event"], st["peak_allocated_bytes"]) == (at, best)
    assert st["peak_time_s"] == (trace[at]["time_us"] - min(e["time_us"] for e in trace)) / 1e6
