"""File formats and conversions, without torch: snapshots, traces, and trace -> snapshot.

- :mod:`~torchmem.io.snapshot_file`: :func:`load_snapshot` (every PyTorch snapshot format, any
  pickle protocol, read by a safe unpickler; torchmem's JSON; ``.tmtrace`` files) and
  :func:`write_snapshot` (PyTorch's pickle or torchmem's JSON).
- :mod:`~torchmem.io.pytorch_snapshot`: PyTorch's snapshot dicts, both directions:
  :func:`from_pytorch` and :func:`to_pytorch_dict`.
- :mod:`~torchmem.io.tmtrace`: the ``.tmtrace`` file of a tracked run: :func:`save_trace` and
  :func:`load_trace`.
- :mod:`~torchmem.io.convert`: :func:`snapshot_from_trace` and :func:`snapshot_from_events`,
  which keep each allocation's category, phase and module.

A missing input file raises :class:`~torchmem.errors.MissingFileError`; a bad one a
:class:`~torchmem.errors.FileFormatError` naming the path and the kind of file.

Example:
    >>> import io, pickle
    >>> from torchmem.io import load_snapshot
    >>> raw = pickle.dumps({"segments": [], "device_traces": [[]]}, protocol=4)
    >>> load_snapshot(io.BytesIO(raw)).segments
    []
"""

from __future__ import annotations

from torchmem.io.convert import snapshot_from_events, snapshot_from_trace
from torchmem.io.pytorch_snapshot import from_pytorch, to_pytorch_dict
from torchmem.io.snapshot_file import load_snapshot, write_snapshot
from torchmem.io.tmtrace import load_trace, save_trace

__all__ = [
    "from_pytorch",
    "load_snapshot",
    "load_trace",
    "save_trace",
    "snapshot_from_events",
    "snapshot_from_trace",
    "to_pytorch_dict",
    "write_snapshot",
]
