"""Memory snapshots: read every format safely, write PyTorch's format or JSON, record them.

- :mod:`torchmem.snapshot.reader`: :func:`~torchmem.snapshot.reader.load_snapshot` (no torch).
- :mod:`torchmem.snapshot.writer`: :func:`~torchmem.snapshot.writer.write_snapshot` (no torch).
- :mod:`torchmem.snapshot.record`: ``record_history``, ``snapshot``, ``dump_snapshot``,
  ``oom_guard`` (imports torch when used).

The model itself is :class:`torchmem.model.snapshot.Snapshot`.

``torchmem.snapshot`` is both this package and the function
:func:`torchmem.snapshot.record.snapshot`: Python binds a package to its parent's attribute once
it is imported, so the package itself is made callable and calling it takes a snapshot.

Example:
    >>> import torchmem, torchmem.snapshot.reader
    >>> callable(torchmem.snapshot)
    True
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torchmem.snapshot.record import snapshot

        return snapshot(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
