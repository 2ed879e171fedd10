"""Device usage: psutil readings, absent devices, background threads and their shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from torchmem import UsagePoller, available_devices, poll_usage
from torchmem.devices import DeviceUsage, normalize_device, poll_all
from torchmem.errors import DeviceError, InvalidInputError


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_cpu_reading_matches_psutil() -> None:
    u = poll_usage("cpu")
    vm = psutil.virtual_memory()
    assert u.total == vm.total
    # used = total - available; memory moves between the two reads, allow 5% of RAM
    assert abs(u.used - (vm.total - vm.available)) < 0.05 * vm.total
    rss = psutil.Process(os.getpid()).memory_info().rss
    assert u.process is not None and abs(u.process - rss) < 64 * 2**20
    assert u.source == "psutil" and 0 < u.used_pct < 100
    assert u.free == u.total - u.used
    assert u.as_dict()["used_pct"] == round(100 * u.used / u.total, 3)


def test_absent_devices_skipped_cleanly() -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert available_devices() == ["cpu"] + [f"cuda:{i}" for i in range(n)]
    assert sorted(poll_all()) == available_devices()
    with pytest.raises(DeviceError, match=f"has {n} visible CUDA device"):
        poll_usage(f"cuda:{n}")
    with UsagePoller(interval=0.05) as p:
        assert p.usage(f"cuda:{n}") is None
        assert p.usage("meta") is None
        assert p.running_devices() == []  # no thread for absent devices
        assert "torchmem-usage-cuda" not in " ".join(_threads())


def test_normalize_device() -> None:
    assert [normalize_device(d) for d in ("cuda", "CUDA:3", 2, torch.device("cpu"))] == [
        "cuda:0", "cuda:3", "cuda:2", "cpu"]
    with pytest.raises(DeviceError, match="expected a device such as"):
        normalize_device("tpu:0")
    with pytest.raises(InvalidInputError):
        normalize_device(True)
    with pytest.raises(InvalidInputError, match="positive number of seconds"):
        UsagePoller(interval=0)


def test_poller_one_thread_per_device_refreshes_and_stops() -> None:
    readings: list[int] = []

    def reader(device: str) -> DeviceUsage:  # counts real calls from the polling thread
        readings.append(1)
        return DeviceUsage(device, total=100, used=len(readings), source="counter",
                           time=time.time())

    p = UsagePoller(interval=0.02, reader=reader)
    assert "torchmem-usage-cpu" not in _threads()  # nothing started before first use
    first = p.usage("cpu")
    assert first is not None and first.used == 1
    assert p.running_devices() == ["cpu"]
    assert sum(1 for t in threading.enumerate() if t.name == "torchmem-usage-cpu") >= 1
    deadline = time.monotonic() + 10
    while p.reads("cpu") < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    latest = p.usage("cpu")
    assert latest is not None and latest.used == p.reads("cpu") >= 4  # refreshed in background
    p.close()
    assert p.running_devices() == []
    n = len(readings)
    time.sleep(0.1)
    assert len(readings) == n  # stopped: no more reads
    assert p.usage("cpu") is None  # closed pollers answer nothing


def test_poller_real_psutil_thread() -> None:
    with UsagePoller(interval=0.05) as p:
        u = p.usage("cpu")
        assert u is not None and u.total == psutil.virtual_memory().total
        deadline = time.monotonic() + 10
        while p.reads("cpu") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.reads("cpu") >= 2
    assert "torchmem-usage-cpu" not in _threads()


def test_pollers_stopped_at_interpreter_exit() -> None:
    # A poller left open: the atexit handler must stop and join it (the process exits at once
    # and the thread reports that it was stopped, not killed mid-loop).
    # atexit runs handlers last-registered first: re-register torchmem's handler after ours so
    # ours reports the thread's state after torchmem's handler ran.
    code = (
        "import atexit, threading, torchmem.devices as d\n"
        "p = d.UsagePoller(interval=0.01)\n"
        "p.usage('cpu')\n"
        "t = [t for t in threading.enumerate() if t.name == 'torchmem-usage-cpu'][0]\n"
        "print('alive-before-exit', t.is_alive())\n"
        "atexit.register(lambda: print('alive-after-close', t.is_alive()))\n"
        "atexit.unregister(d._close_all_pollers)\n"
        "atexit.register(d._close_all_pollers)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "alive-before-exit True" in out.stdout
    assert "alive-after-close False" in out.stdout


@pytest.mark.cuda
def test_cuda_reading_matches_torch() -> None:  # pragma: no cover - needs a GPU
    """NVML (when installed) counts the memory the driver keeps for itself in total and used,
    ``cudaMemGetInfo`` in neither: the readings agree once that amount is taken out."""
    free, total = torch.cuda.mem_get_info(0)
    u = poll_usage("cuda:0")
    if u.source == "nvml":
        import pynvml
        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        assert u.total == int(info.total)
        driver_kept = u.total - total
        assert 0 <= driver_kept < 2**30          # 480 MiB on an H100 80GB, driver 580
        assert abs((u.used - driver_kept) - (total - free)) < 0.01 * total
    else:
        assert u.total == total
        assert abs(u.used - (total - free)) < 0.01 * total


# ---------------------------------------------------------------- the device-name rule


def test_device_name_rule() -> None:
    from torchmem._device import device_name

    cuda_now = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    cases = {
        "cpu": "cpu", " CPU ": "cpu", "cpu:0": "cpu", "meta:0": "meta", "cuda:01": "cuda:1",
        "cuda": f"cuda:{cuda_now}", 3: "cuda:3", "xpu:2": "xpu:2",
        torch.device("cuda", 2): "cuda:2", torch.device("cpu", 0): "cpu",
    }
    assert {repr(k): device_name(k) for k in cases} == {repr(k): v for k, v in cases.items()}
    assert device_name(torch.zeros(1, device="meta")) == "meta"
    for bad in ("gpu", "cuda:x", "cuda:-1", "", None, 1.5, -1, True):
        with pytest.raises(DeviceError):
            device_name(bad)


def test_device_selector_and_split_share_the_rule() -> None:
    from torchmem._device import device_name, device_selector, split_device

    assert device_selector("cuda") == "cuda" and device_selector(torch.device("cuda")) == "cuda"
    for d in ("cpu", "cuda:1", 2, "META", torch.device("cuda", 0)):
        assert device_selector(d) == device_name(d)
    assert split_device("CUDA:7") == ("cuda", 7) and split_device("cpu:3") == ("cpu", None)


def test_every_normaliser_agrees() -> None:
    from torchmem._device import device_name
    from torchmem.capture.storage import device_str
    from torchmem.transfer.streams import canonical_device

    for d in ("cpu", "cpu:0", "meta", "cuda", "cuda:1", torch.device("cuda")):
        assert device_str(d) == str(canonical_device(d)) == device_name(d)
    assert normalize_device("cuda") == device_name("cuda")


def test_device_module_does_not_import_torch() -> None:
    code = (
        "import sys, torchmem._device as d\n"
        "assert d.device_name('cuda') == 'cuda:0' and d.device_name('cpu:0') == 'cpu'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
