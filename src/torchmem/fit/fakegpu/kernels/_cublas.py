"""cuBLAS and cuBLASLt workspaces (``CublasHandlePool.cpp``): which GEMMs run through cuBLASLt,
and ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KiB:COUNT`` terms.
"""

from __future__ import annotations

import torch

_LT_GEMMS = tuple(
    getattr(torch.ops.aten, name).default
    for name in ("addmm", "_addmm_activation")
    if hasattr(torch.ops.aten, name)
)


def _parse_workspace_config(config: str) -> int | None:
    """``:SIZE_KiB:COUNT`` pairs summed (``None`` if the string is not in that form)."""
    parts = config.split(":")
    if parts[0] != "" or len(parts) < 3 or len(parts) % 2 == 0:
        return None
    try:
        nums = [int(x) for x in parts[1:]]
    except ValueError:
        return None
    return sum(size * 1024 * count for size, count in zip(nums[::2], nums[1::2], strict=True))
