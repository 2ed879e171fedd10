"""A memory ledger: bytes allocated and freed per device, exact under views, moves and deaths.

:class:`Ledger` counts *storages*, not tensors: a storage is counted once while it lives however
many views of it you :meth:`~Ledger.allocate`, and when it dies its bytes move from *allocated*
to *freed* on their own (explicit :meth:`~Ledger.free` and the automatic free never both
count). Each counted storage has one weak reference with a callback -- a ``weakref.ref``
subclass carrying the bytes, the device and a monotonic token; it behaves like
``weakref.finalize`` at a fraction of its cost. Lookups go by the live storage's address and are
confirmed by identity through that reference, so a reused address is never mistaken for a
counted storage. :meth:`~Ledger.capture` counts
every storage created in a region -- operator outputs and moves included -- from torchmem's event
stream, without wrapping any torch function.

The ledger's other duties live in their own modules and are mixed into :class:`Ledger`: the
call sites that allocate and free most (:mod:`torchmem.ledger.sites`,
:meth:`~Ledger.set_callsite_tracking`) and the banded auto-GC policy in MemLord's format
(:mod:`torchmem.ledger.autogc`, :meth:`~Ledger.set_auto_gc_strategy`), driven by a usage
source (:mod:`torchmem.devices`). Its figures are :mod:`torchmem.ledger.records`; what it counts
behind an object is :mod:`torchmem.ledger.storages`.

Differences from MemLord (ModelCloud), whose API this follows:

* exact dedup across calls (MemLord dedups only inside one call, so a tensor and then its view
  count twice); a move is never credited directly, the old storage is credited once when it
  actually dies (MemLord's move hook credits the free and its finalizer credits it again);
  operator outputs are counted inside :meth:`~Ledger.capture` (MemLord only sees what its
  wrappers see);
* auto-GC thresholds and defaults differ as :mod:`torchmem.ledger.autogc` says;
* :meth:`~Ledger.reset` also forgets which storages are counted, so later deaths of storages
  counted before the reset do not credit anything.

Example:
    >>> import torch
    >>> from torchmem import Ledger
    >>> led = Ledger()
    >>> x = torch.zeros(1024)                      # 4 KiB
    >>> led.allocate(x); led.allocate(x[10:])      # a view of a counted storage adds nothing
    4096
    0
    >>> led.allocated()
    (4096, '4.00 KiB')
    >>> del x                                      # the storage dies: credited automatically
    >>> led.allocated(), led.freed("cpu")
    ((0, '0 B'), (4096, '4.00 KiB'))
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch

from torchmem._device import device_name, device_selector
from torchmem._log import get_logger
from torchmem.devices import UsageSource
from torchmem.ledger.autogc import _AutoGc
from torchmem.ledger.listener import _TrackerListener
from torchmem.ledger.records import DeviceLike, LedgerRecord, _Agg, _Stats
from torchmem.ledger.sites import Site, _CallSites, user_site
from torchmem.ledger.storages import describe, storages_of
from torchmem.units import format_bytes

__all__ = ["Ledger"]

log = get_logger("ledger")


class _Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one counted storage, carrying what it was counted as."""

    __slots__ = ("key", "nbytes", "device", "token", "free_site")

    key: int
    nbytes: int
    device: str
    token: int
    free_site: Optional[Site]


class Ledger(_CallSites, _AutoGc, _TrackerListener):
    """Exact allocated/freed bytes per device, with automatic frees, capture, hotspots and auto-GC.

    Args:
        auto_gc_strategy: banded policy in MemLord's format (see :meth:`set_auto_gc_strategy`);
            ``None`` or ``{}`` turns auto-GC off (the default).
        track_callsite: record ``file:line`` of allocations and frees (off by default; costs a
            frame walk per call, see BENCHMARKS.md).
        usage_source: where auto-GC reads device usage -- any object with
            ``usage(device) -> DeviceUsage | None``. Default: a
            :class:`~torchmem.devices.UsagePoller` created on first need and closed by
            :meth:`close`.
        poll_interval: seconds between readings of that default poller.
        gc_min_interval: minimum seconds between two auto-GC runs on one device.

    Thread-safe: one lock guards the counters; automatic frees arriving from any thread are
    queued without blocking and applied before the next read or write.

    Example:
        >>> import torch
        >>> led = Ledger()
        >>> m = torch.nn.Linear(4, 4)                  # 64 + 16 bytes of parameters
        >>> led.allocate(m), led.allocate([m.weight, {"b": m.bias}])
        (80, 0)
        >>> led.allocated(torch.device("cpu"))[0], led.record().live_storages
        (80, 2)
    """

    def __init__(
        self,
        auto_gc_strategy: Optional[Mapping[tuple[float, float], Mapping[str, Any]]] = None,
        *,
        track_callsite: bool = False,
        usage_source: Optional[UsageSource] = None,
        poll_interval: float = 0.2,
        gc_min_interval: float = 1.0,
    ) -> None:
        self._init_auto_gc(usage_source, poll_interval, gc_min_interval)
        self._init_sites(track_callsite)
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._pending: collections.deque[_Entry] = collections.deque()
        self._stats: dict[str, _Stats] = {}  # per device ("cpu", "cuda:0", "meta")
        self._aggs: dict[str, _Agg] = {}  # per device type with indexed devices ("cuda")
        self._chains: dict[str, tuple[_Stats, tuple[_Agg, ...]]] = {}
        self._names: dict[torch.device, str] = {}
        self._total = _Agg()
        self._tokens = itertools.count(1)
        self._capture_tls = threading.local()  # dispatch modes are per thread, so is nesting
        self.untracked_frees = 0

        selfref = weakref.ref(self)
        pending = self._pending
        lock = self._lock

        def _died(entry: _Entry) -> None:
            # Runs in whatever thread dropped the last reference. Never block here: queue the
            # entry and apply it now only if the lock is free (it is not if this thread holds it).
            led = selfref()
            if led is None:
                return
            try:
                if led._track:
                    entry.free_site = user_site()
            except Exception:  # e.g. during interpreter shutdown
                pass
            pending.append(entry)
            if lock.acquire(False):
                try:
                    led._drain_locked()
                finally:
                    lock.release()

        self._died = _died
        self.set_auto_gc_strategy(auto_gc_strategy)

    # ----------------------------------------------------------------------------- counting

    def _chain(self, name: str) -> tuple[_Stats, tuple[_Agg, ...]]:
        """The device's stats and the aggregates (its type, all devices) it feeds."""
        chain = self._chains.get(name)
        if chain is None:
            dev = self._stats[name] = _Stats()
            dtype = name.partition(":")[0]
            if dtype != name:
                agg = self._aggs.get(dtype)
                if agg is None:
                    agg = self._aggs[dtype] = _Agg()
                chain = (dev, (agg, self._total))
            else:
                chain = (dev, (self._total,))
            self._chains[name] = chain
        return chain

    def _drain_locked(self) -> set[str]:
        """Apply queued automatic frees; return the devices they touched."""
        touched: set[str] = set()
        pending = self._pending
        entries = self._entries
        while pending:
            try:
                e = pending.popleft()
            except IndexError:  # another thread drained it
                break
            if e.token == 0:  # queued uncounted by a fast producer
                self._count_fresh_locked(e)
                continue
            if entries.get(e.key) is e:
                del entries[e.key]
                self._credit_free_locked(e, True, getattr(e, "free_site", None))
                touched.add(e.device)
        return touched

    def _count_fresh_locked(self, e: _Entry) -> None:
        """Count a storage a producer queued uncounted (an entry with token 0, see below).

        A producer on a hot path (torchmem.compat.MemLord's factory hooks) may append
        ``_Entry(storage, self._died)`` with ``key``, ``nbytes``, ``device`` set and ``token = 0``
        to the queue instead of counting at once. Alive when drained, the storage is counted as
        :meth:`allocate` would; dead already, it counts as allocated and freed. Either way the
        entry's own death, queued later, is skipped (its token is no longer 0 and it is never in
        the table).
        """
        e.token = -1
        st = e()
        if st is not None:
            self._count_locked(st, None, e.device)
            return
        self._count_dead_locked(e)

    def _count_dead_locked(self, e: _Entry) -> None:
        """Count a queued storage that died before it was counted: allocated, then auto-freed.

        The same counters as a count followed by an automatic free (the common case on a hooked
        factory's temporaries, so done in one step): one allocation and one free, the peak raised
        by its bytes, the live and allocated figures unchanged.
        """
        n = e.nbytes
        dev, aggs = self._chains.get(e.device) or self._chain(e.device)
        dev.allocations += 1
        dev.frees += 1
        dev.auto_frees += 1
        dev.freed += n
        dev.freed_total += n
        if dev.allocated + n > dev.peak:
            dev.peak = dev.allocated + n
        for a in aggs:
            if a.allocated + n > a.peak:
                a.peak = a.allocated + n
        if self._track:
            site = getattr(e, "free_site", None)
            if site is not None:
                table = self._free_sites.setdefault(e.device, {})
                table[site] = table.get(site, 0) + n

    def _credit_free_locked(self, e: _Entry, auto: bool, site: Optional[Site]) -> None:
        n = e.nbytes
        dev, aggs = self._chains[e.device]
        dev.allocated -= n
        dev.freed += n
        dev.freed_total += n
        dev.frees += 1
        dev.live -= 1
        if auto:
            dev.auto_frees += 1
        for a in aggs:
            a.allocated -= n
        if site is not None and self._track:
            table = self._free_sites.setdefault(e.device, {})
            table[site] = table.get(site, 0) + n

    def _grow_locked(self, name: str, n: int) -> None:
        dev, aggs = self._chains.get(name) or self._chain(name)
        v = dev.allocated = dev.allocated + n
        if v > dev.peak:
            dev.peak = v
        for a in aggs:
            v = a.allocated = a.allocated + n
            if v > a.peak:
                a.peak = v

    def _count_locked(
        self, st: torch.UntypedStorage, site: Optional[Site], device: Optional[str] = None
    ) -> int:
        """Count one storage; return the bytes newly added (0 if it was counted already).

        ``device`` overrides the storage's own device (fake tensors keep meta storages but
        stand for another device, e.g. ``cuda:1``).
        """
        key = st._cdata
        entries = self._entries
        e = entries.get(key)
        if e is not None:
            if e() is st:
                n = int(st.nbytes())
                if n == e.nbytes:
                    return 0
                delta = n - e.nbytes  # the storage was resized in place since it was counted
                e.nbytes = n
                self._grow_locked(e.device, delta)
                return delta
            # a dead storage whose address was reused before its callback was applied
            del entries[key]
            self._credit_free_locked(e, True, getattr(e, "free_site", None))
        if device is None:
            dev = st.device
            name = self._names.get(dev)
            if name is None:
                name = self._names[dev] = device_name(dev)
        else:
            name = device
        n = int(st.nbytes())
        e = _Entry(st, self._died)
        e.key = key
        e.nbytes = n
        e.device = name
        e.token = next(self._tokens)
        entries[key] = e
        stats, aggs = self._chains.get(name) or self._chain(name)
        stats.allocations += 1
        stats.live += 1
        v = stats.allocated = stats.allocated + n
        if v > stats.peak:
            stats.peak = v
        for a in aggs:
            v = a.allocated = a.allocated + n
            if v > a.peak:
                a.peak = v
        if site is not None:
            table = self._alloc_sites.setdefault(name, {})
            table[site] = table.get(site, 0) + n
        return n

    def allocate(self, obj: Any) -> int:
        """Count the storages behind ``obj``; return the bytes newly counted.

        ``obj``: a tensor, an ``nn.Module`` (parameters, buffers and gradients), an optimizer
        (its state tensors), or a list/tuple/set/dict of these, nested. A storage already counted
        and alive adds nothing, so views, tied weights and repeated calls never double count.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(10, 10)
            >>> led.allocate(x), led.allocate((x[0], x.t())), led.allocated()
            (400, 0, (400, '400 B'))
        """
        if type(obj) is torch.Tensor and not self._track and not self._gc_enabled:
            try:  # fast path: one plain tensor, no sites, no policy
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                pass
            else:
                with self._lock:
                    if self._pending:
                        self._drain_locked()
                    added = self._count_locked(st, None)
                if added and log.isEnabledFor(10):
                    log.debug("[allocate] +%s (%s)", format_bytes(added), describe(obj))
                return added
        storages = storages_of(obj)
        site = user_site() if self._track else None
        with self._lock:
            touched = self._drain_locked() if self._pending else None
            if len(storages) == 1:
                added = self._count_locked(storages[0][0], site, storages[0][1])
            else:
                added = 0
                for st, dev in storages:
                    added += self._count_locked(st, site, dev)
        if self._gc_enabled:
            self._check_devices(storages, touched)
        if added and log.isEnabledFor(10):
            log.debug("[allocate] +%s (%s)", format_bytes(added), describe(obj))
        return added

    def free(self, obj: Any) -> int:
        """Credit the storages behind ``obj`` as freed now; return the bytes credited.

        Idempotent: freeing twice, freeing something never allocated, or freeing a storage the
        ledger already saw die credits nothing more. The storage's later death credits nothing.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(8)
            >>> _ = led.allocate(x)
            >>> led.free(x), led.free(x), led.freed()
            (32, 0, (32, '32 B'))
        """
        entries = self._entries
        if type(obj) is torch.Tensor and not self._track and not self._gc_enabled:
            try:  # fast path: one plain tensor, no sites, no policy
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                pass
            else:
                with self._lock:
                    if self._pending:
                        self._drain_locked()
                    e = entries.get(st._cdata)
                    if e is None or e() is not st:
                        self.untracked_frees += 1
                        return 0
                    del entries[e.key]
                    n = e.nbytes
                    dev, aggs = self._chains[e.device]
                    dev.allocated -= n
                    dev.freed += n
                    dev.freed_total += n
                    dev.frees += 1
                    dev.live -= 1
                    for a in aggs:
                        a.allocated -= n
                if log.isEnabledFor(10):
                    log.debug("[free] -%s (%s)", format_bytes(n), describe(obj))
                return n
        storages = storages_of(obj)
        site = user_site() if self._track else None
        freed = 0
        with self._lock:
            touched = self._drain_locked() if self._pending else None
            for st, _ in storages:
                e = entries.get(st._cdata)
                if e is None or e() is not st:
                    self.untracked_frees += 1
                    continue
                del entries[e.key]
                self._credit_free_locked(e, False, site)
                freed += e.nbytes
        if self._gc_enabled:
            self._check_devices(storages, touched)
        if freed and log.isEnabledFor(10):
            log.debug("[free] -%s (%s)", format_bytes(freed), describe(obj))
        return freed

    def is_counted(self, tensor: Any) -> bool:
        """True while every storage behind ``tensor`` (or any object ``allocate`` takes) is counted.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.ones(3)
            >>> _ = led.allocate(x); led.is_counted(x[1:]), led.is_counted(torch.ones(3))
            (True, False)
        """
        storages = storages_of(tensor)
        with self._lock:
            for st, _ in storages:
                e = self._entries.get(st._cdata)
                if e is None or e() is not st:
                    return False
            return bool(storages)

    # ----------------------------------------------------------------------------- queries

    def _record_locked(self, device: DeviceLike) -> LedgerRecord:
        if self._pending:
            self._drain_locked()
        if device is None:
            name, agg = "all", self._total
            members = list(self._stats.values())
        else:
            name = device_selector(device)
            stats = self._stats.get(name)
            if stats is not None:
                return stats.record(name)
            type_agg = self._aggs.get(name)  # a device type with indexed devices ("cuda")
            if type_agg is None:
                return LedgerRecord(name)
            agg = type_agg
            members = [s for n, s in self._stats.items() if n.partition(":")[0] == name]
        return LedgerRecord(
            name,
            allocated=agg.allocated,
            freed=sum(s.freed for s in members),
            freed_total=sum(s.freed_total for s in members),
            peak=agg.peak,
            allocations=sum(s.allocations for s in members),
            frees=sum(s.frees for s in members),
            auto_frees=sum(s.auto_frees for s in members),
            live_storages=sum(s.live for s in members),
            gc_runs=sum(s.gc_runs for s in members),
        )

    def record(self, device: DeviceLike = None) -> LedgerRecord:
        """Typed figures for all devices (``None``), a device type (``"cuda"``) or one device.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(4, device="meta")
            >>> _ = led.allocate(x)
            >>> led.record("meta").allocated, led.record().allocated, led.record("cpu").allocated
            (16, 16, 0)
        """
        with self._lock:
            return self._record_locked(device)

    def allocated(self, device: DeviceLike = None) -> tuple[int, str]:
        """Bytes of counted storages alive now, as ``(bytes, "human string")`` (MemLord's shape).

        ``device``: ``None`` for all, ``torch.device("cuda")`` for every CUDA index,
        ``torch.device("cuda", 1)`` or ``"cuda:1"`` for one.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(256)
            >>> _ = led.allocate(x); led.allocated(torch.device("cpu"))
            (1024, '1.00 KiB')
        """
        n = self.record(device).allocated
        return n, format_bytes(n)

    def freed(self, device: DeviceLike = None) -> tuple[int, str]:
        """Bytes freed since the last auto-GC run on the device(s), as ``(bytes, "human string")``.

        See :attr:`LedgerRecord.freed_total` for the count that GC runs do not reset.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(256); _ = led.allocate(x)
            >>> del x; led.freed()
            (1024, '1.00 KiB')
        """
        n = self.record(device).freed
        return n, format_bytes(n)

    def peak(self, device: DeviceLike = None) -> tuple[int, str]:
        """Highest allocated bytes seen, as ``(bytes, "human string")``.

        Example:
            >>> import torch
            >>> led = Ledger(); a = torch.zeros(100); b = torch.zeros(50)
            >>> _ = led.allocate(a); _ = led.free(a); _ = led.allocate(b); led.peak()
            (400, '400 B')
        """
        n = self.record(device).peak
        return n, format_bytes(n)

    def records(self) -> dict[str, LedgerRecord]:
        """One record per device seen (``'cpu'``, ``'cuda:0'``, ...), sorted by name.

        Example:
            >>> import torch
            >>> led = Ledger(); keep = [torch.zeros(2), torch.zeros(2, device="meta")]
            >>> _ = led.allocate(keep)
            >>> {k: r.allocated for k, r in led.records().items()}
            {'cpu': 8, 'meta': 8}
        """
        with self._lock:
            if self._pending:
                self._drain_locked()
            return {
                name: self._stats[name].record(name) for name in sorted(self._chains)
            }

    def reset(self) -> None:
        """Zero every counter and hotspot table and forget which storages are counted.

        Storages counted before the reset are no longer followed: their deaths credit nothing.
        Strategies, call-site tracking and the usage source are kept.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(4); _ = led.allocate(x)
            >>> led.reset(); del x; led.allocated(), led.freed()
            ((0, '0 B'), (0, '0 B'))
        """
        with self._lock:
            self._entries.clear()  # dropping the weak references cancels their callbacks
            self._pending.clear()
            self._stats.clear()
            self._chains.clear()
            self._aggs.clear()
            self._total = _Agg()
            self._clear_sites_locked()
            self._clear_auto_gc_locked()
            self.untracked_frees = 0
        log.debug("[reset] counters cleared")

    # ----------------------------------------------------------------------------- lifecycle

    def metrics(self, usage: Optional[UsageSource] = None) -> dict[str, dict[str, Any]]:
        """Per-device figures for monitoring (see :func:`torchmem.ledger.metrics.ledger_metrics`).

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.zeros(8); _ = led.allocate(x)
            >>> led.metrics()["cpu"]["allocated_bytes"]
            32
        """
        from torchmem.ledger.metrics import ledger_metrics

        return ledger_metrics(self, usage)

    def close(self) -> None:
        """Stop the usage poller this ledger started (counters stay readable). Idempotent.

        Example:
            >>> led = Ledger(); led.close(); led.close()
        """
        self._close_poller()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        r = self.record()
        return (
            f"Ledger(allocated={format_bytes(r.allocated)}, freed={format_bytes(r.freed_total)}, "
            f"live_storages={r.live_storages})"
        )
