"""What the CUDA kernel families share: the scratch-buffer record (:data:`Transient`), an ATen
operator by name, and the environment-flag rules of c10 and the SDPA backends.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: One scratch buffer of :meth:`CudaEmulation.transients`: ``(bytes, label)``, or
#: ``(bytes, label, frees)`` where ``frees`` are the indices of earlier scratch buffers of the
#: same call that the kernel frees right after allocating this one (in that order), or
#: ``(bytes, label, frees, fallback)`` where ``fallback`` is the size to take instead when
#: ``bytes`` does not fit (cuDNN tries its next plan when a workspace's allocation runs out
#: of memory: ``try_plans`` in ``Conv_v8.cpp``).
Transient = (tuple[int, str] | tuple[int, str, tuple[int, ...]]
             | tuple[int, str, tuple[int, ...], int])


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


_ENV_TRUE = ("1", "true", "on", "yes", "y")


def _env_flag(name: str) -> bool | None:
    """``c10::utils::check_env``: ``True`` for "1"/"true", ``False`` for "0"/"false" (any
    case), ``None`` when unset or anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    return None
