"""Environment variables set for a block and restored after it (shared by the CLI and fit).

Example:
    >>> import os
    >>> with environ_set({"TORCHMEM_DOC_EXAMPLE": "1"}):
    ...     os.environ["TORCHMEM_DOC_EXAMPLE"]
    '1'
    >>> "TORCHMEM_DOC_EXAMPLE" in os.environ
    False
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["environ_set"]


@contextlib.contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block; afterwards each variable has its old
    value again, or is unset if it was unset."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
