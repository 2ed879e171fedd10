"""Many ranks, one view: :func:`merge_ranks` merges the traces of a distributed job (no torch).

Each rank of a ``torch.distributed`` job writes its own trace with the metadata ``rank``,
``world_size`` and ``job_id`` (``local_rank`` and ``backend`` too). :func:`merge_ranks` reduces
every trace on its own to a :class:`RankStats` (a few dictionaries), then drops it, so 64 traces
of a million events each are merged with one trace in memory at a time. The figures of a rank are
those of :func:`~torchmem.analysis.summarize` on that rank's trace (its device: the one with the
highest peak), computed with C-level passes over the columns instead of a Python loop per event.

Definitions:
  * *peak*, *live at the end*, *iterations* (retained growth per iteration): as in
    :func:`~torchmem.analysis.summarize`; ``growth_per_iteration`` is the robust trend of live
    bytes at iteration ends (:func:`~torchmem.analysis.leak_trend`), ``leak`` its verdict.
  * *imbalance*: the highest peak over the lowest (``None`` when the lowest is 0).
  * *collective operations*: allocations by an operator named like a collective (``c10d``,
    ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``all_to_all``, see
    :func:`is_collective`) or in the category ``communication``, one row per operator.
  * *why ranks differ*: the heaviest rank's bytes live at its peak minus the lightest rank's,
    per category, module, call site and operator, and per ``combined`` key (the three
    together). The rows of a grouping sum to the difference exactly; a grouping's
    ``named_share`` is the part carried by the rows shown that have a name (not ``other``,
    ``(no module)``, ``(no call site)`` or ``(initial state)``; a combined key has a name when
    any of its three parts has one), over the difference. Offsetting rows (the lightest rank
    holds more of something) can take a share past 100%.

Example:
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K, Category as C
    >>> def rank(r, extra):
    ...     tr = Trace({"rank": r, "world_size": 2, "job_id": "j"})
    ...     _ = tr.append(K.ALLOC, 0, "cpu", 100, 1, category=C.PARAMETER)
    ...     _ = tr.append(K.ALLOC, 1, "cpu", extra, 2, op="c10d::allgather_", module="Net",
    ...                   category=C.COMMUNICATION)
    ...     return tr
    >>> m = merge_ranks([rank(0, 300), rank(1, 100)])
    >>> [r.peak for r in m.ranks], m.imbalance, m.heaviest, m.lightest
    ([400, 200], 2.0, 0, 1)
    >>> d = m.difference; d.bytes, [(r.name, r.delta) for r in d.groupings["category"].rows]
    (200, [('communication', 200), ('parameter', 0)])
"""

from __future__ import annotations

import operator
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate, compress, repeat
from typing import Any

from torchmem.analysis._growth import NO_MODULE, NO_SITE, leak_trend
from torchmem.analysis.summary import IterationStat, main_device
from torchmem.errors import InvalidInputError
from torchmem.model.events import Category, EventKind, Phase
from torchmem.model.trace import Trace

__all__ = [
    "RankStats", "CollectiveRow", "AttributionRow", "Attribution", "RankDifference",
    "RankMerge", "rank_stats", "merge_ranks", "is_collective", "GROUPINGS", "ATTRIBUTED",
    "UNNAMED", "SEP",
]

_CATS = [c.label for c in Category]
_PHASES = [p.label for p in Phase]
_COMM = int(Category.COMMUNICATION)
_ALLOC, _FREE, _MARK = int(EventKind.ALLOC), int(EventKind.FREE), int(EventKind.MARK)
#: kind byte -> sign of the live-byte change (as a signed byte), for bytes.translate
_SIGN = bytes([1, 255, 0]) + bytes(253)
_IS_ALLOC = bytes([1, 0, 0]) + bytes(253)
_IS_FREE = bytes([0, 1, 0]) + bytes(253)
_IS_COMM_CAT = bytes(_COMM) + b"\x01" + bytes(255 - _COMM)
_COLLECTIVE_WORDS = (
    "c10d", "all_gather", "allgather", "reduce_scatter", "reducescatter", "all_reduce",
    "allreduce", "broadcast", "all_to_all", "alltoall",
)
#: The groupings of the difference between ranks, in the order tables show them.
GROUPINGS = ("category", "module", "call_site", "operator")
#: Per grouping, the bucket of bytes that carry no name.
UNNAMED = {
    "category": "other", "module": NO_MODULE, "call_site": NO_SITE, "operator": "(initial state)",
}
#: The key joining a storage's category, module and call site (the ``combined`` grouping).
SEP = " | "
UNNAMED["combined"] = SEP.join((UNNAMED["category"], NO_MODULE, NO_SITE))
#: The groupings of the difference: :data:`GROUPINGS` and ``combined`` (category, module and
#: call site together: named when any of the three is).
ATTRIBUTED = (*GROUPINGS, "combined")


def _and(a: bytes, b: bytes) -> bytes:
    """Row-wise AND of two 0/1 byte masks of one length (as big integers: one C operation)."""
    return (int.from_bytes(a, "little") & int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _or(a: bytes, b: bytes) -> bytes:
    """Row-wise OR of two 0/1 byte masks of one length."""
    return (int.from_bytes(a, "little") | int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _rows(mask: bytes) -> list[int]:
    """The rows where a 0/1 byte mask is 1 (fast when they are few)."""
    out = []
    find = mask.find
    pos = find(1)
    while pos >= 0:
        out.append(pos)
        pos = find(1, pos + 1)
    return out


def is_collective(op: str | None) -> bool:
    """True for an operator named like a collective operation (``c10d::allreduce_``,
    ``_c10d_functional::all_gather_into_tensor``, ``reduce_scatter_tensor``...).

    Example:
        >>> is_collective("c10d::allreduce_"), is_collective("aten::mm"), is_collective(None)
        (True, False, False)
    """
    low = (op or "").lower()
    return any(w in low for w in _COLLECTIVE_WORDS)


@dataclass
class CollectiveRow:
    """One collective operator on one rank: bytes it allocated over the run (``count``
    storages) and bytes of it live at the rank's peak; ``category`` is the category most of its
    bytes were recorded in.

    Example:
        >>> CollectiveRow("c10d::allgather_", "communication", 4096, 2, 2048).live_at_peak
        2048
    """

    operator: str
    category: str
    allocated: int
    count: int
    live_at_peak: int


@dataclass
class RankStats:
    """One rank's figures (the result of :func:`rank_stats`); bytes are on ``device``.

    ``at_peak[grouping]`` maps every category, module, call site and operator to the bytes live
    at the peak (all of them, not a top); ``at_peak["combined"]`` does the same for the
    category, module and call site together (``"activation | Net.fc | train.py:9:step"``). ``cut_short`` is the reason when the rank's trace was
    cut short (the run was killed), else ``None``.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> rank_stats(Trace({"rank": 0, "world_size": 1})).peak
        0
    """

    rank: int
    world_size: int
    job_id: str | None
    device: str | None
    events: int
    peak: int
    peak_seq: int
    peak_time_ns: int
    final_live: int
    peaks: dict[str, int]
    final_lives: dict[str, int]
    iterations: list[IterationStat]
    growth_per_iteration: int
    leak: bool
    at_peak: dict[str, dict[str, int]]
    collectives: list[CollectiveRow]
    local_rank: int | None = None
    backend: str | None = None
    start_unix_ns: int | None = None
    cut_short: str | None = None
    name: str | None = None
    #: where the peak was reached: the phase, step counter, operator and module of the
    #: allocation that made it (``None`` without a peak)
    peak_phase: str | None = None
    peak_step: int | None = None
    peak_op: str | None = None
    peak_module: str | None = None

    @property
    def peak_at(self) -> str:
        """Where the peak was reached, in words (``"-"`` without a peak).

        Example:
            >>> from torchmem.model.trace import Trace
            >>> from torchmem.model.events import EventKind as K
            >>> tr = Trace({"rank": 0, "world_size": 1})
            >>> _ = tr.append(K.ALLOC, 0, "cpu", 8, 1, op="aten::mm", module="Net.fc", step=2)
            >>> rank_stats(tr).peak_at
            'other, step 2, aten::mm in Net.fc'
        """
        if self.peak_phase is None:
            return "-"
        where = f"{self.peak_phase}, step {self.peak_step}"
        if self.peak_op:
            where += f", {self.peak_op}"
            if self.peak_module:
                where += f" in {self.peak_module}"
        return where

    @property
    def steps(self) -> int:
        """Complete iterations (step markers) on this rank.

        Example:
            >>> from torchmem.model.trace import Trace
            >>> rank_stats(Trace({"rank": 0, "world_size": 1})).steps
            0
        """
        return sum(1 for it in self.iterations if it.complete)


@dataclass
class AttributionRow:
    """One name in the difference between the heaviest and the lightest rank at their peaks.

    Example:
        >>> AttributionRow("communication", 300, 100, 200, 1.0).delta
        200
    """

    name: str
    heavy: int
    light: int
    delta: int
    share: float | None


@dataclass
class Attribution:
    """The difference between two ranks split by one grouping. ``rows`` (largest change first)
    plus ``rest`` (the names past the top) sum to the difference; ``named`` is the sum of the
    rows with a name, ``named_share`` that over the difference (``None`` when it is 0).

    Example:
        >>> Attribution("category", [AttributionRow("gradient", 8, 0, 8, 1.0)], 0, 8, 1.0).named
        8
    """

    grouping: str
    rows: list[AttributionRow]
    rest: int
    named: int
    named_share: float | None


@dataclass
class RankDifference:
    """Why the heaviest rank uses more than the lightest: ``bytes`` is their peaks' difference,
    ``groupings`` splits it by category, module, call site and operator.

    Example:
        >>> RankDifference(0, 1, 10, 4, 6, {}).bytes
        6
    """

    heavy_rank: int
    light_rank: int
    heavy_peak: int
    light_peak: int
    bytes: int
    groupings: dict[str, Attribution]
    #: where each rank's peak was reached (:attr:`RankStats.peak_at`)
    heavy_at: str | None = None
    light_at: str | None = None
    #: whether the two peaks were reached in different phases or steps: the split then
    #: compares what each rank held at a different moment of its step
    different_moments: bool = False

    @property
    def named_share(self) -> float | None:
        """The share of the difference named by category, module or call site (the
        ``combined`` grouping's ``named_share``; ``None`` when there is no difference).

        Example:
            >>> RankDifference(0, 1, 10, 4, 6, {}).named_share is None
            True
        """
        a = self.groupings.get("combined")
        return a.named_share if a is not None else None


@dataclass
class RankMerge:
    """The merged view of a job's rank traces (the result of :func:`merge_ranks`).

    ``ranks`` is sorted by rank; ``missing`` lists the ranks of ``range(world_size)`` that were
    not given and ``cut_short`` those whose trace was cut short: the merge is ``complete`` only
    when both are empty. ``heaviest``/``lightest`` are ranks (highest and lowest peak),
    ``imbalance`` their peaks' ratio, ``difference`` what makes them differ.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> m = merge_ranks([Trace({"rank": 1, "world_size": 2})])
        >>> m.missing, m.complete
        ([0], False)
    """

    job_id: str | None
    world_size: int
    ranks: list[RankStats]
    missing: list[int]
    cut_short: list[int]
    heaviest: int | None
    lightest: int | None
    imbalance: float | None
    difference: RankDifference | None
    top: int = 10

    @property
    def complete(self) -> bool:
        """True when every rank of the world is here and none was cut short.

        Example:
            >>> from torchmem.model.trace import Trace
            >>> merge_ranks([Trace({"rank": 0, "world_size": 1})]).complete
            True
        """
        return not self.missing and not self.cut_short

    def per_rank(self, grouping: str) -> dict[str, dict[int, int]]:
        """Bytes live at each rank's peak per name of ``grouping`` (one of :data:`GROUPINGS`),
        names with the most bytes on any rank first, at most ``top`` of them.

        Example:
            >>> from torchmem.model.trace import Trace
            >>> merge_ranks([Trace({"rank": 0, "world_size": 1})]).per_rank("category")
            {}
        """
        if grouping not in GROUPINGS:
            raise InvalidInputError(
                f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}"
            )
        names: dict[str, int] = {}
        for r in self.ranks:
            for name, b in r.at_peak[grouping].items():
                if b > names.get(name, -1):
                    names[name] = b
        keep = sorted(names, key=lambda k: (-names[k], k))[: self.top]
        return {k: {r.rank: r.at_peak[grouping].get(k, 0) for r in self.ranks} for k in keep}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bytes as ints; per-name tables keyed by rank as a string; each
        rank's ``iterations`` column-wise: ``{"step": [...], "retained_growth": [...], ...}``).

        Example:
            >>> from torchmem.model.trace import Trace
            >>> d = merge_ranks([Trace({"rank": 0, "world_size": 1})]).to_dict()
            >>> d["complete"], d["world_size"], d["missing"]
            (True, 1, [])
        """
        ranks = []
        for r in self.ranks:
            d = asdict(r)
            d["steps"] = r.steps
            # column-wise: one list per field (thousands of iterations per rank stay small)
            d["iterations"] = {k: [getattr(it, k) for it in r.iterations]
                               for k in IterationStat.__dataclass_fields__}
            d["at_peak"] = {g: dict(sorted(v.items(), key=lambda kv: -kv[1])[: self.top])
                            for g, v in r.at_peak.items()}
            ranks.append(d)
        diff = asdict(self.difference) if self.difference is not None else None
        if diff is not None and self.difference is not None:
            diff["named_share"] = self.difference.named_share
        return {
            "format": "torchmem-rank-merge",
            "job_id": self.job_id,
            "world_size": self.world_size,
            "ranks_present": [r.rank for r in self.ranks],
            "missing": list(self.missing),
            "cut_short": list(self.cut_short),
            "complete": self.complete,
            "heaviest": self.heaviest,
            "lightest": self.lightest,
            "imbalance": self.imbalance,
            "per_rank": {g: {k: {str(rank): b for rank, b in v.items()}
                             for k, v in self.per_rank(g).items()} for g in GROUPINGS},
            "difference": diff,
            "ranks": ranks,
        }


def _int_meta(trace: Trace, key: str, where: str) -> int:
    v = trace.metadata.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInputError(
            f"{where}: expected an integer {key!r} in the trace metadata (a rank trace written by "
            f"'torchmem run --nproc-per-node' or torchmem.track(metadata={{'rank': ..., "
            f"'world_size': ...}})), got {v!r}; pass only the rank traces of one job"
        )
    return v


def rank_stats(trace: Trace, *, name: str | None = None) -> RankStats:
    """Reduce one rank's trace to its figures (see the module docstring).

    ``trace.metadata`` must hold integers ``rank`` (``0 <= rank < world_size``) and
    ``world_size`` (``>= 1``); ``name`` (a file name) is used in error messages.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace({"rank": 0, "world_size": 2})
        >>> for step in range(3):                         # 8 bytes kept every iteration
        ...     _ = tr.append(K.ALLOC, step, "cpu", 8, step + 1, op="aten::ones", step=step)
        ...     _ = tr.append(K.MARK, step, "cpu", 0, 0, op="step", step=step)
        >>> s = rank_stats(tr); s.peak, s.final_live, s.growth_per_iteration, s.leak
        (24, 24, 8, True)
        >>> rank_stats(Trace({"world_size": 2}), name="a.tmtrace")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: a.tmtrace: expected an integer 'rank' in the trace ...
    """
    where = name or "trace"
    rank = _int_meta(trace, "rank", where)
    world = _int_meta(trace, "world_size", where)
    if world < 1 or not 0 <= rank < world:
        raise InvalidInputError(
            f"{where}: expected 0 <= rank < world_size and world_size >= 1, got rank {rank} and "
            f"world_size {world}; the trace's metadata is wrong"
        )
    n = len(trace)
    kb = trace.kind.tobytes()
    signs = array("b", kb.translate(_SIGN))
    ndev = len(trace.devices)
    masks: list[Any] = []
    peaks: dict[str, int] = {}
    finals: dict[str, int] = {}
    series_of: dict[str, array[int]] = {}
    for d, dname in enumerate(trace.devices):
        if ndev == 1:
            on: Any = None
            sgn: Any = signs
        else:
            on = bytes(map(operator.eq, trace.device, repeat(d)))
            sgn = map(operator.mul, signs, on)
        series = array("q", accumulate(map(operator.mul, trace.nbytes, sgn)))
        peaks[dname] = max(0, max(series)) if n else 0
        finals[dname] = series[-1] if n else 0
        series_of[dname] = series
        masks.append(on)
    device = main_device(trace, peaks)
    if device is None:
        return RankStats(
            rank, world, _str_meta(trace, "job_id"), None, n, 0, -1, 0, 0, peaks, finals, [], 0,
            False, {g: {} for g in ATTRIBUTED}, [], **_extra(trace, name),
        )
    want = trace.devices.index(device)
    series = series_of[device]
    del series_of
    on = masks[want]
    amask = kb.translate(_IS_ALLOC)
    fmask = kb.translate(_IS_FREE)
    if on is not None:
        amask = _and(amask, on)
        fmask = _and(fmask, on)
    peak = peaks[device]
    peak_seq = series.index(peak) if peak > 0 else -1
    iterations = _iterations(trace, series, amask, want)
    ends = [it.end_bytes for it in iterations if it.complete]
    trend = leak_trend(ends)
    alive = _alive(trace, amask, fmask, peak_seq, want)
    at_peak = _groups(trace, alive)
    at: dict[str, Any] = {}
    if peak_seq >= 0:
        ev = trace.event(peak_seq)
        at = {"peak_phase": ev.phase.label, "peak_step": ev.step, "peak_op": ev.op,
              "peak_module": ev.module}
    return RankStats(
        rank, world, _str_meta(trace, "job_id"), device, n, peak, peak_seq,
        trace.time_ns[peak_seq] if peak_seq >= 0 else 0, finals[device], peaks, finals,
        iterations, trend.bytes_per_iteration, trend.leak, at_peak,
        _collectives(trace, amask, alive), **_extra(trace, name), **at,
    )


def _str_meta(trace: Trace, key: str) -> str | None:
    v = trace.metadata.get(key)
    return None if v is None else str(v)


def _extra(trace: Trace, name: str | None) -> dict[str, Any]:
    md = trace.metadata
    local = md.get("local_rank")
    start = md.get("start_unix_ns")
    cut = md.get("cut_short")
    return {
        "local_rank": local if isinstance(local, int) and not isinstance(local, bool) else None,
        "backend": _str_meta(trace, "backend"),
        "start_unix_ns": start if isinstance(start, int) and not isinstance(start, bool) else None,
        "cut_short": str(cut) if cut else None,
        "name": name,
    }


def _iterations(trace: Trace, series: array[int], amask: bytes, want: int) -> list[IterationStat]:
    """The iterations exactly as :func:`~torchmem.analysis.summarize` counts them, from the
    live-byte series: resets at the end of the initial state and at each step marker."""
    n = len(trace)
    kind, op_col, step_col, nbytes = trace.kind, trace.op, trace.step, trace.nbytes
    step_ids = {i for i, s in enumerate(trace.strings) if s == "step"}
    kb = trace.kind.tobytes()
    markers = []
    pos = kb.find(b"\x02")
    while pos >= 0:
        if op_col[pos] in step_ids:
            markers.append(pos)
        pos = kb.find(b"\x02", pos + 1)
    # the initial state: ALLOC events at time 0 outside any operator, ended at this device's last
    initial_end = -1
    time_col, dev = trace.time_ns, trace.device
    while (initial_end + 1 < n and kind[initial_end + 1] == _ALLOC
           and time_col[initial_end + 1] == 0 and op_col[initial_end + 1] == 0):
        initial_end += 1
    while initial_end >= 0 and dev[initial_end] != want:
        initial_end -= 1

    def alloc_in(a: int, b: int) -> int:  # on-device bytes allocated in rows a..b-1
        return sum(compress(nbytes[a:b], amask[a:b]))

    def span_peak(a: int, b: int, floor: int) -> int:  # highest live in rows a..b-1
        return max(floor, max(series[a:b])) if b > a else floor

    out: list[IterationStat] = []
    start_row, it_start = (initial_end + 1, series[initial_end]) if initial_end >= 0 else (0, 0)
    cur_step = step_col[0] if n else 0
    for m in markers:
        live = series[m]
        out.append(IterationStat(step_col[m], span_peak(start_row, m + 1, it_start), it_start,
                                 live, live - it_start, alloc_in(start_row, m + 1)))
        start_row, it_start, cur_step = m + 1, live, step_col[m] + 1
    live = series[n - 1] if n else 0
    it_alloc = alloc_in(start_row, n)
    if it_alloc or (out and live != it_start):
        out.append(IterationStat(cur_step, span_peak(start_row, n, it_start), it_start, live,
                                 live - it_start, it_alloc, False))
    return out


def _alive(trace: Trace, amask: bytes, fmask: bytes, stop: int, want: int) -> list[int]:
    """Rows of the allocations live on the device after row ``stop`` (-1: none)."""
    if stop < 0:
        return []
    ids = trace.storage[: stop + 1]
    a = amask[: stop + 1]
    born = set(compress(ids, a))
    if len(born) != a.count(1):  # a storage id used twice: follow the events one by one
        live: dict[int, int] = {}
        kind, dev = trace.kind, trace.device
        for i in range(stop + 1):
            if dev[i] == want:
                if kind[i] == _ALLOC:
                    live[ids[i]] = i
                elif kind[i] == _FREE:
                    live.pop(ids[i], None)
        return sorted(live.values())
    born.difference_update(compress(ids, fmask[: stop + 1]))
    return _rows(_and(a, bytes(map(born.__contains__, ids))))


def _groups(trace: Trace, rows: list[int]) -> dict[str, dict[str, int]]:
    strings, stacks = trace.strings, trace.stacks
    sizes = list(map(trace.nbytes.__getitem__, rows))
    sites = [s[-1] if s else NO_SITE for s in stacks]
    names: dict[str, Any] = {
        "category": lambda k: _CATS[k],
        "module": lambda k: strings[k] or NO_MODULE,
        "call_site": lambda k: sites[k] if k >= 0 else NO_SITE,
        "operator": lambda k: strings[k] or UNNAMED["operator"],
    }
    cols = {"category": trace.category, "module": trace.module, "call_site": trace.stack,
            "operator": trace.op}
    out: dict[str, dict[str, int]] = {}
    for g in GROUPINGS:
        acc: dict[int, int] = {}
        get = acc.get
        for k, b in zip(map(cols[g].__getitem__, rows), sizes):
            acc[k] = get(k, 0) + b
        table: dict[str, int] = {}
        for k, b in acc.items():  # two codes may share a name (an empty stack, a repeated string)
            name = names[g](k)
            table[name] = table.get(name, 0) + b
        out[g] = table
    combined: dict[str, int] = {}
    cat, mod, stack = trace.category, trace.module, trace.stack
    names_of: dict[tuple[int, int, int], str] = {}
    for i, b in zip(rows, sizes):
        key = (cat[i], mod[i], stack[i])
        name = names_of.get(key)
        if name is None:
            name = names_of[key] = SEP.join(
                (names["category"](key[0]), names["module"](key[1]), names["call_site"](key[2])))
        combined[name] = combined.get(name, 0) + b
    out["combined"] = combined
    return out


def _collectives(trace: Trace, amask: bytes, alive: list[int]) -> list[CollectiveRow]:
    flag = [1 if is_collective(s) else 0 for s in trace.strings]
    sel = trace.category.tobytes().translate(_IS_COMM_CAT)
    if any(flag):
        sel = _or(sel, bytes(map(flag.__getitem__, trace.op)))
    sel = _and(sel, amask)
    if not sel.count(1):
        return []
    at_peak = bytearray(len(trace))
    for i in alive:
        at_peak[i] = 1
    # the selected allocations keyed by operator code * 256 + category code; a few keys are
    # summed with C-level passes, many with one Python pass
    keys = list(map(operator.add, map(operator.mul, compress(trace.op, sel), repeat(256)),
                    compress(trace.category, sel)))
    sizes = list(compress(trace.nbytes, sel))
    live_sel = bytes(compress(at_peak, sel))
    count = Counter(keys)
    total: dict[int, int] = {}
    live: dict[int, int] = {}
    if len(count) <= 16:
        for k in count:
            m = bytes(map(k.__eq__, keys))
            total[k] = sum(compress(sizes, m))
            live[k] = sum(compress(sizes, _and(m, live_sel)))
    else:
        for k, b, a in zip(keys, sizes, live_sel):
            total[k] = total.get(k, 0) + b
            if a:
                live[k] = live.get(k, 0) + b
    rows: dict[str, list[Any]] = {}
    for k, b in total.items():
        name = trace.strings[k >> 8] or UNNAMED["operator"]
        v = rows.get(name)
        if v is None:
            v = rows[name] = [0, 0, 0, {}]
        v[0] += b
        v[1] += count[k]
        v[2] += live.get(k, 0)
        v[3][_CATS[k & 255]] = v[3].get(_CATS[k & 255], 0) + b
    return sorted(
        (CollectiveRow(k, max(v[3], key=v[3].get), v[0], v[1], v[2]) for k, v in rows.items()),
        key=lambda r: (-r.allocated, r.operator),
    )


def _attribute(heavy: RankStats, light: RankStats, top: int) -> RankDifference:
    total = heavy.peak - light.peak
    groupings = {}
    for g in ATTRIBUTED:
        h, lo = heavy.at_peak[g], light.at_peak[g]
        rows = [AttributionRow(k, h.get(k, 0), lo.get(k, 0), h.get(k, 0) - lo.get(k, 0), None)
                for k in h.keys() | lo.keys()]
        rows.sort(key=lambda r: (-abs(r.delta), -r.heavy, r.name))
        shown, past = rows[:top], rows[top:]
        for r in shown:
            r.share = r.delta / total if total else None
        named = sum(r.delta for r in shown if r.name != UNNAMED[g])
        groupings[g] = Attribution(g, shown, sum(r.delta for r in past), named,
                                   named / total if total else None)
    moved = (heavy.peak_phase, heavy.peak_step) != (light.peak_phase, light.peak_step)
    return RankDifference(heavy.rank, light.rank, heavy.peak, light.peak, total, groupings,
                          heavy.peak_at, light.peak_at, moved and light.peak_phase is not None)


def merge_ranks(
    traces: Iterable[Trace | RankStats], *, names: Sequence[str] | None = None, top: int = 10
) -> RankMerge:
    """Merge the traces of one job's ranks (any order; each is reduced by :func:`rank_stats`
    and then dropped, so pass a generator to hold one trace at a time). Ranks already reduced
    (a :class:`RankStats`, e.g. from worker processes) are taken as they are.

    ``names`` (file names, in the order of ``traces``) are used in error messages; ``top`` is
    how many names each per-rank table and attribution keeps. Raises
    :class:`~torchmem.errors.InvalidInputError` for a trace without ``rank``/``world_size``
    metadata, traces of different jobs (``job_id``) or world sizes, and a rank given twice. A
    rank of the world not given is listed in ``missing``, and the merge is then not ``complete``.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> merge_ranks([Trace({"rank": 0, "world_size": 2}), Trace({"rank": 0, "world_size": 2})],
        ...             names=["a.rank0.tmtrace", "b.rank0.tmtrace"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: rank 0 is given twice (a.rank0.tmtrace and b.rank0...
    """
    if not isinstance(top, int) or top < 1:
        raise InvalidInputError(f"top must be an int >= 1, got {top!r}")
    stats: dict[int, RankStats] = {}
    first: RankStats | None = None
    for i, trace in enumerate(traces):
        name = names[i] if names is not None and i < len(names) else f"trace {i}"
        s = trace if isinstance(trace, RankStats) else rank_stats(trace, name=name)
        if s.name is None:
            s.name = name
        if first is None:
            first = s
        elif (s.job_id, s.world_size) != (first.job_id, first.world_size):
            raise InvalidInputError(
                f"{name} is not from the same job as {first.name}: job_id {s.job_id!r} and "
                f"world_size {s.world_size} against job_id {first.job_id!r} and world_size "
                f"{first.world_size}; merge the rank traces of one job only"
            )
        if s.rank in stats:
            raise InvalidInputError(
                f"rank {s.rank} is given twice ({stats[s.rank].name} and {name}); pass each "
                "rank's trace once"
            )
        stats[s.rank] = s
        del trace  # hold one trace at a time when ``traces`` is a generator
    if first is None:
        raise InvalidInputError(
            "expected at least one rank trace (NAME.rank{R}.tmtrace), got none"
        )
    ranks = [stats[r] for r in sorted(stats)]
    heavy = max(ranks, key=lambda r: (r.peak, -r.rank))
    light = min(ranks, key=lambda r: (r.peak, r.rank))
    return RankMerge(
        job_id=first.job_id,
        world_size=first.world_size,
        ranks=ranks,
        missing=[r for r in range(first.world_size) if r not in stats],
        cut_short=[r.rank for r in ranks if r.cut_short],
        heaviest=heavy.rank,
        lightest=light.rank,
        imbalance=heavy.peak / light.peak if light.peak > 0 else None,
        difference=_attribute(heavy, light, top) if len(ranks) > 1 else None,
        top=top,
    )
