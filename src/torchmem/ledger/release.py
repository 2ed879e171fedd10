"""Giving a device's cached, unused memory back to the system after an auto-GC run.

:func:`release_device_cache` is what the ledger's banded auto-GC policy runs after
``gc.collect()``: PyTorch's caching allocator is emptied on accelerators, and glibc's heap is
trimmed on the CPU.

Example:
    >>> release_device_cache("meta")            # nothing is cached on the meta device
    'none'
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch

from torchmem._device import device_name, split_device

__all__ = ["release_device_cache"]

_libc: Any = None


def _malloc_trim() -> bool:
    global _libc
    if _libc is None:
        _libc = False
        try:
            name = ctypes.util.find_library("c")
            lib = ctypes.CDLL(name) if name else None
            if lib is not None and hasattr(lib, "malloc_trim"):
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                lib.malloc_trim.restype = ctypes.c_int
                _libc = lib
        except Exception:
            _libc = False
    if _libc is False:
        return False
    _libc.malloc_trim(0)
    return True


def release_device_cache(device: str) -> str:
    """Return a device's cached, unused memory to the system; say what ran.

    CUDA: ``torch.cuda.empty_cache()`` on that device (only if CUDA was initialised). CPU:
    glibc's ``malloc_trim(0)`` where the C library has it. Other devices: their
    ``torch.<type>.empty_cache()`` when it exists. Returns ``"empty_cache"``,
    ``"malloc_trim"`` or ``"none"``.

    Example:
        >>> import platform
        >>> glibc = platform.libc_ver()[0] == "glibc"
        >>> release_device_cache("cpu") == ("malloc_trim" if glibc else "none")
        True
        >>> release_device_cache("meta")
        'none'
    """
    dtype, _ = split_device(device)
    if dtype == "cpu":
        return "malloc_trim" if _malloc_trim() else "none"
    if dtype == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with torch.cuda.device(device_name(device)):
                torch.cuda.empty_cache()
            return "empty_cache"
        return "none"
    mod = getattr(torch, dtype, None)
    fn = getattr(mod, "empty_cache", None)
    if callable(fn):
        try:
            fn()
            return "empty_cache"
        except Exception:
            return "none"
    return "none"

