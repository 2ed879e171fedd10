"""A snapshot's trace entries as rows with correct running totals of allocated and reserved bytes.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> s = from_pytorch({"segments": [], "device_traces": [[
    ...     {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 0, "size": 100, "stream": 0, "frames": []}]]})
    >>> [(r.action, r.allocated_bytes) for r in events(s)]
    [('alloc', 100), ('free_completed', 0)]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from torchmem.analysis.frames import stack_key
from torchmem.analysis.replay import DeviceReplay, select_devices
from torchmem.model.snapshot import Snapshot

__all__ = ["TraceRow", "events", "snapshot_trace"]


@dataclass
class TraceRow:
    """One trace entry with the running totals *after* it.

    Example:
        >>> TraceRow(0, 0, None, "alloc", 0, 512, 0, 512, 0, "").to_dict()["allocated_bytes"]
        512
    """

    device: int
    index: int
    time_us: int | None
    action: str
    addr: int
    size: int
    stream: int
    allocated_bytes: int
    reserved_bytes: int
    frame: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> sorted(TraceRow(0, 0, None, "oom", 0, 512, 0, 0, 0, "").to_dict())[:2]
            ['action', 'addr']
        """
        return asdict(self)




def snapshot_trace(
    snap: Snapshot, *, device: int | None = None, depth: int = 1, filter_internal: bool = True
) -> Iterator[TraceRow]:
    """The event log with correct running totals of allocated and reserved bytes.

    Totals start from the state before the first entry (derived backwards from the end state),
    and end equal to the snapshot's active (requested) bytes and reserved bytes.
    ``frame`` is the ``depth`` innermost user frames joined by `` <- ``. ``device`` selects one
    device index (one with no data raises :class:`~torchmem.errors.InvalidInputError`).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "segment_alloc", "addr": 0, "size": 2097152, "stream": 0, "frames": []},
        ...     {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []},
        ...     {"action": "free_requested", "addr": 0, "size": 100, "stream": 0, "frames": []},
        ...     {"action": "free_completed", "addr": 0, "size": 100, "stream": 0, "frames": []},
        ...     {"action": "segment_free", "addr": 0, "size": 2097152, "stream": 0, "frames": []}]]})
        >>> [(r.action, r.allocated_bytes, r.reserved_bytes) for r in snapshot_trace(s)]  # doctest: +NORMALIZE_WHITESPACE
        [('segment_alloc', 0, 2097152), ('alloc', 100, 2097152), ('free_requested', 100, 2097152),
         ('free_completed', 0, 2097152), ('segment_free', 0, 0)]
    """
    for dev in select_devices(snap, device):
        r = DeviceReplay(snap, dev)
        t = r.trace
        if not len(t):
            continue
        cache: dict[int, str] = {}
        names = t.action_names
        stacks = snap.stacks
        times = t.times if t.has_time else [None] * len(t)
        for i, (a, addr, size, stream, tm, sid, alloc, res) in enumerate(
            zip(t.actions, t.addrs, t.sizes, t.streams, times, t.stack_ids,
                r.allocated[1:], r.reserved[1:])
        ):
            label = cache.get(sid)
            if label is None:
                key = stack_key(stacks[sid], depth, filter_internal)
                label = cache[sid] = " <- ".join(key)
            yield TraceRow(dev, i, tm, names[a], addr, size, stream, alloc, res, label)


#: The short name, as in ``torchmem.analysis.events(snap)``.
events = snapshot_trace
