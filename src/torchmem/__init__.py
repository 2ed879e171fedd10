"""torchmem: make PyTorch memory visible and manageable.

The public surface is listed in ``__all__`` and loaded lazily, so ``import torchmem`` stays cheap
and does not import optional pieces (plots, the HTML viewer) until they are used.

Example:
    >>> import torch, torchmem
    >>> w = torch.zeros(256, 256)
    >>> torchmem.unique_bytes([w, w.t()])           # shared storage counted once
    {'cpu': 262144}
    >>> torchmem.format_bytes(262144)
    '256.00 KiB'
"""

from __future__ import annotations

import importlib
from typing import Any

from torchmem._version import __version__

# name -> module that defines it. Each area keeps its own block.
_EXPORTS: dict[str, str] = {
    # errors and units
    "TorchmemError": "torchmem.errors",
    "InvalidInputError": "torchmem.errors",
    "UnsupportedTensorError": "torchmem.errors",
    "DeviceError": "torchmem.errors",
    "FileFormatError": "torchmem.errors",
    "TraceFormatError": "torchmem.errors",
    "SnapshotFormatError": "torchmem.errors",
    "UnsafePickleError": "torchmem.errors",
    "MoveError": "torchmem.errors",
    "TransferError": "torchmem.errors",
    "ObjectLoadError": "torchmem.errors",
    "format_bytes": "torchmem.units",
    "parse_bytes": "torchmem.units",
    # storage model (issue 2)
    "Span": "torchmem.storage",
    "storage_of": "torchmem.storage",
    "storage_id": "torchmem.storage",
    "storage_ref": "torchmem.storage",
    "storage_nbytes": "torchmem.storage",
    "tensor_span": "torchmem.storage",
    "same_storage": "torchmem.storage",
    "overlaps": "torchmem.storage",
    "unique_bytes": "torchmem.storage",
    "storage_bytes": "torchmem.storage",
    # BEGIN issue-2 exports (inspect, move, torchlinops compat)
    # END issue-2 exports
    # BEGIN issue-3 exports (tracking)
    # END issue-3 exports
    # BEGIN issue-4 exports (ledger, devices)
    # END issue-4 exports
    # BEGIN issue-5 exports (snapshots, viewer)
    # END issue-5 exports
    # BEGIN issue-6 exports (transfer)
    # END issue-6 exports
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
