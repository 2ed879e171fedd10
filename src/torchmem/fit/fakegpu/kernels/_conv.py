"""cuDNN convolutions: the workspace a tensor-core engine asks the caching allocator for when
its tensors are NCHW (NHWC copies of input, output and filter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchmem.fit.fakegpu.kernels._common import Transient

_CONVOLUTION = getattr(torch.ops.aten.convolution, "default", None)


_CONVOLUTION_BACKWARD = getattr(torch.ops.aten.convolution_backward, "default", None)

#: The largest workspace cuDNN's heuristics were seen to choose beyond the NHWC copies, for the
#: upper figure (``upper=True``). Source: the H100 run ``tests/data/gpu/convnet`` (cuDNN 9,
#: torch 2.11, fp32 with TF32), 30 workspace requests of 5 convolutions: every request was the
#: copies plus 16 or 147 bytes (alignment), and each weight gradient added split-K partial
#: filters: 3, 7, 14, 14.45 and 14 filter copies, never more than 8,258,215 bytes. The upper
#: figure allows 15 copies, at most 8 MiB, plus 512 bytes (one allocator block) per request.
SPLIT_K_COPIES = 15
SPLIT_K_MAX_BYTES = 8 << 20
ALIGNMENT_BYTES = 512


def _cudnn_conv_transients(
    func: Any, args: Sequence[Any], cc: tuple[int, int], upper: bool = False
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

    What only cuDNN's closed heuristics decide: the engine's own scratch (a few bytes of
    alignment; the split-K partial filters a weight-gradient engine may add, seen as 3 to 15
    filter copies on an H100), and engines that skip one of the transposes. ``upper=True``
    adds the most seen (:data:`SPLIT_K_COPIES` filter copies up to :data:`SPLIT_K_MAX_BYTES`
    to a weight gradient's, :data:`ALIGNMENT_BYTES` to each): the estimate's upper figure.

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
        >>> _cudnn_conv_transients(
        ...     torch.ops.aten.convolution.default,
        ...     (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), (9, 0), upper=True)[0][0]
        6586880
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
    sizes = [total] * len(parts)
    if upper:
        split_k = min(SPLIT_K_COPIES * w.numel() * size, SPLIT_K_MAX_BYTES)
        sizes = [n + ALIGNMENT_BYTES + (split_k if part == "weight gradient" else 0)
                 for n, part in zip(sizes, parts)]
        label += " (the most cuDNN was seen to take)"
        # a workspace that does not fit makes cuDNN try its next plan: the copies alone
        if len(parts) == 1:
            return [(sizes[0], label, (), total)]
        return [(sizes[0], f"{label} ({parts[0]})", (), total),
                (sizes[1], f"{label} ({parts[1]})", (0,), total)]
    if len(parts) == 1:
        return [(sizes[0], label)]
    # both gradients in one call: the data gradient's workspace is given back first
    return [(sizes[0], f"{label} ({parts[0]})"), (sizes[1], f"{label} ({parts[1]})", (0,))]
