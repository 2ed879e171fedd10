"""The ``.tmtrace`` file format: :func:`save_trace` and :func:`load_trace` (no torch).

A file stores the columns of a :class:`~torchmem.model.trace.Trace` as they are in memory, so
reading one is a handful of ``array.frombytes`` calls: a million events load in well under a
second.

File format, version 2 (all integers little-endian)::

    offset  size  content
    0       8     magic  b"TMTRACE\\0"
    8       4     uint32 format version (2)
    12      4     uint32 header length H
    16      H     header: UTF-8 JSON object
                    {"format": "torchmem-trace", "version": 2, "count": N,
                     "columns": [[name, typecode, itemsize], ...],   # order of the data below
                     "devices": ["cpu", "cuda:0", ...],               # device column indexes this
                     "strings": ["", "aten::mm", "encoder.0", ...],  # op/module columns index this;
                                                                      # index 0 is "" ("none")
                     "stacks": [["file.py:12:fn", ...], ...],         # stack column indexes this;
                                                                      # -1 means "no stack"
                     "threads": ["", "MainThread", ...],              # thread column indexes this
                     "metadata": {...}}                               # free-form (torch version...)
    16+H    ...   one block per column, N * itemsize bytes each, in header order
    end-8   8     trailer magic b"TMTREND\\0" (detects truncation)

Version 1 files (no ``thread`` column, no ``threads`` table) are read too: their events have
``thread=None``.

**Version 3** is version 2 plus an ``"aggregate"`` object in the header: the folded figures of
an aggregated run (:class:`~torchmem.model.aggregate.Aggregate`, ``to_json``), whose columns
hold only the events it kept. Only aggregated traces are written as version 3 (a torchmem that
reads version 2 at most refuses them rather than summarising the kept events as if they were
the whole run); the reader sets ``trace.aggregate``.

**The streamed layout** (:class:`TraceStreamer`, written while a run goes on, so that a killed
run leaves a file): the same preamble with ``"layout": "stream"`` and no ``count`` or tables in
the header, then chunks, each complete on its own::

    8     b"TMCHUNK\\0"
    4     uint32 n: events in this chunk
    4     uint32 J
    J     UTF-8 JSON: the entries added to each table since the previous chunk
          {"devices": [...], "strings": [...], "stacks": [...], "threads": [...]}
    ...   one block per column, n * itemsize bytes each, in header order

An aggregated run starts its streamed file over at each compaction (written aside, then
renamed over it): version 3, a first chunk with the whole compacted trace and an ``"aggregate"``
entry in its JSON, then chunks as above.

A run that ends normally replaces its streamed file with the layout above, so a streamed file
on disk is a run that was cut short: :func:`load_trace` reads every complete chunk, drops a
partial last one, and says so in ``trace.metadata["cut_short"]``. Categories in a streamed file
are those known when each chunk was written (a later change, e.g. an activation found to be a
temporary when it is freed, is not rewritten).

The columns are :data:`~torchmem.model.trace.COLUMNS`. No pickle anywhere; a reader needs only
``json`` and fixed-width integers.

Example:
    >>> import tempfile, os
    >>> from torchmem.model.events import EventKind
    >>> from torchmem.model.trace import Trace
    >>> tr = Trace()
    >>> _ = tr.append(EventKind.ALLOC, 0, "cpu", 4096, 1, op="aten::mm")
    >>> _ = tr.append(EventKind.FREE, 5, "cpu", 4096, 1, op="aten::mm")
    >>> path = os.path.join(tempfile.mkdtemp(), "t.tmtrace")
    >>> save_trace(tr, path)
    >>> back = load_trace(path)
    >>> len(back), back.peak(), [e.kind.label for e in back.events()]
    (2, {'cpu': 4096}, ['alloc', 'free'])
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, Union

from torchmem.errors import InvalidInputError, MissingFileError, TraceFormatError
from torchmem.model.aggregate import Aggregate
from torchmem.model.events import Category, Phase
from torchmem.model.trace import BYTES_PER_EVENT, COLUMNS, Trace

__all__ = [
    "save_trace", "load_trace", "read_header", "is_tmtrace", "is_cut_short", "TraceStreamer", "MAGIC",
    "FORMAT_VERSION",
    "PathLike",
]

PathLike = Union[str, "os.PathLike[str]"]

#: The first 8 bytes of every ``.tmtrace`` file.
MAGIC = b"TMTRACE\0"
TRAILER = b"TMTREND\0"
CHUNK = b"TMCHUNK\0"
#: The version this torchmem writes (it reads this one, version 1 and, for aggregated traces,
#: version 3).
FORMAT_VERSION = 2
#: The version of aggregated traces (version 2 with an ``aggregate`` header object).
AGGREGATED_VERSION = 3
_READS = (1, 2, 3)
_T = TypeVar("_T")
#: Version 1 had no thread column.
_V1_COLUMNS = tuple(c for c in COLUMNS if c[0] != "thread")
_V1_BYTES_PER_EVENT = sum(size for _, _, size in _V1_COLUMNS)
_TABLES = ("devices", "strings", "stacks", "threads")

_N_PHASES = len(Phase)
_N_CATS = len(Category)
_EXPECTED = "expected a trace written by 'torchmem run' or tracker.save(path)"

for _name, _code, _size in COLUMNS:  # fail loudly on an exotic platform rather than write junk
    if array(_code).itemsize != _size:  # pragma: no cover
        raise RuntimeError(f"array typecode {_code!r} is not {_size} bytes on this platform")


def save_trace(trace: Trace, path: PathLike) -> None:
    """Write ``trace`` to ``path`` in the ``.tmtrace`` format (see the module docstring).

    The file is written under a temporary name and renamed, so a crash leaves no half file.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "empty.tmtrace")
        >>> save_trace(Trace(), p); len(load_trace(p))
        0
    """
    short = [f"{name} ({len(getattr(trace, name))})" for name, _, _ in COLUMNS
             if len(getattr(trace, name)) != len(trace)]
    if short:  # a file with a short column would read back as corrupt: refuse to write it
        raise InvalidInputError(
            f"cannot save this trace: it has {len(trace)} events but the column(s) "
            f"{', '.join(short)} have other lengths; append events with Trace.append (it fills "
            "every column) or extend every column named in torchmem.model.trace.COLUMNS by the same count"
        )
    agg = _aggregate_of(trace)
    version = FORMAT_VERSION if agg is None else AGGREGATED_VERSION
    header = {
        "format": "torchmem-trace",
        "version": version,
        "count": len(trace),
        "columns": [list(c) for c in COLUMNS],
        "devices": trace.devices,
        "strings": trace.strings,
        "stacks": [list(s) for s in trace.stacks],
        "threads": trace.threads,
        "metadata": trace.metadata,
    }
    if agg is not None:
        header["aggregate"] = agg
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    tmp = f"{os.fspath(path)}.part"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<II", version, len(blob)))
        f.write(blob)
        for name, _, _ in COLUMNS:
            col: array[Any] = getattr(trace, name)
            if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
                col = array(col.typecode, col)
                col.byteswap()
            col.tofile(f)
        f.write(TRAILER)
    os.replace(tmp, path)


def _aggregate_of(trace: Trace) -> dict[str, Any] | None:
    """The aggregate a file must carry: only when events were dropped (a trace that holds every
    event is a plain version 2 file)."""
    agg = trace.aggregate
    if agg is None or not agg.compactions:
        return None
    agg.fold(trace)
    out: dict[str, Any] = agg.to_json()
    return out


def _read_aggregate(name: str, data: Any) -> Aggregate:
    try:
        return Aggregate.from_json(data)
    except InvalidInputError as e:
        raise TraceFormatError(f"{name}: corrupt aggregate: {e}", path=name) from None


def is_tmtrace(path: PathLike) -> bool:
    """True when ``path`` is a readable file that starts with :data:`MAGIC`.

    Example:
        >>> is_tmtrace("/no/such/file.tmtrace")
        False
    """
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_header(path: PathLike) -> dict[str, Any] | None:
    """The JSON header of the trace file ``path`` (its ``metadata``, string tables, layout)
    without reading its events; ``None`` when it is not a readable trace file.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "t.tmtrace"); save_trace(Trace({"rank": 1}), p)
        >>> read_header(p)["metadata"], read_header("/no/such/file.tmtrace")
        ({'rank': 1}, None)
    """
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                return None
            (hlen,) = struct.unpack_from("<I", head, 12)
            header = json.loads(f.read(hlen).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None


def is_cut_short(path: PathLike) -> bool:
    """True when ``path`` is a streamed trace: a run that ended abruptly (killed) left it, so it
    holds the events up to about a second before the end (see :class:`TraceStreamer`).

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "t.tmtrace"); save_trace(Trace(), p)
        >>> is_cut_short(p), is_cut_short("/no/such/file.tmtrace")
        (False, False)
    """
    header = read_header(path)
    return header is not None and header.get("layout") == "stream"


def _read(name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except FileNotFoundError:
        raise MissingFileError(
            f"{name}: no such file; {_EXPECTED}", path=name, kind="trace"
        ) from None
    except IsADirectoryError:
        raise TraceFormatError(
            f"{name}: is a directory, expected a .tmtrace file", path=name
        ) from None


def _header(name: str, data: bytes) -> tuple[int, dict[str, Any]]:
    def bad(message: str) -> TraceFormatError:
        return TraceFormatError(f"{name}: {message}", path=name)

    if data[:8] != MAGIC:
        raise bad(
            f"not a torchmem trace file (it does not start with {MAGIC!r}); "
            "expected a file written by 'torchmem run' or tracker.save(path)"
        )
    if len(data) < 16:
        raise bad("truncated: the file ends inside its 16-byte preamble")
    version, hlen = struct.unpack_from("<II", data, 8)
    if version not in _READS:
        raise bad(
            f"trace format version {version}, but this torchmem reads version "
            f"{' and '.join(map(str, _READS))}; upgrade torchmem (or re-record the trace with "
            "this version)"
        )
    if 16 + hlen > len(data):
        raise bad(f"truncated: header needs {hlen} bytes but only {len(data) - 16} remain")
    try:
        header = json.loads(data[16 : 16 + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"corrupt header ({e})") from None
    if not isinstance(header, dict) or header.get("format") != "torchmem-trace":
        raise bad("header is not a torchmem-trace header")
    return hlen, header


def load_trace(path: PathLike) -> Trace:
    """Read a trace file written by ``torchmem run``, ``tracker.save(path)`` or :func:`save_trace`.

    Raises :class:`~torchmem.errors.MissingFileError` when there is no such file and
    :class:`~torchmem.errors.TraceFormatError` naming the file and the problem when it is
    truncated, from another version, not a trace, or inconsistent (an event pointing past a
    table, a string table that does not start with ``""``).

    Example:
        >>> load_trace("/no/such/file.tmtrace")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: /no/such/file.tmtrace: no such file; ...
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "junk.tmtrace")
        >>> _ = open(p, "w").write("hello")
        >>> load_trace(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.TraceFormatError: ...junk.tmtrace: not a torchmem trace file ...
    """
    name = os.fspath(path)
    data = _read(name)
    hlen, header = _header(name, data)
    if header.get("layout") == "stream":
        return _check(name, _load_stream(name, data, 16 + hlen, header))
    v1 = header.get("version") == 1
    try:
        count = int(header["count"])
        columns = [tuple(c) for c in header["columns"]]
        devices = [str(d) for d in header["devices"]]
        strings = [str(s) for s in header["strings"]]
        stacks = [tuple(str(f) for f in s) for s in header["stacks"]]
        threads = [""] if v1 else [str(t) for t in header["threads"]]
        metadata = dict(header.get("metadata") or {})
    except (KeyError, TypeError, ValueError) as e:
        raise TraceFormatError(
            f"{name}: header is missing or has a bad field ({e})", path=name
        ) from None
    layout = _V1_COLUMNS if v1 else COLUMNS
    if columns != [tuple(c) for c in layout]:
        raise TraceFormatError(
            f"{name}: unexpected column layout {columns}; expected {list(layout)}", path=name
        )
    for what, table in (("string", strings), ("thread", threads)):
        if not table or table[0] != "":
            raise TraceFormatError(
                f"{name}: corrupt {what} table: it should start with the empty string (index 0 "
                f'means "none"), got {table[:3]}; every name would be shifted by one, so the '
                "file was refused. Re-record the trace with 'torchmem run' or tracker.save(path)",
                path=name,
            )
    per_event = _V1_BYTES_PER_EVENT if v1 else BYTES_PER_EVENT
    need = 16 + hlen + count * per_event + len(TRAILER)
    if len(data) < need or data[need - len(TRAILER) : need] != TRAILER:
        raise TraceFormatError(
            f"{name}: truncated or corrupt: {count} events need {need} bytes with the "
            f"end marker, the file has {len(data)} bytes",
            path=name,
        )
    tr = Trace(metadata)
    _fill_columns(tr, memoryview(data), 16 + hlen, count, layout)
    if v1:
        tr.thread.frombytes(bytes(2 * count))
    tr.set_tables(devices, strings, stacks, threads)
    if header.get("version") == AGGREGATED_VERSION:
        tr.aggregate = _read_aggregate(name, header.get("aggregate"))
    return _check(name, tr)


def _fill_columns(
    tr: Trace, mv: memoryview, pos: int, count: int, layout: tuple[tuple[str, str, int], ...]
) -> int:
    """Append ``count`` rows stored column by column at ``pos``; returns the end offset."""
    for cname, _code, size in layout:
        col: array[Any] = getattr(tr, cname)
        if sys.byteorder == "little":
            col.frombytes(mv[pos : pos + count * size])
        else:  # pragma: no cover - big-endian hosts
            part = array(col.typecode, mv[pos : pos + count * size].tobytes())
            part.byteswap()
            col.extend(part)
        pos += count * size
    return pos


def _check(name: str, tr: Trace) -> Trace:
    """Refuse a trace whose events point past a table."""
    if len(tr) and (
        max(tr.device) >= max(len(tr.devices), 1)
        or max(tr.op) >= len(tr.strings)
        or max(tr.module) >= len(tr.strings)
        or max(tr.kind) > 2
        or max(tr.phase) >= _N_PHASES
        or max(tr.category) >= _N_CATS
        or max(tr.stack) >= len(tr.stacks)
        or max(tr.thread) >= len(tr.threads)
    ):
        raise TraceFormatError(
            f"{name}: corrupt: an event refers to a table entry that is missing", path=name
        )
    return tr


def _load_stream(name: str, data: bytes, pos: int, header: dict[str, Any]) -> Trace:
    """Read a streamed file: every complete chunk; a partial last chunk is dropped."""
    if [tuple(c) for c in header.get("columns") or []] != [tuple(c) for c in COLUMNS]:
        raise TraceFormatError(
            f"{name}: unexpected column layout {header.get('columns')}; expected "
            f"{list(COLUMNS)}",
            path=name,
        )
    tr = Trace(dict(header.get("metadata") or {}))
    tables: dict[str, list[Any]] = {t: [] for t in _TABLES}
    mv = memoryview(data)
    chunks = 0
    agg: Any = None
    while pos + 16 <= len(data) and data[pos : pos + 8] == CHUNK:
        n, jlen = struct.unpack_from("<II", data, pos + 8)
        end = pos + 16 + jlen + n * BYTES_PER_EVENT
        if end > len(data):
            break  # the run was killed while this chunk was being written
        try:
            added = json.loads(data[pos + 16 : pos + 16 + jlen].decode("utf-8"))
            new = {t: list(added.get(t) or []) for t in _TABLES}
        except (UnicodeDecodeError, ValueError, AttributeError, TypeError):
            break
        for t in _TABLES:
            tables[t].extend(new[t])
        if isinstance(added, dict) and "aggregate" in added:
            agg = added["aggregate"]
        _fill_columns(tr, mv, pos + 16 + jlen, n, COLUMNS)
        chunks += 1
        pos = end
    tr.set_tables(
        [str(d) for d in tables["devices"]],
        [str(s) for s in tables["strings"]] or [""],
        [tuple(str(f) for f in s) for s in tables["stacks"]],
        [str(t) for t in tables["threads"]] or [""],
    )
    if agg is not None:
        tr.aggregate = _read_aggregate(name, agg)
    tr.metadata["cut_short"] = (
        f"the run ended abruptly (killed, or the machine stopped): this is the trace it streamed "
        f"to disk, {len(tr)} events in {chunks} chunks"
        + (f", {len(data) - pos} bytes of a partial last chunk dropped" if pos < len(data) else "")
        + "; the last second or so of the run is missing, and categories are those known when "
        "each chunk was written"
    )
    return tr


class TraceStreamer:
    """Append a growing :class:`~torchmem.model.trace.Trace`'s new events to ``path`` as a run
    goes (the streamed layout in the module docstring), from a background thread that writes
    every ``interval`` seconds, so a run killed by SIGKILL or the OOM killer leaves a file that
    :func:`load_trace` reads, missing at most the last ``interval`` seconds.

    The trace's writer must append its ``stack`` column last (the tracker and
    :meth:`Trace.append <torchmem.model.trace.Trace.append>` do): ``len(trace.stack)`` rows are
    complete. :meth:`close` writes what remains and stops the thread; the caller then replaces
    the file with :func:`save_trace` for a run that ended normally.

    Example:
        >>> import tempfile, os
        >>> from torchmem.model.events import EventKind
        >>> tr = Trace(); p = os.path.join(tempfile.mkdtemp(), "s.tmtrace")
        >>> st = TraceStreamer(tr, p, interval=0.1); st.start()
        >>> _ = tr.append(EventKind.ALLOC, 0, "cpu", 64, 1, op="aten::empty", thread="MainThread")
        >>> st.close()                       # a killed run stops here, without save_trace
        >>> back = load_trace(p)
        >>> [(e.op, e.nbytes, e.thread) for e in back.events()], "cut_short" in back.metadata
        ([('aten::empty', 64, 'MainThread')], True)
    """

    def __init__(self, trace: Trace, path: PathLike, interval: float = 0.5) -> None:
        if not isinstance(interval, (int, float)) or not 0 < interval <= 1:
            raise InvalidInputError(
                f"interval must be a number of seconds in (0, 1], got {interval!r}; a killed run "
                "loses at most this much"
            )
        self.trace = trace
        self.path = os.fspath(path)
        self.interval = float(interval)
        self.error: BaseException | None = None
        self.chunks = 0
        self._rows = 0
        self._tab = dict.fromkeys(_TABLES, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._file: Any = None
        self._thread: threading.Thread | None = None
        self._extra: dict[str, Any] | None = None  # JSON added to the next chunk

    def start(self) -> None:
        """Write the preamble and start the background writer.

        Example:
            >>> import tempfile, os
            >>> st = TraceStreamer(Trace(), os.path.join(tempfile.mkdtemp(), "s.tmtrace"))
            >>> st.start(); st.close(); len(load_trace(st.path))
            0
        """
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._preamble(FORMAT_VERSION)
        self._thread = threading.Thread(
            target=self._loop, name="torchmem-trace-streamer", daemon=True
        )
        self._thread._torchmem_untracked = True  # type: ignore[attr-defined]
        self._thread.start()

    def _preamble(self, version: int) -> None:
        header = {
            "format": "torchmem-trace",
            "version": version,
            "layout": "stream",
            "columns": [list(c) for c in COLUMNS],
            "metadata": self.trace.metadata,
        }
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        self._file.write(MAGIC + struct.pack("<II", version, len(blob)) + blob)
        self._file.flush()

    def restart(self, rewrite: Callable[[], _T], state: Callable[[], dict[str, Any]]) -> _T:
        """Run ``rewrite()`` (which may change rows already written: an aggregated trace's
        compaction) with the writer paused, then start the file over: a version 3 preamble and
        one chunk with every row and ``state()`` as its ``"aggregate"``, written aside and
        renamed over the file, so that a killed run always leaves a readable one. Returns what
        ``rewrite`` returned.

        Example:
            >>> import tempfile, os
            >>> from torchmem.model.events import EventKind
            >>> tr = Trace(); st = TraceStreamer(tr, os.path.join(tempfile.mkdtemp(), "s"))
            >>> st.start(); _ = tr.append(EventKind.MARK, 0, "cpu", 0, 0, op="step")
            >>> def drop_all():
            ...     for name, _, _ in COLUMNS: del getattr(tr, name)[:]
            ...     return "dropped"
            >>> st.restart(drop_all, lambda: Aggregate().to_json()), st.chunks
            ('dropped', 1)
            >>> st.close(); len(load_trace(st.path)), load_trace(st.path).aggregate is not None
            (0, True)
        """
        with self._lock:
            result = rewrite()
            if self._file is None:
                return result
            self._file.close()
            tmp = f"{self.path}.part"
            self._file = open(tmp, "wb")  # noqa: SIM115 - closed by close()
            self._preamble(AGGREGATED_VERSION)
            self._rows = 0
            self._tab = dict.fromkeys(_TABLES, 0)
            self._extra = {"aggregate": state()}
            self._flush_locked()
            os.replace(tmp, self.path)
        return result

    def flush(self) -> int:
        """Write the events added since the last write as one chunk; returns how many.

        Example:
            >>> import tempfile, os
            >>> from torchmem.model.events import EventKind
            >>> tr = Trace(); st = TraceStreamer(tr, os.path.join(tempfile.mkdtemp(), "s"))
            >>> st.start(); _ = tr.append(EventKind.MARK, 0, "cpu", 0, 0, op="step")
            >>> st.flush(), st.flush()
            (1, 0)
            >>> st.close()
        """
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        f = self._file
        if f is None:
            return 0
        tr = self.trace
        stop = len(tr.stack)  # written last: every column has these rows
        start = self._rows
        added: dict[str, Any] = {}
        ends = {}
        for t in _TABLES:
            table = getattr(tr, t)
            ends[t] = len(table)
            added[t] = [list(x) if t == "stacks" else x for x in table[self._tab[t] : ends[t]]]
        if stop == start and not any(added.values()) and self._extra is None:
            return 0
        if self._extra is not None:
            added.update(self._extra)
            self._extra = None
        blob = json.dumps(added, separators=(",", ":")).encode("utf-8")
        parts = [CHUNK, struct.pack("<II", stop - start, len(blob)), blob]
        for cname, _, _ in COLUMNS:
            col: array[Any] = getattr(tr, cname)[start:stop]
            if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
                col.byteswap()
            parts.append(col.tobytes())
        f.write(b"".join(parts))
        f.flush()  # to the OS: it survives the process being killed
        self._rows = stop
        self._tab = ends
        self.chunks += 1
        return stop - start

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except (OSError, ValueError) as e:  # a full disk must not break the user's run
                self.error = e
                return

    def close(self) -> None:
        """Stop the writer, write what remains and close the file (safe to call twice).

        Example:
            >>> import tempfile, os
            >>> st = TraceStreamer(Trace(), os.path.join(tempfile.mkdtemp(), "s.tmtrace"))
            >>> st.start(); st.close(); st.close()
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._file is None:
            return
        try:
            if self.error is None:
                self.flush()
        finally:
            with self._lock:
                self._file.close()
                self._file = None
