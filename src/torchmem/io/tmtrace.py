"""The ``.tmtrace`` file format: :func:`save_trace` and :func:`load_trace` (no torch).

A file stores the columns of a :class:`~torchmem.model.trace.Trace` as they are in memory, so
reading one is a handful of ``array.frombytes`` calls: a million events load in well under a
second.

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
                                                                      # index 0 is "" ("none")
                     "stacks": [["file.py:12:fn", ...], ...],         # stack column indexes this;
                                                                      # -1 means "no stack"
                     "metadata": {...}}                               # free-form (torch version...)
    16+H    ...   one block per column, N * itemsize bytes each, in header order
    end-8   8     trailer magic b"TMTREND\\0" (detects truncation)

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
from array import array
from pathlib import Path
from typing import Any, Union

from torchmem.errors import MissingFileError, TraceFormatError
from torchmem.model.events import Category, Phase
from torchmem.model.trace import BYTES_PER_EVENT, COLUMNS, Trace

__all__ = ["save_trace", "load_trace", "is_tmtrace", "MAGIC", "FORMAT_VERSION", "PathLike"]

PathLike = Union[str, "os.PathLike[str]"]

#: The first 8 bytes of every ``.tmtrace`` file.
MAGIC = b"TMTRACE\0"
TRAILER = b"TMTREND\0"
#: The version this torchmem writes and reads.
FORMAT_VERSION = 1

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
    header = {
        "format": "torchmem-trace",
        "version": FORMAT_VERSION,
        "count": len(trace),
        "columns": [list(c) for c in COLUMNS],
        "devices": trace.devices,
        "strings": trace.strings,
        "stacks": [list(s) for s in trace.stacks],
        "metadata": trace.metadata,
    }
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    tmp = f"{os.fspath(path)}.part"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<II", FORMAT_VERSION, len(blob)))
        f.write(blob)
        for name, _, _ in COLUMNS:
            col: array[Any] = getattr(trace, name)
            if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
                col = array(col.typecode, col)
                col.byteswap()
            col.tofile(f)
        f.write(TRAILER)
    os.replace(tmp, path)


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
    if version != FORMAT_VERSION:
        raise bad(
            f"trace format version {version}, but this torchmem reads version "
            f"{FORMAT_VERSION}; upgrade torchmem (or re-record the trace with this version)"
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
    try:
        count = int(header["count"])
        columns = [tuple(c) for c in header["columns"]]
        devices = [str(d) for d in header["devices"]]
        strings = [str(s) for s in header["strings"]]
        stacks = [tuple(str(f) for f in s) for s in header["stacks"]]
        metadata = dict(header.get("metadata") or {})
    except (KeyError, TypeError, ValueError) as e:
        raise TraceFormatError(
            f"{name}: header is missing or has a bad field ({e})", path=name
        ) from None
    if columns != [tuple(c) for c in COLUMNS]:
        raise TraceFormatError(
            f"{name}: unexpected column layout {columns}; expected {list(COLUMNS)}", path=name
        )
    if not strings or strings[0] != "":
        raise TraceFormatError(
            f"{name}: corrupt string table: it should start with the empty string (index 0 of the "
            f'op and module columns means "none"), got {strings[:3]}; every name would be '
            "shifted by one, so the file was refused. Re-record the trace with 'torchmem run' or "
            "tracker.save(path)",
            path=name,
        )
    need = 16 + hlen + count * BYTES_PER_EVENT + len(TRAILER)
    if len(data) < need or data[need - len(TRAILER) : need] != TRAILER:
        raise TraceFormatError(
            f"{name}: truncated or corrupt: {count} events need {need} bytes with the "
            f"end marker, the file has {len(data)} bytes",
            path=name,
        )
    tr = Trace(metadata)
    pos = 16 + hlen
    mv = memoryview(data)
    for cname, _code, size in COLUMNS:
        col: array[Any] = getattr(tr, cname)
        col.frombytes(mv[pos : pos + count * size])
        if sys.byteorder != "little":  # pragma: no cover
            col.byteswap()
        pos += count * size
    tr.set_tables(devices, strings, stacks)
    if count and (
        max(tr.device) >= max(len(devices), 1)
        or max(tr.op) >= len(strings)
        or max(tr.module) >= len(strings)
        or max(tr.kind) > 2
        or max(tr.phase) >= _N_PHASES
        or max(tr.category) >= _N_CATS
        or max(tr.stack) >= len(stacks)
    ):
        raise TraceFormatError(
            f"{name}: corrupt: an event refers to a table entry that is missing", path=name
        )
    return tr
