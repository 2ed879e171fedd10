"""torchmem's exceptions: one root, a few precise subclasses.

Every error torchmem raises on purpose is a :class:`TorchmemError`. Messages say what was
expected, what was received, and how to fix it. The CLI turns these into exit codes in one place
(:func:`torchmem.cli.main`); library code never exits.

Tree::

    TorchmemError
    ├── InvalidInputError          (also a ValueError)  wrong argument value or type
    │   └── UnsupportedTensorError                       sparse/nested/... layouts we cannot handle
    ├── DeviceError                (also a ValueError)  unknown device string, or absent device
    ├── FileFormatError            (also a ValueError)  a file that is not what it should be;
    │   │                                               ``.path`` and ``.kind`` name it
    │   ├── TraceFormatError                            torchmem trace files (kind "trace")
    │   ├── SnapshotFormatError                         PyTorch memory snapshots ("snapshot")
    │   │   └── UnsafePickleError                       a pickle that tries to import or call
    │   └── MissingFileError       (also a FileNotFoundError, a TraceFormatError and a
    │                               SnapshotFormatError) no such file, for every kind of input
    ├── MoveError                  (also a RuntimeError) a move/copy failed; the module is unchanged
    ├── TransferError              (also a RuntimeError) a device transfer failed
    ├── SimulatedOutOfMemoryError  (also a RuntimeError) the allocator simulator ran out of memory
    └── ObjectLoadError            (also a ValueError)  ``path.py:factory`` / ``pkg.mod:attr`` specs

A missing input file raises :class:`MissingFileError` everywhere (snapshots, traces, the viewer,
the CLI). It is a :class:`FileNotFoundError`, so ``except OSError`` catches it, and both a
:class:`TraceFormatError` and a :class:`SnapshotFormatError`, so ``except SnapshotFormatError``
around :func:`~torchmem.io.load_snapshot` catches every way a load can fail.

Example:
    >>> from torchmem.errors import TorchmemError, DeviceError
    >>> issubclass(DeviceError, TorchmemError) and issubclass(DeviceError, ValueError)
    True
    >>> issubclass(MissingFileError, FileNotFoundError)
    True
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "TorchmemError",
    "InvalidInputError",
    "UnsupportedTensorError",
    "DeviceError",
    "FileFormatError",
    "TraceFormatError",
    "SnapshotFormatError",
    "UnsafePickleError",
    "MissingFileError",
    "MoveError",
    "TransferError",
    "SimulatedOutOfMemoryError",
    "ObjectLoadError",
]


class TorchmemError(Exception):
    """Root of every error torchmem raises on purpose.

    Example:
        >>> try:
        ...     raise TorchmemError("expected X, got Y; fix: pass X")
        ... except TorchmemError as e:
        ...     print(e)
        expected X, got Y; fix: pass X
    """


class InvalidInputError(TorchmemError, ValueError):
    """An argument had the wrong type or value.

    Example:
        >>> isinstance(InvalidInputError("bad"), ValueError)
        True
    """


class UnsupportedTensorError(InvalidInputError):
    """A tensor whose layout torchmem cannot handle (sparse, nested, ...).

    Example:
        >>> issubclass(UnsupportedTensorError, InvalidInputError)
        True
    """


class DeviceError(TorchmemError, ValueError):
    """An unknown device string, or a device that does not exist on this machine.

    Example:
        >>> issubclass(DeviceError, TorchmemError)
        True
    """


class FileFormatError(TorchmemError, ValueError):
    """A file is truncated, corrupt, from an unknown version, or not the expected kind.

    ``path`` is the file (``None`` for a stream) and ``kind`` what the file should have been
    (``"trace"``, ``"snapshot"``, or ``"file"`` when unsaid); the message names both.

    Example:
        >>> str(FileFormatError("x.bin: not a torchmem trace"))
        'x.bin: not a torchmem trace'
        >>> e = TraceFormatError("x.bin: not a torchmem trace", path="x.bin")
        >>> e.path, e.kind
        ('x.bin', 'trace')
    """

    kind: str = "file"

    def __init__(
        self, message: str, *, path: str | os.PathLike[str] | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.path: str | None = None if path is None else os.fspath(path)
        if kind is not None:
            self.kind = kind

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuild, (type(self), str(self), self.path, self.kind)


def _rebuild(
    cls: type[FileFormatError], message: str, path: str | None, kind: str
) -> FileFormatError:
    return cls(message, path=path, kind=kind)


class TraceFormatError(FileFormatError):
    """A torchmem trace file could not be read.

    Example:
        >>> issubclass(TraceFormatError, FileFormatError), TraceFormatError.kind
        (True, 'trace')
    """

    kind = "trace"


class SnapshotFormatError(FileFormatError):
    """A PyTorch memory snapshot could not be read.

    Example:
        >>> issubclass(SnapshotFormatError, FileFormatError), SnapshotFormatError.kind
        (True, 'snapshot')
    """

    kind = "snapshot"


class UnsafePickleError(SnapshotFormatError):
    """A pickle tried to import or call something; it was refused and nothing ran.

    Example:
        >>> issubclass(UnsafePickleError, SnapshotFormatError)
        True
    """


class MissingFileError(TraceFormatError, SnapshotFormatError, FileNotFoundError):
    """An input file does not exist: the one error every torchmem reader raises for it.

    ``kind`` says what the file should have been (``"trace"``, ``"snapshot"``, ``"script"``...);
    ``filename`` and ``errno`` are set as on any :class:`FileNotFoundError`.

    Example:
        >>> e = MissingFileError("a.pickle: no such file", path="a.pickle", kind="snapshot")
        >>> isinstance(e, FileNotFoundError), e.filename, e.kind, str(e)
        (True, 'a.pickle', 'snapshot', 'a.pickle: no such file')
    """

    kind = "file"

    def __init__(
        self, message: str, *, path: str | os.PathLike[str] | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message, path=path, kind=kind)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)
        self.filename = self.path


class MoveError(TorchmemError, RuntimeError):
    """A memory-aware move or copy failed; the module was left as it was.

    Example:
        >>> issubclass(MoveError, RuntimeError)
        True
    """


class TransferError(TorchmemError, RuntimeError):
    """A device transfer failed or was given a tensor on the wrong device.

    Example:
        >>> issubclass(TransferError, TorchmemError)
        True
    """


class SimulatedOutOfMemoryError(TorchmemError, RuntimeError):
    """:class:`torchmem.sim.CachingAllocator` could not place a request within its capacity.

    Example:
        >>> issubclass(SimulatedOutOfMemoryError, RuntimeError)
        True
    """


class ObjectLoadError(TorchmemError, ValueError):
    """A ``path/to/file.py:factory`` or ``package.module:attr`` spec could not be loaded.

    Example:
        >>> issubclass(ObjectLoadError, ValueError)
        True
    """
