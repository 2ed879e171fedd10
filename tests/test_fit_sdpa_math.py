"""The math attention fallback in the estimate runs the GPU's operator order
(:func:`torchmem.fit.fakegpu.kernels._sdpa._math`), and in-place operators on values the
estimate knows keep them right.

Ground truth: PyTorch's own composite ``_scaled_dot_product_attention_math`` run for real on the
CPU without any dispatch mode (the profiler records its operators; a dispatch mode or a fake
tensor would switch it to its out-of-place branch, which is what the estimate had run).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import torchmem
from torchmem.fit.fakegpu.kernels._sdpa import _math

_KEEP = {"aten::empty_strided", "aten::add_", "aten::add", "aten::_safe_softmax",
         "aten::_softmax_backward_data", "aten::mul", "aten::new_empty_strided", "aten::ones",
         "aten::tril", "aten::where", "aten::_to_copy", "aten::repeat_interleave", "aten::bmm"}


def _ops(fn, dtype: torch.dtype, causal: bool, gqa: bool, masked: bool) -> list[tuple[str, str]]:
    """The operators (with their input shapes) that allocate or decide the layout, forward and
    backward, in the order they ran (CPU bmm's own per-matrix copies left out)."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 64, 16
    kv = 2 if gqa else h
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv, s, d, dtype=dtype, requires_grad=True)
    mask = torch.zeros(b, 1, s, s, dtype=dtype) if masked else None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        fn(q, k, v, mask, 0.0, causal, None, gqa).float().sum().backward()
    out = []
    for e in sorted(p.events(), key=lambda e: e.time_range.start):
        parent = e.cpu_parent
        if e.name in _KEEP and (parent is None or parent.name != "aten::bmm"):
            out.append((e.name, str(e.input_shapes[:2])))
    return out


def _composite(q, k, v, mask, dropout, causal, scale, gqa):  # noqa: ANN001, ANN202
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          is_causal=causal, scale=scale, enable_gqa=gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal, gqa, masked", [(False, False, True), (False, False, False),
                                                 (False, True, True), (True, False, False)])
def test_the_math_fallback_runs_the_composites_order(dtype, causal, gqa, masked) -> None:
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        real = _ops(_composite, dtype, causal, gqa, masked)
    ours = _ops(_math, dtype, causal, gqa, masked)
    if masked:  # the point: the mask goes into the scores in place
        assert ("aten::add_", "[[2, 4, 64, 64], [2, 1, 64, 64]]") in real
    assert ours == real


def test_the_estimate_adds_the_mask_in_place() -> None:
    """Two scores-sized blocks in each forward (the scores, the softmax), not three."""
    b, h, s = 8, 4, 256
    scores = b * h * s * s * 4

    def build(batch: int):
        q = torch.randn(batch, h, s, 16, device="cuda", requires_grad=True)
        kv = torch.randn(batch, 2, s, 16, device="cuda", requires_grad=True)  # math: GQA

        def step() -> None:
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True).sum()
        return step

    e = torchmem.estimate(build, gpu="H100-80GB", batch_size=b, steps=1, keep_snapshot=True)
    assert e.attention_kernel == "math"
    made = [t.size for t in e.snapshot.traces[0] if t.action == "alloc" and t.size == scores]
    assert len(made) == 2


def test_in_place_updates_of_known_host_values_apply() -> None:
    """torch 2.11's AdamW counts its steps in host tensors with ``_foreach_add_`` and reads
    them back (``1 - beta1 ** step``): the estimate ran the add on a fake copy, read 0 and
    divided by zero. Host tensors made from numbers are real; the add now updates them."""
    seen: list[float] = []

    def build(batch: int):
        x = torch.zeros(4, device="cuda")

        def step() -> None:
            steps = [torch.tensor(0.0), torch.tensor(2.0)]
            torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
            torch._foreach_add_(steps, 1)
            seen.extend(s.item() for s in steps)
            (x + 1).sum()
        return step

    torchmem.estimate(build, gpu="H100-80GB", batch_size=1, steps=1)
    assert seen == [2.0, 4.0]
