"""torchlinops-compatible API. torchlinops 0.8.3's own functions are the ground truth: they are
loaded by file path (torchlinops/utils/_device.py) from the folder scripts/test.sh installs it into
(.cache/linops, kept out of the Python environment so that `pip check` passes), or from an
installed torchlinops."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchmem
from torchmem.compat.torchlinops import (
    MemReporter,
    cdata,
    device_ordinal,
    get_device,
    tensor_memory_span,
)
from torchmem.errors import DeviceError, InvalidInputError
from torchmem.units import GB, GiB

#: Where scripts/test.sh installs torch-named-linops (pip --target), outside the environment.
LINOPS_DIR = Path(__file__).resolve().parents[1] / ".cache" / "linops"


def torchlinops_device_file() -> Path | None:
    """torchlinops/utils/_device.py: from LINOPS_DIR first, else from an installed torchlinops."""
    local = LINOPS_DIR / "torchlinops" / "utils" / "_device.py"
    if local.is_file():
        return local
    spec = importlib.util.find_spec("torchlinops")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "_device.py"
    return path if path.is_file() else None


def load_torchlinops_device() -> ModuleType | None:
    path = torchlinops_device_file()
    if path is None:
        return None
    s = importlib.util.spec_from_file_location("_tl_device_for_tests", path)
    assert s is not None and s.loader is not None
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


TL = load_torchlinops_device()
needs_tl = pytest.mark.skipif(
    TL is None,
    reason="torchlinops 0.8.3 not found: 'bash scripts/test.sh' installs it into .cache/linops "
           "(pip install --no-deps --target .cache/linops torch-named-linops==0.8.3)",
)


def test_test_script_installs_torchlinops_outside_the_environment() -> None:
    # Regression: scripts/test.sh ran `pip install --no-deps torch-named-linops` into the user's
    # environment, so `pip check` failed ever after (its requirements were never installed).
    script = (Path(__file__).resolve().parents[1] / "scripts" / "test.sh").read_text()
    commands = script.replace("\\\n", " ").splitlines()
    installs = [c for c in commands if "pip install" in c and "torch-named-linops" in c]
    assert installs, "scripts/test.sh no longer installs the torchlinops ground truth"
    for c in installs:
        assert '--target "$LINOPS_DIR"' in c, c
    assert 'LINOPS_DIR=".cache/linops"' in script
    assert ".cache/" in (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()


def test_torchlinops_ground_truth_is_loaded_from_its_own_folder() -> None:
    if not (LINOPS_DIR / "torchlinops").is_dir():
        pytest.skip("run 'bash scripts/test.sh' (it installs torchlinops into .cache/linops)")
    assert TL is not None
    assert Path(TL.__file__) == LINOPS_DIR / "torchlinops" / "utils" / "_device.py"


def brute_span(t: torch.Tensor) -> tuple[int, int]:
    offs = [t.storage_offset() + sum(i * s for i, s in zip(idx, t.stride()))
            for idx in __import__("itertools").product(*(range(n) for n in t.shape))]
    return min(offs), max(offs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=4), st.data())
def test_tensor_memory_span_matches_brute_force_and_torchlinops(sizes: list[int], data: st.DataObject) -> None:
    strides = data.draw(st.lists(st.integers(0, 6), min_size=len(sizes), max_size=len(sizes)))
    offset = data.draw(st.integers(0, 5))
    reach = sum((n - 1) * s for n, s in zip(sizes, strides))
    t = torch.zeros(offset + reach + 1).as_strided(sizes, strides, offset)
    assert tensor_memory_span(t) == brute_span(t)
    if TL is not None:
        assert tensor_memory_span(t) == tuple(TL.tensor_memory_span(t))


def test_tensor_memory_span_examples_and_empty() -> None:
    x = torch.zeros(3, 4, dtype=torch.float64)
    assert tensor_memory_span(x) == (0, 11)
    assert tensor_memory_span(x[1:, 2]) == (6, 10)
    assert tensor_memory_span(x[0].expand(5, 4)) == (0, 3)
    assert tensor_memory_span(x[2:2]) == (8, 7)  # empty: an empty inclusive range


def test_cdata_matches_storage_cdata() -> None:
    a = torch.zeros(5)
    assert cdata(a) == a.untyped_storage()._cdata == cdata(a[2:].view(3, 1))
    assert cdata(a) != cdata(a.clone())
    if TL is not None:
        assert cdata(a.t()) == TL.cdata(a.t())


def test_get_device_and_device_ordinal() -> None:
    assert get_device() == torch.device("cpu") == get_device(-1)
    assert get_device(2) == torch.device("cuda", 2)
    assert device_ordinal("cpu") == -1
    assert device_ordinal(torch.device("meta")) == -1
    if TL is not None:
        assert TL.get_device(3) == get_device(3)
        assert TL.device_ordinal(torch.device("cpu")) == device_ordinal(torch.device("cpu"))
        assert TL.device_ordinal(torch.device("meta")) == device_ordinal("meta")
    with pytest.raises(InvalidInputError):
        get_device("0")  # type: ignore[arg-type]
    with pytest.raises(DeviceError):
        device_ordinal("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="not available"):
            device_ordinal("cuda:0")


@pytest.mark.cuda
def test_device_ordinal_cuda_matches_allocation() -> None:
    assert device_ordinal("cuda:0") == torch.zeros(1, device="cuda:0").get_device() == 0


@needs_tl
def test_same_storage_agrees_with_torchlinops_where_documented() -> None:
    assert TL is not None
    x = torch.arange(20.0)
    for a, b in [(x, x[3:7]), (x, x[::2]), (x[:10], x[2:5]), (x, x.clone()), (x, torch.ones(3))]:
        assert torchmem.same_storage(a, b) == TL.same_storage(a, b)
    # documented difference: disjoint parts of one storage
    assert torchmem.same_storage(x[:5], x[5:]) and not TL.same_storage(x[:5], x[5:])
    assert not torchmem.capture.overlaps(x[:5], x[5:])


def test_memreporter_units_and_dedup() -> None:
    emb = torch.nn.Embedding(1000, 250)  # 1,000,000 bytes
    head = torch.nn.Linear(250, 1000, bias=False)
    head.weight = emb.weight
    m = torch.nn.Sequential(emb, head)
    m.register_buffer("view", emb.weight.detach()[:10])
    out = io.StringIO()
    rep = MemReporter(format_mode="GB").report(m, file=out)
    assert rep.unique_bytes == {"cpu": 1_000_000}
    lines = out.getvalue().splitlines()
    assert lines[0] == "Device cpu" and lines[1] == "=" * 20
    assert lines[-1] == "Total: 1.00 MB"  # base 1000
    out = io.StringIO()
    MemReporter(format_mode="GiB").report(m, file=out)
    assert out.getvalue().splitlines()[-1] == f"Total: {1_000_000 / 1024:.2f} KiB"  # base 1024
    assert GB == 1000**3 and GiB == 1024**3
    with pytest.raises(InvalidInputError, match="format_mode"):
        MemReporter(format_mode="MB")


@needs_tl
def test_memreporter_total_equals_torchlinops_without_sharing(capsys: pytest.CaptureFixture[str]) -> None:
    assert TL is not None
    m = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    TL.MemReporter(format_mode="GiB").report(module=m)
    theirs = capsys.readouterr().out.splitlines()[-1]
    out = io.StringIO()
    MemReporter(format_mode="GiB").report(m, file=out)
    ours = out.getvalue().splitlines()[-1]
    num = re.compile(r"Total: ([0-9.]+)")
    assert num.match(theirs) and num.match(ours)
    assert num.match(theirs).group(1) == num.match(ours).group(1)  # type: ignore[union-attr]


def test_memreporter_live_mode_returns_report() -> None:
    keep = torch.zeros(54321, dtype=torch.uint8)
    out = io.StringIO()
    rep = MemReporter().report(file=out)
    assert any(t.nbytes == 54321 for t in rep.tensors)
    assert "Device cpu" in out.getvalue()
    del keep


def test_memreporter_prints_each_device_rows_from_its_tensors() -> None:
    # rows and totals per device, printed from the census's columns, against the parameters
    m = torch.nn.Module()
    m.a = torch.nn.Linear(3, 2)  # cpu: weight 24 B, bias 8 B
    m.b = torch.nn.Linear(5, 4, device="meta")  # meta: weight 80 B, bias 16 B
    m.register_buffer("w_view", m.a.weight.detach()[0])  # a view: printed, not counted again
    out = io.StringIO()
    rep = MemReporter(format_mode="GB").report(m, file=out)
    expect: list[str] = []
    for dev in ("cpu", "meta"):
        expect += [f"Device {dev}", "=" * 20]
        total = 0
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.device.type == dev:
                expect.append(f"{name}\t{tuple(t.shape)}\t\t{t.numel() * t.element_size()} B")
                total += 0 if name == "w_view" else t.numel() * t.element_size()
        expect.append(f"Total: {total} B")
    assert out.getvalue().splitlines() == expect
    assert rep.unique_bytes == {"cpu": 32, "meta": 96}
