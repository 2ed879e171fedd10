"""DESIGN.md layering: model/ and report/ never import torch (checked on the source, not by hope)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "torchmem"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_model_and_report_do_not_import_torch() -> None:
    offenders = {}
    checked = 0
    for sub in ("model", "report"):
        for path in (SRC / sub).rglob("*.py"):
            checked += 1
            bad = sorted(n for n in _imports(path) if n == "torch" or n.startswith("torch."))
            if bad:
                offenders[str(path.relative_to(SRC))] = bad
    assert checked >= 2
    assert offenders == {}


def test_the_checker_sees_a_torch_import(tmp_path: Path) -> None:
    p = tmp_path / "x.py"
    p.write_text("import os\nfrom torch.utils import weak\n")
    assert "torch.utils" in _imports(p)
