"""Summaries of an event trace: peak, top operators/modules, categories, iterations (no torch).

Everything here reads a :class:`~torchmem.model.trace.Trace` (from a live tracker's ``.trace``
or from :func:`~torchmem.io.tmtrace.load_trace`) and returns plain data.

Definitions:
  * *allocated*: the sum of the sizes of all storages an operator (or module) created.
  * *live at the peak*: the storages alive at the event where the device's live bytes first reach
    their maximum, grouped by the operator / module / category / phase that allocated them. The
    peak is named by its trace entry ``#N``, numbered as ``torchmem trace FILE`` prints the
    device's entries (0-based), the numbering of ``torchmem peak`` and the viewer too.
  * *iteration k*: the events between step marker k-1 and step marker k (``Event.step == k``);
    its *peak* is the highest live byte count inside it, its *retained growth* is live bytes at
    its end minus live bytes at its start. Steady training shows growth ~0 after the first
    iterations; a leak shows the same positive growth every iteration.
  * *leak suspect*: the live bytes at the ends of all complete iterations trend upwards, by the
    rule of :func:`~torchmem.analysis.leak_trend` (warm-up iterations excluded, a robust slope,
    thresholds above the loop's own noise); ``growth`` holds the trend and the call sites and
    modules that keep growing (:func:`~torchmem.analysis.growth`). In torchmem 0.1 the rule
    was "every iteration after the first grew"; a steady leak is flagged by both, a noisy clean
    loop by neither, and a leak that starts late only by the trend.

Example:
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K, Category as C, Phase as P
    >>> tr = Trace()
    >>> _ = tr.append(K.ALLOC, 0, "cpu", 100, 1, category=C.PARAMETER)
    >>> _ = tr.append(K.ALLOC, 1, "cpu", 40, 2, op="aten::mm", module="Net.fc", phase=P.FORWARD,
    ...               category=C.ACTIVATION)
    >>> _ = tr.append(K.FREE, 2, "cpu", 40, 2)
    >>> _ = tr.append(K.MARK, 3, "cpu", 0, 0, op="step")
    >>> s = summarize_trace(tr)
    >>> s.peak, s.categories_at_peak, s.top_ops_allocated[0][:2]
    ({'cpu': 140}, {'parameter': 100, 'activation': 40}, ('aten::mm', 40))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.analysis._growth import NO_SITE as _NO_SITE
from torchmem.analysis._growth import GrowthReport, growth, growth_from_series
from torchmem.io.convert import event_entry_index
from torchmem.model.events import Category, EventKind, Phase
from torchmem.model.trace import Trace

__all__ = ["IterationStat", "TraceSummary", "summarize", "summarize_trace", "main_device"]

_ALLOC = int(EventKind.ALLOC)
_FREE = int(EventKind.FREE)
_MARK = int(EventKind.MARK)
_CATS = [c.label for c in Category]
_PHASES = [p.label for p in Phase]


@dataclass
class IterationStat:
    """One iteration (between step markers) on the summary's device.

    Example:
        >>> IterationStat(0, 10, 0, 4, 4, 6).retained_growth
        4
    """

    step: int
    peak_bytes: int
    start_bytes: int
    end_bytes: int
    retained_growth: int
    allocated_bytes: int
    complete: bool = True  # False for the events after the last step marker


@dataclass
class TraceSummary:
    """The result of :func:`summarize_trace`; ``to_dict()`` gives JSON-ready data.

    Lists of tops hold ``(name, bytes, count)`` tuples, largest first. Where the peak is:
    ``peak_index`` is the trace entry ``#N`` (0-based) as ``torchmem trace FILE`` prints it for
    the device, the one numbering every command and the viewer use (see
    :func:`~torchmem.io.convert.event_entry_index`); ``peak_seq`` is the row of the
    :class:`~torchmem.model.trace.Trace` (``Event.seq``, for :meth:`~torchmem.model.trace.Trace.event`).
    Both are -1 when nothing was allocated.

    ``leak_suspect`` is ``growth.leak``: the trend of live bytes at iteration ends (see
    :func:`~torchmem.analysis.leak_trend`). ``to_dict()["growth"]`` holds that trend:
    ``leak``, ``bytes_per_iteration`` (the robust slope, rounded), ``slope``, ``noise`` (bytes),
    ``start_step`` (the first iteration that grew, -1 if none), ``growth_bytes`` (from the onset
    to the last iteration), ``warmup`` (iterations not judged), ``steps`` and ``end_bytes`` (the
    live bytes at each complete iteration's end) and ``growing``: the call sites and modules that
    keep growing, each with ``grouping`` (``"call_site"`` or ``"module"``), ``name``,
    ``bytes_per_iteration``, ``slope``, ``start_step``, ``growth_bytes`` and ``end_bytes``.

    ``aggregated`` is ``None`` for a trace that holds every event; for an aggregated run
    (:mod:`torchmem.model.aggregate`) it says how many events were folded and what detail is
    kept (``detail``): every figure above covers the whole run, and ``peak_seq``/``peak_index``
    number the rows of the saved (compacted) trace.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> summarize_trace(Trace()).to_dict()["events"]
        0
    """

    device: str | None
    events: int
    steps: int
    peak: dict[str, int]
    peak_seq: int
    peak_time_ns: int
    final_live: dict[str, int]
    top_ops_allocated: list[tuple[str, int, int]] = field(default_factory=list)
    top_modules_allocated: list[tuple[str, int, int]] = field(default_factory=list)
    top_ops_at_peak: list[tuple[str, int, int]] = field(default_factory=list)
    top_modules_at_peak: list[tuple[str, int, int]] = field(default_factory=list)
    categories_at_peak: dict[str, int] = field(default_factory=dict)
    phases_at_peak: dict[str, int] = field(default_factory=dict)
    top_stacks_at_peak: list[tuple[str, int, int]] = field(default_factory=list)
    iterations: list[IterationStat] = field(default_factory=list)
    leak_suspect: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    peak_index: int = -1
    top_threads_allocated: list[tuple[str, int, int]] = field(default_factory=list)
    growth: GrowthReport | None = None
    aggregated: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bytes are ints).

        Example:
            >>> from torchmem.model.trace import Trace
            >>> sorted(summarize_trace(Trace()).to_dict())[:3]
            ['aggregated', 'categories_at_peak', 'device']
        """
        d = asdict(self)
        for key in (
            "top_ops_allocated",
            "top_modules_allocated",
            "top_ops_at_peak",
            "top_modules_at_peak",
            "top_stacks_at_peak",
            "top_threads_allocated",
        ):
            d[key] = [{"name": n, "bytes": b, "count": c} for n, b, c in d[key]]
        d["growth"] = self.growth.to_dict() if self.growth is not None else None
        return d

    def _repr_html_(self) -> str:
        """Rich display in Jupyter: the overview and the tables live at the peak.

        Example:
            >>> from torchmem.model.trace import Trace
            >>> from torchmem.model.events import EventKind as K
            >>> tr = Trace(); _ = tr.append(K.ALLOC, 0, "cpu", 2048, 1, op="aten::zeros")
            >>> html = summarize_trace(tr)._repr_html_()
            >>> "2.00 KiB" in html and "<td>aten::zeros</td>" in html, "growing" in html
            (True, False)
        """
        return _summary_html(self)


def _summary_html(self: TraceSummary) -> str:
    from torchmem.model._html import fmt_bytes, html_block, html_table

    dev = self.device or "-"
    over = html_table(
        "overview",
        ["device", "events", "steps", "peak", "live at the end", "leak suspect"],
        [[dev, self.events, self.steps, fmt_bytes(self.peak.get(dev, 0)),
          fmt_bytes(self.final_live.get(dev, 0)), "yes" if self.leak_suspect else "no"]],
    )
    cats = html_table("live at the peak, by category", ["category", "bytes"],
                      [[c, fmt_bytes(n)] for c, n in self.categories_at_peak.items() if n])

    rows = [[g.grouping.replace("_", " "), g.name, fmt_bytes(g.bytes_per_iteration),
             g.start_step] for g in (self.growth.growing if self.growth else [])]
    growing = html_table("growing over iterations (live bytes at iteration ends trend up)",
                         ["by", "name", "per iteration", "from step"], rows) if rows else ""

    def tops(title: str, first: str, rows: list[tuple[str, int, int]]) -> str:
        return html_table(title, [first, "bytes", "count"],
                          [[n, fmt_bytes(b), k] for n, b, k in rows])

    note = html_table("aggregated run", ["detail"], [[self.aggregated["detail"]]]) if (
        self.aggregated) else ""
    return html_block(
        f"torchmem trace summary ({dev}, peak {fmt_bytes(self.peak.get(dev, 0))})",
        over, note, cats,
        tops("operators live at the peak", "operator", self.top_ops_at_peak),
        tops("modules live at the peak", "module", self.top_modules_at_peak),
        tops("call sites live at the peak", "call site", self.top_stacks_at_peak),
        growing,
    )


def _top(groups: dict[str, list[int]], top: int) -> list[tuple[str, int, int]]:
    items = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return [(name, v[0], v[1]) for name, v in items[:top]]


def main_device(trace: Trace, peaks: dict[str, int]) -> str | None:
    """The device a summary is about: the highest peak (a CUDA device wins a tie).

    Example:
        >>> from torchmem.model.trace import Trace
        >>> main_device(Trace(), {"cpu": 10, "cuda:0": 10})
        'cuda:0'
    """
    if not peaks:
        return None
    return max(peaks, key=lambda d: (peaks[d], d.startswith("cuda"), d))


def summarize_trace(trace: Trace, top: int = 10, device: str | None = None) -> TraceSummary:
    """Summarise ``trace`` for one device (default: the device with the highest peak).

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace()
        >>> for step in range(3):     # a leak: 8 bytes kept every iteration
        ...     _ = tr.append(K.ALLOC, step, "cpu", 8, step + 1, op="aten::ones", step=step)
        ...     _ = tr.append(K.MARK, step, "cpu", 0, 0, op="step", step=step)
        >>> [it.retained_growth for it in summarize_trace(tr).iterations], summarize_trace(tr).leak_suspect
        ([8, 8, 8], True)
    """
    if trace.aggregate is not None:
        return _summarize_aggregated(trace, top, device)
    end_live, peak_list, _ = trace._scan()  # one pass for the peaks and the final live bytes
    peaks = dict(zip(trace.devices, peak_list))
    if device is None:
        device = main_device(trace, peaks)
    n = len(trace)
    want = trace.devices.index(device) if device in trace.devices else -1
    strings = trace.strings
    kind, dev, nbytes = trace.kind, trace.device, trace.nbytes
    op_col, mod_col = trace.op, trace.module
    step_col = trace.step

    # pass 1: allocated per op/module, the peak on the device, iterations
    ops: dict[int, list[int]] = {}
    mods: dict[int, list[int]] = {}
    live = 0
    peak = 0
    peak_seq = -1
    iters: list[IterationStat] = []
    it_start = 0
    it_peak = 0
    it_alloc = 0
    cur_step = step_col[0] if n else 0
    steps = 0
    # the initial state (ALLOC events at time 0 before any operator) belongs before iteration 0
    initial_end = -1
    while (
        initial_end + 1 < n
        and kind[initial_end + 1] == _ALLOC
        and trace.time_ns[initial_end + 1] == 0
        and op_col[initial_end + 1] == 0
    ):
        initial_end += 1
    # the loop below only visits this device's events: end the initial state at its last one
    while initial_end >= 0 and dev[initial_end] != want:
        initial_end -= 1
    for i in range(n):
        k = kind[i]
        if k == _MARK:
            if strings[op_col[i]] == "step":
                iters.append(
                    IterationStat(step_col[i], it_peak, it_start, live, live - it_start, it_alloc)
                )
                steps += 1
                it_start = it_peak = live
                it_alloc = 0
                cur_step = step_col[i] + 1
            continue
        if dev[i] != want:
            continue
        b = nbytes[i]
        if k == _ALLOC:
            live += b
            it_alloc += b
            if live > peak:
                peak = live
                peak_seq = i
            if live > it_peak:
                it_peak = live
            o = op_col[i]
            if o:
                v = ops.get(o)
                if v is None:
                    ops[o] = [b, 1]
                else:
                    v[0] += b
                    v[1] += 1
            m = mod_col[i]
            v = mods.get(m)
            if v is None:
                mods[m] = [b, 1]
            else:
                v[0] += b
                v[1] += 1
        else:
            live -= b
        if i == initial_end:
            it_start = it_peak = live
            it_alloc = 0
    if it_alloc or (iters and live != it_start):
        iters.append(
            IterationStat(cur_step, it_peak, it_start, live, live - it_start, it_alloc, False)
        )

    # pass 2 (_at_peak): what is alive at the peak
    trend = growth(trace, device, top=top) if device is not None else GrowthReport(None)
    return TraceSummary(
        device=device,
        events=n,
        steps=steps,
        peak=peaks,
        final_live=dict(zip(trace.devices, end_live)),
        top_ops_allocated=_top({strings[k]: v for k, v in ops.items()}, top),
        top_modules_allocated=_top({(strings[k] or "(no module)"): v for k, v in mods.items()}, top),
        iterations=iters,
        leak_suspect=trend.leak,
        metadata=dict(trace.metadata),
        top_threads_allocated=by_thread(trace, want, top),
        growth=trend,
        **_at_peak(trace, want, peak_seq, top),
    )


def _at_peak(trace: Trace, want: int, peak_seq: int, top: int) -> dict[str, Any]:
    """The summary's fields about the peak (row ``peak_seq`` of device index ``want``)."""
    g = live_groups(trace, want, peak_seq)
    at_stacks = {k: v for k, v in g["call_site"].items() if k != NO_SITE}
    return {
        "peak_seq": peak_seq,
        "peak_time_ns": trace.time_ns[peak_seq] if peak_seq >= 0 else 0,
        "top_ops_at_peak": _top(g["operator"], top),
        "top_modules_at_peak": _top(g["module"], top),
        "categories_at_peak": _by_bytes(g["category"]),
        "phases_at_peak": _by_bytes(g["phase"]),
        "top_stacks_at_peak": _top(at_stacks, top),
        "peak_index": event_entry_index(trace, peak_seq) if peak_seq >= 0 else -1,
    }


def _summarize_aggregated(trace: Trace, top: int, device: str | None) -> TraceSummary:
    """:func:`summarize_trace` of an aggregated trace: the folded figures plus the held rows."""
    agg = trace.aggregate
    if agg.fold_row < len(trace):  # rows past the state (a streamed file): fold a copy
        agg = agg.copy()
        agg.fold(trace)
    devices = trace.devices
    peaks = {d: agg.peak_of(i) for i, d in enumerate(devices)}
    if device is None:
        device = main_device(trace, peaks)
    want = devices.index(device) if device in devices else -1
    strings = trace.strings
    held: dict[tuple[int, int, int], list[int]] = {}
    for k, d, b, o, m, t in zip(trace.kind, trace.device, trace.nbytes, trace.op, trace.module,
                                trace.thread):
        if k == _ALLOC and d == want:
            v = held.setdefault((o, m, t), [0, 0])
            v[0] += b
            v[1] += 1
    ops: dict[str, list[int]] = {}
    mods: dict[str, list[int]] = {}
    threads: dict[str, list[int]] = {}
    for source in (agg.allocated(want), held):
        for (o, m, t), (b, c) in source.items():
            for table, key, on in ((ops, strings[o], o), (mods, strings[m] or "(no module)", 1),
                                   (threads, trace.threads[t] or "(unknown)", 1)):
                if on:
                    v = table.setdefault(key, [0, 0])
                    v[0] += b
                    v[1] += c
    st = agg.devs[want] if 0 <= want < len(agg.devs) else None
    peak_seq = st.peak_row if st is not None else -1
    steps, rows = agg.iteration_table(want)
    iters = [IterationStat(*row) for row in rows]
    trend = GrowthReport(None)
    if device is not None:
        ends = [it.end_bytes for it in iters if it.complete]
        trend = growth_from_series(device, list(agg.marks), ends, agg.group_series(want), top=top)
    thread_rows = _top(threads, top) if len(trace.threads) > 2 and len(threads) > 1 else []
    return TraceSummary(
        device=device,
        events=agg.events,
        steps=steps,
        peak=peaks,
        final_live={d: agg.devs[i].live if i < len(agg.devs) else 0 for i, d in enumerate(devices)},
        top_ops_allocated=_top(ops, top),
        top_modules_allocated=_top(mods, top),
        iterations=iters,
        leak_suspect=trend.leak,
        metadata=dict(trace.metadata),
        top_threads_allocated=thread_rows,
        growth=trend,
        aggregated=agg.describe(),
        **_at_peak(trace, want, peak_seq, top),
    )


def by_thread(trace: Trace, device: int, top: int = 10) -> list[tuple[str, int, int]]:
    """Bytes and storages allocated on device index ``device`` per thread, largest first;
    empty unless more than one thread allocated (a one-thread run needs no such table).

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace()
        >>> _ = tr.append(K.ALLOC, 0, "cpu", 64, 1, thread="MainThread")
        >>> by_thread(tr, 0)
        []
        >>> _ = tr.append(K.ALLOC, 1, "cpu", 256, 2, thread="loader")
        >>> by_thread(tr, 0)
        [('loader', 256, 1), ('MainThread', 64, 1)]
    """
    if len(trace.threads) <= 2:  # "" and at most one name
        return []
    total: dict[int, int] = {}
    count: dict[int, int] = {}
    for k, d, b, t in zip(trace.kind, trace.device, trace.nbytes, trace.thread):
        if k == _ALLOC and d == device:
            total[t] = total.get(t, 0) + b
            count[t] = count.get(t, 0) + 1
    if len(total) < 2:
        return []
    names = trace.threads
    return _top({(names[t] or "(unknown)"): [b, count[t]] for t, b in total.items()}, top)


#: The call-site group of storages recorded without a Python stack (``stacks=False``).
NO_SITE = _NO_SITE
#: The groupings of :func:`live_groups`, in the order tables show them.
GROUPINGS = ("category", "module", "operator", "call_site", "phase")


def _by_bytes(groups: dict[str, list[int]]) -> dict[str, int]:
    return {k: v[0] for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])}


def live_groups(trace: Trace, device: int, stop: int) -> dict[str, dict[str, list[int]]]:
    """The storages live on device index ``device`` after event ``stop``, grouped every way.

    Returns ``{grouping: {name: [bytes, storages]}}`` for each of :data:`GROUPINGS`: the
    category, module (``"(no module)"``), operator (``"(initial state)"`` for storages made
    outside any operator), innermost call site (``"file:line:function"``, :data:`NO_SITE`
    without a stack) and phase of the allocation. ``stop=-1``: nothing is live yet.

    Example:
        >>> from torchmem.model.events import EventKind as K, Category as C
        >>> tr = Trace()
        >>> _ = tr.append(K.ALLOC, 0, "cpu", 100, 1, category=C.PARAMETER)
        >>> _ = tr.append(K.ALLOC, 1, "cpu", 40, 2, op="aten::mm", category=C.ACTIVATION)
        >>> _ = tr.append(K.FREE, 2, "cpu", 40, 2)
        >>> live_groups(tr, 0, 1)["category"], live_groups(tr, 0, 2)["operator"]
        ({'parameter': [100, 1], 'activation': [40, 1]}, {'(initial state)': [100, 1]})
    """
    kind, dev, nbytes, sid_col = trace.kind, trace.device, trace.nbytes, trace.storage
    alive: dict[int, int] = {}
    for i in range(stop + 1):
        if dev[i] != device:
            continue
        k = kind[i]
        if k == _ALLOC:
            alive[sid_col[i]] = i
        elif k == _FREE:
            alive.pop(sid_col[i], None)
    strings, stacks = trace.strings, trace.stacks
    op_col, mod_col, cat_col, phase_col, stack_col = (
        trace.op, trace.module, trace.category, trace.phase, trace.stack
    )
    out: dict[str, dict[str, list[int]]] = {name: {} for name in GROUPINGS}
    for i in alive.values():
        b = nbytes[i]
        st = stack_col[i]
        keys = (
            _CATS[cat_col[i]],
            strings[mod_col[i]] or "(no module)",
            strings[op_col[i]] or "(initial state)",
            stacks[st][-1] if st >= 0 and stacks[st] else NO_SITE,
            _PHASES[phase_col[i]],
        )
        for name, key in zip(GROUPINGS, keys):
            v = out[name].setdefault(key, [0, 0])
            v[0] += b
            v[1] += 1
    return out


#: The short name, as in ``torchmem.analysis.summarize(trace)``.
summarize = summarize_trace
