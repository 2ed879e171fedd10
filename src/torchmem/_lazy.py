"""Lazy exports: a package names where each public name lives and imports it on first use.

``import torchmem`` and ``import torchmem.capture.storage`` stay cheap this way: the tracker,
the recorder and the rest load only when one of their names is used. Static imports under
``if TYPE_CHECKING:`` in the same package give type checkers the real types.

Example:
    >>> ns = {}
    >>> load_export(ns, {"format_bytes": "torchmem.units"}, "format_bytes")(1024)
    '1.00 KiB'
    >>> "format_bytes" in ns                      # cached: later lookups do not come here
    True
    >>> load_export(ns, {}, "nope") is MISSING
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["MISSING", "load_export"]

#: Returned by :func:`load_export` for a name the package does not export.
MISSING: Any = object()


def load_export(namespace: MutableMapping[str, Any], exports: Mapping[str, str], name: str) -> Any:
    """The value of ``name`` from the module ``exports[name]``, cached in ``namespace`` (the
    package's ``globals()``); :data:`MISSING` when ``name`` is not exported.

    Example:
        >>> load_export({}, {"MiB": "torchmem.units"}, "MiB")
        1048576
    """
    module = exports.get(name)
    if module is None:
        return MISSING
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
