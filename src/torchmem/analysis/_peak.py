"""The peak of allocated memory per device, found by replaying the trace, and what was live then.

The running total starts from the live set derived backwards from the end state (see
:mod:`torchmem.analysis.replay`), so traces that start mid-run are right.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> snap = from_pytorch({"segments": [], "device_traces": [[
    ...     {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "alloc", "addr": 512, "size": 50, "stream": 0, "frames": []},
    ...     {"action": "free_requested", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "free_requested", "addr": 512, "size": 50, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 512, "size": 50, "stream": 0, "frames": []}]]})
    >>> p = peak(snap).devices[0]
    >>> p.peak_allocated_bytes, p.peak_index, p.end_allocated_bytes   # reached at entry #1
    (150, 1, 0)

Entries are numbered one way everywhere: ``#N`` is the 0-based index of a trace entry in its
device's trace, as ``torchmem trace`` prints it (and the viewer's ``#N``); the peak is at the
entry whose running total first reaches the maximum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.analysis.frames import StackGroup, group_by_stack
from torchmem.analysis.replay import DeviceReplay, select_devices
from torchmem.model.snapshot import Snapshot

__all__ = ["DevicePeak", "PeakReport", "peak", "snapshot_peak"]


@dataclass
class DevicePeak:
    """Peak of allocated (requested) bytes over one device's trace and what was live then.

    ``peak_index`` is the trace entry ``#N`` (0-based, as ``torchmem trace`` numbers the
    device's entries) after which allocated bytes first reach the peak; -1 when the peak is the
    state before the first entry (a trace that only frees). ``consistent`` is False when the trace contradicts the end state (the running total,
    derived backwards from the end, goes negative somewhere).

    Example:
        >>> DevicePeak(0, "cuda:0", 10, 1, None, 0, 0, 2).to_dict()["peak_allocated_bytes"]
        10
    """

    device: int
    name: str
    peak_allocated_bytes: int
    peak_index: int
    peak_time_us: int | None
    initial_allocated_bytes: int
    end_allocated_bytes: int
    trace_entries: int
    consistent: bool = True
    at_peak: list[StackGroup] = field(default_factory=list)
    at_end: list[StackGroup] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> sorted(DevicePeak(0, "cuda:0", 0, 0, None, 0, 0, 0).to_dict())[:3]
            ['at_end', 'at_peak', 'consistent']
        """
        d = {k: v for k, v in asdict(self).items() if k not in ("at_peak", "at_end")}
        d["at_peak"] = [g.to_dict() for g in self.at_peak]
        d["at_end"] = [g.to_dict() for g in self.at_end]
        return d


@dataclass
class PeakReport:
    """Peaks of every device.

    Example:
        >>> PeakReport(devices=[]).to_dict()
        {'devices': []}
    """

    devices: list[DevicePeak]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> PeakReport([]).to_dict()["devices"]
            []
        """
        return {"devices": [d.to_dict() for d in self.devices]}


def snapshot_peak(
    snap: Snapshot,
    *,
    depth: int = 5,
    filter_internal: bool = True,
    top: int | None = 20,
    device: int | None = None,
) -> PeakReport:
    """Find each device's peak of allocated bytes by replaying its trace; group what was live.

    The running total starts from the live set derived backwards from the end state (see the
    module docs), so traces that start mid-run are right. ``depth`` innermost frames (after
    filtering PyTorch internals unless ``filter_internal=False``) form the group key; ``top``
    limits the groups listed (``None``: all). ``device`` selects one device index; an index
    with no segments or trace entries raises :class:`~torchmem.errors.InvalidInputError`.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [{"device": 0, "address": 0, "total_size": 1024,
        ...     "stream": 0, "blocks": [
        ...         {"address": 0, "size": 512, "requested_size": 0, "state": "inactive"},
        ...         {"address": 512, "size": 512, "requested_size": 100, "state": "active_allocated"}]}],
        ...   "device_traces": [[
        ...     {"action": "free_completed", "addr": 0, "size": 300, "stream": 0, "frames": []},
        ...     {"action": "alloc", "addr": 512, "size": 100, "stream": 0, "frames": []}]]})
        >>> p = snapshot_peak(s).devices[0]   # 300 bytes were live before the trace started
        >>> p.initial_allocated_bytes, p.peak_allocated_bytes, p.peak_index, p.end_allocated_bytes
        (300, 300, -1, 100)
    """
    out: list[DevicePeak] = []
    for dev in select_devices(snap, device):
        r = DeviceReplay(snap, dev)
        t = r.trace
        n = len(t)
        running = r.allocated
        k = r.peak_index
        peak_time = None
        if n and t.has_time:
            peak_time = t.times[min(k, n) - 1] if k > 0 else t.times[0]
        out.append(
            DevicePeak(
                device=dev,
                name=snap.device_name(dev),
                peak_allocated_bytes=running[k],
                peak_index=k - 1,
                peak_time_us=peak_time,
                initial_allocated_bytes=running[0],
                end_allocated_bytes=running[-1],
                trace_entries=n,
                consistent=running[0] >= 0 and min(running) >= 0,
                at_peak=group_by_stack(snap, r.live_at(k).values(), depth, filter_internal, top),
                at_end=group_by_stack(snap, r.end_live().values(), depth, filter_internal, top),
            )
        )
    return PeakReport(out)

#: The short name, as in ``torchmem.analysis.peak(snap)``.
peak = snapshot_peak
