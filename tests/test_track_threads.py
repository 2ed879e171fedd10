"""Every thread: allocations made on other Python threads are recorded, named by their thread.

Ground truth: the bytes of the tensors themselves (``torchmem.inspect_memory``, a census that
never sees the tracker), a run without the other thread (for the tracking thread's attribution),
and the dispatch-mode stacks of the threads (``torch._C._len_torch_dispatch_stack``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import torch

import torchmem
from torchmem.model.events import Event

MiB = 1 << 20


def _stack_len() -> int:
    return int(torch._C._len_torch_dispatch_stack())


def test_a_tensor_made_on_another_thread_is_recorded_with_its_name() -> None:
    start = threading.Thread.start
    held: list[torch.Tensor] = []
    seen_stack: list[int] = []

    def work() -> None:
        seen_stack.append(_stack_len())
        held.append(torch.empty(MiB))  # 4 MiB of float32
        scratch = torch.ones(1000)  # made and freed here
        del scratch

    with torchmem.track() as tr:
        a = torch.zeros(MiB // 16)  # 256 KiB
        th = threading.Thread(target=work, name="maker")
        th.start()
        th.join()
        b = torch.ones(MiB // 8)  # 512 KiB
        census = torchmem.inspect_memory(tensors=[a, held[0], b]).total_unique_bytes
    events = list(tr.events())
    mine = [(e.kind.label, e.op, e.nbytes) for e in events if e.thread == "maker"]
    assert mine == [
        ("alloc", "aten::empty", 4 * MiB),
        ("alloc", "aten::ones", 4000),
        ("free", None, 4000),
    ]
    assert {e.thread for e in events if e.thread != "maker"} == {"MainThread"}
    # the peak is the three tensors alive together, as the census counts them
    assert census == 4 * MiB + MiB // 4 + MiB // 2
    assert tr.peak()["cpu"] == census
    assert tr.trace.peak()["cpu"] == census
    # the thread ran under a mode of its own; nothing is left installed anywhere
    assert seen_stack == [1]
    assert _stack_len() == 0
    assert threading.Thread.start is start
    assert "run" not in th.__dict__
    after: list[int] = []
    late = threading.Thread(target=lambda: after.append(_stack_len()))
    late.start()
    late.join()
    assert after == [0]


def test_the_trace_file_keeps_thread_names(tmp_path: Path) -> None:
    with torchmem.track() as tr:
        th = threading.Thread(target=lambda: torch.zeros(MiB // 4), name="loader-0")
        th.start()
        th.join()
    tr.save(tmp_path / "t.tmtrace")
    back = torchmem.load_trace(tmp_path / "t.tmtrace")
    assert [(e.thread, e.kind.label, e.nbytes) for e in back.events()] == [
        ("loader-0", "alloc", MiB), ("loader-0", "free", MiB)
    ]


def _project(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(e.kind.label, e.op, e.module, e.phase.label, e.category.label, e.nbytes, e.step)
            for e in events if e.thread == "MainThread"]


def test_attribution_of_the_tracking_thread_is_unchanged_by_a_busy_thread() -> None:
    def run(with_thread: bool) -> tuple[list[Event], int]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        other = torch.nn.Linear(16, 16)  # a module run on the other thread: hooks must ignore it
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                other(torch.randn(4, 16))

        with torchmem.track(net, opt) as tr:
            th = threading.Thread(target=busy, name="busy")
            if with_thread:
                th.start()
            for _ in range(3):
                net(torch.randn(16, 32)).sum().backward()
                opt.step()
                opt.zero_grad()
            stop.set()
            if with_thread:
                th.join()
        busy_allocs = sum(1 for e in tr.events() if e.thread == "busy" and e.kind.label == "alloc")
        return list(tr.events()), busy_allocs

    alone, none = run(False)
    shared, busy_allocs = run(True)
    assert none == 0 and busy_allocs >= 2
    assert _project(shared) == _project(alone)
    assert {e.module for e in shared if e.thread == "busy"} == {None}
    assert {e.phase.label for e in shared if e.thread == "busy"} == {"other"}


def test_a_thread_that_outlives_the_block_records_nothing_after_it() -> None:
    go_on, began = threading.Event(), threading.Event()
    out: list[int] = []

    def work() -> None:
        torch.zeros(10)
        began.set()
        go_on.wait(30)
        out.append(_stack_len())  # its inert mode is still on its stack until run() returns
        torch.zeros(1000)

    with torchmem.track() as tr:
        th = threading.Thread(target=work, name="late")
        th.start()
        began.wait(30)
    n = len(tr)
    go_on.set()
    th.join()
    assert out == [1]
    assert len(tr) == n
    assert "run" not in th.__dict__
    assert [(e.kind.label, e.nbytes) for e in tr.events() if e.thread == "late"][:1] == [
        ("alloc", 40)
    ]


SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, torch, torchmem
    held = []
    a = torch.zeros(1 << 16)
    t = threading.Thread(target=lambda: held.append(torch.empty(1 << 20)), name="maker")
    t.start(); t.join()
    b = torch.ones(1 << 17)
    census = torchmem.inspect_memory(tensors=[a, held[0], b]).total_unique_bytes
    json.dump({"census": census}, open(sys.argv[1], "w"))
    """
)


def test_torchmem_run_records_other_threads(tmp_path: Path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--json", "--no-host", "-o",
         str(tmp_path / "t.tmtrace"), str(script), str(tmp_path / "census.json")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    census = json.loads((tmp_path / "census.json").read_text())["census"]
    trace = torchmem.load_trace(tmp_path / "t.tmtrace")
    made = [e for e in trace.events() if e.thread == "maker"]
    assert [(e.kind.label, e.nbytes) for e in made] == [("alloc", 4 * MiB)]
    assert made[0].stack and made[0].stack[-1].startswith(str(script))
    assert census == 4 * MiB + MiB // 4 + MiB // 2
    assert trace.peak()["cpu"] == census
    summary = json.loads(proc.stdout)
    assert summary["peak"]["cpu"] == census
    assert {"name": "maker", "bytes": 4 * MiB, "count": 1} in summary["top_threads_allocated"]
