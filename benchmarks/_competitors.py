"""Load the tools users would otherwise pick, or say cleanly why one is missing.

torchlinops 0.8.3: its package imports optional dependencies (tqdm, ...), so we load only
``torchlinops/utils/_device.py`` by file path; it needs nothing but torch.
"""

from __future__ import annotations

import importlib.util
import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import ModuleType

TORCHLINOPS_HINT = "pip install --no-deps torch-named-linops==0.8.3"
MEMLAB_HINT = "pip install pytorch_memlab"


def torchlinops_device() -> tuple[ModuleType | None, str]:
    """(module, '') or (None, reason)."""
    spec = importlib.util.find_spec("torchlinops")
    if spec is None or not spec.submodule_search_locations:
        return None, f"torchlinops not installed ({TORCHLINOPS_HINT})"
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "_device.py"
    if not path.is_file():
        return None, f"torchlinops found but {path} is missing"
    s = importlib.util.spec_from_file_location("_torchlinops_device", path)
    if s is None or s.loader is None:
        return None, f"cannot load {path}"
    mod = importlib.util.module_from_spec(s)
    try:
        s.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        return None, f"loading {path} failed: {type(e).__name__}: {e}"
    version = ""
    try:
        from importlib.metadata import version as _v

        version = _v("torch-named-linops")
    except Exception:  # noqa: BLE001
        pass
    if version and version != "0.8.3":
        return None, f"torch-named-linops {version} installed; the benchmark compares 0.8.3 ({TORCHLINOPS_HINT})"
    return mod, ""


def memlab() -> tuple[type | None, str]:
    """(pytorch_memlab.MemReporter, '') or (None, reason)."""
    if importlib.util.find_spec("pytorch_memlab") is None:
        return None, f"pytorch_memlab not installed ({MEMLAB_HINT})"
    try:
        buf = io.StringIO()
        with redirect_stdout(buf), redirect_stderr(buf):  # it prints a CUDA notice on import
            from pytorch_memlab import MemReporter
    except Exception as e:  # noqa: BLE001
        return None, f"pytorch_memlab does not import here: {type(e).__name__}: {e}"
    return MemReporter, ""
