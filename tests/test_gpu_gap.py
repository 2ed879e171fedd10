"""The gap to nvidia-smi: :func:`torchmem.analysis.gpu_gap`, the readings of
:func:`torchmem.devices.read_gpu` / :func:`~torchmem.devices.measure_cuda_context`, ``torchmem
gpu`` and the ledger's line.

Without a GPU, NVML (``pynvml``) and ``torch.cuda`` are replaced by a small stand-in that
plays back one scenario's readings: an H100 80GB (NVML total 81,559 MiB) with another process
(PID 4242, 512 MiB) and 512 MiB that no listed process holds; starting CUDA in this process
adds a 534 MiB context; then the program reserves 20 GiB (17.5 GiB allocated) and libraries
take 300 MiB more outside PyTorch. Every expected figure below is worked out by hand from
those readings. The real-GPU checks are marked ``cuda``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

import torchmem.devices as devices
from torchmem.analysis import GpuReading, gpu_gap
from torchmem.cli import main
from torchmem.errors import DeviceError, InvalidInputError

MiB, GiB = 1 << 20, 1 << 30
TOTAL = 81_559 * MiB  # an H100 80GB HBM3's NVML total
OTHER = (4242, 512 * MiB)
UNLISTED = 512 * MiB
CONTEXT = 534 * MiB
RESERVED, ALLOCATED = 20 * GiB, 17 * GiB + 512 * MiB
LIBRARIES = 300 * MiB


class FakeNVML:
    """pynvml's calls used by torchmem, answering from the scenario's readings."""

    def __init__(self, list_processes: bool = True) -> None:
        self.mine = 0  # this process's bytes on the device
        self.list_processes = list_processes

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, int]:
        assert i == 0
        return ("gpu", 0)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> tuple[str, int]:
        assert uuid == "GPU-4f2a"
        return ("gpu", 0)

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        used = OTHER[1] + UNLISTED + self.mine
        return SimpleNamespace(total=TOTAL, used=used, free=TOTAL - used)

    def nvmlDeviceGetName(self, h: Any) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        procs = [SimpleNamespace(pid=OTHER[0], usedGpuMemory=OTHER[1])]
        if self.mine and self.list_processes:
            procs.append(SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.mine))
        return procs

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        return []


class FakeCuda:
    """torch.cuda's calls used by torchmem; starting CUDA adds the context to NVML's figures."""

    def __init__(self, nvml: FakeNVML) -> None:
        self.nvml = nvml
        self.initialized = False
        self.reserved = self.allocated = 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def is_initialized(self) -> bool:
        return self.initialized

    def mem_get_info(self, i: int) -> tuple[int, int]:
        if not self.initialized:
            self.initialized = True
            self.nvml.mine += CONTEXT
        info = self.nvml.nvmlDeviceGetMemoryInfo(None)
        return info.free, info.total

    def run_the_program(self) -> None:
        self.mem_get_info(0)
        self.reserved, self.allocated = RESERVED, ALLOCATED
        self.nvml.mine += RESERVED + LIBRARIES

    def memory_reserved(self, i: int) -> int:
        return self.reserved

    def memory_allocated(self, i: int) -> int:
        return self.allocated

    def get_device_capability(self, i: int) -> tuple[int, int]:
        return (9, 0)

    def get_device_properties(self, i: int) -> Any:
        return SimpleNamespace(uuid="4f2a", name="NVIDIA H100 80GB HBM3")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    nv = FakeNVML()
    cuda = FakeCuda(nv)
    monkeypatch.setattr(devices, "_CONTEXT", {})
    monkeypatch.setattr(devices, "_nvml", lambda: nv)
    monkeypatch.setattr(devices, "_torch_cuda", lambda: cuda)
    import torchmem.cli.gpu as cli_gpu

    monkeypatch.setattr(cli_gpu, "_cuda", lambda: cuda)
    return cuda


def test_the_context_is_measured_when_cuda_starts(fake: FakeCuda) -> None:
    assert devices.measure_cuda_context(0) == CONTEXT
    fake.run_the_program()
    assert devices.measure_cuda_context(0) == CONTEXT  # kept, not measured again


def test_without_a_process_list_the_device_rise_is_the_context(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.nvml.list_processes = False
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.measure_cuda_context(0) == CONTEXT


def test_cuda_started_elsewhere_cannot_be_measured(fake: FakeCuda) -> None:
    fake.run_the_program()
    assert devices.measure_cuda_context(0) is None


def test_the_split_of_used_bytes(fake: FakeCuda) -> None:
    devices.measure_cuda_context(0)
    fake.run_the_program()
    r = devices.read_gpu(0)
    assert (r["total_bytes"], r["name"], r["source"]) == (TOTAL, "NVIDIA H100 80GB HBM3", "nvml")
    assert r["other_processes"] == [OTHER]
    g = gpu_gap(GpuReading.from_dict(r))
    used = OTHER[1] + UNLISTED + CONTEXT + RESERVED + LIBRARIES
    assert g.used_bytes == used
    assert g.process_bytes == CONTEXT + RESERVED + LIBRARIES
    assert (g.context_bytes, g.context_source) == (CONTEXT, "measured")
    assert g.unexplained_bytes == LIBRARIES == 300 * MiB
    assert g.other_processes_bytes == OTHER[1]
    assert g.unattributed_bytes == UNLISTED
    lines = {row["line"]: row["bytes"] for row in g.rows}
    assert lines["cached, not allocated"] == 2 * GiB + 512 * MiB
    assert lines["PyTorch reserved"] == RESERVED and lines["allocated"] == ALLOCATED
    # every part adds up to its whole
    assert (lines["PyTorch reserved"] + lines["CUDA context"] + lines["NCCL"]
            + lines["unexplained (this process)"]) == lines["this process"]
    assert (lines["this process"] + lines["other processes"]
            + lines["not attributed to any process"]) == lines["used (nvidia-smi)"]


def test_without_a_measurement_the_documented_estimate_is_used(fake: FakeCuda) -> None:
    from torchmem.fit import CONTEXT_BYTES

    fake.run_the_program()  # CUDA started before torchmem could measure
    r = devices.read_gpu(0, context_estimates=CONTEXT_BYTES)
    g = gpu_gap(GpuReading.from_dict(r))
    assert (g.context_bytes, g.context_source) == (CONTEXT_BYTES[9], "estimate")
    assert CONTEXT_BYTES[9] == 530 * MiB
    assert g.unexplained_bytes == CONTEXT + LIBRARIES - 530 * MiB == 304 * MiB


def test_without_nvml_the_device_figures_come_from_torch(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.run_the_program()
    monkeypatch.setattr(devices, "_nvml", lambda: None)
    r = devices.read_gpu(0)
    assert r["source"] == "torch.cuda.mem_get_info" and r["process_bytes"] is None
    g = gpu_gap(GpuReading.from_dict(r))
    # no process list: this process is taken as all of used, nothing attributed elsewhere
    assert g.process_bytes == OTHER[1] + UNLISTED + CONTEXT + RESERVED + LIBRARIES
    assert g.unattributed_bytes == 0 and "NVML is not available" in " ".join(g.notes)


def test_nccl_groups_are_named() -> None:
    g = gpu_gap(GpuReading(0, "x", 100 * MiB, 60 * MiB, 50 * MiB, 30 * MiB, 20 * MiB,
                           context_bytes=10 * MiB, nccl_process_groups=2))
    row = next(r for r in g.rows if r["line"] == "NCCL")
    assert row["bytes"] == 0 and "2 NCCL process group(s)" in row["source"]
    assert g.unexplained_bytes == 10 * MiB


def test_bad_readings_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="unknown reading"):
        GpuReading.from_dict({"device": 0, "name": "x", "total_bytes": 1, "used_bytes": 1,
                              "process_bytes": 1, "reserved_bytes": 0, "allocated_bytes": 0,
                              "reserved": 5})
    with pytest.raises(InvalidInputError, match="used_bytes should be a byte count"):
        gpu_gap(GpuReading(0, "x", 10, -1, None, 0, 0))


def test_cli_gpu_with_recorded_readings(fake: FakeCuda, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu", "--json"]) == 0  # measures the context, as on a real machine
    (d,) = json.loads(capsys.readouterr().out)["devices"]
    assert (d["context_bytes"], d["context_source"]) == (CONTEXT, "measured")
    assert (d["reserved_bytes"], d["unexplained_bytes"]) == (0, 0)  # the CLI itself
    assert d["other_processes_bytes"] == OTHER[1] and d["unattributed_bytes"] == UNLISTED
    assert main(["gpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cuda:0 (NVIDIA H100 80GB HBM3)")
    assert "torch.cuda.memory_reserved()" in out and "PID 4242 512.00 MiB" in out
    assert main(["gpu", "--device", "3"]) == 2
    assert "no CUDA device 3" in capsys.readouterr().err


def test_ledger_prints_the_gap_line(fake: FakeCuda) -> None:
    from torchmem.cli.ledger import _gaps

    (g,) = _gaps(["cpu", "cuda:0"])
    assert g.summary() == (
        "cuda:0 vs nvidia-smi: this process 534.00 MiB = PyTorch reserved 0 B + CUDA context "
        "534.00 MiB (measured) + unexplained 0 B; other processes 512.00 MiB; not attributed "
        "512.00 MiB"
    )
    assert _gaps(["cpu"]) == []


def test_cli_gpu_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["gpu"]) == 2
    err = capsys.readouterr().err
    assert "torchmem gpu: error: no CUDA GPU is visible here" in err
    with pytest.raises(DeviceError):
        devices.read_gpu(0)


@pytest.mark.cuda
def test_real_gpu_lines_add_up() -> None:
    import torch

    from torchmem.cli.gpu import gaps

    for g, r in gaps():
        assert g.total_bytes >= torch.cuda.get_device_properties(g.device).total_memory * 0.9
        assert (g.reserved_bytes + g.context_bytes + g.nccl_bytes + g.unexplained_bytes
                == g.process_bytes)
        assert g.process_bytes + g.other_processes_bytes + g.unattributed_bytes == g.used_bytes
        # measured when CUDA had not started before (else the per-generation estimate)
        assert g.context_source in ("measured", "estimate") and 0 < g.context_bytes < 4 * GiB
        assert r["reserved_bytes"] == torch.cuda.memory_reserved(g.device)


def test_torchmem_ledger_prints_the_gap_on_cuda(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(devices, "_cuda_count", lambda: 1)
    assert main(["ledger", "--device", "cuda:0"]) == 0
    out = capsys.readouterr().out
    assert "cuda:0 vs nvidia-smi: this process 534.00 MiB = PyTorch reserved 0 B" in out
    assert main(["ledger", "--device", "cuda:0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (g,) = doc["gpu_gap"]
    assert (g["context_bytes"], g["other_processes_bytes"]) == (CONTEXT, OTHER[1])
    assert doc["readings"][0]["used"] == g["used_bytes"]  # the same NVML figure in both
