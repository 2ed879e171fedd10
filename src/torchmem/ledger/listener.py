"""The ledger as a listener of torchmem's tracker: counting what a tracked region allocates.

:meth:`Ledger.capture <torchmem.ledger.accounting.Ledger.capture>` runs
:func:`torchmem.capture.tracker.track` with the ledger as a listener, so every storage created in
the block -- operator outputs and moves included -- is counted without wrapping any torch
function; :meth:`~torchmem.ledger.accounting.Ledger.attach` listens to a tracker already running.
The methods here are mixed into :class:`~torchmem.ledger.accounting.Ledger`.

Example:
    >>> import torch
    >>> from torchmem.ledger import Ledger
    >>> led = Ledger()
    >>> with led.capture():
    ...     x = torch.ones(8); y = x + 1           # two 32-byte storages
    >>> led.allocated()
    (64, '64 B')
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import torch

from torchmem._log import get_logger
from torchmem.errors import InvalidInputError
from torchmem.ledger.sites import Site, user_site
from torchmem.ledger.storages import Pair
from torchmem.units import format_bytes

__all__: list[str] = []

log = get_logger("ledger")

_Self = TypeVar("_Self", bound="_TrackerListener")


class _TrackerListener:
    """The ledger's capture, attach and detach; counting itself is the ledger's."""

    _lock: threading.Lock
    _pending: collections.deque[Any]
    _track: bool
    _gc_enabled: bool
    _capture_tls: threading.local

    if TYPE_CHECKING:

        def _drain_locked(self) -> set[str]: ...

        def _count_locked(
            self, st: torch.UntypedStorage, site: Optional[Site], device: Optional[str] = None
        ) -> int: ...

        def _check_devices(self, storages: list[Pair], touched: Optional[set[str]]) -> None: ...

    def _on_event(self, event: Any, storage: Optional[torch.UntypedStorage]) -> None:
        if storage is None:
            return
        site = user_site() if self._track else None
        with self._lock:
            touched = self._drain_locked() if self._pending else None
            added = self._count_locked(storage, site, getattr(event, "device", None))
        if self._gc_enabled:
            self._check_devices([(storage, getattr(event, "device", None))], touched)
        if added and log.isEnabledFor(10):
            log.debug("[capture] +%s on %s (%s)", format_bytes(added), storage.device,
                      getattr(event, "op", None))

    @contextmanager
    def capture(self: _Self, **track_options: Any) -> Iterator[_Self]:
        """Count every storage created inside the block, operator outputs and moves included.

        Storages come from torchmem's event stream (:func:`~torchmem.capture.tracker.track`
        with this ledger as a listener); no torch function is wrapped. Like every dispatch mode,
        it sees the operators run by the thread that entered it. A move (``Tensor.to``,
        ``Module.to``, ``torchmem.memory_aware_to``, blocking or not) counts its new storage
        once, and its old storage is credited once when it actually dies. Re-entrant: nested
        ``capture()`` blocks share the outer one's tracker. ``track_options`` go to
        :func:`~torchmem.capture.tracker.track` (``modules=False`` unless given).

        Example:
            >>> import torch
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger(); a = torch.ones(64)
            >>> with led.capture():
            ...     b = a * 2                      # an operator output: 256 bytes
            >>> led.allocated()
            (256, '256 B')
        """
        tls = self._capture_tls
        if getattr(tls, "depth", 0) > 0:
            tls.depth += 1
            try:
                yield self
            finally:
                tls.depth -= 1
            return
        from torchmem.capture.tracker import track

        track_options.setdefault("modules", False)  # module attribution is not needed here
        cm = track(listeners=[self._on_event], **track_options)
        cm.__enter__()
        tls.depth = 1
        try:
            yield self
        finally:
            tls.depth = 0
            cm.__exit__(*sys.exc_info())

    def attach(self, tracker: Any) -> None:
        """Count the storages an already running tracker reports (``tracker.add_listener``).

        Use it when you track a run anyway and also want a ledger of it; :meth:`detach` stops.

        Example:
            >>> import torch, torchmem
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger()
            >>> with torchmem.track() as tr:
            ...     led.attach(tr)
            ...     x = torch.zeros(100)
            ...     led.detach(tr)
            ...     y = torch.zeros(100)         # after detach: not counted
            >>> led.allocated()
            (400, '400 B')
        """
        add = getattr(tracker, "add_listener", None)
        if not callable(add):
            raise InvalidInputError(
                f"attach expected a torchmem Tracker (from torchmem.track()), got "
                f"{type(tracker).__name__}"
            )
        add(self._on_event)

    def detach(self, tracker: Any) -> None:
        """Stop counting what ``tracker`` reports (idempotent).

        Example:
            >>> import torchmem
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger(); tr = torchmem.Tracker()
            >>> led.attach(tr); led.detach(tr); led.detach(tr)
        """
        tracker.remove_listener(self._on_event)
