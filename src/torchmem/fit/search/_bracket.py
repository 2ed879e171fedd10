"""The search for the largest value that fits: a bracket of fake runs, narrowed by the memory curve.

:func:`_search` doubles (or halves) from the start until a run does not fit, then probes where
the curve of the runs that ended (peak reserved bytes against the value: a line, or a parabola
for attention's S x S) says the boundary is, with one bisection step after a misprediction, so
the answer is always a true boundary. :func:`_stream_search` predicts a probe from the
allocator requests of earlier probes (:mod:`torchmem.fit.run._stream`) instead of running it,
for at most :data:`STREAM_ROUNDS` rounds, and checks the answer with real runs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu._memory import _make_sim
from torchmem.fit.run._stream import StreamModel, replay
from torchmem.fit.search._checks import MAX_SEARCH_BATCH
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._estimate import Estimate, OOMSite
from torchmem.units import format_bytes


def _describe(name: str, v: int, e: Estimate) -> str:
    if e.predicted:
        return _describe_run(name, v, e) + " [predicted from earlier probes' requests]"
    return _describe_run(name, v, e)


def _describe_run(name: str, v: int, e: Estimate) -> str:
    """One probe's line, in readable units (the JSON keeps the exact bytes).

    Example:
        >>> from types import SimpleNamespace as N
        >>> e = N(stopped_over=None, fits=True, peak_reserved_bytes=3 << 30,
        ...       usable_bytes=15 << 30, margin_bytes=256 << 20, oom=None)
        >>> _describe_run("batch", 8, e)
        'batch 8: fits (peak reserved 3.00 GiB of 15.00 GiB usable, margin 256.00 MiB)'
    """
    f = format_bytes
    if e.stopped_over is not None:
        return (f"{name} {v}: does not fit with the margin (stopped once its reserved bytes "
                f"passed {f(e.stopped_over)} ({e.stopped_over:,} B), the most that leaves "
                f"the margin free of the "
                f"{f(e.usable_bytes)} usable)")
    if e.fits:
        return (f"{name} {v}: fits (peak reserved {f(e.peak_reserved_bytes)} of "
                f"{f(e.usable_bytes)} usable, margin {f(e.margin_bytes)})")
    if e.oom is None:
        return (f"{name} {v}: does not fit with the margin (peak reserved "
                f"{f(e.peak_reserved_bytes)} of {f(e.usable_bytes)} usable leaves "
                f"{f(e.headroom_bytes)}, under the {f(e.margin_bytes)} margin)")
    where = e.oom.op or "?"
    if e.oom.module:
        where += f" in {e.oom.module}"
    return (f"{name} {v}: does not fit (out of memory at {where}, {e.oom.phase}: "
            f"{f(e.oom.requested_bytes)} requested with {f(e.oom.reserved_bytes)} reserved)")


def _search(
    name: str,
    run: Callable[[int], Estimate],
    start: int,
    lo: int | None,
    hi: int | None,
    card: GPU,
    progress: Callable[[str], None] | None,
    keep_snapshot: bool,
    rerun: Callable[[int], Estimate],
    fits_at: Callable[[float], bool],
    step: int = 1,
) -> Estimate:
    """The search, in units of ``step`` (values ``u * step``)."""
    say = progress or (lambda msg: None)
    label = "batch" if name == "batch_size" else name
    top = hi // step if hi is not None else max(1, MAX_SEARCH_BATCH // step)
    floor = -(-lo // step) if lo is not None else 1
    start = max(-(-start // step), floor)
    cache: dict[int, Estimate] = {}
    order: list[int] = []

    def probe(u: int) -> Estimate:
        e = run(u * step)
        cache[u] = e
        order.append(u)
        say(_describe(label, u * step, e))
        return e

    notes: list[str] = []
    good, bad = 0, 0
    first = probe(start)
    if first.fits:
        good = start
        while good < top:
            nxt = min(good * 2, top)
            e = probe(nxt)
            if not e.fits:
                bad = nxt
                break
            good = nxt
    else:
        bad = start
        v = start
        while v > floor:
            v = max(v // 2, floor)
            if probe(v).fits:
                good = v
                break
            bad = v
        if good == 0 and lo is not None:
            raise InvalidInputError(
                f"nothing fits on {card.name} for {name} in {lo}..{hi}: tried "
                + "; ".join(_describe(name, u * step, cache[u]) for u in order)
                + "; fix: lower the range's low end, the other parameters, or pick a GPU "
                "with more memory"
            )
    if good and bad:
        # The memory curve guides the next probe; a guided probe that does not halve the
        # bracket (a misprediction, or a one-sided creep on a staircase of segment roundings)
        # is followed by a bisection step, and after two mispredictions bisection finishes.
        trust, misses = True, 0
        while bad - good > 1:
            guess = _predict(good, bad, cache, fits_at) if trust and misses < 2 else None
            if guess is not None and guess[1] and guess[0] >= bad - 1 > good + 1:
                guess = None  # "fits just below the miss" tells nothing a bisection would not
            mid = (good + bad) // 2 if guess is None else guess[0]
            width = bad - good
            ok = probe(mid).fits
            if ok:
                good = mid
            else:
                bad = mid
            misses += guess is not None and ok != guess[1]
            trust = guess is None or 2 * (bad - good) <= width
    elif good and not bad:
        if hi is not None:
            notes.append(f"the whole search range fits ({name} {good * step} fits): the "
                         f"largest {name} that fits may be higher; raise the range's high end")
        else:
            notes.append(f"stopped searching at {name} {good * step}: does build use {name}?")
        flat = {cache[u].peak_requested_bytes for u in order}
        if len(order) > 1 and len(flat) == 1:
            notes.append(_flat_note(name, [u * step for u in order],
                                    {u * step: e for u, e in cache.items()}))
    vcache = {u * step: e for u, e in cache.items()}
    vorder = [u * step for u in order]
    notes.extend(_monotonic_notes(name, vorder, vcache))
    for n in notes:
        if "does not grow" in n or "not monotone" in n:
            warnings.warn(n, RuntimeWarning, stacklevel=3)
    if good == 0:  # nothing fits: the probe's out-of-memory site, with its Python stack
        u = floor if floor in cache else order[-1]
        best = rerun(u * step) if cache[u].oom is not None else cache[u]
    elif keep_snapshot or _inexact(cache[good]) or cache[good].predicted:
        best = rerun(good * step)
    else:
        best = cache[good]
    best.searched = True
    best.maximized = name
    best.max_value = good * step
    if name == "batch_size":
        best.max_batch_size = good * step
    if good == 0:
        best.notes.append(f"not even {name} {floor * step} fits")
    elif step > 1 and bad:
        best.notes.append(f"searched in steps of {step}: {name} {good * step} fits, "
                          f"{(good + 1) * step} does not")
    best.probes = [(v, vcache[v].fits) for v in vorder]
    best.notes.extend(notes)
    return best


#: Searches on predicted probes before the search runs every probe for real.
STREAM_ROUNDS = 3


def _stream_search(
    name: str,
    run: Callable[..., Estimate],
    margin: Callable[[Estimate], Estimate],
    args: tuple[Any, ...],
) -> Estimate:
    """:func:`_search` with probes predicted by :mod:`torchmem.fit.run._stream` once two probes of
    ``generate()`` (decode steps extrapolated) ran to the end: the answer and the value above
    it are then run for real (decode steps extrapolated: the answer's split and KV figures
    are those of the full run, which is made only when they could not follow the replay), and
    the answer stands
    when their verdicts are the predicted ones (it fits, one more does not); otherwise the
    search runs again with those runs added (up to :data:`STREAM_ROUNDS` times, while they
    add a record), then with every probe run for real (the runs made so far are reused).

    The check of the value above the answer, predicted not to fit, stops as soon as its
    reserved bytes pass the most that fits (``run``'s third argument): the peak only grows,
    so its verdict is the full run's; a stopped run teaches the prediction nothing."""
    start, lo, hi, card, progress, keep_snapshot, rerun, fits_at, step = args  # _search's
    real: dict[int, Estimate] = {}
    model = StreamModel()
    say = progress or (lambda msg: None)
    most = _most_that_fits(fits_at, card.usable_bytes)

    def real_probe(v: int, stop: bool = False) -> Estimate:
        if v not in real:
            events: list[Any] = []
            e = run(v, events, most) if stop and most is not None else run(v, events)
            real[v] = e
            if e.oom is None and e.stopped_over is None:
                model.add(v, events)
        return real[v]

    def answer(v: int) -> Estimate:
        e = real_probe(v)  # a copy: the search writes its answer's fields
        return rerun(v) if keep_snapshot or _inexact(e) or e.oom is not None else (
            dataclasses.replace(e, notes=list(e.notes)))

    predicted: set[int] = set()  # this round's

    def probe(v: int) -> Estimate:
        if v in real:
            return real[v]
        # only generate()'s probes (decode steps extrapolated) are predicted: every other
        # search runs as before, each probe real
        events = model.predict(v) if all(_replayed(real[x]) for x in model.points) else None
        if events is None:
            return real_probe(v)
        predicted.add(v)
        base = real[min(model.points, key=lambda x: abs(x - v))]
        return margin(_predicted(base, replay(events, _make_sim(
            card.usable_bytes, base.alloc_conf, card.total_bytes)), name, v))

    for _ in range(STREAM_ROUNDS):
        predicted.clear()
        known = len(model.points)
        best = _search(name, probe, start, lo, hi, card, progress, keep_snapshot, answer,
                       fits_at, step)
        good = best.max_value or 0
        if not predicted:
            return best
        checks = [good, good + step] if good else [(-(-lo // step) if lo else 1) * step]
        top = hi if hi is not None else MAX_SEARCH_BATCH
        wrong = []
        for v in checks:
            if v in predicted and v <= top:
                e = real_probe(v, stop=v != good)
                say(f"checked by a run: {_describe_run(name, v, e)}")
                if e.fits != (v == good):
                    wrong.append(v)
        if good and not best.fits:  # the answer's own run (rerun in full, when it is)
            wrong.append(good)
        if not wrong:
            best.predicted_probes = sorted(predicted)
            best.notes.append(
                f"{len(predicted)} of the search's {len(best.probes)} probes were predicted from "
                f"the allocator requests of the {len(real)} that ran; the answer and one more "
                "ran, with the predicted verdicts")
            return best
        say(f"the prediction at {name} {wrong[0]} was wrong; searching again")
        if len(model.points) == known:  # nothing learned: the next round would be the same
            break
    best = _search(name, real_probe, start, lo, hi, card, progress, keep_snapshot, answer,
                   fits_at, step)
    best.predicted_probes = []
    return best


def _most_that_fits(fits_at: Callable[[float], bool], usable: int) -> int | None:
    """The largest peak reserved byte count that ``fits_at`` accepts (the margin's rule
    grows with the peak, so the accepted counts are ``0..most``); ``None`` when none is.

    Example:
        >>> _most_that_fits(lambda r: r + 10 <= 100, 100)
        90
    """
    if not fits_at(0):
        return None
    lo, hi = 0, usable
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_at(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _predicted(base: Estimate, got: tuple[int, int, int, int, int | None], name: str,
               v: int) -> Estimate:
    """The estimate of a probe at ``v`` predicted from the requests replayed: ``base`` (a real
    probe) with the replay's peaks and verdict."""
    req, alloc, res, frag, oom = got
    e = dataclasses.replace(base, notes=[], fits=oom is None, peak_requested_bytes=req,
                            peak_allocated_bytes=alloc, peak_reserved_bytes=res,
                            fragmentation_bytes=frag, params={**base.params, name: v})
    e.oom = None if oom is None else OOMSite(oom, None, None, "predicted", (), alloc, res,
                                             "predicted from earlier probes' requests")
    e.predicted, e.decode_replayed = True, 0
    return e


def _replayed(e: Estimate) -> bool:
    """Whether the probe ``e`` extrapolated decode steps (:mod:`torchmem.fit.run._decode`)."""
    return e.decode_replayed > 0


def _inexact(e: Estimate) -> bool:
    """Whether ``e``'s per-category split and KV figures are not the full run's (decode
    steps replayed without them following): an answer so is rerun in full."""
    return e.decode_replayed > 0 and not e.decode_split_exact


def _predict(
    good: int, bad: int, cache: dict[int, Estimate], fits_at: Callable[[float], bool]
) -> tuple[int, bool] | None:
    """The next probe in the bracket ``(good, bad)`` and whether it should fit, from the memory curve of the probes that
    ran to the end (their peak reserved bytes are exact): the largest value the curve says fits
    (expected to fit), or ``good + 1`` when it says nothing above ``good`` does (expected not
    to). Between a fitting probe and an exact one above it the curve is a straight line
    (regula falsi); beyond the last exact probe, the parabola through the three nearest (a line
    when that bends down). ``None`` when fewer than two probes ran to the end."""
    pts = sorted((v, float(e.peak_reserved_bytes)) for v, e in cache.items()
                 if e.oom is None and e.stopped_over is None)
    below = [p for p in pts if p[0] <= good]
    above = [p for p in pts if good < p[0] < bad]
    if not below or len(pts) < 2:
        return None
    if above:
        (x0, y0), (x1, y1) = below[-1], above[0]
        curve = _line(x0, y0, x1, y1)
    elif len(below) >= 3:
        curve = _parabola(below[-3:]) or _line(*below[-2], *below[-1])
    elif len(below) == 2:
        curve = _line(*below[0], *below[1])
    else:
        return None
    lo_v, hi_v = good, bad - 1
    if not fits_at(curve(lo_v + 1)):
        return good + 1, False
    while lo_v < hi_v:  # the largest v in (good, bad) the curve says fits
        mid = (lo_v + hi_v + 1) // 2
        if fits_at(curve(mid)):
            lo_v = mid
        else:
            hi_v = mid - 1
    return lo_v, True


def _line(x0: float, y0: float, x1: float, y1: float) -> Callable[[float], float]:
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    return lambda x: y0 + slope * (x - x0)


def _parabola(p: list[tuple[int, float]]) -> Callable[[float], float] | None:
    (x0, y0), (x1, y1), (x2, y2) = p
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    a = (d12 - d01) / (x2 - x0)
    if a < 0:
        return None
    return lambda x: y0 + d01 * (x - x0) + a * (x - x0) * (x - x1)


def _flat_note(name: str, order: list[int], cache: dict[int, Estimate]) -> str:
    a, b = min(order), max(order)
    return (f"memory does not grow with {name}: the same peak ({cache[a].peak_requested_bytes:,}"
            f" B requested) at every probe from {name} {a} to {name} {b}")


def _monotonic_notes(name: str, order: list[int], cache: dict[int, Estimate]) -> list[str]:
    """Where a larger value used less memory, or fit where a smaller one did not."""
    vals = sorted(order)
    out: list[str] = []
    for a, b in zip(vals, vals[1:]):
        ea, eb = cache[a], cache[b]
        both_ran = ea.oom is None and eb.oom is None  # an OOM cuts a run's peak short
        shrinks = both_ran and eb.peak_requested_bytes < ea.peak_requested_bytes
        if shrinks or (eb.fits and not ea.fits):
            out.append(
                f"memory is not monotone in {name}: {name} {a} peaks at "
                f"{ea.peak_requested_bytes:,} B requested ({'fits' if ea.fits else 'does not fit'})"
                f", {name} {b} at {eb.peak_requested_bytes:,} B "
                f"({'fits' if eb.fits else 'does not fit'}); the search assumes memory grows "
                f"with {name}, so the answer may not be the largest that fits"
            )
            break
    return out
