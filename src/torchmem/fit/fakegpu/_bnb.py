"""bitsandbytes under an estimate: QLoRA's 4-bit and 8-bit layers and its optimizers.

**With bitsandbytes installed** (0.50 or later), a script's own bitsandbytes runs: each of its
operators has a fake kernel (``bitsandbytes/_ops.py``, ``register_fake``) that makes outputs
of the right shapes, so ``Params4bit`` / ``Int8Params`` quantized on their way to the GPU,
``QuantState`` (absmax blocks, double quantization's ``state2``, the code) and the dequantized
copies in ``dequantize_4bit`` are the tensors bitsandbytes makes. This module adds:

- :func:`imported_without_cuda`: bitsandbytes is imported as on a machine without CUDA (it
  would load its CUDA backend, which reads ``torch._C`` stream handles);
- :func:`patch_bitsandbytes`: what bitsandbytes does outside its operators (ctypes calls on
  raw pointers: ``get_paged``, ``fill``, ``prefetch_tensor``; quantization maps computed for
  real, so no value is assumed);
- :data:`KERNELS`: operators whose CUDA kernels allocate more than their fake kernels say
  (:func:`gemm_4bit_cuda`: the dequantized weight of a 4-bit matmul;
  :func:`int8_scaled_mm_cuda`: LLM.int8's int32 product; :func:`int8_vectorwise_quant_cuda`
  and :func:`int8_mixed_scaled_mm_cuda`: its outlier columns, an upper bound, listed);
- paged optimizer state (``get_paged``: CUDA managed memory, outside PyTorch's allocator) is a
  host tensor, its bytes in :data:`PAGED` and in a note of the report.

**Without bitsandbytes**, :class:`Adam8bitStandIn` takes ``bnb.optim.Adam8bit``'s
arguments and allocates the optimizer state bitsandbytes allocates, at the same moment (the
first ``step()``, parameter by parameter), from bitsandbytes' ``Optimizer2State.init_state``
(``bitsandbytes/optim/optimizer.py``; ``tests/test_fit_qlora.py`` checks it against
bitsandbytes' own ``Adam8bit`` run under the estimate):

- a parameter with fewer than ``min_8bit_size`` elements (default 4096) keeps 32-bit state:
  two float32 buffers of its shape (``state1``, ``state2``);
- a larger one: two uint8 buffers of its shape (one byte per element each) and, block-wise
  (the default), two float32 ``absmax`` vectors of ``ceil(n / blocksize)`` elements; the block
  size is 256 in bitsandbytes since its blockwise optimizers moved to 256-element blocks
  (``blocks = n // 256`` in ``init_state``, e.g. commit 51294d9 of
  bitsandbytes-foundation/bitsandbytes) and 2048 before (``n // 2048``, e.g. commit 06029dd,
  and the 2022 releases);
- the quantization maps: ``create_dynamic_map(signed=True)`` and ``(signed=False)``, 256
  float32 values each, made once per optimizer and moved to the parameters' device.

The update is one in-place CUDA kernel per parameter (``optimizer_update_8bit_blockwise`` /
``optimizer_update_32bit``) that allocates nothing, so :meth:`Adam8bitStandIn.step` allocates
nothing after the state. With ``percentile_clipping < 100`` each parameter also keeps a
100-element float32 ``gnorm_vec``. The values are not computed (an estimate has none).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(64, 128))      # 8192 elements: 8-bit state
    >>> b = torch.nn.Parameter(torch.zeros(64))           # 64 elements: 32-bit state
    >>> w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    >>> opt = Adam8bitStandIn([w, b])
    >>> opt.step()
    >>> Adam8bitStandIn.state_bytes(w.numel()), Adam8bitStandIn.state_bytes(b.numel())
    (16640, 512)
    >>> list(opt.state[w])
    ['step', 'qmap1', 'qmap2', 'state1', 'state2', 'absmax1', 'absmax2']
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["Adam8bitStandIn", "gemm_4bit_cuda", "imported_without_cuda", "int8_mixed_scaled_mm_cuda",
           "int8_scaled_mm_cuda", "int8_vectorwise_quant_cuda", "patch_bitsandbytes"]

#: Entries of bitsandbytes' dynamic quantization maps (``create_dynamic_map``: 256 values).
QMAP_ENTRIES = 256


class Adam8bitStandIn(torch.optim.Optimizer):
    """A stand-in for ``bitsandbytes.optim.Adam8bit`` (and ``AdamW8bit``) inside estimates: the
    same arguments, the same state tensors on the parameters' device, no arithmetic.

    ``blocksize`` is the absmax block (256 in current bitsandbytes, 2048 in its 2022
    releases); ``min_8bit_size``, ``percentile_clipping`` and ``block_wise`` mean what they
    mean in bitsandbytes. Use it where the real code builds ``bnb.optim.Adam8bit``; the
    module docstring gives the sources.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(5000))
        >>> p.grad = torch.zeros_like(p)
        >>> opt = Adam8bitStandIn([{"params": [p], "weight_decay": 0.01}], lr=1e-3)
        >>> opt.step()
        >>> opt.state[p]["state1"].dtype, tuple(opt.state[p]["absmax1"].shape)
        (torch.uint8, (20,))
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        optim_bits: int = 8,
        args: Any = None,
        min_8bit_size: int = 4096,
        percentile_clipping: int = 100,
        block_wise: bool = True,
        is_paged: bool = False,
        blocksize: int = 256,
    ) -> None:
        if amsgrad:
            raise ValueError("Adam8bit does not support amsgrad (neither does bitsandbytes')")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.optim_bits = optim_bits
        self.min_8bit_size = min_8bit_size
        self.percentile_clipping = percentile_clipping
        self.block_wise = block_wise
        self.blocksize = blocksize
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def state_bytes(numel: int, blocksize: int = 256, min_8bit_size: int = 4096) -> int:
        """The state bytes of one parameter of ``numel`` elements (the maps not included).

        Example:
            >>> Adam8bitStandIn.state_bytes(1 << 20)            # 2 bytes + 2 absmax per block
            2129920
        """
        if numel < max(min_8bit_size, 4096):
            return 2 * 4 * numel
        return 2 * numel + 2 * 4 * -(-numel // blocksize)

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._qmaps:
            self._qmaps[device] = (torch.zeros(QMAP_ENTRIES, device=device),
                                   torch.zeros(QMAP_ENTRIES, device=device))
        return self._qmaps[device]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Allocate each parameter's state at its first step, as bitsandbytes does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
        return loss

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        n = p.numel()
        state["step"] = 0
        if self.optim_bits == 32 or n < self.min_8bit_size or n < 4096:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
        else:
            state["qmap1"], state["qmap2"] = self._maps(p.device)  # moved there first
            state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
            state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            if self.block_wise:
                blocks = -(-n // self.blocksize)
                state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            else:
                for k in ("max1", "new_max1", "max2", "new_max2"):
                    state[k] = torch.zeros(1, dtype=torch.float32, device=p.device)
        if self.percentile_clipping < 100:
            state["gnorm_vec"] = torch.zeros(100, device=p.device)


# -- bitsandbytes itself under the estimate (4-bit / 8-bit loading, its optimizers) ----------------

#: bytes of CUDA managed memory the paged optimizers asked for in the last estimate
PAGED: list[int] = []


def paged_note() -> str:
    """The report's line on the paged optimizer state of the last estimate (:data:`PAGED`).

    Example:
        >>> PAGED[:] = [2**20, 2**20]
        >>> paged_note().split(":")[0]
        'bitsandbytes paged optimizer state'
        >>> PAGED.clear()
    """
    from torchmem.units import format_bytes

    return (f"bitsandbytes paged optimizer state: {format_bytes(sum(PAGED))} in {len(PAGED)} "
            "tensors of CUDA managed memory (get_paged, for parameters of 100,000 elements or "
            "more): outside PyTorch's allocator, so not in the peaks above; it stays on the GPU "
            "while there is room (nvidia-smi counts it) and the driver pages it out to host "
            "memory when PyTorch needs the space")


@contextlib.contextmanager
def imported_without_cuda() -> Iterator[None]:
    """bitsandbytes' own import as on a machine without CUDA: it would load its CUDA library and
    register CUDA kernels (which read ``torch._C``'s stream handles) when ``torch.cuda`` says a
    GPU is there. Under the estimate its operators run as the fake kernels it registers for
    each of them (``bitsandbytes/_ops.py``: ``register_fake``), whatever library it loaded.

    Example:
        >>> with imported_without_cuda():
        ...     torch.cuda.is_available()
        False
    """
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.is_available = real  # type: ignore[assignment]


def _real(make: Any) -> Any:
    """``make`` run outside the estimate's modes (its reads of constants are real), its result
    then made again as an estimate's tensor of the same shape and dtype on the host (a real
    tensor would not follow ``.to("cuda")`` onto the simulated GPU)."""

    def real(*args: Any, **kwargs: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            out = make(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        return torch.empty(tuple(out.shape), dtype=out.dtype, device=out.device)

    return real


def patch_bitsandbytes(module: Any) -> Any:
    """What bitsandbytes does outside its operators, for an estimate: ``get_paged`` (CUDA
    managed memory from its own library) gives a host tensor marked paged and its bytes are
    recorded in :data:`PAGED`; ``fill``, ``_mul`` and ``prefetch_tensor`` (ctypes calls into
    the library on raw pointers) do nothing. The quantization maps (``create_dynamic_map`` and
    its kin: constants computed from ``linspace`` and read back with ``tolist``) are computed
    for real, on the host, so no value is assumed; bitsandbytes' module-level map cache
    (``name2qmap``) is emptied before and after, and its ``GlobalOptimManager`` is a fresh one
    during the estimate. Returns what undoes it.

    Example:
        >>> import types
        >>> fake = types.SimpleNamespace(functional=types.SimpleNamespace(
        ...     get_paged=None, fill=None, _mul=None, prefetch_tensor=None))
        >>> undo = patch_bitsandbytes(fake)
        >>> t = fake.functional.get_paged(4, 8, dtype=torch.uint8)
        >>> t.is_paged, tuple(t.shape), PAGED[-1]
        (True, (4, 8), 32)
        >>> undo(); fake.functional.get_paged is None
        True
    """
    functional = getattr(module, "functional", None)
    if functional is None:
        return None
    PAGED.clear()

    def get_paged(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None
                  ) -> torch.Tensor:
        # the real one is torch.frombuffer over cudaMallocManaged memory: a host tensor
        out = torch.zeros(*shape, dtype=dtype, device="cpu")
        out.is_paged = True  # type: ignore[attr-defined]
        out.page_deviceid = getattr(device, "index", 0) or 0  # type: ignore[attr-defined]
        PAGED.append(out.numel() * out.element_size())
        return out

    new = {"get_paged": get_paged, "fill": lambda A, value, device=None, prefetch=True: None,
           "_mul": lambda A, B, device=None: None,
           "prefetch_tensor": lambda A, to_cpu=False: None}
    for k in ("create_linear_map", "create_normal_map", "create_fp8_map", "create_dynamic_map"):
        if callable(getattr(functional, k, None)):
            new[k] = _real(getattr(functional, k))
    old = {k: getattr(functional, k) for k in new if hasattr(functional, k)}
    for k, v in new.items():
        setattr(functional, k, v)
    cache = getattr(functional, "name2qmap", None)
    if isinstance(cache, dict):
        cache.clear()
    ops = getattr(torch.ops, "bitsandbytes", None)
    for name, kernel in (("gemm_4bit", gemm_4bit_cuda),
                         ("int8_vectorwise_quant", int8_vectorwise_quant_cuda),
                         ("int8_mixed_scaled_mm", int8_mixed_scaled_mm_cuda),
                         ("int8_scaled_mm", int8_scaled_mm_cuda)):
        op = getattr(getattr(ops, name, None), "default", None)
        if op is not None:
            KERNELS[op] = kernel

    # bitsandbytes' GlobalOptimManager is a process-wide singleton keyed by id(parameter)
    # (transformers registers 32-bit state for embeddings in it): each estimate gets a fresh
    # one, as a fresh process would, and yours is back after (ids of a finished run's fake
    # parameters, reused by a later run's, gave the later one 32-bit state)
    manager = getattr(getattr(module, "optim", None), "GlobalOptimManager", None)
    saved_manager = getattr(manager, "_instance", None)
    if manager is not None:
        manager._instance = None

    def undo() -> None:
        for k, v in old.items():
            setattr(functional, k, v)
        if manager is not None:
            manager._instance = saved_manager
        if isinstance(cache, dict):
            cache.clear()  # it holds the estimate's fake tensors
        KERNELS.clear()

    return undo


# -- what bitsandbytes' CUDA kernels allocate where its fake kernels do not say ---------------------

#: ``{bitsandbytes operator: its CUDA behaviour}``, filled when bitsandbytes is imported under an
#: estimate; the fake GPU's dispatch (:mod:`~torchmem.fit.fakegpu._dispatch`) runs these in place
#: of the operator's fake kernel. Each takes ``run(op, *args, **kwargs)`` (an operator through
#: the fake GPU, so its memory and workspaces count), ``record(where, value)`` (lists a size
#: assumed with the estimate's assumed values) and the operator's arguments.
KERNELS: dict[Any, Any] = {}

#: bitsandbytes 0.50's ``gemm_4bit`` on CUDA (``backends/cuda/ops.py``): at most this many rows
#: (``_GEMM_4BIT_CUSTOM_FLOOR_M``) always take its fused kernel (the output, nothing else)
GEMM_4BIT_FUSED_M = 4


def gemm_4bit_cuda(run: Any, record: Any, A: torch.Tensor, B: torch.Tensor, shapeB: Any, absmax: torch.Tensor,
                   blocksize: int, quant_type: str, bias: torch.Tensor | None = None,
                   absmax_8bit: torch.Tensor | None = None, absmax_code: Any = None,
                   absmax_offset: torch.Tensor | None = None) -> torch.Tensor:
    """``bitsandbytes::gemm_4bit`` as its CUDA kernel allocates (bitsandbytes 0.50,
    ``backends/cuda/ops.py``; the fake kernel allocates the output only).

    With ``M`` rows in ``A`` (all but its last dimension), the CUDA registration takes, for
    ``M > 1536`` (``_gemm_4bit_custom_max_m``) or an inner dimension that is not a multiple of
    the block size, ``_dequant_linear_fallback``: with double quantization the absmax blocks
    dequantized to float32 (``empty_like``) and the offset added (a second float32 vector),
    then the whole weight dequantized to ``A``'s dtype (``shapeB``: ``N x K``) and
    ``F.linear`` (``mm``/``addmm``: the output and cuBLAS's workspace). For ``M <= 4`` it runs
    its fused kernel, which allocates the output alone. Between the two it chooses by GPU
    architecture and shape (``_gemm_4bit_use_custom_cuda``); the estimate takes the dequantized
    path there, the larger of the two, so it never says a run fits that would not.

    Example:
        >>> calls = []
        >>> def run(op, *a, **k):
        ...     calls.append(op.__name__)
        ...     return op(*a, **k)
        >>> A = torch.zeros(8, 64)
        >>> out = gemm_4bit_cuda(run, print, A, torch.zeros(1024, 1, dtype=torch.uint8), [32, 64],
        ...                      torch.zeros(32), 64, "nf4")
        >>> tuple(out.shape), calls
        ((8, 32), ['empty.memory_format', 't.default', 'mm.default'])
    """
    aten = torch.ops.aten
    K = A.shape[-1]
    M = A.numel() // K if K else 0
    N = int(shapeB[0])
    out_shape = [*A.shape[:-1], N]
    if M <= GEMM_4BIT_FUSED_M and K % blocksize == 0:
        return run(aten.empty.memory_format, out_shape, dtype=A.dtype, device=A.device)
    kept = []
    if absmax_8bit is not None:
        kept.append(run(aten.empty_like.default, absmax_8bit, dtype=torch.float32))
        kept.append(run(aten.add.Tensor, kept[-1], absmax_offset))
    w = run(aten.empty.memory_format, [N, K], dtype=A.dtype, device=A.device)
    a2 = A
    if A.dim() != 2:
        if not A.is_contiguous():
            a2 = run(aten.clone.default, A, memory_format=torch.contiguous_format)
        a2 = run(aten.view.default, a2, [M, K])
    wt = run(aten.t.default, w)
    out = (run(aten.mm.default, a2, wt) if bias is None
           else run(aten.addmm.default, bias, a2, wt))
    if A.dim() != 2:
        out = run(aten._unsafe_view.default, out, out_shape)
    del kept, w, wt, a2
    return out


def int8_vectorwise_quant_cuda(run: Any, record: Any, A: torch.Tensor, threshold: float = 0.0
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``bitsandbytes::int8_vectorwise_quant`` as its CUDA kernel allocates (bitsandbytes 0.50,
    ``backends/cuda/ops.py``): ``row_stats`` (float32, one per row) and ``out_row`` (int8,
    ``A``'s shape); with ``threshold > 0`` (LLM.int8's outliers: transformers passes
    ``llm_int8_threshold``, 6.0 by default) also ``A.abs()`` and the mask ``>= threshold``,
    the mask's ``any(dim=0)`` and the outlier columns' indices. Which columns are outliers
    depends on the activations' values, which an estimate does not have: every column is
    taken as one (an upper bound) and the assumption is listed.

    Example:
        >>> out, stats, cols = int8_vectorwise_quant_cuda(
        ...     lambda op, *a, **k: op(*a, **k), print, torch.zeros(3, 5), 6.0)
        bitsandbytes.int8_vectorwise_quant 5 of 5 outlier columns (every column: an upper bound)
        >>> out.dtype, tuple(stats.shape), tuple(cols.shape)
        (torch.int8, (3,), (5,))
    """
    aten = torch.ops.aten
    rows = A.numel() // A.shape[-1] if A.shape[-1] else 0
    cols = A.shape[-1]
    row_stats = run(aten.empty.memory_format, [rows], dtype=torch.float32, device=A.device)
    out_row = run(aten.empty.memory_format, list(A.shape), dtype=torch.int8, device=A.device)
    outlier_cols = None
    if threshold > 0.0:
        magnitude = run(aten.abs.default, A)
        outliers = run(aten.ge.Scalar, magnitude, threshold)
        del magnitude
        any_col = run(aten.any.dim, outliers, 0)
        record("bitsandbytes.int8_vectorwise_quant",
               f"{cols} of {cols} outlier columns (every column: an upper bound)")
        outlier_cols = run(aten.empty.memory_format, [cols], dtype=torch.int64, device=A.device)
        del outliers, any_col
    return out_row, row_stats, outlier_cols


def int8_mixed_scaled_mm_cuda(run: Any, record: Any, A: torch.Tensor, CA: torch.Tensor,
                              CB: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor,
                              outlier_cols: torch.Tensor | None = None,
                              bias: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``bitsandbytes::int8_mixed_scaled_mm`` as bitsandbytes 0.50 runs it on CUDA (its
    ``default`` kernel, ``backends/default/ops.py``): the outlier columns of ``A`` copied
    (``subA``), the same columns of the int8 weight copied and dequantized (float32, then
    ``A``'s dtype), the int8 product (:func:`int8_scaled_mm_cuda`), then ``addmm`` of the
    outliers into a new output. Returns ``(output, subA)`` (``subA`` is kept for backward).

    Example:
        >>> import bitsandbytes  # its operators (run here on the CPU)
        >>> run = lambda op, *a, **k: op(*a, **k)
        >>> A, CB = torch.zeros(3, 5, dtype=torch.float16), torch.zeros(4, 5, dtype=torch.int8)
        >>> out, sub = int8_mixed_scaled_mm_cuda(run, print, A, A.to(torch.int8), CB,
        ...     torch.zeros(3), torch.zeros(4), torch.zeros(2, dtype=torch.int64))
        >>> tuple(out.shape), tuple(sub.shape)
        ((3, 4), (3, 2))
    """
    aten = torch.ops.aten
    bnb_ops = torch.ops.bitsandbytes
    sub_b = None
    if outlier_cols is not None and outlier_cols.numel():
        n = outlier_cols.numel()
        sub_a = run(aten.empty.memory_format, [A.shape[0], n], dtype=A.dtype, device=A.device)
        cb_cols = run(aten.empty.memory_format, [CB.shape[0], n], dtype=CB.dtype,
                      device=CB.device)
        dequant = run(bnb_ops.int8_vectorwise_dequant.default, cb_cols, SCB)
        del cb_cols
        sub_b = dequant if dequant.dtype == A.dtype else run(aten._to_copy.default, dequant,
                                                              dtype=A.dtype)
        del dequant
    else:
        sub_a = run(aten.empty.memory_format, [0], dtype=A.dtype, device=A.device)
    output = int8_scaled_mm_cuda(run, record, CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    if sub_b is not None:
        output = run(aten.addmm.default, output, sub_a, run(aten.t.default, sub_b))
    return output, sub_a


def int8_scaled_mm_cuda(run: Any, record: Any, A: torch.Tensor, B: torch.Tensor,
                        row_stats: torch.Tensor, col_stats: torch.Tensor,
                        bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """``bitsandbytes::int8_scaled_mm`` as bitsandbytes 0.50 runs it on CUDA (its ``default``
    kernel): the int8 product into a new int32 ``M x N`` tensor (``int8_linear_matmul``),
    then dequantized into the output (``int8_mm_dequant``); the fake kernel allocates the
    output alone.

    Example:
        >>> import bitsandbytes  # its operators
        >>> calls = []
        >>> def run(op, *a, **k):
        ...     calls.append(str(op)); return torch.empty(2, 4, dtype=torch.int32)
        >>> _ = int8_scaled_mm_cuda(run, print, torch.zeros(2, 3, dtype=torch.int8),
        ...     torch.zeros(4, 3, dtype=torch.int8), torch.zeros(2), torch.zeros(4))
        >>> calls
        ['bitsandbytes.int8_linear_matmul.default', 'bitsandbytes.int8_mm_dequant.default']
    """
    bnb_ops = torch.ops.bitsandbytes
    out_i32 = run(bnb_ops.int8_linear_matmul.default, A, B)
    return run(bnb_ops.int8_mm_dequant.default, out_i32, row_stats, col_stats,
               dtype=dtype or torch.float16, bias=bias)
