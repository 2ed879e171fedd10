"""The ledger: explicit allocate/free accounting per device, with automatic frees, call-site
hotspots, usage polling, a banded auto-GC policy and monitoring figures.

- :mod:`~torchmem.ledger.accounting`: :class:`Ledger` and its records.
- :mod:`~torchmem.ledger.metrics`: :func:`ledger_metrics`, :func:`serve_prometheus`.

Example:
    >>> import torch
    >>> from torchmem.ledger import Ledger
    >>> led = Ledger()
    >>> led.allocate(torch.zeros(256))
    1024
"""

from __future__ import annotations

from torchmem.ledger.accounting import (
    DEFAULT_AUTO_GC_STRATEGY,
    GcRun,
    Ledger,
    LedgerRecord,
    release_device_cache,
)
from torchmem.ledger.metrics import MetricsServer, ledger_metrics, serve_prometheus

__all__ = [
    "DEFAULT_AUTO_GC_STRATEGY",
    "GcRun",
    "Ledger",
    "LedgerRecord",
    "MetricsServer",
    "ledger_metrics",
    "release_device_cache",
    "serve_prometheus",
]
