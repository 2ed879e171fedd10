"""Allocator statistics of a snapshot's end state, per device, pool and stream.

Example:
    >>> from torchmem.model.snapshot import Snapshot, Segment, Block
    >>> s = Snapshot()
    >>> s.segments = [Segment(0, 0, 2048, blocks=[Block(0, 1024, 1000, "active_allocated"),
    ...                                           Block(1024, 1024, 0, "inactive")])]
    >>> d = stats(s).devices[0]
    >>> d.reserved_bytes, d.allocated_bytes, d.free_bytes
    (2048, 1024, 1024)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Snapshot

__all__ = ["PoolStats", "DeviceStats", "SnapshotStats", "stats", "snapshot_stats"]


@dataclass
class PoolStats:
    """Totals for a group of segments (a pool, a stream or a whole device).

    Example:
        >>> PoolStats().reserved_bytes
        0
    """

    reserved_bytes: int = 0
    allocated_bytes: int = 0
    active_bytes: int = 0
    requested_bytes: int = 0
    free_bytes: int = 0
    largest_free_block: int = 0
    segments: int = 0
    blocks: int = 0

    def add_segment(self, seg: Any) -> None:
        """Add one segment's blocks to the totals.

        Example:
            >>> from torchmem.model.snapshot import Segment, Block
            >>> p = PoolStats(); p.add_segment(Segment(0, 0, 1024, blocks=[Block(0, 1024, 1000, "active_allocated")]))
            >>> p.allocated_bytes, p.requested_bytes
            (1024, 1000)
        """
        self.reserved_bytes += seg.total_size
        self.segments += 1
        for b in seg.blocks:
            self.blocks += 1
            st = b.state
            if st == "inactive":
                self.free_bytes += b.size
                if b.size > self.largest_free_block:
                    self.largest_free_block = b.size
            else:
                self.active_bytes += b.size
                self.requested_bytes += b.requested_size
                if st == "active_allocated":
                    self.allocated_bytes += b.size


@dataclass
class DeviceStats:
    """Allocator statistics of one device at the snapshot's end.

    ``rounding_slack_bytes`` = allocated block bytes - their requested bytes;
    ``fragmentation`` = 1 - largest free block / free bytes (0 when no free bytes).

    Example:
        >>> DeviceStats(device=0, name="cuda:0").fragmentation
        0.0
    """

    device: int
    name: str
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    active_bytes: int = 0
    requested_bytes: int = 0
    pending_free_bytes: int = 0
    free_bytes: int = 0
    largest_free_block: int = 0
    rounding_slack_bytes: int = 0
    segments: int = 0
    blocks: int = 0
    active_blocks: int = 0
    inactive_blocks: int = 0
    expandable_segments: bool = False
    pools: dict[str, PoolStats] = field(default_factory=dict)
    streams: dict[int, PoolStats] = field(default_factory=dict)
    trace_entries: int = 0
    trace_actions: dict[str, int] = field(default_factory=dict)

    @property
    def fragmentation(self) -> float:
        """Share of free (cached) bytes that are not in the largest free block.

        Example:
            >>> DeviceStats(0, "cuda:0", free_bytes=100, largest_free_block=25).fragmentation
            0.75
        """
        return 1.0 - self.largest_free_block / self.free_bytes if self.free_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (streams keyed by ``str(stream)``).

        Example:
            >>> DeviceStats(0, "cuda:0").to_dict()["reserved_bytes"]
            0
        """
        d = asdict(self)
        d["streams"] = {str(k): v for k, v in d["streams"].items()}
        d["fragmentation"] = round(self.fragmentation, 6)
        return d


@dataclass
class SnapshotStats:
    """Per-device statistics plus the snapshot's allocator settings and notes.

    Example:
        >>> SnapshotStats(devices=[]).to_dict()["devices"]
        []
    """

    devices: list[DeviceStats]
    allocator_settings: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    source_format: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> sorted(SnapshotStats(devices=[]).to_dict())
            ['allocator_settings', 'devices', 'notes', 'source_format']
        """
        return {
            "devices": [d.to_dict() for d in self.devices],
            "allocator_settings": self.allocator_settings,
            "notes": list(self.notes),
            "source_format": self.source_format,
        }


def snapshot_stats(snap: Snapshot) -> SnapshotStats:
    """Per device: reserved/allocated/active/requested bytes, pools, streams, fragmentation.

    Example:
        >>> from torchmem.model.snapshot import Snapshot, Segment, Block
        >>> s = Snapshot()
        >>> s.segments = [Segment(0, 0, 2097152, segment_type="small", blocks=[
        ...     Block(0, 1024, 1000, "active_allocated"), Block(1024, 512, 512, "active_pending_free"),
        ...     Block(1536, 2095616, 0, "inactive")])]
        >>> d = snapshot_stats(s).devices[0]
        >>> d.reserved_bytes, d.allocated_bytes, d.active_bytes, d.requested_bytes, d.rounding_slack_bytes
        (2097152, 1024, 1536, 1512, 24)
        >>> d.pools["small"].segments, d.largest_free_block
        (1, 2095616)
    """
    if not isinstance(snap, Snapshot):
        raise InvalidInputError(
            f"expected a torchmem Snapshot, got {type(snap).__name__}; load one with "
            "torchmem.load_snapshot(path)"
        )
    out: dict[int, DeviceStats] = {}
    for dev in snap.devices:
        out[dev] = DeviceStats(device=dev, name=snap.device_name(dev))
    for seg in snap.segments:
        d = out[seg.device]
        d.reserved_bytes += seg.total_size
        d.segments += 1
        d.expandable_segments = d.expandable_segments or seg.is_expandable
        pool_name = seg.segment_type
        if tuple(seg.segment_pool_id) not in ((0, 0),):
            pool_name = f"{seg.segment_type}@pool{tuple(seg.segment_pool_id)}"
        d.pools.setdefault(pool_name, PoolStats()).add_segment(seg)
        d.streams.setdefault(seg.stream, PoolStats()).add_segment(seg)
        for b in seg.blocks:
            d.blocks += 1
            st = b.state
            if st == "inactive":
                d.inactive_blocks += 1
                d.free_bytes += b.size
                if b.size > d.largest_free_block:
                    d.largest_free_block = b.size
                continue
            d.active_blocks += 1
            d.active_bytes += b.size
            d.requested_bytes += b.requested_size
            if st == "active_allocated":
                d.allocated_bytes += b.size
                d.rounding_slack_bytes += b.size - b.requested_size
            else:
                d.pending_free_bytes += b.size
    for dev, t in snap.traces.items():
        if not len(t):
            continue
        d = out[dev]
        d.trace_entries = len(t)
        acts = t.actions
        counts = [acts.count(i) for i in range(len(t.action_names))]
        d.trace_actions = {n: c for n, c in zip(t.action_names, counts) if c}
    settings = snap.allocator_settings
    if settings and settings.get("expandable_segments"):
        for d in out.values():
            d.expandable_segments = True
    return SnapshotStats(
        devices=[out[k] for k in sorted(out)],
        allocator_settings=settings,
        notes=list(snap.notes),
        source_format=snap.source.format,
    )

#: The short name, as in ``torchmem.analysis.stats(snap)``.
stats = snapshot_stats
