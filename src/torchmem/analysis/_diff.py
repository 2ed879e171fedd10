"""What grew and shrank between two snapshots, grouped by stack, plus per-device totals.

Example:
    >>> from torchmem.model.snapshot import Snapshot, Segment, Block, Frame
    >>> a, b = Snapshot(), Snapshot()
    >>> b.segments = [Segment(0, 0, 2048, blocks=[Block(0, 2048, 2048, "active_allocated",
    ...                                                 (Frame("m.py", 3, "fwd"),))])]
    >>> [(r.stack, r.delta_bytes) for r in diff(a, b).rows]
    [(('m.py:3:fwd',), 2048)]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torchmem.analysis.frames import group_by_stack
from torchmem.model.snapshot import Snapshot

__all__ = ["DiffRow", "SnapshotDiff", "diff", "snapshot_diff"]


@dataclass
class DiffRow:
    """One stack's bytes/count before and after.

    Example:
        >>> DiffRow(0, ("a",), 10, 30, 1, 2).delta_bytes
        20
    """

    device: int
    stack: tuple[str, ...]
    before_bytes: int
    after_bytes: int
    before_count: int
    after_count: int

    @property
    def delta_bytes(self) -> int:
        """``after_bytes - before_bytes``.

        Example:
            >>> DiffRow(0, ("a",), 30, 10, 2, 1).delta_bytes
            -20
        """
        return self.after_bytes - self.before_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> DiffRow(0, ("a",), 1, 2, 1, 1).to_dict()["delta_bytes"]
            1
        """
        d = asdict(self)
        d["stack"] = list(self.stack)
        d["delta_bytes"] = self.delta_bytes
        return d


@dataclass
class SnapshotDiff:
    """What grew and shrank between two snapshots, grouped by stack, plus device totals.

    Example:
        >>> SnapshotDiff(rows=[], totals={}).to_dict()
        {'totals': {}, 'rows': []}
    """

    rows: list[DiffRow]
    totals: dict[int, dict[str, int]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> SnapshotDiff([], {0: {"allocated_bytes_delta": 0}}).to_dict()["totals"]
            {'0': {'allocated_bytes_delta': 0}}
        """
        return {
            "totals": {str(k): v for k, v in self.totals.items()},
            "rows": [r.to_dict() for r in self.rows],
        }


def snapshot_diff(
    before: Snapshot, after: Snapshot, *, depth: int = 5, filter_internal: bool = True
) -> SnapshotDiff:
    """Compare the allocated blocks of two snapshots, grouped by stack (largest change first).

    Totals per device: reserved/allocated deltas and segments only in one of the two (by
    address and size, which is what ``_memory_viz compare`` tries to report).

    Example:
        >>> from torchmem.model.snapshot import Snapshot, Segment, Block, Frame
        >>> a, b = Snapshot(), Snapshot()
        >>> f = (Frame("m.py", 3, "fwd"),)
        >>> a.segments = [Segment(0, 0, 2048, blocks=[Block(0, 1024, 1024, "active_allocated", f),
        ...                                           Block(1024, 1024, 0, "inactive")])]
        >>> b.segments = [Segment(0, 0, 2048, blocks=[Block(0, 2048, 2048, "active_allocated", f)])]
        >>> d = snapshot_diff(a, b)
        >>> [(r.stack, r.delta_bytes) for r in d.rows], d.totals[0]["allocated_bytes_delta"]
        ([(('m.py:3:fwd',), 1024)], 1024)
    """
    rows: list[DiffRow] = []
    totals: dict[int, dict[str, int]] = {}
    devs = sorted(set(before.devices) | set(after.devices))
    for dev in devs:
        groups = []
        for snap in (before, after):
            blocks = [
                (b.size, snap.intern_stack(b.frames))
                for s in snap.segments
                if s.device == dev
                for b in s.blocks
                if b.state == "active_allocated"
            ]
            groups.append({g.stack: g for g in group_by_stack(snap, blocks, depth, filter_internal)})
        ga, gb = groups
        for key in set(ga) | set(gb):
            x, y = ga.get(key), gb.get(key)
            r = DiffRow(dev, key, x.bytes if x else 0, y.bytes if y else 0, x.count if x else 0,
                        y.count if y else 0)
            if r.delta_bytes or r.before_count != r.after_count:
                rows.append(r)
        sa = {(s.address, s.total_size) for s in before.segments if s.device == dev}
        sb = {(s.address, s.total_size) for s in after.segments if s.device == dev}
        ra = sum(s.total_size for s in before.segments if s.device == dev)
        rb = sum(s.total_size for s in after.segments if s.device == dev)
        aa = sum(s.allocated_size for s in before.segments if s.device == dev)
        ab = sum(s.allocated_size for s in after.segments if s.device == dev)
        totals[dev] = {
            "reserved_bytes_before": ra,
            "reserved_bytes_after": rb,
            "reserved_bytes_delta": rb - ra,
            "allocated_bytes_before": aa,
            "allocated_bytes_after": ab,
            "allocated_bytes_delta": ab - aa,
            "segments_only_before": len(sa - sb),
            "segments_only_after": len(sb - sa),
        }
    rows.sort(key=lambda r: (-abs(r.delta_bytes), r.device, r.stack))
    return SnapshotDiff(rows, totals)

#: The short name, as in ``torchmem.analysis.diff(before, after)``.
diff = snapshot_diff
