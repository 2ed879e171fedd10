"""Plain data: events, traces, snapshots, census reports and move plans. No torch, no file I/O.

- :mod:`~torchmem.model.events`: :class:`EventKind`, :class:`Phase`, :class:`Category`,
  :class:`Event`.
- :mod:`~torchmem.model.trace`: :class:`Trace`, the columnar event stream of a tracked run.
- :mod:`~torchmem.model.snapshot`: :class:`Snapshot`, PyTorch's allocator state and history;
  its parts (:class:`Frame`, :class:`Block`, :class:`Segment`, :class:`TraceEntry`,
  :class:`DeviceTrace`) are in :mod:`~torchmem.model.snapshot_parts`.
- :mod:`~torchmem.model.census`: :class:`MemoryReport` and its records, :class:`MovePlan`.

Files and conversions between these are :mod:`torchmem.io`.

Example:
    >>> from torchmem.model import Category, Phase
    >>> Category.PARAMETER.label, Phase.BACKWARD.label
    ('parameter', 'backward')
"""

from __future__ import annotations

from torchmem.model.census import MemoryReport, MovePlan, StorageRecord, TensorRecord
from torchmem.model.events import Category, Event, EventKind, Phase
from torchmem.model.snapshot import Snapshot
from torchmem.model.snapshot_parts import Block, DeviceTrace, Frame, Segment, TraceEntry
from torchmem.model.trace import Trace

__all__ = [
    "Block",
    "Category",
    "DeviceTrace",
    "Event",
    "EventKind",
    "Frame",
    "MemoryReport",
    "MovePlan",
    "Phase",
    "Segment",
    "Snapshot",
    "StorageRecord",
    "TensorRecord",
    "Trace",
    "TraceEntry",
]
