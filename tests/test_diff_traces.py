"""`torchmem diff` of two real tracker runs (and of snapshots), against ground truth computed
another way: parameter, gradient and Adam-state bytes from the model's shapes, and a plain
replay of each run's events written here (not torchmem's)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchmem
from torchmem.analysis import TraceDiff, diff
from torchmem.cli import main
from torchmem.errors import InvalidInputError
from torchmem.model.events import EventKind

# one worker runs this file (bash scripts/test.sh: pytest -n auto --dist loadgroup): its module
# fixtures and caches are built once, not once per worker
pytestmark = pytest.mark.xdist_group("diff_traces")

DATA = Path(__file__).resolve().parent / "data"
SMALL, LARGE = 64, 512  # hidden widths of the two runs
STEPS = 3


def _param_bytes(width: int) -> int:
    # Linear(32, w) + Linear(w, 4), float32: weights and biases
    return 4 * (32 * width + width + width * 4 + 4)


def _train(width: int, path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torchmem.track(model, opt, stacks=True) as tr:
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
    tr.save(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("runs")
    a, b = d / "small.tmtrace", d / "large.tmtrace"
    _train(SMALL, a)
    _train(LARGE, b)
    return a, b


def _replay(path: Path, step: int | None = None, end: bool = False) -> dict[str, Any]:
    """Live bytes by category at the run's peak (first maximum), at the peak of iteration
    ``step``, or at the end: a plain forward replay of the events."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_cats: dict[str, int] = {}
    for e in torchmem.load_trace(path).events():
        if e.kind is EventKind.ALLOC:
            live[e.storage] = (e.nbytes, e.category.label)
            total += e.nbytes
        elif e.kind is EventKind.FREE:
            live.pop(e.storage, None)
            total -= e.nbytes
        else:
            continue
        if (step is None or e.step == step) and total > best and not end:
            best = total
            best_cats = {}
            for n, c in live.values():
                best_cats[c] = best_cats.get(c, 0) + n
    if end:
        best = total
        for n, c in live.values():
            best_cats[c] = best_cats.get(c, 0) + n
    return {"bytes": best, "categories": best_cats}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_peak_by_category_matches_the_model_and_an_independent_replay(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    code, out, err = _cli(capsys, "diff", str(a), str(b), "--json", "--top", "0")
    assert code == 0, err
    d = json.loads(out)
    assert (d["kind"], d["at"], d["device_before"], d["device_after"]) == ("trace", "peak", "cpu", "cpu")
    ra, rb = _replay(a), _replay(b)
    assert (d["live_bytes_before"], d["live_bytes_after"]) == (ra["bytes"], rb["bytes"])
    assert d["live_bytes_delta"] == rb["bytes"] - ra["bytes"] > 0
    cats = {g["name"]: g for g in d["groups"]["category"]}
    assert {k: v["before_bytes"] for k, v in cats.items() if v["before_bytes"]} == ra["categories"]
    assert {k: v["after_bytes"] for k, v in cats.items() if v["after_bytes"]} == rb["categories"]
    # hand-computed from the shapes: the peak is in Adam's first step, with every parameter,
    # its gradient and its state (exp_avg, exp_avg_sq and a 4-byte float32 step) alive
    for width, side in ((SMALL, "before"), (LARGE, "after")):
        p = _param_bytes(width)
        assert cats["parameter"][f"{side}_bytes"] == p
        assert cats["gradient"][f"{side}_bytes"] == p
        assert cats["optimizer_state"][f"{side}_bytes"] == 2 * p + 4 * 4
    assert cats["parameter"]["delta_bytes"] == _param_bytes(LARGE) - _param_bytes(SMALL)
    # every grouping adds up to the same live bytes, and rows are sorted by the size of the change
    for name, rows in d["groups"].items():
        assert sum(r["before_bytes"] for r in rows) == ra["bytes"], name
        assert sum(r["after_bytes"] for r in rows) == rb["bytes"], name
        deltas = [abs(r["delta_bytes"]) for r in rows]
        assert deltas == sorted(deltas, reverse=True), name
        assert all(r["delta_bytes"] == r["after_bytes"] - r["before_bytes"] for r in rows)
    assert {r["name"] for r in d["groups"]["module"]} >= {"Sequential.0", "Sequential.2"}
    assert any(r["name"].startswith("aten::") for r in d["groups"]["operator"])
    assert any("test_diff_traces.py" in r["name"] for r in d["groups"]["call_site"])


def test_per_iteration_peaks_and_the_other_points(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    code, out, _ = _cli(capsys, "diff", str(a), str(b), "--json")
    its = [it for it in json.loads(out)["iterations"] if it["complete"]]
    assert [it["step"] for it in its] == list(range(STEPS))
    for it in its:
        assert it["peak_bytes_before"] == _replay(a, step=it["step"])["bytes"]
        assert it["peak_bytes_after"] == _replay(b, step=it["step"])["bytes"]
        assert it["peak_bytes_delta"] == it["peak_bytes_after"] - it["peak_bytes_before"]
    # at the end: parameters, gradients and Adam's state of each run
    code, out, _ = _cli(capsys, "diff", str(a), str(b), "--json", "--at", "end")
    d = json.loads(out)
    assert d["at"] == "end"
    assert (d["live_bytes_before"], d["live_bytes_after"]) == (_replay(a, end=True)["bytes"],
                                                               _replay(b, end=True)["bytes"])
    cats = {g["name"]: g["after_bytes"] for g in d["groups"]["category"]}
    assert cats["optimizer_state"] == 2 * _param_bytes(LARGE) + 16
    # --at step N: the peak inside iteration N
    code, out, _ = _cli(capsys, "diff", str(a), str(b), "--json", "--at", "step", "2")
    d = json.loads(out)
    assert d["at"] == "step 2"
    assert d["live_bytes_after"] == _replay(b, step=2)["bytes"]
    code, _, err = _cli(capsys, "diff", str(a), str(b), "--at", "step", "9")
    assert code == 2 and "step 9 is not in the first trace on cpu" in err and "0, 1, 2" in err


def test_text_shows_signed_changes_largest_first(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    code, out, _ = _cli(capsys, "diff", str(a), str(b))
    assert code == 0
    ra, rb = _replay(a), _replay(b)
    fmt = torchmem.units.format_bytes
    assert out.splitlines()[0].startswith(
        f"live at the peak on cpu: {fmt(ra['bytes'])} -> {fmt(rb['bytes'])} "
        f"(+{fmt(rb['bytes'] - ra['bytes'])})")
    for title in ("by category", "by module", "by operator", "by call site", "per iteration"):
        assert title in out
    block = out.split("by category")[1].split("\n\n")[0].splitlines()[2:]
    changes = [ln.split()[0] for ln in block]
    assert all(c.startswith("+") for c in changes)
    p = _param_bytes(LARGE) - _param_bytes(SMALL)
    assert any(ln.lstrip().startswith("+" + fmt(2 * p) + " ") and ln.endswith("optimizer_state")
               for ln in block)
    # the same run against itself: nothing changed
    code, out, _ = _cli(capsys, "diff", str(a), str(a))
    assert "(0 B)" in out.splitlines()[0] and "no differences in what was live at the peak" in out


def test_library_diff_takes_traces_or_snapshots_and_refuses_a_mix(runs: tuple[Path, Path]) -> None:
    a, b = (torchmem.load_trace(p) for p in runs)
    d = diff(a, b)
    assert isinstance(d, TraceDiff) and d.after_bytes == _replay(runs[1])["bytes"]
    with pytest.raises(InvalidInputError, match="two traces or two snapshots"):
        diff(a, torchmem.load_snapshot(runs[1]))
    with pytest.raises(InvalidInputError, match="'peak', 'end' or 'step N'"):
        diff(a, b, at="middle")


def _raw_peak(name: str) -> int:
    with open(DATA / name, "rb") as f:
        raw = pickle.load(f)
    cur = best = 0
    for e in raw["device_traces"][0]:
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        best = max(best, cur)
    return best


def test_snapshots_compare_at_the_peak_by_default(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    dec = str(DATA / "DeComFL__memory.pickle")
    # a tracker run against a real CUDA snapshot: both read as snapshots, compared at the peak
    code, out, err = _cli(capsys, "diff", str(runs[0]), dec, "--json", "--top", "0")
    assert code == 0, err
    d = json.loads(out)
    assert d["kind"] == "snapshot" and d["at"] == "peak"
    t = d["totals"]["0"]
    assert t["peak_bytes_after"] == _raw_peak("DeComFL__memory.pickle")
    assert t["peak_bytes_before"] == _replay(runs[0])["bytes"]
    assert sum(r["after_bytes"] for r in d["rows"]) == t["peak_bytes_after"]
    assert sum(r["delta_bytes"] for r in d["rows"]) == t["peak_bytes_delta"]
    code, _, err = _cli(capsys, "diff", dec, dec, "--at", "step", "1")
    assert code == 2 and "two torchmem traces" in err


def test_at_may_come_before_or_between_the_files(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = map(str, runs)
    outs = []
    for argv in (["diff", a, b, "--at", "step", "1", "--json"],
                 ["diff", "--at", "step", "1", a, b, "--json"],
                 ["diff", a, "--at", "step", "1", b, "--json"]):
        code, out, err = _cli(capsys, *argv)
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[0] == outs[1] == outs[2] and outs[0]["at"] == "step 1"
    assert (outs[0]["before"], outs[0]["after"]) == (a, b)
    code, _, err = _cli(capsys, "diff", a)
    assert code == 2 and "expected two files to compare" in err
