"""Ledger and device figures for monitoring: a per-device dict and a Prometheus endpoint.

:func:`ledger_metrics` returns plain ints per device (no torch objects), ready for JSON or any
monitoring client. :func:`serve_prometheus` exposes the same figures over HTTP in Prometheus'
text format (optional extra ``torchmem[prometheus]``, i.e. ``prometheus-client``), from a private
registry, on loopback by default.

Metric names (label ``device``): ``torchmem_ledger_allocated_bytes``,
``torchmem_ledger_peak_bytes``, ``torchmem_ledger_freed_since_gc_bytes`` (since the last
auto-GC run on the device), ``torchmem_ledger_live_storages`` (gauges);
``torchmem_ledger_freed_bytes``, ``torchmem_ledger_allocations``, ``torchmem_ledger_frees``,
``torchmem_ledger_auto_frees``, ``torchmem_ledger_gc_runs`` (counters, scraped with the
``_total`` suffix, e.g. ``torchmem_ledger_freed_bytes_total``); and, when a usage
source is given, ``torchmem_device_total_bytes``, ``torchmem_device_used_bytes``,
``torchmem_device_used_percent`` and ``torchmem_device_process_bytes``.

Example:
    >>> import torch
    >>> from torchmem import Ledger
    >>> led = Ledger(); x = torch.zeros(256); _ = led.allocate(x)
    >>> m = ledger_metrics(led)
    >>> m["cpu"]["allocated_bytes"], m["cpu"]["live_storages"]
    (1024, 1)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Optional

from torchmem.devices import UsageSource
from torchmem.errors import InvalidInputError

__all__ = ["ledger_metrics", "serve_prometheus", "MetricsServer", "LEDGER_FIELDS"]

#: ledger field -> (metric suffix, kind, help)
LEDGER_FIELDS: dict[str, tuple[str, str, str]] = {
    "allocated": ("allocated_bytes", "gauge", "Bytes of counted storages alive now"),
    "peak": ("peak_bytes", "gauge", "Highest allocated bytes seen"),
    "freed": ("freed_since_gc_bytes", "gauge", "Bytes freed since the last auto-GC run on the device"),
    "live_storages": ("live_storages", "gauge", "Counted storages alive now"),
    "freed_total": ("freed_bytes", "counter", "Bytes freed since creation or reset"),
    "allocations": ("allocations", "counter", "Storages counted"),
    "frees": ("frees", "counter", "Storages freed (explicit and automatic)"),
    "auto_frees": ("auto_frees", "counter", "Storages freed by their death"),
    "gc_runs": ("gc_runs", "counter", "Auto-GC runs"),
}
_USAGE_FIELDS = {
    "total": ("total_bytes", "Device capacity in bytes"),
    "used": ("used_bytes", "Device bytes in use (all processes)"),
    "used_pct": ("used_percent", "Device used percent"),
    "process": ("process_bytes", "This process's bytes on the device, where known"),
}


def ledger_metrics(ledger: Any, usage: Optional[UsageSource] = None) -> dict[str, dict[str, Any]]:
    """Per device: the ledger's figures (``allocated_bytes``, ``peak_bytes``, ...) and usage.

    Keys are the metric names without the ``torchmem_ledger_`` prefix (see the module
    docstring); ``freed_bytes`` is cumulative. With ``usage`` (a usage source such as
    :class:`~torchmem.UsagePoller`), every device the ledger saw, plus ``cpu``, also gets
    ``device_total_bytes``, ``device_used_bytes``, ``device_used_percent`` and
    ``device_process_bytes`` when the source knows the device.

    Example:
        >>> from torchmem import Ledger
        >>> from torchmem.devices import DeviceUsage
        >>> class Fixed:
        ...     def usage(self, device):
        ...         return DeviceUsage(device, total=1000, used=250) if device == "cpu" else None
        >>> ledger_metrics(Ledger(), Fixed())["cpu"]["device_used_percent"]
        25.0
    """
    if not callable(getattr(ledger, "records", None)):
        raise InvalidInputError(
            f"ledger_metrics expected a torchmem.Ledger, got {type(ledger).__name__}"
        )
    out: dict[str, dict[str, Any]] = {}
    for name, rec in ledger.records().items():
        out[name] = {suffix: getattr(rec, field) for field, (suffix, _, _) in LEDGER_FIELDS.items()}
    if usage is not None:
        for name in sorted(set(out) | {"cpu"}):
            try:
                u = usage.usage(name)
            except Exception:
                u = None
            if u is None:
                continue
            row = out.setdefault(
                name, {suffix: 0 for suffix, _, _ in LEDGER_FIELDS.values()}
            )
            row["device_total_bytes"] = u.total
            row["device_used_bytes"] = u.used
            row["device_used_percent"] = round(u.used_pct, 3)
            row["device_process_bytes"] = u.process
    return out


class _Collector:
    """A prometheus-client custom collector reading the ledger at scrape time."""

    def __init__(self, ledger: Any, usage: Optional[UsageSource], prefix: str) -> None:
        self.ledger = ledger
        self.usage = usage
        self.prefix = prefix

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are produced at scrape time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rows = ledger_metrics(self.ledger, self.usage)
        for suffix, kind, help_ in LEDGER_FIELDS.values():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(f"{self.prefix}_ledger_{suffix}", help_, labels=["device"])
            for dev, row in sorted(rows.items()):
                fam.add_metric([dev], float(row[suffix]))
            yield fam
        for suffix, help_ in _USAGE_FIELDS.values():
            fam = GaugeMetricFamily(f"{self.prefix}_device_{suffix}", help_, labels=["device"])
            for dev, row in sorted(rows.items()):
                v = row.get(f"device_{suffix}")
                if v is not None:
                    fam.add_metric([dev], float(v))
            yield fam


class MetricsServer:
    """A running Prometheus endpoint (see :func:`serve_prometheus`); ``close()`` stops it.

    Example:
        >>> from torchmem import Ledger
        >>> with serve_prometheus(Ledger(), port=0) as srv:
        ...     srv.url.startswith("http://127.0.0.1:") and srv.port > 0
        True
    """

    def __init__(self, server: Any, thread: threading.Thread, registry: Any, addr: str) -> None:
        self._server = server
        self._thread = thread
        self.registry = registry
        self.addr = addr
        self.port = int(server.server_port)
        self._closed = False

    @property
    def url(self) -> str:
        """The scrape URL, e.g. ``http://127.0.0.1:9464/metrics``.

        Example:
            >>> from torchmem import Ledger
            >>> with serve_prometheus(Ledger()) as srv:
            ...     srv.url.endswith("/metrics")
            True
        """
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and join the server thread (idempotent).

        Example:
            >>> from torchmem import Ledger
            >>> srv = serve_prometheus(Ledger()); srv.close(); srv.close()
        """
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_prometheus(
    ledger: Any,
    port: int = 0,
    addr: str = "127.0.0.1",
    *,
    usage: Optional[UsageSource] = None,
    prefix: str = "torchmem",
) -> MetricsServer:
    """Serve the ledger's figures (and device usage, if ``usage`` is given) for Prometheus.

    ``port=0`` picks a free port (read it back from :attr:`MetricsServer.port`). Binds to
    loopback unless ``addr`` says otherwise. Uses a private registry, so nothing is added to
    prometheus-client's global one. Needs the optional extra ``torchmem[prometheus]``.

    Example:
        >>> import urllib.request
        >>> from torchmem import Ledger
        >>> led = Ledger()
        >>> with serve_prometheus(led) as srv:
        ...     body = urllib.request.urlopen(srv.url, timeout=5).read().decode()
        >>> "torchmem_ledger_allocated_bytes" in body
        True
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise InvalidInputError(
            "serve_prometheus needs prometheus-client; install it with "
            "`pip install 'torchmem[prometheus]'`"
        ) from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInputError(f"port must be an int in [0, 65535] (0 = any free port), got {port!r}")
    if not prefix.replace("_", "").isalnum():
        raise InvalidInputError(f"prefix must be letters, digits and underscores, got {prefix!r}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(ledger, usage, prefix))  # type: ignore[arg-type]
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread, registry, addr)
