"""Write snapshots: PyTorch's pickle format (protocol 4) or torchmem's JSON.

The pickle is exactly :meth:`Snapshot.to_pytorch_dict` pickled with protocol 4, so PyTorch's own
viewer and ``torch.cuda._memory_viz`` open it. The JSON is
``{"format": "torchmem-snapshot", "version": 1, "snapshot": <the same dict>}``.

Example:
    >>> import os, tempfile
    >>> from torchmem.model.snapshot import Snapshot
    >>> from torchmem.snapshots.reader import load_snapshot
    >>> d = tempfile.mkdtemp()
    >>> write_snapshot(os.path.join(d, "s.pickle"), Snapshot())
    >>> load_snapshot(os.path.join(d, "s.pickle")).segments
    []
    >>> write_snapshot(os.path.join(d, "s.json"), Snapshot(), format="json")
    >>> load_snapshot(os.path.join(d, "s.json")).source.format
    'torchmem-json'
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model._normalise import JSON_FORMAT_NAME
from torchmem.model.snapshot import Snapshot

__all__ = ["write_snapshot", "dump_snapshot", "PICKLE_PROTOCOL", "to_json_dict"]

#: PyTorch's viewer reads protocol 4 pickles (and its JS unpickler knows no protocol 5 opcodes).
PICKLE_PROTOCOL = 4


def to_json_dict(snapshot: Snapshot) -> dict[str, Any]:
    """The JSON document torchmem writes for a snapshot.

    Example:
        >>> to_json_dict(Snapshot())["format"]
        'torchmem-snapshot'
    """
    return {"format": JSON_FORMAT_NAME, "version": 1, "snapshot": snapshot.to_pytorch_dict()}


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
                pickle.dump(snapshot.to_pytorch_dict(), f, protocol=PICKLE_PROTOCOL)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(to_json_dict(snapshot), f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def dump_snapshot(
    path: str | os.PathLike[str], snapshot: Snapshot | None = None, format: str = "pickle"
) -> str:
    """Write ``snapshot`` (default: :func:`torchmem.snapshot` now) to ``path``; returns the path.

    ``format="pickle"`` writes PyTorch's format with protocol 4 (PyTorch's viewer and
    ``torch.cuda._memory_viz`` open it); ``format="json"`` writes torchmem's JSON. Taking the
    default snapshot imports torch (see :mod:`torchmem.snapshots.record`).

    Example:
        >>> import os, tempfile, torch, torchmem
        >>> p = os.path.join(tempfile.mkdtemp(), "mem.pickle")
        >>> with torchmem.record_history(device="cpu"):
        ...     w = torch.empty(10)
        ...     _ = dump_snapshot(p)
        >>> torchmem.load_snapshot(p).segments[0].total_size
        40
    """
    if snapshot is None:
        from torchmem.snapshots.record import snapshot as take

        snapshot = take()
    write_snapshot(path, snapshot, format=format)
    return os.fspath(path)
