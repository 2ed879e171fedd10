"""Live bytes per category over time, sampled for plots (no torch).

Example:
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K, Category as C
    >>> tr = Trace()
    >>> _ = tr.append(K.ALLOC, 0, "cpu", 10, 1, category=C.PARAMETER)
    >>> category_series(tr)[2]["parameter"]
    [10]
"""

from __future__ import annotations

from torchmem.analysis.summary import main_device
from torchmem.model.events import Category, EventKind
from torchmem.model.trace import Trace

__all__ = ["category_series"]

_ALLOC = int(EventKind.ALLOC)
_MARK = int(EventKind.MARK)
_CATS = [c.label for c in Category]


def category_series(
    trace: Trace, device: str | None = None, max_points: int = 4000
) -> tuple[list[int], list[int], dict[str, list[int]], list[int]]:
    """Live bytes per category over time on one device, for plots.

    Returns ``(seqs, times_ns, {category: bytes}, phases)`` sampled at most ``max_points`` times
    (each sample is the event with the highest total in its bucket, so the peak is kept).

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K, Category as C
        >>> tr = Trace()
        >>> _ = tr.append(K.ALLOC, 0, "cpu", 10, 1, category=C.PARAMETER)
        >>> _ = tr.append(K.ALLOC, 5, "cpu", 4, 2, category=C.ACTIVATION)
        >>> seqs, t, series, _ = category_series(tr)
        >>> seqs, series["parameter"], series["activation"]
        ([0, 1], [10, 10], [0, 4])
    """
    peaks = trace.peak()
    if device is None:
        device = main_device(trace, peaks)
    want = trace.devices.index(device) if device in trace.devices else -1
    ncat = len(_CATS)
    live = [0] * ncat
    cat_of: dict[int, int] = {}
    rows: list[tuple[int, int, int, tuple[int, ...]]] = []
    kind, dev, nbytes, sid_col, cat_col = (
        trace.kind,
        trace.device,
        trace.nbytes,
        trace.storage,
        trace.category,
    )
    n = len(trace)
    bucket = max(1, -(-n // max_points)) if max_points > 0 else 1
    best: tuple[int, int, int, tuple[int, ...]] | None = None
    best_total = -1
    for i in range(n):
        k = kind[i]
        if k != _MARK and dev[i] == want:
            if k == _ALLOC:
                c = cat_col[i]
                cat_of[sid_col[i]] = c
                live[c] += nbytes[i]
            else:
                c = cat_of.pop(sid_col[i], cat_col[i])
                live[c] -= nbytes[i]
        total = sum(live)
        if total > best_total:
            best_total = total
            best = (i, trace.time_ns[i], trace.phase[i], tuple(live))
        if (i + 1) % bucket == 0 or i == n - 1:
            assert best is not None
            rows.append(best)
            best = None
            best_total = -1
    seqs = [r[0] for r in rows]
    times = [r[1] for r in rows]
    phases = [r[2] for r in rows]
    series = {name: [r[3][j] for r in rows] for j, name in enumerate(_CATS)}
    return seqs, times, series, phases
