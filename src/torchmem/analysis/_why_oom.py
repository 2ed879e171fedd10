"""Why it ran out of memory: the full explanation of ``torchmem oom`` (:func:`explain_oom`).

Built on :func:`torchmem.analysis._oom.oom_report` (the simulator's state at each ``oom`` entry
and the what-if replays): the failed request after rounding, its stream, pool and stack; the
device's free memory; reserved and allocated bytes and how the reserved-but-unallocated bytes
split (free blocks per stream and pool, bytes only other streams can use, pending cross-stream
frees); what the allocator tried (the cached segments its retry released, seen as the
``segment_free`` entries right before the ``oom``); and the verdict, ``fragmentation`` (with the
setting that fits it) or ``exhaustion`` (with the bytes missing). A device without an OOM gets
the same analysis at its peak of allocated bytes ("closest to OOM"); a host (CPU) OOM, which no
caching allocator handled, compares the request with the memory the OS had available.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> s = from_pytorch({"segments": [], "device_traces": [[{"action": "oom",
    ...     "device_free": 1024, "size": 4096, "stream": 0, "frames": []}]]})
    >>> e = explain_oom(s)[0]
    >>> e.verdict, e.missing_bytes
    ('exhaustion', 3072)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.analysis._oom import OomEvent, _free_rows, _sim_state, oom_report
from torchmem.analysis.replay import DeviceReplay
from torchmem.errors import TorchmemError
from torchmem.model.snapshot import Snapshot
from torchmem.sim.config import AllocatorConfig
from torchmem.sim.replay import TraceReplay, ran_expandable
from torchmem.units import format_bytes as _fb

__all__ = ["OomExplanation", "explain_oom"]


_SMALL = 1 << 20  # the largest request of the small pool (after rounding)
_RELEASES = ("segment_free", "segment_unmap")


@dataclass
class OomExplanation:
    """Why an allocation ran out of memory (or, without an OOM, how close the peak came).

    The first eleven fields are ``torchmem oom --json``'s keys. ``request_bytes`` is the failed
    request after rounding (PyTorch records the rounded size in the ``oom`` entry) and
    ``alloc_bytes`` the segment cudaMalloc was asked for (the size in PyTorch's error message;
    with expandable segments, ``expandable`` true, the most bytes of pages it had to map: the
    request rounded up to whole pages, less when a free block ends the stream's mapped range);
    ``largest_free_block_bytes`` is the largest cached free block the request could have used
    (its stream and pool). ``verdict`` is ``"fragmentation"`` (the device's free bytes plus the
    bytes reserved but not allocated would have covered the request, or a what-if configuration
    fits it: ``fix``) or ``"exhaustion"`` (``missing_bytes`` were missing even if every cached byte
    had been returned); both are ``None`` for a snapshot without an OOM (``closest`` is then true
    and the analysis is at the peak of allocated bytes). ``pools`` splits the free blocks per
    stream and pool; ``other_streams_bytes`` are free bytes that only other streams can use and
    ``pending_free_bytes`` blocks freed by the program that another stream still uses.
    ``released_segments``/``released_bytes``: what the allocator's retry freed (the
    ``segment_free`` entries just before the ``oom``; with expandable segments the mapped ranges
    unmapped, ``segment_unmap``). ``exact`` is false when the state at the
    entry is an approximation (the simulator did not reproduce the trace).

    Example:
        >>> e = OomExplanation(0, None, None, 0, 0, 0, None, None, None, None, "")
        >>> list(e.to_dict())[:4]
        ['device', 'request_bytes', 'stream', 'device_free_bytes']
    """

    device: int
    request_bytes: int | None
    stream: int | None
    device_free_bytes: int | None
    reserved_bytes: int
    allocated_bytes: int
    largest_free_block_bytes: int | None
    verdict: str | None
    missing_bytes: int | None
    fix: str | None
    text: str
    name: str = ""
    index: int | None = None
    closest: bool = False
    alloc_bytes: int | None = None
    pool: str | None = None
    stack: list[str] = field(default_factory=list)
    free_blocks: int = 0
    free_bytes: int = 0
    pools: list[dict[str, Any]] = field(default_factory=list)
    other_streams_bytes: int = 0
    pending_free_bytes: int = 0
    released_segments: int = 0
    released_bytes: int = 0
    exact: bool = True
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    #: built by torchmem's tracker (no caching allocator behind the snapshot)
    torchmem_trace: bool = False
    #: the device used expandable segments (pages mapped and unmapped, no cudaMalloc per segment)
    expandable: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, the issue's keys first.

        Example:
            >>> OomExplanation(0, 1024, 0, 0, 0, 0, 0, "exhaustion", 1024, None, "").to_dict()["verdict"]
            'exhaustion'
        """
        return asdict(self)


def explain_oom(snap: Snapshot, device: int | None = None) -> list[OomExplanation]:
    """Explain each ``oom`` entry; a device without one gets the analysis at its peak.

    One :class:`OomExplanation` per ``oom`` entry of the chosen devices (default: all); when
    none of them has an OOM, one per device at the peak of allocated bytes ("closest to OOM";
    a snapshot without a trace: its end state). The state at an entry comes from the
    allocator simulator's replay (:class:`~torchmem.sim.replay.TraceReplay`) when it
    reproduced every decision before it, else from the snapshot's end state when nothing
    changed since, else from the trace's running totals (``exact`` false, no per-pool split).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> MiB = 1 << 20
        >>> s = from_pytorch({"segments": [{"device": 0, "address": 0, "total_size": 40 * MiB,
        ...     "stream": 0, "blocks": [
        ...       {"address": 0, "size": 10 * MiB, "requested_size": 10 * MiB, "state": "active_allocated"},
        ...       {"address": 10 * MiB, "size": 30 * MiB, "requested_size": 0, "state": "inactive"}]}],
        ...   "device_traces": [[{"action": "oom", "device_free": 8 * MiB, "size": 64 * MiB,
        ...                       "stream": 0, "frames": []}]]})
        >>> e = explain_oom(s)[0]
        >>> e.verdict, e.missing_bytes == 64 * MiB - 8 * MiB - 30 * MiB, e.largest_free_block_bytes == 30 * MiB
        ('exhaustion', True, True)
    """
    devices = snap.devices if device is None else [device]
    events = [e for e in oom_report(snap) if e.device in devices]
    if events:
        return [_explain(snap, e) if e.name.startswith("cuda") else _explain_host(snap, e)
                for e in events]
    return [_closest(snap, dev) for dev in devices]


def _end_state(snap: Snapshot, dev: int) -> dict[str, Any]:
    """The state dict (as :func:`_sim_state`) of the snapshot's end segments of ``dev``."""
    segs = snap.segments_of(dev)
    free, largest = _free_rows(segs)
    pending = sum(b.size for s in segs for b in s.blocks if b.state == "active_pending_free")
    allocated = sum(s.allocated_size for s in segs)
    return {"exact": True, "allocated_bytes": allocated + pending,
            "reserved_bytes": sum(s.total_size for s in segs), "largest_free_block": largest,
            "free": free, "pending_free_bytes": pending}


def _split(state: dict[str, Any], stream: int | None, pool: str | None) -> dict[str, Any]:
    """The reserved-but-unallocated bytes of ``state`` seen from a request on (stream, pool)."""
    rows = state["free"]
    own = [r for r in rows if r["stream"] == stream and r["pool"] == pool]
    largest = own[0]["largest_free_block"] if own else 0
    if stream is None:  # no request: the largest block anywhere
        largest = state["largest_free_block"]
    return {
        "pools": rows,
        "free_blocks": sum(r["blocks"] for r in rows),
        "free_bytes": sum(r["free_bytes"] for r in rows),
        "largest_free_block_bytes": largest,
        "other_streams_bytes": sum(r["free_bytes"] for r in rows
                                   if stream is not None and r["stream"] != stream),
        "pending_free_bytes": state["pending_free_bytes"],
    }


def _stack(snap: Snapshot, dev: int, i: int) -> list[str]:
    from torchmem.analysis.frames import stack_key

    key = stack_key(snap.stacks[snap.trace(dev).stack_ids[i]], depth=6)
    return [] if key[0].startswith("<") else list(key)


def _released_before(snap: Snapshot, dev: int, i: int) -> tuple[int, int]:
    """The run of segment_free/segment_unmap entries right before entry ``i``: count, bytes."""
    t = snap.trace(dev)
    names = t.action_names
    n = size = 0
    j = i - 1
    while j >= 0 and names[t.actions[j]] in _RELEASES:
        n += 1
        size += t.sizes[j]
        j -= 1
    return n, size


def _explain(snap: Snapshot, ev: OomEvent) -> OomExplanation:
    from torchmem.sim.allocator import SMALL_BUFFER, segment_size

    dev, i, size = ev.device, ev.index, ev.requested_bytes
    t = snap.trace(dev)
    stream = t.streams[i]
    pool = "small" if size <= _SMALL else "large"
    cfg = AllocatorConfig.from_settings(snap.allocator_settings)
    expandable = ran_expandable(snap, dev)
    try:
        alloc = segment_size(size, cfg) if size else 0
    except TorchmemError:
        alloc = size
    if expandable:  # whole pages: 2 MiB in the small pool, large_segment_size in the large one
        page = SMALL_BUFFER if size <= _SMALL else cfg.large_segment_size
        alloc = -(-size // page) * page
    sim = ev.simulated
    if sim is not None and sim["exact"]:
        state: dict[str, Any] | None = sim
    elif i > DeviceReplay(snap, dev).last_change:
        state = _end_state(snap, dev)
    else:
        state = None
    if state is not None:
        allocated = state["allocated_bytes"] - state["pending_free_bytes"]
        reserved = state["reserved_bytes"]
        parts = _split(state, stream, pool)
    else:
        allocated, reserved = ev.allocated_bytes, ev.reserved_bytes
        parts = {"pools": [], "free_blocks": 0, "free_bytes": max(0, reserved - allocated),
                 "largest_free_block_bytes": None, "other_streams_bytes": 0,
                 "pending_free_bytes": 0}
    free = ev.device_free_bytes
    missing = max(0, size - free - max(0, reserved - allocated))
    fits = [a for a in ev.alternatives if a["avoided"]]
    fix = fits[0]["alloc_conf"] if fits else None
    verdict = "fragmentation" if fix is not None or missing == 0 else "exhaustion"
    released = _released_before(snap, dev, i)
    e = OomExplanation(
        device=dev, request_bytes=size, stream=stream, device_free_bytes=free,
        reserved_bytes=reserved, allocated_bytes=allocated, verdict=verdict,
        missing_bytes=missing if verdict == "exhaustion" else 0, fix=fix, text="",
        name=ev.name, index=i, alloc_bytes=alloc, pool=pool, stack=_stack(snap, dev, i),
        released_segments=released[0], released_bytes=released[1], exact=state is not None,
        alternatives=ev.alternatives, expandable=expandable, **parts,
    )
    e.text = _oom_text(e, cfg, fits, sim)
    return e


def _explain_host(snap: Snapshot, ev: OomEvent) -> OomExplanation:
    """A host (CPU) OOM: no caching allocator, so the request against what the OS had free."""
    dev, i, size, free = ev.device, ev.index, ev.requested_bytes, ev.device_free_bytes
    live = sum(b.size for s in snap.segments_of(dev) for b in s.blocks if b.is_allocated)
    if i <= DeviceReplay(snap, dev).last_change:
        live = ev.allocated_bytes
    missing = max(0, size - free)
    t = snap.trace(dev)
    why = t[i].user_metadata or ""
    text = (
        f"Host out of memory on {ev.name} at trace entry {i}: a request of {_fb(size)} "
        f"({size} B); the OS had {_fb(free)} available; tracked tensors held {_fb(live)}\n"
        + (f"  error         {why}\n" if why else "")
    )
    if missing:
        text += (f"  verdict       exhaustion: {_fb(missing)} ({missing} B) more than the OS had "
                 "available; a CPU has no caching allocator, so no allocator setting helps: "
                 "reduce the sizes or process the data in chunks\n")
    else:
        text += ("  verdict       exhaustion: the request is within what the OS reported "
                 "available, so another limit refused it (address space, ulimit -v, a cgroup "
                 "memory limit or the overcommit policy)\n")
    return OomExplanation(
        device=dev, request_bytes=size, stream=t.streams[i], device_free_bytes=free,
        reserved_bytes=live, allocated_bytes=live, largest_free_block_bytes=None,
        verdict="exhaustion", missing_bytes=missing, fix=None, text=text, name=ev.name,
        index=i, alloc_bytes=size, stack=_stack(snap, dev, i),
    )


def _closest(snap: Snapshot, dev: int) -> OomExplanation:
    """The analysis at the peak of allocated bytes of a device without an OOM."""
    t = snap.trace(dev)
    peak = _peak_entry(snap, dev) if t.count("alloc") else None
    state: dict[str, Any] | None = None
    if peak is not None:
        try:
            tr = TraceReplay(snap, dev)
            tr.run(peak + 1)
            state = _sim_state(tr)
        except TorchmemError:
            state = None
        if state is not None and not state["exact"]:
            state = None
    if state is None:
        if peak is not None and peak < DeviceReplay(snap, dev).last_change:
            peak = None  # the simulator's replay is not exact: the end state is what is known
        state = _end_state(snap, dev)
    stream = t.streams[peak] if peak is not None else None
    size = t.sizes[peak] if peak is not None else None
    pool = None if size is None else ("small" if size <= _SMALL else "large")
    parts = _split(state, stream, pool)
    e = OomExplanation(
        device=dev, request_bytes=size, stream=stream, device_free_bytes=None,
        reserved_bytes=state["reserved_bytes"],
        allocated_bytes=state["allocated_bytes"] - state["pending_free_bytes"],
        verdict=None, missing_bytes=None, fix=None, text="", name=snap.device_name(dev),
        index=peak, closest=True, pool=pool,
        stack=_stack(snap, dev, peak) if peak is not None else [],
        torchmem_trace=snap.source.format == "torchmem-events", **parts,
    )
    why = ("the snapshot has no allocation history" if not t.count("alloc") else
           "the allocator simulator did not reproduce its trace, so the state at the peak is "
           "not known")
    e.text = _closest_text(e, why)
    return e


def _peak_entry(snap: Snapshot, dev: int) -> int | None:
    """The ``alloc`` entry after which allocated bytes (whole blocks) peak, from a replay."""
    try:
        tr = TraceReplay(snap, dev)
        tr.run()
    except TorchmemError:
        return None
    t = snap.trace(dev)
    names = t.action_names
    sizes: dict[int, int] = {}  # live address -> block size
    pending: set[int] = set()
    for seg in tr.start_segments:
        for addr, bsize, _req, is_pending in seg.blocks:
            sizes[addr] = bsize
            if is_pending:
                pending.add(addr)
    cur = sum(v for a, v in sizes.items() if a not in pending)
    best, at = cur, None
    for i in range(len(t)):
        act, a = names[t.actions[i]], t.addrs[i]
        if act == "alloc":
            sizes[a] = tr.block_sizes[i]
            cur += sizes[a]
            if cur > best:
                best, at = cur, i
        elif act == "free_requested" and a not in pending:
            pending.add(a)
            cur -= sizes.get(a, 0)
        elif act == "free_completed":
            if a in pending:
                pending.discard(a)
            else:
                cur -= sizes.get(a, 0)
            sizes.pop(a, None)
    return at


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _where(e: OomExplanation) -> list[str]:
    lines = []
    if e.stack:
        lines.append("  allocated at  " + e.stack[0])
        lines.extend("                " + f for f in e.stack[1:3])
    unalloc = max(0, e.reserved_bytes - e.allocated_bytes)
    lines.append(
        f"  reserved {_fb(e.reserved_bytes)}, allocated {_fb(e.allocated_bytes)}: "
        f"{_fb(unalloc)} reserved but not allocated"
    )
    if e.exact:
        per = "; ".join(
            f"stream {r['stream']} {r['pool']} pool: {_n(r['blocks'], 'block')}, {_fb(r['free_bytes'])}, "
            f"largest {_fb(r['largest_free_block'])}" for r in e.pools
        ) or "none"
        lines.append(f"    free blocks   {e.free_blocks} ({_fb(e.free_bytes)}): {per}")
        lines.append(f"    other streams {_fb(e.other_streams_bytes)} (free, but only for their own streams)")
        lines.append(f"    pending frees {_fb(e.pending_free_bytes)} (freed, still in use by another stream)")
    else:
        lines.append("    (per-pool split unknown: the simulator did not reproduce the trace up to here)")
    return lines


def _oom_text(
    e: OomExplanation, cfg: AllocatorConfig, fits: list[dict[str, Any]], sim: dict[str, Any] | None
) -> str:
    size, free = e.request_bytes or 0, e.device_free_bytes or 0
    lines = [
        f"OOM on {e.name} at trace entry {e.index}: a request of {_fb(size)} ({size} B after "
        f"rounding) on stream {e.stream}, {e.pool} pool; "
        + (f"the expandable segment was asked to map up to {_fb(e.alloc_bytes or 0)} of pages"
           if e.expandable else f"cudaMalloc was asked for {_fb(e.alloc_bytes or 0)}"),
    ]
    lines.append(f"  device free   {_fb(free)} (cudaMemGetInfo at the OOM)")
    lines.extend(_where(e))
    largest = e.largest_free_block_bytes
    tried = f"  tried         no cached block of {_fb(size)} on stream {e.stream}'s {e.pool} pool"
    tried += f" (largest {_fb(largest)})" if largest is not None else ""
    if e.expandable:
        tried += f"; mapping up to {_fb(e.alloc_bytes or 0)} of pages (cuMemMap) failed; "
    else:
        tried += f"; cudaMalloc({_fb(e.alloc_bytes or 0)}) failed; "
    if cfg.max_split_size_mb is not None:
        tried += "released cached blocks over max_split_size, then "
    if e.released_segments and e.expandable:
        tried += (f"unmapped {_fb(e.released_bytes)} of pages (cuMemUnmap, "
                  f"{_n(e.released_segments, 'free range')}) and retried; failed again with "
                  f"{_fb(free)} free")
    elif e.released_segments:
        tried += (f"released {_n(e.released_segments, 'cached segment')} ({_fb(e.released_bytes)}) "
                  f"and retried; failed again with {_fb(free)} free")
    elif e.expandable:
        tried += ("found no free whole page to unmap (every free block lies on pages partly in "
                  f"use), so the retry failed too, with {_fb(free)} free")
    else:
        tried += ("found no whole cached segment to release (every free block lies in a segment "
                  f"partly in use), so the retry failed too, with {_fb(free)} free")
    lines.append(tried)
    unalloc = max(0, e.reserved_bytes - e.allocated_bytes)
    if e.verdict == "exhaustion":
        lines.append(
            f"  verdict       exhaustion: even with all {_fb(unalloc)} reserved but unallocated "
            f"returned to the device, {_fb(e.missing_bytes or 0)} ({e.missing_bytes} B) were "
            "missing; reduce the batch size or the model's memory"
        )
    else:
        v = (f"  verdict       fragmentation: {_fb(free)} free on the device plus {_fb(unalloc)} "
             f"reserved but unallocated cover {_fb(size)}, but not in one piece")
        if e.pending_free_bytes:
            v += (f"; {_fb(e.pending_free_bytes)} are freed but still in use by another stream "
                  "(record_stream): they return once that stream's work is done")
        if e.other_streams_bytes:
            v += (f"; {_fb(e.other_streams_bytes)} are cached for other streams only: allocate "
                  "on one stream, or torch.cuda.empty_cache() between phases")
        if e.fix is not None:
            frac = fits[0]["memory_fraction"]
            v += (f"; PYTORCH_CUDA_ALLOC_CONF={e.fix}"
                  + (f" (with torch.cuda.set_per_process_memory_fraction({frac}))" if frac else "")
                  + " would have fit it (replayed on a device of the same size)")
        elif e.alternatives:
            v += ("; none of the what-if settings fits it either: free memory before the peak "
                  "(torch.cuda.empty_cache() between phases) or make the request smaller")
        lines.append(v)
    lines.append("  what-ifs      " + _what_if_line(sim, e.alternatives))
    return "\n".join(lines) + "\n"


def _what_if_line(sim: dict[str, Any] | None, alternatives: list[dict[str, Any]]) -> str:
    """One line: each what-if setting and whether it fits the request."""
    if sim is None or not sim["exact"]:
        return ("none: the allocator simulator did not reproduce the trace up to the OOM, so a "
                "replay under other settings would prove nothing")
    if not sim.get("reproduces_oom"):
        return ("none: with the snapshot's own settings on a device of the same size the "
                "simulator does not run out of memory here, so no what-if is conclusive")
    word = {True: "fits", False: "still OOM", None: "not simulated"}
    out = "; ".join(f"{a['setting']}: "
                    + ("already set in this run" if a.get("already_set") else word[a["avoided"]])
                    for a in alternatives)
    if sim.get("start") == "rebuilt":
        out += " (replayed from the state at the trace's start, which the real settings made)"
    return out


def _closest_text(e: OomExplanation, why: str) -> str:
    if e.index is not None:
        head = (f"No OOM recorded on {e.name}; closest to OOM: the peak of allocated bytes, after "
                f"trace entry {e.index} (a request of {_fb(e.request_bytes or 0)} on stream "
                f"{e.stream}, {e.pool} pool)")
    else:
        head = f"No OOM recorded on {e.name}; closest to OOM: its end state ({why})"
    lines = [head]
    if e.torchmem_trace:
        lines.append("  note          a torchmem trace: no caching allocator recorded it, every "
                     "segment is one storage (torchmem oom shows reserved creeping per "
                     "iteration with the allocator simulator below, when it has step markers)")
    lines.extend(_where(e))
    unalloc = max(0, e.reserved_bytes - e.allocated_bytes)
    if e.reserved_bytes and not unalloc:
        lines.append("  cache         all of reserved is allocated: nothing cached to reuse")
    elif e.reserved_bytes:
        lines.append(
            f"  cache         {100 * e.allocated_bytes / e.reserved_bytes:.2f}% of reserved is "
            f"allocated; the {_fb(unalloc)} cached is split into {_n(e.free_blocks, 'free block')}, so "
            f"at most {_fb(e.largest_free_block_bytes or 0)} of it can serve one request"
        )
    lines.append(
        f"  headroom      a request up to {_fb(e.largest_free_block_bytes or 0)} (the largest "
        "free block) fits in the cache; a larger one needs a new segment from the device's free "
        "memory, which a snapshot without an oom entry does not record"
    )
    return "\n".join(lines) + "\n"
