"""`torchmem inspect`: examples, object specs, formats, filters and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchmem.capture.census import inspect_memory
from torchmem.cli import main
from torchmem.cli._objects import classify, load_object
from torchmem.errors import ObjectLoadError
from torchmem.examples import build_example


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_example_json_matches_library(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--no-step")
    truth = inspect_memory(build_example("tied-lm"))
    assert data["unique_bytes"] == truth.unique_bytes
    assert data["storage_bytes"] == truth.storage_bytes
    assert sorted(map(sorted, data["sharing_groups"])) == sorted(map(sorted, truth.sharing_groups))


def test_default_runs_a_training_step(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--example", "mlp")
    cats = data["by_category"]["cpu"]
    params = 8 * (256 * 256 + 256) * 4
    assert cats["parameter"] == params and cats["gradient"] == params
    assert cats["optimizer_state"] == 2 * params + 8 * 2 * 4  # exp_avg, exp_avg_sq, 16 steps


def test_file_factory_spec_with_module_and_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "mymodel.py"
    f.write_text(textwrap.dedent("""
        import torch
        def make():
            m = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
            m[1].weight = m[0].weight
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            m(torch.ones(1, 10)).sum().backward()
            opt.step()
            return m, opt
    """))
    data = run_json(capsys, f"{f}:make")
    assert data["by_category"] == {"cpu": {"parameter": 480, "gradient": 480, "optimizer_state": 480}}
    names = {t["name"] for t in data["tensors"]}
    assert "state[0.weight].momentum_buffer" in names
    assert ["0.weight", "1.weight"] in data["sharing_groups"]


def test_package_attr_spec_and_tensor_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "torchmem.examples:TiedLM")
    assert data["unique_bytes"] == inspect_memory(build_example("tied-lm")).unique_bytes
    f = tmp_path / "tensors.py"
    f.write_text("import torch\nbig = torch.zeros(100, dtype=torch.float64)\nview = big[10:20]\n")
    data = run_json(capsys, f"{f}:view")
    assert data["unique_bytes"] == {"cpu": 80} and data["storage_bytes"] == {"cpu": 800}


def test_plain_and_rich_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--no-step", "--format", "plain", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "embed.weight (= head.weight)" in out and "pos, pos_slice" in out
    assert main(["inspect", "--example", "transformer", "--format", "rich"]) == 0
    out = capsys.readouterr().out
    assert "encoder.layers.0.linear1.weight" in out


def test_device_filter_and_live(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--no-step", "--device", "meta")
    assert data["unique_bytes"] == {} and data["tensors"] == []
    keep = torch.zeros(98765, dtype=torch.uint8)
    data = run_json(capsys, "--no-step", "--live")
    assert any(t["nbytes"] == 98765 for t in data["tensors"])
    assert any(t["name"] == "embed.weight" for t in data["tensors"])
    del keep


def test_list_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--list-examples"]) == 0
    out = capsys.readouterr().out
    assert out.split()[0] == "mlp" and "tied-lm" in out


@pytest.mark.parametrize("args,message", [
    (["nope_pkg_xyz:thing"], "cannot import module 'nope_pkg_xyz'"),
    (["no/such/file.py:f"], "does not exist"),
    (["torchmem.examples:nothing_here"], "has no attribute 'nothing_here'"),
    (["torchmem.examples"], "expected an object spec"),
    (["torchmem.examples:list_examples"], "expected a torch.nn.Module"),
    (["--example", "resnet"], "unknown example 'resnet'"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--top", "-3"], "--top expects"),
])
def test_errors_exit_2_without_traceback(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_factory_that_raises_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "broken.py"
    f.write_text("def make():\n    raise ValueError('boom')\n")
    assert main(["inspect", f"{f}:make"]) == 2
    assert "ValueError: boom" in capsys.readouterr().err


def test_loader_and_classify_directly(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import torch\nclass Thing:\n    pass\nthing = Thing()\nneeds_arg = lambda x: x\n")
    with pytest.raises(ObjectLoadError, match="expected a torch.nn.Module"):
        classify(load_object(f"{f}:thing"))
    with pytest.raises(ObjectLoadError, match="no arguments"):
        load_object(f"{f}:needs_arg")
    t = classify({"a": torch.zeros(1)})
    assert t.tensors is not None and list(t.tensors) == ["a"]


def test_python_dash_m_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "torchmem", "inspect", "--example", "mlp", "--no-step", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["unique_bytes"] == {"cpu": 8 * (256 * 256 + 256) * 4}
