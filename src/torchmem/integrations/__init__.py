"""Memory figures inside the trainers users run: Lightning and transformers' ``Trainer``.

- :mod:`torchmem.integrations.lightning`: ``MemoryCallback`` for Lightning (``pip install
  torchmem[lightning]``).
- :mod:`torchmem.integrations.transformers`: ``MemoryCallback`` for transformers' ``Trainer``
  (``pip install torchmem[transformers]``).

Both log, per training step, the peak of live tensor memory and the peak of each phase through
the trainer's own logger, take the maximum across ranks under DDP, and write a trace per rank
when a step runs out of memory. The shared meter is :mod:`torchmem.integrations._meter`.

Example:
    >>> import torchmem.integrations
    >>> torchmem.integrations.__all__
    []
"""

from __future__ import annotations

__all__: list[str] = []
