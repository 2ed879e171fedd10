"""``torchmem estimate``: output, JSON keys, exit codes, progress, and clear errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from torchmem.cli import main

MiB = 1 << 20

TRAIN = textwrap.dedent("""
    import torch
    def build(batch):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        net = torch.nn.Linear(256, 256).to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(batch, 256, device=dev)
        def step():
            net(x).sum().backward(); opt.step(); opt.zero_grad()
        return step
    def rows(batch):
        x = torch.zeros(batch, 1 << 18, device="cuda")
        return lambda: x * 2
    def broken(batch):
        x = torch.randn(batch)
        if x.sum() > 0:
            pass
        return lambda: None
    def nothing(batch):
        return None
""")


@pytest.fixture()
def train(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(TRAIN)
    return p


def test_json_keys_in_order(train, capsys):
    assert main(["estimate", f"{train}:build", "--gpu", "T4", "--batch-size", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert list(d)[:8] == ["fits", "peak_requested_bytes", "peak_allocated_bytes",
                           "peak_reserved_bytes", "capacity_bytes", "overhead_bytes",
                           "by_category", "oom"]
    assert "max_batch_size" not in d
    assert d["fits"] is True and d["oom"] is None
    assert d["by_category"]["parameter"] == (256 * 256 + 256) * 4
    assert d["capacity_bytes"] == round(14.75 * (1 << 30))


def test_text_report(train, capsys):
    assert main(["estimate", f"{train}:build", "--gpu", "RTX-3090", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "RTX-3090, batch 4: FITS" in out and "CUDA context" in out
    assert "cuBLAS workspaces" in out and "parameter" in out


def test_does_not_fit_exits_3_and_names_the_op(train, capsys):
    # 1 GiB less a 530 MiB Hopper context leaves 494 MiB: x (300 MiB) fits, x * 2 does not
    code = main(["estimate", f"{train}:rows", "--gpu", "1 GiB", "--batch-size", "300", "--json"])
    assert code == 3
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["oom"]["op"] == "aten::mul"
    assert d["oom"]["stack"][-1].startswith(f"{train}:13:")


def test_max_batch_size_progress_on_stderr(train, capsys):
    # "2 GiB" GPU with a Hopper context (530 MiB): 2 * ceil2(b) MiB <= 1518 MiB -> 758 (no margin)
    assert main(["estimate", f"{train}:rows", "--gpu", "2 GiB", "--max-batch-size", "--steps",
                 "1", "--json", "--margin", "0"]) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    assert d["max_batch_size"] == 758
    assert "batch 512: fits" in cap.err and "batch 1024: does not fit" in cap.err


def test_module_spec(capsys):
    code = main(["estimate", "torchmem._example_train:build_for_estimate", "--gpu", "T4"])
    err = capsys.readouterr().err
    assert code == 2 and "has no attribute" in err


@pytest.mark.parametrize("args,needle", [
    (["{train}:broken", "--strict-values"], "raised DataDependentOutputException at {train}:16"),
    (["{train}:nothing"], "returned NoneType, expected a zero-argument step()"),
    (["{train}:build", "--gpu", "H9000"], "unknown GPU 'H9000'; expected one of: A100-40GB"),
    (["{train}:build", "--steps", "0"], "--steps must be >= 1"),
    (["{train}:missing"], "has no attribute 'missing'"),
    (["nope.py:build"], "does not exist"),
    ([], "expected a build function"),
])
def test_bad_input_is_a_clear_error(train, capsys, args, needle):
    code = main(["estimate", *[a.format(train=train) for a in args]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle.format(train=train) in err and "Traceback" not in err


def test_nothing_written_on_failure(train, tmp_path, capsys):
    out = tmp_path / "estimate.pickle"
    code = main(["estimate", f"{train}:broken", "--strict-values", "-o", str(out)])
    assert code == 2 and not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_output_folder_must_exist(train, tmp_path, capsys):
    code = main(["estimate", f"{train}:build", "-o", str(tmp_path / "no" / "x.pickle")])
    assert code == 2 and "cannot be written" in capsys.readouterr().err


def test_list_gpus(capsys):
    assert main(["estimate", "--list-gpus"]) == 0
    out = capsys.readouterr().out
    assert "H100-80GB" in out and "source:" in out


def test_output_snapshot(train, tmp_path, capsys):
    out = tmp_path / "estimate.pickle"
    assert main(["estimate", f"{train}:build", "--gpu", "T4", "--batch-size", "8",
                 "--alloc-conf", "expandable_segments:True", "-o", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    from torchmem.analysis import peak
    from torchmem.io import load_snapshot

    snap = load_snapshot(out)
    assert snap.allocator_settings["expandable_segments"] is True
    # the file's trace (requested sizes) peaks at the storages plus the two cuBLAS workspaces
    assert peak(snap).devices[0].peak_allocated_bytes == (
        d["peak_requested_bytes"] + d["workspace_bytes"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["estimate.pickle", "train.py"]


def test_bad_alloc_conf_names_the_option(train, tmp_path, capsys):
    out = tmp_path / "x.pickle"
    code = main(["estimate", f"{train}:build", "--alloc-conf", "bogus:1", "-o", str(out)])
    assert code == 2 and "'bogus'" in capsys.readouterr().err and not out.exists()


def test_module_build_spec(tmp_path, monkeypatch, capsys):
    (tmp_path / "fit_cli_train_mod.py").write_text(TRAIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "fit_cli_train_mod:build", "--gpu", "L4", "--batch-size", "2",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["by_category"]["parameter"] == (256 * 256 + 256) * 4


def test_output_snapshot_when_it_does_not_fit(train, tmp_path, capsys):
    out = tmp_path / "oom.pickle"
    code = main(["estimate", f"{train}:rows", "--gpu", "1 GiB", "--batch-size", "300",
                 "-o", str(out)])
    assert code == 3 and "DOES NOT FIT" in capsys.readouterr().out
    from torchmem.io import load_snapshot

    actions = [e.action for e in load_snapshot(out).trace(0)]
    assert actions[-1] == "oom" and actions.count("alloc") == 1   # x fit; x * 2 did not
