"""Host and GPU apart in the estimate (issue 24): what stays on the host is not GPU memory.

Ground truth is computed another way: from the tensors' sizes (what each build keeps where) and
from the same step written with every tensor created on the GPU from the start.
"""

from __future__ import annotations

import json

import pytest
import torch

import torchmem
from torchmem.errors import InvalidInputError
from torchmem.fit.verdict._catalog import gpu as catalog_gpu

MiB = 1 << 20
GB = 10**9


def _storage_sum(*shapes_dtypes) -> int:
    return sum(torch.Size(s).numel() * d.itemsize for s, d in shapes_dtypes)


def test_host_tensors_are_not_gpu_memory():
    """The issue's example: 1.5 GB kept on the host (no device, and device="cpu"), 0.2 GB on
    "cuda": the GPU holds 0.2 GB, the host 1.5 GB."""
    host_a, host_b, dev_n = 1_000_000_000 // 4, 500_000_000 // 4, 200_000_000 // 4

    def build(batch):
        a = torch.empty(host_a)                    # no device: the host, as in PyTorch
        b = torch.empty(host_b, device="cpu")
        d = torch.empty(dev_n, device="cuda")

        def step():
            return a.numel() + b.numel() + d.numel()
        return step

    e = torchmem.estimate(build, gpu="A100-40GB", steps=1, margin=0)
    assert e.peak_requested_bytes == dev_n * 4 == 200_000_000
    assert e.host_peak_bytes == (host_a + host_b) * 4 == 1_500_000_000
    # one 200 MB request: a large-pool block rounded to 512 B, in a segment rounded to 2 MiB
    assert e.peak_allocated_bytes == -(-dev_n * 4 // 512) * 512
    assert e.peak_reserved_bytes == -(-dev_n * 4 // (2 * MiB)) * 2 * MiB
    assert e.to_dict()["host_peak_bytes"] == 1_500_000_000


def _mlp(device=None):
    return torch.nn.Sequential(torch.nn.Linear(512, 2048, device=device), torch.nn.GELU(),
                               torch.nn.Linear(2048, 512, device=device))


PARAM_BYTES = _storage_sum(((2048, 512), torch.float32), ((2048,), torch.float32),
                           ((512, 2048), torch.float32), ((512,), torch.float32))


def _train(model_on_host: bool, batch_on_host: bool):
    def build(batch):
        if model_on_host:
            net = _mlp()                     # built on the host, then moved (from_pretrained style)
            net.to("cuda")
        else:
            net = _mlp("cuda")
        opt = torch.optim.AdamW(net.parameters())
        x = torch.randn(batch, 512, device=None if batch_on_host else "cuda")
        if batch_on_host:
            x = x.pin_memory()

        def step():
            xb = x.to("cuda", non_blocking=True) if batch_on_host else x
            net(xb).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return build


def test_a_model_built_on_the_host_and_moved_matches_one_built_on_the_gpu():
    on_gpu = torchmem.estimate(_train(False, False), gpu="T4", batch_size=64, margin=0)
    moved = torchmem.estimate(_train(True, True), gpu="T4", batch_size=64, margin=0)
    # the GPU sees the same requests in the same order: the same peaks, to the byte
    assert (moved.peak_requested_bytes, moved.peak_allocated_bytes, moved.peak_reserved_bytes) \
        == (on_gpu.peak_requested_bytes, on_gpu.peak_allocated_bytes, on_gpu.peak_reserved_bytes)
    assert moved.by_category["parameter"] == on_gpu.by_category["parameter"] == PARAM_BYTES
    # AdamW on CUDA (foreach, not capturable) keeps its step counters on the host: four
    # float32 scalars, plus the 1.0 it adds to them (torch/optim/adamw.py), as on a GPU
    assert on_gpu.host_peak_bytes == 4 * 4 + 4
    # the host held the whole model before the move (each storage dies as .to() replaces it),
    # more than the batch and its pinned copy later
    assert moved.host_peak_bytes == PARAM_BYTES


def test_code_that_asks_where_a_tensor_is_sees_the_gpu():
    seen = {}

    def build(batch):
        w = torch.randn(256, 256, device="cuda")
        h = torch.randn(256, 256)

        def step():
            seen["device"] = (str(w.device), w.device.type, w.is_cuda, w.get_device(), w.is_cpu)
            seen["host"] = (str(h.device), h.is_cuda, h.get_device(), h.is_cpu)
            with torch.autocast(device_type=w.device.type, dtype=torch.float16):
                seen["autocast"] = (w @ w).dtype
            back = w.cpu()
            seen["back"] = (back.device.type, back.is_cuda)
            seen["like"] = torch.zeros(4, device=w.device).is_cuda
            seen["to_other"] = h.to(w).is_cuda
        return step

    e = torchmem.estimate(build, gpu="A100-40GB", steps=1, margin=0)
    assert seen == {
        "device": ("cuda:0", "cuda", True, 0, False),
        "host": ("cpu", False, -1, True),
        "autocast": torch.float16,
        "back": ("cpu", False),
        "like": True,
        "to_other": True,
    }
    n = 256 * 256 * 4
    # host: h and the copy of w made by .cpu(); GPU: w, h's copy, the fp16 casts and product,
    # the 16-byte zeros and the cuBLAS workspace
    assert e.host_peak_bytes == 2 * n


def test_default_device_cuda_is_set_default_device():
    def agnostic(batch):
        net = _mlp()
        x = torch.randn(batch, 512)
        return lambda: net(x).sum().backward()

    def explicit(batch):
        torch.set_default_device("cuda")
        try:
            net = _mlp()
            x = torch.randn(batch, 512)
        finally:
            torch.set_default_device(None)
        return lambda: net(x).sum().backward()

    a = torchmem.estimate(agnostic, gpu="T4", batch_size=32, default_device="cuda", margin=0)
    b = torchmem.estimate(explicit, gpu="T4", batch_size=32, margin=0)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes, a.host_peak_bytes) == \
        (b.peak_allocated_bytes, b.peak_reserved_bytes, 0)
    assert a.by_category["parameter"] == PARAM_BYTES


def test_a_step_with_nothing_on_the_gpu_says_how_to_fix_it():
    def build(batch):
        net = _mlp()
        x = torch.randn(batch, 512)
        return lambda: net(x).sum().backward()

    with pytest.raises(InvalidInputError) as ei:
        torchmem.estimate(build, gpu="T4", batch_size=8)
    msg = str(ei.value)
    assert "put nothing on the GPU" in msg and "device='cuda'" in msg
    assert "default_device='cuda'" in msg and "test_fit_placement.py" in msg
    with pytest.raises(InvalidInputError, match="default_device must be None, 'cpu' or 'cuda'"):
        torchmem.estimate(build, gpu="T4", default_device="gpu")


def test_cpu_offloaded_optimizer_state_is_host_memory():
    """Adam moments kept on the host (a hand-written CPU offload): the GPU holds parameters and
    gradients; the host the moments and the gradients' copies."""
    def build(batch):
        net = _mlp("cuda")
        params = list(net.parameters())
        m = [torch.zeros_like(p, device="cpu") for p in params]
        x = torch.randn(batch, 512, device="cuda")

        def step():
            net(x).sum().backward()
            with torch.no_grad():
                for p, mi in zip(params, m):
                    g = p.grad.to("cpu")
                    mi.mul_(0.9).add_(g, alpha=0.1)
                    p.sub_(mi.to(p.device), alpha=1e-3)
            net.zero_grad(set_to_none=True)
        return step

    e = torchmem.estimate(build, gpu="T4", batch_size=16, margin=0, steps=2)
    assert e.by_category["optimizer_state"] == 0
    # host: the moments, plus the gradient copies: the previous one (`g`) is still held while
    # the next is made, so the peak is the first weight's (2048 x 512) with its bias's (2048)
    assert e.host_peak_bytes == PARAM_BYTES + 2048 * 512 * 4 + 2048 * 4
    assert e.by_category["parameter"] == PARAM_BYTES


def test_cli_reports_host_memory_and_default_device(tmp_path, capsys):
    from torchmem.cli import main

    f = tmp_path / "train.py"
    f.write_text(
        "import torch\n"
        "def build(batch):\n"
        "    x = torch.zeros(batch, 1 << 18)\n"
        "    return lambda: x * 2\n"
    )
    assert main(["estimate", f"{f}:build", "--gpu", "T4", "--steps", "1", "--json"]) == 2
    assert "put nothing on the GPU" in capsys.readouterr().err
    assert main(["estimate", f"{f}:build", "--gpu", "T4", "--steps", "1", "--json",
                 "--default-device", "cuda", "--batch-size", "4"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["peak_requested_bytes"] == 2 * 4 * MiB and d["host_peak_bytes"] == 0
    f.write_text(
        "import torch\n"
        "def build(batch):\n"
        "    h = torch.zeros(batch, 1 << 18)\n"
        "    x = h.cuda()\n"
        "    return lambda: x * 2\n"
    )
    assert main(["estimate", f"{f}:build", "--gpu", "T4", "--steps", "1",
                 "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "host peak" in out and "4.00 MiB" in out
    assert catalog_gpu("T4").usable_bytes > 0


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_fsdp2_cpu_offload_keeps_the_model_state_on_the_host():
    """FSDP2 with ``CPUOffloadPolicy`` (rank 0 of 2): sharded parameters, gradients (copied to
    the host in backward, by FSDP's post-backward hook) and AdamW's state live on the host; the
    GPU holds only what a step gathers. Without offload the same state is GPU memory."""
    import math

    shapes = [(100, 96), (30, 100)]
    shard = 4 * sum(math.ceil(o / 2) * i + math.ceil(o / 2) for o, i in shapes)  # rank 0 of 2

    def build(batch, offload):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kw = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        layers = [torch.nn.Linear(i, o, device="cuda") for o, i in shapes]
        for layer in layers:
            fully_shard(layer, **kw)
        net = torch.nn.Sequential(*layers)
        fully_shard(net, **kw)
        opt = torch.optim.AdamW(net.parameters())
        x = torch.randn(batch, shapes[0][1], device="cuda")

        def step():
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return step

    on = torchmem.estimate(build, batch_size=32, world_size=2, params={"offload": False},
                           margin=0)
    off = torchmem.estimate(build, batch_size=32, world_size=2, params={"offload": True},
                            margin=0)
    assert on.model_state == {"parameter": shard, "gradient": shard,
                              "optimizer_state": 2 * shard, "communication": 0}
    assert off.model_state == {"parameter": 0, "gradient": 0, "optimizer_state": 0,
                               "communication": 0}
    # the host holds the shards, their gradients and both AdamW moments (and the 4 step
    # counters), at least; the GPU saves all of that
    assert off.host_peak_bytes >= 4 * shard + 16
    assert on.peak_requested_bytes - off.peak_requested_bytes >= 3 * shard
