"""Late out-of-memory errors: reserved memory that creeps up over iterations while allocated does not.

A run that fails at step 500 and not at step 1 usually has a cache that grows a little every
iteration: requests of changing sizes (variable sequence lengths, growing buffers) no longer fit
the cached free blocks, so the allocator asks cudaMalloc for a new segment while the old ones
stay cached. :func:`creep` splits a device's trace into iterations and compares, per iteration,
the peak of reserved bytes with the peak of allocated bytes; their difference is the
iteration's *fragmentation* (cache the iteration's peak did not need).

Iterations come from the snapshot's ``external_annotations``: the step markers of a torchmem
trace (``stage`` ``"MARK"``, name ``"step"``) or any annotation name that repeats (``START``
entries such as ``ProfilerStep#3``: the trailing number is ignored), placed in the trace by
their ``time_us`` (each marker starts an iteration: the entries before the first one are
iteration 0); or from ``boundaries`` (trace-entry indexes where iterations start).
Reserved bytes come from the trace's ``segment_*`` entries for a PyTorch snapshot; a torchmem
trace recorded on a CUDA device has no allocator behind it, so its requests are replayed through
the allocator simulator (:class:`torchmem.sim.CachingAllocator`, default settings) instead.

The verdict (``creeping``): over the iterations (the first one left out when there are four or
more: it builds the state, such as optimizer moments), the peak reserved grew by at least 2 MiB
(one small segment), by more than twice what the peak allocated grew, and in at least two
iterations. ``start_iteration`` is the first iteration whose fragmentation rose above the one
before and never came back down to it.

Example:
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K
    >>> from torchmem.io.convert import snapshot_from_trace
    >>> MiB, us, tr = 1 << 20, 1000, Trace()
    >>> for k in range(5):   # two tensors live together; from iteration 2 their sizes drift
    ...     d = max(0, k - 1) * 2 * MiB
    ...     _ = tr.append(K.ALLOC, us * (10 * k + 1), "cuda:0", 100 * MiB + d, 2 * k)
    ...     _ = tr.append(K.ALLOC, us * (10 * k + 2), "cuda:0", 60 * MiB - d, 2 * k + 1)
    ...     _ = tr.append(K.FREE, us * (10 * k + 3), "cuda:0", 0, 2 * k)
    ...     _ = tr.append(K.FREE, us * (10 * k + 4), "cuda:0", 0, 2 * k + 1)
    ...     _ = tr.append(K.MARK, us * (10 * k + 5), "cuda:0", 0, 0, op="step", step=k)
    >>> c = creep(snapshot_from_trace(tr))[0]
    >>> c.creeping, c.start_iteration, [i.fragmentation_bytes // MiB for i in c.iterations]
    (True, 2, [0, 0, 102, 206, 312])
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.analysis.replay import DeviceReplay
from torchmem.errors import InvalidInputError, TorchmemError
from torchmem.model.snapshot import Snapshot
from torchmem.sim.replay import ran_expandable
from torchmem.units import format_bytes as _fb

__all__ = ["IterationMemory", "CreepReport", "creep"]

_MIN_GROWTH = 2 << 20  # one small segment: less is noise


@dataclass(frozen=True)
class IterationMemory:
    """One iteration's peaks: entries ``[first_entry, end_entry)`` of the device's trace.

    Example:
        >>> IterationMemory(0, 0, 10, 300, 200).fragmentation_bytes
        100
    """

    iteration: int
    first_entry: int
    end_entry: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int

    @property
    def fragmentation_bytes(self) -> int:
        """Peak reserved minus peak allocated: cache this iteration's peak did not need.

        Example:
            >>> IterationMemory(0, 0, 1, 5, 7).fragmentation_bytes
            0
        """
        return max(0, self.peak_reserved_bytes - self.peak_allocated_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (with ``fragmentation_bytes``).

        Example:
            >>> IterationMemory(1, 4, 9, 8, 6).to_dict()["fragmentation_bytes"]
            2
        """
        return {**asdict(self), "fragmentation_bytes": self.fragmentation_bytes}


@dataclass
class CreepReport:
    """Reserved versus allocated bytes per iteration of one device, and whether reserved creeps.

    ``iterations`` is empty when the trace has no iteration markers (``text`` says so);
    ``reserved_source`` is ``"trace"`` (the snapshot's ``segment_*`` entries) or ``"simulated"``.

    Example:
        >>> CreepReport(0, [], False, None, 0, 0, "trace", "no markers").to_dict()["creeping"]
        False
    """

    device: int
    iterations: list[IterationMemory]
    creeping: bool
    start_iteration: int | None
    reserved_growth_bytes: int
    allocated_growth_bytes: int
    reserved_source: str
    text: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> CreepReport(0, [IterationMemory(0, 0, 1, 2, 2)], False, None, 0, 0, "trace", "").to_dict()["iterations"][0]["iteration"]
            0
        """
        d = asdict(self)
        d["iterations"] = [i.to_dict() for i in self.iterations]
        return d


def creep(
    snap: Snapshot, device: int | None = None, *, boundaries: list[int] | None = None
) -> list[CreepReport]:
    """Per device (default: every device with a trace): does reserved creep up over iterations?

    ``boundaries``: trace-entry indexes where iterations start (default: from the snapshot's
    annotations, see the module docs).

    Example:
        >>> creep(Snapshot())
        []
    """
    devices = [d for d in snap.devices if len(snap.trace(d))] if device is None else [device]
    return [_device_creep(snap, d, boundaries) for d in devices]


def _marker_times(snap: Snapshot, dev: int) -> tuple[str, list[int]]:
    """The most frequent repeating annotation (trailing numbers ignored) on ``dev``: its name
    and times."""
    groups: dict[str, list[int]] = {}
    for a in snap.external_annotations or ():
        if a.get("stage") not in ("MARK", "START") or a.get("time_us") is None:
            continue
        if a.get("device", dev) != dev:
            continue
        name = re.sub(r"[#_ ]?\d+$", "", str(a.get("name", "")))
        groups.setdefault(name, []).append(int(a["time_us"]))
    name, best = max(groups.items(), key=lambda kv: len(kv[1]), default=("", []))
    return (name, sorted(best)) if len(best) >= 2 else ("", [])


def _series(snap: Snapshot, dev: int) -> tuple[list[int], list[int], str]:
    """Reserved and allocated bytes before the first entry and after each, and their source."""
    t = snap.trace(dev)
    if snap.source.format != "torchmem-events":
        r = DeviceReplay(snap, dev)
        return r.reserved, r.allocated, "trace"
    from torchmem.sim import CachingAllocator

    sim = CachingAllocator()
    names = t.action_names
    where: dict[int, int] = {}
    reserved, allocated = [0], [0]
    for i in range(len(t)):
        act = names[t.actions[i]]
        if act == "alloc":
            where[t.addrs[i]] = sim.malloc(t.sizes[i], t.streams[i])
        elif act == "free_completed" and t.addrs[i] in where:
            sim.free(where.pop(t.addrs[i]))
        reserved.append(sim.reserved_bytes)
        allocated.append(sim.allocated_bytes)
    return reserved, allocated, "simulated"


def _device_creep(snap: Snapshot, dev: int, boundaries: list[int] | None) -> CreepReport:
    t = snap.trace(dev)
    n = len(t)
    notes: list[str] = []
    if boundaries is None:
        marker, times = _marker_times(snap, dev)
        if times:
            notes.append(f"iterations start at the {len(times)} annotations {marker!r}")
        if times and not t.has_time:
            notes.append("the trace has no timestamps, so its annotations cannot be placed")
            times = []
        bounds = sorted({0, *(bisect_right(t.times, x) for x in times)} - {n})
    else:
        if any(not isinstance(b, int) or b < 0 or b > n for b in boundaries):
            raise InvalidInputError(
                f"creep: boundaries should be trace-entry indexes from 0 to {n}, got {boundaries!r}"
            )
        bounds = sorted({0, *boundaries} - {n})
    if len(bounds) < 2:
        return CreepReport(
            dev, [], False, None, 0, 0, "trace",
            f"{snap.device_name(dev)}: no iteration markers, so reserved bytes cannot be followed "
            "per iteration (torchmem traces mark steps with tracker.step(); PyTorch snapshots with "
            "record_function annotations)", notes,
        )
    name = snap.device_name(dev)
    try:
        reserved, allocated, source = _series(snap, dev)
    except TorchmemError as e:
        return CreepReport(dev, [], False, None, 0, 0, "trace",
                           f"{name}: the trace could not be replayed: {e}", notes)
    if source == "simulated" and not name.startswith("cuda"):
        notes.append(f"{name} has no caching allocator; the reserved bytes are what PyTorch's CUDA "
                     "allocator would have reserved for the same requests")
    iters = []
    ends = bounds[1:] + [n]
    for k, (a, b) in enumerate(zip(bounds, ends)):
        iters.append(IterationMemory(k, a, b, max(reserved[a:b + 1]), max(allocated[a:b + 1])))
    # the real trace of a run that had expandable segments: the setting is not the remedy
    expandable = source == "trace" and ran_expandable(snap, dev)
    return _verdict(dev, name, iters, source, notes, expandable)


def _verdict(
    dev: int, name: str, iters: list[IterationMemory], source: str, notes: list[str],
    expandable: bool = False,
) -> CreepReport:
    base = 1 if len(iters) >= 4 else 0  # the first iteration builds state
    used = iters[base:]
    res_growth = used[-1].peak_reserved_bytes - used[0].peak_reserved_bytes
    alloc_growth = used[-1].peak_allocated_bytes - used[0].peak_allocated_bytes
    rises = sum(1 for p, q in zip(used, used[1:]) if q.peak_reserved_bytes > p.peak_reserved_bytes)
    creeping = (len(used) >= 2 and res_growth >= _MIN_GROWTH
                and res_growth > 2 * max(0, alloc_growth) and rises >= 2)
    frag = [i.fragmentation_bytes for i in used]
    start = None
    for k in range(1, len(frag)):
        if frag[k] > frag[k - 1] and min(frag[k:]) > frag[k - 1]:
            start = used[k].iteration
            break
    if creeping:
        text = (
            f"{name}: reserved memory creeps up while allocated does not: over iterations "
            f"{used[0].iteration} to {used[-1].iteration} the peak reserved grew by "
            f"{_fb(res_growth)} and the peak allocated by {_fb(alloc_growth)}; fragmentation "
            f"started to grow at iteration {start} (per iteration: "
            + ", ".join(f"{i.iteration}: {_fb(f)}" for i, f in zip(used, frag)) + "). "
            + ("Requests of changing sizes no longer fit the cached free ranges, so more pages "
               "are mapped every few iterations: a late OOM. expandable_segments is already on "
               "in this run; pad the varying sizes to a few fixed ones, or free long-lived "
               "tensors made between large short-lived ones (they split the free range, so a "
               "larger request cannot reuse it)."
               if expandable else
               "Requests of changing sizes no longer fit the cached blocks, so new segments are "
               "added every few iterations: a late OOM. Try "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or pad the varying sizes to a "
               "few fixed ones.")
        )
    else:
        text = (
            f"{name}: no creep over {len(iters)} iterations (peak reserved grew by "
            f"{_fb(res_growth)}, peak allocated by {_fb(alloc_growth)})"
        )
    return CreepReport(dev, iters, creeping, start if creeping else None, res_growth,
                       alloc_growth, source, text, notes)
