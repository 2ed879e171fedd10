"""Host memory of the process tree: ``host_memory()``, the sampler and ``torchmem run``'s
``"host"`` section, against psutil read another way and against the workers' own reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from torchmem.capture.host import COPY_ON_READ_MIN_GROWTH, HostSampler, host_memory
from torchmem.errors import InvalidInputError
from torchmem.units import MiB

ROOT = Path(__file__).resolve().parents[1]

# A DataLoader (2 workers) over half a million dicts (each with a 600-character string, so that
# reading half of them writes about 200 MiB of refcount pages in each worker), or over one NumPy
# array of the same numbers. Each worker writes its own USS every 50,000 items (the ground truth the
# sampler's peaks are checked against).
DATALOADER = textwrap.dedent(
    """
    import os, sys
    import numpy as np, psutil, torch
    from torch.utils.data import DataLoader, Dataset

    N = 500_000
    OUT = sys.argv[2]

    class Data(Dataset):
        def __init__(self, kind):
            self.kind = kind
            if kind == "dicts":
                self.items = [{"a": i, "b": float(i), "c": f"{i:0>600}"} for i in range(N)]
            else:
                self.items = np.stack([np.arange(N)] * 3, 1).astype(np.float64)
            self.seen = 0

        def __len__(self):
            return N

        def __getitem__(self, i):
            if self.kind == "dicts":
                d = self.items[i]
                item = d["a"], d["b"], len(d["c"])
            else:
                r = self.items[i]
                item = int(r[0]), float(r[1]), 1
            self.seen += 1
            if self.seen % 50_000 == 0:  # the latest of these is the worker's state near its end
                uss = psutil.Process().memory_full_info().uss
                with open(os.path.join(OUT, f"{os.getpid()}.uss"), "w") as f:
                    f.write(str(uss))
            return item

    if __name__ == "__main__":
        loader = DataLoader(Data(sys.argv[1]), batch_size=256, num_workers=2)
        print("items", sum(len(b[0]) for b in loader))
    """
)


def test_host_memory_matches_psutil_for_this_process() -> None:
    me = host_memory(children=False)
    assert len(me) == 1 and me[0].pid == os.getpid() and me[0].role == "main"
    info = psutil.Process().memory_full_info()
    # read twice, a moment apart: equal within what the interpreter allocates in between
    assert abs(me[0].rss - info.rss) < 8 * MiB
    assert abs(me[0].uss - info.uss) < 8 * MiB
    assert me[0].uss <= me[0].rss


def test_children_are_workers_or_other() -> None:
    py = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    sh = subprocess.Popen(["sleep", "30"])
    try:
        roles = {p.pid: p.role for p in host_memory()}
        assert roles[py.pid] == "worker"  # the same Python executable
        assert roles[sh.pid] == "other"
    finally:
        py.kill()
        sh.kill()
        py.wait()
        sh.wait()


def test_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="expects the id of a running process"):
        host_memory(-1)
    with pytest.raises(InvalidInputError, match="interval must be a number of seconds > 0"):
        HostSampler(interval=0)


def test_sampler_sees_growth_of_this_process() -> None:
    with HostSampler(interval=0.02) as s:
        block = bytearray(64 * MiB)  # written pages: private memory
        for i in range(0, len(block), 4096):
            block[i] = 1
        import time

        time.sleep(0.1)
    me = s.summary().processes[0]
    assert me.role == "main"
    assert me.uss_growth >= 60 * MiB
    del block


def test_latest_sample_lists_running_processes_and_all_seen_adds_exited_ones() -> None:
    """A child that writes 48 MiB of its own and then waits: the latest sample shows it with
    that growth; once it has exited, only ``all_seen`` still lists it (as last seen)."""
    import time

    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; print('up', flush=True); sys.stdin.readline()\n"
         "b = bytearray(48 << 20)\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "print('ready', flush=True); time.sleep(30)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    s = HostSampler(interval=0.05)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "up\n"
        _ = s.sample()                              # the child before it writes its pages
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ready\n"
        _ = s.sample()
        rows = {m.pid: (m, growth) for m, growth in s.latest()}
        mem, growth = rows[child.pid]
        assert mem.role == "worker"
        truth = psutil.Process(child.pid).memory_full_info().uss
        assert abs(mem.uss - truth) < 4 * MiB
        assert growth >= 40 * MiB
        assert list(rows)[0] == os.getpid()         # main first
    finally:
        child.kill()
        child.wait()
    time.sleep(0.05)
    _ = s.sample()
    assert child.pid not in {m.pid for m, _ in s.latest()}
    assert child.pid in {m.pid for m, _ in s.latest(all_seen=True)}


def _run_loader(kind: str, tmp_path: Path) -> tuple[dict, dict[int, int]]:
    script = tmp_path / "loader.py"
    script.write_text(DATALOADER)
    out = tmp_path / kind
    out.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--json", "--no-stacks", "-o",
         str(tmp_path / f"{kind}.tmtrace"), str(script), kind, str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout[res.stdout.index("{"):])
    reported = {int(p.stem): int(p.read_text()) for p in out.glob("*.uss")}
    return data["host"], reported


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dicts", "numpy"])
def test_dataloader_copy_on_read_is_flagged_for_python_objects_only(
    kind: str, tmp_path: Path
) -> None:
    host, reported = _run_loader(kind, tmp_path)
    workers = [p for p in host["processes"] if p["role"] == "worker"]
    mains = [p for p in host["processes"] if p["role"] == "main"]
    assert len(mains) == 1 and len(workers) == 2
    assert set(reported) == {w["pid"] for w in workers}
    for w in workers:
        # the sampler's peak is at least what the worker read of itself at its last item,
        # minus what a 0.1 s sampling gap can miss
        assert w["uss_peak_bytes"] >= reported[w["pid"]] - 16 * MiB
        assert w["uss_peak_bytes"] <= w["rss_peak_bytes"]
    # the same loader under a plain ``python``: each worker's USS near its end (its own report)
    # is what it is under ``torchmem run``, within a few MiB (the tracker stops in the workers)
    plain_out = tmp_path / f"{kind}-plain"
    plain_out.mkdir()
    script = tmp_path / "loader.py"
    res = subprocess.run([sys.executable, str(script), kind, str(plain_out)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr
    plain = sorted(int(p.read_text()) for p in plain_out.glob("*.uss"))
    tracked = sorted(reported.values())
    assert len(plain) == 2 and all(abs(t - q) <= 8 * MiB for t, q in zip(tracked, plain)), (
        plain, tracked)
    growth = [w["uss_growth_bytes"] for w in workers]
    if kind == "dicts":
        assert host["copy_on_read_suspect"] is True
        assert all(g >= COPY_ON_READ_MIN_GROWTH for g in growth), growth
    else:
        assert host["copy_on_read_suspect"] is False
        assert all(g < 64 * MiB for g in growth), growth


# A DataLoader (2 workers, forked) over one NumPy array whose items are made into tensors: no
# copy-on-read, but every item is an operator (``torch.tensor``) in the worker. Each worker writes
# its USS every 20,000 items.
TENSOR_LOADER = DATALOADER.replace("N = 500_000", "N = 200_000").replace(
    "self.seen % 50_000 == 0", "self.seen % 20_000 == 0").replace(
    "item = int(r[0]), float(r[1]), 1", "item = torch.tensor(r)").replace(
    'print("items", sum(len(b[0]) for b in loader))', 'print("items", sum(len(b) for b in loader))')


@pytest.mark.slow
def test_dataloader_workers_cost_under_torchmem_run_what_they_cost_under_python(
    tmp_path: Path,
) -> None:
    """The tracker stops in forked workers: their private memory is what a plain ``python``
    run gives them (before: every worker kept recording its own events, about 330 B per item
    here, and a large dataset got flagged as copy-on-read)."""
    assert "torch.tensor(r)" in TENSOR_LOADER and "N = 200_000" in TENSOR_LOADER
    script = tmp_path / "loader.py"
    script.write_text(TENSOR_LOADER)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    usss = {}
    for how in ("python", "torchmem"):
        out = tmp_path / how
        out.mkdir()
        cmd = ([sys.executable, str(script), "numpy", str(out)] if how == "python" else
               [sys.executable, "-m", "torchmem", "run", "--json", "-o",
                str(tmp_path / "t.tmtrace"), str(script), "numpy", str(out)])
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, res.stderr
        usss[how] = sorted(int(p.read_text()) for p in out.glob("*.uss"))
        assert len(usss[how]) == 2, usss
        if how == "torchmem":
            host = json.loads(res.stdout[res.stdout.index("{"):])["host"]
    plain, tracked = usss["python"], usss["torchmem"]
    assert all(t <= p + 6 * MiB for p, t in zip(plain, tracked)), (plain, tracked)
    workers = [p for p in host["processes"] if p["role"] == "worker"]
    assert len(workers) == 2
    # The sampler's peak for each worker is no more than a plain run's worker holds near its end
    # (recording in the workers would add about 330 B per item: 31 MiB for each one's 100,000).
    # Not its growth since its first sample: under load that sample can come right after the
    # fork, before the worker has touched anything, and the growth then counts its start-up.
    peaks = [w["uss_peak_bytes"] for w in workers]
    assert all(q <= max(plain) + 8 * MiB for q in peaks), (peaks, plain)
    assert host["copy_on_read_suspect"] is False


def _fork_in_block(path: Path, report: Path) -> tuple[int, Any, int]:
    """Fork inside a tracked block; the child makes tensors, starts a tracker of its own, and
    leaves the block (then reports whether the parent's file changed)."""
    import torch

    import torchmem

    with torchmem.track(stacks=True, path=path) as tr:
        keep = torch.ones(8)
        before = len(tr)
        pid = os.fork()
        if pid == 0:
            xs = [torch.ones(10) for _ in range(100)]
            with torchmem.track() as inner:
                ys = [torch.ones(10) for _ in range(100)]
            report.write_text(json.dumps({
                "events": len(tr) - before, "active": tr._active, "inner": len(inner),
                "made": len(xs) + len(ys), "file": path.read_bytes().hex()}))
        else:
            _, status = os.waitpid(pid, 0)
            assert status == 0
            y = torch.ones(3)
            del y
        del keep
    return pid, tr, before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_records_nothing_and_leaves_the_parents_file_alone(tmp_path: Path) -> None:
    """``os.fork`` inside a tracked block: the child's allocations are not in the parent's
    trace, the child's tracker is inactive (a new tracker there works), and the child leaving
    the block does not write the parent's file."""
    import torchmem

    path, report = tmp_path / "t.tmtrace", tmp_path / "child.json"
    pid, tr, before = 0, None, 0
    try:
        pid, tr, before = _fork_in_block(path, report)
    finally:
        if pid == 0:  # the child: never run the rest of the test session
            code = 1
            try:
                got = json.loads(report.read_text())
                file_now = path.read_bytes().hex()
                report.write_text(json.dumps({**got, "file": got["file"] == file_now}))
                code = 0
            finally:
                os._exit(code)
    got = json.loads(report.read_text())
    assert got == {"events": 0, "active": False, "inner": 100, "made": 200, "file": True}
    assert tr is not None and len(tr) == before + 3  # the parent's ones(3), its free, the free of keep
    assert len(torchmem.load_trace(path)) == len(tr)
