"""Device transfers: tensors and modules moved between devices with bounded staging memory.

Modules, from the bottom up (each imports only those above it):

- :mod:`~torchmem.transfer.streams`: :class:`DeviceSpec` (a device with its compute and transfer
  streams) and the per-pair transfer streams.
- :mod:`~torchmem.transfer.staging`: :class:`StagingBuffers`, the reusable pair of (pinned) host
  buffers, with measured live and peak bytes.
- :mod:`~torchmem.transfer.pipeline`: the double-buffered chunk loop and the packed copy of the
  storages behind several tensors.
- :mod:`~torchmem.transfer.engine`: :func:`transfer`, :func:`transfer_async` and
  :class:`PendingTransfer`, :func:`chunked_transfer` and :class:`TransferResult`, and
  :func:`transfer_module`, a thin call into :func:`torchmem.move.move_module` (the one module
  move, shared with :func:`torchmem.memory_aware_to`) with chunked, stream-ordered copies.
- :mod:`~torchmem.transfer.offload`: :func:`offload_forward`, layer-by-layer offloaded inference.
- :mod:`~torchmem.transfer.ops`: :class:`ToDevice`, a transfer as a linear operator, and the
  operator algebra it composes with (:class:`Operator`, :class:`Chain`, :class:`Identity`,
  :class:`LinearOp`, :func:`adjoint_of`).

Example:
    >>> import torch
    >>> from torchmem.transfer import ToDevice, chunked_transfer
    >>> ToDevice("cpu", "meta")(torch.ones(2)).device.type
    'meta'
    >>> chunked_transfer(torch.ones(100), "cpu", chunk_bytes=256).chunk_sizes
    (256, 144)
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

from torchmem.transfer.engine import (
    PendingTransfer,
    TransferResult,
    chunked_transfer,
    transfer,
    transfer_async,
    transfer_module,
)
from torchmem.transfer.offload import OffloadResult, offload_forward
from torchmem.transfer.ops import Chain, Identity, LinearOp, Operator, ToDevice, adjoint_of
from torchmem.transfer.staging import DEFAULT_CHUNK_BYTES, StagingBuffers
from torchmem.transfer.streams import DeviceSpec, transfer_stream

__all__ = [
    # tensors and modules
    "transfer",
    "transfer_async",
    "PendingTransfer",
    "chunked_transfer",
    "transfer_module",
    "TransferResult",
    "offload_forward",
    "OffloadResult",
    # devices, streams and staging
    "DeviceSpec",
    "transfer_stream",
    "StagingBuffers",
    "DEFAULT_CHUNK_BYTES",
    # transfers as linear operators
    "ToDevice",
    "Operator",
    "Chain",
    "Identity",
    "LinearOp",
    "adjoint_of",
]


class _CallableNamespace(types.ModuleType):
    """``torchmem.transfer`` is this namespace; torchmem 0.1 also had a top-level *function* of that
    name. Calling the namespace forwards to :func:`transfer` with a :class:`DeprecationWarning`
    until torchmem 0.3.

    Example:
        >>> import warnings, torch, torchmem
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     y = torchmem.transfer(torch.ones(2), "cpu")
        >>> y.tolist(), caught[0].category.__name__
        ([1.0, 1.0], 'DeprecationWarning')
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            "torchmem.transfer(...) as a function moved to torchmem.transfer.transfer(...); the "
            "old call is forwarded until torchmem 0.3. Fix: call torchmem.transfer.transfer",
            DeprecationWarning,
            stacklevel=2,
        )
        return transfer(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableNamespace
