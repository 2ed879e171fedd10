"""Column-wise event traces and the ``.tmtrace`` file format (plain data, no torch).

A :class:`Trace` holds an event stream as parallel typed arrays (the stdlib :mod:`array`
module), one entry per event, plus string tables for devices, operator/module names and stacks.
Holding an event costs 45 bytes (see :data:`BYTES_PER_EVENT`), and reading a file is a handful of
``array.frombytes`` calls, so a million events load in well under a second.

The tracker (:mod:`torchmem.capture`) appends to a Trace while it records; consumers (summaries,
plots, snapshot conversion, the viewer) read one with :meth:`Trace.events` or the columns.

File format, version 1 (all integers little-endian)::

    offset  size  content
    0       8     magic  b"TMTRACE\\0"
    8       4     uint32 format version (1)
    12      4     uint32 header length H
    16      H     header: UTF-8 JSON object
                    {"format": "torchmem-trace", "version": 1, "count": N,
                     "columns": [[name, typecode, itemsize], ...],   # order of the data below
                     "devices": ["cpu", "cuda:0", ...],               # device column indexes this
                     "strings": ["", "aten::mm", "encoder.0", ...],  # op/module columns index this;
                                                                      # index 0 means "none"
                     "stacks": [["file.py:12:fn", ...], ...],         # stack column indexes this;
                                                                      # -1 means "no stack"
                     "metadata": {...}}                               # free-form (torch version...)
    16+H    ...   one block per column, N * itemsize bytes each, in header order
    end-8   8     trailer magic b"TMTREND\\0" (detects truncation)

Columns (typecode, bytes): kind (B,1) time_ns (q,8) device (H,2) nbytes (q,8) storage (q,8)
op (I,4) module (I,4) phase (B,1) category (B,1) step (I,4) stack (i,4). ``seq`` is the row
index. Codes of kind/phase/category are :class:`~torchmem.model.events.EventKind`,
:class:`~torchmem.model.events.Phase` and :class:`~torchmem.model.events.Category`. No pickle
anywhere; a reader needs only ``json`` and fixed-width integers.

Example:
    >>> import tempfile, os
    >>> from torchmem.model.events import EventKind, Category
    >>> tr = Trace()
    >>> tr.append(EventKind.ALLOC, 0, "cpu", 4096, 1, op="aten::mm", category=Category.ACTIVATION)
    0
    >>> tr.append(EventKind.FREE, 5, "cpu", 4096, 1, op="aten::mm")
    1
    >>> path = os.path.join(tempfile.mkdtemp(), "t.tmtrace")
    >>> tr.save(path)
    >>> back = Trace.load(path)
    >>> len(back), back.peak(), [e.kind.label for e in back.events()]
    (2, {'cpu': 4096}, ['alloc', 'free'])
"""

from __future__ import annotations

import json
import os
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

from torchmem.errors import TraceFormatError
from torchmem.model.events import Category, Event, EventKind, Phase

__all__ = ["Trace", "load_trace", "FORMAT_VERSION", "COLUMNS", "BYTES_PER_EVENT", "MAGIC"]

PathLike = Union[str, "os.PathLike[str]"]

MAGIC = b"TMTRACE\0"
TRAILER = b"TMTREND\0"
FORMAT_VERSION = 1

#: (column name, array typecode, item size in bytes) in file order.
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
    """An event stream held column-wise; the result of a tracking run or of :func:`load_trace`.

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
        self.devices: list[str] = []
        self.strings: list[str] = [""]
        self.stacks: list[tuple[str, ...]] = []
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._device_index: dict[str, int] = {}
        self._string_index: dict[str, int] = {"": 0}
        self._stack_index: dict[tuple[str, ...], int] = {}

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
        self.stack.append(self.intern_stack(stack))
        return len(self.kind) - 1

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

    # ---- files ----------------------------------------------------------------------------
    def save(self, path: PathLike) -> None:
        """Write the trace to ``path`` in the ``.tmtrace`` format (see the module docstring).

        Example:
            >>> import tempfile, os
            >>> p = os.path.join(tempfile.mkdtemp(), "empty.tmtrace")
            >>> Trace().save(p); len(Trace.load(p))
            0
        """
        header = {
            "format": "torchmem-trace",
            "version": FORMAT_VERSION,
            "count": len(self),
            "columns": [list(c) for c in COLUMNS],
            "devices": self.devices,
            "strings": self.strings,
            "stacks": [list(s) for s in self.stacks],
            "metadata": self.metadata,
        }
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        tmp = f"{os.fspath(path)}.part"
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<II", FORMAT_VERSION, len(blob)))
            f.write(blob)
            for name, _, _ in COLUMNS:
                col: array[Any] = getattr(self, name)
                if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
                    col = array(col.typecode, col)
                    col.byteswap()
                col.tofile(f)
            f.write(TRAILER)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: PathLike) -> Trace:
        """Read a ``.tmtrace`` file; raises :class:`~torchmem.errors.TraceFormatError` naming
        the file and the problem if it is truncated, from another version or not a trace.

        Example:
            >>> import tempfile, os
            >>> p = os.path.join(tempfile.mkdtemp(), "junk.tmtrace")
            >>> _ = open(p, "w").write("hello")
            >>> Trace.load(p)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.TraceFormatError: ...junk.tmtrace: not a torchmem trace file ...
        """
        name = os.fspath(path)
        try:
            data = Path(name).read_bytes()
        except FileNotFoundError:
            raise TraceFormatError(
                f"{name}: no such file; expected a trace written by 'torchmem run' or "
                "tracker.save(path)"
            ) from None
        except IsADirectoryError:
            raise TraceFormatError(f"{name}: is a directory, expected a .tmtrace file") from None
        if data[:8] != MAGIC:
            raise TraceFormatError(
                f"{name}: not a torchmem trace file (it does not start with {MAGIC!r}); "
                "expected a file written by 'torchmem run' or tracker.save(path)"
            )
        if len(data) < 16:
            raise TraceFormatError(f"{name}: truncated: the file ends inside its 16-byte preamble")
        version, hlen = struct.unpack_from("<II", data, 8)
        if version != FORMAT_VERSION:
            raise TraceFormatError(
                f"{name}: trace format version {version}, but this torchmem reads version "
                f"{FORMAT_VERSION}; upgrade torchmem (or re-record the trace with this version)"
            )
        if 16 + hlen > len(data):
            raise TraceFormatError(
                f"{name}: truncated: header needs {hlen} bytes but only {len(data) - 16} remain"
            )
        try:
            header = json.loads(data[16 : 16 + hlen].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise TraceFormatError(f"{name}: corrupt header ({e})") from None
        if not isinstance(header, dict) or header.get("format") != "torchmem-trace":
            raise TraceFormatError(f"{name}: header is not a torchmem-trace header")
        try:
            count = int(header["count"])
            columns = [tuple(c) for c in header["columns"]]
            devices = [str(d) for d in header["devices"]]
            strings = [str(s) for s in header["strings"]]
            stacks = [tuple(str(f) for f in s) for s in header["stacks"]]
            metadata = dict(header.get("metadata") or {})
        except (KeyError, TypeError, ValueError) as e:
            raise TraceFormatError(f"{name}: header is missing or has a bad field ({e})") from None
        if columns != [tuple(c) for c in COLUMNS]:
            raise TraceFormatError(
                f"{name}: unexpected column layout {columns}; expected {list(COLUMNS)}"
            )
        need = 16 + hlen + count * BYTES_PER_EVENT + len(TRAILER)
        if len(data) < need or data[need - len(TRAILER) : need] != TRAILER:
            raise TraceFormatError(
                f"{name}: truncated or corrupt: {count} events need {need} bytes with the "
                f"end marker, the file has {len(data)} bytes"
            )
        tr = cls(metadata)
        pos = 16 + hlen
        mv = memoryview(data)
        for cname, _code, size in COLUMNS:
            col: array[Any] = getattr(tr, cname)
            col.frombytes(mv[pos : pos + count * size])
            if sys.byteorder != "little":  # pragma: no cover
                col.byteswap()
            pos += count * size
        tr.devices = devices
        tr.strings = strings if strings and strings[0] == "" else ["", *strings]
        tr.stacks = stacks
        tr._device_index = {d: i for i, d in enumerate(devices)}
        tr._string_index = {s: i for i, s in enumerate(tr.strings)}
        tr._stack_index = {s: i for i, s in enumerate(stacks)}
        if count and (
            max(tr.device) >= max(len(devices), 1)
            or max(tr.op) >= len(tr.strings)
            or max(tr.module) >= len(tr.strings)
            or max(tr.kind) > 2
            or max(tr.phase) >= len(_PHASES)
            or max(tr.category) >= len(_CATS)
            or max(tr.stack) >= len(stacks)
        ):
            raise TraceFormatError(f"{name}: corrupt: an event refers to a table entry that is missing")
        return tr


def load_trace(path: PathLike) -> Trace:
    """Read a trace file written by ``torchmem run`` or ``tracker.save(path)``.

    Example:
        >>> load_trace("/no/such/file.tmtrace")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.TraceFormatError: /no/such/file.tmtrace: no such file; ...
    """
    return Trace.load(path)
