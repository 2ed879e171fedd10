"""torchmem's exceptions: one root, a few precise subclasses.

Every error torchmem raises on purpose is a :class:`TorchmemError`. Messages say what was
expected, what was received, and how to fix it. The CLI turns these into exit codes in one place
(:func:`torchmem.cli.main`); library code never exits.

Tree::

    TorchmemError
    ├── InvalidInputError          (also a ValueError)  wrong argument value or type
    │   └── UnsupportedTensorError                       sparse/nested/... layouts we cannot handle
    ├── DeviceError                (also a ValueError)  unknown device string, or absent device
    ├── FileFormatError            (also a ValueError)  a file that is not what it should be
    │   ├── TraceFormatError                            torchmem trace files
    │   └── SnapshotFormatError                         PyTorch memory snapshots
    │       └── UnsafePickleError                       a pickle that tries to import or call
    ├── MoveError                  (also a RuntimeError) a move/copy failed; the module is unchanged
    ├── TransferError              (also a RuntimeError) a device transfer failed
    └── ObjectLoadError            (also a ValueError)  ``path.py:factory`` / ``pkg.mod:attr`` specs

Example:
    >>> from torchmem.errors import TorchmemError, DeviceError
    >>> issubclass(DeviceError, TorchmemError) and issubclass(DeviceError, ValueError)
    True
"""

from __future__ import annotations

__all__ = [
    "TorchmemError",
    "InvalidInputError",
    "UnsupportedTensorError",
    "DeviceError",
    "FileFormatError",
    "TraceFormatError",
    "SnapshotFormatError",
    "UnsafePickleError",
    "MoveError",
    "TransferError",
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

    Example:
        >>> str(FileFormatError("x.bin: not a torchmem trace"))
        'x.bin: not a torchmem trace'
    """


class TraceFormatError(FileFormatError):
    """A torchmem trace file could not be read.

    Example:
        >>> issubclass(TraceFormatError, FileFormatError)
        True
    """


class SnapshotFormatError(FileFormatError):
    """A PyTorch memory snapshot could not be read.

    Example:
        >>> issubclass(SnapshotFormatError, FileFormatError)
        True
    """


class UnsafePickleError(SnapshotFormatError):
    """A pickle tried to import or call something; it was refused and nothing ran.

    Example:
        >>> issubclass(UnsafePickleError, SnapshotFormatError)
        True
    """


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


class ObjectLoadError(TorchmemError, ValueError):
    """A ``path/to/file.py:factory`` or ``package.module:attr`` spec could not be loaded.

    Example:
        >>> issubclass(ObjectLoadError, ValueError)
        True
    """
