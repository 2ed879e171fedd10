"""Build (once) and load the fast tracker's native part with PyTorch's C++ extension builder.

The source ``_native.cpp`` ships with torchmem; :func:`load_native` compiles it with
``torch.utils.cpp_extension.load`` the first time it is needed for this torch version (about a
minute; PyTorch caches the build under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and imports it afterwards in milliseconds. Building needs a C++
compiler and ninja (``pip install ninja``); without them :func:`load_native` raises
:class:`FastModeUnavailable` saying so.

Example:
    >>> from torchmem.capture.fast._build import native_available
    >>> isinstance(native_available(), bool)
    True
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from torchmem.errors import InvalidInputError

__all__ = ["FastModeUnavailable", "load_native", "native_available"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native.cpp")
_loaded: Any = None
_failure: str | None = None


class FastModeUnavailable(InvalidInputError):
    """``mode="fast"`` cannot run here (its native part could not be built or loaded).

    Example:
        >>> issubclass(FastModeUnavailable, InvalidInputError)
        True
    """


def _missing_tools() -> list[str]:
    missing = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        missing.append("a C++ compiler (g++ or clang++; e.g. apt-get install g++)")
    try:
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            missing.append("ninja (pip install ninja)")
    except ImportError:  # pragma: no cover - every supported torch has it
        missing.append("torch.utils.cpp_extension")
    return missing


def load_native(quiet: bool = False) -> Any:
    """The compiled native module (built on first use); raises :class:`FastModeUnavailable`.

    Example:
        >>> from torchmem.capture.fast._build import load_native, native_available
        >>> native_available() and hasattr(load_native(), "convert") or not native_available()
        True
    """
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise FastModeUnavailable(_failure)
    missing = _missing_tools()
    if missing:
        _failure = (
            "mode='fast' builds a small C++ part once per torch version and needs "
            f"{' and '.join(missing)}; install them, or use mode='ops' (the dispatch tracker, "
            "no build needed)"
        )
        raise FastModeUnavailable(_failure)
    from torch.utils.cpp_extension import load

    if not quiet:
        print("torchmem: loading the fast tracker's native part (built once per torch version, "
              "about a minute the first time)...", file=sys.stderr, flush=True)
    try:
        _loaded = load(name="torchmem_fast_native", sources=[_SOURCE], extra_cflags=["-O2"],
                       verbose=False)
    except Exception as e:  # compiler errors, a broken toolchain, a read-only cache folder
        _failure = (
            f"mode='fast' could not build its C++ part ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[-1] if str(e).strip() else 'no message'}); set "
            "TORCH_EXTENSIONS_DIR to a writable folder, check the compiler, or use mode='ops'"
        )
        raise FastModeUnavailable(_failure) from e
    return _loaded


def native_available() -> bool:
    """True when the native part is built or can be built here (a compiler and ninja exist).

    Example:
        >>> from torchmem.capture.fast._build import native_available
        >>> native_available() in (True, False)
        True
    """
    return _loaded is not None or (_failure is None and not _missing_tools())
