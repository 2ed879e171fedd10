"""A trace that survives the crash: streamed to disk as the run goes, read after a SIGKILL.

Ground truth: the same script run to completion (the killed run's events are a prefix of it),
the script's own count of finished iterations when it was killed, and the file ``save_trace``
writes (the end-of-run file is byte-identical to it).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import MAGIC, TRAILER, TraceStreamer, is_cut_short, load_trace, save_trace
from torchmem.model.events import Event, EventKind
from torchmem.model.trace import COLUMNS, Trace

SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    n, progress = int(sys.argv[1]), sys.argv[2]
    keep = []
    for i in range(n):
        keep.append(torch.ones(1 << 16))      # 256 KiB kept each iteration
        scratch = torch.zeros(1000)
        del scratch
        with open(progress, "w") as f:
            f.write(str(i + 1))
        time.sleep(0.1)
    """
)


def _key(e: Event) -> tuple[Any, ...]:
    # everything but the time and the category (a streamed chunk holds the categories known
    # when it was written)
    return (e.seq, e.kind, e.device, e.nbytes, e.storage, e.op, e.module, e.phase, e.step,
            e.stack, e.thread)


def _torchmem(*args: str, cwd: Path) -> list[str]:
    return [sys.executable, "-m", "torchmem", *args]


def test_a_killed_run_leaves_a_trace_that_summary_reads(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    killed, full = tmp_path / "killed.tmtrace", tmp_path / "full.tmtrace"
    progress = tmp_path / "progress"
    proc = subprocess.Popen(
        _torchmem("run", "--no-host", "--quiet", "-o", str(killed), str(script), "200",
                  str(progress), cwd=tmp_path),
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        done = 0
        while done < 25 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            try:
                done = int(progress.read_text() or 0)
            except (FileNotFoundError, ValueError):
                pass
        assert done >= 25, proc.stderr.read().decode() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        at_kill = int(progress.read_text() or done)  # empty if killed while rewriting it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert is_cut_short(killed)

    out = subprocess.run(_torchmem("summary", "--json", str(killed), cwd=tmp_path),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ended abruptly" in out.stderr
    summary = json.loads(out.stdout)
    assert "ended abruptly" in summary["metadata"]["cut_short"]

    trace = load_trace(killed)
    kept = [e for e in trace.events() if e.kind is EventKind.ALLOC and e.nbytes == 1 << 18]
    # the loop ran 0.1 s an iteration and the file is written every 0.5 s: at most about a
    # second of iterations is missing (a margin for the shared CPU)
    assert at_kill - 15 <= len(kept) <= at_kill + 1
    assert summary["peak"]["cpu"] >= len(kept) * (1 << 18)

    complete = subprocess.run(
        _torchmem("run", "--no-host", "--quiet", "-o", str(full), str(script), "40",
                  str(tmp_path / "p2"), cwd=tmp_path),
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert complete.returncode == 0, complete.stderr
    whole = load_trace(full)
    assert not is_cut_short(full) and "cut_short" not in whole.metadata
    got = [_key(e) for e in trace.events()]
    assert len(got) >= 3 * 5  # several iterations' events (3 events an iteration and the start)
    assert got == [_key(e) for e in whole.events()][: len(got)]


def test_the_end_of_block_file_is_the_one_save_writes(tmp_path: Path) -> None:
    path = tmp_path / "run.tmtrace"
    net = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with torchmem.track(net, opt, path=path) as tr:
        for _ in range(3):
            net(torch.randn(2, 8)).sum().backward()
            opt.step()
        time.sleep(1.2)  # the writer has streamed what there is
        assert is_cut_short(path)
        midway = load_trace(path)
        assert len(midway) == len(tr) and "cut_short" in midway.metadata
    save_trace(tr.trace, tmp_path / "saved.tmtrace")
    assert path.read_bytes() == (tmp_path / "saved.tmtrace").read_bytes()
    assert not is_cut_short(path)
    assert [_key(e) for e in midway.events()] == [_key(e) for e in tr.events()]


def test_a_partial_last_chunk_is_dropped_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tr = Trace()
    path = tmp_path / "s.tmtrace"
    st = TraceStreamer(tr, path, interval=1)
    st.start()
    tr.append(EventKind.ALLOC, 1, "cpu", 100, 1, op="aten::ones", thread="MainThread")
    assert st.flush() == 1
    tr.append(EventKind.ALLOC, 2, "cpu", 300, 2, op="aten::zeros", thread="worker")
    tr.append(EventKind.FREE, 3, "cpu", 100, 1, thread="worker")
    assert st.flush() == 2
    st.close()
    data = path.read_bytes()
    whole = load_trace(path)
    assert [(e.op, e.nbytes, e.thread) for e in whole.events()] == [
        ("aten::ones", 100, "MainThread"), ("aten::zeros", 300, "worker"), (None, 100, "worker")
    ]
    assert whole.peak() == {"cpu": 400}
    from torchmem.cli import main

    assert main(["view", str(path), "-o", str(tmp_path / "v.html")]) == 0
    assert "was cut short" in capsys.readouterr().err
    assert main(["summary", str(path)]) == 0
    assert "ended abruptly" in capsys.readouterr().err
    path.write_bytes(data[:-5])  # killed while writing the second chunk
    cut = load_trace(path)
    assert [(e.op, e.nbytes) for e in cut.events()] == [("aten::ones", 100)]
    assert "1 events in 1 chunks" in cut.metadata["cut_short"]
    assert "bytes of a partial last chunk dropped" in cut.metadata["cut_short"]
    path.write_bytes(data[: data.index(b"TMCHUNK")])  # killed before the first chunk
    assert len(load_trace(path)) == 0 and "0 events in 0 chunks" in load_trace(path).metadata[
        "cut_short"]


def test_version_1_files_are_still_read(tmp_path: Path) -> None:
    tr = Trace({"producer": "old"})
    tr.append(EventKind.ALLOC, 0, "cpu", 64, 1, op="aten::ones", module="net.0")
    tr.append(EventKind.FREE, 9, "cpu", 64, 1)
    v1 = [c for c in COLUMNS if c[0] != "thread"]
    header = {"format": "torchmem-trace", "version": 1, "count": 2, "columns": [list(c) for c in v1],
              "devices": tr.devices, "strings": tr.strings, "stacks": [], "metadata": tr.metadata}
    blob = json.dumps(header).encode()
    body = b"".join(getattr(tr, name).tobytes() for name, _, _ in v1)
    path = tmp_path / "v1.tmtrace"
    path.write_bytes(MAGIC + struct.pack("<II", 1, len(blob)) + blob + body + TRAILER)
    back = load_trace(path)
    assert [(e.kind.label, e.op, e.module, e.nbytes, e.thread) for e in back.events()] == [
        ("alloc", "aten::ones", "net.0", 64, None), ("free", None, None, 64, None)
    ]
    assert back.metadata == {"producer": "old"}


def test_bad_stream_arguments_are_explained(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="existing folder"):
        torchmem.track(path=tmp_path / "no" / "such" / "t.tmtrace")
    with pytest.raises(InvalidInputError, match=r"interval must be .* \(0, 1\]"):
        TraceStreamer(Trace(), tmp_path / "t.tmtrace", interval=5)
