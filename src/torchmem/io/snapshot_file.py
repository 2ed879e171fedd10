"""Read memory snapshots of every known format, safely; write PyTorch's format or torchmem's JSON.

:func:`load_snapshot` accepts PyTorch's pickles (the modern dict with ``device_traces``, the bare
list of segments from ``torch.cuda.memory_snapshot()``, 2.0-era blocks with ``history``; any
pickle protocol 0 to 5; with or without ``time_us``, ``allocator_settings``,
``external_annotations``, ``compile_context``, ``user_metadata``) and torchmem's JSON, and
normalises them into one :class:`~torchmem.model.snapshot.Snapshot`.

Safe by construction: pickles are read by :class:`SafeUnpickler`, the C-accelerated
``pickle.Unpickler`` with ``find_class`` and ``persistent_load`` refusing everything, so only
plain containers and scalars can be built. A pickle that tries to import or call anything raises
:class:`~torchmem.errors.UnsafePickleError` naming the file and the global, and nothing runs. A
file that is no pickle at all (a PNG renamed ``.pickle``, a directory) raises
:class:`~torchmem.errors.SnapshotFormatError` saying what it is before any unpickling.

Example:
    >>> import io, pickle
    >>> raw = pickle.dumps({"segments": [], "device_traces": [[]]}, protocol=4)
    >>> load_snapshot(io.BytesIO(raw)).source.format
    'dict'
    >>> evil = b"cos\\nsystem\\n(S'echo hi'\\ntR."
    >>> load_snapshot(io.BytesIO(b"\\x89PNG\\r\\n\\x1a\\n..."))
    Traceback (most recent call last):
    ...
    torchmem.errors.SnapshotFormatError: <stream>: not a pickle (a PNG image (a timeline plot?)); expected a memory snapshot: a pickle from torch.cuda.memory._dump_snapshot, torchmem's JSON or a .tmtrace file
    >>> load_snapshot(io.BytesIO(evil))
    Traceback (most recent call last):
    ...
    torchmem.errors.UnsafePickleError: <stream>: refused to load: the pickle tries to import os.system (a snapshot holds only dicts, lists and scalars, so this file is not a plain memory snapshot and may run code); nothing was executed. If you trust the file, load it with pickle yourself.
"""

from __future__ import annotations

import gc
import io
import json
import os
import pickle
import pickletools
from pathlib import Path
from typing import IO, Any

from torchmem.errors import (
    InvalidInputError,
    MissingFileError,
    SnapshotFormatError,
    UnsafePickleError,
)
from torchmem.io.convert import snapshot_from_trace
from torchmem.io.pytorch_snapshot import JSON_FORMAT_NAME, normalise, to_pytorch_dict
from torchmem.io.tmtrace import PathLike, is_tmtrace, load_trace
from torchmem.model.snapshot import Snapshot

__all__ = [
    "load_snapshot",
    "load_raw",
    "write_snapshot",
    "to_json_dict",
    "SafeUnpickler",
    "PathLike",
    "PICKLE_PROTOCOL",
]

class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` (the C implementation) that refuses every global and persistent id.

    Example:
        >>> import io, pickle
        >>> SafeUnpickler(io.BytesIO(pickle.dumps([1, {"a": (2.5, None)}]))).load()
        [1, {'a': (2.5, None)}]
        >>> SafeUnpickler(io.BytesIO(pickle.dumps(print))).load()
        Traceback (most recent call last):
        ...
        torchmem.errors.UnsafePickleError: <stream>: refused to load: the pickle tries to import builtins.print (a snapshot holds only dicts, lists and scalars, so this file is not a plain memory snapshot and may run code); nothing was executed. If you trust the file, load it with pickle yourself.
    """

    def __init__(self, file: IO[bytes], name: str = "<stream>") -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - refuse everything
        raise UnsafePickleError(
            f"{self._name}: refused to load: the pickle tries to import {module}.{name} "
            "(a snapshot holds only dicts, lists and scalars, so this file is not a plain memory "
            "snapshot and may run code); nothing was executed. If you trust the file, load it "
            "with pickle yourself."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            f"{self._name}: refused to load: the pickle asks for an external (persistent) object "
            f"{str(pid)[:60]!r}; a memory snapshot never does; nothing was executed."
        )


def _pickle_protocol(head: bytes) -> int | None:
    if len(head) >= 2 and head[0] == 0x80:
        return head[1]
    return None


#: Signatures of files that get renamed or mixed up with snapshots, and what they are.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image (a timeline plot?)"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF", "a PDF document"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"TMTRACE\x00", "a torchmem trace (.tmtrace): name it .tmtrace"),
    (b"\x93NUMPY", "a NumPy array (.npy)"),
    (b"SQLite format 3", "an SQLite database"),
)
#: Bytes a pickle can start with: its opcodes (protocols 2-5 start with PROTO, ``\\x80``).
_PICKLE_STARTS = frozenset(ord(op.code) for op in pickletools.opcodes)


def _not_a_pickle(head: bytes) -> str | None:
    """Why ``head`` cannot start a pickled snapshot, or ``None`` when it can."""
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if not head or head[0] not in _PICKLE_STARTS:
        return None if not head else f"it starts with bytes {head[:12]!r}"
    if head[0] == 0x80 and (len(head) < 2 or not 2 <= head[1] <= 5):
        return f"it starts with bytes {head[:12]!r} (no pickle protocol 2-5 header)"
    return None


def _describe_bad(data_head: bytes) -> str:
    if not data_head:
        return "the file is empty"
    if data_head[:2] == b"\x1f\x8b":
        return "it is gzip-compressed (decompress it first, e.g. gunzip)"
    if data_head[:4] == b"PK\x03\x04":
        return "it is a zip archive (a torch.save checkpoint?), not a memory snapshot"
    if data_head[:15] == b"<!DOCTYPE html>" or data_head[:5].lower() == b"<html":
        return "it is an HTML page (a viewer output?), not a snapshot"
    for magic, what in _MAGIC:
        if data_head.startswith(magic):
            return f"it is {what}"
    return f"it starts with bytes {data_head[:12]!r}"


def load_raw(source: PathLike | IO[bytes]) -> tuple[Any, str, int | None]:
    """Safely read the raw object of a snapshot file: ``(object, name, pickle_protocol)``.

    Pickles go through :class:`SafeUnpickler`; JSON files (first non-blank byte ``{`` or ``[``)
    through ``json``. Raises :class:`SnapshotFormatError` for truncated or corrupt files.

    Example:
        >>> import io, pickle
        >>> load_raw(io.BytesIO(pickle.dumps([], protocol=2)))
        ([], '<stream>', 2)
    """
    try:
        return _load_raw(source)
    except SnapshotFormatError as e:
        if e.path is None and isinstance(source, (str, os.PathLike)):
            e.path = os.fspath(source)
        raise


def _load_raw(source: PathLike | IO[bytes]) -> tuple[Any, str, int | None]:
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        try:
            f: IO[bytes] = open(name, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise MissingFileError(
                f"{name}: no such file; expected the path of a memory snapshot "
                "(from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)",
                path=name,
                kind="snapshot",
            ) from None
        except IsADirectoryError:
            raise SnapshotFormatError(
                f"{name}: is a directory; expected a memory snapshot file (from "
                "torch.cuda.memory._dump_snapshot or torchmem.write_snapshot) or a .tmtrace "
                "file: name one of the files inside it",
                path=name,
            ) from None
        except OSError as e:
            raise SnapshotFormatError(f"{name}: cannot open: {e.strerror}", path=name) from None
        close = True
    else:
        f = source
        name = getattr(source, "name", None) or "<stream>"
        if not isinstance(name, str):
            name = "<stream>"
        close = False
    try:
        head = f.peek(16)[:16] if hasattr(f, "peek") else b""
        if not head and hasattr(f, "seek") and hasattr(f, "tell"):
            pos = f.tell()
            head = f.read(16)
            f.seek(pos)
        stripped = head.lstrip()
        if stripped[:1] in (b"{", b"["):
            try:
                text = f.read()
                return json.loads(text), name, None
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SnapshotFormatError(
                    f"{name}: looks like JSON but could not be parsed ({e}); the file may be "
                    "truncated or corrupt"
                ) from None
        protocol = _pickle_protocol(head)
        why = _not_a_pickle(head)
        if why is not None:
            raise SnapshotFormatError(
                f"{name}: not a pickle ({why}); expected a memory snapshot: a pickle from "
                "torch.cuda.memory._dump_snapshot, torchmem's JSON or a .tmtrace file"
            )
        try:
            obj = SafeUnpickler(f, name).load()
        except UnsafePickleError:
            raise
        except pickle.UnpicklingError as e:
            if "truncated" not in str(e):
                raise SnapshotFormatError(
                    f"{name}: not a readable pickle (UnpicklingError: {e}); {_describe_bad(head)}. "
                    "Expected a memory snapshot from torch.cuda.memory._dump_snapshot or torchmem"
                ) from None
            raise SnapshotFormatError(
                f"{name}: the pickle ends early ({_describe_bad(head)}); the file is truncated -- "
                "copy it again"
            ) from None
        except EOFError:
            raise SnapshotFormatError(
                f"{name}: the pickle ends early ({_describe_bad(head)}); the file is truncated or "
                "empty -- copy it again"
            ) from None
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError,
                OverflowError, RecursionError) as e:
            raise SnapshotFormatError(
                f"{name}: not a readable pickle ({type(e).__name__}: {e}); {_describe_bad(head)}. "
                "Expected a memory snapshot from torch.cuda.memory._dump_snapshot or torchmem"
            ) from None
        return obj, name, protocol
    finally:
        if close:
            f.close()


def load_snapshot(source: PathLike | IO[bytes]) -> Snapshot:
    """Load a memory snapshot file (any PyTorch version, any pickle protocol, or our JSON).

    A torchmem tracker trace file (``.tmtrace``) is accepted too and converted with
    :func:`~torchmem.io.convert.snapshot_from_trace`.

    Returns a normalised :class:`~torchmem.model.snapshot.Snapshot`. Errors
    (:class:`~torchmem.errors.SnapshotFormatError`, :class:`~torchmem.errors.UnsafePickleError`)
    name the file and what was wrong; a missing file raises
    :class:`~torchmem.errors.MissingFileError`.

    Example:
        >>> snap = load_snapshot("tests/data/DeComFL__memory.pickle")  # doctest: +SKIP
        >>> snap.devices, len(snap.segments)  # doctest: +SKIP
        ([0], 61)
        >>> import io
        >>> load_snapshot(io.BytesIO(b"\\x80\\x04\\x95"))
        Traceback (most recent call last):
        ...
        torchmem.errors.SnapshotFormatError: <stream>: the pickle ends early (it starts with bytes b'\\x80\\x04\\x95'); the file is truncated -- copy it again
    """
    if isinstance(source, (str, os.PathLike)) and is_tmtrace(source):
        snap = snapshot_from_trace(load_trace(source))
        snap.source.path = os.fspath(source)
        return snap
    # Building millions of small containers triggers the cyclic GC over and over for nothing
    # (a snapshot has no cycles); pause it during the load and restore its previous state.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        obj, name, protocol = load_raw(source)
        path = name if name != "<stream>" else None
        snap = normalise(obj, name, protocol)
        del obj
    finally:
        if was_enabled:
            gc.enable()
    snap.source.path = path
    return snap


def _scan_opcodes(path: PathLike) -> set[str]:
    """Opcode names in a pickle file (a diagnostic helper for tests and bug reports).

    Example:
        >>> import tempfile, pickle, os
        >>> p = os.path.join(tempfile.mkdtemp(), "x.pickle")
        >>> Path(p).write_bytes(pickle.dumps({"a": 1}, protocol=2)) > 0
        True
        >>> "GLOBAL" in _scan_opcodes(p)
        False
    """
    data = Path(path).read_bytes()
    return {op.name for op, _, _ in pickletools.genops(io.BytesIO(data))}


#: PyTorch's viewer reads protocol 4 pickles (and its JS unpickler knows no protocol 5 opcodes).
PICKLE_PROTOCOL = 4


def to_json_dict(snapshot: Snapshot) -> dict[str, Any]:
    """The JSON document torchmem writes for a snapshot.

    Example:
        >>> to_json_dict(Snapshot())["format"]
        'torchmem-snapshot'
    """
    return {"format": JSON_FORMAT_NAME, "version": 1, "snapshot": to_pytorch_dict(snapshot)}


def write_snapshot(path: str | os.PathLike[str], snapshot: Snapshot, format: str = "pickle") -> None:
    """Write ``snapshot`` to ``path`` as ``"pickle"`` (PyTorch's format) or ``"json"``.

    The file is written to a temporary name first and renamed, so a crash never leaves a
    truncated snapshot behind.

    Example:
        >>> write_snapshot("x.bin", Snapshot(), format="yaml")
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: unknown snapshot format 'yaml'; expected 'pickle' (PyTorch's format, opens in PyTorch's viewer) or 'json'
    """
    if format not in ("pickle", "json"):
        raise InvalidInputError(
            f"unknown snapshot format {format!r}; expected 'pickle' (PyTorch's format, opens in "
            "PyTorch's viewer) or 'json'"
        )
    if not isinstance(snapshot, Snapshot):
        raise InvalidInputError(
            f"expected a torchmem Snapshot, got {type(snapshot).__name__}; "
            "load one with torchmem.load_snapshot or take one with torchmem.snapshot()"
        )
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        if format == "pickle":
            with open(tmp, "wb") as f:
                pickle.dump(to_pytorch_dict(snapshot), f, protocol=PICKLE_PROTOCOL)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(to_json_dict(snapshot), f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
