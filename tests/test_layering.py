"""The layering of ARCHITECTURE.md, checked three ways.

1. import-linter's contracts (pyproject.toml) run on the real package and hold; a package that
   breaks one makes the same linter fail (so the check can fail).
2. Importing the whole torch-free core in a fresh interpreter leaves ``torch`` out of
   ``sys.modules`` (catches imports that a static graph cannot see, e.g. through ``importlib``).
3. The source of the core names no torch import (a plain AST scan, independent of the linter).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "torchmem"
CORE = ("model", "io", "analysis", "render", "sim")
CORE_MODULES = ("units", "errors", "_device", "_lazy")


def _lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (bash scripts/test.sh installs it)")
    return subprocess.run(
        [exe, "--no-logo", "--no-cache"], cwd=cwd, capture_output=True, text=True, env=env,
        timeout=300,
    )


def _core_module_names() -> list[str]:
    names = [f"torchmem.{m}" for m in CORE_MODULES]
    for sub in CORE:
        for path in sorted((SRC / sub).rglob("*.py")):
            rel = path.relative_to(SRC.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


def test_import_linter_contracts_hold() -> None:
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # all six contracts were checked and kept
    assert proc.stdout.count(" KEPT") == 6, proc.stdout
    assert "Contracts: 6 kept, 0 broken." in proc.stdout


@pytest.mark.parametrize(
    ("where", "upward", "broken"),
    [
        # the package layers
        ("model/_bad.py", "torchmem.capture", "torchmem.model._bad -> torchmem.capture"),
        # torchmem.fit's rooms: the verdict (bottom) must not reach the search (above it)
        ("fit/verdict/_bad.py", "torchmem.fit.search._search",
         "torchmem.fit.verdict._bad -> torchmem.fit.search._search"),
        # inside the fake GPU: CUDA's kernels must not reach the dispatch mode above them
        ("fit/fakegpu/kernels/_bad.py", "torchmem.fit.fakegpu._dispatch",
         "torchmem.fit.fakegpu.kernels._bad -> torchmem.fit.fakegpu._dispatch"),
    ],
)
def test_import_linter_fails_on_a_layer_violation(
    tmp_path: Path, where: str, upward: str, broken: str
) -> None:
    """The same contracts, on a copy of the package with one upward import added, must fail."""
    pkg = tmp_path / "src"
    shutil.copytree(SRC, pkg / "torchmem", ignore=shutil.ignore_patterns("__pycache__"))
    bad = pkg / "torchmem" / where
    bad.write_text(f"import {upward}\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    proc = _lint_imports(tmp_path, env)
    assert proc.returncode != 0
    assert broken in proc.stdout, proc.stdout


def test_no_module_over_800_lines_without_a_reason_at_its_top() -> None:
    """ARCHITECTURE.md: a module over 800 lines says why in its docstring ("Over 800 lines:")."""
    long = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines > 800:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            long[str(path.relative_to(SRC))] = "Over 800 lines:" in doc
    assert "sim/allocator.py" in long  # the scan sees a long module (946 lines) ...
    assert [m for m, ok in long.items() if not ok] == []  # ... and each says why


def test_core_imports_without_torch() -> None:
    names = _core_module_names()
    assert len(names) >= 12
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {names!r}:
            importlib.import_module(name)
        bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        producers = sorted(
            m for m in sys.modules
            if m.split(".")[:2] in (["torchmem", p] for p in
            ("capture", "ledger", "move", "transfer", "devices", "compat", "cli"))
        )
        print(len(bad), len(producers))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_source_names_no_torch_import() -> None:
    offenders = {}
    checked = 0
    paths = [p for sub in CORE for p in (SRC / sub).rglob("*.py")]
    paths += [SRC / f"{m}.py" for m in CORE_MODULES]
    for path in paths:
        checked += 1
        bad = sorted(n for n in _imports(path) if n == "torch" or n.startswith("torch."))
        if bad:
            offenders[str(path.relative_to(SRC))] = bad
    assert checked >= 14
    assert offenders == {}


def test_the_checker_sees_a_torch_import(tmp_path: Path) -> None:
    p = tmp_path / "x.py"
    p.write_text("import os\nfrom torch.utils import weak\n")
    assert "torch.utils" in _imports(p)


def test_a_producer_module_loads_only_what_it_imports() -> None:
    """``torchmem.capture`` exports lazily: the ledger, move and transfer import
    ``capture.storage`` and must not pay for the tracker, the recorder or the census."""
    code = (
        "import sys, torchmem.capture.storage, torchmem.ledger\n"
        "heavy = ('tracker', 'recording', 'census', 'lite')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:3] in "
        "[['torchmem', 'capture', h] for h in heavy]))\n"
        "from torchmem.capture import track\n"
        "print('torchmem.capture.tracker' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "True"]
