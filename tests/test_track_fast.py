"""``torchmem.track(..., mode="fast")``: allocator-level capture, checked against ground truth.

Ground truth comes from other mechanisms: hand arithmetic on tensors of known sizes, and the
dispatch tracker (``mode="ops"``, a TorchDispatchMode with weak references on storages, whose
own accuracy against an independent census is tested in test_track_accuracy.py) run on the same
seeded workload. The fast tracker wraps PyTorch's CPU allocator instead, so agreement between the
two is agreement between two independent captures.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import torchmem
from torchmem.analysis.summary import summarize_trace
from torchmem.capture.fast import FastTracker, native_available
from torchmem.errors import InvalidInputError

pytestmark = pytest.mark.skipif(
    not native_available(), reason="mode='fast' needs a C++ compiler and ninja to build"
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _workloads():  # type: ignore[no-untyped-def]
    from bench_tracker import mlp, transformer

    def cnn():  # type: ignore[no-untyped-def]
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10),
        )
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        x = torch.randn(4, 3, 8, 8)
        y = torch.randint(0, 10, (4,))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

        return step, net, opt

    return {"mlp": mlp, "transformer": transformer, "cnn": cnn}


def test_peak_and_order_by_hand() -> None:
    with torchmem.track(mode="fast") as tr:
        a = torch.ones(1000)            # 4000
        b = torch.ones(500)             # 2000 -> 6000
        del a                           # 2000
        c = torch.ones(2000)            # 8000 -> 10000 (the peak)
        del b, c
    assert tr.peak() == {"cpu": 10_000}
    kinds = [(e.kind.label, e.nbytes, e.op) for e in tr.events()]
    assert kinds == [
        ("alloc", 4000, "aten::ones"), ("alloc", 2000, "aten::ones"), ("free", 4000, None),
        ("alloc", 8000, "aten::ones"), ("free", 2000, None), ("free", 8000, None),
    ]
    assert tr.live_bytes("cpu") == 0


def test_categories_modules_and_phases_by_hand() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(net.parameters())
    with torchmem.track(net, opt, mode="fast") as tr:
        x = torch.ones(8, 64)
        net(x).sum().backward()
        opt.step()
    ev = list(tr.events())
    params = (64 * 32 + 32 + 32 * 4 + 4) * 4
    by = lambda cat: sum(e.nbytes for e in ev if e.kind.label == "alloc" and e.category.label == cat)  # noqa: E731
    assert by("parameter") == params           # the initial state, at time 0
    assert by("gradient") == params            # one .grad per parameter, made in backward
    assert by("optimizer_state") == 2 * params + 4 * 4  # exp_avg, exp_avg_sq, a step per tensor
    assert by("input") == 8 * 64 * 4
    # the ReLU output is saved for backward (an activation of Sequential.1); Linear 0's output
    # is freed as soon as ReLU has run (a temporary)
    acts = [(e.module, e.nbytes) for e in ev if e.kind.label == "alloc" and e.category.label == "activation"]
    assert ("Sequential.1", 8 * 32 * 4) in acts
    mods = {e.module for e in ev if e.phase.label == "backward" and e.kind.label == "alloc"}
    assert {"Sequential.0", "Sequential.2"} <= mods
    assert [e.op for e in ev if e.kind.label == "mark"] == ["step"]


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_summary_equals_the_dispatch_tracker(name: str) -> None:
    torch.set_num_threads(1)
    make = _workloads()[name]
    summaries = {}
    traces = {}
    for mode in ("ops", "fast"):
        torch.manual_seed(0)
        step, net, opt = make()
        with torchmem.track(net, opt, mode=mode) as tr:  # type: ignore[call-overload]
            for _ in range(3):
                step()
        summaries[mode] = summarize_trace(tr.trace, top=10_000)
        traces[mode] = tr.trace
    ops, fast = summaries["ops"], summaries["fast"]
    if name == "cnn":
        # AdamW turns Python floats into 0-d tensors inside C++ without a dispatcher call: the
        # allocator makes them (the fast tracker sees them), the dispatch tracker cannot. The
        # whole difference at the peak must be such scalars of the optimizer step.
        extra = _live_at_peak(traces["fast"]) - _live_at_peak(traces["ops"])
        assert extra and all(nb <= 8 and ph == "optimizer" for nb, _, ph in extra.elements())
        assert fast.peak["cpu"] - ops.peak["cpu"] == sum(nb for nb, _, _ in extra.elements())
        for cat, nb in fast.categories_at_peak.items():
            assert nb - ops.categories_at_peak.get(cat, 0) == sum(
                b for b, c, _ in extra.elements() if c == cat)
        return
    assert fast.peak == ops.peak
    assert fast.categories_at_peak == ops.categories_at_peak
    assert fast.phases_at_peak == ops.phases_at_peak
    assert fast.top_modules_at_peak == ops.top_modules_at_peak
    assert fast.steps == ops.steps == 3
    # after the first iteration the loop is steady: every iteration retains nothing, in both
    assert [it.retained_growth for it in fast.iterations[1:]] == [
        it.retained_growth for it in ops.iterations[1:]] == [0] * (len(ops.iterations) - 1)
    assert fast.iterations[0].retained_growth == ops.iterations[0].retained_growth
    # operators: the fast tracker names the operator called (aten::linear), the dispatch tracker
    # the kernel it sees below autograd (aten::addmm); their byte totals at the peak agree
    assert sum(b for _, b, _ in fast.top_ops_at_peak) == sum(b for _, b, _ in ops.top_ops_at_peak)


def _live_at_peak(trace):  # type: ignore[no-untyped-def]
    """(nbytes, category, phase) of the storages alive at the trace's peak, as a multiset."""
    from collections import Counter

    stop = trace.peak_seq()["cpu"]
    live = {}
    for e in trace.events(0, stop + 1):
        if e.kind.label == "alloc":
            live[e.storage] = (e.nbytes, e.category.label, e.phase.label)
        elif e.kind.label == "free":
            live.pop(e.storage, None)
    return Counter(live.values())


def test_other_threads_are_recorded() -> None:
    seen: list[int] = []

    def work() -> None:
        t = torch.ones(1 << 20)  # 4 MiB
        seen.append(t.numel())
        del t

    with torchmem.track(mode="fast") as tr:
        th = threading.Thread(target=work)
        th.start()
        th.join()
    allocs = [e for e in tr.events() if e.kind.label == "alloc" and e.nbytes == 4 << 20]
    assert len(allocs) == 1 and seen == [1 << 20]
    assert allocs[0].thread == "thread-1"  # numbered in order of first allocation
    assert tr.peak()["cpu"] >= 4 << 20


def test_nothing_stays_installed_and_late_frees_are_safe() -> None:
    from torch.nn.modules import module as nn_module

    from torchmem.capture.fast._build import load_native

    pre = len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)
    with torchmem.track(torch.nn.Linear(2, 2), mode="fast") as tr:
        kept = torch.ones(100)
        with pytest.raises(InvalidInputError, match="do not nest"):
            with torchmem.track(mode="fast"):
                pass
    n = len(tr)
    del kept  # freed after the block: its deleter must not record or crash
    after = torch.ones(100)
    assert len(tr) == n and not load_native().active()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == pre
    del after
    try:  # an exception inside the block restores everything too
        with torchmem.track(mode="fast"):
            raise ValueError("boom")
    except ValueError:
        pass
    assert not load_native().active()


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "fast.tmtrace"
    with torchmem.track(mode="fast", path=p) as tr:
        x = torch.zeros(256)
        del x
    back = torchmem.load_trace(p)
    assert back.peak() == tr.peak() == {"cpu": 1024}
    assert back.metadata["mode"] == "fast"


def test_bad_arguments() -> None:
    with pytest.raises(InvalidInputError, match="stacks"):
        torchmem.track(stacks=True, mode="fast")
    with pytest.raises(InvalidInputError, match="listeners"):
        torchmem.track(listeners=[lambda e, s: None], mode="fast")
    with pytest.raises(InvalidInputError, match="'ops'.*'fast'"):
        torchmem.track(mode="quick")  # type: ignore[call-overload]
    with pytest.raises(InvalidInputError, match="argument 0"):
        FastTracker(torch.ones(2))
    tr = torchmem.track(mode="fast")
    with tr:
        pass
    with pytest.raises(InvalidInputError, match="already used"):
        tr.__enter__()


def _run_json(*args: str, tmp: Path) -> dict:  # type: ignore[type-arg]
    import json
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", *args, "--json", "--no-host",
         "-o", str(tmp / f"{args[1]}.tmtrace")],
        capture_output=True, text=True, timeout=600, cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_torchmem_run_mode_fast_matches_mode_ops(tmp_path: Path) -> None:
    ops = _run_json("--mode", "ops", "--example", tmp=tmp_path)
    fast = _run_json("--mode", "fast", "--example", tmp=tmp_path)
    extra = fast["peak"]["cpu"] - ops["peak"]["cpu"]
    # the same run seen twice; the allocator also makes the optimizer's 0-d scalar tensors that
    # no dispatcher call returns (a few bytes of temporaries), nothing else differs
    assert 0 <= extra <= 64
    cats_f, cats_o = fast["categories_at_peak"], ops["categories_at_peak"]
    assert {k: v for k, v in cats_f.items() if k != "temporary"} == {
        k: v for k, v in cats_o.items() if k != "temporary"}
    assert cats_f.get("temporary", 0) - cats_o.get("temporary", 0) == extra
    assert fast["steps"] == ops["steps"] == 4
    assert [it["retained_growth"] for it in fast["iterations"]] == [
        it["retained_growth"] for it in ops["iterations"]]


def test_torchmem_run_mode_fast_refuses_live() -> None:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "torchmem", "run", "--mode", "fast", "--live",
                           "--example"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--live needs --mode ops" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no os.fork on this platform")
def test_a_forked_child_stops_the_native_capture(tmp_path: Path) -> None:
    """``os.fork`` in a fast-tracked block (a DataLoader worker): the child's copy of the
    native capture stops (before, it kept recording every allocation of the worker, and a
    fast tracker of the child's own was refused as nested); leaving the block in the child
    writes nothing to the parent's file."""
    import json
    import os

    path, report = tmp_path / "t.tmtrace", tmp_path / "child.json"
    pid = -1
    try:
        with torchmem.track(mode="fast", path=path) as tr:
            keep = torch.ones(8)
            pid = os.fork()
            if pid == 0:
                xs = [torch.ones(10) for _ in range(100)]
                with torchmem.track(mode="fast") as inner:
                    ys = [torch.ones(10) for _ in range(100)]
                got = {"active": tr._active, "inner_allocs": sum(
                    1 for e in inner.events() if e.kind.label == "alloc"), "made": len(xs + ys)}
            else:
                _, status = os.waitpid(pid, 0)
                assert status == 0
            del keep
    finally:
        if pid == 0:
            code = 1
            try:
                report.write_text(json.dumps({**got, "file": path.exists()}))
                code = 0
            finally:
                os._exit(code)
    got = json.loads(report.read_text())
    assert got == {"active": False, "inner_allocs": 100, "made": 200, "file": False}
    assert path.exists() and len(torchmem.load_trace(path)) == len(tr)
