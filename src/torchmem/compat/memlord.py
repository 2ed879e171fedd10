"""``torchmem.compat.MemLord``: MemLord's API and behaviour on an exact :class:`torchmem.Ledger`.

Coming from MemLord (ModelCloud) takes one changed import::

    from memlord import MemLord            # before
    from torchmem.compat import MemLord    # after

Every public method keeps MemLord's name, arguments and results: ``allocate``/``free`` of
tensors, modules and tuples of them, ``allocated()``/``freed()`` as ``(bytes, "human string")``
for all devices, a device type or one index, ``hook_into_torch()``, ``hook_into_python(...)``,
``set_callsite_tracking``, ``top_alloc_site``/``top_free_site``, ``set_auto_gc_strategy``,
``reset``, the ``DEBUG=1`` lines it prints per call and its always-printed ``[auto_gc]`` report.
MemLord's per-device counters (``_allocated_by_dev``, ``_freed_by_dev``) and its auto-GC hooks
(``_maybe_auto_gc``, ``_device_memory_stats``, this module's ``_run_backend_gc``) keep their
names too, and :func:`get_device_mem_stats` stands for ``memlord.util.get_device_mem_stats``, so
tests written against MemLord run unchanged.

What is counted comes from a :class:`torchmem.Ledger`, so MemLord's drift is gone: a storage
counts once however many views of it are allocated (across calls too), and a storage credited as
freed -- explicitly, by a move, or by its death -- is never credited again. Where torchmem's
:class:`~torchmem.Ledger` deliberately differs (:mod:`torchmem.ledger.autogc`), this class
follows MemLord: ``auto_gc_strategy=None`` installs MemLord's default bands
(:data:`MEMLORD_DEFAULT_STRATEGY`), a threshold with both ``bytes`` and ``percent`` resolves to
the *smaller* of the two, and an auto-GC run empties the device's cache (no ``gc.collect()``;
nothing on CPU, where MemLord's backend GC does nothing) and resets ``allocated`` and ``freed`` of
every device of that type.

The factory hooks of :meth:`MemLord.hook_into_python` keep torch's factories cheap: without
call-site tracking, auto-GC bands or ``DEBUG=1`` a new storage is only queued (weakly) and
counted at the next read or write of the counters, or once 4096 events are queued.

Over 800 lines: MemLord's whole public surface is one class whose methods share its counters,
hooks and queue, and every method documents MemLord's behaviour with an example.

Example:
    >>> import torch
    >>> from torchmem.compat import MemLord
    >>> lord = MemLord(auto_gc_strategy={})
    >>> x = torch.zeros(256)                     # 1 KiB
    >>> lord.allocate(x); lord.allocate(x[10:])  # the view adds nothing
    >>> lord.allocated(), lord.allocated(torch.device("cpu"))
    ((1024, '1 KiB'), (1024, '1 KiB'))
    >>> lord.free(x); lord.freed()
    (1024, '1 KiB')
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch

from torchmem._device import device_name, device_selector
from torchmem.devices import UsagePoller
from torchmem.errors import InvalidInputError
from torchmem.ledger.accounting import Ledger, _Entry
from torchmem.ledger.autogc import _Band, _validate_strategy
from torchmem.ledger.release import release_device_cache
from torchmem.ledger.sites import Site, user_site
from torchmem.ledger.storages import storages_of

__all__ = [
    "MEMLORD_DEFAULT_STRATEGY",
    "MemLord",
    "SnakeHooks",
    "TorchMoveHooks",
    "UnsupportedObjectError",
    "format_bytes",
    "get_device_mem_stats",
]

#: MemLord's default bands, installed by ``MemLord(auto_gc_strategy=None)``.
MEMLORD_DEFAULT_STRATEGY: dict[tuple[float, float], dict[str, Any]] = {
    (0, 50): {"metric": "max", "threshold": {"percent": 60.0}},
    (50, 75): {"metric": "max", "threshold": {"percent": 50.0}},
    (75, 101): {"metric": "max", "threshold": {"percent": 40.0}},
}

#: The torch factories ``hook_into_python(enable_factory_wrappers=True)`` counts (MemLord's list).
_FACTORIES = (
    "empty", "zeros", "ones", "full", "rand", "randn", "tensor", "arange",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint", "randperm", "linspace", "logspace", "eye", "tri", "empty_strided", "normal",
)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")

#: Storages a hooked factory may queue before the producing thread applies the queue itself.
_MAX_QUEUED = 4096


class UnsupportedObjectError(InvalidInputError, TypeError):
    """What :meth:`MemLord.allocate`/:meth:`~MemLord.free` raise for an object they cannot count.

    Both torchmem's :class:`~torchmem.errors.InvalidInputError` and the ``TypeError`` MemLord
    raised, so ``except TypeError`` written for MemLord still catches it.

    Example:
        >>> E = UnsupportedObjectError
        >>> issubclass(E, TypeError), issubclass(E, InvalidInputError)
        (True, True)
    """


def format_bytes(n: int) -> str:
    """Bytes as MemLord prints them: base 1024, at most two decimals, trailing zeros trimmed.

    Example:
        >>> format_bytes(0), format_bytes(1536), format_bytes(2**30), format_bytes(1181116006)
        ('0 B', '1.5 KiB', '1 GiB', '1.1 GiB')
    """
    x = float(n)
    for unit in _UNITS:
        if abs(x) < 1024 or unit == _UNITS[-1]:
            s = f"{x:.2f}".rstrip("0").rstrip(".")
            return f"{s} {unit}"
        x /= 1024.0
    raise AssertionError("unreachable")  # pragma: no cover


_ENV_DATA: Any = getattr(os.environ, "_data", None)
_ENV_KEYS: tuple[Any, ...] = ()
if isinstance(_ENV_DATA, dict) and os.name == "posix":
    _ENV_KEYS = ((b"DEBUG", b"1"), (b"TORCHMEM_DEBUG", b"1"))
else:  # pragma: no cover - other platforms read os.environ itself
    _ENV_DATA = None


def _debug_on() -> bool:
    """MemLord's switch, read at every call as MemLord does: ``DEBUG=1`` (or ``TORCHMEM_DEBUG=1``).

    Example:
        >>> import os
        >>> os.environ["DEBUG"] = "1"; on = _debug_on(); del os.environ["DEBUG"]
        >>> on, _debug_on() == (os.environ.get("TORCHMEM_DEBUG") == "1")
        (True, True)
    """
    data = _ENV_DATA
    if data is not None:  # os.environ's own dict: a lookup without encoding the key each time
        for key, on in _ENV_KEYS:
            if data.get(key) == on:
                return True
        return False
    env = os.environ
    return env.get("DEBUG") == "1" or env.get("TORCHMEM_DEBUG") == "1"


def _emit(msg: str) -> None:
    print(f"MemLord: {msg}", file=sys.stdout, flush=True)


def _debug(msg: str) -> None:
    if _debug_on():
        _emit(msg)


# ----------------------------------------------------------------------------- device usage

_poller: Optional[UsagePoller] = None
_poller_lock = threading.Lock()


def get_device_mem_stats(dev: Any) -> tuple[Optional[int], Optional[int], float]:
    """``(total_bytes, used_bytes, used_pct)`` of a device from a background poller (MemLord's).

    The first call for a device reads it and starts its poller thread; later calls return the
    latest reading without blocking. An absent device gives ``(None, None, 0.0)``.

    Example:
        >>> import torch
        >>> total, used, pct = get_device_mem_stats(torch.device("cpu"))
        >>> total > 0 and 0.0 <= pct <= 100.0
        True
        >>> get_device_mem_stats(torch.device("meta"))
        (None, None, 0.0)
    """
    global _poller
    p = _poller
    if p is None:
        with _poller_lock:
            if _poller is None:
                _poller = UsagePoller(0.2)
            p = _poller
    u = p.usage(str(dev) if isinstance(dev, torch.device) else dev)
    if u is None:
        return (None, None, 0.0)
    return (u.total, u.used, u.used_pct)


def _run_backend_gc(dev: torch.device) -> bool:
    """Empty ``dev``'s accelerator cache; True if one was emptied (CPU: False, as in MemLord).

    Example:
        >>> import torch
        >>> _run_backend_gc(torch.device("cpu"))
        False
    """
    if dev.type in ("cpu", "meta"):
        return False
    try:
        return release_device_cache(str(dev)) == "empty_cache"
    except Exception:
        return False


# ----------------------------------------------------------------------------- the ledger


class _LordLedger(Ledger):
    """A :class:`Ledger` that also moves every count and credit into a :class:`MemLord`'s counters.

    Deaths are only queued when they happen (a deque append, thread-safe); every read or write
    applies the queue first, so no figure ever misses one.
    """

    def __init__(self, lord: MemLord, track_callsite: bool) -> None:
        self._alloc_tab = lord._allocated_by_dev
        self._freed_tab = lord._freed_by_dev
        self._devs = lord._devices
        self._batch: Optional[dict[torch.device, int]] = None
        self._slow = False  # True while the MemLord has auto-GC bands: hooks count at once
        super().__init__(track_callsite=track_callsite)
        selfref = weakref.ref(self)
        pending = self._pending

        def _died(entry: _Entry) -> None:
            led = selfref()
            if led is not None and led._track:
                try:
                    entry.free_site = user_site()
                except Exception:  # e.g. during interpreter shutdown
                    pass
            pending.append(entry)

        self._died = _died

    def _dev(self, name: str) -> torch.device:
        d = self._devs.get(name)
        if d is None:
            d = self._devs[name] = torch.device(name)
        return d

    def make_sink(self, lord: MemLord) -> Callable[[torch.Tensor], None]:
        """The function a factory hook calls with each plain tensor it made.

        Without call-site tracking, auto-GC bands or ``DEBUG=1`` it only queues a weak entry for
        the new storage (token 0), counted at the next drain -- a temporary that dies before then
        is counted as allocated and freed -- so a hooked factory stays cheap and no memory is
        held. Otherwise it counts at once through ``lord``.
        """
        lord_ref = weakref.ref(lord)
        pending, names, lock = self._pending, self._names, self._lock
        entry, env, debug_on = _Entry, _ENV_DATA, _debug_on
        # A queued entry's death only needs appending to the queue: the deque's own append is
        # its callback, with no Python frame (the ledger's _died also records the free site, but
        # this path runs only while call-site tracking is off).
        died = pending.append

        def sink(t: torch.Tensor) -> None:
            if (
                self._track
                or self._slow
                or (
                    debug_on() if env is None
                    else env.get(b"DEBUG") == b"1" or env.get(b"TORCHMEM_DEBUG") == b"1"
                )
            ):
                m = lord_ref()
                if m is not None:
                    m._hook_allocate([t])
                return
            if t.is_cpu:
                name = "cpu"
            elif t.is_meta:
                return
            else:
                dev = t.device
                name = names.get(dev) or device_name(dev)
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse layouts: the general path
                m = lord_ref()
                if m is not None:
                    m._hook_allocate([t])
                return
            e = entry(st, died)
            e.key = st._cdata
            e.nbytes = st.nbytes()
            e.device = name
            e.token = 0
            pending.append(e)
            if len(pending) > _MAX_QUEUED and lock.acquire(False):
                try:
                    self._drain_locked()
                finally:
                    lock.release()

        return sink

    def _count_dead_locked(self, e: _Entry) -> None:
        # counted as allocated, then credited as freed: MemLord's allocated figure is unchanged
        super()._count_dead_locked(e)
        n = e.nbytes
        d = self._devs.get(e.device) or self._dev(e.device)
        self._freed_tab[d] = self._freed_tab.get(d, 0) + n
        batch = self._batch
        if batch is not None:
            batch[d] = batch.get(d, 0) + n

    def _count_locked(
        self, st: torch.UntypedStorage, site: Optional[Site], device: Optional[str] = None
    ) -> int:
        n = super()._count_locked(st, site, device)
        if n:
            name = self._entries[st._cdata].device
            d = self._devs.get(name) or self._dev(name)
            tab = self._alloc_tab
            v = tab.get(d, 0) + n
            tab[d] = v if v > 0 else 0
            batch = self._batch
            if batch is not None:
                batch[d] = batch.get(d, 0) + n
        return n

    def _credit_free_locked(self, e: _Entry, auto: bool, site: Optional[Site]) -> None:
        super()._credit_free_locked(e, auto, site)
        n = e.nbytes
        d = self._devs.get(e.device) or self._dev(e.device)
        tab = self._alloc_tab
        v = tab.get(d, 0) - n
        tab[d] = v if v > 0 else 0
        self._freed_tab[d] = self._freed_tab.get(d, 0) + n
        batch = self._batch
        if batch is not None:
            batch[d] = batch.get(d, 0) + n


_Obj = Union[torch.Tensor, torch.nn.Module]


def _tensors(ob: Any) -> list[torch.Tensor]:
    """The tensors MemLord counts behind ``ob``: a tensor, a module's parameters and buffers."""
    items = ob if isinstance(ob, tuple) else (ob,)
    out: list[torch.Tensor] = []
    for x in items:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, torch.nn.Module):
            out.extend(p.data for p in x.parameters())
            out.extend(x.buffers())
        else:
            where = "in the tuple " if isinstance(ob, tuple) else ""
            raise UnsupportedObjectError(
                f"MemLord.allocate/free expected a torch.Tensor, an nn.Module or a tuple of them, "
                f"got {type(x).__module__}.{type(x).__name__} {where}; pass the tensors or "
                "modules themselves (a list can be passed as tuple(items))"
            )
    return [t for t in out if t.device.type != "meta"]


class MemLord:
    """MemLord's memory accountant: allocated and freed bytes per device, auto-GC bands, hooks.

    Args:
        auto_gc_strategy: bands in MemLord's format ``{(lo_pct, hi_pct): {"metric":
            "allocated" | "freed" | "max", "threshold": {"bytes": int, "percent": float}}}``.
            ``None`` installs :data:`MEMLORD_DEFAULT_STRATEGY` (as MemLord does); ``{}`` turns
            auto-GC off.
        track_callsite: record ``file:line`` of allocations and frees for the hotspot queries.

    Counting is exact (a :class:`torchmem.Ledger` underneath, see :attr:`ledger`): views and
    repeated calls never double count, and a storage whose bytes were credited as freed -- by
    :meth:`free`, by a move through :meth:`hook_into_torch`, or by its death -- is credited once.
    Freeing something never allocated credits nothing (MemLord credited its size). Auto-GC follows
    MemLord (see the module docstring). The torch patches are installed once per process and
    shared by every MemLord that hooks in.

    Example:
        >>> import torch
        >>> lord = MemLord(auto_gc_strategy={})
        >>> m = torch.nn.Linear(4, 4)               # 64 + 16 bytes
        >>> lord.allocate((m, m.weight))            # the weight is counted once
        >>> lord.allocated(torch.device("cpu"))
        (80, '80 B')
        >>> lord.allocate([m])                      # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.compat.memlord.UnsupportedObjectError: MemLord.allocate/free expected a ...
    """

    def __init__(
        self, auto_gc_strategy: Optional[Mapping[Any, Any]] = None, *, track_callsite: bool = False
    ) -> None:
        self._allocated_by_dev: dict[torch.device, int] = {}
        self._freed_by_dev: dict[torch.device, int] = {}
        self._gc_count_by_dev: dict[torch.device, int] = {}
        self._gc_total_count = 0
        self._devices: dict[str, torch.device] = {}
        self._auto_gc_strategy: dict[Any, Any] = {}
        self._bands: list[_Band] = []
        self._ledger = _LordLedger(self, bool(track_callsite))
        self._lock = self._ledger._lock
        self._snake_hooks: Optional[SnakeHooks] = None
        self._torch_hooks: Optional[TorchMoveHooks] = None
        self.set_auto_gc_strategy(auto_gc_strategy)

    # ------------------------------------------------------------------ counter updates

    def _dev(self, name: str) -> torch.device:
        return self._ledger._dev(name)

    def _drain_locked(self) -> None:
        if self._ledger._pending:
            self._ledger._drain_locked()

    def _count(self, tensors: list[torch.Tensor], site: Optional[Site]) -> dict[torch.device, int]:
        """Count the storages behind ``tensors``; bytes newly counted per device."""
        pairs = storages_of(tensors) if tensors else []
        led = self._ledger
        with self._lock:
            self._drain_locked()
            batch: dict[torch.device, int] = {}
            led._batch = batch
            try:
                for st, dev in pairs:
                    led._count_locked(st, site, dev)
            finally:
                led._batch = None
        return batch

    def _entries_of(
        self, tensors: list[torch.Tensor], site: Optional[Site], count_first: bool
    ) -> list[_Entry]:
        """The ledger's entries of the storages behind ``tensors``.

        ``count_first``: count a storage not counted yet (a move's source) so it has one.
        """
        pairs = storages_of(tensors) if tensors else []
        led = self._ledger
        entries = led._entries
        found: list[_Entry] = []
        with self._lock:
            self._drain_locked()
            for st, dev in pairs:
                e = entries.get(st._cdata)
                if (e is None or e() is not st) and count_first:
                    led._count_locked(st, site, dev)
                    e = entries.get(st._cdata)
                if e is None or e() is not st:
                    led.untracked_frees += 1
                    continue
                found.append(e)
        return found

    def _credit_entries(
        self, found: list[_Entry], site: Optional[Site]
    ) -> dict[torch.device, int]:
        """Credit entries still counted as freed now; bytes credited per device."""
        led = self._ledger
        entries = led._entries
        batch: dict[torch.device, int] = {}
        with self._lock:
            self._drain_locked()
            led._batch = batch
            try:
                for e in found:
                    if entries.get(e.key) is e:
                        del entries[e.key]
                        led._credit_free_locked(e, False, site)
            finally:
                led._batch = None
        return batch

    def _credit(
        self, tensors: list[torch.Tensor], site: Optional[Site], count_first: bool = False
    ) -> dict[torch.device, int]:
        """Credit the storages behind ``tensors`` as freed; bytes credited per device."""
        return self._credit_entries(self._entries_of(tensors, site, count_first), site)

    # ------------------------------------------------------------------ public API

    @property
    def ledger(self) -> Ledger:
        """The exact :class:`torchmem.Ledger` underneath: peaks, records, live storages, capture.

        Its own counters are torchmem's (auto-GC runs of this class do not reset them).

        Example:
            >>> import torch
            >>> lord = MemLord({}); x = torch.zeros(8); lord.allocate(x)
            >>> lord.ledger.record("cpu").live_storages, lord.ledger.peak()
            (1, (32, '32 B'))
        """
        return self._ledger

    def set_callsite_tracking(self, enabled: bool) -> None:
        """Record ``file:line`` of each allocation and free from now on (off by default).

        Example:
            >>> import torch
            >>> lord = MemLord({}); lord.set_callsite_tracking(True)
            >>> lord.allocate(torch.zeros(4)); lord.top_alloc_site()[2]
            16
        """
        self._ledger.set_callsite_tracking(bool(enabled))

    def allocate(self, ob: Any) -> None:
        """Count a tensor, an ``nn.Module`` (parameters and buffers) or a tuple of them.

        Storages already counted add nothing. With ``DEBUG=1`` prints ``[allocate] +X on dev,
        now Y`` per device and one ``[allocate-summary]`` line per known device; then checks
        the auto-GC bands of the devices touched.

        Example:
            >>> import torch
            >>> lord = MemLord({}); a, b = torch.zeros(10), torch.zeros(5, dtype=torch.int8)
            >>> lord.allocate((a, b)); lord.allocated()
            (45, '45 B')
            >>> lord.allocate("x")                     # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.compat.memlord.UnsupportedObjectError: ... got builtins.str ...
        """
        site = user_site() if self._ledger._track else None
        batch = self._count(_tensors(ob), site)
        self._after(batch, "[allocate] +", "[allocate-summary]", self._allocated_by_dev)

    def free(self, ob: Any) -> None:
        """Credit the storages behind ``ob`` as freed now (each storage at most once).

        A storage never counted, or already credited (by :meth:`free`, a move or its death),
        credits nothing. With ``DEBUG=1`` prints ``[free] -X on dev, now Y`` and the
        ``[free-summary]`` lines; then checks the auto-GC bands of the devices touched.

        Example:
            >>> import torch
            >>> lord = MemLord({}); x = torch.zeros(100); lord.allocate(x)
            >>> lord.free(x); lord.free(x); lord.allocated(), lord.freed()
            ((0, '0 B'), (400, '400 B'))
        """
        site = user_site() if self._ledger._track else None
        batch = self._credit(_tensors(ob), site)
        self._after(batch, "[free] -", "[free-summary]", self._freed_by_dev)

    def _after(
        self,
        batch: dict[torch.device, int],
        tag: str,
        header: Optional[str] = None,
        table: Optional[dict[torch.device, int]] = None,
    ) -> None:
        """After a count or credit: the ``DEBUG=1`` lines MemLord prints, then the bands."""
        if _debug_on():
            with self._lock:
                lines = [
                    f"{tag}{format_bytes(b)} on {dev}, now "
                    f"{format_bytes(self._allocated_by_dev.get(dev, 0))}"
                    for dev, b in batch.items()
                ]
            for line in lines:
                _emit(line)
            if header is not None and table is not None:
                self._summary(header, table)
        if self._bands:
            for dev in batch:
                self._maybe_auto_gc(dev)

    def _summary(self, header: str, table: dict[torch.device, int]) -> None:
        with self._lock:
            devs = sorted(
                set(self._allocated_by_dev) | set(self._freed_by_dev),
                key=lambda d: (d.type, -1 if d.index is None else d.index),
            )
            lines = [f"{header} {d}: {format_bytes(table.get(d, 0))}" for d in devs]
            by_type: dict[str, list[torch.device]] = {}
            for d in devs:
                by_type.setdefault(d.type, []).append(d)
            for t in sorted(by_type):
                if len(by_type[t]) > 1:
                    total = sum(table.get(d, 0) for d in by_type[t])
                    lines.append(f"{header} {t}: {format_bytes(total)}")
        for line in lines:
            _emit(line)

    def _query(self, table: dict[torch.device, int], device: Any) -> int:
        if device is None:
            want = None
        else:
            try:
                want = device_selector(device)
            except Exception:
                want = ""
            if not want or isinstance(device, (bool, int, float)):
                raise InvalidInputError(
                    "MemLord.allocated/freed expected None (all devices), a device type such as "
                    "torch.device('cuda'), or one device such as torch.device('cuda', 1) or "
                    f"'cuda:1', got {device!r}"
                )
        with self._lock:
            self._drain_locked()
            if want is None:
                return sum(table.values())
            dtype, _, index = want.partition(":")
            if index:
                return sum(v for d, v in table.items() if str(d) == want)
            return sum(v for d, v in table.items() if d.type == dtype)

    def allocated(self, device: Any = None) -> tuple[int, str]:
        """Bytes allocated and not freed: ``(bytes, "human string")``.

        ``device``: ``None`` for all devices, ``torch.device("cuda")`` for every CUDA index,
        ``torch.device("cuda", 1)`` (or ``"cuda:1"``) for one.

        Example:
            >>> import torch
            >>> lord = MemLord({}); x = torch.zeros(2, 512); lord.allocate(x)
            >>> lord.allocated(), lord.allocated(torch.device("cuda")), lord.allocated("cpu")
            ((4096, '4 KiB'), (0, '0 B'), (4096, '4 KiB'))
            >>> lord.allocated(3.5)                    # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: MemLord.allocated/freed expected None ...
        """
        val = self._query(self._allocated_by_dev, device)
        _debug(f"[allocated] query={device}, result={format_bytes(val)}")
        return val, format_bytes(val)

    def freed(self, device: Any = None) -> tuple[int, str]:
        """Bytes freed since the last auto-GC run of the device's type: ``(bytes, "human")``.

        Counts explicit frees, moves' sources (with :meth:`hook_into_torch`) and storage deaths.
        Same device selection as :meth:`allocated`.

        Example:
            >>> import torch, gc
            >>> lord = MemLord({}); x = torch.zeros(64); lord.allocate(x)
            >>> del x; lord.freed(torch.device("cpu"))  # its death is credited on its own
            (256, '256 B')
        """
        val = self._query(self._freed_by_dev, device)
        _debug(f"[freed] query={device}, result={format_bytes(val)}")
        return val, format_bytes(val)

    def _top(self, kind: str, device: Any) -> Optional[tuple[torch.device, str, int]]:
        led = self._ledger
        top = led.top_alloc_site(device) if kind == "alloc" else led.top_free_site(device)
        if top is None:
            return None
        return self._dev(top[0]), top[1], top[2]

    def top_alloc_site(self, device: Any = None) -> Optional[tuple[torch.device, str, int]]:
        """``(device, "file:line", bytes)`` of the line that allocated most, or ``None``.

        Needs :meth:`set_callsite_tracking` on; ``device`` selects as in :meth:`allocated`.

        Example:
            >>> import torch
            >>> lord = MemLord({}, track_callsite=True); lord.allocate(torch.zeros(10))
            >>> dev, site, n = lord.top_alloc_site(torch.device("cpu")); dev, ":" in site, n
            (device(type='cpu'), True, 40)
            >>> MemLord({}).top_alloc_site() is None
            True
        """
        return self._top("alloc", device)

    def top_free_site(self, device: Any = None) -> Optional[tuple[torch.device, str, int]]:
        """``(device, "file:line", bytes)`` of the line that freed most, or ``None``.

        Example:
            >>> import torch
            >>> lord = MemLord({}, track_callsite=True); x = torch.zeros(10); lord.allocate(x)
            >>> lord.free(x); lord.top_free_site()[2]
            40
        """
        return self._top("free", device)

    def reset(self) -> None:
        """Zero the counters, GC run counts and hotspot tables (strategy and hooks are kept).

        Storages counted before still credit ``freed`` when they die.

        Example:
            >>> import torch
            >>> lord = MemLord({}); x = torch.zeros(4); lord.allocate(x)
            >>> lord.reset(); lord.allocated(); del x; lord.freed()
            (0, '0 B')
            (16, '16 B')
        """
        with self._lock:
            self._drain_locked()
            self._allocated_by_dev.clear()
            self._freed_by_dev.clear()
            self._gc_count_by_dev.clear()
            self._gc_total_count = 0
            self._ledger._clear_sites_locked()
        _debug("[reset] counters cleared")

    def gc_runs(self, device: Any = None) -> int:
        """Auto-GC runs so far: all devices (``None``), a device type, or one device.

        Example:
            >>> MemLord({}).gc_runs()
            0
        """
        with self._lock:
            if device is None:
                return self._gc_total_count
        return self._query(self._gc_count_by_dev, device)

    # ------------------------------------------------------------------ auto-GC

    def set_auto_gc_strategy(self, strategy: Optional[Mapping[Any, Any]] = None) -> None:
        """Install auto-GC bands in MemLord's format (``None``: MemLord's defaults; ``{}``: off).

        After each :meth:`allocate`, :meth:`free` or counted hook event on a device, the band
        holding the device's used percent (``lo <= used% < hi``) is chosen; its threshold is
        resolved in bytes -- **the smaller of ``bytes`` and ``percent`` of capacity when both are
        given** (MemLord's rule) -- and when the metric (``allocated``, ``freed`` or their
        ``max``) reaches it, the device's cache is emptied, ``allocated`` and ``freed`` of every
        device of that type are reset, the run is counted (:meth:`gc_runs`) and reported.

        Example:
            >>> lord = MemLord()
            >>> sorted(lord._auto_gc_strategy) == sorted(MEMLORD_DEFAULT_STRATEGY)
            True
            >>> lord.set_auto_gc_strategy({(0, 101): {"metric": "mean", "threshold": {"bytes": 1}}})
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: auto-GC band (0, 101): metric must be one of ...
        """
        if strategy is None:
            strategy = MEMLORD_DEFAULT_STRATEGY
        bands = _validate_strategy(strategy) if strategy else []
        with self._lock:
            self._auto_gc_strategy = dict(strategy)
            self._bands = bands
            self._ledger._slow = bool(bands)
        _debug(f"[set_auto_gc_strategy] installed {len(bands)} band(s)")

    def _device_memory_stats(self, dev: torch.device) -> tuple[Optional[int], Optional[int], float]:
        return get_device_mem_stats(dev)

    def _threshold(self, band: _Band, dev: torch.device) -> int:
        candidates = []
        if band.bytes is not None and band.bytes > 0:
            candidates.append(band.bytes)
        if band.percent is not None:
            total = self._device_memory_stats(dev)[0]
            if total:
                candidates.append(int(total * band.percent / 100.0))
        candidates = [c for c in candidates if c > 0]
        return min(candidates) if candidates else 0  # MemLord's rule: the smaller one

    def _maybe_auto_gc(self, dev: torch.device) -> None:
        _total, _used, pct = self._device_memory_stats(dev)
        band = next((b for b in self._bands if b.lo <= pct < b.hi), None)
        if band is None:
            return
        threshold = self._threshold(band, dev)
        if threshold <= 0:
            return
        with self._lock:
            self._drain_locked()
            a = self._allocated_by_dev.get(dev, 0)
            f = self._freed_by_dev.get(dev, 0)
        value = a if band.metric == "allocated" else f if band.metric == "freed" else max(a, f)
        if value < threshold:
            return
        if not _run_backend_gc(dev):
            return
        with self._lock:
            snap_alloc = dict(self._allocated_by_dev)
            snap_freed = dict(self._freed_by_dev)
            snap_runs = dict(self._gc_count_by_dev)
            devs = sorted(
                set(snap_alloc) | set(snap_freed),
                key=lambda d: (d.type, -1 if d.index is None else d.index),
            )
            for table in (self._allocated_by_dev, self._freed_by_dev):
                for d in table:
                    if d.type == dev.type:
                        table[d] = 0
            runs = self._gc_count_by_dev[dev] = self._gc_count_by_dev.get(dev, 0) + 1
            self._gc_total_count += 1
            total_runs = self._gc_total_count
        lines = [
            f"[auto_gc] {dev}: ran GC (dev_gc_runs={runs}, global_gc_runs={total_runs}); "
            f"band={band.lo:.0f}–{band.hi:.0f}% used≈{pct:.1f}%; metric={band.metric} "
            f"value={format_bytes(value)} threshold={format_bytes(threshold)}; "
            f"counters_reset_family={dev.type}"
        ]
        for d in devs:
            t_bytes, u_bytes, u_pct = self._device_memory_stats(d)
            tb = "unknown" if t_bytes is None else format_bytes(t_bytes)
            ub = "unknown" if u_bytes is None else format_bytes(u_bytes)
            lines.append(
                f"  - {d}: allocated={format_bytes(snap_alloc.get(d, 0))}, "
                f"freed={format_bytes(snap_freed.get(d, 0))}, "
                f"dev_gc_runs={snap_runs.get(d, 0) + (1 if d == dev else 0)}; "
                f"device_smi(total={tb}, used={ub}, used%={u_pct:.1f}%)"
            )
        _emit("\n".join(lines))  # always printed, DEBUG or not (as MemLord)

    # ------------------------------------------------------------------ hooks

    def hook_into_torch(self) -> TorchMoveHooks:
        """Count moves: ``Tensor.to``/``Module.to`` and the CUDA synchronize calls.

        A ``.to`` that returns a new tensor on another device, or with another dtype, counts the
        new storage; a device change also credits the source's bytes as freed on its device (at
        once, or at the next synchronize for a non-blocking CUDA-to-CUDA copy) -- once: the
        source's later death credits nothing more. Calling it again returns the same hooks.

        Example:
            >>> import torch
            >>> lord = MemLord({}); hooks = lord.hook_into_torch()
            >>> x = torch.zeros(100); y = x.to(torch.float16)   # a new 200-byte storage
            >>> lord.allocated()
            (200, '200 B')
            >>> hooks.disable()
        """
        h = self._torch_hooks
        if h is None:
            h = self._torch_hooks = TorchMoveHooks(self)
        h.enable()
        return h

    def hook_into_python(
        self, *, enable_factory_wrappers: bool = True, enable_deep_autowrap: bool = True
    ) -> SnakeHooks:
        """Count tensors as torch's factories (and ``Tensor.clone``) create them.

        ``enable_factory_wrappers`` wraps ``torch.empty``, ``zeros``, ``ones``, ``rand``,
        ``eye``, ``normal`` ... (MemLord's list); ``enable_deep_autowrap`` also wraps
        ``torch.Tensor.clone``. A call with ``out=`` counts nothing. Each storage's death
        credits its bytes as freed. Calling it again returns the same hooks, enabled.

        Example:
            >>> import torch, gc
            >>> lord = MemLord({}); hooks = lord.hook_into_python()
            >>> x = torch.empty(256); lord.allocated()
            (1024, '1 KiB')
            >>> del x; lord.freed()
            (1024, '1 KiB')
            >>> hooks.disable()
        """
        h = self._snake_hooks
        if h is None:
            h = self._snake_hooks = SnakeHooks(
                self,
                enable_factory_wrappers=enable_factory_wrappers,
                enable_deep_autowrap=enable_deep_autowrap,
            )
        h.enable()
        return h

    def _hook_allocate(self, tensors: list[torch.Tensor]) -> None:
        """A hook saw new tensors: count them, log ``[allocate] [hook]`` and check the bands."""
        site = user_site() if self._ledger._track else None
        batch = self._count([t for t in tensors if t.device.type != "meta"], site)
        self._after(batch, "[allocate] [hook] +")

    def _hook_free(self, found: list[_Entry]) -> None:
        """A move's source (its entries, see :meth:`_entries_of`): credit it as freed."""
        site = user_site() if self._ledger._track else None
        self._after(self._credit_entries(found, site), "[free] [hook] -")

    def __repr__(self) -> str:
        a, f = self.allocated()[1], self.freed()[1]
        return f"MemLord(allocated={a}, freed={f}, bands={len(self._bands)})"


# ----------------------------------------------------------------------------- shared patches
#
# Each torch function is patched once per process however many MemLords hook in; the wrapper
# calls every enabled hooks object (held weakly, so a forgotten MemLord stops counting when it
# dies) and the originals come back when the last one is disabled.

_patch_lock = threading.RLock()
_originals: dict[tuple[Any, str], Any] = {}
_snake_registry: tuple[weakref.ref[SnakeHooks], ...] = ()  # every enabled SnakeHooks
_snakes: tuple[weakref.ref[SnakeHooks], ...] = ()  # those wrapping factories
_clone_snakes: tuple[weakref.ref[SnakeHooks], ...] = ()  # those wrapping Tensor.clone
_sinks: tuple[Callable[[torch.Tensor], None], ...] = ()  # their fast paths (SnakeHooks._sink)
_clone_sinks: tuple[Callable[[torch.Tensor], None], ...] = ()
_movers: tuple[weakref.ref[TorchMoveHooks], ...] = ()  # every enabled TorchMoveHooks
_TLS = threading.local()


def _has_out(kwargs: dict[str, Any]) -> bool:
    out = kwargs.get("out")
    if out is None:
        return False
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in out)


def _new_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


def _factory_wrapper(fn: Callable[..., Any], clone: bool) -> Callable[..., Any]:
    tensor_type = torch.Tensor

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        sinks = _clone_sinks if clone else _sinks
        if sinks and not (kwargs and _has_out(kwargs)):
            if type(out) is tensor_type:  # the common case, kept short
                for sink in sinks:
                    sink(out)
                return out
            refs = _clone_snakes if clone else _snakes
            tensors = _new_tensors(out)
            if tensors:
                for r in refs:
                    h = r()
                    if h is not None:
                        h._created(tensors)
        return out

    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(wrapper, attr, getattr(fn, attr))
        except (AttributeError, TypeError):
            pass
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    key = (owner, name)
    if key in _originals or not hasattr(owner, name):
        return
    orig = getattr(owner, name)
    _originals[key] = orig
    setattr(owner, name, make(orig))


def _unpatch(keep: Callable[[tuple[Any, str]], bool]) -> None:
    for key in [k for k in _originals if not keep(k)]:
        setattr(key[0], key[1], _originals.pop(key))


def _refresh_patches() -> None:
    """Install the patches enabled hooks need, and restore the originals no hooks need."""
    global _snake_registry, _snakes, _movers, _clone_snakes, _sinks, _clone_sinks
    with _patch_lock:
        snakes = [r for r in _snake_registry if (h := r()) is not None and h._enabled]
        movers = [r for r in _movers if (m := r()) is not None and m._enabled]
        _snake_registry = tuple(snakes)
        _snakes = tuple(r for r in snakes if (h := r()) is not None and h._wrap_factories)
        _clone_snakes = tuple(r for r in snakes if (h := r()) is not None and h._deep_autowrap)
        _sinks = tuple(h._sink for r in _snakes if (h := r()) is not None)
        _clone_sinks = tuple(h._sink for r in _clone_snakes if (h := r()) is not None)
        _movers = tuple(movers)
        if _snakes:
            for name in _FACTORIES:
                _patch(torch, name, lambda f: _factory_wrapper(f, False))
        if _clone_snakes:
            _patch(torch.Tensor, "clone", lambda f: _factory_wrapper(f, True))
            _patch(torch, "clone", lambda f: _factory_wrapper(f, True))
        if _movers:
            _patch(torch.Tensor, "to", _tensor_to_wrapper)
            _patch(torch.nn.Module, "to", _module_to_wrapper)
            cuda = torch.cuda
            _patch(cuda, "synchronize", _sync_wrapper)
            for cls_name in ("Stream", "Event"):
                cls = getattr(cuda, cls_name, None)
                if cls is not None:
                    _patch(cls, "synchronize", _sync_wrapper)

        def keep(key: tuple[Any, str]) -> bool:
            owner, name = key
            if name == "clone":
                return bool(_clone_snakes)
            if owner is torch and name in _FACTORIES:
                return bool(_snakes)
            return bool(_movers)

        _unpatch(keep)


def _forget(_ref: Any) -> None:
    # a hooks object died without being disabled: drop it and maybe restore torch
    try:
        _refresh_patches()
    except Exception:  # during interpreter shutdown
        pass


def _tensor_to_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = orig(t, *args, **kwargs)
        if out is not t and _movers and isinstance(out, torch.Tensor):
            if "non_blocking" in kwargs:
                nb = bool(kwargs["non_blocking"])
            else:
                nb = bool(getattr(_TLS, "module_non_blocking", False))
            for r in _movers:
                m = r()
                if m is not None:
                    m._moved(t, out, nb)
        return out

    to.__name__, to.__qualname__, to.__doc__ = "to", "Tensor.to", orig.__doc__
    return to


def _module_to_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def to(m: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        old = getattr(_TLS, "module_non_blocking", None)
        _TLS.module_non_blocking = bool(kwargs.get("non_blocking", False))
        try:
            return orig(m, *args, **kwargs)
        finally:
            _TLS.module_non_blocking = old

    to.__name__, to.__qualname__, to.__doc__ = "to", "Module.to", orig.__doc__
    return to


def _sync_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def synchronize(*args: Any, **kwargs: Any) -> Any:
        res = orig(*args, **kwargs)
        for r in _movers:
            m = r()
            if m is not None:
                m.poll()
        return res

    synchronize.__name__ = "synchronize"
    synchronize.__doc__ = orig.__doc__
    return synchronize


class _Hooks:
    """What both hook kinds share: one MemLord (weakly), an on/off state, the shared patches."""

    _registry_name = ""  # the module-level tuple of enabled hooks of this kind

    def __init__(self, lord: MemLord) -> None:
        self._lord_ref = weakref.ref(lord)
        self._enabled = False
        self._ref = weakref.ref(self, _forget)

    @property
    def enabled(self) -> bool:
        """Whether these hooks count now.

        Example:
            >>> h = MemLord({}).hook_into_python(); on = h.enabled; h.disable(); on, h.enabled
            (True, False)
        """
        return self._enabled

    def enable(self) -> None:
        """Start counting (idempotent); torch is patched while any MemLord's hooks are enabled.

        Example:
            >>> import torch
            >>> h = MemLord({}).hook_into_torch(); h.enable(); h.disable(); h.enabled
            False
        """
        with _patch_lock:
            if self._enabled:
                return
            self._enabled = True
            globals()[self._registry_name] += (self._ref,)
            _refresh_patches()

    def disable(self) -> None:
        """Stop counting (idempotent); storages counted so far still credit their deaths.

        Example:
            >>> h = MemLord({}).hook_into_python(); h.disable(); h.disable(); h.enabled
            False
        """
        with _patch_lock:
            if not self._enabled:
                return
            self._enabled = False
            _refresh_patches()


class SnakeHooks(_Hooks):
    """What :meth:`MemLord.hook_into_python` returns: factory wrappers feeding one MemLord.

    ``enable()``/``disable()`` are idempotent; torch's originals come back when no MemLord's
    hooks are enabled any more.

    Example:
        >>> import torch
        >>> lord = MemLord({}); hooks = lord.hook_into_python(enable_deep_autowrap=False)
        >>> x = torch.ones(10); y = x.clone(); lord.allocated()   # clone is not wrapped
        (40, '40 B')
        >>> hooks.disable(); hooks.enabled
        False
    """

    _registry_name = "_snake_registry"

    def __init__(
        self, lord: MemLord, enable_factory_wrappers: bool = True, enable_deep_autowrap: bool = True
    ) -> None:
        super().__init__(lord)
        self._sink = lord._ledger.make_sink(lord)
        self._wrap_factories = bool(enable_factory_wrappers)
        self._deep_autowrap = bool(enable_deep_autowrap)

    def register(self, ob: Any) -> None:
        """Count a tensor or module now, as if a wrapped factory had created it.

        Example:
            >>> import torch
            >>> lord = MemLord({}); h = lord.hook_into_python(enable_factory_wrappers=False)
            >>> m = torch.nn.Linear(2, 2); lord.allocated()[0]
            0
            >>> h.register(m); lord.allocated()[0]
            24
            >>> h.disable()
        """
        lord = self._lord_ref()
        if lord is not None:
            lord._hook_allocate(_tensors(ob))

    def _created(self, tensors: list[torch.Tensor]) -> None:
        lord = self._lord_ref()
        if lord is not None and self._enabled:
            lord._hook_allocate(tensors)


class TorchMoveHooks(_Hooks):
    """What :meth:`MemLord.hook_into_torch` returns: ``.to`` and synchronize hooks for one MemLord.

    A non-blocking CUDA-to-CUDA move credits its source when an event recorded after the copy
    has completed, checked at the next ``synchronize`` (torch.cuda, Stream or Event), the next
    move, :meth:`poll` or :meth:`disable`.

    Example:
        >>> import torch
        >>> lord = MemLord({}); hooks = lord.hook_into_torch()
        >>> m = torch.nn.Linear(4, 4).to(torch.float64)    # 160 new bytes counted
        >>> lord.allocated()
        (160, '160 B')
        >>> hooks.disable(); hooks.enabled
        False
    """

    _registry_name = "_movers"

    def __init__(self, lord: MemLord) -> None:
        super().__init__(lord)
        self._pending: list[tuple[Any, list[_Entry]]] = []
        self._pending_lock = threading.Lock()

    def enable(self) -> None:
        """Start counting moves (idempotent).

        Example:
            >>> h = MemLord({}).hook_into_torch(); h.enable(); h.disable()
        """
        super().enable()
        _debug("[hooks] Patched: Tensor.to, Module.to, cuda.synchronize, Stream.synchronize, "
               "Event.synchronize")

    def disable(self) -> None:
        """Stop counting moves (idempotent); pending deferred frees are credited.

        Example:
            >>> h = MemLord({}).hook_into_torch(); h.disable(); h.disable()
        """
        was = self._enabled
        super().disable()
        self._flush(force=True)
        if was:
            _debug("[hooks] Restored patches")

    def poll(self) -> None:
        """Credit the deferred frees whose copies have completed.

        Example:
            >>> MemLord({}).hook_into_torch().poll()
        """
        self._flush(force=False)

    def _flush(self, force: bool) -> None:
        with self._pending_lock:
            if not self._pending:
                return
            done: list[_Entry] = []
            waiting = []
            for ev, found in self._pending:
                if force or ev.query():
                    done.extend(found)
                else:
                    waiting.append((ev, found))
            self._pending = waiting
        lord = self._lord_ref()
        if lord is not None and done:
            lord._hook_free(done)

    def _moved(self, src: torch.Tensor, out: torch.Tensor, non_blocking: bool) -> None:
        lord = self._lord_ref()
        if lord is None or not self._enabled:
            return
        moved = out.device != src.device
        if moved or out.dtype != src.dtype:
            lord._hook_allocate([out])
        deferred = False
        if moved and src.device.type != "meta":
            site = user_site() if lord._ledger._track else None
            found = lord._entries_of([src], site, True)
            if (
                non_blocking
                and src.device.type == "cuda"
                and out.device.type == "cuda"
                and torch.cuda.is_available()
            ):
                with torch.cuda.device(out.device):
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(out.device))
                with self._pending_lock:
                    self._pending.append((ev, found))
                deferred = True
            else:
                lord._hook_free(found)
        if not deferred:
            self.poll()
