"""``torchmem run --live``: the panel's figures against the tracker's summary, the panel drawn
from plain data, the script's output kept, at most two redraws a second, and Ctrl-C.

Ground truth is :func:`torchmem.analysis.summarize` over the same run's trace (two passes over
the columns), against which the live counter (one incremental listener) is checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from torchmem.analysis import summarize
from torchmem.cli._live import LiveCounter
from torchmem.render.live import DeviceLive, HostRow, LiveState, live_text
from torchmem.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]

# Leaks one loss with its graph per step (the input and activations it saved stay alive).
LEAKY = textwrap.dedent(
    """
    import sys, torch
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    KEPT = []
    N = int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 5
    for i in range(N):
        loss = net(torch.randn(16, 32)).square().mean()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
        KEPT.append(loss)
        print(f"step {i}", flush=True)
        print(f"stderr {i}", file=sys.stderr, flush=True)
    """
)

CLEAN = LEAKY.replace("KEPT.append(loss)", "del loss")


def _counted(source: str) -> tuple[LiveCounter, Any]:
    """Run ``source`` under the tracker with the live counter; the counter and the trace."""
    counter = LiveCounter()
    with torchmem.track(listeners=[counter.on_event]) as tr:
        exec(compile(source, "script.py", "exec"), {"__name__": "__main__"})
    return counter, tr.trace


@pytest.mark.parametrize("source", [LEAKY, CLEAN], ids=["leaky", "clean"])
def test_live_figures_equal_the_summary(source: str) -> None:
    torch.manual_seed(0)
    counter, trace = _counted(source)
    summary = summarize(trace)
    dev = counter.state("script.py", 0.0).devices[0]
    assert dev.device == summary.device == "cpu"
    assert dev.peak == summary.peak["cpu"] > 0
    assert dev.live == summary.final_live["cpu"]
    assert dev.iterations == summary.steps == 5
    assert dev.growth == [it.retained_growth for it in summary.iterations if it.complete]
    assert dev.leak is summary.leak_suspect is (source is LEAKY)
    # live by category sums to the live bytes, at-peak by category to the peak
    assert sum(dev.live_by_category.values()) == dev.live
    assert sum(dev.peak_by_category.values()) == dev.peak
    # the final panel's figures (the trace's final categories) equal the summary's
    final = LiveCounter.from_trace(trace).state("script.py", 0.0).devices[0]
    assert final.peak_by_category == {c: b for c, b in summary.categories_at_peak.items() if b}
    assert (final.peak, final.live, final.growth) == (dev.peak, dev.live, dev.growth)


def test_panel_shows_the_numbers_it_is_given() -> None:
    dev = DeviceLive("cuda:0", live=3 << 20, peak=5 << 20,
                     live_by_category={"parameter": 2 << 20, "optimizer_state": 1 << 20},
                     peak_by_category={"parameter": 2 << 20, "activation": 3 << 20},
                     iterations=4, growth=[1 << 20, 4096, 4096, 4096])
    state = LiveState("train.py", 12.25, [dev], [HostRow(41, "main", 900 << 20, 700 << 20, 0),
                                                 HostRow(42, "worker", 300 << 20, 280 << 20,
                                                         270 << 20)])
    text = live_text(state, width=100)
    assert "torchmem run --live: train.py  (12.2 s)" in text
    assert "cuda:0: live 3.00 MiB   peak 5.00 MiB   iterations 4" in text
    assert "growth per iteration (latest last): +1.00 MiB, +4.00 KiB, +4.00 KiB, +4.00 KiB" in text
    rows = {line.split()[1]: line.split()[2:] for line in text.splitlines()
            if len(line.split()) > 2 and line.split()[1] in ("parameter", "activation",
                                                             "optimizer_state")}
    assert rows["activation"] == ["0", "B", "3.00", "MiB", "│"]
    assert rows["parameter"] == ["2.00", "MiB", "2.00", "MiB", "│"]
    assert rows["optimizer_state"] == ["1.00", "MiB", "0", "B", "│"]
    # ends 1 MiB, +4 KiB, +4 KiB, +4 KiB: the trend after the warm-up iteration is 4 KiB/iteration
    assert ("leak suspected on cuda:0: +4.00 KiB per iteration since iteration 1 "
            "(+4.00 KiB latest)") in text
    assert re.search(r"42\s+worker\s+300\.00 MiB\s+280\.00 MiB\s+\+270\.00 MiB", text)
    assert "leak suspected" not in live_text(LiveState("x", 0, [DeviceLive(
        "cpu", 1, 1, {}, {}, 3, [5, 5, 0])]))


def _torchmem(*args: str, cwd: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchmem", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, **kw)


def test_run_live_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    res = _torchmem("run", "--live", "-o", "t.tmtrace", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # the script's own output is where it was (not a terminal: nothing redirected)
    assert [f"step {i}" for i in range(5)] == [
        line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert [f"stderr {i}" for i in range(5)] == [
        line for line in res.stderr.splitlines() if line.startswith("stderr ")]
    summary = json.loads(_torchmem("summary", "--json", "t.tmtrace", cwd=tmp_path).stdout)
    panel = res.stderr[res.stderr.index("torchmem run --live: train.py"):]
    assert "final" in panel.splitlines()[0]
    assert (f"cpu: live {format_bytes(summary['final_live']['cpu'])}   "
            f"peak {format_bytes(summary['peak']['cpu'])}   iterations 5") in panel
    for cat, nbytes in summary["categories_at_peak"].items():
        if nbytes:
            assert re.search(rf"{cat}\s+\S+ \S+\s+{re.escape(format_bytes(nbytes))}", panel), cat
    assert "leak suspected on cpu" in panel
    assert re.search(r"\d+\s+main\s+\d+\.\d\d MiB", panel)   # host memory of the script


def _pty_run(args: list[str], cwd: Path) -> bytes:
    """Run with stdout and stderr on a pseudo-terminal; everything it wrote."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="100", LINES="40", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "torchmem", *args], cwd=cwd,
                            stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=300)
    os.close(master)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.skipif(os.name != "posix", reason="needs a pseudo-terminal (POSIX)")
def test_on_a_terminal_the_panel_redraws_at_most_twice_a_second(tmp_path: Path) -> None:
    slow = LEAKY.replace('print(f"step {i}", flush=True)',
                         'print(f"step {i}", flush=True); __import__("time").sleep(0.5)')
    (tmp_path / "train.py").write_text(slow)
    out = _pty_run(["run", "--live", "--quiet", "-o", "t.tmtrace", "train.py", "8"], tmp_path)
    text = out.decode(errors="replace")
    frames = text.count("torchmem run --live: train.py")
    # the final panel's title says how long the panel was up; rich redraws it on its timer
    # (2 a second), once below each line the script prints (8 on stdout, 8 on stderr), once as
    # it starts and once as it stops; then the final panel
    found = re.search(r"torchmem run --live: train.py  \((\d+\.\d) s\)  final", text)
    assert found, text[-2000:]
    seconds = float(found.group(1))
    assert seconds >= 4  # eight steps of 0.5 s
    assert 4 <= frames <= 2 * seconds + 16 + 2 + 1 + 1, (frames, seconds)
    # the script's lines were printed (above the panel), each once
    for i in range(8):
        assert text.count(f"step {i}\r\n") == 1, i


def test_ctrl_c_stops_the_script_and_still_writes_the_trace(tmp_path: Path) -> None:
    forever = LEAKY.replace("range(N)", "__import__('itertools').count()")
    (tmp_path / "train.py").write_text(forever)
    # SIGINT raises KeyboardInterrupt even if the test runner's parent ignores SIGINT
    boot = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from torchmem.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", boot, "run", "--live", "-o", "t.tmtrace", "train.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 3"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "torchmem run: the script was interrupted" in err
    assert "trace written to" in out
    assert "torchmem run --live: train.py" in err   # the final panel
    summary = _torchmem("summary", "--json", "t.tmtrace", cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    assert json.loads(summary.stdout)["steps"] >= 4


WORKERS = textwrap.dedent(
    """
    import os, time, torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            time.sleep(0.1)
            return torch.full((4,), float(i))

    def init(_):
        print("worker pid", os.getpid(), flush=True)

    if __name__ == "__main__":
        total = sum(float(b.sum()) for b in DataLoader(Slow(), batch_size=2, num_workers=2,
                                                       worker_init_fn=init))
        print("total", total)
    """
)


def test_panel_lists_the_dataloader_workers(tmp_path: Path) -> None:
    (tmp_path / "load.py").write_text(WORKERS)
    res = _torchmem("run", "--live", "--host-interval", "0.05", "-o", "t.tmtrace", "load.py",
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "total 480.0" in res.stdout   # 4 * (0 + 1 + ... + 15)
    pids = sorted(int(line.split()[-1]) for line in res.stdout.splitlines()
                  if line.startswith("worker pid"))
    assert len(pids) == 2
    panel = res.stderr[res.stderr.index("torchmem run --live: load.py"):]
    listed = sorted(int(m.group(1)) for m in re.finditer(r"│ (\d+)\s+worker\s", panel))
    assert listed == pids
    assert len(re.findall(r"│ \d+\s+main\s", panel)) == 1


@pytest.mark.skipif(os.name != "posix", reason="needs a pseudo-terminal (POSIX)")
def test_a_script_with_its_own_rich_progress_bar_still_runs(tmp_path: Path) -> None:
    """Lightning's RichProgressBar and many scripts draw their own rich Live: the panel is on a
    console of its own (stderr), so the script's bar neither fails nor is swallowed."""
    (tmp_path / "bar.py").write_text(textwrap.dedent(
        """
        import torch
        from rich.progress import Progress
        with Progress() as bar:
            task = bar.add_task("train", total=5)
            for _ in range(5):
                x = torch.zeros(1000)
                bar.advance(task)
        print("bar done", x.numel())
        """
    ))
    text = _pty_run(["run", "--live", "--quiet", "-o", "t.tmtrace", "bar.py"],
                    tmp_path).decode(errors="replace")
    assert "bar done 1000" in text
    assert "train" in text and "torchmem run --live: bar.py" in text
    assert torchmem.load_trace(tmp_path / "t.tmtrace").peak()["cpu"] >= 4000


def test_a_cuda_device_shows_the_allocators_allocated_and_reserved_bytes() -> None:
    """The allocator reading comes from torchmem's simulator of the caching allocator fed the
    same storages: 1 MiB and 512 KiB share one 2 MiB small-pool segment."""
    import io

    from rich.console import Console

    from torchmem.cli._live import LiveView
    from torchmem.model.events import Event, EventKind
    from torchmem.sim import CachingAllocator

    sim = CachingAllocator()
    view = LiveView("gpu.py", console=Console(file=io.StringIO(), width=100),
                    allocator=lambda dev: (sim.allocated_bytes, sim.reserved_bytes))
    for sid, nbytes in ((1, 1 << 20), (2, 512 << 10)):
        sim.malloc(nbytes)
        view.on_event(Event(sid, EventKind.ALLOC, sid, "cuda:0", nbytes, sid))
    view.on_event(Event(3, EventKind.ALLOC, 3, "cpu", 64, 3))
    text = live_text(view.state())
    assert "cuda:0: live 1.50 MiB   peak 1.50 MiB" in text
    assert "allocator: allocated 1.50 MiB, reserved 2.00 MiB" in text
    assert text.count("allocator:") == 1   # not for the CPU
