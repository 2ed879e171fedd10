"""The banded auto-GC policy: collect and release a device's cache when its figures cross a band.

A strategy, in MemLord's format, maps bands of a device's used percent to a rule:
``{(lo_pct, hi_pct): {"metric": "allocated" | "freed" | "max", "threshold": {"bytes": int,
"percent": float}}}``. After each allocate, free or capture that touches a device, the ledger
reads the device's usage from a usage source (:mod:`torchmem.devices`), picks the band holding
its used percent, and when the metric reaches the band's threshold runs ``gc.collect()`` and
:func:`~torchmem.ledger.release.release_device_cache`, then resets that device's ``freed``
counter and records a :class:`GcRun`.

Choices that differ from MemLord:

* a threshold with both ``bytes`` and ``percent`` resolves to the *larger* of the two (the
  behaviour MemLord's README documents): both limits must be crossed before a band triggers;
* ``auto_gc_strategy=None`` means *no* auto-GC (MemLord installs default bands); pass
  :data:`DEFAULT_AUTO_GC_STRATEGY` to get MemLord-like bands.

The policy's methods are mixed into :class:`~torchmem.ledger.accounting.Ledger`.

Example:
    >>> from torchmem.devices import DeviceUsage
    >>> from torchmem.ledger import Ledger
    >>> class Full:
    ...     def usage(self, device):
    ...         return DeviceUsage(device, total=10_000, used=9_500)
    >>> led = Ledger({(90, 101): {"metric": "freed", "threshold": {"bytes": 4000}}},
    ...              usage_source=Full(), gc_min_interval=0)
    >>> import torch
    >>> x = torch.zeros(1000); _ = led.allocate(x); _ = led.free(x)   # 4000 bytes freed
    >>> run = led.gc_history[-1]; run.metric, run.value, led.freed()
    ('freed', 4000, (0, '0 B'))
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from torchmem._device import device_name, device_selector
from torchmem._log import get_logger
from torchmem.devices import DeviceUsage, UsagePoller, UsageSource
from torchmem.errors import InvalidInputError
from torchmem.ledger.records import DeviceLike, _Stats
from torchmem.ledger.release import release_device_cache
from torchmem.ledger.storages import Pair
from torchmem.units import format_bytes, parse_bytes

__all__ = ["DEFAULT_AUTO_GC_STRATEGY", "GcRun"]

log = get_logger("ledger")

#: MemLord-like bands: thresholds scale with capacity and tighten as the device fills.
DEFAULT_AUTO_GC_STRATEGY: dict[tuple[float, float], dict[str, Any]] = {
    (0, 50): {"metric": "max", "threshold": {"percent": 50.0}},
    (50, 75): {"metric": "max", "threshold": {"percent": 33.0}},
    (75, 101): {"metric": "max", "threshold": {"percent": 25.0}},
}

_METRICS = ("allocated", "freed", "max")


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


class _Band:
    """One band of a strategy: ``lo <= used% < hi``, its metric and its threshold."""

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


class _AutoGc:
    """The ledger's auto-GC methods and state; the figures they read are the ledger's."""

    _lock: threading.Lock
    _pending: collections.deque[Any]
    _stats: dict[str, _Stats]
    _names: dict[torch.device, str]

    if TYPE_CHECKING:

        def _drain_locked(self) -> set[str]: ...

    def _init_auto_gc(
        self, usage_source: Optional[UsageSource], poll_interval: float, gc_min_interval: float
    ) -> None:
        if usage_source is not None and not callable(getattr(usage_source, "usage", None)):
            raise InvalidInputError(
                "usage_source must have a usage(device) -> DeviceUsage | None method, got "
                f"{type(usage_source).__name__}; pass a torchmem.UsagePoller or your own object"
            )
        if (
            isinstance(gc_min_interval, bool)
            or not isinstance(gc_min_interval, (int, float))
            or gc_min_interval < 0
        ):
            raise InvalidInputError(
                f"gc_min_interval must be a number of seconds >= 0, got {gc_min_interval!r}"
            )
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

    def _clear_auto_gc_locked(self) -> None:
        self._last_gc.clear()
        self.gc_history.clear()
        self._gc_suppressed = 0

    def _close_poller(self) -> None:
        with self._lock:
            poller, self._own_poller = self._own_poller, None
        if poller is not None:
            poller.close()

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
        (:func:`~torchmem.ledger.release.release_device_cache`), resets that device's ``freed``
        counter only, logs the run and counts it
        (:attr:`~torchmem.ledger.records.LedgerRecord.gc_runs`, :attr:`gc_history`). Runs on one
        device are at least :attr:`gc_min_interval` seconds apart. ``device=None`` sets the default for all
        devices; a device (``"cuda:1"``) overrides it for that index only. ``None``/``{}``
        removes the policy.

        Example:
            >>> from torchmem.ledger import Ledger
            >>> led = Ledger()
            >>> led.set_auto_gc_strategy(
            ...     {(0, 101): {"metric": "freed", "threshold": {"bytes": "1 GiB"}}})
            >>> led.set_auto_gc_strategy(
            ...     {(90, 101): {"metric": "max", "threshold": {"percent": 5}}}, "cuda:1")
            >>> led.set_auto_gc_strategy({(0, 50): {"metric": "mean", "threshold": {"bytes": 1}}})
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: auto-GC band (0, 50): metric must be one of ...
        """
        bands = _validate_strategy(strategy) if strategy else []
        with self._lock:
            if device is None:
                self._default_bands = bands
            else:
                name = device_selector(device)
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

    def _check_devices(self, storages: list[Pair], touched: Optional[set[str]]) -> None:
        names = {
            dev or self._names.get(st.device) or device_name(st.device) for st, dev in storages
        }
        if touched:
            names |= touched
        for name in names:
            self.maybe_auto_gc(name)

    def maybe_auto_gc(self, device: DeviceLike) -> Optional[GcRun]:
        """Evaluate the policy for one device now; run the GC if it triggers; return the run.

        Called automatically after each allocate/free/capture that touches the device.

        Example:
            >>> from torchmem.ledger import Ledger
            >>> Ledger().maybe_auto_gc("cpu") is None    # no policy installed
            True
        """
        name = device_selector(device)
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
            >>> from torchmem.ledger import Ledger
            >>> Ledger().gc_suppressed
            0
        """
        return self._gc_suppressed
