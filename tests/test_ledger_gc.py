"""Banded auto-GC driven by an injected usage source, the real psutil poller, and logging."""

from __future__ import annotations

import gc
import io
import logging
import os
import platform
import subprocess
import sys
import threading

import psutil
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchmem
from torchmem import Ledger
from torchmem._log import ColorFormatter, debug_requested, remove_debug_logging, setup_debug_logging
from torchmem.devices import DeviceUsage
from torchmem.errors import InvalidInputError


class FixedUsage:
    """A real usage source for tests: readings set by the test, per device."""

    def __init__(self, **pct: float) -> None:
        self.total = 10_000
        self.pct = {k.replace("_", ":"): v for k, v in pct.items()}
        self.calls = 0

    def set(self, device: str, pct: float) -> None:
        self.pct[device] = pct

    def usage(self, device: str) -> DeviceUsage | None:
        self.calls += 1
        if device not in self.pct:
            return None
        return DeviceUsage(device, self.total, int(self.total * self.pct[device] / 100), source="test")


def fake_cuda(n: int, index: int) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(n, dtype=torch.uint8, device=f"cuda:{index}")


def test_band_chosen_by_used_percent_and_only_that_device_reset() -> None:
    src = FixedUsage(cuda_0=30.0, cuda_1=30.0)
    strategy = {
        (0, 50): {"metric": "freed", "threshold": {"bytes": 1000}},
        (50, 101): {"metric": "freed", "threshold": {"bytes": 100}},
    }
    led = Ledger(strategy, usage_source=src, gc_min_interval=0)
    a0, b0 = fake_cuda(500, 0), fake_cuda(500, 0)
    a1 = fake_cuda(300, 1)
    led.allocate([a0, b0, a1])
    led.free(a0)  # freed 500 < 1000 in the low band
    led.free(a1)  # cuda:1 freed 300
    assert led.record("cuda:0").gc_runs == 0 and led.freed("cuda:0")[0] == 500
    src.set("cuda:0", 60.0)  # the device fills up: the tight band applies
    led.free(b0)  # freed 1000 >= 100: GC on cuda:0
    r0, r1 = led.record("cuda:0"), led.record("cuda:1")
    assert (r0.gc_runs, r0.freed, r0.freed_total) == (1, 0, 1000)
    assert (r1.gc_runs, r1.freed) == (0, 300)  # the other index is untouched
    run = led.gc_history[-1]
    assert (run.device, run.metric, run.value, run.threshold, run.band) == (
        "cuda:0", "freed", 1000, 100, (50.0, 101.0)
    )
    assert run.used_pct == 60.0
    assert run.released == "none"  # CUDA never initialised here: nothing to release


def test_bytes_and_percent_combine_as_max() -> None:
    src = FixedUsage(cuda_0=10.0)  # total 10_000 bytes
    # percent 10 -> 1000 bytes, bytes 100: the threshold is the larger, 1000
    led = Ledger(
        {(0, 101): {"metric": "allocated", "threshold": {"bytes": 100, "percent": 10.0}}},
        usage_source=src, gc_min_interval=0,
    )
    keep = [fake_cuda(400, 0)]
    led.allocate(keep)  # 400: above 100 (min would trigger) but below 1000
    assert led.record("cuda:0").gc_runs == 0
    keep.append(fake_cuda(600, 0))
    led.allocate(keep)  # 1000 >= max(100, 1000)
    assert led.record("cuda:0").gc_runs == 1
    assert led.gc_history[-1].threshold == 1000
    # the other way round: bytes larger than percent
    led.set_auto_gc_strategy({(0, 101): {"metric": "allocated", "threshold": {"bytes": 5000, "percent": 10}}})
    keep.append(fake_cuda(3000, 0))
    led.allocate(keep)  # 4000 < 5000
    assert led.record("cuda:0").gc_runs == 1
    keep.append(fake_cuda(1000, 0))
    led.allocate(keep)  # 5000
    assert led.record("cuda:0").gc_runs == 2 and led.gc_history[-1].threshold == 5000


def test_metric_max_and_rate_limit() -> None:
    src = FixedUsage(cuda_0=80.0)
    led = Ledger(
        {(75, 101): {"metric": "max", "threshold": {"percent": 5.0}}},  # 500 bytes
        usage_source=src, gc_min_interval=3600.0,
    )
    x = fake_cuda(600, 0)
    led.allocate(x)  # max(600 allocated, 0 freed) >= 500
    assert led.record("cuda:0").gc_runs == 1
    y = fake_cuda(700, 0)
    led.allocate(y)  # crosses again, but within the minimum interval
    assert led.record("cuda:0").gc_runs == 1 and led.gc_suppressed == 1
    led.gc_min_interval = 0.0
    led.allocate(fake_cuda(1, 0))  # dies at once; the allocate still re-evaluates
    assert led.record("cuda:0").gc_runs == 2
    src.set("cuda:0", 50.0)  # no band for 50%
    led.allocate(fake_cuda(5000, 0))
    assert led.record("cuda:0").gc_runs == 2


def test_per_device_override() -> None:
    src = FixedUsage(cuda_0=90.0, cuda_1=90.0)
    led = Ledger(usage_source=src, gc_min_interval=0)
    led.set_auto_gc_strategy({(0, 101): {"metric": "allocated", "threshold": {"bytes": 10}}}, "cuda:1")
    keep = [fake_cuda(100, 0), fake_cuda(100, 1)]
    led.allocate(keep)
    assert led.record("cuda:0").gc_runs == 0 and led.record("cuda:1").gc_runs == 1
    led.set_auto_gc_strategy(None, "cuda:1")
    led.allocate(fake_cuda(100, 1))
    assert led.record("cuda:1").gc_runs == 1


def test_trigger_collects_cycles_and_trims_cpu_heap(caplog: pytest.LogCaptureFixture) -> None:
    src = FixedUsage(cpu=95.0)
    led = Ledger({(90, 101): {"metric": "allocated", "threshold": {"bytes": 40_000}}},
                 usage_source=src, gc_min_interval=0)

    class Node:
        pass

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        n = Node()
        n.self = n  # a reference cycle holding a tensor
        n.t = torch.zeros(5000)  # 20 kB
        ref = torchmem.capture.storage_ref(n.t)
        led.allocate(n.t)
        del n
        assert ref() is not None and led.allocated("cpu")[0] == 20_000  # stuck in the cycle
        with caplog.at_level(logging.INFO, logger="torchmem.ledger"):
            big = torch.zeros(5000)
            led.allocate(big)  # 40 kB allocated -> trigger: gc.collect() breaks the cycle
        assert ref() is None
        r = led.record("cpu")
        assert r.gc_runs == 1 and r.allocated == 20_000 and r.auto_frees == 1
        run = led.gc_history[-1]
        assert run.collected >= 2
        glibc = platform.libc_ver()[0] == "glibc"
        assert run.released == ("malloc_trim" if glibc else "none")
        assert any("[auto_gc] cpu: allocated" in m for m in caplog.messages)
    finally:
        if was_enabled:
            gc.enable()


def test_real_psutil_poller_drives_auto_gc() -> None:
    # No injected source: the ledger starts its own background poller (psutil) on first need.
    led = Ledger({(0, 101): {"metric": "freed", "threshold": {"bytes": 1}}}, poll_interval=0.05,
                 gc_min_interval=0)
    names = lambda: {t.name for t in threading.enumerate()}  # noqa: E731
    x = torch.zeros(10)
    led.allocate(x)  # evaluates the policy: the poller starts
    assert "torchmem-usage-cpu" in names()
    led.free(x)
    run = led.gc_history[-1]
    vm = psutil.virtual_memory()
    assert run.device == "cpu" and run.value == 40
    assert abs(run.used_pct - 100.0 * (vm.total - vm.available) / vm.total) < 10.0
    led.close()
    assert "torchmem-usage-cpu" not in names()


def test_strategy_validation_messages() -> None:
    led = Ledger()
    with pytest.raises(InvalidInputError, match="overlap"):
        led.set_auto_gc_strategy({
            (0, 60): {"metric": "max", "threshold": {"percent": 10}},
            (50, 101): {"metric": "max", "threshold": {"percent": 10}},
        })
    with pytest.raises(InvalidInputError, match="'bytes' and/or 'percent'"):
        led.set_auto_gc_strategy({(0, 101): {"metric": "max", "threshold": {}}})
    with pytest.raises(InvalidInputError, match=r"\(lo_pct, hi_pct\)"):
        led.set_auto_gc_strategy({(50, 10): {"metric": "max", "threshold": {"percent": 10}}})
    with pytest.raises(InvalidInputError, match="percent must be a number in"):
        led.set_auto_gc_strategy({(0, 10): {"metric": "max", "threshold": {"percent": 150}}})
    with pytest.raises(InvalidInputError, match="usage_source must have"):
        Ledger(usage_source=object())  # type: ignore[arg-type]
    # MemLord-like defaults validate and human sizes parse
    led.set_auto_gc_strategy(torchmem.ledger.DEFAULT_AUTO_GC_STRATEGY)
    led.set_auto_gc_strategy({(85, 101): {"metric": "freed", "threshold": {"bytes": "256 MiB"}}})


# ------------------------------------------------------------------------------- logging


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_debug_env_switches_and_colour() -> None:
    assert debug_requested({"TORCHMEM_DEBUG": "1"}) and debug_requested({"DEBUG": "1"})
    assert not debug_requested({"DEBUG": "0", "TORCHMEM_DEBUG": ""})
    plain, tty = io.StringIO(), _TTY()
    try:
        setup_debug_logging(plain, force=True)
        led = Ledger()
        x = torch.zeros(256)
        led.allocate(x)
        out = plain.getvalue()
        assert "[torchmem.ledger] DEBUG [allocate] +1.00 KiB" in out and "\x1b[" not in out
        setup_debug_logging(tty, force=True)  # a terminal: coloured (rich)
        led.free(x)
        assert "[free] -1.00 KiB" in tty.getvalue() and "\x1b[" in tty.getvalue()
    finally:
        remove_debug_logging()
    rec = logging.LogRecord("torchmem.ledger", logging.WARNING, "f", 1, "m", None, None)
    assert ColorFormatter(color=True).format(rec) == "[torchmem.ledger] \x1b[33mWARNING\x1b[0m m"


def test_debug_env_in_fresh_processes() -> None:
    code = (
        "import torch, torchmem\n"
        "led = torchmem.Ledger(); x = torch.zeros(8); led.allocate(x); led.free(x)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHMEM_DEBUG", "DEBUG")}

    def run(extra: dict[str, str]) -> str:
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stderr

    assert "[allocate]" not in run({})
    for var in ("TORCHMEM_DEBUG", "DEBUG"):  # ours, and MemLord's switch
        err = run({var: "1"})
        assert "[torchmem.ledger] DEBUG [allocate] +32 B" in err
        assert "[free] -32 B" in err
