"""The parts a memory snapshot is made of: frames, blocks, segments and device traces.

Plain data, no torch, no file I/O; :class:`~torchmem.model.snapshot.Snapshot` holds them (and
:mod:`torchmem.model.snapshot` re-exports every name here, so import from either).

Memory: segments and blocks are ``__slots__`` objects; frames are interned :class:`Frame`
tuples and stacks are interned tuples of frames, stored once per snapshot. Trace entries are
stored column-wise (``array`` columns per device in :class:`DeviceTrace`) and materialised as
:class:`TraceEntry` objects only when read.

Blocks and trace entries built from a torchmem trace also carry where each allocation came from,
as typed fields: ``category`` (:class:`~torchmem.model.events.Category`), ``phase``
(:class:`~torchmem.model.events.Phase`) and ``module`` (a module path); they are ``None`` for
allocations PyTorch's allocator recorded.

Example:
    >>> from torchmem.model.events import Category
    >>> t = DeviceTrace(0, [()])
    >>> t.append("alloc", 4096, 512, 0, 10, 0, category=Category.GRADIENT, module="fc")
    >>> e = t[0]
    >>> e.action, e.category.label, e.phase, e.module
    ('alloc', 'gradient', None, 'fc')
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any, NamedTuple, overload

from torchmem.model.events import Category, Phase

__all__ = [
    "ACTIONS",
    "BLOCK_STATES",
    "Frame",
    "Stack",
    "Block",
    "Segment",
    "TraceEntry",
    "DeviceTrace",
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

#: Fields that say where an allocation came from; ``None`` (and left out of reprs) when unknown.
_ORIGIN = ("category", "phase", "module")
_CATEGORIES = tuple(Category)
_PHASES = tuple(Phase)


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
        fields = ", ".join(
            f"{k}={getattr(self, k)!r}"
            for k in self.__slots__
            if k != "frames" and not (k in _ORIGIN and getattr(self, k) is None)
        )
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]


class _Origin(_Slotted):
    __slots__ = ()
    category: Category | None
    phase: Phase | None
    module: str | None

    def origin(self) -> dict[str, str]:
        """Where the allocation came from, as the labels that are known (PyTorch's dict keys).

        Example:
            >>> Block(0, 512, 512, "active_allocated", phase=Phase.BACKWARD).origin()
            {'phase': 'backward'}
        """
        d: dict[str, str] = {}
        if self.category is not None:
            d["category"] = self.category.label
        if self.phase is not None:
            d["phase"] = self.phase.label
        if self.module is not None:
            d["module"] = self.module
        return d


class Block(_Origin):
    """A block inside a segment: ``state`` is one of :data:`BLOCK_STATES`.

    ``frames`` is the allocation's stack, innermost first (empty when unknown). ``category``,
    ``phase`` and ``module`` say where the allocation came from when a torchmem trace knew it.

    Example:
        >>> b = Block(4096, 1024, 1000, "active_allocated")
        >>> b.is_active, b.is_allocated, b.slack
        (True, True, 24)
        >>> Block(0, 512, 512, "active_allocated", module="fc").module
        'fc'
    """

    __slots__ = (
        "address", "size", "requested_size", "state", "frames", "category", "phase", "module"
    )

    def __init__(
        self,
        address: int,
        size: int,
        requested_size: int,
        state: str,
        frames: tuple[Frame, ...] = (),
        *,
        category: Category | None = None,
        phase: Phase | None = None,
        module: str | None = None,
    ) -> None:
        self.address = address
        self.size = size
        self.requested_size = requested_size
        self.state = state
        self.frames = frames
        self.category = category
        self.phase = phase
        self.module = module

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


class TraceEntry(_Origin):
    """One trace entry, materialised from a :class:`DeviceTrace` column store.

    ``addr`` holds ``device_free`` for an ``oom`` entry (also available as ``device_free``).
    ``time_us`` is ``None`` when the snapshot predates timestamps. ``category``, ``phase`` and
    ``module`` say where the allocation came from when a torchmem trace knew it, else ``None``.

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
        "category",
        "phase",
        "module",
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
        category: Category | None = None,
        phase: Phase | None = None,
        module: str | None = None,
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
        self.category = category
        self.phase = phase
        self.module = module

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
        d.update(self.origin())
        d["frames"] = [f._asdict() for f in self.frames]
        return d


class DeviceTrace:
    """The trace entries of one device, stored column-wise.

    Columns (``array``): ``actions`` (index into :attr:`action_names`), ``addrs`` (``device_free``
    for ``oom``), ``sizes``, ``streams``, ``times`` (-1 when absent), ``stack_ids`` (index into the
    owning snapshot's :attr:`Snapshot.stacks`). ``compile_contexts`` / ``user_metadata`` are
    ``None`` when the source had no such key, else columns of indexes into :attr:`texts`.
    ``categories`` / ``phases`` (codes of :class:`~torchmem.model.events.Category` and
    :class:`~torchmem.model.events.Phase`) and ``modules`` (indexes into :attr:`texts`) are
    ``None`` when no entry knows where its allocation came from, else columns with -1 for
    "unknown".

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
        "categories",
        "phases",
        "modules",
        "texts",
        "has_time",
        "_stacks",
        "_text_index",
        "_text_count",
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
        self.categories: array | None = None
        self.phases: array | None = None
        self.modules: array | None = None
        self.texts: list[str] = []
        self.has_time = True
        self._stacks = stacks
        self._text_index: dict[str, int] | None = None
        self._text_count = 0

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
        *,
        category: Category | None = None,
        phase: Phase | None = None,
        module: str | None = None,
    ) -> None:
        """Append one entry (used by converters; readers fill columns in bulk).

        ``category``, ``phase`` and ``module`` say where the allocation came from; the first
        entry that gives one adds those columns (earlier entries read as unknown).

        Example:
            >>> t = DeviceTrace(0, [()]); t.append("oom", 1024, 4096, 0, None, 0)
            >>> t[0].device_free, t.has_time, t.categories
            (1024, False, None)
        """
        if self.categories is not None or not (category is None and phase is None and not module):
            self.add_origin_columns()
            assert self.categories is not None and self.phases is not None
            assert self.modules is not None
            self.categories.append(-1 if category is None else int(category))
            self.phases.append(-1 if phase is None else int(phase))
            self.modules.append(self.intern_text(module) if module else -1)
        self.actions.append(self.action_code(action))
        self.addrs.append(addr)
        self.sizes.append(size)
        self.streams.append(stream)
        if time_us is None:
            self.has_time = False
            time_us = -1
        self.times.append(time_us)
        self.stack_ids.append(stack_id)

    def add_origin_columns(self) -> None:
        """Add the ``categories``/``phases``/``modules`` columns (all unknown) if they are absent.

        Example:
            >>> t = DeviceTrace(0, [()]); t.append("alloc", 0, 512, 0, 1, 0)
            >>> t.add_origin_columns(); list(t.categories), t[0].category
            ([-1], None)
        """
        if self.categories is None:
            n = len(self.actions)
            self.categories = array("b", [-1]) * n
            self.phases = array("b", [-1]) * n
            self.modules = array("i", [-1]) * n

    def intern_text(self, text: str) -> int:
        """Index of ``text`` in :attr:`texts` (added if new).

        Example:
            >>> t = DeviceTrace(0, [()]); t.intern_text("fc"), t.intern_text("fc"), t.texts
            (0, 0, ['fc'])
        """
        texts = self.texts
        index = self._text_index
        if index is None or self._text_count != len(texts):  # texts grew or were replaced
            index = self._text_index = {x: i for i, x in enumerate(texts)}
        i = index.get(text)
        if i is None:
            i = index[text] = len(texts)
            texts.append(text)
        self._text_count = len(texts)
        return i

    @overload
    def __getitem__(self, i: int) -> TraceEntry: ...

    @overload
    def __getitem__(self, i: slice) -> list[TraceEntry]: ...

    def __getitem__(self, i: int | slice) -> TraceEntry | list[TraceEntry]:
        """Entry ``i`` (negative counts from the end), or a list of entries for a slice.

        Example:
            >>> t = DeviceTrace(0, [()])
            >>> t.append("alloc", 4096, 512, 0, None, 0)
            >>> t.append("free_completed", 4096, 512, 0, None, 0)
            >>> t[-1].action, [e.action for e in t[:1]], t[5:]
            ('free_completed', ['alloc'], [])
        """
        n = len(self.actions)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"trace entry {i} out of range (0..{n - 1})")
        t = self.times[i]
        cc = self.texts[self.compile_contexts[i]] if self.compile_contexts is not None else None
        um = self.texts[self.user_metadata[i]] if self.user_metadata is not None else None
        category = phase = module = None
        if self.categories is not None:
            assert self.phases is not None and self.modules is not None
            c, p, m = self.categories[i], self.phases[i], self.modules[i]
            category = _CATEGORIES[c] if c >= 0 else None
            phase = _PHASES[p] if p >= 0 else None
            module = self.texts[m] if m >= 0 else None
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
            category,
            phase,
            module,
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
