"""``scaled_dot_product_attention`` with CUDA's backend choice (``sdp_utils.cpp``: cuDNN first
on sm90/sm10x, then flash, memory-efficient, math, from dtype, head dim, mask, dropout and
compute capability) and the CUDA op each backend calls, whose fake kernel allocates what the
CUDA kernel does (``attention.cpp``'s mask handling and dropout included).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from torchmem.fit.fakegpu.kernels._common import _ENV_TRUE

# -- scaled_dot_product_attention with CUDA's backend choice --------------------------------------

_FLASH, _EFFICIENT, _MATH, _CUDNN = "flash", "efficient", "math", "cudnn"


def _cudnn_first(cc: tuple[int, int]) -> bool:
    """``check_prefer_cudnn_attention`` (sdp_utils.cpp, PyTorch 2.13): cuDNN attention goes
    first on sm90 and sm10x when the runtime cuDNN is newer than 9.15 (the CUDA 13 wheels'),
    unless the environment sets ``TORCH_CUDNN_SDPA_DEPRIORITIZED``."""
    off = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in _ENV_TRUE
    return cc[0] in (9, 10) and not off


def _cudnn_ok(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, cc: tuple[int, int]
) -> bool:
    """``can_use_cudnn_attention`` for dense inputs on a recent cuDNN (> 9.22: head dims up to
    256 on sm90/sm10x; backward only for head dims <= 128, (192, 128) or (256, 256))."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False
    if dropout * 16.0 != math.floor(dropout * 16.0) or not (8, 0) <= cc <= (12, 1):
        return False
    if any(t.size(-2) == 0 or t.size(-1) == 0 for t in (q, k, v)):
        return False
    if not all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (q, k, v)):
        return False
    b, h, s_q, d_qk = q.shape
    hk, s_k, d_v = k.size(1), k.size(-2), v.size(-1)
    if not (q.size(0) == k.size(0) == v.size(0) and hk == v.size(1) and h % hk == 0):
        return False
    if b > 65535 or h > 65535 or d_qk != k.size(-1):
        return False
    limit = 256 if cc == (9, 0) or cc[0] == 10 else 128
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or s_k == 1:
        return False
    if dropout != 0.0 and s_q == 1:
        return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return not grad or (
        (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    )


def _sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    is_causal: bool,
    enable_gqa: bool,
    cc: tuple[int, int],
) -> str:
    """The backend CUDA's ``select_sdp_backend`` picks (priority: cuDNN on sm90/sm10x, then
    flash, efficient, math; the user's ``torch.backends.cuda.enable_*_sdp`` switches are
    honoured)."""
    backends = torch.backends.cuda
    if _cudnn_first(cc) and _cudnn_ok(q, k, v, dropout, cc):
        return _CUDNN
    dense = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    same_batch = dense and q.size(0) == k.size(0) == v.size(0)
    same_heads = dense and q.size(1) == k.size(1) == v.size(1)
    gqa_ok = same_heads or (
        enable_gqa and dense and k.size(1) == v.size(1) and q.size(1) % k.size(1) == 0
    )
    nonzero = dense and all(t.size(-2) > 0 and t.size(-1) > 0 for t in (q, k, v))
    stride_ok = dense and all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (q, k, v))
    d_qk, d_v = q.size(-1), v.size(-1)
    low = {torch.float16, torch.bfloat16} if cc >= (8, 0) else {torch.float16}
    if (
        backends.flash_sdp_enabled()
        and dense
        and same_batch
        and gqa_ok
        and nonzero
        and stride_ok
        and mask is None
        and d_qk == k.size(-1) == d_v
        and d_qk <= 256
        and (8, 0) <= cc <= (12, 1)
        and q.dtype in low
        and q.dtype == k.dtype == v.dtype
        and not (is_causal and q.size(-2) != k.size(-2))
        and _flash_grad_head_dim_ok(q, k, v, dropout, cc)
    ):
        return _FLASH
    align = _gemm_alignment(q.dtype, cc)
    eff_dtypes = (
        {torch.float16, torch.float32, torch.bfloat16}
        if cc >= (8, 0)
        else {torch.float16, torch.float32}
    )
    if (
        backends.mem_efficient_sdp_enabled()
        and (5, 0) <= cc <= (12, 1)
        and dense
        and same_batch
        # no grouped query heads: sdp_utils.cpp checks its dense inputs with
        # check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention*/>
        and same_heads
        and nonzero
        and all(t.stride(-1) == 1 for t in (q, k, v))
        and d_qk == k.size(-1)
        and d_qk % align == 0
        and d_v % align == 0
        and q.dtype in eff_dtypes
        and q.dtype == k.dtype == v.dtype
        and (
            cc < (8, 0)
            or all((t.storage_offset() * t.element_size()) % (align * t.element_size()) == 0
                   for t in (q, k, v))
        )
    ):  # fmt: skip
        return _EFFICIENT
    return _MATH


_SDPA_NAMES = {
    _CUDNN: "cuDNN attention kernel (no S x S scores kept; PyTorch's CUDA 13 wheels put it "
            "first on sm90/sm10x, TORCH_CUDNN_SDPA_DEPRIORITIZED=1 gives flash)",
    _FLASH: "flash kernel (no S x S scores kept)",
    _EFFICIENT: "memory-efficient kernel (no S x S scores kept)",
    _MATH: "math fallback (keeps batch x heads x L x S scores)",
}


def _sdpa_inputs(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, backend: str,
    cc: tuple[int, int],
) -> str:
    """What decided an SDPA call's backend, in words: dtype, head dim, mask, and why the
    backends ahead of it in CUDA's priority order were not taken."""
    dtype = str(q.dtype).removeprefix("torch.")
    head = q.size(-1) if q.dim() else 0
    masked = "causal" if causal else ("no mask" if mask is None else "explicit attn_mask")
    low = {torch.float16, torch.bfloat16} if cc >= (8, 0) else {torch.float16}
    low_name = "float16/bfloat16" if cc >= (8, 0) else "float16"
    why: list[str] = []
    if backend != _CUDNN and _cudnn_first(cc):
        if q.dtype not in low:
            why.append(f"cuDNN needs {low_name}")
        elif head % 8 or head > 256:
            why.append("cuDNN needs a head dim that is a multiple of 8, at most 256")
        elif head > 128 and torch.is_grad_enabled() and q.requires_grad:
            why.append("cuDNN's backward takes head dims <= 128, 192/128 or 256")
        else:
            why.append("cuDNN's other checks (dropout in 1/16 steps, key length > 1, shapes)")
    if backend not in (_CUDNN, _FLASH):
        if not (8, 0) <= cc <= (12, 1):
            why.append("flash needs compute capability 8.0-12.1")
        elif q.dtype not in low:
            why.append(f"flash needs {low_name}")
        elif mask is not None:
            why.append("flash takes no attn_mask")
        elif head > 256:
            why.append("flash needs head dim <= 256")
        elif causal and q.dim() >= 2 and k.dim() >= 2 and q.size(-2) != k.size(-2):
            why.append("flash's causal mask needs as many queries as keys")
        else:
            why.append("flash's other checks (strides, shapes, backends enabled)")
    if backend == _MATH:
        why.append(f"memory-efficient needs head dim a multiple of {_gemm_alignment(q.dtype, cc)}"
                   " and a supported dtype")
    tail = f"; {', '.join(why)}" if why else ""
    return f"{dtype}, head dim {head}, {masked}{tail}"


def _flash_grad_head_dim_ok(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, cc: tuple[int, int]
) -> bool:
    """Flash refuses training with head dim in (192, 224] (or (224, 256] with dropout) on
    sm86-89 and sm120-121 (its backward cannot run there)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not needs_grad or not ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
        return True
    d = q.size(-1)
    return d <= 192 or (dropout == 0.0 and d > 224)


def _gemm_alignment(dtype: torch.dtype, cc: tuple[int, int]) -> int:
    """``minimum_gemm_alignment`` of sdp_utils.cpp (elements)."""
    half = dtype in (torch.float16, torch.bfloat16)
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and half)
    align = 4 if cc[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def _sdpa(cc: tuple[int, int], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``scaled_dot_product_attention`` as on CUDA (runs below the autocast key)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    p = dict(zip(names, args))
    p.update(kwargs)
    q, k, v = p["query"], p["key"], p["value"]
    mask = p.get("attn_mask")
    dropout = float(p.get("dropout_p", 0.0) or 0.0)
    is_causal = bool(p.get("is_causal", False))
    scale = p.get("scale")
    enable_gqa = bool(p.get("enable_gqa", False))
    backend = _sdpa_backend(q, k, v, mask, dropout, is_causal, enable_gqa, cc)
    if mask is not None and mask.dtype == torch.bool:
        # convert_boolean_attn_mask: where(!mask, -inf, scalar_tensor(0)) in the query's dtype
        zero = torch.scalar_tensor(0.0, dtype=q.dtype, device=mask.device)
        mask = torch.where(mask.logical_not(), -math.inf, zero)
    if backend == _CUDNN:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, mask, True, dropout, is_causal, False, scale=scale
            )[0]
        # Without grad the CUDA kernel (MHA.cpp) allocates only the output, in q's layout; the
        # fake kernel would also allocate the softmax stats (b, h, s_q, 1) fp32.
        return _like_layout(q, (q.size(0), q.size(1), q.size(2), v.size(-1)))
    if backend == _FLASH:
        head = q.size(-1)
        if scale is None:
            scale = 1.0 / math.sqrt(head)
        if head % 8:
            pad = 8 - head % 8
            q, k, v = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout, is_causal, False, scale=scale
        )[0]
        return out[..., :head] if head % 8 else out
    if backend == _EFFICIENT:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if mask is not None:
            mask = _pad_mask(mask, q, k)
        if q.size(1) != k.size(1):  # grouped-query attention: k, v repeated per query head
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, grad, dropout, is_causal, scale=scale
        )[0]
    return _math(q, k, v, mask, dropout, is_causal, scale, enable_gqa)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          dropout: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """The math fallback as it runs on a GPU, operator for operator.

    PyTorch's ``_scaled_dot_product_attention_math`` (a composite) adds the mask into the
    scores in place, unless a tensor is "subclass-like", which every fake tensor is, and which
    any dispatch mode (the estimate's) makes every tensor: the composite then adds out of place,
    one scores-sized block more in each attention's forward than on the GPU (the transformers
    ``Trainer`` case on an H100 was 6.8 % low). This runs the GPU's order: 16-bit inputs upcast
    to fp32 (unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``), the query
    scaled by sqrt(scale), a causal mask built, grouped key/value heads repeated, the scores
    ``q @ (k^T * sqrt(scale))``, the mask added in place, ``_safe_softmax``, dropout, the
    weights cast back (made, then dropped) and ``weights @ v`` cast back. Checked against the
    composite run without a dispatch mode (the profiler's operator sequence, fp32 and bf16; with
    a mask, causal, grouped-query) in tests/test_fit_sdpa_math.py.

    Example:
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeTensorMode():
        ...     q = torch.empty(2, 4, 64, 16)
        ...     _math(q, q, q, torch.zeros(2, 1, 64, 64), 0.0, False, None, False).shape
        torch.Size([2, 4, 64, 16])
    """
    origin = q.dtype
    if origin in (torch.float16, torch.bfloat16) and \
            not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.float(), k.float(), v.float()
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    q = q * root
    if is_causal:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        mask = torch.where(causal.logical_not(), -math.inf,
                           torch.scalar_tensor(0.0, dtype=q.dtype))
    if enable_gqa and q.size(-3) != k.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scores = torch.matmul(q, k.transpose(-2, -1) * root)
    if mask is not None:
        scores.add_(mask)
    weights = torch.ops.aten._safe_softmax(scores, -1)
    del scores
    if dropout > 0:
        weights = torch.dropout(weights, dropout, True)
    returned = weights.to(origin)  # the composite returns the weights too, cast first
    out = torch.matmul(weights, v).to(origin)
    del returned
    return out


def _like_layout(q: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dims are laid out in ``q``'s stride order
    (``alloc_with_matching_layout`` of PyTorch's attention kernels)."""
    q_strides = tuple(q.stride())
    order = sorted(range(4), key=lambda i: -q_strides[i])
    strides = [0] * 4
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device)


def _pad_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` for the memory-efficient kernel: unless every stride but the last is
    a multiple of 16 (and the last is 1), the mask is padded by ``16 - last % 16`` columns (a
    copy) and sliced back; then expanded (a view) to (batch, heads, L, S)."""
    target = (q.size(0), q.size(1), q.size(-2), k.size(-2))
    aligned = all(mask.stride(i) % 16 == 0 for i in range(mask.dim() - 1)) and (
        mask.stride(-1) == 1
    )
    if not aligned:
        last = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 16 - last % 16))[..., :last]
    return mask.expand(target)


def _dropout(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """``aten::dropout`` as on CUDA (Dropout.cpp): in training, for 0 < p < 1 and a non-empty
    input, the fused ``native_dropout`` kernel, which keeps a ``bool`` mask (1 byte per
    element) for backward; the CPU path (``_dropout_impl``) keeps a noise tensor of the input's
    dtype (4 bytes per element in fp32)."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]  # type: ignore[no-any-return]
    if p == 0.0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)  # p == 1
