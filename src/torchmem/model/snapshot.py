"""One typed, normalised model of a memory snapshot (plain data, no torch import).

A :class:`Snapshot` is what every PyTorch memory snapshot format normalises into (the modern dict
with ``device_traces``, the bare list of segments from ``torch.cuda.memory_snapshot()``, the
2.0-era blocks that carry ``history`` and no ``address``, our JSON) and what torchmem's own
tracker traces convert into (:func:`snapshot_from_events`). :meth:`Snapshot.to_pytorch_dict`
gives the modern PyTorch format back, which ``torch.cuda._memory_viz`` and PyTorch's viewer read.

Memory: segments and blocks are ``__slots__`` objects; frames are interned :class:`Frame`
tuples and stacks are interned tuples of frames, stored once per snapshot in
:attr:`Snapshot.stacks`. Trace entries are stored column-wise (``array`` columns per device in
:class:`DeviceTrace`) and materialised as :class:`TraceEntry` objects only when read.

Example:
    >>> snap = Snapshot.from_pytorch({
    ...     "segments": [{"device": 0, "address": 4096, "total_size": 2097152, "stream": 0,
    ...                   "segment_type": "small", "blocks": [
    ...         {"address": 4096, "size": 512, "requested_size": 100, "state": "active_allocated",
    ...          "frames": [{"filename": "train.py", "line": 7, "name": "step"}]},
    ...         {"address": 4608, "size": 2096640, "requested_size": 0, "state": "inactive",
    ...          "frames": []}]}],
    ...     "device_traces": [[{"action": "alloc", "addr": 4096, "size": 100, "stream": 0,
    ...                         "time_us": 5, "frames": []}]]})
    >>> seg = snap.segments[0]
    >>> seg.total_size, seg.blocks[0].frames[0].name, len(snap.traces[0])
    (2097152, 'step', 1)
    >>> snap.traces[0][0].action, snap.traces[0][0].size
    ('alloc', 100)
    >>> snap.to_pytorch_dict()["segments"][0]["blocks"][0]["state"]
    'active_allocated'
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from torchmem.errors import InvalidInputError, SnapshotFormatError
from torchmem.model.events import Event, EventKind

__all__ = [
    "ACTIONS",
    "BLOCK_STATES",
    "Frame",
    "Stack",
    "Block",
    "Segment",
    "TraceEntry",
    "DeviceTrace",
    "SourceInfo",
    "Snapshot",
    "snapshot_from_events",
    "CPU_NOTE",
]

#: Trace-entry actions PyTorch's allocator records (c10/cuda/CUDACachingAllocator.h TraceEntry).
ACTIONS: tuple[str, ...] = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
#: Block states in ``segments[*].blocks[*].state``.
BLOCK_STATES: tuple[str, ...] = ("active_allocated", "active_pending_free", "inactive")

#: The honest description attached to snapshots built from CPU (or other non-CUDA) tracker runs.
CPU_NOTE = (
    "built by torchmem from tracked storage allocations: this device has no caching allocator, "
    "so every segment is exactly one storage (segment_alloc/alloc on allocation, "
    "free_requested/free_completed/segment_free on free); addresses are synthetic, "
    "non-overlapping and never reused; sizes are the storages' exact byte counts (no rounding)"
)


class Frame(NamedTuple):
    """One stack frame, as PyTorch records it (``{filename, line, name}``).

    Example:
        >>> Frame("train.py", 12, "step").label()
        'train.py:12:step'
    """

    filename: str
    line: int
    name: str

    def label(self, full_filename: bool = False) -> str:
        """``file:line:name`` (the file's base name unless ``full_filename``).

        Example:
            >>> Frame("/a/b/model.py", 3, "forward").label()
            'model.py:3:forward'
        """
        fname = self.filename
        if not full_filename:
            fname = fname.replace("\\", "/").rsplit("/", 1)[-1]
        return f"{fname}:{self.line}:{self.name}"


#: A stack is innermost-first (PyTorch's order), an interned tuple of frames.
Stack = tuple  # tuple[Frame, ...]


class _Slotted:
    __slots__: tuple[str, ...] = ()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__ if k != "frames")
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]


class Block(_Slotted):
    """A block inside a segment: ``state`` is one of :data:`BLOCK_STATES`.

    ``frames`` is the allocation's stack, innermost first (empty when unknown).

    Example:
        >>> b = Block(4096, 1024, 1000, "active_allocated")
        >>> b.is_active, b.is_allocated, b.slack
        (True, True, 24)
    """

    __slots__ = ("address", "size", "requested_size", "state", "frames")

    def __init__(
        self,
        address: int,
        size: int,
        requested_size: int,
        state: str,
        frames: tuple[Frame, ...] = (),
    ) -> None:
        self.address = address
        self.size = size
        self.requested_size = requested_size
        self.state = state
        self.frames = frames

    @property
    def is_allocated(self) -> bool:
        """True for ``active_allocated`` (counted in allocated bytes).

        Example:
            >>> Block(0, 512, 512, "active_pending_free").is_allocated
            False
        """
        return self.state == "active_allocated"

    @property
    def is_active(self) -> bool:
        """True unless ``inactive`` (pending frees still count as active).

        Example:
            >>> Block(0, 512, 512, "active_pending_free").is_active
            True
        """
        return self.state != "inactive"

    @property
    def slack(self) -> int:
        """Rounding slack of an active block: ``size - requested_size`` (0 when inactive).

        Example:
            >>> Block(0, 1024, 1000, "inactive").slack
            0
        """
        return self.size - self.requested_size if self.state != "inactive" else 0


class Segment(_Slotted):
    """One allocator segment (one ``cudaMalloc``, or one mapped range of an expandable segment).

    Example:
        >>> s = Segment(0, 0, 2097152, stream=0, segment_type="small",
        ...             blocks=[Block(0, 512, 500, "active_allocated"),
        ...                     Block(512, 2096640, 0, "inactive")])
        >>> s.allocated_size, s.active_size, s.requested_size, s.free_size
        (512, 512, 500, 2096640)
    """

    __slots__ = (
        "device",
        "address",
        "total_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "is_expandable",
        "frames",
        "blocks",
    )

    def __init__(
        self,
        device: int,
        address: int,
        total_size: int,
        *,
        stream: int = 0,
        segment_type: str = "large",
        segment_pool_id: tuple[int, int] = (0, 0),
        is_expandable: bool = False,
        frames: tuple[Frame, ...] = (),
        blocks: list[Block] | None = None,
    ) -> None:
        self.device = device
        self.address = address
        self.total_size = total_size
        self.stream = stream
        self.segment_type = segment_type
        self.segment_pool_id = segment_pool_id
        self.is_expandable = is_expandable
        self.frames = frames
        self.blocks = blocks if blocks is not None else []

    @property
    def allocated_size(self) -> int:
        """Bytes of ``active_allocated`` blocks.

        Example:
            >>> Segment(0, 0, 1024, blocks=[Block(0, 1024, 1000, "active_allocated")]).allocated_size
            1024
        """
        return sum(b.size for b in self.blocks if b.state == "active_allocated")

    @property
    def active_size(self) -> int:
        """Bytes of active blocks (allocated or pending free).

        Example:
            >>> Segment(0, 0, 1024, blocks=[Block(0, 1024, 1000, "active_pending_free")]).active_size
            1024
        """
        return sum(b.size for b in self.blocks if b.state != "inactive")

    @property
    def requested_size(self) -> int:
        """Requested (unrounded) bytes of active blocks, as PyTorch reports it.

        Example:
            >>> Segment(0, 0, 1024, blocks=[Block(0, 1024, 1000, "active_allocated")]).requested_size
            1000
        """
        return sum(b.requested_size for b in self.blocks if b.state != "inactive")

    @property
    def free_size(self) -> int:
        """Bytes of inactive blocks (cached, free inside this segment).

        Example:
            >>> Segment(0, 0, 1024, blocks=[Block(0, 1024, 0, "inactive")]).free_size
            1024
        """
        return sum(b.size for b in self.blocks if b.state == "inactive")


class TraceEntry(_Slotted):
    """One trace entry, materialised from a :class:`DeviceTrace` column store.

    ``addr`` holds ``device_free`` for an ``oom`` entry (also available as ``device_free``).
    ``time_us`` is ``None`` when the snapshot predates timestamps.

    Example:
        >>> e = TraceEntry(0, "oom", 0, 2048, 0, None, ())
        >>> e.device_free
        0
    """

    __slots__ = (
        "index",
        "action",
        "addr",
        "size",
        "stream",
        "time_us",
        "frames",
        "compile_context",
        "user_metadata",
    )

    def __init__(
        self,
        index: int,
        action: str,
        addr: int,
        size: int,
        stream: int,
        time_us: int | None,
        frames: tuple[Frame, ...],
        compile_context: str | None = None,
        user_metadata: str | None = None,
    ) -> None:
        self.index = index
        self.action = action
        self.addr = addr
        self.size = size
        self.stream = stream
        self.time_us = time_us
        self.frames = frames
        self.compile_context = compile_context
        self.user_metadata = user_metadata

    @property
    def device_free(self) -> int | None:
        """Free device bytes reported by an ``oom`` entry, else ``None``.

        Example:
            >>> TraceEntry(0, "alloc", 4096, 512, 0, 1, ()).device_free is None
            True
        """
        return self.addr if self.action == "oom" else None

    def to_dict(self) -> dict[str, Any]:
        """PyTorch's dict form of this entry (frames as dicts).

        Example:
            >>> TraceEntry(0, "alloc", 4096, 512, 0, 7, (Frame("a.py", 1, "f"),)).to_dict()["frames"]
            [{'filename': 'a.py', 'line': 1, 'name': 'f'}]
        """
        d: dict[str, Any] = {"action": self.action}
        if self.action == "oom":
            d["device_free"] = self.addr
        else:
            d["addr"] = self.addr
        d["size"] = self.size
        d["stream"] = self.stream
        if self.time_us is not None:
            d["time_us"] = self.time_us
        if self.compile_context is not None:
            d["compile_context"] = self.compile_context
        if self.user_metadata is not None:
            d["user_metadata"] = self.user_metadata
        d["frames"] = [f._asdict() for f in self.frames]
        return d


def _int_array(code: str, values: Iterable[int]) -> array:
    try:
        return array(code, values)
    except OverflowError:
        raise SnapshotFormatError(
            f"a trace column holds a value outside the 64-bit range ({code}); "
            "expected addresses, sizes, streams and times that fit in 64 bits"
        ) from None


class DeviceTrace:
    """The trace entries of one device, stored column-wise.

    Columns (``array``): ``actions`` (index into :attr:`action_names`), ``addrs`` (``device_free``
    for ``oom``), ``sizes``, ``streams``, ``times`` (-1 when absent), ``stack_ids`` (index into the
    owning snapshot's :attr:`Snapshot.stacks`). ``compile_contexts`` / ``user_metadata`` are
    ``None`` when the source had no such key, else columns of indexes into :attr:`texts`.

    Example:
        >>> t = DeviceTrace(0, [()])
        >>> t.append("alloc", 4096, 512, 0, 10, 0)
        >>> t.append("free_completed", 4096, 512, 0, 11, 0)
        >>> len(t), [e.action for e in t], t.has_time
        (2, ['alloc', 'free_completed'], True)
    """

    __slots__ = (
        "device",
        "action_names",
        "actions",
        "addrs",
        "sizes",
        "streams",
        "times",
        "stack_ids",
        "compile_contexts",
        "user_metadata",
        "texts",
        "has_time",
        "_stacks",
    )

    def __init__(self, device: int, stacks: list[tuple[Frame, ...]]) -> None:
        self.device = device
        self.action_names: list[str] = list(ACTIONS)
        self.actions = array("B")
        self.addrs = array("Q")
        self.sizes = array("Q")
        self.streams = array("q")
        self.times = array("q")
        self.stack_ids = array("I")
        self.compile_contexts: array | None = None
        self.user_metadata: array | None = None
        self.texts: list[str] = []
        self.has_time = True
        self._stacks = stacks

    def __len__(self) -> int:
        return len(self.actions)

    def action_code(self, name: str) -> int:
        """Code of an action name (unknown names get a new code).

        Example:
            >>> DeviceTrace(0, [()]).action_code("free_completed")
            2
        """
        try:
            return self.action_names.index(name)
        except ValueError:
            self.action_names.append(name)
            return len(self.action_names) - 1

    def append(
        self,
        action: str,
        addr: int,
        size: int,
        stream: int,
        time_us: int | None,
        stack_id: int,
    ) -> None:
        """Append one entry (used by converters; readers fill columns in bulk).

        Example:
            >>> t = DeviceTrace(0, [()]); t.append("oom", 1024, 4096, 0, None, 0)
            >>> t[0].device_free, t.has_time
            (1024, False)
        """
        self.actions.append(self.action_code(action))
        self.addrs.append(addr)
        self.sizes.append(size)
        self.streams.append(stream)
        if time_us is None:
            self.has_time = False
            time_us = -1
        self.times.append(time_us)
        self.stack_ids.append(stack_id)

    def __getitem__(self, i: int) -> TraceEntry:
        n = len(self.actions)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"trace entry {i} out of range (0..{n - 1})")
        t = self.times[i]
        cc = self.texts[self.compile_contexts[i]] if self.compile_contexts is not None else None
        um = self.texts[self.user_metadata[i]] if self.user_metadata is not None else None
        return TraceEntry(
            i,
            self.action_names[self.actions[i]],
            self.addrs[i],
            self.sizes[i],
            self.streams[i],
            t if (self.has_time and t >= 0) else None,
            self._stacks[self.stack_ids[i]],
            cc,
            um,
        )

    def __iter__(self) -> Iterator[TraceEntry]:
        for i in range(len(self.actions)):
            yield self[i]

    def count(self, action: str) -> int:
        """How many entries have this action.

        Example:
            >>> t = DeviceTrace(0, [()]); t.append("alloc", 0, 512, 0, 1, 0)
            >>> t.count("alloc"), t.count("oom")
            (1, 0)
        """
        if action not in self.action_names:
            return 0
        return self.actions.count(self.action_names.index(action))


class SourceInfo(_Slotted):
    """Where a snapshot came from and which format features it had.

    ``format`` is ``"dict"`` (modern, with ``device_traces``), ``"list"`` (bare list of segments),
    ``"legacy-history"`` (2.0-era blocks with ``history``), ``"torchmem-json"``,
    ``"torchmem-events"`` (built from a tracker trace) or ``"memory"`` (built in memory).

    Example:
        >>> SourceInfo(format="list").format
        'list'
    """

    __slots__ = ("path", "format", "pickle_protocol", "features")

    def __init__(
        self,
        path: str | None = None,
        format: str = "memory",
        pickle_protocol: int | None = None,
        features: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.format = format
        self.pickle_protocol = pickle_protocol
        self.features = features


class Snapshot:
    """A normalised memory snapshot: segments and blocks at the end, device traces, settings.

    Attributes: ``segments`` (sorted by device then address), ``traces`` (``{device: DeviceTrace}``),
    ``num_trace_devices`` (length of ``device_traces`` in the source), ``allocator_settings``
    (dict or ``None``), ``external_annotations`` (list of dicts or ``None``), ``device_names``
    (``{index: "cuda:0" | "cpu" | ...}``), ``notes`` (honest remarks about how it was produced),
    ``source`` (:class:`SourceInfo`), ``stacks`` (the interned stack table; index 0 is ``()``).

    Example:
        >>> s = Snapshot()
        >>> s.devices, s.to_pytorch_dict()["device_traces"]
        ([], [])
    """

    __slots__ = (
        "segments",
        "traces",
        "num_trace_devices",
        "allocator_settings",
        "external_annotations",
        "device_names",
        "notes",
        "source",
        "stacks",
        "_stack_index",
        "_frame_index",
    )

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.traces: dict[int, DeviceTrace] = {}
        self.num_trace_devices = 0
        self.allocator_settings: dict[str, Any] | None = None
        self.external_annotations: list[dict[str, Any]] | None = None
        self.device_names: dict[int, str] = {}
        self.notes: list[str] = []
        self.source = SourceInfo()
        self.stacks: list[tuple[Frame, ...]] = [()]
        self._stack_index: dict[tuple[Frame, ...], int] = {(): 0}
        self._frame_index: dict[Frame, Frame] = {}

    # ------------------------------------------------------------------ interning
    def intern_frame(self, filename: str, line: int, name: str) -> Frame:
        """The snapshot's single shared :class:`Frame` for these values.

        Example:
            >>> s = Snapshot()
            >>> s.intern_frame("a.py", 1, "f") is s.intern_frame("a.py", 1, "f")
            True
        """
        f = Frame(filename, line, name)
        return self._frame_index.setdefault(f, f)

    def intern_stack(self, frames: Sequence[Frame]) -> int:
        """Index of this stack (tuple of frames) in :attr:`stacks`, adding it if new.

        Example:
            >>> s = Snapshot(); f = s.intern_frame("a.py", 1, "f")
            >>> s.intern_stack((f,)), s.intern_stack([f]), s.intern_stack(())
            (1, 1, 0)
        """
        key = tuple(frames)
        idx = self._stack_index.get(key)
        if idx is None:
            idx = len(self.stacks)
            self.stacks.append(key)
            self._stack_index[key] = idx
        return idx

    def new_trace(self, device: int) -> DeviceTrace:
        """Create (or return) the :class:`DeviceTrace` of ``device``.

        Example:
            >>> s = Snapshot(); s.new_trace(1) is s.new_trace(1), s.num_trace_devices
            (True, 2)
        """
        t = self.traces.get(device)
        if t is None:
            t = self.traces[device] = DeviceTrace(device, self.stacks)
            self.num_trace_devices = max(self.num_trace_devices, device + 1)
        return t

    # ------------------------------------------------------------------ queries
    @property
    def devices(self) -> list[int]:
        """Device indexes that have segments or trace entries.

        Example:
            >>> Snapshot().devices
            []
        """
        devs = {s.device for s in self.segments}
        devs.update(d for d, t in self.traces.items() if len(t))
        return sorted(devs)

    def device_name(self, device: int) -> str:
        """Human name of a device index (``"cuda:N"`` unless the producer said otherwise).

        Example:
            >>> Snapshot().device_name(1)
            'cuda:1'
        """
        return self.device_names.get(device, f"cuda:{device}")

    def segments_of(self, device: int) -> list[Segment]:
        """Segments of one device, sorted by address.

        Example:
            >>> Snapshot().segments_of(0)
            []
        """
        return [s for s in self.segments if s.device == device]

    def trace(self, device: int) -> DeviceTrace:
        """The trace of ``device`` (an empty one when it has none).

        Example:
            >>> len(Snapshot().trace(3))
            0
        """
        t = self.traces.get(device)
        return t if t is not None else DeviceTrace(device, self.stacks)

    def __repr__(self) -> str:
        n = sum(len(t) for t in self.traces.values())
        return (
            f"Snapshot(devices={self.devices}, segments={len(self.segments)}, "
            f"trace_entries={n}, format={self.source.format!r})"
        )

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_pytorch(cls, obj: Any, *, path: str | None = None) -> Snapshot:
        """Normalise an unpickled PyTorch snapshot (dict or list of segments) or our JSON dict.

        Raises :class:`~torchmem.errors.SnapshotFormatError` naming ``path`` and what was wrong.

        Example:
            >>> Snapshot.from_pytorch([]).source.format
            'list'
        """
        from torchmem.io.pytorch_snapshot import normalise

        return normalise(obj, path)

    @classmethod
    def from_trace(cls, trace: Any, **kwargs: Any) -> Snapshot:
        """Build a snapshot from a torchmem tracker trace (anything with ``.events()``) or events.

        See :func:`snapshot_from_events` for the keyword arguments.

        Example:
            >>> ev = [Event(0, EventKind.ALLOC, 1000, "cpu", 4096, 1, op="aten::empty")]
            >>> Snapshot.from_trace(ev).segments[0].total_size
            4096
        """
        events = trace.events() if hasattr(trace, "events") else trace
        devices = getattr(trace, "devices", None) or getattr(getattr(trace, "trace", None), "devices", None)
        if devices and kwargs.get("device_index") is None:
            kwargs["device_index"] = default_device_index(devices)
        return snapshot_from_events(events, **kwargs)

    def to_pytorch_dict(self) -> dict[str, Any]:
        """PyTorch's modern snapshot format (what ``torch.cuda.memory._snapshot()`` returns).

        Keys: ``segments`` (with ``blocks`` carrying ``address`` and ``frames``),
        ``device_traces`` (one list per device index, entries with ``action``, ``addr`` /
        ``device_free``, ``size``, ``stream``, ``frames`` and ``time_us`` when known), plus
        ``allocator_settings`` / ``external_annotations`` when known. Frames and stacks are shared
        objects (as in PyTorch's output), so do not mutate them in place. A ``torchmem`` key holds
        device names and notes; PyTorch's tools ignore it.

        Example:
            >>> d = Snapshot().to_pytorch_dict()
            >>> sorted(d)
            ['device_traces', 'segments', 'torchmem']
        """
        frame_dicts: dict[Frame, dict[str, Any]] = {}

        def fd(f: Frame) -> dict[str, Any]:
            d = frame_dicts.get(f)
            if d is None:
                d = frame_dicts[f] = {"filename": f.filename, "line": f.line, "name": f.name}
            return d

        stack_lists: list[list[dict[str, Any]] | None] = [None] * len(self.stacks)

        def sl(idx: int) -> list[dict[str, Any]]:
            lst = stack_lists[idx]
            if lst is None:
                lst = stack_lists[idx] = [fd(f) for f in self.stacks[idx]]
            return lst

        segs = []
        for s in self.segments:
            blocks = [
                {
                    "address": b.address,
                    "size": b.size,
                    "requested_size": b.requested_size,
                    "state": b.state,
                    "frames": sl(self.intern_stack(b.frames)),
                }
                for b in s.blocks
            ]
            segs.append(
                {
                    "device": s.device,
                    "address": s.address,
                    "total_size": s.total_size,
                    "allocated_size": s.allocated_size,
                    "active_size": s.active_size,
                    "requested_size": s.requested_size,
                    "stream": s.stream,
                    "segment_type": s.segment_type,
                    "segment_pool_id": tuple(s.segment_pool_id),
                    "is_expandable": s.is_expandable,
                    "frames": sl(self.intern_stack(s.frames)),
                    "blocks": blocks,
                }
            )
        traces: list[list[dict[str, Any]]] = []
        for dev in range(self.num_trace_devices):
            t = self.traces.get(dev)
            entries: list[dict[str, Any]] = []
            traces.append(entries)
            if t is None:
                continue
            names = t.action_names
            oom = names.index("oom")
            has_time = t.has_time
            ccs = t.compile_contexts
            ums = t.user_metadata
            texts = t.texts
            for i, (a, addr, size, stream, tm, sid) in enumerate(
                zip(t.actions, t.addrs, t.sizes, t.streams, t.times, t.stack_ids)
            ):
                e: dict[str, Any] = {"action": names[a]}
                if a == oom:
                    e["device_free"] = addr
                else:
                    e["addr"] = addr
                e["size"] = size
                e["stream"] = stream
                if has_time:
                    e["time_us"] = tm
                if ccs is not None:
                    e["compile_context"] = texts[ccs[i]]
                if ums is not None:
                    e["user_metadata"] = texts[ums[i]]
                e["frames"] = sl(sid)
                entries.append(e)
        out: dict[str, Any] = {"segments": segs, "device_traces": traces}
        if self.allocator_settings is not None:
            out["allocator_settings"] = self.allocator_settings
        if self.external_annotations is not None:
            out["external_annotations"] = self.external_annotations
        out["torchmem"] = {
            "device_names": {str(k): v for k, v in sorted(self.device_names.items())},
            "notes": list(self.notes),
            "source_format": self.source.format,
        }
        return out


# ---------------------------------------------------------------------- events -> snapshot
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



def default_device_index(names: Iterable[str]) -> dict[str, int]:
    """Device indexes for a snapshot: ``cuda:N`` keeps ``N``; other devices follow the CUDA ones.

    Knowing every device up front keeps ``cuda:0`` at index 0 even when a CPU event comes first.

    Example:
        >>> default_device_index(["cpu", "cuda:1", "cuda:0", "meta"])
        {'cuda:1': 1, 'cuda:0': 0, 'cpu': 2, 'meta': 3}
    """
    names = list(dict.fromkeys(names))
    index: dict[str, int] = {}
    for name in names:
        if name.startswith("cuda:") and name[5:].isdigit():
            index[name] = int(name[5:])
    nxt = max(index.values(), default=-1) + 1
    for name in names:
        if name not in index:
            index[name] = nxt
            nxt += 1
    return index

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
    (filename ``<module>``); ``user_metadata`` carries ``category=... phase=... storage=...``.
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
        if name.startswith("cuda:") and name[5:].isdigit() and int(name[5:]) not in used:
            d = int(name[5:])
        elif name == "cuda" and 0 not in used:
            d = 0
        else:
            d = 0
            while d in used:
                d += 1
        index[name] = d
        used.add(d)
        snap.device_names[d] = name
        return d

    next_addr: dict[int, int] = {}
    # storage key -> (device, addr, size, stack_id, time_us)
    live: dict[tuple[str, int], tuple[int, int, int, int]] = {}
    ctx_cache: dict[tuple[Any, ...], int] = {}
    annotations: list[dict[str, Any]] = []
    traces_meta: dict[int, list[str]] = {}
    text_index: dict[int, dict[str, int]] = {}

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

    def meta_of(t: DeviceTrace, ev: Event) -> None:
        text = f"category={ev.category.label} phase={ev.phase.label} storage={ev.storage}"
        idx_map = text_index.setdefault(t.device, {})
        i = idx_map.get(text)
        if i is None:
            i = idx_map[text] = len(t.texts)
            t.texts.append(text)
        assert t.user_metadata is not None
        t.user_metadata.append(i)

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
            traces_meta[dev] = []
        tus = ev.time_ns // 1000
        if ev.kind is EventKind.MARK:
            annotations.append(
                {"stage": "MARK", "name": ev.op or "", "device": dev, "time_us": tus}
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
            live[key] = (dev, addr, ev.nbytes, sid)
            if with_segments:
                t.append("segment_alloc", addr, ev.nbytes, 0, tus, sid)
                meta_of(t, ev)
            t.append("alloc", addr, ev.nbytes, 0, tus, sid)
            meta_of(t, ev)
        else:
            rec = live.pop(key, None)
            if rec is None:
                # freed storage allocated before tracking started: no address known; counted
                unknown_frees += 1
                continue
            _, addr, size, sid = rec
            actions: tuple[str, ...] = ("free_requested", "free_completed")
            if with_segments:
                actions += ("segment_free",)
            for a in actions:
                t.append(a, addr, size, 0, tus, sid)
                meta_of(t, ev)
    for dev, addr, size, sid in sorted(live.values(), key=lambda r: (r[0], r[1])):
        frames = snap.stacks[sid]
        snap.segments.append(
            Segment(
                dev,
                addr,
                size,
                segment_type="large",
                frames=frames,
                blocks=[Block(addr, size, size, "active_allocated", frames)],
            )
        )
    snap.external_annotations = annotations
    snap.notes.append(CPU_NOTE)
    if unknown_frees:
        snap.notes.append(
            f"{unknown_frees} frees of storages allocated before recording started were left out "
            "(their allocation, and so their address, is unknown)"
        )
    snap.source.features = ("time_us", "user_metadata")
    return snap
