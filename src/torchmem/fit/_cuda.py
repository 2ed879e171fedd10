"""CUDA behaviour on a CPU-only build: what a fake run must do differently to allocate like CUDA.

An estimate runs the user's step on fake tensors on a CPU-only PyTorch build (fake *CPU* tensors
stand in for the GPU's memory: on such a build fake CUDA tensors abort the process in autograd,
whose engine asks the missing CUDA runtime for streams). Where a CUDA kernel allocates
differently from what the CPU/fake path would, :class:`CudaEmulation` makes the run follow CUDA:

- **autocast**: ``torch.autocast("cuda", dtype=...)`` in user code applies *CUDA's* autocast
  policy (the op lists of ``aten/src/ATen/autocast_mode.cpp``, CUDA section) to the fake tensors,
  with autocast's weight-cast cache. A CPU-only build compiles the AutocastCUDA kernels in, but
  they only see tensors whose device is CUDA; this module registers Python kernels for the
  *AutocastCPU* key that apply the CUDA policy whenever CUDA autocast is on, and neutralises the
  CPU-only autocast entries (CPU's policy is a different list).
- **scaled_dot_product_attention** picks its backend with CUDA's rules (``sdp_utils.cpp``: cuDNN
  first on sm90/sm10x, then flash, memory-efficient, math, from dtype, head dim, mask,
  dropout, compute capability)
  and calls the CUDA op, whose fake (meta) kernel allocates what the CUDA kernel does: output
  plus logsumexp, no S x S matrix.
- **accelerate** (and transformers' ``Trainer``, which runs on it) sees the CUDA device, so its
  ``fp16`` mixed precision autocasts with a gradient scaler (:mod:`torchmem.fit._accelerate`).
- **optimizers** default to the ``foreach`` implementation as on CUDA (``_foreach_*`` ops
  allocate whole intermediate lists; the CPU default is the per-parameter loop).
- :meth:`CudaEmulation.transients` gives the scratch buffers a CUDA kernel allocates after its
  outputs and frees before it returns (multi-block reduction staging), and
  :attr:`CudaEmulation.gemm_workspace_bytes` the cuBLAS workspace each (thread, stream) pins.

:data:`MODELLED` lists each case, what differs on CUDA and how it is modelled, for the docs.

Why one module of about 1,000 lines: it is the one place that ports CUDA-only rules, each
from its PyTorch source (autocast_mode.cpp's op lists, sdp_utils.cpp's backend choice,
attention.cpp's mask handling, flash_api.cpp's backward scratch, Reduce.cuh's launch
configuration, CublasHandlePool.cpp's workspace size); its sections split cleanly into
``_cuda_autocast``, ``_cuda_sdpa`` and ``_cuda_reduce`` should it grow further.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), CudaEmulation((8, 0)):
    ...     x, w = torch.empty(4, 8), torch.empty(16, 8, requires_grad=True)
    ...     with torch.autocast("cuda", dtype=torch.bfloat16):
    ...         y = x @ w.T                   # CUDA: matmul runs in bf16
    ...         z = torch.exp(y)              # CUDA: exp runs in fp32
    >>> y.dtype, z.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchmem.errors import InvalidInputError

__all__ = ["MODELLED", "CudaEmulation", "Transient"]

#: One scratch buffer of :meth:`CudaEmulation.transients`: ``(bytes, label)``, or
#: ``(bytes, label, frees)`` where ``frees`` are the indices of earlier scratch buffers of the
#: same call that the kernel frees right after allocating this one (in that order).
Transient = tuple[int, str] | tuple[int, str, tuple[int, ...]]

# -- CUDA's autocast policy (aten/src/ATen/autocast_mode.cpp, the KERNEL_CUDA lists) ------------
# Overload names as the dispatcher registers them ("" is the default overload). The test checks
# that these sets together are exactly the ops registered for the AutocastCUDA key in this build.

#: Run in the autocast dtype (fp16/bf16): every floating-point tensor argument is cast.
LOWER_PRECISION_FP = frozenset(
    {
        "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
        "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
        "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
        "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention", "cudnn_convolution", "cudnn_convolution_transpose",
    }
)  # fmt: skip

#: Run in float32: every fp16/bf16 tensor argument is cast up (a copy).
FP32 = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
        "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "rms_norm", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    }
)  # fmt: skip

#: Reductions that get ``dtype=torch.float32`` when the caller gave none (no input copy).
FP32_SET_OPT_DTYPE = frozenset(
    {
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
        "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
        "sum.dim_IntList",
    }
)  # fmt: skip

#: ``norm`` overloads redirected to their ``dtype=float32`` overload (no input copy).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}

#: Run in the widest floating dtype among the arguments (fp32 if any is fp32).
PROMOTE = frozenset(
    {
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
        "index_put", "tensordot", "scatter_add",
    }
)  # fmt: skip

#: Refused under CUDA autocast (PyTorch raises; so do we, with PyTorch's advice).
BANNED = frozenset({"binary_cross_entropy"})

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
    "(CUDA autocast refuses them, and so does the estimate).\nUse "
    "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
    "which combine the sigmoid and the loss and are safe to autocast."
)

MODELLED: list[tuple[str, str, str]] = [
    (
        "autocast (fp16/bf16)",
        "torch.autocast('cuda') switches itself off on a CPU-only build; CUDA's op lists differ "
        "from CPU's (exp, pow, rsqrt, sum, softmax, norms and losses run in fp32 on CUDA)",
        "Python kernels on the AutocastCPU key apply CUDA's lists (lower precision, fp32, "
        "fp32-with-dtype, promote, banned) while CUDA autocast is on; casts of leaf fp32 "
        "parameters are cached for the autocast region as CUDA's cast cache does; 'cpu' and "
        "'cuda' name one autocast state (the fake tensors' device is cpu), so activation "
        "checkpointing recomputes under the autocast state it captured, as on CUDA",
    ),
    (
        "scaled_dot_product_attention",
        "CUDA runs cuDNN, flash or memory-efficient kernels that keep no S x S matrix",
        "the backend is chosen with CUDA's rules for the target compute capability (cuDNN "
        "attention first on sm90/sm10x, as PyTorch's CUDA 13 wheels do with cuDNN >= 9.15.1, "
        "unless TORCH_CUDNN_SDPA_DEPRIORITIZED is set; then flash, memory-efficient, math) "
        "and the CUDA "
        "op is called (its fake kernel allocates output + logsumexp (+ RNG state); the flash "
        "backward's scratch (softmax_d, fp32 dq accumulator, contiguous grad_out) comes from "
        "transients(), and so do the memory-efficient backward's delta and fp32 dQ (dK/dV) "
        "workspace and its forward's fp32 output accumulator (head dims > 128 in half "
        "precision); its forward's philox seed and offset stay on the host; head dims not "
        "a multiple of 8 are padded for flash; boolean masks are converted to additive masks, "
        "padded to a multiple of 16 for the memory-efficient kernel); math fallback otherwise. "
        "cuDNN's own workspace (sized by its heuristics at run time) is not modelled",
    ),
    (
        "accelerate's mixed precision (Accelerator(mixed_precision=\"fp16\"), the Trainer's fp16)",
        "on a CUDA device accelerate autocasts the forward in float16 and scales the loss "
        "with a GradScaler; on a CPU device it ignores fp16 and trains in float32",
        "accelerate's default device is CUDA and its per-process state the estimate's own "
        "(torchmem.fit._accelerate), so it autocasts (CUDA's policy, above) with a gradient "
        "scaler as on the GPU",
    ),
    (
        "optimizers (Adam, AdamW, SGD, ...)",
        "on CUDA the default implementation is foreach, whose _foreach_* ops allocate whole "
        "intermediate lists; the fake CPU run would take the per-parameter loop",
        "parameters on the fake device count as foreach-capable, so the optimizer takes the "
        "foreach path; fused=True runs the fused kernel (in place, like CUDA)",
    ),
    (
        "dropout (nn.Dropout, F.dropout)",
        "CUDA runs the fused native_dropout kernel, which saves a bool mask (1 B per element); "
        "the CPU path saves a noise tensor of the input's dtype (4 B per element in fp32)",
        "aten::dropout takes CUDA's path (native_dropout) in training for 0 < p < 1; the "
        "in-place dropout_ keeps its noise tensor on CUDA too",
    ),
    (
        "multi-block reductions",
        "CUDA reductions that split one output over several blocks allocate a staging buffer "
        "and a semaphore after the output and free them before returning",
        "CudaEmulation.transients(): sizes from Reduce.cuh's launch configuration",
    ),
    (
        "cuBLAS / cuBLASLt workspace",
        "one workspace per (thread, stream) becomes an allocator block at its first GEMM; "
        "cuBLASLt GEMMs (addmm with a bias, as nn.Linear runs) allocate a second one of their "
        "own unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1",
        "CudaEmulation.gemm_workspace_bytes: CUBLAS_WORKSPACE_CONFIG's default for the "
        "compute capability (8,519,680 B before Hopper, 32 MiB from 9.0); "
        "CudaEmulation.lt_workspace_bytes (CUBLASLT_WORKSPACE_SIZE, 1 MiB by default) at the "
        "first cuBLASLt GEMM of each thread (CudaEmulation.uses_cublaslt)",
    ),
    (
        "cuDNN convolution workspace (nn.Conv1d/2d/3d)",
        "cuDNN's tensor-core engines work in NHWC; on NCHW tensors they transpose the "
        "input, output and filter through a workspace the caching allocator hands out after "
        "the output and takes back when the call returns (the backward: input gradient, then "
        "weight gradient)",
        "CudaEmulation.transients(): input + output + filter bytes for each cuDNN call whose "
        "channels per group are a multiple of 4 (TF32, fp32 with "
        "torch.backends.cudnn.allow_tf32, from sm80) or 8 (fp16/bf16); none for channels-last "
        "tensors. The weight gradient's split-K partial filters and engines that skip a "
        "transpose come from cuDNN's closed heuristics and are not modelled",
    ),
    (
        "the math attention's softmax (aten::_safe_softmax)",
        "a composite kernel: on CUDA it allocates the softmax, then a bool -inf mask (1 B per "
        "element), its all-masked rows (1 B per row) and a zero scalar, and writes the result "
        "into the softmax's storage; a fake run calls its meta kernel, which allocates only "
        "the output",
        "CudaEmulation.transients(): the mask, the rows and the scalar after the output, freed "
        "in reverse order when the call returns (allocation sizes as on the recorded H100's "
        "hf_trainer run)",
    ),
    (
        "cuDNN RNN workspace and reserve (nn.LSTM/GRU/RNN)",
        "cuDNN allocates a workspace and a reserve space whose size comes from cuDNN at run time",
        "not modelled: the estimate shows the CPU implementation's memory for these modules",
    ),
]


# -- helpers ------------------------------------------------------------------------------------


def _eligible(t: Any) -> bool:
    """Autocast casts floating-point tensors other than float64 (all fake tensors are 'GPU')."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """Autocast's weight-cast cache: one cast per leaf fp32 tensor that requires grad, for the
    autocast region (cleared when the outermost region exits, like ``clear_autocast_cache``)."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        cacheable = (
            dtype == lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        hit = self._casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        self._casts[id(t)] = (weakref.ref(t), out)
        return out

    def clear(self) -> None:
        self._casts.clear()


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value) if _eligible(value) else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _iter_tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


# -- scaled_dot_product_attention with CUDA's backend choice --------------------------------------

_FLASH, _EFFICIENT, _MATH, _CUDNN = "flash", "efficient", "math", "cudnn"
_ENV_TRUE = ("1", "true", "on", "yes", "y")


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
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, mask, dropout, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


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


# -- multi-block reductions (aten/src/ATen/native/cuda/Reduce.cuh) ---------------------------

#: SM count of the typical card per compute capability (used when the caller gives none):
#: V100, T4, A100, A10/RTX 3090 (8.6: 82), Jetson Orin (8.7), L40S (8.9: 142), H100 SXM,
#: B200, RTX 5090.
_TYPICAL_SMS: dict[tuple[int, int], int] = {
    (7, 0): 80, (7, 5): 40, (8, 0): 108, (8, 6): 82, (8, 7): 16, (8, 9): 142, (9, 0): 132,
    (10, 0): 148, (12, 0): 170,
}  # fmt: skip

#: ``maxThreadsPerMultiProcessor`` (CUDA C programming guide, compute capabilities table).
_MAX_THREADS_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 2048, (7, 2): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 7): 2048,
    (8, 9): 1536, (9, 0): 2048, (10, 0): 2048, (10, 3): 2048, (12, 0): 1536, (12, 1): 1536,
}  # fmt: skip

_MAX_NUM_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double only)
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
_WARP = 32


def _acc_size(dtype: torch.dtype) -> int:
    """Bytes of the accumulator (``acc_type``) of a sum-like reduction over ``dtype``."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype.is_complex:
        return 16 if dtype == torch.complex128 else 8
    return 8  # double; integers and bool accumulate in int64


def _sum_like(x: torch.Tensor, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    dtype = kwargs.get("dtype")
    return _acc_size(dtype if isinstance(dtype, torch.dtype) else x.dtype)


def _with_index(x: torch.Tensor, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    # thrust::pair<scalar or acc, int64_t>: 16 bytes with the int64's alignment
    return 16


_REDUCTIONS: dict[Any, Callable[..., int]] = {}
for _name, _size in (
    ("sum", _sum_like), ("mean", _sum_like), ("nansum", _sum_like), ("prod", _sum_like),
    ("linalg_vector_norm", _sum_like), ("max", _with_index), ("min", _with_index),
    ("argmax", _with_index), ("argmin", _with_index),
):  # fmt: skip
    if hasattr(torch.ops.aten, _name):
        _REDUCTIONS[getattr(torch.ops.aten, _name)] = _size


def _reduce_dims(
    func: Any, x: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[int] | None:
    """The reduced dims of a reduction call (all dims for a full reduction); ``None`` when the
    overload is not a reduction over dims (``max(a, b)``, ``max()`` ...)."""
    name = func._overloadpacket.__name__
    overload = func._overloadname
    nd = x.dim()
    if name in ("max", "min"):
        if overload != "dim":
            return None  # max.default is a full reduction without indices; max.other elementwise
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return [int(dim) % max(nd, 1)]
    if name in ("argmax", "argmin"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None:
            return list(range(nd))
        return [int(dim) % max(nd, 1)]
    if name == "linalg_vector_norm":
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
    elif name == "prod" and overload == "dim_int":
        return [int(args[1] if len(args) > 1 else kwargs["dim"]) % max(nd, 1)]
    else:
        dim = (
            args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else kwargs.get("dim")
        )
        if overload == "default" and name in ("sum", "mean", "prod", "nansum"):
            dim = None
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(nd))
    if isinstance(dim, int):
        dim = [dim]
    return sorted({int(d) % max(nd, 1) for d in dim})


def _iterator_layout(
    x: torch.Tensor, reduced: list[int]
) -> tuple[list[int], list[int], list[int]] | None:
    """TensorIterator's view of a reduction: (shape, input strides in bytes, output strides)
    after its dimension reordering (reduced dims first, then by strides) and coalescing."""
    el = x.element_size()
    out_el = 1
    dims = [d for d in range(x.dim()) if x.size(d) != 1]
    if not dims:
        return [], [], []
    kept = [d for d in range(x.dim()) if d not in reduced]
    out_stride: dict[int, int] = {}
    acc = out_el
    for d in reversed(kept):  # the reduction's output is contiguous in logical order
        out_stride[d] = acc if x.size(d) != 1 else 0
        acc *= x.size(d)
    shape = {d: x.size(d) for d in dims}
    ins = {d: x.stride(d) * el for d in dims}
    outs = {d: (0 if d in reduced else out_stride[d]) for d in dims}

    def should_swap(a: int, b: int) -> int:
        sa, sb = outs[a], outs[b]
        if (sa == 0) != (sb == 0):
            return 1 if sb == 0 else -1
        for s0, s1 in ((sa, sb), (ins[a], ins[b])):
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[a] > shape[b]:
                return 1
        return 0

    perm = list(reversed(dims))  # fastest-moving first
    for i in range(1, len(perm)):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    out_shape = [shape[perm[0]]]
    out_in = [ins[perm[0]]]
    out_out = [outs[perm[0]]]
    for d in perm[1:]:
        if out_in[-1] * out_shape[-1] == ins[d] and out_out[-1] * out_shape[-1] == outs[d]:
            out_shape[-1] *= shape[d]
        else:
            out_shape.append(shape[d])
            out_in.append(ins[d])
            out_out.append(outs[d])
    return out_shape, out_in, out_out


def _reduce_config(
    x: torch.Tensor, reduced: list[int], arg_size: int, num_mp: int, max_threads_per_mp: int
) -> tuple[int, int] | None:
    """``setReduceConfig``: (staging bytes, semaphore bytes) when the launch reduces globally
    (several blocks per output), else ``None``."""
    numel = x.numel()
    if numel == 0 or numel * x.element_size() >= 2**31:
        return None  # empty, or split into 32-bit-indexable sub-iterators (not modelled)
    layout = _iterator_layout(x, reduced)
    if layout is None:
        return None
    shape, ins, outs = layout
    num_outputs = 1
    for n, o in zip(shape, outs):
        if o != 0:
            num_outputs *= n
    inputs_per_output = numel // num_outputs
    n_reduce = sum(1 for o in outs if o == 0)
    ndim = len(shape)
    scalar = x.element_size()
    if ndim > 0:
        fastest_reduce = n_reduce == ndim or ins[0] < ins[n_reduce]
        if fastest_reduce:
            dim0, dim1, fastest = inputs_per_output, num_outputs, ins[0]
        else:
            dim0, dim1, fastest = num_outputs, inputs_per_output, ins[n_reduce]
    else:
        fastest_reduce, fastest, dim0, dim1 = True, scalar, 1, 1
    output_vec = 1
    if fastest == scalar:
        if fastest_reduce and dim0 >= 128 and n_reduce == 1:
            dim0 //= 4  # vectorize along input (input_vec_size = vt0 = 4)
        elif not fastest_reduce:
            output_vec = 4
            for n in [shape[n_reduce]] + [s // scalar for j, s in enumerate(ins) if j != n_reduce]:
                while n % output_vec:
                    output_vec //= 2
            dim0 //= output_vec
    max_threads = _MAX_NUM_THREADS // output_vec

    def last_pow2(n: int) -> int:
        return max(1, 1 << (max(n, 1).bit_length() - 1))

    d0 = last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = last_pow2(dim1) if dim1 < max_threads else max_threads
    bw = min(d0, _WARP)
    bh = min(d1, max_threads // bw)
    bw = min(d0, max_threads // bh)
    threads = bw * bh
    step_in, step_out = 1, 1
    block_x_reduce = False
    if ndim == 0 or fastest_reduce:
        block_x_reduce = True
        step_in *= bw
    else:
        step_out *= bw

    def div_up(a: int, b: int) -> int:
        return -(-a // b)

    split_warps = div_up(inputs_per_output, step_in) >= min(bh * 16, _MAX_VALUES_PER_THREAD)
    if split_warps:
        step_in *= bh
    else:
        step_out *= bh
    grid = div_up(num_outputs // output_vec, step_out)
    target = num_mp * (max_threads_per_mp // threads)
    vpt = div_up(inputs_per_output, step_in)
    if not (split_warps and vpt >= _MAX_VALUES_PER_THREAD and grid <= target):
        return None
    ctas = max(
        min(div_up(target, grid), div_up(vpt, _MIN_VALUES_PER_THREAD)),
        div_up(vpt, _MAX_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return None
    staging = arg_size * num_outputs * ctas
    if not block_x_reduce:
        staging *= bw * output_vec
    return staging, 4 * grid


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


_LT_GEMMS = tuple(
    getattr(torch.ops.aten, name).default
    for name in ("addmm", "_addmm_activation")
    if hasattr(torch.ops.aten, name)
)


def _env_flag(name: str) -> bool | None:
    """``c10::utils::check_env``: ``True`` for "1"/"true", ``False`` for "0"/"false" (any
    case), ``None`` when unset or anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    return None


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


_CONVOLUTION = getattr(torch.ops.aten.convolution, "default", None)
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
_CONVOLUTION_BACKWARD = getattr(torch.ops.aten.convolution_backward, "default", None)


def _cudnn_conv_transients(
    func: Any, args: Sequence[Any], cc: tuple[int, int]
) -> list[Transient]:
    """The workspace a cuDNN convolution asks the caching allocator for when its tensors are
    NCHW and the engine it runs is a tensor-core one, which works in NHWC.

    PyTorch runs a CUDA ``aten::convolution`` on cuDNN (``ConvParams::use_cudnn``) through the
    v8/v9 graph API (``Conv_v8.cpp``): the plan's workspace is one block from the caching
    allocator, taken after the output and given back when the call returns; the backward
    (``cudnn_convolution_backward``) runs the data gradient (its output, then its workspace)
    before the weight gradient. cuDNN's tensor-core kernels work in NHWC; on NCHW tensors
    cuDNN transposes them through its workspace (cuDNN developer guide, "Tensor
    Transformations": NCHW-to-NHWC conversion to call the tensor-core operations), so the
    workspace holds an NHWC copy of each of the operation's three tensors: input, output and
    filter (``x``, ``y``, ``w`` of the forward; ``dx``, ``dy``, ``w`` of the data gradient;
    ``x``, ``dy``, ``dw`` of the weight gradient). Tensor cores run an fp32 convolution as
    TF32 (``torch.backends.cudnn.allow_tf32``, on by default, from compute capability 8.0),
    and fp16/bf16 from 7.0/8.0; they need the channels of each group to be a multiple of
    4 (TF32) or 8 (16-bit); channels-last tensors need no transform.

    What this leaves out, because only cuDNN's closed heuristics decide it: the engine's own
    scratch (a few bytes of alignment; the split-K partial filters a weight-gradient engine
    may add, seen as 4 to 15 filter copies on an H100), and engines that skip one of the
    transposes.

    Example:
        >>> import torch
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeTensorMode():
        ...     x = torch.empty(8, 64, 32, 32)
        ...     w = torch.empty(128, 64, 3, 3)
        ...     y = torch.empty(8, 128, 32, 32)
        >>> _cudnn_conv_transients(
        ...     torch.ops.aten.convolution.default,
        ...     (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), (9, 0))
        [(6586368, 'cuDNN convolution workspace: NHWC copies of input, output, filter')]
    """
    if func is _CONVOLUTION:
        x, w = args[0], args[1]
        groups = args[8] if len(args) > 8 else 1
        parts = ["forward"]
    elif func is _CONVOLUTION_BACKWARD:
        x, w = args[1], args[2]
        groups = args[9] if len(args) > 9 else 1
        mask = list(args[10]) if len(args) > 10 else [True, True, True]
        parts = [name for name, on in zip(("data gradient", "weight gradient"), mask) if on]
    else:
        return []
    if not parts or not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return []
    if not torch.backends.cudnn.enabled or x.dim() not in (3, 4, 5) or x.dim() != w.dim():
        return []
    dtype = x.dtype
    if dtype == torch.float32:
        if cc < (8, 0) or not torch.backends.cudnn.allow_tf32:
            return []
        align = 4
    elif dtype in (torch.float16, torch.bfloat16):
        if cc < ((8, 0) if dtype == torch.bfloat16 else (7, 0)):
            return []
        align = 8
    else:
        return []
    transposed = bool(args[6]) if func is _CONVOLUTION and len(args) > 6 else (
        bool(args[7]) if len(args) > 7 else False)
    g = int(groups) if isinstance(groups, int) else 1
    c_in, c_out = (w.size(0), w.size(1) * g) if transposed else (w.size(1) * g, w.size(0))
    if g < 1 or c_in % (g * align) or c_out % (g * align):
        return []
    channels_last = (
        x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    ) or (w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous())
    if x.dim() == 5:
        channels_last = (
            x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
        ) or (w.is_contiguous(memory_format=torch.channels_last_3d) and not w.is_contiguous())
    if channels_last:
        return []
    # the output's size from the convolution arithmetic (the backward has grad_output)
    if func is _CONVOLUTION_BACKWARD:
        y_numel = args[0].numel()
    else:
        stride, padding, dilation = args[3], args[4], args[5]
        out_pad = args[7] if len(args) > 7 else [0] * (x.dim() - 2)
        y_numel = x.size(0) * c_out
        for i, n in enumerate(x.shape[2:]):
            k = w.size(2 + i)
            s, p, d = stride[i % len(stride)], padding[i % len(padding)], dilation[i % len(dilation)]
            if transposed:
                o = (n - 1) * s - 2 * p + d * (k - 1) + out_pad[i % len(out_pad)] + 1
            else:
                o = (n + 2 * p - d * (k - 1) - 1) // s + 1
            y_numel *= max(o, 0)
    size = x.element_size()
    total = (x.numel() + y_numel + w.numel()) * size
    if not total:
        return []
    label = "cuDNN convolution workspace: NHWC copies of input, output, filter"
    if len(parts) == 1:
        return [(total, label)]
    # both gradients in one call: the data gradient's workspace is given back first
    return [(total, f"{label} ({parts[0]})"), (total, f"{label} ({parts[1]})", (0,))]


# -- the emulation --------------------------------------------------------------------------------

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_C_IS_ENABLED = torch.is_autocast_enabled  # the bindings, kept before anyone patches them
_C_GET_DTYPE = torch.get_autocast_dtype
_lock = threading.Lock()


class CudaEmulation:
    """Make a fake run on a CPU-only build allocate like CUDA on a GPU of ``compute_capability``.

    A context manager entered around the whole fake run (not re-entrant; one at a time per
    process). Everything it changes is restored on exit: the kernels it registered are removed,
    CPU autocast's state and dtype, the patched functions and the optimizers' device lists.

    Example:
        >>> import torch
        >>> from torch._subclasses import FakeTensorMode
        >>> emu = CudaEmulation((9, 0))
        >>> emu.gemm_workspace_bytes == 32 * 2**20          # cuBLAS workspace on an H100
        True
        >>> with FakeTensorMode(), emu:
        ...     q = torch.empty(2, 8, 1024, 64, dtype=torch.bfloat16)
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> out.shape, emu.last_sdpa_backend                  # cuDNN first on sm90
        (torch.Size([2, 8, 1024, 64]), 'cudnn')
    """

    def __init__(
        self,
        compute_capability: tuple[int, int],
        *,
        multiprocessors: int | None = None,
    ) -> None:
        ok = (
            isinstance(compute_capability, tuple)
            and len(compute_capability) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in compute_capability)
            and compute_capability >= (3, 0)
        )
        if not ok:
            raise InvalidInputError(
                "compute_capability must be a (major, minor) tuple of ints such as (8, 0) for an "
                f"A100 or (9, 0) for an H100, got {compute_capability!r}; take it from the GPU "
                "catalog or torch.cuda.get_device_capability() on the target machine"
            )
        self.compute_capability: tuple[int, int] = compute_capability
        if multiprocessors is not None and (
            not isinstance(multiprocessors, int)
            or isinstance(multiprocessors, bool)
            or multiprocessors < 1
        ):
            raise InvalidInputError(
                f"multiprocessors must be a positive int (the GPU's SM count, e.g. 108 for an "
                f"A100, 132 for an H100 SXM), got {multiprocessors!r}; leave it out to use the "
                "typical datacenter card of the compute capability"
            )
        major_minor = compute_capability
        #: Streaming multiprocessors of the target (reduction launch configuration).
        self.multiprocessors: int = multiprocessors or _TYPICAL_SMS.get(
            major_minor, _TYPICAL_SMS.get((major_minor[0], 0), 80)
        )
        #: ``maxThreadsPerMultiProcessor`` of the compute capability (CUDA's table).
        self.max_threads_per_sm: int = _MAX_THREADS_PER_SM.get(major_minor, 2048)
        #: The backend the last ``scaled_dot_product_attention`` call used (``None`` before one).
        self.last_sdpa_backend: str | None = None
        #: Every ``scaled_dot_product_attention`` call: (backend, inputs and why) -> count.
        self.sdpa_calls: dict[tuple[str, str], int] = {}
        self._cache = _CastCache()
        self._lib: Any = None
        self._undo: list[Callable[[], None]] = []

    # -- sizes --------------------------------------------------------------------------------

    @property
    def gemm_workspace_bytes(self) -> int:
        """Bytes of the cuBLAS workspace each (thread, stream) allocates at its first GEMM.

        PyTorch's ``CublasHandlePool.cpp`` takes the size from ``CUBLAS_WORKSPACE_CONFIG``
        (the sum of its ``:SIZE_KiB:COUNT`` terms) and otherwise defaults to ``:4096:8`` =
        32 MiB on compute capability 9.x, 10.x and 12.x, and ``:4096:2:16:8`` = 8 MiB + 128 KiB
        = 8,519,680 B before Hopper. cuBLASLt GEMMs add a workspace of their own
        (:attr:`lt_workspace_bytes`). It is allocated through the caching
        allocator, so it is a block like any tensor (and lives as long as the process).

        Example:
            >>> CudaEmulation((8, 6)).gemm_workspace_bytes
            8519680
            >>> CudaEmulation((9, 0)).gemm_workspace_bytes
            33554432
        """
        import os

        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if config:
            parsed = _parse_workspace_config(config)
            if parsed is not None:
                return parsed
        if self.compute_capability[0] in (9, 10, 12):
            return 4096 * 1024 * 8
        return 4096 * 1024 * 2 + 16 * 1024 * 8

    @property
    def lt_workspace_bytes(self) -> int:
        """Bytes of the cuBLASLt workspace each (thread, stream) allocates at its first cuBLASLt
        GEMM (:meth:`uses_cublaslt`), on top of its cuBLAS workspace; 0 when they share one.

        ``CublasHandlePool.cpp`` (PyTorch 2.11, as recorded on an H100 in ``tests/data/gpu``):
        ``getCUDABlasLtWorkspace`` returns the cuBLAS workspace only when
        ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set to a true value; otherwise it allocates its
        own block through the caching allocator, of ``getCUDABlasLtWorkspaceSize()``:
        ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024), capped at the cuBLAS workspace's size
        unless the variable is set to a false value. The recorded GPT runs show it: 1 MiB after
        the 32 MiB workspace at the first ``addmm`` with a bias (forward thread only; the
        backward's plain ``mm`` calls do not use cuBLASLt).

        Example:
            >>> CudaEmulation((9, 0)).lt_workspace_bytes
            1048576
        """
        unified = _env_flag("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
        if unified is True:
            return 0
        size = 1024
        raw = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
        if raw is not None:
            try:
                size = int(raw.strip())
            except ValueError:
                pass
        nbytes = max(size, 0) * 1024
        if unified is None:
            nbytes = min(nbytes, self.gemm_workspace_bytes)
        return nbytes

    def uses_cublaslt(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether CUDA runs this call through cuBLASLt (``gemm_and_bias``), which needs
        the cuBLASLt workspace (:attr:`lt_workspace_bytes`).

        ``addmm_out_cuda_impl`` (``aten/src/ATen/native/cuda/Blas.cpp``,
        ``isInputCompliesAddmmCudaLt``): ``addmm`` / ``_addmm_activation`` with ``beta == 1``
        into a fresh 2-D output, a contiguous bias that is 1-D (or squeezes to 1-D) of the
        output's width (or, with a fused activation, 2-D and broadcastable), a float, double,
        half or bfloat16 GEMM whose matrices have more than one row and column; never when
        ``DISABLE_ADDMM_CUDA_LT=1``. ``nn.Linear`` with a bias on a 2-D input is the common
        case; ``mm`` (no bias, or the backward's GEMMs) is not.

        Example:
            >>> import torch
            >>> from torch._subclasses import FakeTensorMode
            >>> emu = CudaEmulation((9, 0))
            >>> with FakeTensorMode():
            ...     x, w, b = torch.empty(8, 4), torch.empty(4, 16), torch.empty(16)
            >>> emu.uses_cublaslt(torch.ops.aten.addmm.default, (b, x, w), {})
            True
            >>> emu.uses_cublaslt(torch.ops.aten.mm.default, (x, w), {})
            False
        """
        if func not in _LT_GEMMS or os.environ.get("DISABLE_ADDMM_CUDA_LT") == "1":
            return False
        if len(args) < 3 or not all(isinstance(t, torch.Tensor) for t in args[:3]):
            return False
        bias, mat1, mat2 = args[0], args[1], args[2]
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        activation = func is not torch.ops.aten.addmm.default  # _addmm_activation
        try:
            if complex(beta) != 1.0:
                return False
        except TypeError:
            return False
        if mat1.dim() != 2 or mat2.dim() != 2:
            return False
        m, k = mat1.shape
        k2, n = mat2.shape
        if not (m > 1 and k > 1 and k2 > 1 and n > 1):
            return False
        if mat1.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            return False
        fused_bias = (
            bias.is_contiguous()
            and (bias.dim() == 1 or bias.squeeze().dim() == 1)
            and bias.size(-1) == n
        )
        broadcast_bias = activation and bias.dim() == 2 and all(
            s in (1, t) for s, t in zip(bias.shape, (m, n))
        )
        return bool(fused_bias or broadcast_bias)

    def host_outputs(self, func: Any, out: Any) -> list[torch.Tensor]:
        """Outputs of ``func`` that CUDA keeps in host memory where the fake run puts them on
        the device: the memory-efficient attention forward's philox seed and offset
        (``_efficient_attention_forward``, attention.cu: CPU scalars unless a CUDA graph is
        being captured; the recorded H100 runs allocate neither).

        Example:
            >>> import torch
            >>> from torch._subclasses import FakeTensorMode
            >>> emu = CudaEmulation((9, 0))
            >>> with FakeTensorMode():
            ...     q = torch.empty(1, 2, 16, 64)
            ...     out = torch.ops.aten._scaled_dot_product_efficient_attention(
            ...         q, q, q, None, True)
            >>> [tuple(t.shape) for t in emu.host_outputs(
            ...     torch.ops.aten._scaled_dot_product_efficient_attention.default, out)]
            [(), ()]
        """
        if func is _EFFICIENT_FORWARD and isinstance(out, (tuple, list)) and len(out) >= 4:
            return [t for t in out[2:4] if isinstance(t, torch.Tensor)]
        return []

    # -- transients -----------------------------------------------------------------------------

    def transients(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> list[Transient]:
        """Scratch buffers the CUDA kernel of ``func`` allocates after its outputs and frees
        before it returns: ``[(bytes, label), ...]`` in allocation order (empty for most ops).
        All of them are live together, except those an entry ``(bytes, label, frees)`` names
        in ``frees`` (indices of earlier entries, freed right after that entry is allocated);
        the rest are freed in reverse order when the kernel returns.

        Modelled: the flash-attention backward (``_flash_attention_backward`` and flash's
        ``mha_bwd``: contiguous copies of ``grad_out`` / ``out`` in (B, L, H, D) layout when
        they are not, ``softmax_d`` (B, H, L rounded up to 128) and the fp32 ``dq`` accumulator
        (B, L rounded to 128, H, D rounded to 32; one per SM split when deterministic), and the
        expanded dK/dV of grouped-query attention); the memory-efficient attention
        (:func:`_efficient_backward_transients`: its backward's ``delta`` and, when the kernel
        does not compute it, the fp32 product and row sums it comes from, then the kernel's
        fp32 workspace for the dQ (and dK/dV) accumulation; the forward's fp32 output
        accumulator for head dims over 128 in half precision); the math attention's
        ``_safe_softmax`` (:func:`_safe_softmax_transients`); and reductions (``sum``, ``mean``, ``prod``, ``nansum``, ``max``/``min`` along a
        dim, ``argmax``/``argmin``, ``linalg_vector_norm``) whose CUDA launch splits each
        output over several thread blocks. ``Reduce.cuh`` (``setReduceConfig``) then allocates
        a staging buffer for the blocks' partial results and an ``int`` semaphore per output
        block, through the caching allocator. The launch configuration depends on the input's
        layout (TensorIterator's dimension order), the accumulator type and the GPU's
        multiprocessor count (``multiprocessors``).

        Example:
            >>> import torch
            >>> from torch._subclasses import FakeTensorMode
            >>> emu = CudaEmulation((8, 0))
            >>> with FakeTensorMode():
            ...     x = torch.empty(8192, 768)     # an RMSNorm weight gradient's sum over rows
            ...     s = x.sum(0)
            >>> emu.transients(torch.ops.aten.sum.dim_IntList, (x, [0]), {}, s)
            [(50331648, 'reduction staging'), (24, 'reduction semaphores')]
        """
        if func is _FLASH_BACKWARD:
            return list(_flash_backward_transients(args, self.multiprocessors))
        if func is _EFFICIENT_BACKWARD:
            return _efficient_backward_transients(args, kwargs, self.compute_capability)
        if func is _EFFICIENT_FORWARD:
            return _efficient_forward_transients(args, out)
        if func is _CONVOLUTION or func is _CONVOLUTION_BACKWARD:
            return _cudnn_conv_transients(func, args, self.compute_capability)
        if func is _SAFE_SOFTMAX:
            return _safe_softmax_transients(args, out)
        spec = _REDUCTIONS.get(getattr(func, "_overloadpacket", None))
        if spec is None or not args or not isinstance(args[0], torch.Tensor):
            return []
        x = args[0]
        dims = _reduce_dims(func, x, args, kwargs)
        if dims is None:
            return []
        config = _reduce_config(
            x, dims, spec(x, func, args, kwargs), self.multiprocessors, self.max_threads_per_sm
        )
        if config is None:
            return []
        return [(config[0], "reduction staging"), (config[1], "reduction semaphores")]

    # -- entering and leaving -------------------------------------------------------------------

    def __enter__(self) -> CudaEmulation:
        if not _lock.acquire(blocking=False):
            raise InvalidInputError(
                "a CudaEmulation is already active in this process; CUDA emulation changes "
                "process-wide dispatcher state, so run one estimate at a time"
            )
        try:
            self._install_autocast()
            self._install_amp_checks()
            self._install_optimizers()
            self._install_accelerate()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        try:
            while self._undo:
                self._undo.pop()()
            self._cache.clear()
        finally:
            _lock.release()

    # -- autocast -------------------------------------------------------------------------------

    def _install_autocast(self) -> None:
        lib = torch.library.Library("aten", "IMPL")
        self._lib = lib
        self._undo.append(lib._destroy)
        registered = {
            r.split("::", 1)[1] for r in torch._C._dispatch_get_registrations_for_dispatch_key(
                "AutocastCPU")
        }  # fmt: skip
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": intended, undone on exit
            warnings.simplefilter("ignore")
            ours = set()
            for name in LOWER_PRECISION_FP | FP32 | FP32_SET_OPT_DTYPE | PROMOTE | BANNED:
                lib.impl(name, self._kernel(name), "AutocastCPU")
                ours.add(name)
            for name in FP32_APPEND_DTYPE:
                lib.impl(name, self._kernel(name), "AutocastCPU")
                ours.add(name)
            for name in sorted(registered - ours):  # CPU-only autocast entries: not on CUDA
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            # scaled_dot_product_attention is composite: it picks its backend below autograd,
            # with or without autocast; ours picks CUDA's
            lib.impl("scaled_dot_product_attention", self._run_sdpa, "CompositeImplicitAutograd")
            # dropout (out of place) runs CUDA's fused kernel: a bool mask, not a noise tensor
            lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
        # One autocast state for the fake GPU. The fake tensors' device is "cpu", so torch's own
        # code asks for the "cpu" state where a real run asks for "cuda" (checkpoint captures
        # the state of its inputs' device and re-enters it to recompute); both names read and
        # write one state, and the AutocastCPU key (where our kernels sit) is visited exactly
        # while it is on.
        saved = {
            dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            for dev in ("cpu", "cuda")
        }
        names = [
            "is_autocast_enabled",
            "set_autocast_enabled",
            "get_autocast_dtype",
            "set_autocast_dtype",
        ]
        originals = {name: getattr(torch, name) for name in names}
        o_is, o_set = originals["is_autocast_enabled"], originals["set_autocast_enabled"]
        o_get, o_set_dtype = originals["get_autocast_dtype"], originals["set_autocast_dtype"]

        def one(device: Any) -> bool:
            return str(device) in ("cpu", "cuda")

        def is_autocast_enabled(*args: Any) -> bool:
            if not args or one(args[0]):
                return bool(o_is("cuda"))
            return bool(o_is(*args))

        def set_autocast_enabled(*args: Any) -> None:
            if len(args) == 2 and one(args[0]):
                o_set("cuda", args[1])
                o_set("cpu", args[1])
            elif len(args) == 1:  # legacy: set_autocast_enabled(bool) is CUDA
                o_set("cuda", args[0])
                o_set("cpu", args[0])
            else:
                o_set(*args)

        def get_autocast_dtype(device: Any) -> torch.dtype:
            return o_get("cuda" if one(device) else device)  # type: ignore[no-any-return]

        def set_autocast_dtype(device: Any, dtype: torch.dtype) -> None:
            if one(device):
                o_set_dtype("cuda", dtype)
                o_set_dtype("cpu", dtype)
            else:
                o_set_dtype(device, dtype)

        patched = {
            "is_autocast_enabled": is_autocast_enabled,
            "set_autocast_enabled": set_autocast_enabled,
            "get_autocast_dtype": get_autocast_dtype,
            "set_autocast_dtype": set_autocast_dtype,
        }
        o_set("cpu", bool(o_is("cuda")))
        o_set_dtype("cpu", o_get("cuda"))
        for name, fn in patched.items():
            setattr(torch, name, fn)

        def undo_state() -> None:
            for name, fn in originals.items():
                setattr(torch, name, fn)
            for dev, (enabled, dtype) in saved.items():
                o_set(dev, enabled)
                o_set_dtype(dev, dtype)

        self._undo.append(undo_state)
        original_clear = torch.clear_autocast_cache
        cache = self._cache

        def clear_autocast_cache() -> None:
            cache.clear()
            original_clear()

        torch.clear_autocast_cache = clear_autocast_cache
        self._undo.append(lambda: setattr(torch, "clear_autocast_cache", original_clear))

    def _kernel(self, name: str) -> Callable[..., Any]:
        op = _op(name)
        cache = self._cache

        def below(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                return op(*args, **kwargs)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if not _C_IS_ENABLED("cuda"):
                return below(*args, **kwargs)
            lower = _C_GET_DTYPE("cuda")
            if name in BANNED:
                raise InvalidInputError(_BANNED_MESSAGE)
            if name in LOWER_PRECISION_FP or name in FP32 or name in PROMOTE:
                if name in LOWER_PRECISION_FP:
                    to = lower
                elif name in FP32:
                    to = torch.float32
                else:
                    wide = [t.dtype for t in _iter_tensors(args, kwargs) if _eligible(t)]
                    to = torch.float32 if torch.float32 in wide else lower
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                    args = tuple(_map_tensors(a, lambda t: cache.cast(t, to, lower)) for a in args)
                    kwargs = {
                        k: _map_tensors(a, lambda t: cache.cast(t, to, lower))
                        for k, a in kwargs.items()
                    }
                return below(*args, **kwargs)
            first = args[0] if args else None
            if not _eligible(first):
                return below(*args, **kwargs)
            if name in FP32_APPEND_DTYPE:
                target = _op(FP32_APPEND_DTYPE[name])
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                    return target(*args, **kwargs, dtype=torch.float32)
            # FP32_SET_OPT_DTYPE: dtype=float32 unless the caller chose one
            if dtype_at < len(args):
                if args[dtype_at] is None:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = dict(kwargs, dtype=torch.float32)
            return below(*args, **kwargs)

        names = [a.name for a in op._schema.arguments]
        dtype_at = names.index("dtype") if "dtype" in names else len(names)
        return kernel

    def _run_sdpa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        p = dict(zip(names, args))
        p.update(kwargs)
        mask = p.get("attn_mask")
        q, k, v = p["query"], p["key"], p["value"]
        dropout = float(p.get("dropout_p", 0.0) or 0.0)
        causal = bool(p.get("is_causal", False))
        backend = _sdpa_backend(q, k, v, mask, dropout, causal, bool(p.get("enable_gqa", False)),
                                self.compute_capability)
        self.last_sdpa_backend = backend
        key = (backend, _sdpa_inputs(q, k, mask, causal, backend, self.compute_capability))
        self.sdpa_calls[key] = self.sdpa_calls.get(key, 0) + 1
        return _sdpa(self.compute_capability, *args, **kwargs)

    def attention_report(self) -> tuple[str | None, list[str]]:
        """The attention kernel(s) ``scaled_dot_product_attention`` ran, and one note per kind
        of call (the inputs that decided it); ``(None, [])`` when it was never called.

        The kernel is ``"flash"``, ``"efficient"`` (memory-efficient) or ``"math"``, or several
        joined by ``+`` (most calls first) when calls differed.

        Example:
            >>> import torch
            >>> from torch._subclasses import FakeTensorMode
            >>> emu = CudaEmulation((7, 5))                   # a T4: no flash kernel
            >>> with FakeTensorMode(), emu:
            ...     q = torch.empty(1, 4, 128, 64, dtype=torch.float16)
            ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            >>> kernel, notes = emu.attention_report()
            >>> kernel, "float16, head dim 64, no mask; flash needs compute capability" in notes[0]
            ('efficient', True)
        """
        if not self.sdpa_calls:
            return None, []
        per_backend: dict[str, int] = {}
        for (backend, _), n in self.sdpa_calls.items():
            per_backend[backend] = per_backend.get(backend, 0) + n
        kernel = "+".join(sorted(per_backend, key=lambda b: -per_backend[b]))
        notes = [
            f"attention: {_SDPA_NAMES[backend]} for {n} scaled_dot_product_attention "
            f"call{'s' if n > 1 else ''} ({inputs}; CUDA's choice on "
            f"sm_{self.compute_capability[0]}{self.compute_capability[1]})"
            for (backend, inputs), n in self.sdpa_calls.items()
        ]
        return kernel, notes

    # -- torch.autocast("cuda") on a CPU-only build ---------------------------------------------

    def _install_amp_checks(self) -> None:
        import torch.cuda.amp.common as amp_common  # noqa: PLC0415

        original = amp_common.amp_definitely_not_available
        amp_common.amp_definitely_not_available = lambda: False
        self._undo.append(lambda: setattr(amp_common, "amp_definitely_not_available", original))
        original_bf16 = torch.cuda.is_bf16_supported
        major = self.compute_capability[0]

        def is_bf16_supported(including_emulation: bool = True) -> bool:
            return major >= 8 or including_emulation

        torch.cuda.is_bf16_supported = is_bf16_supported
        self._undo.append(lambda: setattr(torch.cuda, "is_bf16_supported", original_bf16))

    def _install_accelerate(self) -> None:
        # accelerate (and the Trainer's fp16 through it) sees the GPU: :mod:`torchmem.fit._accelerate`
        from torchmem.fit._accelerate import accelerate_on_gpu  # noqa: PLC0415

        stack = contextlib.ExitStack()
        stack.enter_context(accelerate_on_gpu())
        self._undo.append(stack.close)

    # -- optimizers -----------------------------------------------------------------------------

    def _install_optimizers(self) -> None:
        import torch.optim.optimizer as optimizer  # noqa: PLC0415
        import torch.utils._foreach_utils as foreach_utils  # noqa: PLC0415
        from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415

        original = optimizer._get_foreach_kernels_supported_devices

        def supported() -> list[str]:
            return [*original(), "cpu"]

        optimizer._get_foreach_kernels_supported_devices = supported  # type: ignore[assignment]
        self._undo.append(
            lambda: setattr(optimizer, "_get_foreach_kernels_supported_devices", original)
        )
        for types in (optimizer._foreach_supported_types, foreach_utils._foreach_supported_types):
            if FakeTensor not in types:
                types.append(FakeTensor)
                self._undo.append(_remover(types, FakeTensor))


def _remover(items: list[Any], item: Any) -> Callable[[], None]:
    def remove() -> None:
        items.remove(item)

    return remove


def _parse_workspace_config(config: str) -> int | None:
    """``:SIZE_KiB:COUNT`` pairs summed (``None`` if the string is not in that form)."""
    parts = config.split(":")
    if parts[0] != "" or len(parts) < 3 or len(parts) % 2 == 0:
        return None
    try:
        nums = [int(x) for x in parts[1:]]
    except ValueError:
        return None
    return sum(size * 1024 * count for size, count in zip(nums[::2], nums[1::2], strict=True))
