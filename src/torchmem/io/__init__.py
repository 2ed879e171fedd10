"""File formats, both directions, without torch: memory snapshots and torchmem traces.

- :mod:`~torchmem.io.snapshot_file`: :func:`load_snapshot` (every PyTorch snapshot format, any
  pickle protocol, read by a safe unpickler; torchmem's JSON; ``.tmtrace`` files) and
  :func:`write_snapshot` (PyTorch's pickle or torchmem's JSON).
- :mod:`~torchmem.io.pytorch_snapshot`: PyTorch's snapshot dicts to and from
  :class:`~torchmem.model.snapshot.Snapshot`.

Example:
    >>> import io, pickle
    >>> from torchmem.io import load_snapshot
    >>> raw = pickle.dumps({"segments": [], "device_traces": [[]]}, protocol=4)
    >>> load_snapshot(io.BytesIO(raw)).segments
    []
"""

from __future__ import annotations

from torchmem.io.snapshot_file import load_snapshot, write_snapshot

__all__ = ["load_snapshot", "write_snapshot"]
