"""Transfers on real GPUs: streams, events, pinned staging. Skipped on machines without CUDA
(marker ``cuda``, see conftest.py); nothing here is simulated."""

from __future__ import annotations

import pytest
import torch

from torchmem.transfer import (
    DeviceSpec,
    StagingBuffers,
    ToDevice,
    chunked_transfer,
    offload_forward,
    transfer_async,
    transfer_module,
    transfer_stream,
)

pytestmark = pytest.mark.cuda

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


@pytest.fixture
def no_device_sync(monkeypatch):
    """Fail if anything calls a device-wide synchronize during the test."""

    def boom(*args, **kwargs):
        raise AssertionError("device-wide synchronize called")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(torch.accelerator, "synchronize", boom)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def test_round_trip_cpu_gpu_cpu_is_byte_exact(no_device_sync):
    x = torch.randn(1000, 37)
    x[0, 0] = float("nan")
    T = ToDevice("cpu", "cuda:0", chunk_bytes=4096)
    y = T(x)  # pageable: staged through the operator's pinned buffers
    assert y.device == torch.device("cuda", 0)
    assert T._staging[0] is not None and T._staging[0].pinned
    z = T.H(y)  # synchronized by default
    assert torch.equal(bytes_of(z), bytes_of(x))
    xp = x.pin_memory()
    assert torch.equal(bytes_of(T.H(T(xp))), bytes_of(x))


def test_chunked_h2d_and_d2h_measure_pinned_staging(no_device_sync):
    x = torch.randn(1 << 20)  # 4 MiB
    r = chunked_transfer(x, "cuda:0", chunk_bytes=1 << 20)
    assert r.chunk_sizes == (1 << 20,) * 4 and r.peak_staging_bytes == 2 << 20
    r.event.synchronize()
    assert torch.equal(bytes_of(r.tensor), bytes_of(x))
    back = chunked_transfer(r.tensor, "cpu", chunk_bytes=3 << 18)
    assert torch.equal(bytes_of(back.tensor), bytes_of(x)) and back.peak_staging_bytes == 2 * (3 << 18)
    nc = torch.randn(64, 96, device="cuda:0").t()
    out = chunked_transfer(nc, "cpu", chunk_bytes=1000)
    assert torch.equal(out.tensor, nc.cpu())


def test_async_d2h_returns_pinned_tensor_and_event(no_device_sync):
    x = torch.arange(1 << 16, device="cuda:0", dtype=torch.float32)
    p = transfer_async(x, "cpu")
    assert p.event is not None and p.tensor.is_pinned()
    assert torch.equal(p.wait(), torch.arange(1 << 16, dtype=torch.float32))
    assert p.ready()


def test_producer_stream_is_respected(no_device_sync):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.full((1 << 22,), 3.0, device="cuda:0")
        a.mul_(2)
    T = ToDevice(DeviceSpec("cuda:0", compute_stream=s), "cpu")
    assert torch.equal(T(a), torch.full((1 << 22,), 6.0))


def test_transfer_streams_are_cached_per_pair():
    a = transfer_stream("cpu", "cuda:0")
    assert a is transfer_stream("cpu", "cuda:0")
    assert a is not transfer_stream("cuda:0", "cpu")
    assert "transfer=cuda:0#0x" in repr(ToDevice("cpu", "cuda:0"))


@two_gpus
def test_gpu_to_gpu_on_transfer_stream(no_device_sync):
    T = ToDevice("cuda:0", "cuda:1")
    assert T.is_gpu2gpu and "transfer=cuda:0#0x" in repr(T)
    x = torch.randn(1 << 20, device="cuda:0")
    y = T(x)
    assert y.device == torch.device("cuda", 1)
    assert torch.equal(bytes_of(y), bytes_of(x))
    assert torch.equal(bytes_of(T.H(y)), bytes_of(x))
    assert transfer_stream("cuda:0", "cuda:1") is not transfer_stream("cuda:1", "cuda:0")


def test_module_and_offload_on_gpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    x = torch.randn(4, 256)
    ref = model(x)
    pool = StagingBuffers(64 << 10)
    r = offload_forward(model, x, "cuda:0", chunk_bytes=64 << 10, staging=pool)
    torch.testing.assert_close(r.output.cpu(), ref, rtol=1e-4, atol=1e-4)
    per_layer = 256 * 256 * 4 + 256 * 4
    assert r.peak_resident_bytes == 2 * per_layer
    assert r.peak_staging_bytes == 2 * (64 << 10)
    m = torch.nn.Linear(8, 8)
    w = m.weight
    res = transfer_module(m, "cuda:0", chunk_bytes=64)
    assert m.weight is w and w.is_cuda and res.bytes_moved == 8 * 8 * 4 + 8 * 4
