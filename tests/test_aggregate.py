"""Aggregated tracking (issue 12, bounded memory): an aggregated run's summary equals the full
run's, field by field, on the same seeded workload; saved aggregated traces read back the same.

Ground truth: a full ``torchmem.track()`` of the same seeded run (every event held), summarised
by the full-trace path of ``summarize_trace``. The aggregated run compacts at every step marker
(``aggregate=1``), the hardest setting: each iteration's events are folded and dropped as soon
as it ends. Row numbers (``peak_seq``, ``peak_index``) and times differ between two runs by
construction; the peak *event* is compared instead (size, operator, module, phase, category,
step, call site).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchmem
from torchmem.analysis._diff import trace_diff
from torchmem.analysis.summary import summarize_trace
from torchmem.cli import main
from torchmem.errors import InvalidInputError, TraceFormatError
from torchmem.io.tmtrace import load_trace, save_trace
from torchmem.model.aggregate import Aggregate

_RUN_DEPENDENT = {"peak_seq", "peak_time_ns", "peak_index", "metadata", "aggregated"}


def _mlp(batches: list[int]) -> Callable[[dict[str, Any]], Any]:
    def run(kw: dict[str, Any]) -> Any:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        opt = torch.optim.Adam(net.parameters())
        with torchmem.track(net, opt, **kw) as tr:
            for b in batches:
                loss = net(torch.randn(b, 32)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        return tr
    return run


def _transformer(kw: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                             dropout=0.0, batch_first=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01, momentum=0.9)
    with torchmem.track(layer, opt, **kw) as tr:
        for i in range(8):
            x = torch.randn(4, 6 + (i % 3), 32)
            layer(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=i % 2 == 0)
    return tr


def _leak(kw: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kept = []
    with torchmem.track(net, opt, stacks=True, **kw) as tr:
        for _ in range(16):
            loss = net(torch.randn(8, 16)).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept.append(loss)  # the loss and its graph: a leak through a list
    return tr


WORKLOADS = {
    "mlp": _mlp([16] * 10),
    "transformer": _transformer,
    "leak": _leak,
    "peak_early": _mlp([16, 128, 16, 16, 16, 16, 16, 16]),
    "peak_last": _mlp([16] * 7 + [128]),
}


def _fields(tr: Any) -> dict[str, Any]:
    s = summarize_trace(tr.trace)
    d = s.to_dict()
    ev = tr.trace.event(s.peak_seq)
    d["peak_event"] = (ev.kind, ev.nbytes, ev.op, ev.module, ev.phase, ev.category, ev.step,
                       ev.stack[-1] if ev.stack else None)  # the call site (outer frames: callers)
    return {k: v for k, v in d.items() if k not in _RUN_DEPENDENT}


@pytest.mark.parametrize("keep_last", [0, 2])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_aggregated_summary_equals_full(name: str, keep_last: int) -> None:
    run = WORKLOADS[name]
    full = run({})
    agg = run({"aggregate": 1, "keep_last": keep_last})
    a = agg.trace.aggregate
    assert full.trace.aggregate is None
    assert a.compactions > 0 and a.dropped > 0 and len(agg.trace) < len(full.trace)
    assert a.events == len(full.trace)
    want, got = _fields(full), _fields(agg)
    assert sorted(want) == sorted(got)
    for key in want:
        assert got[key] == want[key], key
    assert agg.peak() == full.peak()
    s = summarize_trace(agg.trace)
    assert s.aggregated is not None and s.aggregated["events_folded"] == a.dropped


def test_the_workloads_show_what_they_are_for() -> None:
    """The equality above is only worth something if the figures compared are not trivial."""
    early = summarize_trace(WORKLOADS["peak_early"]({}).trace)
    last = summarize_trace(WORKLOADS["peak_last"]({}).trace)
    leak = summarize_trace(WORKLOADS["leak"]({}).trace)
    assert max(early.iterations, key=lambda it: it.peak_bytes).step == 1
    assert max(last.iterations, key=lambda it: it.peak_bytes).step == 7
    assert leak.leak_suspect and leak.growth is not None and leak.growth.growing


def test_held_rows_are_bounded_and_the_peak_iteration_is_whole() -> None:
    full = _mlp([16, 128] + [16] * 30)({})
    agg = _mlp([16, 128] + [16] * 30)({"aggregate": 1, "keep_last": 2})
    per_step_full = {}
    for e in full.events():
        per_step_full[e.step] = per_step_full.get(e.step, 0) + 1
    per_step_agg: dict[int, int] = {}
    for e in agg.events():
        per_step_agg[e.step] = per_step_agg.get(e.step, 0) + 1
    # every event of the peak's iteration (1) and of the last two (30, 31) is held
    for step in (1, 30, 31):
        assert per_step_agg[step] == per_step_full[step]
    # the rest: only the storages alive across (parameters, Adam's state, gradients)
    assert len(agg.trace) < len(full.trace) // 5
    assert sum(per_step_agg.values()) == len(agg.trace)


def test_aggregate_after_n_events_keeps_short_runs_whole() -> None:
    short = _mlp([16] * 3)({"aggregate": 10_000})
    assert short.trace.aggregate.compactions == 0
    full = _mlp([16] * 3)({})
    assert len(short.trace) == len(full.trace)
    long = _mlp([16] * 12)({"aggregate": 200})
    assert long.trace.aggregate.compactions > 0
    assert _fields(long) == _fields(_mlp([16] * 12)({}))


def test_saved_aggregated_trace_reads_back(tmp_path: Any) -> None:
    agg = _leak({"aggregate": 1, "keep_last": 1})
    full = _leak({})
    p = str(tmp_path / "agg.tmtrace")
    agg.save(p)
    back = load_trace(p)
    assert back.aggregate is not None and len(back) == len(agg.trace)
    assert _fields(type("T", (), {"trace": back})()) == _fields(full)
    with open(p, "rb") as f:
        head = f.read(16)
    assert int.from_bytes(head[8:12], "little") == 3  # aggregated traces are version 3
    # a plain run stays a version 2 file with no aggregate
    plain = str(tmp_path / "full.tmtrace")
    full.save(plain)
    assert load_trace(plain).aggregate is None
    with open(plain, "rb") as f:
        assert int.from_bytes(f.read(12)[8:12], "little") == 2


def test_cli_summary_says_the_run_was_aggregated(tmp_path: Any, capsys: Any) -> None:
    p = str(tmp_path / "agg.tmtrace")
    _mlp([16] * 6)({"aggregate": 1, "path": p})
    assert main(["summary", p, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["aggregated"]["events_folded"] > 0
    assert data["events"] == data["aggregated"]["events"]
    assert main(["summary", p]) == 0
    out = capsys.readouterr().out
    assert "aggregated run:" in out and "folded into counters" in out


def test_diff_of_full_and_aggregated_runs_is_zero(tmp_path: Any) -> None:
    full = _transformer({})
    agg = _transformer({"aggregate": 1, "keep_last": 1})
    for at in ("peak", "end"):
        d = trace_diff(full.trace, agg.trace, at=at)
        assert d.delta_bytes == 0, at
        for rows in d.groups.values():
            assert all(g.delta_bytes == 0 and g.before_count == g.after_count for g in rows), at
        assert all(it.before is not None and it.after is not None for it in d.iterations)
    pa, pb = str(tmp_path / "a.tmtrace"), str(tmp_path / "b.tmtrace")
    full.save(pa)
    agg.save(pb)
    assert main(["diff", pa, pb, "--json"]) == 0


def test_view_reads_an_aggregated_trace(tmp_path: Any) -> None:
    p = str(tmp_path / "agg.tmtrace")
    _mlp([16] * 6)({"aggregate": 1, "path": p})
    out = str(tmp_path / "v.html")
    assert main(["view", p, "-o", out, "-q"]) == 0
    assert os.path.getsize(out) > 1000


def test_streamed_file_of_an_aggregated_run_reads_while_it_runs(tmp_path: Any) -> None:
    """A run killed mid-way leaves the streamed file: the aggregate written at the last
    compaction plus the chunks after it; its summary covers every event streamed."""
    p = str(tmp_path / "live.tmtrace")
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with torchmem.track(net, opt, aggregate=1, keep_last=1, path=p) as tr:
        for _ in range(6):
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
        x = torch.ones(1000)  # after the last compaction: in a later chunk
        assert tr._streamer is not None
        tr._streamer.flush()
        mid = load_trace(p)
        now = summarize_trace(tr.trace)
        del x
    assert "cut_short" in mid.metadata and mid.aggregate is not None
    s = summarize_trace(mid)
    assert s.events == now.events == tr.trace.aggregate.events - 1  # the free of x came later
    assert s.peak == now.peak and s.steps == now.steps == 6
    assert [vars(it) for it in s.iterations] == [vars(it) for it in now.iterations]


def test_bad_arguments_say_what_to_pass() -> None:
    with pytest.raises(InvalidInputError, match="aggregate must be True, False or an event count"):
        torchmem.track(aggregate=0)
    with pytest.raises(InvalidInputError, match="keep_last must be an int >= 0"):
        torchmem.track(aggregate=True, keep_last=-2)


def test_corrupt_aggregate_is_a_format_error(tmp_path: Any) -> None:
    agg = _mlp([16] * 4)({"aggregate": 1})
    agg.trace.aggregate.fold(agg.trace)
    state = agg.trace.aggregate.to_json()
    del state["marks"]
    with pytest.raises(InvalidInputError, match="aggregate data is missing or has a bad field"):
        Aggregate.from_json(state)
    p = str(tmp_path / "a.tmtrace")
    save_trace(agg.trace, p)
    data = bytearray(open(p, "rb").read())
    i = data.find(b'"format":1')
    data[i:i + 10] = b'"format":7'
    open(p, "wb").write(bytes(data))
    with pytest.raises(TraceFormatError, match="corrupt aggregate"):
        load_trace(p)


def test_listeners_see_the_ids_of_the_whole_run() -> None:
    """Listeners keep state by storage id (the live panel, the leak watch): in an aggregated run
    they get the ids a full run gives, which never change while a storage lives."""
    from torchmem.cli._live import LiveCounter

    def with_listener(kw: dict[str, Any]) -> tuple[LiveCounter, list[tuple[int, int, int]]]:
        counter = LiveCounter()
        seen: list[tuple[int, int, int]] = []
        _leak({"listeners": [counter.on_event,
                             lambda e, s: seen.append((e.seq, int(e.kind), e.storage))], **kw})
        return counter, seen

    full, full_seen = with_listener({})
    agg, agg_seen = with_listener({"aggregate": 1, "keep_last": 1})
    assert agg_seen == full_seen  # same seq and storage ids, event by event
    for name in ("live", "peak", "by_category", "at_peak", "growth", "iterations"):
        assert getattr(agg, name) == getattr(full, name), name


LEAKY_SCRIPT = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.Adam(net.parameters())
kept = []
for i in range(14):
    loss = net(torch.randn(8 if i != 3 else 64, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    kept.append(loss.detach().clone())
"""


def test_cli_run_aggregated_equals_full(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(LEAKY_SCRIPT)

    def run(*opts: str) -> tuple[dict[str, Any], str]:
        out = tmp_path / f"t{len(opts)}.tmtrace"
        p = subprocess.run([sys.executable, "-m", "torchmem", "run", "--json", "--no-host",
                            "--why", "0", "-o", str(out), *opts, str(script)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout), p.stderr

    full, _ = run("--no-aggregate")
    agg, err = run("--aggregate-after", "50", "--keep-last", "1")
    assert full["aggregated"] is None
    assert agg["aggregated"]["events_folded"] > 0 and "aggregated" in err
    for key in full:
        if key not in _RUN_DEPENDENT:
            assert agg[key] == full[key], key
    assert full["leak_suspect"] and full["iterations"][3]["peak_bytes"] == max(
        it["peak_bytes"] for it in full["iterations"])
    p = subprocess.run([sys.executable, "-m", "torchmem", "run", "--aggregate",
                        "--aggregate-after", "5", str(script)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "not allowed with argument" in p.stderr


def _two_devices(kw: dict[str, Any]) -> Any:
    """CPU and meta storages, each device with its own peak iteration (meta's in step 2,
    CPU's in step 5), and a meta storage made only from step 3 on."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with torchmem.track(net, opt, **kw) as tr:
        for i in range(8):
            m = torch.empty(1000 if i == 2 else 100, device="meta")
            if i >= 3:
                late = torch.empty(10 * i, device="meta")
                del late
            net(torch.randn(64 if i == 5 else 4, 8)).sum().backward()
            opt.step()
            del m
    return tr


def test_every_device_keeps_its_own_peak_iteration() -> None:
    full = _two_devices({})
    agg = _two_devices({"aggregate": 1, "keep_last": 1})
    assert agg.trace.aggregate.dropped > 0
    assert set(full.trace.devices) == {"cpu", "meta"}
    for device in ("cpu", "meta"):
        a = summarize_trace(full.trace, device=device).to_dict()
        b = summarize_trace(agg.trace, device=device).to_dict()
        for key in a:
            if key not in _RUN_DEPENDENT:
                assert b[key] == a[key], (device, key)
    meta = summarize_trace(full.trace, device="meta")
    assert max(meta.iterations, key=lambda it: it.peak_bytes).step == 2


def _stepless(n: int, kw: dict[str, Any], within: int = 0, held: list[int] | None = None) -> Any:
    """An inference loop with no step marker: ``n`` batches through a small net, a 40 kB
    buffer alive for a few batches a third of the way in (the run's peak)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    tr = torchmem.track(net, stacks=True, **kw)
    if within:
        tr.trace.aggregate.within = within
    big = None
    with tr, torch.no_grad():
        for i in range(n):
            _ = net(torch.randn(4 + i % 5, 16)).softmax(-1)
            if i == n // 3:
                big = torch.ones(10_000)
            elif i == n // 3 + 4:
                big = None
            if held is not None:
                held.append(len(tr))
    assert big is None
    return tr


def test_a_run_without_step_markers_holds_a_bounded_number_of_events() -> None:
    """Issue: ``aggregate=True`` kept every event of a step-less run (one endless iteration).
    Now the iteration in progress is compacted every ``within`` rows: the held events stay
    under ``within`` plus the storages alive, however long the run, and the summary is the
    full run's, field by field."""
    held: list[int] = []
    agg = _stepless(1500, {"aggregate": 1}, within=500, held=held)
    full = _stepless(1500, {})
    a = agg.trace.aggregate
    assert a.events == len(full.trace) > 10_000
    assert a.compactions >= 15 and a.dropped > 0.9 * a.events
    assert max(held) <= 500 + 64, max(held)
    assert max(held[len(held) // 2:]) <= max(held[:len(held) // 2]) + 16  # flat, not growing
    assert agg.peak() == full.peak() and agg.peak()["cpu"] > 40_000
    want, got = _fields(full), _fields(agg)
    assert sorted(want) == sorted(got)
    for key in want:
        assert got[key] == want[key], key
    s = summarize_trace(agg.trace)
    assert s.aggregated is not None and s.aggregated["events_folded"] == a.dropped
    assert s.iterations and s.iterations[-1].complete is False


def test_a_step_less_aggregated_run_saves_and_reads_back(tmp_path: Any) -> None:
    agg = _stepless(600, {"aggregate": 1}, within=1000)
    assert agg.trace.aggregate.compactions > 0
    path = str(tmp_path / "a.tmtrace")
    agg.save(path)
    back = load_trace(path)
    assert back.aggregate is not None and back.aggregate.within == 1000
    want = summarize_trace(agg.trace).to_dict()
    got = summarize_trace(back).to_dict()
    assert {k: v for k, v in got.items() if k != "metadata"} == {
        k: v for k, v in want.items() if k != "metadata"}


def test_default_aggregation_compacts_step_less_runs_past_the_default_period() -> None:
    """``aggregate=True``: the first compaction, with or without step markers, once the trace
    holds ``DEFAULT_PERIOD`` events; the iteration in progress then every ``within`` rows."""
    from torchmem.model.aggregate import DEFAULT_PERIOD

    a = torchmem.track(aggregate=True).trace.aggregate
    assert a.within == DEFAULT_PERIOD and a.midway_at() == DEFAULT_PERIOD
    assert torchmem.track(aggregate=10).trace.aggregate.midway_at() == DEFAULT_PERIOD


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2  # one new storage (aten::mul) and one autograd node


class _Shift(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1  # one new storage (aten::add) and one autograd node


def test_a_step_less_run_with_autograd_stays_bounded_and_its_totals_are_exact() -> None:
    """Issue 26: an inference loop with autograd on (no ``torch.no_grad``) and no optimizer
    step. The held events stay under ``within`` and so does the tracker's map from autograd
    sequence numbers to modules (it grew by two entries per forward before: 12 B each, without
    bound); per-operator and per-module totals, the event count and the peak equal sums over
    the tensors the loop made, computed here from their sizes."""
    n, within, big_at = 3000, 500, 1000
    sizes = [8 + i % 13 for i in range(n)]  # floats per tensor in iteration i
    net = torch.nn.Sequential(_Scale(), _Shift())
    held: list[int] = []
    seq_map: list[int] = []
    tr = torchmem.track(net, aggregate=1)  # no optimizer: no step marker, ever
    tr.trace.aggregate.within = within
    big = None
    with tr:
        for i, k in enumerate(sizes):
            if i == big_at:
                big = torch.ones(25_000)
            elif i == big_at + 4:
                big = None
            x = torch.full((k,), 1.0, requires_grad=True)
            out = net(x)
            del x, out
            held.append(len(tr.trace))
            seq_map.append(len(tr._seq_bounds))
    assert big is None
    a = tr.trace.aggregate
    assert a.events == 6 * n + 2  # every tensor's ALLOC and FREE, none missed or doubled
    assert a.compactions >= 20 and max(held) <= within + 16, (a.compactions, max(held))
    assert max(seq_map) <= within, max(seq_map)
    assert max(seq_map[n // 2:]) <= max(seq_map[:n // 2])  # flat, not growing
    s = summarize_trace(tr.trace)
    per_tensor = 4 * sum(sizes)
    ops = {name: (nbytes, count) for name, nbytes, count in s.top_ops_allocated}
    assert ops == {"aten::full": (per_tensor, n), "aten::mul": (per_tensor, n),
                   "aten::add": (per_tensor, n), "aten::ones": (100_000, 1)}, ops
    mods = {name: (nbytes, count) for name, nbytes, count in s.top_modules_allocated}
    assert mods["Sequential.0"] == (per_tensor, n) and mods["Sequential.1"] == (per_tensor, n)
    # the most alive at once: the 100 kB buffer and one iteration's x, x * 2 and x * 2 + 1
    assert s.peak == {"cpu": 100_000 + 12 * max(sizes[big_at:big_at + 4])}, s.peak
    assert s.final_live == {"cpu": 0} and not s.iterations[-1].complete


def _backward_after_many_forwards(kw: dict[str, Any], within: int = 0) -> tuple[list[Any], int]:
    """300 forwards with autograd on and no backward, then one forward and backward: the
    backward's allocations as (operator, module, bytes), and the sequence map's largest size."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    seen: list[Any] = []

    def listener(ev: Any, _storage: Any) -> None:
        if ev.kind.name == "ALLOC" and ev.phase.label == "backward":
            seen.append((ev.op, ev.module, ev.nbytes))

    tr = torchmem.track(net, listeners=[listener], **kw)
    if within:
        tr.trace.aggregate.within = within
    most = 0
    with tr:
        for _ in range(300):
            _ = net(torch.randn(2, 8))
            most = max(most, len(tr._seq_bounds))
        net(torch.randn(2, 8)).sum().backward()
    return seen, most


def test_the_bounded_sequence_map_still_attributes_a_recent_backward() -> None:
    """The map from autograd nodes to modules of a step-less aggregated run is cut to its newest
    half at ``within`` entries; a backward right after its forward is attributed to the same
    modules as in a full trace, which keeps every entry."""
    full, full_most = _backward_after_many_forwards({})
    agg, agg_most = _backward_after_many_forwards({"aggregate": 1}, within=64)
    assert full_most > 500 and agg_most <= 64, (full_most, agg_most)
    assert agg == full and len(full) >= 4
    assert {m for _, m, _ in full} >= {"Sequential.0", "Sequential.2"}, full
