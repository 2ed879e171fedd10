"""Memory snapshots: read every format safely, write PyTorch's format or JSON, record them.

- :mod:`torchmem.snapshots.reader`: :func:`~torchmem.snapshots.reader.load_snapshot` (no torch).
- :mod:`torchmem.snapshots.writer`: :func:`~torchmem.snapshots.writer.write_snapshot` (no torch).
- :mod:`torchmem.snapshots.record`: ``record_history``, ``snapshot``, ``dump_snapshot``,
  ``oom_guard`` (imports torch when used).

The model itself is :class:`torchmem.model.snapshot.Snapshot`. The package is named
``snapshots`` so that ``torchmem.snapshot`` stays the function that takes a snapshot.

Example:
    >>> import torchmem
    >>> from torchmem.snapshots.reader import load_snapshot
    >>> load_snapshot is torchmem.load_snapshot, callable(torchmem.snapshot)
    (True, True)
"""
