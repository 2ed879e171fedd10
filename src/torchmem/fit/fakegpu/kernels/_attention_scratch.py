"""Scratch buffers of CUDA's attention kernels, allocated after their outputs and freed before
they return: the flash backward (``flash_api.cpp``), the memory-efficient forward and backward
(``attention.cu``, ``kernel_backward.h``) and the math path's ``_safe_softmax``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchmem.fit.fakegpu.kernels._common import Transient

_FLASH_BACKWARD = getattr(
    getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None), "default", None
)


def _flash_backward_transients(args: Sequence[Any], num_mp: int) -> list[tuple[int, str]]:
    """Scratch of ``_flash_attention_backward`` + flash's ``mha_bwd`` (PyTorch's flash_api.cpp)
    for ``_scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, ...)``."""
    grad_out, q, k, _v, out = args[:5]
    b, h, seq_q, d = q.shape
    h_k, seq_k = k.size(1), k.size(2)
    found: list[tuple[int, str]] = []
    for t, what in ((grad_out, "grad_out"), (out, "out")):  # "CUDA code assumes dout contiguous"
        if not t.transpose(1, 2).is_contiguous():
            found.append((t.numel() * t.element_size(), f"flash backward: contiguous {what}"))

    def up(x: int, m: int) -> int:
        return -(-x // m) * m

    q_rounded, d_rounded = up(seq_q, 128), up(d, 32)
    found.append((b * h * q_rounded * 4, "flash backward: softmax_d"))
    accum = b * q_rounded * h * d_rounded * 4
    if torch.are_deterministic_algorithms_enabled():
        accum *= -(-num_mp // (b * h))  # zeros({nsplits, ...})
    found.append((accum, "flash backward: dq accumulator"))
    if h_k != h:  # MQA/GQA: dK, dV for every query head, summed into the k/v heads after
        n = b * seq_k * h * d * q.element_size()
        found += [(n, "flash backward: expanded dk"), (n, "flash backward: expanded dv")]
    return found


_EFFICIENT_BACKWARD = getattr(
    getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", None),
    "default",
    None,
)
_EFFICIENT_FORWARD = getattr(
    getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None), "default", None
)

#: Compute capabilities whose opt-in shared memory per block (>= 163 KB) fits the
#: memory-efficient backward's 128-row kernels; the others (sm75, sm86, sm89, sm120: 64 to
#: 99 KB) fall back to 64-row blocks (generate_kernels.py: "fallback to 64 for GPUs with less
#: shmem").
_BIG_SMEM = {(8, 0), (8, 7), (9, 0), (10, 0), (10, 3), (11, 0)}


def _efficient_backward_kernel(
    half: bool, max_k: int, cc: tuple[int, int]
) -> tuple[int, int, bool] | None:
    """The memory-efficient backward kernel ``dispatch_cutlassB`` launches (the first of
    generate_kernels.py's sorted list that fits): ``(block_i, block_j, output_in_rf)``, or
    ``None`` when no kernel takes the head dim."""
    sm = 80 if cc >= (8, 0) else (75 if cc >= (7, 5) else (70 if cc >= (7, 0) else 50))
    for kmax in (32, 64, 96, 128, 2**16):
        if kmax < max_k:
            continue
        if kmax == 96:  # sm86/89's K<=96 kernel (128 x 64, outputs in registers), half only
            if half and cc in ((8, 6), (8, 9)):
                return 128, 64, True
            continue
        blocks = [64]
        if kmax > 64 and (sm >= 80 or (sm >= 70 and half)):
            blocks.insert(0, 128)  # sort order: the highest block_i first
        for bi in blocks:
            if bi == 128 and cc not in _BIG_SMEM and not (sm == 70 and cc == (7, 0)):
                continue
            rf = half and kmax <= bi
            preload = half and sm >= 80 and rf
            bj = 128 if (preload and kmax > 64) else 64
            return bi, bj, rf
    return None


def _efficient_backward_transients(
    args: Sequence[Any], kwargs: dict[str, Any], cc: tuple[int, int]
) -> list[Transient]:
    """Scratch of ``_efficient_attention_backward`` (attention_backward.cu, PyTorch 2.11) for
    ``_scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, bias, out, lse, ...)``
    (inputs in (B, H, M, K) layout; the kernel works in (B, M, H, K)).

    - ``grad_out.contiguous()`` in (B, M, H, Kv) when it is not.
    - ``delta`` (B, H, M) fp32: an empty buffer the kernel fills (half precision), else
      ``(grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()``: the casts
      (half only), the product and the row sums are live until ``delta`` exists, then freed.
    - the kernel's workspace (``Params::workspace_size``, kernel_backward.h), per (batch,
      head), in floats: for dQ always (split keys enabled), per block of ``block_i`` queries
      and ``block_j`` head-dim columns one ``GradQTempStorage`` (4 ints + ``block_i *
      block_j`` floats); for dK and dV in half precision when the head dim exceeds what the
      kernel keeps in registers, ``num_splits_key`` copies of keys x head dim, rounded up to
      the blocks; the sum rounded up to 4 floats. Zeroed when keys are split: no other
      buffer.

    Example:
        >>> import torch
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeTensorMode():
        ...     q = torch.empty(8, 16, 2048, 64, dtype=torch.bfloat16)
        ...     out = torch.empty(8, 2048, 16, 64, dtype=torch.bfloat16).transpose(1, 2)
        >>> [(n, label.split(": ")[1]) for n, label, *_ in _efficient_backward_transients(
        ...     (out, q, q, q, None, out), {}, (9, 0))]
        [(1048576, 'delta'), (67174400, 'workspace')]
    """
    grad_out, q, k, v = args[:4]
    b, h, m, dk = q.shape
    n, dv = k.size(2), v.size(3)
    half = q.dtype in (torch.float16, torch.bfloat16)
    kernel = _efficient_backward_kernel(half, max(dk, dv), cc)
    found: list[Transient] = []
    if not grad_out.transpose(1, 2).is_contiguous():
        found.append((grad_out.numel() * grad_out.element_size(),
                      "efficient backward: contiguous grad_out"))
    if kernel is None:
        return found
    bi, bj, rf = kernel
    delta = b * h * m * 4
    computes_delta = half and (rf or not (7, 0) <= cc < (7, 5))  # kKernelComputesDelta
    if computes_delta:
        found.append((delta, "efficient backward: delta"))
    else:
        first = len(found)
        full = b * m * h * dv * 4
        parts = []
        if half:
            parts += [(full, "efficient backward: grad_out as fp32"),
                      (full, "efficient backward: out as fp32")]
        parts += [(full, "efficient backward: grad_out * out"),
                  (b * m * h * 4, "efficient backward: row sums")]
        found.extend(parts)
        temporaries = tuple(range(first + len(parts) - 1, first - 1, -1))
        found.append((delta, "efficient backward: delta", temporaries))

    def up(x: int, to: int) -> int:
        return -(-x // to) * to

    accum_kv = half and not rf
    splits = max(-(-n // bj), 1)
    if b * h >= 256 and n <= 2 * bj:
        splits = 1
    if accum_kv:
        splits = min(splits, 200 // (b * h))
    if splits < 1 or torch.are_deterministic_algorithms_enabled():
        splits = 1
    gk = splits * up(n, bj) * up(dk, bi) if accum_kv else 0
    gv = splits * up(n, bj) * up(dv, bi) if accum_kv else 0
    gq = -(-m // bi) * -(-dk // bj) * (4 + bi * bj)
    workspace = b * h * up(gk + gv + gq, 4) * 4
    if workspace:
        found.append((workspace, "efficient backward: workspace"))
    return found


def _efficient_forward_transients(args: Sequence[Any], out: Any) -> list[Transient]:
    """Scratch of ``_efficient_attention_forward`` (attention.cu): the kernel for head dims
    over 128 (``kMaxK`` 65536, 128 keys per block) accumulates the output in fp32 when the
    output is half precision (``kNeedsOutputAccumulatorBuffer``): a (B, M, H, Kv) fp32 buffer
    after the outputs, freed on return.

    Example:
        >>> import torch
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeTensorMode():
        ...     q = torch.empty(2, 4, 128, 256, dtype=torch.float16)
        ...     o = torch.empty(2, 4, 128, 256, dtype=torch.float16)
        >>> _efficient_forward_transients((q, q, q), (o,))
        [(1048576, 'efficient forward: fp32 output accumulator')]
    """
    q, v = args[0], args[2]
    o = out[0] if isinstance(out, (tuple, list)) else out
    half = q.dtype in (torch.float16, torch.bfloat16)
    if not half or max(q.size(-1), v.size(-1)) <= 128 or not isinstance(o, torch.Tensor):
        return []
    return [(o.numel() * 4, "efficient forward: fp32 output accumulator")]


_SAFE_SOFTMAX = getattr(getattr(torch.ops.aten, "_safe_softmax", None), "default", None)


def _safe_softmax_transients(args: Sequence[Any], out: Any) -> list[Transient]:
    """The temporaries of ``aten::_safe_softmax``'s composite kernel (the math attention's
    softmax, ``attention.cpp``): after the softmax (the output, written in place by
    ``where_out``) come ``self.isneginf()`` (1 B per element), ``all`` of it along ``dim``
    (1 B per row) and a zero scalar of the output's dtype; all freed when the call returns.

    Example:
        >>> import torch
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeTensorMode():
        ...     x = torch.empty(8, 4, 256, 256)
        ...     y = torch.ops.aten._safe_softmax(x, -1)
        >>> _safe_softmax_transients((x, -1), y)
        [(2097152, 'safe softmax: -inf mask'), (8192, 'safe softmax: masked rows'), (4, 'safe softmax: zero')]
    """
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() == 0:
        return []
    dim = int(args[1]) if len(args) > 1 else -1
    numel = x.numel()
    rows = numel // max(int(x.shape[dim]), 1)
    return [(numel, "safe softmax: -inf mask"), (rows, "safe softmax: masked rows"),
            (out.element_size(), "safe softmax: zero")]
