"""CUDA's autocast policy (``aten/src/ATen/autocast_mode.cpp``, the ``KERNEL_CUDA`` lists) and the
weight-cast cache, applied to fake tensors by :class:`~torchmem.fit.fakegpu.kernels.CudaEmulation`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

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
