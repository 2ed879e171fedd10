"""Trace -> snapshot: torchmem's event stream in the allocator-snapshot model, losing nothing.

:func:`snapshot_from_trace` (a :class:`~torchmem.model.trace.Trace`, a tracker, or events) and
:func:`snapshot_from_events` build a :class:`~torchmem.model.snapshot.Snapshot` whose trace
entries and live blocks keep each allocation's category, phase and module as typed fields, so
one snapshot model serves every analysis and the viewer. No torch.

Example:
    >>> from torchmem.model.events import Category, Phase
    >>> ev = [Event(0, EventKind.ALLOC, 1000, "cpu", 4096, 1, op="aten::mm", module="fc",
    ...             phase=Phase.FORWARD, category=Category.ACTIVATION)]
    >>> e = snapshot_from_events(ev).trace(0)[1]
    >>> e.action, e.category.label, e.phase.label, e.module
    ('alloc', 'activation', 'forward', 'fc')
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from torchmem._device import split_device
from torchmem.errors import DeviceError, InvalidInputError
from torchmem.model.events import Event, EventKind
from torchmem.model.snapshot import Block, DeviceTrace, Frame, Segment, Snapshot, SourceInfo

__all__ = [
    "snapshot_from_trace", "snapshot_from_events", "default_device_index", "event_entry_index",
    "CPU_NOTE",
]

#: The honest description attached to snapshots built from CPU (or other non-CUDA) tracker runs.
CPU_NOTE = (
    "built by torchmem from tracked storage allocations: this device has no caching allocator, "
    "so every segment is exactly one storage (segment_alloc/alloc on allocation, "
    "free_requested/free_completed/segment_free on free); addresses are synthetic, "
    "non-overlapping and never reused; sizes are the storages' exact byte counts (no rounding)"
)

_ALIGN = 512  # keep synthetic addresses 512-aligned like CUDA blocks (cosmetic, documented)
_BASE_ADDRESS = 0x7F0000000000  # synthetic address space start (any non-zero value works)


def _parse_stack_entry(text: str) -> tuple[str, int, str]:
    # "file:line:function"; filenames may contain ':' (Windows drives), so split from the right.
    parts = text.rsplit(":", 2)
    if len(parts) == 3:
        try:
            return parts[0], int(parts[1]), parts[2]
        except ValueError:
            pass
    return text, 0, "?"


def _cuda_index(name: str) -> int | None:
    """The CUDA index a device name stands for (a bare ``"cuda"`` is index 0), else ``None``."""
    try:
        dtype, index = split_device(name)
    except DeviceError:
        return None
    if dtype != "cuda":
        return None
    return 0 if index is None else index


def default_device_index(names: Iterable[str]) -> dict[str, int]:
    """Device indexes for a snapshot: ``cuda:N`` keeps ``N``; other devices follow the CUDA ones.

    Knowing every device up front keeps ``cuda:0`` at index 0 even when a CPU event comes first.

    Example:
        >>> default_device_index(["cpu", "cuda:1", "cuda:0", "meta"])
        {'cuda:1': 1, 'cuda:0': 0, 'cpu': 2, 'meta': 3}
        >>> default_device_index(["cpu", "cuda"])     # a bare "cuda" is cuda:0, as everywhere
        {'cuda': 0, 'cpu': 1}
    """
    names = list(dict.fromkeys(names))
    index: dict[str, int] = {}
    for name in names:
        cuda = _cuda_index(name)
        if cuda is not None and cuda not in index.values():
            index[name] = cuda
    nxt = max(index.values(), default=-1) + 1
    for name in names:
        if name not in index:
            index[name] = nxt
            nxt += 1
    return index


def snapshot_from_trace(
    trace: Any,
    *,
    device_index: Mapping[str, int] | None = None,
    with_segments: bool = True,
) -> Snapshot:
    """Convert a torchmem :class:`~torchmem.model.trace.Trace` (or a tracker holding one, or an
    iterable of :class:`~torchmem.model.events.Event`) into a :class:`Snapshot`.

    Devices are indexed with :func:`default_device_index` over the trace's device table unless
    ``device_index`` is given; see :func:`snapshot_from_events` for the rest. Category, phase and
    module of every allocation are kept as typed fields of the trace entries and live blocks.

    Example:
        >>> from torchmem.model.events import Category
        >>> from torchmem.model.trace import Trace
        >>> tr = Trace()
        >>> _ = tr.append(EventKind.ALLOC, 1000, "cpu", 4096, 1, module="fc",
        ...               category=Category.PARAMETER)
        >>> block = snapshot_from_trace(tr).segments[0].blocks[0]
        >>> block.size, block.category.label, block.module
        (4096, 'parameter', 'fc')
    """
    events = trace.events() if hasattr(trace, "events") else trace
    devices = getattr(trace, "devices", None) or getattr(
        getattr(trace, "trace", None), "devices", None
    )
    if devices and device_index is None:
        device_index = default_device_index(devices)
    return snapshot_from_events(events, device_index=device_index, with_segments=with_segments)


def event_entry_index(trace: Any, seq: int, *, with_segments: bool = True) -> int:
    """The trace entry that tracker event ``seq`` becomes in :func:`snapshot_from_trace`.

    torchmem numbers every point of a run one way: the 0-based index of a trace entry in its
    device's trace, as ``torchmem trace`` prints it (``torchmem peak``'s ``#N`` and
    ``peak_index``, the summary's peak and the viewer's ``#N`` use the same). A tracker event
    becomes several entries (see :func:`snapshot_from_events`); this is the index of its
    ``alloc`` entry (an allocation) or its ``free_completed`` entry (a free), counted on the
    event's own device. Markers and frees of storages allocated before tracking started become
    no entry: -1. ``trace`` is a :class:`~torchmem.model.trace.Trace`.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> tr = Trace()
        >>> _ = tr.append(EventKind.ALLOC, 0, "cpu", 8, 1)     # entries 0, 1 (segment_alloc, alloc)
        >>> _ = tr.append(EventKind.ALLOC, 1, "cpu", 8, 2)     # entries 2, 3
        >>> _ = tr.append(EventKind.FREE, 2, "cpu", 8, 1)      # entries 4, 5, 6
        >>> [event_entry_index(tr, i) for i in range(3)]
        [1, 3, 5]
        >>> [e.action for e in snapshot_from_trace(tr).trace(0)][5]
        'free_completed'
    """
    if not 0 <= seq < len(trace):
        raise InvalidInputError(
            f"event_entry_index: expected an event index in 0..{len(trace) - 1}, got {seq}"
        )
    kind, dev, sid = trace.kind, trace.device, trace.storage
    want = dev[seq]
    alloc, free = int(EventKind.ALLOC), int(EventKind.FREE)
    per_alloc, per_free = (2, 3) if with_segments else (1, 2)
    live: set[int] = set()
    n = 0  # entries emitted on this device before event i
    for i in range(seq + 1):
        if dev[i] != want:
            continue
        k = kind[i]
        if k == alloc:
            if i == seq:
                return n + per_alloc - 1
            live.add(sid[i])
            n += per_alloc
        elif k == free:
            known = sid[i] in live
            if i == seq:
                return n + 1 if known else -1
            if known:
                live.discard(sid[i])
                n += per_free
    return -1


def snapshot_from_events(
    events: Iterable[Event],
    *,
    device_index: Mapping[str, int] | None = None,
    with_segments: bool = True,
) -> Snapshot:
    """Turn torchmem tracker events (:class:`~torchmem.model.events.Event`) into a Snapshot.

    Each device string gets a device index (``cuda:N`` keeps ``N``; ``cpu`` and others get the
    next free indexes, recorded in :attr:`Snapshot.device_names`; override with
    ``device_index``). Every storage gets a synthetic, non-overlapping address per device (a
    bump pointer that is never reused). An allocation becomes ``segment_alloc`` + ``alloc``, a
    free becomes ``free_requested`` + ``free_completed`` + ``segment_free`` (``with_segments=False``
    drops the segment entries), with ``time_us = time_ns // 1000``. Frames are the event's stack
    (innermost first) preceded by pseudo-frames for the op (filename ``<op>``) and the module
    (filename ``<module>``); each entry's ``category``, ``phase`` and ``module`` fields hold the
    event's (typed columns of :class:`~torchmem.model.snapshot.DeviceTrace`, kept by
    :func:`~torchmem.io.snapshot_file.write_snapshot`), and ``user_metadata`` repeats them as
    ``category=... phase=... storage=...`` for PyTorch's viewer.
    Storages alive at the end become one segment each with one ``active_allocated`` block.
    There is no caching allocator behind such a snapshot; :data:`CPU_NOTE` is added to its notes.
    Markers (``EventKind.MARK``) become ``external_annotations``.

    Example:
        >>> ev = [Event(0, EventKind.ALLOC, 1000, "cpu", 4096, 1, op="aten::empty"),
        ...       Event(1, EventKind.ALLOC, 2000, "cpu", 100, 2, op="aten::add"),
        ...       Event(2, EventKind.FREE, 3000, "cpu", 4096, 1)]
        >>> s = snapshot_from_events(ev)
        >>> [e.action for e in s.trace(0)]  # doctest: +NORMALIZE_WHITESPACE
        ['segment_alloc', 'alloc', 'segment_alloc', 'alloc', 'free_requested', 'free_completed',
         'segment_free']
        >>> [(b.size, b.state, b.frames[0].name) for seg in s.segments for b in seg.blocks]
        [(100, 'active_allocated', 'aten::add')]
        >>> s.device_names
        {0: 'cpu'}
    """
    snap = Snapshot()
    snap.source = SourceInfo(format="torchmem-events")
    index: dict[str, int] = dict(device_index or {})
    used = set(index.values())

    def dev_of(name: str) -> int:
        d = index.get(name)
        if d is not None:
            snap.device_names.setdefault(d, name)
            return d
        cuda = _cuda_index(name)
        if cuda is not None and cuda not in used:
            d = cuda
        else:
            d = 0
            while d in used:
                d += 1
        index[name] = d
        used.add(d)
        snap.device_names[d] = name
        return d

    next_addr: dict[int, int] = {}
    # storage key -> (device, addr, size, stack_id, the allocating event)
    live: dict[tuple[str, int], tuple[int, int, int, int, Event]] = {}
    ctx_cache: dict[tuple[Any, ...], int] = {}
    annotations: list[dict[str, Any]] = []

    def frames_for(ev: Event) -> int:
        key = (ev.op, ev.module, ev.stack)
        sid = ctx_cache.get(key)
        if sid is None:
            frames: list[Frame] = []
            if ev.op:
                frames.append(snap.intern_frame("<op>", 0, ev.op))
            if ev.module:
                frames.append(snap.intern_frame("<module>", 0, ev.module))
            for text in reversed(ev.stack or ()):
                frames.append(snap.intern_frame(*_parse_stack_entry(text)))
            sid = ctx_cache[key] = snap.intern_stack(frames)
        return sid

    def add(t: DeviceTrace, action: str, addr: int, size: int, sid: int, ev: Event) -> None:
        t.append(action, addr, size, 0, ev.time_ns // 1000, sid,
                 category=ev.category, phase=ev.phase, module=ev.module)
        text = f"category={ev.category.label} phase={ev.phase.label} storage={ev.storage}"
        assert t.user_metadata is not None
        t.user_metadata.append(t.intern_text(text))

    n_events = 0
    unknown_frees = 0
    for ev in events:
        if not isinstance(ev, Event):
            raise InvalidInputError(
                f"snapshot_from_events expected torchmem Event records, got {type(ev).__name__}; "
                "pass tracker.events() or a Trace"
            )
        n_events += 1
        dev = dev_of(ev.device)
        t = snap.new_trace(dev)
        if t.user_metadata is None:
            t.user_metadata = array("I")
        if ev.kind is EventKind.MARK:
            annotations.append(
                {"stage": "MARK", "name": ev.op or "", "device": dev, "time_us": ev.time_ns // 1000}
            )
            continue
        key = (ev.device, ev.storage)
        if ev.kind is EventKind.ALLOC:
            if key in live:
                raise InvalidInputError(
                    f"event {ev.seq}: storage {ev.storage} on {ev.device} allocated twice without "
                    "a free; expected each storage id to be unique within one trace"
                )
            addr = next_addr.get(dev, _BASE_ADDRESS)
            step = max(_ALIGN, -(-ev.nbytes // _ALIGN) * _ALIGN)
            next_addr[dev] = addr + step
            sid = frames_for(ev)
            live[key] = (dev, addr, ev.nbytes, sid, ev)
            if with_segments:
                add(t, "segment_alloc", addr, ev.nbytes, sid, ev)
            add(t, "alloc", addr, ev.nbytes, sid, ev)
        else:
            rec = live.pop(key, None)
            if rec is None:
                # freed storage allocated before tracking started: no address known; counted
                unknown_frees += 1
                continue
            _, addr, size, sid, _ = rec
            actions: tuple[str, ...] = ("free_requested", "free_completed")
            if with_segments:
                actions += ("segment_free",)
            for a in actions:
                add(t, a, addr, size, sid, ev)
    for dev, addr, size, sid, alloc in sorted(live.values(), key=lambda r: (r[0], r[1])):
        frames = snap.stacks[sid]
        block = Block(addr, size, size, "active_allocated", frames, category=alloc.category,
                      phase=alloc.phase, module=alloc.module)
        snap.segments.append(
            Segment(
                dev,
                addr,
                size,
                segment_type="large",
                frames=frames,
                blocks=[block],
            )
        )
    snap.external_annotations = annotations
    snap.notes.append(CPU_NOTE)
    if unknown_frees:
        snap.notes.append(
            f"{unknown_frees} frees of storages allocated before recording started were left out "
            "(their allocation, and so their address, is unknown)"
        )
    snap.source.features = ("category", "module", "phase", "time_us", "user_metadata")
    return snap
