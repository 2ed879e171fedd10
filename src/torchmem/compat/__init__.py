"""Drop-in names for users coming from other tools.

- :mod:`~torchmem.compat.torchlinops`: torchlinops' ``MemReporter``, ``get_device``,
  ``device_ordinal``, ``cdata`` and ``tensor_memory_span``.
- :mod:`~torchmem.compat.memlord`: :class:`MemLord`, MemLord's memory ledger on an exact
  :class:`torchmem.Ledger` (``from torchmem.compat import MemLord``).
- :mod:`~torchmem.compat.memtracker`: :class:`MemoryTracker`, with the interface of PyTorch's
  ``torch.distributed._tools.MemoryTracker``.

Example:
    >>> import torch
    >>> from torchmem.compat import get_device
    >>> get_device(-1)
    device(type='cpu')
"""

from __future__ import annotations

from torchmem.compat.memlord import MemLord
from torchmem.compat.memtracker import MemoryTracker
from torchmem.compat.torchlinops import (
    MemReporter,
    cdata,
    device_ordinal,
    get_device,
    tensor_memory_span,
)

__all__ = ["MemLord", "MemReporter", "MemoryTracker", "cdata", "device_ordinal", "get_device", "tensor_memory_span"]
