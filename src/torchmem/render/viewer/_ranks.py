"""The viewer's payload for the ranks of a distributed job: switch ranks, compare them in time.

:func:`build_rank_payload` reads the rank traces one at a time (each is converted, reduced and
dropped). Every rank gets a curve of its live bytes over time, on one time axis for the whole job
(each trace's ``start_unix_ns`` places it: ranks started at different moments line up); the
ranks chosen by ``detail`` also get the full timeline of allocations, as a device of the page
named ``rank R (device)``. The page's selector switches between those; in time mode the
timeline draws every rank's curve over the one shown, so the ranks are compared on one axis.
No torch, no file I/O.

Example:
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K
    >>> def rank(r, start):
    ...     tr = Trace({"rank": r, "world_size": 2, "start_unix_ns": start})
    ...     _ = tr.append(K.ALLOC, 1000, "cpu", 4096 * (r + 1), 1, op="aten::empty")
    ...     return tr
    >>> p = build_rank_payload([rank(0, 10**9), rank(1, 10**9 + 5000)])
    >>> [(d["name"], d["rank"]) for d in p["devices"]]
    [('rank 0 (cpu)', 0), ('rank 1 (cpu)', 1)]
    >>> [(r["rank"], r["peak"], r["t"], r["live"]) for r in p["ranks"]]
    [(0, 4096, [0, 1], [0, 4096]), (1, 8192, [5, 6], [0, 8192])]
"""

from __future__ import annotations

import bisect
import operator
from array import array
from collections.abc import Collection, Iterable
from itertools import accumulate
from typing import Any

from torchmem.analysis._ranks import rank_stats
from torchmem.io.convert import default_device_index, snapshot_from_trace
from torchmem.model.trace import Trace
from torchmem.render.viewer._origin import CATEGORY_NAMES, PHASE_NAMES
from torchmem.render.viewer.payload import (
    KIND_NAMES,
    PAYLOAD_VERSION,
    ProgressFn,
    _device_figures,
    _device_payload,
    _Interner,
)

__all__ = ["build_rank_payload", "rank_curve", "POINTS"]

#: Points of each rank's live-bytes curve (the highest live bytes in each slice of time).
POINTS = 1000
_SIGN = bytes([1, 255, 0]) + bytes(253)


def rank_curve(trace: Trace, device: str, points: int = POINTS) -> tuple[list[int], list[int]]:
    """``(times, live)``: the live bytes on ``device`` over the trace's time (microseconds from
    its start), at most ``points`` + 1 points, each the highest live bytes in its slice of time
    (so peaks survive). Starts with 0 bytes at time 0.

    Example:
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace(); _ = tr.append(K.ALLOC, 2000, "cpu", 64, 1)
        >>> _ = tr.append(K.FREE, 4000, "cpu", 64, 1)
        >>> rank_curve(tr, "cpu", points=2)
        ([0, 2, 4], [0, 64, 0])
    """
    n = len(trace)
    if not n or device not in trace.devices:
        return [0], [0]
    d = trace.devices.index(device)
    signs: Any = array("b", trace.kind.tobytes().translate(_SIGN))
    if len(trace.devices) > 1:
        signs = map(operator.mul, signs, map(operator.eq, trace.device, [d] * n))
    live = array("q", accumulate(map(operator.mul, trace.nbytes, signs)))
    times = array("q", accumulate(trace.time_ns, max))  # threads may interleave: running max
    step = max(1, times[-1] // max(1, points) + 1)
    t_out, l_out = [0], [0]
    i = 0
    while i < n:
        t_ns = times[i]
        # this slice: the events up to the end of the step of time that holds event i
        j = bisect.bisect_right(times, (t_ns // step + 1) * step - 1, i)
        t_out.append(t_ns // 1000)
        l_out.append(max(live[i:j]))
        i = j
    return t_out, l_out


def build_rank_payload(
    traces: Iterable[Trace],
    *,
    detail: Collection[int] | None = None,
    names: list[str] | None = None,
    title: str | None = None,
    progress: ProgressFn | None = None,
    points: int = POINTS,
) -> dict[str, Any]:
    """The viewer's payload for a job's rank traces (see the module docstring).

    ``detail``: the ranks whose full timeline the page holds (default: all); each rank's
    figures come from :func:`~torchmem.analysis.rank_stats` (its main device). Raises
    :class:`~torchmem.errors.InvalidInputError` for a trace without rank metadata.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace({"rank": 3, "world_size": 4})
        >>> _ = tr.append(K.ALLOC, 0, "cuda:3", 512, 1)
        >>> p = build_rank_payload([tr], detail=[])
        >>> p["devices"], p["ranks"][0]["detail"], p["world_size"]
        ([], -1, 4)
    """
    say = progress or (lambda _msg: None)
    interner = _Interner()
    devices: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    world = 0
    starts: list[int | None] = []
    for i, trace in enumerate(traces):
        s = rank_stats(trace, name=names[i] if names and i < len(names) else None)
        world = max(world, s.world_size)
        start = s.start_unix_ns
        starts.append(start)
        entry: dict[str, Any] = {
            "rank": s.rank, "name": f"rank {s.rank} ({s.device or '-'})", "device": s.device,
            "peak": s.peak, "final_live": s.final_live, "events": s.events,
            "cut_short": s.cut_short, "detail": -1, "start_unix_ns": start,
        }
        if s.device is not None and (detail is None or s.rank in detail):
            say(f"rank {s.rank}: {s.events} events")
            model = snapshot_from_trace(trace)
            dev = default_device_index(trace.devices)[s.device]
            figures = _device_figures(model)
            meta, cols = _device_payload(model, dev, interner, dict(figures.get(dev) or {}))
            meta.update(name=entry["name"], rank=s.rank, columns=cols, peak_at=s.peak_at)
            entry["detail"] = len(devices)
            devices.append(meta)
            del model
        entry["t"], entry["live"] = rank_curve(trace, s.device or "", points)
        ranks.append(entry)
        del trace
    known = [x for x in starts if x is not None]
    origin = min(known) if known else 0
    offsets = [((x - origin) // 1000 if x is not None else 0) for x in starts]
    for r, off in zip(ranks, offsets):  # one time axis for the job
        r["t"] = [t + off for t in r["t"]]
        r["offset_us"] = off
    end = max((r["t"][-1] for r in ranks), default=0)
    for meta in devices:  # every detailed rank's events on the job's time axis
        r = next(x for x in ranks if x["detail"] == devices.index(meta))
        if meta["has_time"]:  # ev_time counts from the device's first entry (t0_us)
            shift = r["offset_us"] + meta["t0_us"]
            times = meta["columns"]["ev_time"]
            meta["columns"]["ev_time"] = array("d", map(float(shift).__add__, times))
        meta["t_end_us"] = end
    ranks.sort(key=lambda r: r["rank"])
    order = sorted(range(len(devices)), key=lambda i: devices[i]["rank"])
    devices = [devices[i] for i in order]
    for r in ranks:
        r["detail"] = order.index(r["detail"]) if r["detail"] >= 0 else -1
    return {
        "version": PAYLOAD_VERSION,
        "title": title or "ranks",
        "frames": interner.frames,
        "stacks": interner.stacks,
        "texts": interner.texts,
        "notes": ([] if len(known) == len(starts) else
                  ["some rank traces have no start time (start_unix_ns): they are drawn from 0"]),
        "devices": devices,
        "allocator_settings": None,
        "kind_names": KIND_NAMES,
        "category_names": CATEGORY_NAMES,
        "phase_names": PHASE_NAMES,
        "ranks": ranks,
        "world_size": world,
    }
