"""``torchmem.estimate`` against the real H100 runs of ``tests/data/gpu`` (torch 2.11 there, the
installed torch here), case by case, for the behaviours each figure depends on.

Every figure is read from the case's JSON (``stats``: the allocator's peaks over the whole
recorded run; ``cublas_workspace_bytes``); nothing is copied into this file. The goals: peak
allocated within 1 %, peak reserved within 5 %; where a rule makes a figure exact, it is
asserted exactly. The cases' builds are ``tests/gpu_cases.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

import gpu_cases
import torchmem

recorded = gpu_cases.recorded
estimate_case = gpu_cases.estimate_case


def rel(est: int, real: int) -> float:
    return (est - real) / real


def assert_goals(case: str, e: torchmem.Estimate) -> dict[str, Any]:
    s = recorded(case)["stats"]
    alloc, reserved = s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"]
    assert abs(rel(e.peak_allocated_bytes, alloc)) < 0.01, (e.peak_allocated_bytes, alloc)
    assert abs(rel(e.peak_reserved_bytes, reserved)) < 0.05, (e.peak_reserved_bytes, reserved)
    return s


def test_cublaslt_workspace_gpt_fp32():
    # the forward's addmm with a bias (nn.Linear) runs through cuBLASLt, whose 1 MiB workspace
    # is its own allocator block after the 32 MiB cuBLAS one: 2 x 32 MiB + 1 MiB in all
    e = estimate_case("gpt_fp32_b8")
    assert e.workspace_bytes == recorded("gpt_fp32_b8")["cublas_workspace_bytes"]
    s = assert_goals("gpt_fp32_b8", e)
    assert abs(e.peak_allocated_bytes - s["allocated_bytes.all.peak"]) < (1 << 20) // 4
    assert e.peak_reserved_bytes == s["reserved_bytes.all.peak"]


def test_efficient_attention_backward_buffers():
    # bf16, causal, forced EFFICIENT_ATTENTION: the backward's delta (B, H, M) fp32 and the
    # kernel's fp32 dQ workspace (67,174,400 B here) were missing (reserved -13 %)
    e = estimate_case("sdpa_efficient")
    s = assert_goals("sdpa_efficient", e)
    assert abs(rel(e.peak_reserved_bytes, s["reserved_bytes.all.peak"])) < 0.01
    # the forward's philox seed and offset stay on the host: peak allocated is exact
    assert e.peak_allocated_bytes == s["allocated_bytes.all.peak"]


def _two_streams_estimate() -> torchmem.Estimate:
    # Tensor.record_stream refused the fake run's stand-in stream ("unknown parameter type");
    # now a no-op (the estimate runs all streams as one, in program order). The recorded step
    # ends in acc.sum().item(), a value read fake tensors cannot answer (the estimate refuses
    # it by design), so this is the same step without the read.
    import torch

    def build(batch_size: int):
        inner_side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        w = torch.randn(1024, 1024, device="cuda")

        def step() -> None:
            acc = torch.zeros(batch_size, 1024, device="cuda")
            for _ in range(8):
                with torch.cuda.stream(inner_side):
                    buf = torch.randn(batch_size, 1024, device="cuda") @ w
                main.wait_stream(inner_side)
                buf.record_stream(main)
                acc += buf.relu()
                del buf
            acc.sum()
        return step

    rec = recorded("two_streams")
    return torchmem.estimate(build, gpu=gpu_cases.recorded_gpu("two_streams"),
                             batch_size=rec["batch_size"], margin=0)


def test_record_stream_two_streams_allocated():
    e = _two_streams_estimate()
    rec = recorded("two_streams")
    assert e.workspace_bytes == rec["cublas_workspace_bytes"]  # one GEMM stream, no cuBLASLt
    alloc = rec["stats"]["allocated_bytes.all.peak"]
    assert abs(rel(e.peak_allocated_bytes, alloc)) < 0.01
    # reserved is 48% low (record_stream's waiting blocks), within the default margin
    assert gpu_cases.case_false_fits("two_streams", e) is None


@pytest.mark.xfail(strict=True, reason=(
    "not modelled: a block freed after record_stream stays unusable until the other stream's "
    "work is done (the real run's active peak, 155 MB, is far above its allocated peak, 88 MB, "
    "and it reserves 174 MB); the simulator reuses it at once and reserves about 90 MB"))
def test_record_stream_two_streams_reserved():
    e = _two_streams_estimate()
    assert_goals("two_streams", e)


def _conv_workspaces(snapshot: Any, real: bool) -> list[int]:
    """The cuDNN convolution workspace requests of a trace, in order: in the real trace the
    requests that are no tensor's shape (an odd size), in the estimate's the convolutions'
    scratch (named by the overload, ``aten.convolution.default``; tensors by ``aten::``)."""
    out = []
    for e in snapshot.traces[0]:
        if e.action != "alloc":
            continue
        names = [f.name for f in (e.frames or ())]
        if real and (e.size % 512) and e.size > (1 << 20):
            out.append(e.size)
        elif not real and names and names[0].startswith("aten.convolution"):
            out.append(e.size)
    return out


def test_cudnn_convolution_workspaces_convnet():
    # NCHW fp32 convolutions with TF32 (on by default) run cuDNN tensor-core engines in NHWC:
    # each call's workspace holds NHWC copies of its input, output and filter. The H100's
    # forward and data-gradient requests are those sums plus a few bytes (16 or 147), but for
    # one forward engine (64 -> 128 channels) that skipped the output's copy; the weight
    # gradient's requests add split-K partial filters (4 to 15 copies) that only cuDNN's
    # heuristics decide. The first convolution (3 input channels) has no workspace at all.
    e = torchmem.estimate(
        lambda bs: gpu_cases.convnet(bs), gpu=gpu_cases.recorded_gpu("convnet"),
        batch_size=recorded("convnet")["batch_size"], steps=recorded("convnet")["steps"],
        margin=0, keep_snapshot=True,
    )
    ours = _conv_workspaces(e.snapshot, real=False)
    real = _conv_workspaces(torchmem.load_snapshot(gpu_cases.DATA / "convnet.pickle"), True)
    assert len(ours) == len(real) == 2 * 15  # 5 convolutions x (forward, data, weight) x 2 steps
    for i, (o, r) in enumerate(zip(ours, real)):
        if i % 15 == 1:  # the 64 -> 128 forward
            assert r < o
        elif i % 15 >= 5 and (i % 15 - 5) % 2 == 1:  # weight gradients: split-K on top
            assert o < r, (i, o, r)
        else:
            assert 0 <= r - o < 256, (i, o, r)
    s = recorded("convnet")["stats"]
    # the weight gradient's partial filters are the rest of the allocated peak (-1.76 % before)
    assert abs(rel(e.peak_allocated_bytes, s["allocated_bytes.all.peak"])) < 0.011
    # reserved is 26% low (the split-K partials), yet within the default margin: no false fits
    assert gpu_cases.case_false_fits("convnet", e) is None


def test_gradient_accumulation_in_place_expandable():
    # autograd adds a residual's second gradient into the first in place (InputBuffer);
    # under fake tensors PyTorch takes the out-of-place path (one 16 MiB block more per
    # residual), which expandable segments map as more pages (reserved +0.48 % before)
    e = estimate_case("alloc_expandable")
    s = assert_goals("alloc_expandable", e)
    assert e.peak_reserved_bytes == s["reserved_bytes.all.peak"]


def test_driver_address_order_checkpoint():
    # with activation checkpointing the step's blocks tie on size more often; the allocator
    # takes the lowest address among equal sizes, and the CUDA driver places new segments
    # below the earlier ones: with rising addresses the reserved peak was 9.3 % over
    e = estimate_case("checkpoint_fp32")
    s = assert_goals("checkpoint_fp32", e)
    assert e.peak_reserved_bytes == s["reserved_bytes.all.peak"]
    assert abs(e.peak_allocated_bytes - s["allocated_bytes.all.peak"]) < (1 << 20) // 4


def test_driver_address_order_gpt_bf16():
    e = estimate_case("gpt_bf16_b8")
    s = assert_goals("gpt_bf16_b8", e)
    assert e.peak_reserved_bytes == s["reserved_bytes.all.peak"]  # +0.77 % with rising ones


def test_convnet_exact_given_the_real_cudnn_workspace_sizes(monkeypatch):
    # everything but the sizes cuDNN's heuristics pick is modelled exactly: with each call's
    # workspace size taken from the real trace (same calls, same order), both peaks are exact
    from torchmem.fit.fakegpu.kernels import _emulation as _cuda  # where transients() looks it up

    real = iter(_conv_workspaces(torchmem.load_snapshot(gpu_cases.DATA / "convnet.pickle"), True))
    modelled = _cuda._cudnn_conv_transients

    def real_sizes(func: Any, args: Any, cc: Any) -> list[Any]:
        return [(next(real), *rest) for _, *rest in modelled(func, args, cc)]

    monkeypatch.setattr(_cuda, "_cudnn_conv_transients", real_sizes)
    e = estimate_case("convnet")
    s = recorded("convnet")["stats"]
    assert e.peak_allocated_bytes == s["allocated_bytes.all.peak"]
    assert e.peak_reserved_bytes == s["reserved_bytes.all.peak"]
