"""Column-wise event traces (plain data, no torch, no file I/O).

A :class:`Trace` holds an event stream as parallel typed arrays (the stdlib :mod:`array`
module), one entry per event, plus string tables for devices, operator/module names and stacks.
Holding an event costs 47 bytes (see :data:`BYTES_PER_EVENT`). The ``.tmtrace`` file format that
stores these columns is in :mod:`torchmem.io.tmtrace`.

The tracker (:mod:`torchmem.capture`) appends to a Trace while it records; consumers (summaries,
plots, snapshot conversion, the viewer) read one with :meth:`Trace.events` or the columns.

Columns (typecode, bytes): kind (B,1) time_ns (q,8) device (H,2) nbytes (q,8) storage (q,8)
op (I,4) module (I,4) phase (B,1) category (B,1) step (I,4) stack (i,4) thread (H,2). ``seq``
is the row index. Codes of kind/phase/category are :class:`~torchmem.model.events.EventKind`,
:class:`~torchmem.model.events.Phase` and :class:`~torchmem.model.events.Category`; ``op`` and
``module`` index :attr:`Trace.strings` (index 0 is ``""``, meaning "none"), ``stack`` indexes
:attr:`Trace.stacks` (-1 means "no stack"); ``thread`` indexes :attr:`Trace.threads`, the names
of the Python threads events happened on (index 0 is ``""``, meaning "not known").

Writers append ``stack`` last: a reader on another thread (the trace streamer) may take
``len(trace.stack)`` as the number of complete rows.

Example:
    >>> from torchmem.model.events import EventKind, Category
    >>> tr = Trace()
    >>> tr.append(EventKind.ALLOC, 0, "cpu", 4096, 1, op="aten::mm", category=Category.ACTIVATION)
    0
    >>> tr.append(EventKind.FREE, 5, "cpu", 4096, 1, op="aten::mm")
    1
    >>> len(tr), tr.peak(), [e.kind.label for e in tr.events()]
    (2, {'cpu': 4096}, ['alloc', 'free'])
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.events import Category, Event, EventKind, Phase

__all__ = ["Trace", "COLUMNS", "BYTES_PER_EVENT"]

#: (column name, array typecode, item size in bytes), in the order files store them.
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("kind", "B", 1),
    ("time_ns", "q", 8),
    ("device", "H", 2),
    ("nbytes", "q", 8),
    ("storage", "q", 8),
    ("op", "I", 4),
    ("module", "I", 4),
    ("phase", "B", 1),
    ("category", "B", 1),
    ("step", "I", 4),
    ("stack", "i", 4),
    ("thread", "H", 2),
)
#: Bytes one held event costs in the columns (string tables are shared and not counted).
BYTES_PER_EVENT = sum(size for _, _, size in COLUMNS)

for _name, _code, _size in COLUMNS:  # fail loudly on an exotic platform rather than write junk
    if array(_code).itemsize != _size:  # pragma: no cover
        raise RuntimeError(f"array typecode {_code!r} is not {_size} bytes on this platform")

_KINDS = tuple(EventKind)
_PHASES = tuple(Phase)
_CATS = tuple(Category)


class Trace:
    """An event stream held column-wise; the result of a tracking run or of
    :func:`torchmem.io.tmtrace.load_trace`.

    ``storage`` ids are unique within the trace. Categories of allocations may be refined after
    they are appended (see :meth:`set_category`), e.g. an activation freed within its phase
    becomes a temporary.

    Example:
        >>> from torchmem.model.events import EventKind
        >>> tr = Trace()
        >>> _ = tr.append(EventKind.ALLOC, 0, "cpu", 100, 1)
        >>> _ = tr.append(EventKind.ALLOC, 1, "meta", 50, 2)
        >>> _ = tr.append(EventKind.FREE, 2, "cpu", 100, 1)
        >>> tr.peak(), tr.live_bytes(), tr.live_bytes("meta")
        ({'cpu': 100, 'meta': 50}, {'cpu': 0, 'meta': 50}, 50)
    """

    def __init__(self, metadata: dict[str, Any] | None = None) -> None:
        self.kind = array("B")
        self.time_ns = array("q")
        self.device = array("H")
        self.nbytes = array("q")
        self.storage = array("q")
        self.op = array("I")
        self.module = array("I")
        self.phase = array("B")
        self.category = array("B")
        self.step = array("I")
        self.stack = array("i")
        self.thread = array("H")
        self.devices: list[str] = []
        self.strings: list[str] = [""]
        self.stacks: list[tuple[str, ...]] = []
        self.threads: list[str] = [""]
        self.metadata: dict[str, Any] = dict(metadata or {})
        #: the folded figures of an aggregated run (a :class:`~torchmem.model.aggregate.Aggregate`),
        #: ``None`` for a trace that holds every event
        self.aggregate: Any = None
        self._device_index: dict[str, int] = {}
        self._string_index: dict[str, int] = {"": 0}
        self._stack_index: dict[tuple[str, ...], int] = {}
        self._thread_index: dict[str, int] = {"": 0}

    # ---- building -------------------------------------------------------------------------
    def intern_device(self, device: str) -> int:
        """Index of ``device`` in the device table (added if new).

        Example:
            >>> Trace().intern_device("cuda:0")
            0
        """
        i = self._device_index.get(device)
        if i is None:
            i = self._device_index[device] = len(self.devices)
            self.devices.append(device)
        return i

    def intern(self, text: str | None) -> int:
        """Index of an operator or module name in the string table (0 for ``None``).

        Example:
            >>> t = Trace(); t.intern("aten::mm"), t.intern(None), t.intern("aten::mm")
            (1, 0, 1)
        """
        if not text:
            return 0
        i = self._string_index.get(text)
        if i is None:
            i = self._string_index[text] = len(self.strings)
            self.strings.append(text)
        return i

    def intern_thread(self, name: str | None) -> int:
        """Index of a thread name in the thread table (0 for ``None``: "not known").

        Example:
            >>> t = Trace(); t.intern_thread("MainThread"), t.intern_thread(None)
            (1, 0)
        """
        if not name:
            return 0
        i = self._thread_index.get(name)
        if i is None:
            if len(self.threads) >= 65535:
                raise InvalidInputError(
                    f"expected at most 65534 thread names in one trace, got one more ({name!r}); "
                    "name threads by role rather than uniquely"
                )
            i = self._thread_index[name] = len(self.threads)
            self.threads.append(name)
        return i

    def intern_stack(self, stack: Sequence[str] | None) -> int:
        """Index of a stack (innermost last) in the stack table, -1 for ``None``.

        Example:
            >>> Trace().intern_stack(("a.py:1:f",))
            0
        """
        if stack is None:
            return -1
        key = tuple(stack)
        i = self._stack_index.get(key)
        if i is None:
            i = self._stack_index[key] = len(self.stacks)
            self.stacks.append(key)
        return i

    def append(
        self,
        kind: EventKind | int,
        time_ns: int,
        device: str,
        nbytes: int,
        storage: int,
        op: str | None = None,
        module: str | None = None,
        phase: Phase | int = Phase.OTHER,
        category: Category | int = Category.OTHER,
        step: int = 0,
        stack: Sequence[str] | None = None,
        thread: str | None = None,
    ) -> int:
        """Append one event and return its sequence number (slow path; the tracker appends
        to the columns directly).

        Example:
            >>> from torchmem.model.events import EventKind
            >>> Trace().append(EventKind.MARK, 0, "cpu", 0, 0, op="step")
            0
        """
        self.kind.append(int(kind))
        self.time_ns.append(int(time_ns))
        self.device.append(self.intern_device(device))
        self.nbytes.append(int(nbytes))
        self.storage.append(int(storage))
        self.op.append(self.intern(op))
        self.module.append(self.intern(module))
        self.phase.append(int(phase))
        self.category.append(int(category))
        self.step.append(int(step))
        self.thread.append(self.intern_thread(thread))
        self.stack.append(self.intern_stack(stack))
        return len(self.kind) - 1

    def set_tables(
        self,
        devices: Sequence[str],
        strings: Sequence[str],
        stacks: Sequence[Sequence[str]],
        threads: Sequence[str] = ("",),
    ) -> None:
        """Replace the device, string, stack and thread tables (a reader fills the columns, then
        this).

        ``strings[0]`` must be ``""``: index 0 of the ``op`` and ``module`` columns means "none".

        Example:
            >>> t = Trace(); t.set_tables(["cpu"], ["", "aten::mm"], [["a.py:1:f"]])
            >>> t.intern("aten::mm"), t.intern_device("cpu"), t.intern_stack(["a.py:1:f"])
            (1, 0, 0)
            >>> t.set_tables([], ["aten::mm"], [])
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: expected a string table that starts with "" (index 0 means no name), got ['aten::mm']; fix: put "" first
        """
        for what, table in (("string", strings), ("thread", threads)):
            if not table or table[0] != "":
                raise InvalidInputError(
                    f'expected a {what} table that starts with "" (index 0 means no name), got '
                    f'{list(table[:3])}; fix: put "" first'
                )
        self.devices = list(devices)
        self.strings = list(strings)
        self.stacks = [tuple(s) for s in stacks]
        self._device_index = {d: i for i, d in enumerate(self.devices)}
        self._string_index = {s: i for i, s in enumerate(self.strings)}
        self._stack_index = {s: i for i, s in enumerate(self.stacks)}
        self.threads = [str(t) for t in threads]
        self._thread_index = {t: i for i, t in enumerate(self.threads)}

    def set_category(self, seq: int, category: Category | int) -> None:
        """Change the category recorded for event ``seq``.

        Example:
            >>> from torchmem.model.events import EventKind, Category
            >>> t = Trace(); i = t.append(EventKind.ALLOC, 0, "cpu", 8, 1)
            >>> t.set_category(i, Category.TEMPORARY); t.event(i).category.label
            'temporary'
        """
        self.category[seq] = int(category)

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.kind)

    def __repr__(self) -> str:
        return f"<Trace {len(self)} events on {', '.join(self.devices) or 'no device'}>"

    def event(self, seq: int) -> Event:
        """The event with sequence number ``seq`` as an :class:`Event`.

        Example:
            >>> from torchmem.model.events import EventKind
            >>> t = Trace(); _ = t.append(EventKind.ALLOC, 7, "cpu", 8, 1, op="aten::add")
            >>> t.event(0).op, t.event(0).time_ns
            ('aten::add', 7)
        """
        if seq < 0:
            seq += len(self)
        st = self.stack[seq]
        strings = self.strings
        return Event(
            seq=seq,
            kind=_KINDS[self.kind[seq]],
            time_ns=self.time_ns[seq],
            device=self.devices[self.device[seq]] if self.devices else "cpu",
            nbytes=self.nbytes[seq],
            storage=self.storage[seq],
            op=strings[self.op[seq]] or None,
            module=strings[self.module[seq]] or None,
            phase=_PHASES[self.phase[seq]],
            category=_CATS[self.category[seq]],
            step=self.step[seq],
            stack=self.stacks[st] if st >= 0 else None,
            thread=self.threads[self.thread[seq]] or None,
        )

    def events(self, start: int = 0, stop: int | None = None) -> Iterator[Event]:
        """Events in sequence order (``start``/``stop`` select a slice of sequence numbers).

        Example:
            >>> from torchmem.model.events import EventKind
            >>> t = Trace(); _ = t.append(EventKind.MARK, 0, "cpu", 0, 0, op="step")
            >>> [e.op for e in t.events()]
            ['step']
        """
        n = len(self)
        stop = n if stop is None else min(stop, n)
        for i in range(max(start, 0), stop):
            yield self.event(i)

    def live_series(self, device: str | None = None) -> list[int]:
        """Live bytes after each event (on ``device``, or summed over all devices).

        Example:
            >>> from torchmem.model.events import EventKind
            >>> t = Trace(); _ = t.append(EventKind.ALLOC, 0, "cpu", 8, 1)
            >>> _ = t.append(EventKind.FREE, 1, "cpu", 8, 1); t.live_series()
            [8, 0]
        """
        want = -1 if device is None else self._device_index.get(device, -2)
        out = []
        live = 0
        for k, d, n in zip(self.kind, self.device, self.nbytes):
            if want == -1 or d == want:
                if k == 0:
                    live += n
                elif k == 1:
                    live -= n
            out.append(live)
        return out

    def _scan(self) -> tuple[list[int], list[int], list[int]]:
        nd = len(self.devices)
        live = [0] * nd
        peak = [0] * nd
        peak_seq = [-1] * nd
        for i, (k, d, n) in enumerate(zip(self.kind, self.device, self.nbytes)):
            if k == 0:
                v = live[d] + n
                live[d] = v
                if v > peak[d]:
                    peak[d] = v
                    peak_seq[d] = i
            elif k == 1:
                live[d] -= n
        return live, peak, peak_seq

    def peak(self) -> dict[str, int]:
        """Peak live bytes per device over the whole trace.

        Example:
            >>> Trace().peak()
            {}
        """
        _, peak, _ = self._scan()
        return dict(zip(self.devices, peak))

    def peak_seq(self) -> dict[str, int]:
        """Per device, the sequence number of the event at which the peak was first reached.

        Example:
            >>> from torchmem.model.events import EventKind
            >>> t = Trace(); _ = t.append(EventKind.ALLOC, 0, "cpu", 8, 1); t.peak_seq()
            {'cpu': 0}
        """
        _, _, seqs = self._scan()
        return dict(zip(self.devices, seqs))

    def live_bytes(self, device: str | None = None) -> Any:
        """Live bytes at the end of the trace: a dict per device, or an int for ``device``.

        Example:
            >>> Trace().live_bytes("cpu")
            0
        """
        live, _, _ = self._scan()
        per = dict(zip(self.devices, live))
        if device is not None:
            return per.get(device, 0)
        return per

    @property
    def held_bytes(self) -> int:
        """Bytes the event columns occupy in memory (allocated capacity is close to this).

        Example:
            >>> Trace().held_bytes
            0
        """
        return len(self) * BYTES_PER_EVENT
