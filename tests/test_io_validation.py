"""Input files as a new user meets them: one error for a missing file, format errors that name the
path and the kind, values no snapshot can hold refused, and traces that convert to snapshots
without losing where each allocation came from."""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from torchmem.cli import main
from torchmem.cli._snapshot_common import load as cli_load
from torchmem.errors import (
    FileFormatError,
    MissingFileError,
    SnapshotFormatError,
    TorchmemError,
    TraceFormatError,
)
from torchmem.io import (
    load_snapshot,
    load_trace,
    save_trace,
    snapshot_from_trace,
    write_snapshot,
)
from torchmem.io.pytorch_snapshot import DEVICE_INDEX_LIMIT
from torchmem.model.events import Category, EventKind, Phase
from torchmem.model.trace import Trace

DATA = Path(__file__).resolve().parent / "data"


def _view(path: Path) -> int:
    from torchmem.cli import view

    return view.run(argparse.Namespace(file=str(path), output=None, title=None, quiet=True))


def _tracked_trace() -> Trace:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters())
    with torchmem.track(net, opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
    return tr.trace


# --------------------------------------------------------------------------- missing files


@pytest.mark.parametrize(
    "read, name, kind",
    [
        (load_snapshot, "missing.pickle", "snapshot"),
        (load_trace, "missing.tmtrace", "trace"),
        (cli_load, "missing.json", "snapshot"),
        (_view, "missing.pickle", "snapshot"),
    ],
    ids=["snapshot", "trace", "cli", "viewer"],
)
def test_a_missing_file_is_one_error_type_everywhere(
    tmp_path: Path, read: Any, name: str, kind: str
) -> None:
    path = tmp_path / name
    with pytest.raises(MissingFileError) as info:
        read(path)
    e = info.value
    assert isinstance(e, FileNotFoundError) and isinstance(e, TorchmemError)
    assert e.path == str(path) and e.filename == str(path) and e.kind == kind
    assert "no such file" in str(e) and str(path) in str(e)


def test_missing_file_is_still_the_format_error_it_used_to_be(tmp_path: Path) -> None:
    with pytest.raises(SnapshotFormatError):
        load_snapshot(tmp_path / "a.pickle")
    with pytest.raises(TraceFormatError):
        load_trace(tmp_path / "a.tmtrace")
    with pytest.raises(OSError):
        load_trace(tmp_path / "a.tmtrace")


@pytest.mark.parametrize("argv", [["stats", "{}/x.pickle"], ["summary", "{}/x.tmtrace"],
                                  ["view", "{}/x.pickle"]])
def test_cli_reports_a_missing_file_as_a_user_error(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(tmp_path) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err and "bug" not in err


# --------------------------------------------------------------------------- format errors


def test_format_errors_name_the_path_and_the_kind(tmp_path: Path) -> None:
    bad = tmp_path / "junk.pickle"
    bad.write_bytes(b"\x80\x04garbage-garbage")
    with pytest.raises(FileFormatError) as info:
        load_snapshot(bad)
    assert (info.value.path, info.value.kind) == (str(bad), "snapshot")
    not_trace = tmp_path / "junk.tmtrace"
    not_trace.write_bytes(b"hello")
    with pytest.raises(FileFormatError) as info:
        load_trace(not_trace)
    assert (info.value.path, info.value.kind) == (str(not_trace), "trace")
    segs = tmp_path / "segs.pickle"
    segs.write_bytes(pickle.dumps({"segments": [{"address": 0}], "device_traces": []}))
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(segs)
    assert info.value.path == str(segs)


# --------------------------------------------------------------------------- snapshot values


def _segment(**over: Any) -> dict[str, Any]:
    seg: dict[str, Any] = {
        "device": 0, "address": 4096, "total_size": 2097152, "stream": 0,
        "segment_type": "large",
        "blocks": [{"address": 4096, "size": 2097152, "requested_size": 2097152,
                    "state": "active_allocated", "frames": []}],
    }
    seg.update(over)
    return seg


def _block(**over: Any) -> dict[str, Any]:
    b = dict(_segment()["blocks"][0])
    b.update(over)
    return _segment(blocks=[b])


@pytest.mark.parametrize(
    "segment, field, value",
    [
        (_segment(total_size=-5), "total_size", -5),
        (_segment(total_size=10**30), "total_size", 10**30),
        (_segment(address=2**64), "address", 2**64),
        (_segment(device=10**12), "device", 10**12),
        (_segment(device=-1), "device", -1),
        (_block(size=-512), "size", -512),
        (_block(size=10**30), "size", 10**30),
        (_block(requested_size=-1), "requested_size", -1),
        (_block(address=2**70), "address", 2**70),
    ],
)
def test_snapshot_sizes_addresses_and_devices_out_of_range_are_refused(
    tmp_path: Path, segment: dict[str, Any], field: str, value: int
) -> None:
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [[]]}, protocol=4))
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: segment 0")
    assert f"{field} is {value};" in msg and "expected" in msg and "re-create it" in msg
    assert info.value.path == str(path)


def test_values_at_the_limits_are_accepted(tmp_path: Path) -> None:
    seg = _segment(device=DEVICE_INDEX_LIMIT - 1, address=0, total_size=2**64 - 1)
    seg["blocks"] = [{"address": 0, "size": 2**64 - 1, "requested_size": 0, "state": "inactive"}]
    path = tmp_path / "edge.pickle"
    path.write_bytes(pickle.dumps({"segments": [seg], "device_traces": []}, protocol=4))
    snap = load_snapshot(path)
    assert snap.segments[0].device == DEVICE_INDEX_LIMIT - 1
    assert snap.segments[0].total_size == 2**64 - 1


# --------------------------------------------------------------------------- trace files


def test_trace_whose_string_table_does_not_start_empty_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "good.tmtrace"
    save_trace(_tracked_trace(), good)
    data = good.read_bytes()
    head = b'"strings":["",'
    assert data.count(head) == 1
    # the same header with the leading "" blanked out (JSON whitespace keeps every length)
    shifted = data.replace(head, b'"strings":[   ')
    bad = tmp_path / "shifted.tmtrace"
    bad.write_bytes(shifted)
    assert json.loads(shifted[16 : 16 + int.from_bytes(shifted[12:16], "little")])["strings"][0]
    with pytest.raises(TraceFormatError) as info:
        load_trace(bad)
    msg = str(info.value)
    assert msg.startswith(f"{bad}: corrupt string table") and "empty string" in msg
    assert info.value.path == str(bad) and info.value.kind == "trace"
    assert len(load_trace(good)) > 0


# --------------------------------------------------------------------------- lossless convert


def _allocs_of_trace(trace: Trace) -> dict[str, list[tuple[Category, Phase, str | None]]]:
    out: dict[str, list[tuple[Category, Phase, str | None]]] = {}
    for i in range(len(trace)):
        if trace.kind[i] == EventKind.ALLOC:
            mod = trace.strings[trace.module[i]] or None
            out.setdefault(trace.devices[trace.device[i]], []).append(
                (Category(trace.category[i]), Phase(trace.phase[i]), mod)
            )
    return out


def _allocs_of_snapshot(snap: Any) -> dict[str, list[tuple[Any, Any, Any]]]:
    return {
        snap.device_name(dev): [
            (e.category, e.phase, e.module) for e in t if e.action == "alloc"
        ]
        for dev, t in snap.traces.items()
    }


@pytest.mark.parametrize("fmt, suffix", [("pickle", ".pickle"), ("json", ".json")])
def test_trace_to_snapshot_keeps_category_phase_and_module(
    tmp_path: Path, fmt: str, suffix: str
) -> None:
    trace = _tracked_trace()
    expected = _allocs_of_trace(trace)
    cats = {c for rows in expected.values() for c, _, _ in rows}
    phases = {p for rows in expected.values() for _, p, _ in rows}
    assert {Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE} <= cats
    assert {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER} <= phases
    assert any(m for rows in expected.values() for _, _, m in rows)

    snap = snapshot_from_trace(trace)
    assert _allocs_of_snapshot(snap) == expected
    path = tmp_path / f"run{suffix}"
    write_snapshot(path, snap, format=fmt)
    back = load_snapshot(path)
    assert _allocs_of_snapshot(back) == expected
    assert {"category", "phase", "module"} <= set(back.source.features)

    # blocks alive at the end keep the fields of their allocation
    live_trace: dict[int, tuple[Category, Phase, str | None]] = {}
    for i in range(len(trace)):
        if trace.kind[i] == EventKind.ALLOC:
            live_trace[trace.storage[i]] = (
                Category(trace.category[i]), Phase(trace.phase[i]),
                trace.strings[trace.module[i]] or None,
            )
        elif trace.kind[i] == EventKind.FREE:
            live_trace.pop(trace.storage[i], None)
    blocks = sorted(
        ((b.category, b.phase, b.module) for s in back.segments for b in s.blocks),
        key=repr,
    )
    assert blocks == sorted(live_trace.values(), key=repr) and blocks


def test_converted_pickle_stays_readable_by_pytorch_tools(tmp_path: Path) -> None:
    from torch.cuda import _memory_viz

    path = tmp_path / "run.pickle"
    write_snapshot(path, snapshot_from_trace(_tracked_trace()))
    with open(path, "rb") as f:
        raw = pickle.load(f)
    entry = next(e for e in raw["device_traces"][0] if e["action"] == "alloc")
    assert {"category", "phase", "action", "addr", "size", "frames"} <= set(entry)
    assert "total_reserved" in _memory_viz.segsum(raw)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(raw)


def test_real_pytorch_files_gain_no_fields(tmp_path: Path) -> None:
    snap = load_snapshot(DATA / "DeComFL__memory.pickle")
    assert all(t.categories is None for t in snap.traces.values())
    assert all(b.category is None for s in snap.segments for b in s.blocks)
    assert not {"category", "phase", "module"} & set(snap.source.features)
