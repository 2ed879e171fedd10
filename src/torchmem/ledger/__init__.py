"""The ledger: explicit allocate/free accounting per device, with automatic frees, call-site
hotspots, a banded auto-GC policy and monitoring figures.

One module per duty; the ledger's methods for each are mixed into :class:`Ledger`:

- :mod:`~torchmem.ledger.accounting`: :class:`Ledger`, the allocate/free counting and queries.
- :mod:`~torchmem.ledger.records`: :class:`LedgerRecord`, the figures a query returns.
- :mod:`~torchmem.ledger.storages`: the storages behind a tensor, module, optimizer or container.
- :mod:`~torchmem.ledger.listener`: :meth:`Ledger.capture` and :meth:`Ledger.attach`, counting
  what torchmem's tracker reports.
- :mod:`~torchmem.ledger.sites`: call-site hotspots (:meth:`Ledger.top_alloc_site`).
- :mod:`~torchmem.ledger.autogc`: the banded auto-GC policy, :class:`GcRun`,
  :data:`DEFAULT_AUTO_GC_STRATEGY`.
- :mod:`~torchmem.ledger.release`: :func:`release_device_cache`, run after each auto-GC.
- :mod:`~torchmem.ledger.metrics`: :func:`ledger_metrics`, :func:`serve_prometheus`.

Device usage (what auto-GC reads) comes from :mod:`torchmem.devices`.

Example:
    >>> import torch
    >>> from torchmem.ledger import Ledger
    >>> led = Ledger()
    >>> led.allocate(torch.zeros(256))
    1024
"""

from __future__ import annotations

from torchmem.ledger.accounting import Ledger
from torchmem.ledger.autogc import DEFAULT_AUTO_GC_STRATEGY, GcRun
from torchmem.ledger.metrics import MetricsServer, ledger_metrics, serve_prometheus
from torchmem.ledger.records import LedgerRecord
from torchmem.ledger.release import release_device_cache

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
