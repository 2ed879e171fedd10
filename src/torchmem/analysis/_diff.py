"""What grew and shrank between two runs: two snapshots, or two tracker traces.

Snapshots (:func:`snapshot_diff`) are compared by stack, per device, at the end (the blocks
allocated in each end state) or at the peak (what was live when each trace's allocated bytes
peaked, in requested bytes as ``torchmem peak`` counts them). Tracker traces
(:func:`trace_diff`) are compared at one point of each run (the peak by default, the end, or
the peak of iteration N) by category, module, operator, call site and phase, and iteration by
iteration. :func:`diff` takes either pair. Every delta is ``after - before`` (signed), and rows
are sorted by the size of the change, largest first.

Example:
    >>> from torchmem.model.snapshot import Snapshot, Segment, Block, Frame
    >>> a, b = Snapshot(), Snapshot()
    >>> b.segments = [Segment(0, 0, 2048, blocks=[Block(0, 2048, 2048, "active_allocated",
    ...                                                 (Frame("m.py", 3, "fwd"),))])]
    >>> [(r.stack, r.delta_bytes) for r in diff(a, b).rows]
    [(('m.py:3:fwd',), 2048)]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.analysis.frames import group_by_stack
from torchmem.analysis.replay import DeviceReplay
from torchmem.analysis.summary import (
    GROUPINGS,
    IterationStat,
    live_groups,
    main_device,
    summarize_trace,
)
from torchmem.errors import InvalidInputError
from torchmem.io.convert import event_entry_index
from torchmem.model.events import EventKind
from torchmem.model.snapshot import Snapshot
from torchmem.model.trace import Trace

__all__ = [
    "DiffRow", "SnapshotDiff", "GroupDelta", "IterationDelta", "TraceDiff", "diff",
    "snapshot_diff", "trace_diff", "parse_at",
]


class _Change:
    """``delta_bytes`` of a row with ``before_bytes`` and ``after_bytes`` (a mixin)."""

    before_bytes: int
    after_bytes: int

    @property
    def delta_bytes(self) -> int:
        """``after_bytes - before_bytes``.

        Example:
            >>> DiffRow(0, ("a",), 30, 10, 2, 1).delta_bytes, GroupDelta("x", 5, 8, 1, 1).delta_bytes
            (-20, 3)
        """
        return self.after_bytes - self.before_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the row's fields, with ``delta_bytes``.

        Example:
            >>> sorted(GroupDelta("x", 5, 2, 1, 1).to_dict())
            ['after_bytes', 'after_count', 'before_bytes', 'before_count', 'delta_bytes', 'name']
        """
        d = asdict(self)  # type: ignore[call-overload]  # the subclasses are dataclasses
        d["delta_bytes"] = self.delta_bytes
        return d


@dataclass
class DiffRow(_Change):
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the stack as a list).

        Example:
            >>> DiffRow(0, ("a",), 1, 2, 1, 1).to_dict()["delta_bytes"]
            1
        """
        d = super().to_dict()
        d["stack"] = list(self.stack)
        return d


@dataclass
class SnapshotDiff:
    """What grew and shrank between two snapshots, grouped by stack, plus device totals.

    ``at`` is ``"end"`` (allocated blocks of the end states, with reserved-memory and segment
    totals) or ``"peak"`` (what was live at each device's peak; totals hold the peaks and the
    trace entry ``#N`` of each).

    Example:
        >>> SnapshotDiff(rows=[], totals={}).to_dict()
        {'at': 'end', 'totals': {}, 'rows': []}
    """

    rows: list[DiffRow]
    totals: dict[int, dict[str, int]]
    at: str = "end"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> SnapshotDiff([], {0: {"allocated_bytes_delta": 0}}).to_dict()["totals"]
            {'0': {'allocated_bytes_delta': 0}}
        """
        return {
            "at": self.at,
            "totals": {str(k): v for k, v in self.totals.items()},
            "rows": [r.to_dict() for r in self.rows],
        }


def snapshot_diff(
    before: Snapshot,
    after: Snapshot,
    *,
    depth: int = 5,
    filter_internal: bool = True,
    at: str = "end",
) -> SnapshotDiff:
    """Compare two snapshots' allocations, grouped by stack (largest change first).

    ``at="end"`` (the default, as in torchmem 0.1) compares the allocated blocks of the end
    states; totals per device: reserved/allocated deltas and segments only in one of the two
    (by address and size, which is what ``_memory_viz compare`` tries to report).
    ``at="peak"`` compares what was live at each device's peak (requested bytes, replayed from
    the trace as :func:`~torchmem.analysis.peak` does); totals: ``peak_bytes_before`` /
    ``_after`` / ``_delta`` and ``peak_index_before`` / ``_after`` (trace entry ``#N``).

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
    if at == "peak":
        return _snapshot_peak_diff(before, after, depth, filter_internal)
    if at != "end":
        raise InvalidInputError(
            f"snapshots are compared at 'peak' or 'end', got at={at!r}; 'step N' needs two "
            "torchmem traces (.tmtrace), whose events carry the iteration"
        )
    rows: list[DiffRow] = []
    totals: dict[int, dict[str, int]] = {}
    devs = sorted(set(before.devices) | set(after.devices))
    for dev in devs:
        a_live, b_live = ([
            (b.size, snap.intern_stack(b.frames))
            for s in snap.segments
            if s.device == dev
            for b in s.blocks
            if b.state == "active_allocated"
        ] for snap in (before, after))
        rows += _stack_rows(dev, ((before, a_live), (after, b_live)), depth, filter_internal)
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
def _stack_rows(
    dev: int,
    sides: tuple[tuple[Snapshot, list[tuple[int, int]]], tuple[Snapshot, list[tuple[int, int]]]],
    depth: int,
    filter_internal: bool,
) -> list[DiffRow]:
    """Rows of one device: ``(size, stack id)`` pairs of each side grouped by stack, compared."""
    ga, gb = ({g.stack: g for g in group_by_stack(snap, live, depth, filter_internal)}
              for snap, live in sides)
    rows = []
    for key in set(ga) | set(gb):
        x, y = ga.get(key), gb.get(key)
        r = DiffRow(dev, key, x.bytes if x else 0, y.bytes if y else 0, x.count if x else 0,
                    y.count if y else 0)
        if r.delta_bytes or r.before_count != r.after_count:
            rows.append(r)
    return rows


def _snapshot_peak_diff(
    before: Snapshot, after: Snapshot, depth: int, filter_internal: bool
) -> SnapshotDiff:
    rows: list[DiffRow] = []
    totals: dict[int, dict[str, int]] = {}
    for dev in sorted(set(before.devices) | set(after.devices)):
        sides = []
        figures: list[int] = []
        for snap in (before, after):
            if dev in snap.devices:
                r = DeviceReplay(snap, dev)
                k = r.peak_index
                sides.append((snap, list(r.live_at(k).values())))
                figures += [r.allocated[k], k - 1]
            else:
                sides.append((snap, []))
                figures += [0, -1]
        rows += _stack_rows(dev, (sides[0], sides[1]), depth, filter_internal)
        totals[dev] = {
            "peak_bytes_before": figures[0],
            "peak_bytes_after": figures[2],
            "peak_bytes_delta": figures[2] - figures[0],
            "peak_index_before": figures[1],
            "peak_index_after": figures[3],
        }
    rows.sort(key=lambda r: (-abs(r.delta_bytes), r.device, r.stack))
    return SnapshotDiff(rows, totals, at="peak")


# --------------------------------------------------------------------------- tracker traces


def parse_at(spec: str | list[str] | tuple[str, ...]) -> tuple[str, int | None]:
    """Read a comparison point: ``"peak"``, ``"end"`` or ``"step N"`` (also ``step:N``).

    Returns ``(kind, step)``; ``step`` is ``None`` unless ``kind == "step"``. A list of words
    (as the CLI's ``--at step 3`` gives them) is joined first.

    Example:
        >>> parse_at("peak"), parse_at(["step", "3"]), parse_at("step:0")
        (('peak', None), ('step', 3), ('step', 0))
        >>> parse_at("middle")
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: expected the point to compare as 'peak', 'end' or 'step N' (N an iteration number >= 0, as the summary's Iterations table numbers them), got 'middle'
    """
    text = spec if isinstance(spec, str) else " ".join(spec)
    words = text.replace(":", " ").replace("=", " ").split()
    if words in (["peak"], ["end"]):
        return words[0], None
    if len(words) == 2 and words[0] == "step" and words[1].isdigit():
        return "step", int(words[1])
    raise InvalidInputError(
        "expected the point to compare as 'peak', 'end' or 'step N' (N an iteration number "
        f">= 0, as the summary's Iterations table numbers them), got {text!r}"
    )


@dataclass
class GroupDelta(_Change):
    """One group (a category, module, operator, call site or phase) live at the compared point.

    Example:
        >>> g = GroupDelta("activation", 1024, 4096, 2, 8)
        >>> g.delta_bytes, g.to_dict()["delta_bytes"]
        (3072, 3072)
    """

    name: str
    before_bytes: int
    after_bytes: int
    before_count: int
    after_count: int


@dataclass
class IterationDelta:
    """One iteration of the two runs side by side (``None``: that run has no such iteration).

    Example:
        >>> from torchmem.analysis.summary import IterationStat
        >>> d = IterationDelta(1, IterationStat(1, 100, 0, 0, 0, 100), IterationStat(1, 250, 0, 0, 0, 250))
        >>> d.peak_delta, d.to_dict()["peak_bytes_after"]
        (150, 250)
    """

    step: int
    before: IterationStat | None
    after: IterationStat | None

    @property
    def peak_delta(self) -> int:
        """The change of the iteration's peak (a missing side counts as 0).

        Example:
            >>> IterationDelta(0, None, None).peak_delta
            0
        """
        return (self.after.peak_bytes if self.after else 0) - (
            self.before.peak_bytes if self.before else 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: each figure ``_before``, ``_after`` and ``_delta`` (``None`` when
        a run lacks the iteration).

        Example:
            >>> sorted(IterationDelta(0, None, None).to_dict())[:3]
            ['allocated_bytes_after', 'allocated_bytes_before', 'allocated_bytes_delta']
        """
        d: dict[str, Any] = {"step": self.step, "complete": all(
            it.complete for it in (self.before, self.after) if it is not None)}
        for name in ("peak_bytes", "end_bytes", "retained_growth", "allocated_bytes"):
            a = getattr(self.before, name) if self.before else None
            b = getattr(self.after, name) if self.after else None
            d[name + "_before"], d[name + "_after"] = a, b
            d[name + "_delta"] = (b or 0) - (a or 0)
        return d


@dataclass
class TraceDiff:
    """Two tracker traces compared at one point of each run (:func:`trace_diff`).

    ``at`` is ``"peak"``, ``"end"`` or ``"step N"``; ``before_bytes``/``after_bytes`` are the
    live bytes there, ``before_index``/``after_index`` the trace entry ``#N`` of the point
    (numbered as ``torchmem trace`` prints each device's entries; -1: nothing allocated).
    ``groups`` maps each grouping (``category``, ``module``, ``operator``, ``call_site``,
    ``phase``) to its rows, largest change first; ``iterations`` pairs the runs' iterations.

    Example:
        >>> TraceDiff("peak", "cpu", "cpu", 0, 0, -1, -1, 0, 0).to_dict()["live_bytes_delta"]
        0
    """

    at: str
    device_before: str | None
    device_after: str | None
    before_bytes: int
    after_bytes: int
    before_index: int
    after_index: int
    peak_before: int
    peak_after: int
    groups: dict[str, list[GroupDelta]] = field(default_factory=dict)
    iterations: list[IterationDelta] = field(default_factory=list)

    @property
    def delta_bytes(self) -> int:
        """Live bytes at the point, ``after - before``.

        Example:
            >>> TraceDiff("end", "cpu", "cpu", 10, 4, 0, 0, 10, 4).delta_bytes
            -6
        """
        return self.after_bytes - self.before_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict. Keys: ``kind`` (``"trace"``), ``at``, ``device_before``/``_after``,
        ``live_bytes_before``/``_after``/``_delta``, ``entry_before``/``_after`` (trace entry
        ``#N`` of the point), ``peak_bytes_before``/``_after``/``_delta``, ``groups``
        (grouping -> rows of :meth:`GroupDelta.to_dict`) and ``iterations`` (rows of
        :meth:`IterationDelta.to_dict`).

        Example:
            >>> sorted(TraceDiff("peak", "cpu", "cpu", 0, 0, -1, -1, 0, 0).to_dict())[:4]
            ['at', 'device_after', 'device_before', 'entry_after']
        """
        return {
            "kind": "trace",
            "at": self.at,
            "device_before": self.device_before,
            "device_after": self.device_after,
            "live_bytes_before": self.before_bytes,
            "live_bytes_after": self.after_bytes,
            "live_bytes_delta": self.delta_bytes,
            "entry_before": self.before_index,
            "entry_after": self.after_index,
            "peak_bytes_before": self.peak_before,
            "peak_bytes_after": self.peak_after,
            "peak_bytes_delta": self.peak_after - self.peak_before,
            "groups": {k: [g.to_dict() for g in v] for k, v in self.groups.items()},
            "iterations": [it.to_dict() for it in self.iterations],
        }


_ALLOC = int(EventKind.ALLOC)
_FREE = int(EventKind.FREE)


def _point(
    trace: Trace, want: int, kind: str, step: int | None, which: str = "this"
) -> tuple[int, int, int]:
    """``(event, live bytes after it, the run's peak)`` of the compared point on device
    ``want``: the first event reaching the run's peak, the last event, or the first reaching
    iteration ``step``'s own peak. Event -1: no event (nothing live)."""
    kinds, dev, nbytes, steps = trace.kind, trace.device, trace.nbytes, trace.step
    live = peak = 0
    peak_at = last = -1
    sel = sel_at = -1
    for i in range(len(trace)):
        if dev[i] != want:
            continue
        k = kinds[i]
        if k == _ALLOC:
            live += nbytes[i]
        elif k == _FREE:
            live -= nbytes[i]
        else:
            continue
        last = i
        if live > peak:
            peak, peak_at = live, i
        if steps[i] == step and live > sel:
            sel, sel_at = live, i
    if kind == "peak":
        return peak_at, peak, peak
    if kind == "end":
        return last, live, peak
    if sel_at < 0:
        have = sorted({steps[i] for i in range(len(trace)) if dev[i] == want
                       and kinds[i] in (_ALLOC, _FREE)})
        shown = ", ".join(map(str, have[:20])) + (" ..." if len(have) > 20 else "")
        raise InvalidInputError(
            f"step {step} is not in the {which} trace on {trace.devices[want]}; it has "
            "iterations: "
            f"{shown or 'none'} (numbered as the summary's Iterations table)"
        )
    return sel_at, sel, peak


def _device(trace: Trace, device: str | None, which: str) -> str | None:
    if device is None:
        return main_device(trace, trace.peak())
    if device not in trace.devices:
        raise InvalidInputError(
            f"device {device!r} is not in the {which} trace; it has: "
            f"{', '.join(trace.devices) or 'none'}"
        )
    return device


def trace_diff(
    before: Trace, after: Trace, *, at: str = "peak", device: str | None = None
) -> TraceDiff:
    """Compare two tracker traces at one point of each run, group by group and per iteration.

    ``at``: ``"peak"`` (the default: when each run's live bytes first reach their maximum),
    ``"end"`` (after the last event) or ``"step N"`` (when iteration N's live bytes peak;
    iterations are numbered as the summary's Iterations table, from 0). ``device`` picks the
    device in both traces (default: each trace's device with the highest peak). The storages
    live at each point are grouped by category, module, operator, innermost call site and
    phase; each grouping's rows are sorted by the size of their change, largest first.

    Example:
        >>> from torchmem.model.events import EventKind as K, Category as C
        >>> def run(width):
        ...     tr = Trace()
        ...     _ = tr.append(K.ALLOC, 0, "cpu", 100 * width, 1, category=C.PARAMETER)
        ...     _ = tr.append(K.ALLOC, 1, "cpu", 40 * width, 2, op="aten::mm", category=C.ACTIVATION)
        ...     _ = tr.append(K.FREE, 2, "cpu", 40 * width, 2)
        ...     return tr
        >>> d = trace_diff(run(1), run(3))
        >>> d.before_bytes, d.after_bytes, [(g.name, g.delta_bytes) for g in d.groups["category"]]
        (140, 420, [('parameter', 200), ('activation', 80)])
        >>> trace_diff(run(1), run(3), at="end").delta_bytes
        200
    """
    kind, step = parse_at(at)
    sides = []
    for which, tr in (("first", before), ("second", after)):
        if not isinstance(tr, Trace):
            raise InvalidInputError(
                f"trace_diff expected two torchmem Traces (load_trace(path)), got "
                f"{type(tr).__name__} as the {which}; compare snapshots with snapshot_diff"
            )
        dev = _device(tr, device, which)
        want = tr.devices.index(dev) if dev is not None else -1
        seq, live, peak = _point(tr, want, kind, step, which)
        live_at = live_groups(tr, want, seq)
        entry = event_entry_index(tr, seq) if seq >= 0 else -1
        iters = summarize_trace(tr, top=1, device=dev).iterations if dev is not None else []
        sides.append((dev, seq, live, peak, live_at, entry, iters))
    (da, _, la, pa, ga, ea, ia), (db, _, lb, pb, gb, eb, ib) = sides
    groups: dict[str, list[GroupDelta]] = {}
    for name in GROUPINGS:
        x, y = ga[name], gb[name]
        rows = []
        for k in set(x) | set(y):
            (b0, n0), (b1, n1) = x.get(k, (0, 0)), y.get(k, (0, 0))
            rows.append(GroupDelta(k, b0, b1, n0, n1))
        rows.sort(key=lambda g: (-abs(g.delta_bytes), -max(g.before_bytes, g.after_bytes), g.name))
        groups[name] = rows
    by_step_a = {(it.step, it.complete): it for it in ia}
    by_step_b = {(it.step, it.complete): it for it in ib}
    keys = sorted(set(by_step_a) | set(by_step_b), key=lambda k: (not k[1], k[0]))
    iterations = [IterationDelta(k[0], by_step_a.get(k), by_step_b.get(k)) for k in keys]
    label = kind if step is None else f"step {step}"
    return TraceDiff(label, da, db, la, lb, ea, eb, pa, pb, groups, iterations)


def diff(before: Any, after: Any, **options: Any) -> SnapshotDiff | TraceDiff:
    """Compare two runs: two :class:`~torchmem.model.trace.Trace` (:func:`trace_diff`, at the
    peak by default) or two :class:`~torchmem.model.snapshot.Snapshot` (:func:`snapshot_diff`,
    at the end by default as in torchmem 0.1; ``at="peak"`` compares the peaks).

    Example:
        >>> diff(Snapshot(), Snapshot()).rows, diff(Trace(), Trace()).delta_bytes
        ([], 0)
        >>> diff(Trace(), Snapshot())
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: diff compares two traces or two snapshots, got Trace and Snapshot; convert a trace with torchmem.io.snapshot_from_trace to compare it with a snapshot
    """
    if isinstance(before, Trace) and isinstance(after, Trace):
        return trace_diff(before, after, **options)
    if isinstance(before, Snapshot) and isinstance(after, Snapshot):
        return snapshot_diff(before, after, **options)
    raise InvalidInputError(
        f"diff compares two traces or two snapshots, got {type(before).__name__} and "
        f"{type(after).__name__}; convert a trace with torchmem.io.snapshot_from_trace to "
        "compare it with a snapshot"
    )
