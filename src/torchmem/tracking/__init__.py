"""Producers of the event stream: the dispatch-mode tracker, the profiler-based lite tracker and
the torch-compatible ``MemoryTracker`` wrapper.

Example:
    >>> import torch
    >>> from torchmem.tracking import track
    >>> with track() as tr:
    ...     _ = torch.ones(4)
    >>> tr.peak()
    {'cpu': 16}
"""

from __future__ import annotations

from torchmem.tracking.compat import MemoryTracker
from torchmem.tracking.lite import LiteTracker, track_lite
from torchmem.tracking.tracker import Listener, Tracker, track

__all__ = ["track", "Tracker", "Listener", "MemoryTracker", "track_lite", "LiteTracker"]
