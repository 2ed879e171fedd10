"""Multi-block reductions (``aten/src/ATen/native/cuda/Reduce.cuh``, ``setReduceConfig``): the
launch configuration of a reduction on a GPU of a given SM count, and the staging buffer and
semaphores it allocates through the caching allocator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

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
