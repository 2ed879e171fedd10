"""Analyses of memory snapshots: stats, peak, diff, trace with running totals, flame, OOM report.

All functions take a :class:`~torchmem.model.snapshot.Snapshot` (see
:func:`torchmem.load_snapshot`) and return plain dataclasses with ``to_dict()`` for JSON. No torch.

Replay model (``snapshot_peak``, ``snapshot_trace``, ``oom_report``): an allocation is live from
its ``alloc`` entry to its ``free_completed`` entry (a ``free_requested`` block is still held by
the allocator until its stream events complete). Sizes are the entries' requested sizes, as in
PyTorch's Active Memory Timeline. Traces are ring buffers that usually start mid-run, so the live
set *before* the first entry is derived backwards from the snapshot's state at the end: the active
blocks at the end, minus the allocations in the trace, plus the frees in the trace. Reserved bytes
are replayed the same way from ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap``.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> snap = from_pytorch({"segments": [], "device_traces": [[
    ...     {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "alloc", "addr": 512, "size": 50, "stream": 0, "frames": []},
    ...     {"action": "free_requested", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "free_requested", "addr": 512, "size": 50, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 512, "size": 50, "stream": 0, "frames": []}]]})
    >>> p = snapshot_peak(snap).devices[0]
    >>> p.peak_allocated_bytes, p.peak_index, p.end_allocated_bytes
    (150, 2, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from itertools import accumulate, compress
from operator import mul
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import ACTIONS, Frame, Snapshot
from torchmem.units import format_bytes as _fb

__all__ = [
    "PoolStats",
    "DeviceStats",
    "SnapshotStats",
    "snapshot_stats",
    "StackGroup",
    "DevicePeak",
    "PeakReport",
    "snapshot_peak",
    "initial_live",
    "replay",
    "DiffRow",
    "SnapshotDiff",
    "snapshot_diff",
    "TraceRow",
    "snapshot_trace",
    "folded_stacks",
    "OomEvent",
    "oom_report",
    "is_internal_frame",
    "stack_key",
]

_ALLOC, _FREE_REQ, _FREE_DONE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP, _SNAP, _OOM = range(9)
assert ACTIONS[_FREE_DONE] == "free_completed" and ACTIONS[_OOM] == "oom"

NO_STACK = "<no stack>"
INTERNAL_ONLY = "<torch internals>"

# Frames that say nothing about the user's code: PyTorch's own C++ unwinding and Python-runtime
# frames (the same families torch.cuda._memory_viz omits), plus files inside the torch package.
_OMIT_NAMES = (
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "_start",
    "__libc_start_main",
    "PyEval_",
    "PyObject_",
    "PyFunction_",
)
_OMIT_FILES = (
    "core/boxing",
    "/Register",
    "/Redispatch",
    "pythonrun.c",
    "Modules/main.c",
    "Objects/call.c",
    "Objects/methodobject.c",
    "pycore_ceval.h",
    "ceval.c",
    "cpython/abstract.h",
)


@lru_cache(maxsize=65536)
def is_internal_frame(frame: Frame) -> bool:
    """True for frames of PyTorch's internals and the Python runtime (filtered from stacks).

    Internal: native (C++) frames (any file not ending in ``.py``, e.g. ``??`` or
    ``CUDACachingAllocator.cpp``), interpreter frames, and Python files inside an installed
    ``torch`` package (``.../torch/...``).

    Example:
        >>> is_internal_frame(Frame("/venv/lib/site-packages/torch/nn/modules/module.py", 1, "_call_impl"))
        True
        >>> is_internal_frame(Frame("train.py", 3, "step"))
        False
    """
    name, filename = frame.name, frame.filename
    if filename.startswith("<"):  # torchmem's <op>/<module> pseudo-frames, <frozen ...>
        return False
    if not filename.endswith(".py"):  # native frames: PyTorch's C++ (or "??" when unsymbolised)
        return True
    for o in _OMIT_NAMES:
        if o in name:
            return True
    for o in _OMIT_FILES:
        if o in filename:
            return True
    f = filename.replace("\\", "/")
    return "/torch/" in f or f.startswith("torch/")


def stack_key(frames: Sequence[Frame], depth: int = 5, filter_internal: bool = True) -> tuple[str, ...]:
    """Group key of a stack: its ``depth`` innermost (non-internal) frames as ``file:line:name``.

    Example:
        >>> stack_key((Frame("??", 0, "torch::unwind::unwind()"), Frame("m.py", 4, "fwd"),
        ...            Frame("t.py", 9, "main")), depth=1)
        ('m.py:4:fwd',)
        >>> stack_key(())
        ('<no stack>',)
    """
    if not frames:
        return (NO_STACK,)
    kept = [f for f in frames if not is_internal_frame(f)] if filter_internal else list(frames)
    if not kept:
        return (INTERNAL_ONLY,)
    if depth > 0:
        kept = kept[:depth]
    return tuple(f.label() for f in kept)


# ---------------------------------------------------------------------------------- stats
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


# ---------------------------------------------------------------------------------- replay
def _select_devices(snap: Snapshot, device: int | None) -> list[int]:
    """All devices with data (``device=None``) or ``[device]``; an index without data is an error
    (it would otherwise report zeros as if the device had been idle)."""
    devices = snap.devices
    if device is None:
        return devices
    if device not in devices:
        have = ", ".join(map(str, devices)) or "none (the snapshot is empty)"
        raise InvalidInputError(
            f"device {device!r} has no segments or trace entries in this snapshot; expected one "
            f"of: {have}. Fix: pass one of those indexes, or no device for all of them"
        )
    return [device]


def _running_allocated(snap: Snapshot, device: int, end: dict[int, tuple[int, int]]) -> list[int]:
    """Allocated bytes before the first entry and after each entry (``len(trace) + 1`` values),
    starting from the total derived backwards from the end state ``end``."""
    deltas = _deltas(snap, device)
    initial = sum(v[0] for v in end.values()) - sum(deltas)
    return list(accumulate(deltas, initial=initial))


def _end_live(snap: Snapshot, device: int) -> dict[int, tuple[int, int]]:
    """addr -> (requested size, stack id) of the active blocks at the end."""
    live: dict[int, tuple[int, int]] = {}
    intern = snap.intern_stack
    for seg in snap.segments:
        if seg.device != device:
            continue
        for b in seg.blocks:
            if b.state != "inactive":
                live[b.address] = (b.requested_size, intern(b.frames))
    return live


_SIGN = (1, 0, -1) + (0,) * 253  # alloc +size, free_completed -size, everything else 0
_SIGN_RESERVED = (0, 0, 0, 1, -1, 1, -1) + (0,) * 249  # segment_alloc/map +, segment_free/unmap -
_ALLOC_OR_FREE = (True, False, True) + (False,) * 253


def _deltas(snap: Snapshot, device: int) -> list[int]:
    """Signed allocated-bytes change of every entry (C-speed ``map``s over the columns)."""
    t = snap.trace(device)
    return list(map(mul, t.sizes, map(_SIGN.__getitem__, t.actions)))


def _live_at(
    snap: Snapshot, device: int, end: dict[int, tuple[int, int]], k: int
) -> dict[int, tuple[int, int]]:
    """Allocations live after the first ``k`` entries, derived from the end state backwards.

    For every address touched by an ``alloc``/``free_completed`` at or after entry ``k``, the
    earliest such entry decides: a free means it was live at ``k`` (with the free's size and
    stack), an alloc means it was not. Untouched addresses keep their end state.
    """
    t = snap.trace(device)
    acts, addrs, sizes, sids = t.actions, t.addrs, t.sizes, t.stack_ids
    idx = list(compress(range(k, len(acts)), map(_ALLOC_OR_FREE.__getitem__, acts[k:])))
    idx.reverse()
    first = dict(zip(map(addrs.__getitem__, idx), idx))  # later keys overwrite: earliest wins
    live = {a: v for a, v in end.items() if a not in first}
    for a, i in first.items():
        if acts[i] == _FREE_DONE:
            live[a] = (sizes[i], sids[i])
    return live


def _undo(snap: Snapshot, device: int, live: dict[int, tuple[int, int]], stop: int) -> int:
    """Walk the trace backwards from its end down to entry ``stop`` (inclusive), undoing entries.

    Returns the number of inconsistencies (an alloc whose address was not live).
    """
    t = snap.trace(device)
    acts, addrs, sizes, sids = t.actions, t.addrs, t.sizes, t.stack_ids
    bad = 0
    pop = live.pop
    for i in range(len(acts) - 1, stop - 1, -1):
        a = acts[i]
        if a == _ALLOC:
            if pop(addrs[i], None) is None:
                bad += 1
        elif a == _FREE_DONE:
            live[addrs[i]] = (sizes[i], sids[i])
    return bad


def initial_live(snap: Snapshot, device: int) -> dict[int, tuple[int, int]]:
    """Allocations live *before* the first trace entry: ``{addr: (size, stack id)}``.

    Derived backwards: active blocks at the end, minus allocations in the trace, plus frees.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "free_completed", "addr": 512, "size": 7, "stream": 0, "frames": []}]]})
        >>> initial_live(s, 0)
        {512: (7, 0)}
    """
    live = _end_live(snap, device)
    _undo(snap, device, live, 0)
    return live


def replay(
    snap: Snapshot, device: int, initial: dict[int, tuple[int, int]] | None = None
) -> dict[int, tuple[int, int]]:
    """Replay the trace forward from ``initial`` (default: :func:`initial_live`); the live set at the end.

    On a trace that is complete from an empty allocator, ``replay(snap, d, {})`` equals the
    snapshot's active blocks (checked on a real snapshot in the tests).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "alloc", "addr": 0, "size": 7, "stream": 0, "frames": []}]]})
        >>> replay(s, 0, {})
        {0: (7, 0)}
    """
    live = dict(initial_live(snap, device) if initial is None else initial)
    t = snap.trace(device)
    for a, addr, size, sid in zip(t.actions, t.addrs, t.sizes, t.stack_ids):
        if a == _ALLOC:
            live[addr] = (size, sid)
        elif a == _FREE_DONE:
            live.pop(addr, None)
    return live


@dataclass
class StackGroup:
    """Bytes and allocation count of one stack key (innermost frame first).

    Example:
        >>> StackGroup(("m.py:1:f",), 512, 1).to_dict()["bytes"]
        512
    """

    stack: tuple[str, ...]
    bytes: int
    count: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> StackGroup(("a",), 1, 1).to_dict()
            {'stack': ['a'], 'bytes': 1, 'count': 1}
        """
        return {"stack": list(self.stack), "bytes": self.bytes, "count": self.count}


def _group(
    snap: Snapshot,
    live: Iterable[tuple[int, int]],
    depth: int,
    filter_internal: bool,
    top: int | None,
) -> list[StackGroup]:
    cache: dict[int, tuple[str, ...]] = {}
    acc: dict[tuple[str, ...], list[int]] = {}
    stacks = snap.stacks
    for size, sid in live:
        key = cache.get(sid)
        if key is None:
            key = cache[sid] = stack_key(stacks[sid], depth, filter_internal)
        slot = acc.get(key)
        if slot is None:
            acc[key] = [size, 1]
        else:
            slot[0] += size
            slot[1] += 1
    groups = [StackGroup(k, v[0], v[1]) for k, v in acc.items()]
    groups.sort(key=lambda g: (-g.bytes, g.stack))
    return groups[:top] if top else groups


@dataclass
class DevicePeak:
    """Peak of allocated (requested) bytes over one device's trace and what was live then.

    ``peak_index`` counts trace entries applied (0 = before the first entry);
    ``consistent`` is False when the trace contradicts the end state (the running total,
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
        (300, 300, 0, 100)
    """
    devices = _select_devices(snap, device)
    out: list[DevicePeak] = []
    for dev in devices:
        end = _end_live(snap, dev)
        t = snap.trace(dev)
        n = len(t)
        running = _running_allocated(snap, dev, end)
        initial, end_total = running[0], running[-1]
        peak = max(running)
        k = running.index(peak)
        live = _live_at(snap, dev, end, k)
        consistent = initial >= 0 and min(running) >= 0
        peak_time = None
        if n and t.has_time:
            peak_time = t.times[min(k, n) - 1] if k > 0 else t.times[0]
        out.append(
            DevicePeak(
                device=dev,
                name=snap.device_name(dev),
                peak_allocated_bytes=peak,
                peak_index=k,
                peak_time_us=peak_time,
                initial_allocated_bytes=initial,
                end_allocated_bytes=end_total,
                trace_entries=n,
                consistent=consistent,
                at_peak=_group(snap, live.values(), depth, filter_internal, top),
                at_end=_group(snap, end.values(), depth, filter_internal, top),
            )
        )
    return PeakReport(out)


# ---------------------------------------------------------------------------------- diff
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
            groups.append({g.stack: g for g in _group(snap, blocks, depth, filter_internal, None)})
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


# ---------------------------------------------------------------------------------- trace
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


def _reserved_deltas(snap: Snapshot, device: int) -> list[int]:
    t = snap.trace(device)
    return list(map(mul, t.sizes, map(_SIGN_RESERVED.__getitem__, t.actions)))


def _start_totals(snap: Snapshot, device: int) -> tuple[int, int]:
    # only the total is needed here: sum the active blocks without interning their stacks
    end_alloc = sum(
        b.requested_size
        for s in snap.segments
        if s.device == device
        for b in s.blocks
        if b.state != "inactive"
    )
    end_res = sum(s.total_size for s in snap.segments if s.device == device)
    return end_alloc - sum(_deltas(snap, device)), end_res - sum(_reserved_deltas(snap, device))


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
    devices = _select_devices(snap, device)
    for dev in devices:
        t = snap.trace(dev)
        if not len(t):
            continue
        alloc, res = _start_totals(snap, dev)
        cache: dict[int, str] = {}
        names = t.action_names
        stacks = snap.stacks
        for i, (a, addr, size, stream, tm, sid) in enumerate(
            zip(t.actions, t.addrs, t.sizes, t.streams, t.times, t.stack_ids)
        ):
            if a == _ALLOC:
                alloc += size
            elif a == _FREE_DONE:
                alloc -= size
            elif a == _SEG_ALLOC or a == _SEG_MAP:
                res += size
            elif a == _SEG_FREE or a == _SEG_UNMAP:
                res -= size
            label = cache.get(sid)
            if label is None:
                key = stack_key(stacks[sid], depth, filter_internal)
                label = cache[sid] = " <- ".join(key)
            yield TraceRow(
                dev, i, tm if t.has_time else None, names[a], addr, size, stream, alloc, res, label
            )


# ---------------------------------------------------------------------------------- flame
def _flame_label(f: Frame) -> str:
    return f.label().replace(";", ":").replace(" ", "_")


def folded_stacks(
    snap: Snapshot,
    *,
    at: str = "end",
    device: int | None = None,
    filter_internal: bool = True,
    include_state: bool = False,
) -> list[str]:
    """Folded stacks (``root;...;leaf bytes``) for flamegraph.pl, speedscope, inferno.

    ``at="end"``: active blocks at the snapshot's end (their rounded block sizes);
    ``at="peak"``: allocations live at each device's peak (requested sizes). Each line starts
    with the device name (and the block state if ``include_state``); identical stacks are summed.
    ``device`` selects one device index (one with no data raises
    :class:`~torchmem.errors.InvalidInputError`).

    Example:
        >>> from torchmem.model.snapshot import Snapshot, Segment, Block, Frame
        >>> s = Snapshot()
        >>> st = (Frame("m.py", 4, "fwd"), Frame("t.py", 9, "main"))
        >>> s.segments = [Segment(0, 0, 2048, blocks=[Block(0, 1024, 1000, "active_allocated", st),
        ...                                           Block(1024, 1024, 1024, "active_allocated", st)])]
        >>> folded_stacks(s)
        ['cuda:0;t.py:9:main;m.py:4:fwd 2048']
    """
    if at not in ("end", "peak"):
        raise InvalidInputError(f"folded_stacks: at={at!r}; expected 'end' or 'peak'")
    acc: dict[str, int] = {}
    cache: dict[tuple[int, int], str] = {}

    def path(dev: int, sid: int) -> str:
        p = cache.get((dev, sid))
        if p is None:
            frames = snap.stacks[sid]
            kept = [f for f in frames if not (filter_internal and is_internal_frame(f))]
            parts = [snap.device_name(dev).replace(";", ":")]
            parts += [_flame_label(f) for f in reversed(kept)] or ["<no stack>"]
            p = cache[(dev, sid)] = ";".join(parts)
        return p

    devices = _select_devices(snap, device)
    for dev in devices:
        if at == "end":
            for seg in snap.segments:
                if seg.device != dev:
                    continue
                for b in seg.blocks:
                    if b.state == "inactive":
                        continue
                    line = path(dev, snap.intern_stack(b.frames))
                    if include_state:
                        a, _, rest = line.partition(";")
                        line = f"{a};{b.state};{rest}"
                    acc[line] = acc.get(line, 0) + b.size
        else:
            end = _end_live(snap, dev)
            running = _running_allocated(snap, dev, end)
            k = running.index(max(running))
            for size, sid in _live_at(snap, dev, end, k).values():
                line = path(dev, sid)
                acc[line] = acc.get(line, 0) + size
    return [f"{k} {v}" for k, v in sorted(acc.items()) if v > 0]


# ---------------------------------------------------------------------------------- OOM
@dataclass
class OomEvent:
    """An out-of-memory entry explained.

    ``verdict`` is ``"fragmentation"`` when the device's free bytes plus the allocator's cached
    free bytes would have covered the request (memory existed but not as one contiguous block),
    else ``"device full"``. ``cached_free_bytes`` is reserved minus allocated at that moment;
    ``largest_free_block`` is known only when nothing changed between the OOM and the snapshot.

    Example:
        >>> OomEvent(0, "cuda:0", 5, None, 1024, 0, 0, 0, 0, None, "device full", "").to_dict()["verdict"]
        'device full'
    """

    device: int
    name: str
    index: int
    time_us: int | None
    requested_bytes: int
    device_free_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    cached_free_bytes: int
    largest_free_block: int | None
    verdict: str
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> "explanation" in OomEvent(0, "cuda:0", 0, None, 0, 0, 0, 0, 0, None, "", "").to_dict()
            True
        """
        return asdict(self)


def oom_report(snap: Snapshot) -> list[OomEvent]:
    """Explain every ``oom`` trace entry: requested, free, and fragmentation vs a full device.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [{"device": 0, "address": 0,
        ...     "total_size": 41943040, "stream": 0, "blocks": [
        ...       {"address": 0, "size": 10485760, "requested_size": 10485760, "state": "active_allocated"},
        ...       {"address": 10485760, "size": 10485760, "requested_size": 0, "state": "inactive"},
        ...       {"address": 20971520, "size": 10485760, "requested_size": 10485760, "state": "active_allocated"},
        ...       {"address": 31457280, "size": 10485760, "requested_size": 0, "state": "inactive"}]}],
        ...   "device_traces": [[{"action": "oom", "device_free": 1048576, "size": 20971520,
        ...                       "stream": 0, "frames": []}]]})
        >>> o = oom_report(s)[0]
        >>> o.requested_bytes, o.cached_free_bytes, o.largest_free_block, o.verdict
        (20971520, 20971520, 10485760, 'fragmentation')
    """
    out: list[OomEvent] = []
    for dev in snap.devices:
        t = snap.trace(dev)
        if not t.count("oom"):
            continue
        oom_code = t.action_names.index("oom")
        alloc, res = _start_totals(snap, dev)
        n = len(t)
        changing = {_ALLOC, _FREE_DONE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP}
        last_change = max((i for i in range(n) if t.actions[i] in changing), default=-1)
        segs = [s for s in snap.segments if s.device == dev]
        end_free = sum(s.free_size for s in segs)
        end_alloc_blocks = sum(s.allocated_size for s in segs)
        largest_end = max((b.size for s in segs for b in s.blocks if b.state == "inactive"), default=0)
        for i in range(n):
            a, size = t.actions[i], t.sizes[i]
            if a == _ALLOC:
                alloc += size
            elif a == _FREE_DONE:
                alloc -= size
            elif a in (_SEG_ALLOC, _SEG_MAP):
                res += size
            elif a in (_SEG_FREE, _SEG_UNMAP):
                res -= size
            elif a == oom_code:
                free = t.addrs[i]
                exact = i > last_change
                if exact:
                    cached = end_free
                    largest: int | None = largest_end
                    alloc_now = end_alloc_blocks
                else:
                    cached = max(0, res - alloc)
                    largest = None
                    alloc_now = alloc
                if free + cached >= size:
                    verdict = "fragmentation"
                    why = (
                        f"{_fb(size)} was requested; the device had {_fb(free)} free and the "
                        f"allocator held {_fb(cached)} cached free, enough in total, but no single "
                        "free block or new segment could hold the request"
                    )
                    if largest is not None:
                        why += f" (largest cached free block: {_fb(largest)})"
                    why += (
                        ". Consider PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a smaller "
                        "max_split_size_mb."
                    )
                else:
                    verdict = "device full"
                    why = (
                        f"{_fb(size)} was requested but only {_fb(free)} was free on the device "
                        f"and {_fb(cached)} cached free in the allocator: the device is truly full; "
                        "reduce the batch size or the model's memory."
                    )
                out.append(
                    OomEvent(
                        device=dev,
                        name=snap.device_name(dev),
                        index=i,
                        time_us=t.times[i] if t.has_time else None,
                        requested_bytes=size,
                        device_free_bytes=free,
                        allocated_bytes=alloc_now,
                        reserved_bytes=res,
                        cached_free_bytes=cached,
                        largest_free_block=largest,
                        verdict=verdict,
                        explanation=why,
                    )
                )
    return out
