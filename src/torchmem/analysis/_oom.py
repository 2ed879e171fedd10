"""Out-of-memory entries explained: a full device, or fragmentation of the allocator's cache.

Each ``oom`` entry is explained from the allocator simulator's replay of the trace up to it
(:class:`torchmem.sim.replay.TraceReplay`, the one allocator model of the codebase): the free
memory per stream and pool and the largest free block at that moment, exact when the replay
reproduced every decision before it. Then the trace is replayed again under other settings on a
device of the same size (the reserved bytes at the OOM plus the device's free bytes) to say
whether ``expandable_segments``, a ``max_split_size_mb``, or garbage collection (with a
per-process memory fraction) would have avoided it.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> s = from_pytorch({"segments": [], "device_traces": [[{"action": "oom",
    ...     "device_free": 0, "size": 1024, "stream": 0, "frames": []}]]})
    >>> [o.verdict for o in oom(s)]
    ['exhaustion']
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torchmem.analysis.replay import OOM, DeviceReplay
from torchmem.errors import SimulatedOutOfMemoryError, TorchmemError
from torchmem.model.snapshot import Segment, Snapshot
from torchmem.sim.config import AllocatorConfig
from torchmem.sim.replay import StartSegment, TraceReplay
from torchmem.units import format_bytes as _fb

__all__ = ["OomEvent", "oom", "oom_report"]


@dataclass
class OomEvent:
    """An out-of-memory entry explained.

    ``verdict`` is ``"fragmentation"`` when the device's free bytes plus the allocator's cached
    free bytes would have covered the request (memory existed but not as one contiguous block),
    else ``"exhaustion"``. ``cached_free_bytes`` is reserved minus allocated at that moment;
    ``largest_free_block`` is known only when nothing changed between the OOM and the snapshot.

    Example:
        >>> OomEvent(0, "cuda:0", 5, None, 1024, 0, 0, 0, 0, None, "exhaustion", "").to_dict()["verdict"]
        'exhaustion'
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
    #: The simulator's state at the entry (``None`` when the trace could not be replayed):
    #: ``exact`` (every decision before it reproduced), ``allocated_bytes``,
    #: ``reserved_bytes``, ``largest_free_block``, ``free`` (per stream and pool:
    #: ``{"stream", "pool", "free_bytes", "largest_free_block"}``) and
    #: ``expandable_segments`` (the run's own setting).
    simulated: dict[str, Any] | None = None
    #: What-if replays: ``{"setting", "avoided" (bool), "detail"}`` per alternative setting;
    #: a setting the run already had is not replayed again: ``"already_set": True``, and
    #: ``avoided`` false (the run with it ran out of memory).
    alternatives: list[dict[str, Any]] = field(default_factory=list)

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
        r = DeviceReplay(snap, dev)
        allocated, reserved = r.allocated, r.reserved
        last_change = r.last_change
        segs = [s for s in snap.segments if s.device == dev]
        end_free = sum(s.free_size for s in segs)
        end_alloc_blocks = sum(s.allocated_size for s in segs)
        largest_end = max((b.size for s in segs for b in s.blocks if b.state == "inactive"), default=0)
        for i, a in enumerate(t.actions):
            if a != OOM:
                continue
            size, free, res = t.sizes[i], t.addrs[i], reserved[i]
            sim, alternatives = _simulate(snap, dev, i, size, t.streams[i], free)
            if sim is not None and sim["exact"]:  # the simulator's state at the OOM
                alloc_now = sim["allocated_bytes"]
                res = sim["reserved_bytes"]
                cached = res - alloc_now
                largest: int | None = sim["largest_free_block"]
            elif i > last_change:  # nothing changed since: the end state is the state at the OOM
                cached = end_free
                largest = largest_end
                alloc_now = end_alloc_blocks
            else:
                alloc_now = allocated[i]
                cached = max(0, res - alloc_now)
                largest = None
            if free + cached >= size:
                verdict = "fragmentation"
                why = (
                    f"{_fb(size)} was requested; the device had {_fb(free)} free and the "
                    f"allocator held {_fb(cached)} cached free, enough in total, but no single "
                    "free block or new segment could hold the request"
                )
                if largest is not None:
                    why += f" (largest cached free block: {_fb(largest)})"
                if sim is not None and sim.get("expandable_segments"):
                    why += (". expandable_segments is already on in this run; consider a "
                            "smaller max_split_size_mb.")
                else:
                    why += (
                        ". Consider PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a "
                        "smaller max_split_size_mb."
                    )
            else:
                verdict = "exhaustion"
                why = (
                    f"{_fb(size)} was requested but only {_fb(free)} was free on the device "
                    f"and {_fb(cached)} cached free in the allocator: the device is truly full; "
                    "reduce the batch size or the model's memory."
                )
            why += _explain_simulation(sim, alternatives)
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
                    simulated=sim,
                    alternatives=alternatives,
                )
            )
    return out


#: Settings tried by the what-if replays: (label, config change, memory fraction). Garbage
#: collection acts only with a per-process memory fraction (here the whole simulated device).
_WHAT_IF: tuple[tuple[str, dict[str, Any], float | None], ...] = (
    ("expandable_segments:True", {"expandable_segments": True}, None),
    ("max_split_size_mb:128", {"max_split_size_mb": 128}, None),
    ("max_split_size_mb:512", {"max_split_size_mb": 512}, None),
    ("garbage_collection_threshold:0.8", {"garbage_collection_threshold": 0.8}, 1.0),
    ("garbage_collection_threshold:0.5", {"garbage_collection_threshold": 0.5}, 1.0),
)


def _label(alloc_conf: str, fraction: float | None) -> str:
    """A what-if's name: the ``PYTORCH_CUDA_ALLOC_CONF`` string and the memory fraction it needs."""
    return alloc_conf if fraction is None else f"{alloc_conf} (memory fraction {fraction})"


def _free_by_pool(tr: TraceReplay) -> tuple[list[dict[str, Any]], int]:
    """Free bytes and the largest free block per (stream, pool) of the simulator's state."""
    return _free_rows(tr.allocator.snapshot().segments)


def _free_rows(segments: list[Segment]) -> tuple[list[dict[str, Any]], int]:
    """Per (stream, pool) of ``segments``: free blocks, free bytes, the largest free block."""
    groups: dict[tuple[int, str], list[int]] = {}
    for seg in segments:
        for b in seg.blocks:
            if b.state == "inactive":
                groups.setdefault((seg.stream, seg.segment_type), []).append(b.size)
    rows: list[dict[str, Any]] = [
        {"stream": stream, "pool": pool, "blocks": len(v), "free_bytes": sum(v),
         "largest_free_block": max(v)}
        for (stream, pool), v in sorted(groups.items())
    ]
    return rows, max((max(v) for v in groups.values()), default=0)


def _sim_state(tr: TraceReplay) -> dict[str, Any]:
    """The simulator's state where ``tr`` stopped (the ``simulated`` dict of :class:`OomEvent`)."""
    result = tr.result()
    div = result.first_divergence
    free, largest = _free_by_pool(tr)
    sim: dict[str, Any] = {
        "exact": div is None,
        "start": result.start,
        "allocated_bytes": tr.allocator.allocated_bytes,
        "reserved_bytes": tr.allocator.reserved_bytes,
        "largest_free_block": largest,
        "free": free,
        # freed by the program (free_requested) but still in use by another stream
        "pending_free_bytes": tr.allocator.allocated_bytes - tr.allocated_bytes,
    }
    if div is not None:
        sim["divergence"] = div["explanation"]
    return sim


def _simulate(
    snap: Snapshot, dev: int, i: int, size: int, stream: int, device_free: int
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The simulator's state at trace entry ``i`` (an ``oom``) and the what-if replays."""
    try:
        tr = TraceReplay(snap, dev)
        tr.run(i)
    except TorchmemError:
        return None, []
    sim = _sim_state(tr)
    div = tr.result().first_divergence
    capacity = tr.allocator.reserved_bytes + device_free
    base = tr.allocator.config
    sim["expandable_segments"] = bool(base.expandable_segments)  # the run's own setting
    alternatives: list[dict[str, Any]] = []
    if div is not None:
        return sim, alternatives  # what-ifs on an unfaithful replay would prove nothing
    start = tr.start_segments  # the state at the trace's start is the real settings' doing
    same = _what_if(snap, dev, i, size, stream, base, None, capacity, start,
                    "the snapshot's own settings")
    sim["reproduces_oom"] = same["avoided"] is False
    if same["avoided"] is not False:
        return sim, alternatives
    for conf, change, fraction in _WHAT_IF:
        label = _label(conf, fraction)
        try:
            cfg = replace(base, **change)
        except TorchmemError as e:  # e.g. a max_split_size below the large segment size
            alt: dict[str, Any] = {"setting": label, "avoided": None, "detail": str(e)}
        else:
            if cfg == base and fraction is None:  # the run's own setting: replayed above
                alt = {"setting": label, "avoided": False, "already_set": True,
                       "detail": "already set in the run: the replay with its own settings "
                                 "runs out of memory here"}
            else:
                alt = _what_if(snap, dev, i, size, stream, cfg, fraction, capacity, start,
                               label)
        alt["alloc_conf"], alt["memory_fraction"] = conf, fraction
        alternatives.append(alt)
    return sim, alternatives


def _what_if(
    snap: Snapshot, dev: int, i: int, size: int, stream: int, cfg: AllocatorConfig,
    fraction: float | None, capacity: int, start: list[StartSegment], label: str,
) -> dict[str, Any]:
    """Replay up to entry ``i`` under ``cfg`` on a device of ``capacity`` bytes, then retry."""
    try:
        tr = TraceReplay(snap, dev, config=cfg, capacity=capacity, memory_fraction=fraction,
                         real_addresses=False, start=start)
    except SimulatedOutOfMemoryError:  # the start state alone does not fit
        return {"setting": label, "avoided": False,
                "detail": "the state at the trace's start does not fit the device"}
    t = snap.trace(dev)
    try:
        tr.run(i)
    except SimulatedOutOfMemoryError:
        j = tr.position
        return {"setting": label, "avoided": False,
                "detail": f"runs out of memory earlier, at trace entry {j} (a request of "
                          f"{_fb(t.sizes[j])})"}
    except Exception as e:  # noqa: BLE001 - a what-if must never break the report
        return {"setting": label, "avoided": None, "detail": f"not simulated: {type(e).__name__}: {e}"}
    reserved = tr.allocator.reserved_bytes
    try:
        tr.allocator.malloc(size, stream)
    except SimulatedOutOfMemoryError:
        return {"setting": label, "avoided": False,
                "detail": f"still out of memory ({_fb(reserved)} reserved before the request)"}
    except Exception as e:  # noqa: BLE001
        return {"setting": label, "avoided": None, "detail": f"not simulated: {type(e).__name__}: {e}"}
    return {"setting": label, "avoided": True,
            "detail": f"the request fits ({_fb(tr.allocator.reserved_bytes)} reserved after it, "
                      f"of {_fb(capacity)})"}


def _explain_simulation(sim: dict[str, Any] | None, alternatives: list[dict[str, Any]]) -> str:
    if sim is None:
        return " (The allocator simulator could not replay this trace.)"
    pools = "; ".join(
        f"stream {r['stream']} {r['pool']} pool {_fb(r['free_bytes'])} free, largest block "
        f"{_fb(r['largest_free_block'])}" for r in sim["free"]
    ) or "no free block"
    if sim["exact"]:
        head = "Simulated at the OOM"
    else:
        head = "Simulated (approximate: " + sim.get("divergence", "the replay diverged") + ")"
    out = f" {head}: {pools}."
    if sim["exact"] and not sim.get("reproduces_oom"):
        out += (" The simulator, with the snapshot's settings on a device of the same size, does "
                "not run out of memory here, so no what-if replay is conclusive.")
    avoided = [a["setting"] for a in alternatives if a["avoided"]]
    if alternatives and sim.get("start") == "rebuilt":
        out += (" The what-if replays start from the state at the trace's start, which the real "
                "settings made.")
    if avoided:
        out += " Would have avoided it (replayed on a device of the same size): " + ", ".join(avoided) + "."
    not_ = [a["setting"] for a in alternatives
            if a["avoided"] is False and not a.get("already_set")]
    if not_:
        out += " Would not have: " + ", ".join(not_) + "."
    already = [a["setting"] for a in alternatives if a.get("already_set")]
    if already:
        out += " Already set in this run: " + ", ".join(already) + "."
    return out


#: The short name, as in ``torchmem.analysis.oom(snap)``.
oom = oom_report
