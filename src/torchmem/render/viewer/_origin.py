"""Where each allocation came from, and the figures of a run with no caching allocator behind it.

torchmem's own traces (a ``.tmtrace``, or a snapshot recorded by ``record_history`` on CPU)
know each allocation's category (parameter, gradient, activation, ...), phase and module; the
viewer colours the timeline by category and shows them on hover (:func:`origin_columns`). Such a
run has no caching allocator (every segment is exactly one storage), so reserved, free,
fragmentation and slack figures are all zeros: the Stats tab shows the figures of the storages
themselves instead (:func:`tracked_figures`). No torch, no file I/O.

Example:
    >>> from torchmem.io.convert import snapshot_from_events
    >>> from torchmem.model.events import Category, Event, EventKind
    >>> from torchmem.analysis.replay import DeviceReplay
    >>> snap = snapshot_from_events([
    ...     Event(0, EventKind.ALLOC, 1000, "cpu", 4096, 1, category=Category.PARAMETER),
    ...     Event(1, EventKind.ALLOC, 2000, "cpu", 100, 2, category=Category.ACTIVATION),
    ...     Event(2, EventKind.FREE, 3000, "cpu", 100, 2, category=Category.ACTIVATION)])
    >>> lt = DeviceReplay(snap, 0).lifetimes()
    >>> cat, _phase, _mod = origin_columns(snap.trace(0), lt, [-1] * len(snap.trace(0).texts))
    >>> list(cat)
    [1, 4]
    >>> f = tracked_figures(lt, cat, _phase, _mod, [], array("d", [0.0] * len(snap.trace(0))))
    >>> f["peak_bytes"], f["live_end_bytes"], f["by_category"]["activation"]
    (4196, 4096, {'peak': 100, 'end': 0})
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from torchmem.analysis.replay import Lifetimes
from torchmem.model.events import Category, Phase
from torchmem.model.snapshot import DeviceTrace

__all__ = ["CATEGORY_NAMES", "PHASE_NAMES", "origin_columns", "peak_position", "tracked_figures"]

#: Category labels indexed by the payload's ``al_cat`` code (-1: not known).
CATEGORY_NAMES = [c.label for c in sorted(Category)]
#: Phase labels indexed by the payload's ``al_phase`` code (-1: not known).
PHASE_NAMES = [p.label for p in sorted(Phase)]


def origin_columns(
    t: DeviceTrace, lt: Lifetimes, text_ids: Sequence[int]
) -> tuple[array, array, array]:
    """Per allocation: category code, phase code and module (an index into the payload's texts,
    mapped through ``text_ids`` from the trace's own text table), each -1 when not known.

    Empty columns when the trace records no origin (every PyTorch snapshot).

    Example:
        >>> from torchmem.model.snapshot import Snapshot
        >>> s = Snapshot(); t = s.new_trace(0)
        >>> t.append("alloc", 0, 512, 0, 1, 0, category=Category.GRADIENT, module="fc")
        >>> from torchmem.analysis.replay import DeviceReplay
        >>> cols = origin_columns(t, DeviceReplay(s, 0).lifetimes(), [7])
        >>> [list(c) for c in cols]
        [[3], [-1], [7]]
    """
    cats, phases, mods = t.categories, t.phases, t.modules
    if cats is None or phases is None or mods is None:
        return array("b"), array("b"), array("i")
    n = len(lt.entry)
    al_cat, al_phase, al_mod = array("b", [-1]) * n, array("b", [-1]) * n, array("i", [-1]) * n
    for aid, i in enumerate(lt.entry):
        if i >= 0:  # the alloc entry (or, for a free with no alloc, the free: it repeats them)
            al_cat[aid] = cats[i]
            al_phase[aid] = phases[i]
            m = mods[i]
            al_mod[aid] = text_ids[m] if m >= 0 else -1
    return al_cat, al_phase, al_mod


def peak_position(live: Sequence[int]) -> int:
    """The first position (trace entries applied) where ``live`` bytes are highest.

    The peak's trace entry is ``position - 1`` (0-based, as ``torchmem trace`` numbers them).

    Example:
        >>> peak_position([0, 8, 20, 20, 4])
        2
    """
    return live.index(max(live)) if live else 0


def _add(d: dict[str, dict[str, int]], key: str, field: str, size: int) -> None:
    row = d.setdefault(key, {"peak": 0, "end": 0})
    row[field] += size


def tracked_figures(
    lt: Lifetimes, al_cat: array, al_phase: array, al_mod: array, texts: Sequence[str],
    ev_time: array,
) -> dict[str, Any]:
    """The Stats tab's figures for a run with no caching allocator (one storage per segment).

    ``peak_bytes`` and ``peak_event`` (the 0-based trace entry after which the live bytes peak),
    ``peak_time_s`` (seconds from the first entry), ``live_end_bytes``, ``storages_end``,
    ``allocations`` and ``frees`` (in the trace), ``duration_s``, and the bytes live at the peak
    and at the end ``by_category``, at the peak ``by_phase`` and the ten largest ``modules``
    at the peak. ``texts`` are the payload's texts (module names).

    Example:
        >>> f = tracked_figures(Lifetimes(), array("b"), array("b"), array("i"), [], array("d"))
        >>> f["peak_bytes"], f["peak_event"], f["by_category"]
        (0, None, {})
    """
    live = lt.live_bytes()
    n = len(live) - 1
    p = peak_position(live)
    start, end, size = lt.start, lt.end, lt.size
    by_cat: dict[str, dict[str, int]] = {}
    by_phase: dict[str, int] = {}
    by_mod: dict[str, int] = {}
    has_cat = len(al_cat) == len(size)
    for a in range(len(size)):
        at_peak, at_end = start[a] < p <= end[a], end[a] >= n
        if not (at_peak or at_end):
            continue
        cat = CATEGORY_NAMES[al_cat[a]] if has_cat and al_cat[a] >= 0 else "unknown"
        if at_end:
            _add(by_cat, cat, "end", size[a])
        if at_peak:
            _add(by_cat, cat, "peak", size[a])
            ph = PHASE_NAMES[al_phase[a]] if has_cat and al_phase[a] >= 0 else "unknown"
            by_phase[ph] = by_phase.get(ph, 0) + size[a]
            mod = texts[al_mod[a]] if has_cat and al_mod[a] >= 0 else "(no module)"
            by_mod[mod] = by_mod.get(mod, 0) + size[a]

    def desc(d: dict[str, Any], key: Any) -> dict[str, Any]:  # largest first, then by name
        return dict(sorted(d.items(), key=lambda kv: (key(kv[1]), kv[0])))

    n_ev = len(ev_time)
    return {
        "peak_bytes": live[p] if live else 0,
        "peak_event": p - 1 if p > 0 else None,
        "peak_time_s": ev_time[p - 1] / 1e6 if 0 < p <= n_ev else None,
        "live_end_bytes": live[-1] if live else 0,
        "storages_end": sum(1 for e in end if e >= n),
        "allocations": sum(1 for s in start if s >= 0),
        "frees": sum(1 for e in end if e < n),
        "duration_s": (max(ev_time) - min(ev_time)) / 1e6 if n_ev else None,
        "by_category": desc(by_cat, lambda r: (-r["peak"], -r["end"])),
        "by_phase": desc(by_phase, lambda v: -v),
        "modules": dict(list(desc(by_mod, lambda v: -v).items())[:10]),
    }
