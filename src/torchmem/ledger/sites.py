"""Call-site hotspots: the ``file:line`` that allocates and frees most, per device.

When tracking is on (:meth:`Ledger.set_callsite_tracking
<torchmem.ledger.accounting.Ledger.set_callsite_tracking>`), each allocate, free and automatic
free records the innermost frame outside torch and torchmem (:func:`user_site`, a cheap frame
walk whose verdict per file is cached), and adds its bytes to a per-device table. The query
methods here are mixed into :class:`~torchmem.ledger.accounting.Ledger`.

Example:
    >>> import torch
    >>> from torchmem.ledger import Ledger
    >>> led = Ledger(track_callsite=True)
    >>> _ = led.allocate(torch.zeros(256))
    >>> [(dev, n) for dev, site, n in led.sites("alloc")]
    [('cpu', 1024)]
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Optional

import torch

from torchmem._device import device_selector
from torchmem.errors import InvalidInputError
from torchmem.ledger.records import DeviceLike

__all__ = ["user_site"]

Site = tuple[str, int]  # (file, line); formatted as "file:line" only when asked for

_TORCHMEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__ or "")) + os.sep, _TORCHMEM_DIR + os.sep
)
_internal_cache: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        absolute = os.path.abspath(filename) if not filename.startswith("<") else filename
        hit = absolute.startswith(_INTERNAL_DIRS) or filename.startswith("<frozen")
        _internal_cache[filename] = hit
    return hit


def user_site(depth: int = 2) -> Optional[Site]:
    """``(file, line)`` of the innermost frame outside torch and torchmem, or ``None``.

    ``depth`` is where the walk starts: 2 skips this function and its caller.

    Example:
        >>> def count_here():
        ...     return user_site()
        >>> count_here()[1] > 0
        True
    """
    try:
        f: Any = sys._getframe(depth)
    except ValueError:
        return None
    cache = _internal_cache
    while f is not None:
        filename = f.f_code.co_filename
        hit = cache.get(filename)
        if hit is None:
            hit = _is_internal(filename)
        if not hit:
            return (filename, f.f_lineno)
        f = f.f_back
    return None


def _matches(name: str, want: Optional[str]) -> bool:
    """Whether device ``name`` is selected by ``want`` (``None``: all; a type: all its indexes)."""
    return want is None or name == want or name.partition(":")[0] == want


class _CallSites:
    """The ledger's call-site methods; the tables are filled by the ledger's counting."""

    _lock: threading.Lock
    _pending: collections.deque[Any]
    _track: bool
    _alloc_sites: dict[str, dict[Site, int]]
    _free_sites: dict[str, dict[Site, int]]

    if TYPE_CHECKING:

        def _drain_locked(self) -> set[str]: ...

    def _init_sites(self, track: bool) -> None:
        self._track = bool(track)
        self._alloc_sites = {}
        self._free_sites = {}

    def _clear_sites_locked(self) -> None:
        self._alloc_sites.clear()
        self._free_sites.clear()

    def set_callsite_tracking(self, enabled: bool) -> None:
        """Turn ``file:line`` hotspot tracking on or off (off by default).

        Example:
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger(); led.set_callsite_tracking(True); led.callsite_tracking
            True
        """
        self._track = bool(enabled)

    @property
    def callsite_tracking(self) -> bool:
        """Whether call sites are being recorded.

        Example:
            >>> from torchmem.ledger import Ledger
            >>> Ledger().callsite_tracking
            False
        """
        return self._track

    def _top(
        self, tables: dict[str, dict[Site, int]], device: DeviceLike
    ) -> Optional[tuple[str, str, int]]:
        want = None if device is None else device_selector(device)
        with self._lock:
            if self._pending:
                self._drain_locked()
            names = [n for n in tables if _matches(n, want)]
            best: Optional[tuple[str, Site, int]] = None
            for name in sorted(names):
                for site, n in tables[name].items():
                    if best is None or n > best[2]:
                        best = (name, site, n)
        if best is None:
            return None
        return best[0], f"{best[1][0]}:{best[1][1]}", best[2]

    def top_alloc_site(self, device: DeviceLike = None) -> Optional[tuple[str, str, int]]:
        """``(device, "file:line", bytes)`` of the line that allocated most, or ``None``.

        Frames inside torch and torchmem are skipped, so the line is the user's. ``device``
        selects as in :meth:`allocated`. Needs :meth:`set_callsite_tracking` on.

        Example:
            >>> import torch
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger(track_callsite=True)
            >>> _ = led.allocate(torch.zeros(1000))
            >>> dev, site, n = led.top_alloc_site(); dev, "top_alloc_site" in site, n
            ('cpu', True, 4000)
        """
        return self._top(self._alloc_sites, device)

    def top_free_site(self, device: DeviceLike = None) -> Optional[tuple[str, str, int]]:
        """``(device, "file:line", bytes)`` of the line that freed most, or ``None``.

        For automatic frees the line is where the last reference was dropped.

        Example:
            >>> import torch
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger(track_callsite=True); x = torch.zeros(10); _ = led.allocate(x)
            >>> del x
            >>> dev, site, n = led.top_free_site("cpu"); dev, "top_free_site" in site, n
            ('cpu', True, 40)
        """
        return self._top(self._free_sites, device)

    def sites(self, kind: str = "alloc", device: DeviceLike = None) -> list[tuple[str, str, int]]:
        """Every recorded ``(device, "file:line", bytes)``, largest first (``kind``: alloc/free).

        Example:
            >>> from torchmem.ledger import Ledger
            >>> Ledger().sites("free")
            []
        """
        if kind not in ("alloc", "free"):
            raise InvalidInputError(f"kind must be 'alloc' or 'free', got {kind!r}")
        tables = self._alloc_sites if kind == "alloc" else self._free_sites
        want = None if device is None else device_selector(device)
        with self._lock:
            if self._pending:
                self._drain_locked()
            rows = [
                (name, f"{site[0]}:{site[1]}", n)
                for name, table in tables.items()
                if _matches(name, want)
                for site, n in table.items()
            ]
        return sorted(rows, key=lambda r: (-r[2], r[0], r[1]))

