"""The emulation itself: :class:`CudaEmulation` installs CUDA's behaviour around a fake run (the
autocast kernels, the AMP checks, the optimizers' CUDA defaults, accelerate's device) and answers
the engine's questions about each operator: the cuBLAS / cuBLASLt workspaces, the scratch
buffers of the kernel families (:mod:`torchmem.fit.fakegpu.kernels`), and the outputs CUDA keeps
in host memory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu.kernels._attention_scratch import (
    _EFFICIENT_BACKWARD,
    _EFFICIENT_FORWARD,
    _FLASH_BACKWARD,
    _SAFE_SOFTMAX,
    _efficient_backward_transients,
    _efficient_forward_transients,
    _flash_backward_transients,
    _safe_softmax_transients,
)
from torchmem.fit.fakegpu.kernels._autocast import (
    _BANNED_MESSAGE,
    BANNED,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER_PRECISION_FP,
    PROMOTE,
    _CastCache,
    _eligible,
    _iter_tensors,
    _map_tensors,
)
from torchmem.fit.fakegpu.kernels._common import Transient, _env_flag, _op
from torchmem.fit.fakegpu.kernels._conv import (
    _CONVOLUTION,
    _CONVOLUTION_BACKWARD,
    _cudnn_conv_transients,
)
from torchmem.fit.fakegpu.kernels._cublas import _LT_GEMMS, _parse_workspace_config
from torchmem.fit.fakegpu.kernels._reduce import (
    _MAX_THREADS_PER_SM,
    _REDUCTIONS,
    _TYPICAL_SMS,
    _reduce_config,
    _reduce_dims,
)
from torchmem.fit.fakegpu.kernels._sdpa import (
    _SDPA_NAMES,
    _dropout,
    _sdpa,
    _sdpa_backend,
    _sdpa_inputs,
)

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
        #: workspaces that cuDNN's closed heuristics size take the most seen (the estimate's
        #: upper figure) when true, the modelled NHWC copies alone when false
        self.upper = True
        #: calls whose workspace such a heuristic sized (the estimate's range then has width)
        self.closed_calls = 0
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
            found = _cudnn_conv_transients(func, args, self.compute_capability, upper=self.upper)
            if found:
                self.closed_calls += 1
            return found
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
        # accelerate (and the Trainer's fp16 through it) sees the GPU: :mod:`torchmem.fit.fakegpu._accelerate`
        from torchmem.fit.fakegpu._accelerate import accelerate_on_gpu  # noqa: PLC0415

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
