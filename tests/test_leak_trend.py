"""Leaks over many iterations (issue 12): the trend rule, growing call sites and modules, on real
scripts run under ``torchmem run``, with the bytes per iteration computed by hand."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from torchmem.analysis import GrowthReport, growth, leak_trend, summarize
from torchmem.cli import main
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import load_trace
from torchmem.model.events import EventKind
from torchmem.model.trace import Trace

# Keeps a 1000-float tensor per iteration in a list (made after the step marker, so it lands in
# the next iteration): 4000 bytes per iteration at line 11, from step 1 on.
LIST_LEAK = textwrap.dedent(
    """\
    import torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    KEPT = []
    for i in range(12):
        loss = net(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        KEPT.append(torch.zeros(1000))
    """
)

# A validation loss kept with its graph (no backward on it, no torch.no_grad): the graph keeps
# addmm's saved input xv (16*64 floats = 4096 B, line 12) and pow's saved input, the Linear's
# output (16*32 floats = 2048 B, made in module Sequential.0 at line 13), plus the 4-byte loss
# itself (line 13): 6148 bytes per iteration.
CACHED_GRAPH = textwrap.dedent(
    """\
    import torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    VAL = []
    for i in range(10):
        x = torch.randn(16, 64)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        xv = torch.randn(16, 64)
        val = net(xv).pow(2).mean()
        VAL.append(val)
    """
)

# A parameter added to Adam every step: the parameter (256 floats = 1024 B, line 7) and its
# Adam state made in opt.step() (line 12): exp_avg and exp_avg_sq (1024 B each) and the
# float32 step count (4 B) = 2052 B; 3076 bytes per iteration in all.
OPTIMIZER_STATE = textwrap.dedent(
    """\
    import torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    for i in range(10):
        extra = torch.nn.Parameter(torch.zeros(256))
        opt.add_param_group({"params": [extra]})
        loss = net(x).pow(2).mean() + extra.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    """
)

# A clean loop whose iteration ends are noisy: random batch sizes, `out` kept with its graph
# across the step marker, and a bounded cache of tensors of random sizes. With LATE >= 0 a list
# leak (4000 bytes, line 17, before opt.step so in the iteration of step i) starts at i == LATE.
NOISY = textwrap.dedent(
    """\
    import random, sys, torch
    SEED = int(sys.argv[1])
    LATE = int(sys.argv[2])
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    CACHE = {}
    KEPT = []
    for i in range(30):
        b = rng.choice([4, 8, 16, 32, 48, 64])
        out = net(torch.randn(b, 64))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        if 0 <= LATE <= i:
            KEPT.append(torch.zeros(1000))
        opt.step()
        CACHE[i % 3] = torch.randn(rng.randint(1, 4000))
    """
)


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         name: str, source: str, *args: str) -> dict[str, Any]:
    """``torchmem run --json`` on ``source`` saved as ``name``, as a user runs it (its own
    process: the leak explanations search that script's heap, not the test session's); its JSON
    document. The current folder is ``tmp_path`` afterwards (the trace is ``t.tmtrace``)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(source)
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--json", "--no-host", "-o", "t.tmtrace", name,
         *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def _growing(data: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    return {(g["grouping"], g["name"]): (g["bytes_per_iteration"], g["start_step"])
            for g in data["growth"]["growing"]}


def _diffs(xs: list[int]) -> list[int]:
    return [b - a for a, b in zip(xs, xs[1:])]


def test_list_leak_flagged_at_its_call_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    data = _run(tmp_path, monkeypatch, capsys, "train.py", LIST_LEAK)
    g = data["growth"]
    assert data["leak_suspect"] is g["leak"] is True
    assert g["bytes_per_iteration"] == 4000 and g["start_step"] == 1
    # the device's iteration ends are the summary's iteration table, every step after 0 +4000
    full = [it for it in data["iterations"] if it["complete"]]
    assert g["end_bytes"] == [it["end_bytes"] for it in full]
    assert _diffs(g["end_bytes"]) == [4000] * 11
    sites = _growing(data)
    assert sites[("call_site", "train.py:11:<module>")] == (4000, 1)
    assert sites[("module", "(no module)")] == (4000, 1)
    assert set(sites) == {("call_site", "train.py:11:<module>"), ("module", "(no module)")}
    site = next(x for x in g["growing"] if x["grouping"] == "call_site")
    assert site["end_bytes"] == [4000 * k for k in range(12)]
    # what holds it: only storages of the growing call site are explained (not the gradients)
    assert [(p["nbytes"], p["step"], p["site"]) for p in data["leak_paths"]] == [
        (4000, 1, "train.py:11"), (4000, 2, "train.py:11"), (4000, 3, "train.py:11")]
    assert "train.py global KEPT (list) [0]" in data["leak_paths"][0]["paths"][0]


def test_cached_graph_flagged_with_its_sites_and_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = _run(tmp_path, monkeypatch, capsys, "train.py", CACHED_GRAPH)
    g = data["growth"]
    assert data["leak_suspect"] and g["bytes_per_iteration"] == 4096 + 2048 + 4
    assert set(_diffs(g["end_bytes"][1:])) == {6148}
    sites = _growing(data)
    assert sites[("call_site", "train.py:12:<module>")] == (16 * 64 * 4, 1)
    assert sites[("call_site", "train.py:13:<module>")] == (16 * 32 * 4 + 4, 1)
    assert sites[("module", "Sequential.0")] == (16 * 32 * 4, 1)
    assert sites[("module", "(no module)")] == (16 * 64 * 4 + 4, 1)


def test_growing_optimizer_state_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = _run(tmp_path, monkeypatch, capsys, "train.py", OPTIMIZER_STATE)
    g = data["growth"]
    assert data["leak_suspect"] and g["bytes_per_iteration"] == 1024 + 2 * 1024 + 4
    sites = _growing(data)
    assert sites[("call_site", "train.py:7:<module>")] == (1024, 1)
    assert sites[("call_site", "train.py:12:<module>")] == (2 * 1024 + 4, 1)
    assert sites[("module", "optimizer:Adam")] == (2 * 1024 + 4, 1)
    state = next(x for x in g["growing"] if x["name"] == "optimizer:Adam")
    assert set(_diffs(state["end_bytes"])) == {2052}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_clean_loop_not_flagged(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _run(tmp_path, monkeypatch, capsys, "train.py", NOISY, str(seed), "-1")
    g = data["growth"]
    ends = g["end_bytes"][g["warmup"] - 1:]
    # the loop is noisy: its ends move by kilobytes up and down, yet nothing is flagged
    assert max(ends) - min(ends) > 10_000
    assert any(d > 0 for d in _diffs(ends)) and any(d < 0 for d in _diffs(ends))
    assert data["leak_suspect"] is False and g["leak"] is False
    assert g["growing"] == [] and data["leak_paths"] == []


@pytest.mark.parametrize("seed", [0, 1])
def test_late_leak_flagged_from_where_it_starts(
        seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = _run(tmp_path, monkeypatch, capsys, "train.py", NOISY, str(seed), "10")
    g = data["growth"]
    assert data["leak_suspect"] is True
    site = next(x for x in g["growing"] if x["name"] == "train.py:17:<module>")
    assert (site["bytes_per_iteration"], site["start_step"]) == (4000, 10)
    assert site["end_bytes"] == [4000 * max(0, k - 9) for k in range(30)]
    # the device's own trend is noisier, but of the same size as the leak
    assert 2000 < g["bytes_per_iteration"] < 6000


def test_summary_command_prints_the_growing_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, monkeypatch, capsys, "train.py", LIST_LEAK)
    assert main(["summary", "t.tmtrace"]) == 0
    text = capsys.readouterr().out
    assert "Growing over iterations" in text
    row = next(line for line in text.splitlines() if "train.py:11:<module>" in line
               and line.startswith("call site"))
    # 4000 B per iteration from step 1, 11 iterations: 44000 B = 42.97 KiB; live at the end
    assert [c.strip() for c in row.split("│")[2:6]] == ["+3.91 KiB", "1", "+42.97 KiB",
                                                        "42.97 KiB"]
    assert ("Possible leak: live memory grows by 3.91 KiB per iteration from step 1 on"
            in " ".join(text.split()))
    assert "growing at train.py:11:<module> (+3.91 KiB per iteration from step 1)" in text
    assert main(["summary", "--json", "t.tmtrace"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["growth"] == growth(load_trace("t.tmtrace")).to_dict()


# --- the rule itself, on hand-made series ---------------------------------------------------


def test_rule_on_hand_series() -> None:
    steady = leak_trend([5000, 5008, 5016, 5024])
    assert (steady.leak, steady.bytes_per_iteration, steady.start, steady.noise) == (True, 8, 1, 0)
    late = leak_trend([100] * 10 + [100 + 50 * k for k in range(1, 11)], warmup=2)
    assert (late.leak, late.start, late.slope, late.growth_bytes) == (True, 10, 50.0, 500)
    # one outlier iteration moves neither the verdict nor the slope
    spiky = leak_trend([0, 10, 20, 30, 1000, 50, 60, 70, 80])
    assert spiky.leak and spiky.slope == 10.0
    # back to the start: no point lies below all later ones, nothing grows
    assert leak_trend([10, 20, 30, 10]).start == -1
    # the warm-up is not judged: a big first iteration and a flat rest is clean
    assert not leak_trend([0, 1 << 20, 1 << 20, 1 << 20, 1 << 20]).leak
    # a leak every third iteration (a periodic log) is a trend too; the rate is 4096 / 3
    periodic = leak_trend([4096 * (k // 3) for k in range(30)])
    assert periodic.leak and abs(periodic.slope - 4096 / 3) < 4096 / 3 * 0.1
    # at least two growing iterations after the warm-up
    assert not leak_trend([0, 8, 16], warmup=2).leak and leak_trend([0, 8, 16]).leak


def test_noisy_series_rarely_trip_and_real_trends_do() -> None:
    rng = random.Random(12)
    clean = [[10_000 + 512 * rng.randint(0, 8) for _ in range(20)] for _ in range(500)]
    assert sum(leak_trend(e).leak for e in clean) <= 5          # at most 1% (0 when measured)
    # the same noise with 1 KiB kept per iteration (a third of the noise's spread): flagged
    leaky = [[x + 1024 * k for k, x in enumerate(e)] for e in clean]
    assert sum(leak_trend(e).leak for e in leaky) >= 450


def test_bad_warmup_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="warmup must be at least 1 iteration.*got 0"):
        leak_trend([1, 2, 3], warmup=0)
    with pytest.raises(InvalidInputError, match="device 'cuda:3' is not in this trace; it has: cpu"):
        tr = Trace()
        tr.append(EventKind.ALLOC, 0, "cpu", 8, 1)
        growth(tr, "cuda:3")


def test_growth_equals_an_independent_count_per_group() -> None:
    """Per-group ends against a census recomputed from the events (a different code path)."""
    rng = random.Random(3)
    tr = Trace()
    alive: dict[int, tuple[int, str]] = {}
    sid = 0
    for step in range(15):
        for _ in range(20):
            if alive and rng.random() < 0.5:
                s = rng.choice(sorted(alive))
                tr.append(EventKind.FREE, step, "cpu", alive.pop(s)[0], s, step=step)
            else:
                sid += 1
                site = rng.choice(["a.py:1:f", "b.py:2:g"])
                alive[sid] = (rng.randint(1, 100), site)
                tr.append(EventKind.ALLOC, step, "cpu", alive[sid][0], sid, module="M",
                          stack=(site,), step=step)
        sid += 1  # and one storage of 40 bytes kept per step at c.py
        tr.append(EventKind.ALLOC, step, "cpu", 40, sid, stack=("c.py:3:h",), step=step)
        tr.append(EventKind.MARK, step, "cpu", 0, 0, op="step", step=step)
    r = growth(tr)
    census: dict[str, list[int]] = {"c.py:3:h": []}
    live: dict[int, tuple[int, str]] = {}
    for e in tr.events():
        if e.kind is EventKind.ALLOC:
            live[e.storage] = (e.nbytes, e.stack[-1])
        elif e.kind is EventKind.FREE:
            live.pop(e.storage)
        else:
            census["c.py:3:h"].append(sum(b for b, s in live.values() if s == "c.py:3:h"))
    kept = next(g for g in r.growing if g.name == "c.py:3:h")
    assert kept.end_bytes == census["c.py:3:h"] == [40 * (k + 1) for k in range(15)]
    assert kept.bytes_per_iteration == 40
    assert isinstance(summarize(tr).growth, GrowthReport)
    assert summarize(tr).to_dict()["growth"] == r.to_dict()
    html = summarize(tr)._repr_html_()
    assert "growing over iterations" in html and '<td>c.py:3:h</td><td class="num">40 B</td>' in html
