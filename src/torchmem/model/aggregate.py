"""Aggregated traces: bounded memory for long runs (plain data, no torch, no file I/O).

A tracker in aggregated mode (``torchmem.track(..., aggregate=True)``, ``torchmem run
--aggregate``) appends its events to a :class:`~torchmem.model.trace.Trace` as usual; an
:class:`Aggregate` attached to the trace consumes them as they are appended and, at step
markers, *folds* finished iterations into running figures and *compacts* the trace: it drops the
rows nobody needs any more, so the trace holds a bounded number of rows however long the run.

What is kept, exactly:

* per device: live and peak bytes (high-water mark), and for every iteration its peak, start,
  end and allocated bytes (the summary's Iterations table);
* counters per (device, operator, module, phase, category, call site, thread) of the dropped
  allocations and frees (bytes and counts; the rows still held are counted when read);
* the live bytes at every iteration end of each call site and module (the leak trend's input);
* the full rows of the peak iteration of every device, of the last ``keep_last`` iterations,
  of every storage still alive (so the tracker can still refine its category and module), of
  every storage alive at a device's peak (so what was live at the peak keeps its final
  category), and both rows of a storage whenever one of them is kept.

Why the kept rows are enough: a storage is kept with both of its events or not at all, so the
live bytes the compacted trace shows at a row are those of a subset of the storages really
alive there; inside a kept iteration that subset is all of them (a storage alive during the peak
iteration is alive at the peak event or has an event in it; one alive during the last
iterations is alive at the end or has an event in them). So the peak, its row, the storages live
at the peak and at the end, by every grouping, are exact in the compacted trace;
``torchmem.analysis.summarize`` adds the folded figures for everything else. The rows of
dropped iterations do not come back: a row-level view (``torchmem trace``, the viewer) of an
aggregated trace shows the kept iterations and the storages alive across them.

Row numbers and storage ids are those of the compacted trace: a storage's id is its ALLOC's
row + 1, as producers write it (a FREE repeats it), renumbered at each compaction;
:meth:`Aggregate.compact` returns the old-to-new row map so that a producer renumbers the rows
it holds (the tracker's live storages). :meth:`Aggregate.original_row` and
:meth:`Aggregate.stable_id` give a row's index and a storage's id in the whole run (what a full
trace would have said), which never change: the tracker hands those to its listeners.

Runs without step markers (an inference loop, data processing), and iterations that run long:
once the iteration in progress has added :attr:`Aggregate.within` rows (default
:data:`DEFAULT_PERIOD`) since it began or since the last compaction, the producer compacts it
*midway* (``compact(trace, midway=True)``): its rows are dropped like a finished iteration's
(counted first), except those of the storages still alive and of those alive at a device's peak
(and marks), so the trace stays bounded however long the run. The peak, the totals, the final
live bytes and the iteration table stay those of the whole run; such an iteration keeps its
live and peak storages' rows, not every row.

Example:
    >>> from torchmem.model.events import EventKind as K
    >>> tr = Trace(); agg = Aggregate(keep_last=1, after=1); tr.aggregate = agg
    >>> for step in range(4):                          # 4 iterations: 8 bytes made, then freed
    ...     a = tr.append(K.ALLOC, 1, "cpu", 8, len(tr) + 1, op="aten::ones", step=step)
    ...     _ = tr.append(K.FREE, 2, "cpu", 8, a + 1, step=step)
    ...     _ = tr.append(K.MARK, 3, "cpu", 0, 0, op="step", step=step)
    ...     _ = agg.fold(tr); _ = agg.compact(tr) if agg.due(tr) else None
    >>> len(tr), agg.events, agg.dropped, [e.step for e in tr.events()]  # the peak's and the last
    (6, 12, 6, [0, 0, 0, 3, 3, 3])
    >>> agg.peak_of(0), list(agg.iteration_table(0)[1])
    (8, [(0, 8, 0, 0, 0, 8, True), (1, 8, 0, 0, 0, 8, True), (2, 8, 0, 0, 0, 8, True), (3, 8, 0, 0, 0, 8, True)])
"""

from __future__ import annotations

import json
from array import array
from itertools import compress
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.events import EventKind
from torchmem.model.trace import COLUMNS, Trace

__all__ = ["Aggregate", "DEFAULT_PERIOD", "DEFAULT_KEEP_LAST", "NO_SITE", "NO_MODULE"]

_ALLOC = int(EventKind.ALLOC)
_FREE = int(EventKind.FREE)
_MARK = int(EventKind.MARK)
#: Rows appended between two compactions (about 12 MiB of columns) once aggregation is on.
DEFAULT_PERIOD = 1 << 18
#: Complete iterations whose every event an aggregated trace keeps, besides the peak's.
DEFAULT_KEEP_LAST = 5
#: The call-site group of allocations recorded without a Python stack.
NO_SITE = "(no call site)"
#: The module group of allocations made outside any module.
NO_MODULE = "(no module)"
_FORMAT = 1


def fold_cells(
    dirty: set[int], live_c: list[int], rec_c: list[int], cell_groups: list[tuple[int, int]],
    live_g: list[int],
) -> set[int]:
    """At an iteration's end: add the change of each cell touched since the last end (``dirty``,
    emptied) to its two groups (a call site's and a module's); returns the groups that changed.

    A *cell* is one (call site, module) pair: an event updates one cell, the groups are updated
    once per iteration (the leak trend's input, here and in ``torchmem.analysis.growth``).

    Example:
        >>> live_g = [0, 0]; dirty = {0}
        >>> fold_cells(dirty, [8], [0], [(0, 1)], live_g), live_g, dirty
        ({0, 1}, [8, 8], set())
    """
    touched = set()
    for c in dirty:
        delta = live_c[c] - rec_c[c]
        if delta:
            rec_c[c] = live_c[c]
            sg, mg = cell_groups[c]
            live_g[sg] += delta
            live_g[mg] += delta
            touched.add(sg)
            touched.add(mg)
    dirty.clear()
    return touched


class _Dev:
    """Running figures of one device (index into the trace's device table)."""

    __slots__ = ("live", "peak", "peak_row", "it_start", "it_peak", "it_alloc", "first_mark",
                 "its")

    def __init__(self, first_mark: int) -> None:
        self.live = self.peak = self.it_start = self.it_peak = self.it_alloc = 0
        self.peak_row = -1
        self.first_mark = first_mark
        # per complete iteration from first_mark on: peak, start, end, allocated bytes
        self.its = (array("q"), array("q"), array("q"), array("q"))

    def to_json(self) -> list[Any]:
        return [self.live, self.peak, self.peak_row, self.it_start, self.it_peak, self.it_alloc,
                self.first_mark, [list(a) for a in self.its]]

    @classmethod
    def from_json(cls, d: list[Any]) -> _Dev:
        st = cls(int(d[6]))
        (st.live, st.peak, st.peak_row, st.it_start, st.it_peak, st.it_alloc) = (
            int(x) for x in d[:6])
        for a, values in zip(st.its, d[7]):
            a.extend(int(v) for v in values)
        return st


class Aggregate:
    """The folded figures of an aggregated trace, and the rules that fold and compact it.

    ``keep_last``: complete iterations kept in full (besides each device's peak iteration);
    ``after``: rows the trace may hold before the first compaction (later compactions happen
    every ``min(after, DEFAULT_PERIOD)`` new rows), at a step marker. A producer calls
    :meth:`fold` after appending a step marker, then :meth:`compact` when :meth:`due` says so,
    and renumbers the rows it holds with the map :meth:`compact` returns; :meth:`fold` again
    before the trace is read or saved. ``events`` counts every event appended so far (held or
    dropped); ``dropped`` those no longer held.

    Example:
        >>> Aggregate(keep_last=2).keep_last, Aggregate(after=100).period
        (2, 100)
        >>> Aggregate(keep_last=-1)
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: keep_last must be an int >= 0 (complete iterations kept in full), got -1
    """

    def __init__(self, keep_last: int = DEFAULT_KEEP_LAST, after: int = DEFAULT_PERIOD) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise InvalidInputError(
                f"keep_last must be an int >= 0 (complete iterations kept in full), got "
                f"{keep_last!r}"
            )
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise InvalidInputError(
                f"after must be an int >= 1 (events held before aggregation starts), got "
                f"{after!r}; pass aggregate=True for the default"
            )
        self.keep_last = keep_last
        self.after = after
        self.period = min(after, DEFAULT_PERIOD)
        self.events = 0
        self.dropped = 0
        self.compactions = 0
        self.fold_row = 0  # rows of the (compacted) trace folded so far
        self.retained = 0  # rows held right after the last compaction
        self.orig = array("q")  # each of those rows' index in the whole run
        self.cur_step = 0
        self.initial = True  # still in the initial state (ALLOC rows at time 0, no operator)
        self.marks = array("q")  # step of each step marker, in order
        self.devs: list[_Dev] = []
        self.counters: dict[tuple[int, ...], list[int]] = {}
        self.pinned: dict[int, set[int]] = {}  # device -> storages alive at its peak
        self.pinned_at: dict[int, int] = {}  # device -> the peak row ``pinned`` is for
        # call sites and modules: cells (device, stack, module) feed groups
        self.cells: dict[int, int] = {}
        self.cell_groups: list[tuple[int, int]] = []
        self.live_c: list[int] = []
        self.rec_c: list[int] = []
        self.owner: dict[int, int] = {}  # live storage -> cell
        self.dirty: set[int] = set()
        self.group_index: dict[tuple[int, str, Any], int] = {}
        self.gnames: list[tuple[int, str, str]] = []  # group -> (device, grouping, name)
        self.live_g: list[int] = []
        self.hist: dict[int, tuple[array[int], array[int]]] = {}
        self._step_op = -1
        #: Rows the iteration in progress may add before a midway compaction (see the module
        #: docstring); set it before the run starts.
        self.within = DEFAULT_PERIOD
        self.iter_start = 0  # the row where the iteration in progress (or its rest) begins

    # ---- folding --------------------------------------------------------------------------
    def _group(self, d: int, grouping: str, key: Any, name: str) -> int:
        g = self.group_index.get((d, grouping, key))
        if g is None:
            g = self.group_index[(d, grouping, key)] = len(self.live_g)
            self.gnames.append((d, grouping, name))
            self.live_g.append(0)
        return g

    def _new_cell(self, trace: Trace, d: int, st: int, m: int) -> int:
        frames = trace.stacks[st] if st >= 0 else ()
        site = frames[-1] if frames else NO_SITE
        self.cell_groups.append((self._group(d, "call_site", site, site),
                                 self._group(d, "module", m, trace.strings[m] or NO_MODULE)))
        self.live_c.append(0)
        self.rec_c.append(0)
        return len(self.live_c) - 1

    def _mark(self, step: int) -> None:
        it = len(self.marks)
        self.marks.append(step)
        for st in self.devs:
            a_peak, a_start, a_end, a_alloc = st.its
            a_peak.append(st.it_peak)
            a_start.append(st.it_start)
            a_end.append(st.live)
            a_alloc.append(st.it_alloc)
            st.it_start = st.it_peak = st.live
            st.it_alloc = 0
        self.cur_step = step + 1
        live_g = self.live_g
        for g in fold_cells(self.dirty, self.live_c, self.rec_c, self.cell_groups, live_g):
            h = self.hist.get(g)
            if h is None:
                h = self.hist[g] = (array("q"), array("q"))
            h[0].append(it)
            h[1].append(live_g[g])

    def fold(self, trace: Trace) -> int:
        """Fold the rows appended since the last call; returns how many.

        Example:
            >>> from torchmem.model.events import EventKind as K
            >>> tr = Trace(); agg = Aggregate()
            >>> _ = tr.append(K.ALLOC, 0, "cpu", 64, 1, op="aten::ones")
            >>> agg.fold(tr), agg.fold(tr), agg.peak_of(0)
            (1, 0, 64)
        """
        stop = len(trace.stack)  # the column appended last: complete rows
        i0 = self.fold_row
        if i0 >= stop:
            return 0
        if self.events == 0 and i0 == 0:
            self.cur_step = trace.step[0]
        if self._step_op < 0 and "step" in trace.strings:
            self._step_op = trace.strings.index("step")
        step_op = self._step_op
        kind, dev, nbytes, sid = trace.kind, trace.device, trace.nbytes, trace.storage
        op, mod, stack, step, time_ns = trace.op, trace.module, trace.stack, trace.step, trace.time_ns
        devs, cells, owner, live_c, dirty = self.devs, self.cells, self.owner, self.live_c, self.dirty
        initial = self.initial
        for i in range(i0, stop):
            k = kind[i]
            if initial and not (k == _ALLOC and time_ns[i] == 0 and op[i] == 0):
                initial = False
            if k == _MARK:
                if op[i] == step_op:
                    self._mark(step[i])
                    self.iter_start = i + 1
                continue
            d = dev[i]
            while d >= len(devs):
                devs.append(_Dev(len(self.marks)))
            st = devs[d]
            b = nbytes[i]
            if k == _ALLOC:
                v = st.live + b
                st.live = v
                st.it_alloc += b
                if v > st.peak:
                    st.peak = v
                    st.peak_row = i
                if v > st.it_peak:
                    st.it_peak = v
                key = ((stack[i] + 1) << 32 | mod[i]) << 16 | d
                c = cells.get(key)
                if c is None:
                    c = cells[key] = self._new_cell(trace, d, stack[i], mod[i])
                live_c[c] += b
                dirty.add(c)
                owner[sid[i]] = c
                if initial:
                    st.it_start = st.it_peak = v
                    st.it_alloc = 0
            elif k == _FREE:
                st.live -= b
                c = owner.pop(sid[i], -1)
                if c >= 0:
                    live_c[c] -= b
                    dirty.add(c)
        self.initial = initial
        self.fold_row = stop
        self.events += stop - i0
        return stop - i0

    # ---- compacting -----------------------------------------------------------------------
    def due(self, trace: Trace) -> bool:
        """True when the trace holds enough new rows to compact (see the class docstring).

        Example:
            >>> Aggregate(after=10).due(Trace())
            False
        """
        n = len(trace.stack)
        if self.compactions == 0:
            return n >= self.after
        return n - self.retained >= self.period

    def midway_at(self) -> int:
        """The trace length at which the iteration in progress is compacted midway (no step
        marker needed): :attr:`within` rows past its start or the last compaction, and not
        before ``after`` rows for a first compaction.

        Example:
            >>> a = Aggregate(after=10); a.within = 100; a.midway_at()
            100
            >>> Aggregate(after=1000).midway_at() == max(1000, DEFAULT_PERIOD)
            True
        """
        at = self.iter_start + self.within
        return at if self.compactions else max(at, self.after)

    def _alive_at(self, trace: Trace, d: int, row: int) -> set[int]:
        """Storages alive on device ``d`` after row ``row`` (exact in a compacted trace: see
        the module docstring)."""
        kind, dev, sid = trace.kind, trace.device, trace.storage
        alive: set[int] = set()
        for i in range(row + 1):
            if dev[i] == d:
                k = kind[i]
                if k == _ALLOC:
                    alive.add(sid[i])
                elif k == _FREE:
                    alive.discard(sid[i])
        return alive

    def compact(self, trace: Trace, midway: bool = False) -> array[int]:
        """Drop the rows no longer needed (folded first); returns the map old row -> new row
        (-1: dropped), for a producer to renumber the rows it holds. ``midway``: the iteration
        in progress is compacted too (see the module docstring), keeping only the rows of
        storages alive now or at a peak, and marks.

        Example:
            >>> from torchmem.model.events import EventKind as K
            >>> tr = Trace(); agg = Aggregate(keep_last=0, after=1)
            >>> _ = tr.append(K.ALLOC, 0, "cpu", 64, 1, op="aten::ones")     # alive: kept
            >>> _ = tr.append(K.MARK, 1, "cpu", 0, 0, op="step", step=0)
            >>> _ = tr.append(K.ALLOC, 2, "cpu", 8, 3, op="aten::ones", step=1)
            >>> _ = tr.append(K.FREE, 3, "cpu", 8, 3, step=1)
            >>> _ = tr.append(K.MARK, 4, "cpu", 0, 0, op="step", step=1)
            >>> _ = agg.fold(tr); list(agg.compact(tr)), len(tr)   # the live storage, the peak's
            ([0, -1, 1, 2, 3], 4)
            >>> tr = Trace(); agg = Aggregate(keep_last=0, after=1)      # no step markers
            >>> for i in range(4):                        # 8 bytes made and freed, 4 times
            ...     a = tr.append(K.ALLOC, 2 * i, "cpu", 8, len(tr) + 1, op="aten::ones")
            ...     _ = tr.append(K.FREE, 2 * i + 1, "cpu", 8, a + 1)
            >>> list(agg.compact(tr, midway=True)), agg.peak_of(0), agg.events  # the peak's kept
            ([0, 1, -1, -1, -1, -1, -1, -1], 8, 8)
        """
        self.fold(trace)
        n = len(trace.stack)
        kind, sid, step = trace.kind, trace.storage, trace.step
        kept_steps = set(self.marks[len(self.marks) - self.keep_last:]) if self.keep_last else set()
        for d, st in enumerate(self.devs):
            if st.peak_row >= 0:
                kept_steps.add(step[st.peak_row])
                if self.pinned_at.get(d) != st.peak_row:
                    self.pinned[d] = self._alive_at(trace, d, st.peak_row)
                    self.pinned_at[d] = st.peak_row
        cur = self.cur_step
        if midway:
            kept_steps.discard(cur)
        held = set(self.owner)
        for pinned in self.pinned.values():
            held |= pinned
        keep = bytearray(n)
        for i in range(n):
            k = kind[i]
            if step[i] in kept_steps or (k == _ALLOC and sid[i] in held) or (
                    midway and k == _MARK and step[i] == cur):
                keep[i] = 1
        for i in range(n):  # a storage is kept with both of its rows, or not at all
            if kind[i] == _FREE:
                a = sid[i] - 1
                if 0 <= a < i and kind[a] == _ALLOC and sid[a] == sid[i]:
                    if keep[i]:
                        keep[a] = 1
                    elif keep[a]:
                        keep[i] = 1
        self._count_dropped(trace, keep, n)
        self.orig = array("q", (self.original_row(i) for i in compress(range(n), keep)))
        pos = array("q", bytes(8 * n))
        j = 0
        for i in range(n):
            if keep[i]:
                pos[i] = j
                j += 1
            else:
                pos[i] = -1
        for name, _code, _size in COLUMNS:
            col: array[Any] = getattr(trace, name)
            col[:] = array(col.typecode, compress(col[:n], keep))
        new_sid = trace.storage
        k2 = trace.kind
        for j2 in range(j):  # a storage's id is its ALLOC's row + 1
            s = new_sid[j2]
            if s > 0 and k2[j2] != _MARK:
                a = s - 1
                if 0 <= a < n and pos[a] >= 0:
                    new_sid[j2] = pos[a] + 1
        self.owner = {int(pos[s - 1]) + 1: c for s, c in self.owner.items()}
        self.pinned = {d: {int(pos[s - 1]) + 1 for s in ss} for d, ss in self.pinned.items()}
        for d, st in enumerate(self.devs):
            if st.peak_row >= 0:
                st.peak_row = int(pos[st.peak_row])
                self.pinned_at[d] = st.peak_row
        self.dropped += n - j
        self.fold_row = self.retained = self.iter_start = j
        self.compactions += 1
        return pos

    def _count_dropped(self, trace: Trace, keep: bytearray, n: int) -> None:
        counters = self.counters
        cols = (trace.kind, trace.device, trace.op, trace.module, trace.phase, trace.category,
                trace.stack, trace.thread, trace.nbytes)
        for i in range(n):
            if keep[i]:
                continue
            k = cols[0][i]
            if k == _MARK:
                continue
            key = (cols[1][i], cols[2][i], cols[3][i], cols[4][i], cols[5][i], cols[6][i],
                   cols[7][i])
            v = counters.get(key)
            if v is None:
                v = counters[key] = [0, 0, 0, 0]
            if k == _ALLOC:
                v[0] += cols[8][i]
                v[1] += 1
            else:
                v[2] += cols[8][i]
                v[3] += 1

    # ---- reading --------------------------------------------------------------------------
    def original_row(self, row: int) -> int:
        """The index in the whole run (a full trace's ``Event.seq``) of the held row ``row``.

        Example:
            >>> Aggregate().original_row(7)
            7
        """
        held = len(self.orig)
        return int(self.orig[row]) if row < held else row + self.dropped

    def stable_id(self, storage: int) -> int:
        """The id a full trace gives the storage whose id in the held rows is ``storage`` (its
        ALLOC's index in the whole run + 1): it never changes while the storage lives.

        Example:
            >>> Aggregate().stable_id(3)
            3
        """
        return self.original_row(storage - 1) + 1 if storage > 0 else storage

    def peak_of(self, device: int) -> int:
        """Peak live bytes of device index ``device`` over the whole run (folded so far).

        Example:
            >>> Aggregate().peak_of(0)
            0
        """
        return self.devs[device].peak if 0 <= device < len(self.devs) else 0

    def iteration_table(self, device: int) -> tuple[int, list[tuple[int, int, int, int, int, int, bool]]]:
        """``(steps, rows)``: the step markers folded, and one row per iteration on device index
        ``device``: ``(step, peak, start, end, retained growth, allocated, complete)``, the
        last one (``complete=False``) for the events after the last step marker, as
        :class:`~torchmem.analysis.summary.IterationStat` holds them.

        Example:
            >>> Aggregate().iteration_table(0)
            (0, [])
        """
        marks = self.marks
        rows: list[tuple[int, int, int, int, int, int, bool]] = []
        if not 0 <= device < len(self.devs):
            return len(marks), [(s, 0, 0, 0, 0, 0, True) for s in marks]
        st = self.devs[device]
        for j in range(st.first_mark):
            rows.append((marks[j], 0, 0, 0, 0, 0, True))
        a_peak, a_start, a_end, a_alloc = st.its
        for j in range(len(a_peak)):
            rows.append((marks[st.first_mark + j], a_peak[j], a_start[j], a_end[j],
                         a_end[j] - a_start[j], a_alloc[j], True))
        if st.it_alloc or (rows and st.live != st.it_start):
            rows.append((self.cur_step, st.it_peak, st.it_start, st.live,
                         st.live - st.it_start, st.it_alloc, False))
        return len(marks), rows

    def group_series(self, device: int) -> dict[int, tuple[str, str, array[int], array[int]]]:
        """The call sites and modules of device index ``device`` whose live bytes changed
        between iteration ends: ``{group: (grouping, name, iteration indexes, live bytes)}``,
        the live bytes at the end of each listed iteration (unlisted: unchanged).

        Example:
            >>> Aggregate().group_series(0)
            {}
        """
        out = {}
        for g, (its, vals) in self.hist.items():
            d, grouping, name = self.gnames[g]
            if d == device:
                out[g] = (grouping, name, its, vals)
        return out

    def allocated(self, device: int) -> dict[tuple[int, int, int], list[int]]:
        """Bytes and count of the dropped allocations on device index ``device`` per
        ``(operator, module, thread)`` string/thread-table indexes (the held rows are not in
        it).

        Example:
            >>> Aggregate().allocated(0)
            {}
        """
        out: dict[tuple[int, int, int], list[int]] = {}
        for (d, o, m, _p, _c, _s, t), v in self.counters.items():
            if d == device and v[1]:
                w = out.setdefault((o, m, t), [0, 0])
                w[0] += v[0]
                w[1] += v[1]
        return out

    def describe(self) -> dict[str, Any]:
        """What an aggregated summary says about the run's detail (JSON-ready).

        Example:
            >>> Aggregate(keep_last=3).describe()["keep_last"]
            3
        """
        return {
            "events": self.events,
            "events_held": self.events - self.dropped,
            "events_folded": self.dropped,
            "compactions": self.compactions,
            "keep_last": self.keep_last,
            "detail": (
                f"aggregated run: {self.dropped} of {self.events} events folded into counters; "
                f"every event kept for each device's peak iteration, the last {self.keep_last} "
                "iterations and the storages alive at the end or at a peak; per-iteration "
                "figures, totals and the leak trend cover the whole run"
            ),
        }

    # ---- files ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The state as JSON-ready data (the ``aggregate`` object of a ``.tmtrace`` header).

        Example:
            >>> a = Aggregate(keep_last=2); Aggregate.from_json(a.to_json()).keep_last
            2
        """
        return {
            "format": _FORMAT,
            "keep_last": self.keep_last,
            "after": self.after,
            "events": self.events,
            "dropped": self.dropped,
            "compactions": self.compactions,
            "fold_row": self.fold_row,
            "retained": self.retained,
            "orig": list(self.orig),
            "cur_step": self.cur_step,
            "initial": self.initial,
            "marks": list(self.marks),
            "devs": [st.to_json() for st in self.devs],
            "counters": [[*k, *v] for k, v in self.counters.items()],
            "pinned": [[d, self.pinned_at.get(d, -1), sorted(s)] for d, s in self.pinned.items()],
            "cells": [[key, *self.cell_groups[c], self.live_c[c], self.rec_c[c]]
                      for key, c in self.cells.items()],  # in cell order (c counts up)
            "owner": [x for sc in self.owner.items() for x in sc],
            "dirty": sorted(self.dirty),
            "groups": [[d, grouping, name, self.live_g[g]] for g, (d, grouping, name)
                       in enumerate(self.gnames)],
            "group_keys": [[k[0], k[1], k[2]] for k in self.group_index],
            "hist": [[g, list(its), list(vals)] for g, (its, vals) in self.hist.items()],
            "within": self.within,
            "iter_start": self.iter_start,
        }

    @classmethod
    def from_json(cls, data: Any) -> Aggregate:
        """Rebuild from :meth:`to_json`'s data; raises :class:`~torchmem.errors.InvalidInputError`
        naming the problem when it is not such data.

        Example:
            >>> Aggregate.from_json({"format": 99})
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: expected aggregate data of format 1 (written by torchmem's aggregated mode), got format 99; upgrade torchmem to read it
        """
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt != _FORMAT:
            raise InvalidInputError(
                f"expected aggregate data of format {_FORMAT} (written by torchmem's aggregated "
                f"mode), got format {fmt!r}; upgrade torchmem to read it"
            )
        try:
            a = cls(int(data["keep_last"]), int(data["after"]))
            for name in ("events", "dropped", "compactions", "fold_row", "retained", "cur_step"):
                setattr(a, name, int(data[name]))
            a.initial = bool(data["initial"])
            a.within = int(data.get("within", DEFAULT_PERIOD))  # absent before midway compaction
            a.iter_start = int(data.get("iter_start", a.fold_row))
            a.orig.extend(int(x) for x in data["orig"])
            a.marks.extend(int(s) for s in data["marks"])
            a.devs = [_Dev.from_json(d) for d in data["devs"]]
            a.counters = {tuple(int(x) for x in row[:7]): [int(x) for x in row[7:11]]
                          for row in data["counters"]}
            for d, at, sids in data["pinned"]:
                a.pinned[int(d)] = {int(s) for s in sids}
                a.pinned_at[int(d)] = int(at)
            for c, (key, sg, mg, lv, rc) in enumerate(data["cells"]):
                a.cells[int(key)] = c
                a.cell_groups.append((int(sg), int(mg)))
                a.live_c.append(int(lv))
                a.rec_c.append(int(rc))
            flat = data["owner"]
            a.owner = {int(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
            a.dirty = {int(c) for c in data["dirty"]}
            for d, grouping, name, lv in data["groups"]:
                a.gnames.append((int(d), str(grouping), str(name)))
                a.live_g.append(int(lv))
            for g, (d, grouping, key) in enumerate(data["group_keys"]):
                a.group_index[(int(d), str(grouping), key if grouping == "call_site" else int(key))] = g
            for g, its, vals in data["hist"]:
                a.hist[int(g)] = (array("q", (int(x) for x in its)), array("q", (int(x) for x in vals)))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise InvalidInputError(
                f"aggregate data is missing or has a bad field ({type(e).__name__}: {e}); "
                "re-record the run with torchmem's aggregated mode"
            ) from None
        return a

    def copy(self) -> Aggregate:
        """An independent copy (a reader folds the rows a streamed file holds past the state).

        Example:
            >>> Aggregate(keep_last=4).copy().keep_last
            4
        """
        return Aggregate.from_json(json.loads(json.dumps(self.to_json())))
