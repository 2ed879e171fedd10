"""The .tmtrace format: round trip, bad files, and the torch-free reading path."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchmem
from torchmem.errors import TraceFormatError
from torchmem.io.tmtrace import MAGIC, load_trace, save_trace
from torchmem.model.events import Category, EventKind, Phase
from torchmem.model.trace import BYTES_PER_EVENT, COLUMNS, Trace


def _recorded(tmp_path: Path) -> tuple[torchmem.Tracker, Path]:
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(net.parameters())
    with torchmem.track(net, opt, stacks=True) as tr:
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
    path = tmp_path / "run.tmtrace"
    tr.save(path)
    return tr, path


def test_round_trip_keeps_every_event_and_total(tmp_path: Path) -> None:
    tr, path = _recorded(tmp_path)
    back = load_trace(path)
    assert list(back.events()) == list(tr.events())
    assert back.peak() == tr.peak()
    assert back.live_bytes() == tr.live_bytes()
    assert any(e.stack for e in back.events())
    # the file is the columns plus a header and 24 bytes of framing
    header_len = struct.unpack_from("<I", path.read_bytes(), 12)[0]
    assert path.stat().st_size == 16 + header_len + len(tr.trace) * BYTES_PER_EVENT + 8
    assert BYTES_PER_EVENT == sum(size for _, _, size in COLUMNS) == 47  # with the thread column


def test_synthetic_trace_values_survive(tmp_path: Path) -> None:
    t = Trace({"note": "x"})
    t.append(EventKind.ALLOC, 0, "cuda:1", 2**40, 7, op="aten::mm", module="a.b",
             phase=Phase.BACKWARD, category=Category.GRADIENT, step=3, stack=["f.py:1:g"])
    t.append(EventKind.FREE, 2**62, "cuda:1", 2**40, 7)
    p = tmp_path / "s.tmtrace"
    save_trace(t, p)
    back = load_trace(p)
    e0, e1 = back.events()
    assert (e0.device, e0.nbytes, e0.op, e0.module, e0.phase, e0.category, e0.step, e0.stack) == (
        "cuda:1", 2**40, "aten::mm", "a.b", Phase.BACKWARD, Category.GRADIENT, 3, ("f.py:1:g",)
    )
    assert e1.time_ns == 2**62 and e1.op is None and e1.stack is None
    assert back.metadata == {"note": "x"} and back.peak() == {"cuda:1": 2**40}


@pytest.mark.parametrize("cut", [4, 15, 40, -9, -1])
def test_truncated_files_are_reported_with_the_file_name(tmp_path: Path, cut: int) -> None:
    _, path = _recorded(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / "cut.tmtrace"
    bad.write_bytes(data[:cut])
    with pytest.raises(TraceFormatError) as ei:
        load_trace(bad)
    msg = str(ei.value)
    assert str(bad) in msg
    assert "truncated" in msg or "not a torchmem trace" in msg or "corrupt" in msg


def test_other_version_and_non_trace_files(tmp_path: Path) -> None:
    _, path = _recorded(tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 99)
    other = tmp_path / "v99.tmtrace"
    other.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match=r"v99\.tmtrace: trace format version 99.*reads version 1"):
        load_trace(other)
    js = tmp_path / "snap.json"
    js.write_text(json.dumps({"segments": []}))
    with pytest.raises(TraceFormatError, match=r"snap\.json: not a torchmem trace file"):
        load_trace(js)
    with pytest.raises(TraceFormatError, match="is a directory"):
        load_trace(tmp_path)
    # a header that lies about a table
    data = bytearray(path.read_bytes())
    hlen = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16 : 16 + hlen])
    header["strings"] = header["strings"][:1]
    blob = json.dumps(header, separators=(",", ":")).encode()
    forged = bytes(data[:12]) + struct.pack("<I", len(blob)) + blob + bytes(data[16 + hlen :])
    bad = tmp_path / "forged.tmtrace"
    bad.write_bytes(forged)
    with pytest.raises(TraceFormatError, match="forged.tmtrace: corrupt"):
        load_trace(bad)


def test_reading_and_summarising_need_no_torch(tmp_path: Path) -> None:
    _, path = _recorded(tmp_path)
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any torch import now fails
        "from torchmem.cli import main\n"
        f"rc = main(['summary', {str(path)!r}, '--json'])\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "sys.exit(rc)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["peak"] == load_trace(path).peak()
    assert MAGIC == path.read_bytes()[:8]


def test_plot_without_matplotlib_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchmem.render.plot import MissingPlotDependency, plot_timeline

    _, path = _recorded(tmp_path)
    trace = load_trace(path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPlotDependency, match=r"pip install 'torchmem\[plot\]'"):
        plot_timeline(trace, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_save_refuses_a_trace_with_a_short_column(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # columns filled by hand without the thread column (as an old generator did) used to be
    # written, and the file then read back as corrupt: now nothing is written
    from torchmem.errors import InvalidInputError
    from torchmem.model.events import EventKind
    from torchmem.model.trace import COLUMNS, Trace

    tr = Trace()
    tr.intern_device("cpu")
    for name, _, _ in COLUMNS:
        if name != "thread":
            getattr(tr, name).extend([0] * 3)
    tr.kind[:] = type(tr.kind)(tr.kind.typecode, [int(EventKind.ALLOC)] * 3)
    tr.stack[:] = type(tr.stack)(tr.stack.typecode, [-1] * 3)  # no stacks recorded
    path = tmp_path / "short.tmtrace"
    with pytest.raises(InvalidInputError, match=r"thread \(0\)"):
        save_trace(tr, path)
    assert not path.exists() and not (tmp_path / "short.tmtrace.part").exists()
    tr.thread.extend([0] * 3)
    tr.intern_thread("MainThread")
    save_trace(tr, path)
    assert len(load_trace(path)) == 3
