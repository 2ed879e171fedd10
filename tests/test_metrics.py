"""Per-device metrics dict and the Prometheus endpoint, scraped over loopback."""

from __future__ import annotations

import socket
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from torchmem import Ledger
from torchmem.devices import DeviceUsage
from torchmem.errors import InvalidInputError
from torchmem.ledger import ledger_metrics, serve_prometheus


class Fixed:
    def usage(self, device: str) -> DeviceUsage | None:
        return DeviceUsage(device, total=8000, used=2000, process=123) if device == "cpu" else None


def _scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:  # bounded: never hangs the suite
        body = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            out[(sample.name, sample.labels.get("device", ""))] = sample.value
    return out


def test_metrics_dict_matches_records() -> None:
    led = Ledger()
    a, b = torch.zeros(100), torch.zeros(10, device="meta")
    led.allocate([a, b])
    led.free(a)
    m = ledger_metrics(led, Fixed())
    assert m["cpu"]["allocated_bytes"] == 0 and m["cpu"]["freed_bytes"] == 400
    assert m["cpu"]["peak_bytes"] == 400 and m["cpu"]["frees"] == 1
    assert m["meta"]["allocated_bytes"] == 40 and m["meta"]["live_storages"] == 1
    assert (m["cpu"]["device_total_bytes"], m["cpu"]["device_used_percent"]) == (8000, 25.0)
    assert m["cpu"]["device_process_bytes"] == 123
    assert "device_total_bytes" not in m["meta"]  # the source knows nothing about meta
    assert led.metrics() == ledger_metrics(led)
    with pytest.raises(InvalidInputError, match="expected a torchmem.Ledger"):
        ledger_metrics(object())


def test_prometheus_endpoint_on_loopback_random_port() -> None:
    led = Ledger()
    x = torch.zeros(256)
    led.allocate(x)
    with serve_prometheus(led, port=0, usage=Fixed()) as srv:
        assert srv.addr == "127.0.0.1" and srv.port > 0
        got = _scrape(srv.url)
        assert got[("torchmem_ledger_allocated_bytes", "cpu")] == 1024
        assert got[("torchmem_ledger_allocations_total", "cpu")] == 1
        assert got[("torchmem_device_used_percent", "cpu")] == 25.0
        del x  # the figures are read at scrape time
        got = _scrape(srv.url)
        assert got[("torchmem_ledger_allocated_bytes", "cpu")] == 0
        assert got[("torchmem_ledger_freed_bytes_total", "cpu")] == 1024
        assert got[("torchmem_ledger_freed_since_gc_bytes", "cpu")] == 1024
        assert got[("torchmem_ledger_auto_frees_total", "cpu")] == 1
        port = srv.port
    # closed: the port no longer accepts connections
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_prometheus_bad_port() -> None:
    with pytest.raises(InvalidInputError, match="port must be an int"):
        serve_prometheus(Ledger(), port=70000)
