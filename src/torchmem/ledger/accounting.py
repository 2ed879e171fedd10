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

It also keeps, on request, the call sites that allocate and free most
(:meth:`~Ledger.set_callsite_tracking`), and runs a banded auto-GC policy in MemLord's format
(:meth:`~Ledger.set_auto_gc_strategy`) driven by a usage source (:mod:`torchmem.devices`).

Differences from MemLord (ModelCloud), whose API this follows:

* exact dedup across calls (MemLord dedups only inside one call, so a tensor and then its view
  count twice); a move is never credited directly, the old storage is credited once when it
  actually dies (MemLord's move hook credits the free and its finalizer credits it again);
  operator outputs are counted inside :meth:`~Ledger.capture` (MemLord only sees what its
  wrappers see);
* a threshold with both ``bytes`` and ``percent`` resolves to the *larger* of the two (the
  behaviour MemLord's README documents): both limits must be crossed before a band triggers;
* ``auto_gc_strategy=None`` means *no* auto-GC (MemLord installs default bands); pass
  :data:`DEFAULT_AUTO_GC_STRATEGY` to get MemLord-like bands;
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
import ctypes
import ctypes.util
import gc
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

import torchmem
from torchmem._log import get_logger
from torchmem.devices import DeviceUsage, UsagePoller, UsageSource
from torchmem.errors import DeviceError, InvalidInputError, UnsupportedTensorError
from torchmem.units import format_bytes, parse_bytes

__all__ = [
    "Ledger",
    "LedgerRecord",
    "GcRun",
    "DEFAULT_AUTO_GC_STRATEGY",
    "release_device_cache",
]

log = get_logger("ledger")

DeviceLike = Union[str, torch.device, None]
_Pair = tuple[torch.UntypedStorage, Optional[str]]  # a storage and its device if not its own

#: MemLord-like bands: thresholds scale with capacity and tighten as the device fills.
DEFAULT_AUTO_GC_STRATEGY: dict[tuple[float, float], dict[str, Any]] = {
    (0, 50): {"metric": "max", "threshold": {"percent": 50.0}},
    (50, 75): {"metric": "max", "threshold": {"percent": 33.0}},
    (75, 101): {"metric": "max", "threshold": {"percent": 25.0}},
}

_METRICS = ("allocated", "freed", "max")


# ---------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class LedgerRecord:
    """The ledger's figures for one device, one device type or all devices.

    ``allocated`` is the bytes of counted storages alive now; ``freed`` the bytes freed since the
    last auto-GC run on that device (MemLord's counter, which a GC trigger resets);
    ``freed_total`` every byte freed since the ledger was created or reset; ``peak`` the highest
    ``allocated`` seen. Counts: ``allocations`` (storages counted), ``frees`` (explicit and
    automatic), ``auto_frees`` (frees by storage death), ``live_storages`` and ``gc_runs``.

    Example:
        >>> import torch
        >>> led = Ledger(); t = torch.zeros(256)
        >>> _ = led.allocate(t); _ = led.free(t)
        >>> r = led.record("cpu"); (r.allocated, r.freed, r.peak, r.allocations, r.frees)
        (0, 1024, 1024, 1, 1)
    """

    device: str
    allocated: int = 0
    freed: int = 0
    freed_total: int = 0
    peak: int = 0
    allocations: int = 0
    frees: int = 0
    auto_frees: int = 0
    live_storages: int = 0
    gc_runs: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (ints only, plus the device name).

        Example:
            >>> LedgerRecord("cpu", allocated=5).as_dict()["allocated"]
            5
        """
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        return (
            f"{self.device}: allocated {format_bytes(self.allocated)} (peak "
            f"{format_bytes(self.peak)}), freed {format_bytes(self.freed_total)}, "
            f"{self.live_storages} live storage(s), {self.gc_runs} GC run(s)"
        )


@dataclass(frozen=True)
class GcRun:
    """One auto-GC trigger: why it ran and what it did.

    Example:
        >>> GcRun("cpu", 0.0, "freed", 10, 8, 91.0, (90.0, 101.0), 0, "malloc_trim").metric
        'freed'
    """

    device: str
    time: float
    metric: str
    value: int
    threshold: int
    used_pct: float
    band: tuple[float, float]
    collected: int
    released: str


class _Stats:
    __slots__ = (
        "allocated", "freed", "freed_total", "peak", "allocations", "frees", "auto_frees",
        "live", "gc_runs",
    )

    def __init__(self) -> None:
        self.allocated = self.freed = self.freed_total = self.peak = 0
        self.allocations = self.frees = self.auto_frees = self.live = self.gc_runs = 0

    def record(self, name: str) -> LedgerRecord:
        return LedgerRecord(
            name, self.allocated, self.freed, self.freed_total, self.peak, self.allocations,
            self.frees, self.auto_frees, self.live, self.gc_runs,
        )


class _Agg:
    """Running allocated bytes and peak of a device type or of all devices."""

    __slots__ = ("allocated", "peak")

    def __init__(self) -> None:
        self.allocated = self.peak = 0


class _Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one counted storage, carrying what it was counted as."""

    __slots__ = ("key", "nbytes", "device", "token", "free_site")

    key: int
    nbytes: int
    device: str
    token: int
    free_site: Optional[tuple[str, int]]


class _Band:
    __slots__ = ("lo", "hi", "metric", "bytes", "percent")

    def __init__(
        self, lo: float, hi: float, metric: str, nbytes: Optional[int], percent: Optional[float]
    ) -> None:
        self.lo, self.hi, self.metric, self.bytes, self.percent = lo, hi, metric, nbytes, percent

    def threshold(self, total: int) -> int:
        # Documented choice: bytes and percent combine as the LARGER of the two (MemLord's README).
        candidates = []
        if self.bytes is not None:
            candidates.append(self.bytes)
        if self.percent is not None and total > 0:
            candidates.append(int(total * self.percent / 100.0))
        return max(candidates) if candidates else 0


# ---------------------------------------------------------------------------------------------
# call sites

_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (torch, torchmem)
)
_internal_cache: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        absolute = os.path.abspath(filename) if not filename.startswith("<") else filename
        hit = absolute.startswith(_INTERNAL_DIRS) or filename.startswith("<frozen")
        _internal_cache[filename] = hit
    return hit


_Site = tuple[str, int]  # (file, line); formatted as "file:line" only when asked for


def _user_site(depth: int = 2) -> Optional[_Site]:
    """(file, line) of the innermost frame outside torch and torchmem (cheap frame walk)."""
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


# ---------------------------------------------------------------------------------------------
# cache release

_libc: Any = None


def _malloc_trim() -> bool:
    global _libc
    if _libc is None:
        _libc = False
        try:
            name = ctypes.util.find_library("c")
            lib = ctypes.CDLL(name) if name else None
            if lib is not None and hasattr(lib, "malloc_trim"):
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                lib.malloc_trim.restype = ctypes.c_int
                _libc = lib
        except Exception:
            _libc = False
    if _libc is False:
        return False
    _libc.malloc_trim(0)
    return True


def release_device_cache(device: str) -> str:
    """Return a device's cached, unused memory to the system; say what ran.

    CUDA: ``torch.cuda.empty_cache()`` on that device (only if CUDA was initialised). CPU:
    glibc's ``malloc_trim(0)`` where the C library has it. Other devices: their
    ``torch.<type>.empty_cache()`` when it exists. Returns ``"empty_cache"``,
    ``"malloc_trim"`` or ``"none"``.

    Example:
        >>> import platform
        >>> release_device_cache("cpu") == ("malloc_trim" if platform.libc_ver()[0] == "glibc" else "none")
        True
        >>> release_device_cache("meta")
        'none'
    """
    dtype, _, index = device.partition(":")
    if dtype == "cpu":
        return "malloc_trim" if _malloc_trim() else "none"
    if dtype == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with torch.cuda.device(int(index or 0)):
                torch.cuda.empty_cache()
            return "empty_cache"
        return "none"
    mod = getattr(torch, dtype, None)
    fn = getattr(mod, "empty_cache", None)
    if callable(fn):
        try:
            fn()
            return "empty_cache"
        except Exception:
            return "none"
    return "none"


# ---------------------------------------------------------------------------------------------
# the ledger


def _validate_strategy(strategy: Any) -> list[_Band]:
    if not isinstance(strategy, Mapping):
        raise InvalidInputError(
            "auto-GC strategy must be a dict {(lo_pct, hi_pct): {'metric': ..., 'threshold': "
            f"{{'bytes': int, 'percent': float}}}}, got {type(strategy).__name__}; pass {{}} or "
            "None to turn auto-GC off"
        )
    bands: list[_Band] = []
    for key, rule in strategy.items():
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in key)
            and 0 <= key[0] < key[1]
        ):
            raise InvalidInputError(
                f"auto-GC band key must be (lo_pct, hi_pct) with 0 <= lo < hi, got {key!r}; "
                "e.g. (75, 101) for 75% <= used < 101%"
            )
        if not isinstance(rule, Mapping):
            raise InvalidInputError(f"auto-GC band {key} must map to a dict, got {rule!r}")
        metric = rule.get("metric", "max")
        if metric not in _METRICS:
            raise InvalidInputError(
                f"auto-GC band {key}: metric must be one of {_METRICS}, got {metric!r}"
            )
        thr = rule.get("threshold")
        if not isinstance(thr, Mapping) or not ({"bytes", "percent"} & set(thr)):
            raise InvalidInputError(
                f"auto-GC band {key}: 'threshold' must be a dict with 'bytes' and/or 'percent', "
                f"got {thr!r}; e.g. {{'percent': 25.0}} or {{'bytes': 256 * 2**20}}"
            )
        unknown = set(thr) - {"bytes", "percent"}
        if unknown:
            raise InvalidInputError(
                f"auto-GC band {key}: unknown threshold key(s) {sorted(unknown)}; "
                "use 'bytes' and/or 'percent'"
            )
        nbytes = parse_bytes(thr["bytes"]) if "bytes" in thr else None
        percent: Optional[float] = None
        if "percent" in thr:
            p = thr["percent"]
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100:
                raise InvalidInputError(
                    f"auto-GC band {key}: percent must be a number in (0, 100], got {p!r}"
                )
            percent = float(p)
        bands.append(_Band(float(key[0]), float(key[1]), metric, nbytes, percent))
    bands.sort(key=lambda b: b.lo)
    for a, b in zip(bands, bands[1:]):
        if b.lo < a.hi:
            raise InvalidInputError(
                f"auto-GC bands ({a.lo:g}, {a.hi:g}) and ({b.lo:g}, {b.hi:g}) overlap; "
                "each used % must fall in at most one band"
            )
    return bands


def _device_name(device: Any) -> str:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(
            f"expected a device such as 'cpu', 'cuda', 'cuda:1' or torch.device('cuda', 1), "
            f"got {device!r} ({e})"
        ) from None
    return str(d)


class Ledger:
    """Exact allocated/freed bytes per device, with automatic frees, capture, hotspots and auto-GC.

    Args:
        auto_gc_strategy: banded policy in MemLord's format (see :meth:`set_auto_gc_strategy`);
            ``None`` or ``{}`` turns auto-GC off (the default).
        track_callsite: record ``file:line`` of allocations and frees (off by default; costs a
            frame walk per call, see BENCHMARKS.md).
        usage_source: where auto-GC reads device usage -- any object with
            ``usage(device) -> DeviceUsage | None``. Default: a :class:`~torchmem.devices.UsagePoller`
            created on first need and closed by :meth:`close`.
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
        if usage_source is not None and not callable(getattr(usage_source, "usage", None)):
            raise InvalidInputError(
                "usage_source must have a usage(device) -> DeviceUsage | None method, got "
                f"{type(usage_source).__name__}; pass a torchmem.UsagePoller or your own object"
            )
        if isinstance(gc_min_interval, bool) or not isinstance(gc_min_interval, (int, float)) or gc_min_interval < 0:
            raise InvalidInputError(
                f"gc_min_interval must be a number of seconds >= 0, got {gc_min_interval!r}"
            )
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._pending: collections.deque[_Entry] = collections.deque()
        self._stats: dict[str, _Stats] = {}  # per device ("cpu", "cuda:0", "meta")
        self._aggs: dict[str, _Agg] = {}  # per device type with indexed devices ("cuda")
        self._chains: dict[str, tuple[_Stats, tuple[_Agg, ...]]] = {}
        self._names: dict[torch.device, str] = {}
        self._total = _Agg()
        self._tokens = itertools.count(1)
        self._track = bool(track_callsite)
        self._alloc_sites: dict[str, dict[_Site, int]] = {}
        self._free_sites: dict[str, dict[_Site, int]] = {}
        self._default_bands: list[_Band] = []
        self._device_bands: dict[str, list[_Band]] = {}
        self._gc_enabled = False
        self._usage_source = usage_source
        self._own_poller: Optional[UsagePoller] = None
        self._poll_interval = poll_interval
        self.gc_min_interval = float(gc_min_interval)
        self._last_gc: dict[str, float] = {}
        self._gc_suppressed = 0
        self.gc_history: collections.deque[GcRun] = collections.deque(maxlen=256)
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
                    entry.free_site = _user_site()
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
            if entries.get(e.key) is e:
                del entries[e.key]
                self._credit_free_locked(e, True, getattr(e, "free_site", None))
                touched.add(e.device)
        return touched

    def _credit_free_locked(self, e: _Entry, auto: bool, site: Optional[_Site]) -> None:
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
        self, st: torch.UntypedStorage, site: Optional[_Site], device: Optional[str] = None
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
                name = self._names[dev] = str(dev)
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
                    log.debug("[allocate] +%s (%s)", format_bytes(added), _describe(obj))
                return added
        storages = _storages(obj)
        site = _user_site() if self._track else None
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
            log.debug("[allocate] +%s (%s)", format_bytes(added), _describe(obj))
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
                    log.debug("[free] -%s (%s)", format_bytes(n), _describe(obj))
                return n
        storages = _storages(obj)
        site = _user_site() if self._track else None
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
            log.debug("[free] -%s (%s)", format_bytes(freed), _describe(obj))
        return freed

    def is_counted(self, tensor: Any) -> bool:
        """True while every storage behind ``tensor`` (or any object ``allocate`` takes) is counted.

        Example:
            >>> import torch
            >>> led = Ledger(); x = torch.ones(3)
            >>> _ = led.allocate(x); led.is_counted(x[1:]), led.is_counted(torch.ones(3))
            (True, False)
        """
        storages = _storages(tensor)
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
            name = _device_name(device)
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
            self._alloc_sites.clear()
            self._free_sites.clear()
            self._last_gc.clear()
            self.gc_history.clear()
            self._gc_suppressed = 0
            self.untracked_frees = 0
        log.debug("[reset] counters cleared")

    # ----------------------------------------------------------------------------- capture

    def _on_event(self, event: Any, storage: Optional[torch.UntypedStorage]) -> None:
        if storage is None:
            return
        site = _user_site() if self._track else None
        with self._lock:
            touched = self._drain_locked() if self._pending else None
            added = self._count_locked(storage, site, getattr(event, "device", None))
        if self._gc_enabled:
            self._check_devices([(storage, getattr(event, "device", None))], touched)
        if added and log.isEnabledFor(10):
            log.debug("[capture] +%s on %s (%s)", format_bytes(added), storage.device,
                      getattr(event, "op", None))

    @contextmanager
    def capture(self, **track_options: Any) -> Iterator[Ledger]:
        """Count every storage created inside the block, operator outputs and moves included.

        Storages come from torchmem's event stream (:func:`torchmem.track` with this ledger as
        a listener); no torch function is wrapped. Like every dispatch mode, it sees the
        operators run by the thread that entered it. A move (``Tensor.to``, ``Module.to``,
        ``torchmem.memory_aware_to``, blocking or not) counts its new storage once, and its old
        storage is credited once when it actually dies. Re-entrant: nested ``capture()`` blocks
        share the outer one's tracker. ``track_options`` go to :func:`torchmem.track`
        (``modules=False`` unless given).

        Example:
            >>> import torch
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
        try:
            track = torchmem.track  # provided by torchmem.capture (issue 3)
        except AttributeError:
            raise InvalidInputError(
                "Ledger.capture() needs torchmem's tracker (torchmem.track), which this build "
                "does not have; count objects explicitly with ledger.allocate(obj) instead"
            ) from None
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
            >>> led = Ledger(); tr = torchmem.Tracker(); led.attach(tr); led.detach(tr); led.detach(tr)
        """
        tracker.remove_listener(self._on_event)

    # ----------------------------------------------------------------------------- call sites

    def set_callsite_tracking(self, enabled: bool) -> None:
        """Turn ``file:line`` hotspot tracking on or off (off by default).

        Example:
            >>> led = Ledger(); led.set_callsite_tracking(True); led.callsite_tracking
            True
        """
        self._track = bool(enabled)

    @property
    def callsite_tracking(self) -> bool:
        """Whether call sites are being recorded.

        Example:
            >>> Ledger().callsite_tracking
            False
        """
        return self._track

    def _top(
        self, tables: dict[str, dict[_Site, int]], device: DeviceLike
    ) -> Optional[tuple[str, str, int]]:
        with self._lock:
            if self._pending:
                self._drain_locked()
            if device is None:
                names = list(tables)
            else:
                want = _device_name(device)
                names = [n for n in tables if n == want or n.partition(":")[0] == want]
            best: Optional[tuple[str, _Site, int]] = None
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
            >>> led = Ledger(track_callsite=True); x = torch.zeros(10); _ = led.allocate(x)
            >>> del x
            >>> dev, site, n = led.top_free_site("cpu"); dev, "top_free_site" in site, n
            ('cpu', True, 40)
        """
        return self._top(self._free_sites, device)

    def sites(self, kind: str = "alloc", device: DeviceLike = None) -> list[tuple[str, str, int]]:
        """Every recorded ``(device, "file:line", bytes)``, largest first (``kind``: alloc/free).

        Example:
            >>> Ledger().sites("free")
            []
        """
        if kind not in ("alloc", "free"):
            raise InvalidInputError(f"kind must be 'alloc' or 'free', got {kind!r}")
        tables = self._alloc_sites if kind == "alloc" else self._free_sites
        want = None if device is None else _device_name(device)
        with self._lock:
            if self._pending:
                self._drain_locked()
            rows = [
                (name, f"{site[0]}:{site[1]}", n)
                for name, table in tables.items()
                if want is None or name == want or name.partition(":")[0] == want
                for site, n in table.items()
            ]
        return sorted(rows, key=lambda r: (-r[2], r[0], r[1]))

    # ----------------------------------------------------------------------------- auto-GC

    def set_auto_gc_strategy(
        self,
        strategy: Optional[Mapping[tuple[float, float], Mapping[str, Any]]],
        device: DeviceLike = None,
    ) -> None:
        """Install a banded auto-GC policy (MemLord's format), for all devices or one device.

        ``{(lo_pct, hi_pct): {"metric": "allocated" | "freed" | "max", "threshold": {"bytes":
        int, "percent": float}}}``. The band whose ``lo <= used% < hi`` holds for the device's
        current usage is chosen; its threshold is resolved in bytes -- **when both ``bytes`` and
        ``percent`` (of capacity) are given, the larger one counts** -- and when the metric
        reaches it, the ledger runs ``gc.collect()`` and the device's cache release
        (:func:`release_device_cache`), resets that device's ``freed`` counter only, logs the run
        and counts it (:attr:`LedgerRecord.gc_runs`, :attr:`gc_history`). Runs on one device are
        at least :attr:`gc_min_interval` seconds apart. ``device=None`` sets the default for all
        devices; a device (``"cuda:1"``) overrides it for that index only. ``None``/``{}``
        removes the policy.

        Example:
            >>> led = Ledger()
            >>> led.set_auto_gc_strategy({(0, 101): {"metric": "freed", "threshold": {"bytes": "1 GiB"}}})
            >>> led.set_auto_gc_strategy({(90, 101): {"metric": "max", "threshold": {"percent": 5}}}, "cuda:1")
            >>> led.set_auto_gc_strategy({(0, 50): {"metric": "mean", "threshold": {"bytes": 1}}})
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: auto-GC band (0, 50): metric must be one of ('allocated', 'freed', 'max'), got 'mean'
        """
        bands = _validate_strategy(strategy) if strategy else []
        with self._lock:
            if device is None:
                self._default_bands = bands
            else:
                name = _device_name(device)
                if bands:
                    self._device_bands[name] = bands
                else:
                    self._device_bands.pop(name, None)
            self._gc_enabled = bool(self._default_bands) or any(self._device_bands.values())
        log.debug("[set_auto_gc_strategy] %d band(s) for %s", len(bands), device or "all devices")

    def _usage(self) -> UsageSource:
        src = self._usage_source
        if src is None:
            with self._lock:
                if self._own_poller is None:
                    self._own_poller = UsagePoller(self._poll_interval)
                src = self._own_poller
        return src

    def _check_devices(self, storages: list[_Pair], touched: Optional[set[str]]) -> None:
        names = {dev or self._names.get(st.device) or str(st.device) for st, dev in storages}
        if touched:
            names |= touched
        for name in names:
            self.maybe_auto_gc(name)

    def maybe_auto_gc(self, device: DeviceLike) -> Optional[GcRun]:
        """Evaluate the policy for one device now; run the GC if it triggers; return the run.

        Called automatically after each allocate/free/capture that touches the device.

        Example:
            >>> Ledger().maybe_auto_gc("cpu") is None    # no policy installed
            True
        """
        name = _device_name(device)
        bands = self._device_bands.get(name) or self._default_bands
        if not bands:
            return None
        usage: Optional[DeviceUsage] = self._usage().usage(name)
        if usage is None or usage.total <= 0:
            return None
        pct = usage.used_pct
        band = next((b for b in bands if b.lo <= pct < b.hi), None)
        if band is None:
            return None
        threshold = band.threshold(usage.total)
        if threshold <= 0:
            return None
        with self._lock:
            if self._pending:
                self._drain_locked()
            s = self._stats.get(name)
            if s is None:
                return None
            value = (
                s.allocated if band.metric == "allocated"
                else s.freed if band.metric == "freed"
                else max(s.allocated, s.freed)
            )
            if value < threshold:
                return None
            now = time.monotonic()
            last = self._last_gc.get(name)
            if last is not None and now - last < self.gc_min_interval:
                self._gc_suppressed += 1
                return None
            self._last_gc[name] = now  # claim the run so other threads back off
        collected = gc.collect()
        released = release_device_cache(name)
        with self._lock:
            if self._pending:
                self._drain_locked()
            s = self._stats.get(name)
            if s is not None:
                s.freed = 0  # this device's counter only
                s.gc_runs += 1
            run = GcRun(name, time.time(), band.metric, value, threshold, pct,
                        (band.lo, band.hi), collected, released)
            self.gc_history.append(run)
        log.info(
            "[auto_gc] %s: %s %s >= threshold %s (band %g-%g%%, used %.1f%%); gc.collect() "
            "found %d object(s); cache release: %s",
            name, band.metric, format_bytes(value), format_bytes(threshold), band.lo, band.hi,
            pct, collected, released,
        )
        return run

    @property
    def gc_suppressed(self) -> int:
        """Triggers skipped because the device's last GC run was too recent.

        Example:
            >>> Ledger().gc_suppressed
            0
        """
        return self._gc_suppressed

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
        with self._lock:
            poller, self._own_poller = self._own_poller, None
        if poller is not None:
            poller.close()

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


# ---------------------------------------------------------------------------------------------
# gathering storages


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor {tuple(obj.shape)} {obj.dtype} on {obj.device}"
    return type(obj).__name__


def _tensor_storages(t: torch.Tensor, out: list[_Pair]) -> None:
    layout = t.layout
    if layout is torch.strided or layout is torch.jagged:
        # nested tensors: their storage is the packed data buffer, which is what they hold
        try:
            st = t.untyped_storage()
            dev = t.device
            out.append((st, None if st.device == dev else str(dev)))
        except (RuntimeError, NotImplementedError) as e:
            raise UnsupportedTensorError(
                f"a {type(t).__name__} without a storage cannot be counted ({e}); allocate the "
                "tensors it wraps instead"
            ) from None
    elif layout is torch.sparse_coo:
        _tensor_storages(t._indices(), out)
        _tensor_storages(t._values(), out)
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        for part in (t.crow_indices(), t.col_indices(), t.values()):
            _tensor_storages(part, out)
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        for part in (t.ccol_indices(), t.row_indices(), t.values()):
            _tensor_storages(part, out)
    else:
        raise UnsupportedTensorError(f"tensor layout {layout} is not supported by the ledger")


def _storages(obj: Any) -> list[_Pair]:
    if type(obj) is torch.Tensor:
        try:
            return [(obj.untyped_storage(), None)]  # fast path: a plain strided (or nested) tensor
        except (RuntimeError, NotImplementedError):
            pass  # sparse layouts: counted through their component tensors below
    out: list[_Pair] = []
    _gather(obj, out, 0)
    return out


def _gather(obj: Any, out: list[_Pair], depth: int) -> None:
    if depth > 64:
        raise InvalidInputError("objects nested more than 64 levels deep (a cycle?) cannot be counted")
    if isinstance(obj, torch.Tensor):
        _tensor_storages(obj, out)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            _tensor_storages(p, out)
            if p.grad is not None:
                _tensor_storages(p.grad, out)
        for b in obj.buffers():
            _tensor_storages(b, out)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            _gather(state, out, depth + 1)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            if v is not None:
                _gather(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            if v is not None:
                _gather(v, out, depth + 1)
    elif depth > 0 and isinstance(obj, (int, float, bool, str)):
        return  # e.g. an optimizer's "step" counter
    else:
        raise InvalidInputError(
            "Ledger.allocate/free expected a tensor, an nn.Module, an optimizer, or a "
            f"list/tuple/dict of them, got {type(obj).__module__}.{type(obj).__name__}"
        )
