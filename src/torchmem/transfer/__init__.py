"""Device transfers: the :class:`ToDevice` operator, :class:`DeviceSpec` streams, and chunked,
double-buffered transfers of tensors, modules and layer-by-layer offloaded inference.

Example:
    >>> import torch
    >>> from torchmem.transfer import ToDevice, chunked_transfer
    >>> ToDevice("cpu", "meta")(torch.ones(2)).device.type
    'meta'
    >>> chunked_transfer(torch.ones(100), "cpu", chunk_bytes=256).chunk_sizes
    (256, 144)
"""

from __future__ import annotations

from torchmem.transfer.engine import (
    DEFAULT_CHUNK_BYTES,
    PendingTransfer,
    StagingBuffers,
    TransferResult,
    chunked_transfer,
    transfer,
    transfer_async,
    transfer_module,
)
from torchmem.transfer.offload import OffloadResult, offload_forward
from torchmem.transfer.ops import Chain, Identity, LinearOp, Operator, ToDevice, adjoint_of
from torchmem.transfer.streams import DeviceSpec, transfer_stream

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Chain",
    "DeviceSpec",
    "Identity",
    "LinearOp",
    "OffloadResult",
    "Operator",
    "PendingTransfer",
    "StagingBuffers",
    "ToDevice",
    "TransferResult",
    "adjoint_of",
    "chunked_transfer",
    "offload_forward",
    "transfer",
    "transfer_async",
    "transfer_module",
    "transfer_stream",
]
