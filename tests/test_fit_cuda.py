"""CudaEmulation: a fake run on a CPU-only build allocates like CUDA.

Ground truth, each computed another way: PyTorch's own AutocastCUDA kernels (compiled into CPU
builds; they run on fake CUDA tensors as long as autograd is not involved), the shapes the CUDA
attention kernels document, real CPU runs of the same optimizer code, and Reduce.cuh's launch
rules worked by hand against the allocator traces of ../shared/data/gpu-truth.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses import FakeTensorMode

from torchmem.capture import track
from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu.kernels import MODELLED, CudaEmulation
from torchmem.fit.fakegpu.kernels._autocast import (
    BANNED,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER_PRECISION_FP,
    PROMOTE,
)
from torchmem.model.events import EventKind

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _allocs(fn):
    """Storage allocations (op, bytes) made while ``fn()`` runs, and its result."""
    seen: list[tuple[str | None, int]] = []

    def listener(ev, storage):
        if ev.kind == EventKind.ALLOC:
            seen.append((ev.op, ev.nbytes))

    with track(listeners=[listener]):
        out = fn()
    return seen, out


# -- autocast -------------------------------------------------------------------------------------


def test_policy_lists_are_exactly_the_ops_cuda_autocast_registers():
    ours = LOWER_PRECISION_FP | FP32 | FP32_SET_OPT_DTYPE | PROMOTE | BANNED | set(FP32_APPEND_DTYPE)
    registered = {
        r.split("::", 1)[1]
        for r in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    }
    assert ours == registered
    lists = [LOWER_PRECISION_FP, FP32, FP32_SET_OPT_DTYPE, PROMOTE, BANNED, set(FP32_APPEND_DTYPE)]
    assert sum(len(x) for x in lists) == len(registered)  # no op in two lists


def _cases(dev: str, low: torch.dtype) -> dict:
    def f(*s):
        return torch.empty(*s, device=dev)

    def h(*s):
        return torch.empty(*s, device=dev, dtype=low)

    def ids(n):
        return torch.zeros(n, dtype=torch.long, device=dev)

    return {
        "mm": lambda: torch.mm(f(4, 8), f(8, 3)),
        "einsum": lambda: torch.einsum("ij,kj->ik", f(4, 8), f(3, 8)),
        "matmul 4-d": lambda: f(2, 3, 4, 8) @ f(2, 3, 8, 5),
        "linear": lambda: torch.nn.functional.linear(f(4, 8), f(3, 8), f(3)),
        "baddbmm": lambda: torch.baddbmm(f(2, 4, 3), f(2, 4, 8), f(2, 8, 3)),
        "conv2d": lambda: torch.nn.functional.conv2d(f(1, 3, 8, 8), f(4, 3, 3, 3)),
        "exp": lambda: torch.exp(h(4)),
        "pow": lambda: h(4) ** 2,
        "rsqrt": lambda: torch.rsqrt(h(4)),
        "log": lambda: torch.log(h(4)),
        "sum": lambda: h(4, 4).sum(),
        "sum dim": lambda: h(4, 4).sum(-1),
        "sum dtype": lambda: h(4, 4).sum(-1, dtype=torch.float64),
        "mean": lambda: h(4, 4).mean(-1),
        "softmax": lambda: torch.softmax(h(4, 4), -1),
        "log_softmax": lambda: torch.log_softmax(h(4, 4), -1),
        "cumsum": lambda: torch.cumsum(h(4), 0),
        "logsumexp": lambda: torch.logsumexp(h(4, 4), -1),
        "rms_norm": lambda: torch.nn.functional.rms_norm(h(4, 4), (4,)),
        "layer_norm": lambda: torch.nn.functional.layer_norm(h(4, 4), (4,)),
        "norm": lambda: torch.norm(h(4, 4)),
        "mse": lambda: torch.nn.functional.mse_loss(h(4), h(4)),
        "cross_entropy": lambda: torch.nn.functional.cross_entropy(h(4, 10), ids(4)),
        "addcmul mixed": lambda: torch.addcmul(h(4), f(4), h(4)),
        "addcmul low": lambda: torch.addcmul(h(4), h(4), h(4)),
        "cat mixed": lambda: torch.cat([h(4), f(4)]),
        "max dim": lambda: h(4, 4).max(-1).values,
        "where scalar": lambda: torch.where(torch.ones(4, dtype=torch.bool, device=dev), h(4), 0.0),
        "gelu": lambda: torch.nn.functional.gelu(h(4)),
        "silu": lambda: torch.nn.functional.silu(h(4)),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            f(1, 2, 4, 8), f(1, 2, 4, 8), f(1, 2, 4, 8)
        ),
        "double stays": lambda: torch.mm(
            torch.empty(4, 8, device=dev, dtype=torch.float64),
            torch.empty(8, 3, device=dev, dtype=torch.float64),
        ),
    }


@pytest.mark.parametrize("low", [BF16, F16])
def test_output_dtypes_match_pytorchs_own_autocast_cuda_kernels(low):
    # Ground truth: the AutocastCUDA kernels of this build, on fake CUDA tensors (no autograd)
    with FakeTensorMode():
        prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_dtype("cuda", low)
        torch.set_autocast_enabled("cuda", True)
        try:
            real = {k: fn().dtype for k, fn in _cases("cuda", low).items()}
        finally:
            torch.set_autocast_enabled("cuda", prev[0])
            torch.set_autocast_dtype("cuda", prev[1])
    with FakeTensorMode(), CudaEmulation((8, 0)):
        with torch.autocast("cuda", dtype=low):
            emulated = {k: fn().dtype for k, fn in _cases("cpu", low).items()}
    assert emulated == real
    # and the cases do exercise every kind of rule
    assert real["mm"] == low and real["exp"] == F32 and real["sum"] == F32
    assert real["addcmul mixed"] == F32 and real["addcmul low"] == low
    assert real["sum dtype"] == torch.float64 and real["double stays"] == torch.float64


def test_autocast_bf16_linear_allocates_half_the_bytes_of_fp32():
    b, d_in, d_out = 64, 1024, 4096

    def run(autocast: bool):
        with FakeTensorMode(), CudaEmulation((8, 0)):
            x = torch.empty(b, d_in)
            w = torch.empty(d_out, d_in, requires_grad=True)
            with torch.autocast("cuda", dtype=BF16, enabled=autocast):
                return _allocs(lambda: torch.nn.functional.linear(x, w))

    fp32, _ = run(False)
    bf16, out = run(True)
    assert fp32 == [("aten::mm", b * d_out * 4)]
    # autocast: x cast, W cast, then the bf16 output (autocast_mode.cpp's cached_cast order)
    assert bf16 == [
        ("aten::_to_copy", b * d_in * 2),
        ("aten::_to_copy", d_out * d_in * 2),
        ("aten::mm", b * d_out * 2),
    ]
    assert out.dtype == BF16


def test_weight_casts_are_cached_for_the_autocast_region_only():
    with FakeTensorMode(), CudaEmulation((8, 0)):
        x = torch.empty(8, 64, dtype=BF16)
        w = torch.empty(32, 64, requires_grad=True)  # leaf fp32 parameter: cacheable

        def lin(weight):
            return torch.nn.functional.linear(x, weight)

        def two_uses():
            with torch.autocast("cuda", dtype=BF16):
                return lin(w), lin(w)

        first, _ = _allocs(two_uses)
        second, _ = _allocs(two_uses)  # a new region: the cache was cleared on exit

        def uncached():
            with torch.autocast("cuda", dtype=BF16, cache_enabled=False):
                return lin(w), lin(w)

        third, _ = _allocs(uncached)
        v = torch.empty(32, 64)  # no grad: never cached (autocast caches only leaf params)

        def plain():
            with torch.autocast("cuda", dtype=BF16):
                return lin(v), lin(v)

        fourth, _ = _allocs(plain)

        def viewed():  # w.T is a view, not the leaf: CUDA's cache skips it too
            with torch.autocast("cuda", dtype=BF16):
                return x @ w.T, x @ w.T

        fifth, _ = _allocs(viewed)
    casts = [
        len([a for a in run if a[0] == "aten::_to_copy"])
        for run in (first, second, third, fourth, fifth)
    ]
    assert casts == [1, 1, 2, 2, 2]
    assert ("aten::_to_copy", 32 * 64 * 2) in first


def test_banned_op_raises_like_cuda_autocast():
    with FakeTensorMode(), CudaEmulation((8, 0)):
        p = torch.empty(4)
        with torch.autocast("cuda", dtype=F16), pytest.raises(InvalidInputError) as err:
            torch.nn.functional.binary_cross_entropy(p, p)
        torch.nn.functional.binary_cross_entropy(p, p)  # allowed outside autocast
    assert "binary_cross_entropy_with_logits" in str(err.value)


def test_everything_is_restored_on_exit():
    import torch.cuda.amp.common as amp_common
    import torch.optim.optimizer as optimizer

    def state() -> tuple:
        return (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled,
            torch.set_autocast_dtype,
            amp_common.amp_definitely_not_available,
            torch.cuda.is_bf16_supported,
            torch.clear_autocast_cache,
            optimizer._get_foreach_kernels_supported_devices,
            list(optimizer._foreach_supported_types),
        )

    before = state()
    with CudaEmulation((9, 0)):
        assert not amp_common.amp_definitely_not_available()
        assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        with torch.autocast("cuda", dtype=F16):  # one state for the fake GPU, by either name
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == F16
        assert not torch.is_autocast_enabled("cpu")
    after = state()
    assert after == before
    # CPU autocast follows CPU's own policy again (exp is not in CPU's fp32 list), and a real
    # CPU tensor goes through the compiled AutocastCPU kernels
    with torch.autocast("cpu", dtype=BF16):
        assert torch.exp(torch.ones(2, dtype=BF16)).dtype == BF16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == BF16
    # scaled_dot_product_attention is PyTorch's own again: a real CPU computation
    q = torch.randn(1, 2, 5, 8)
    ref = torch.softmax(q @ q.transpose(-2, -1) / 8**0.5, -1) @ q
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q), ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda"):
            pass
    assert any("Disabling autocast" in str(w.message) for w in caught)


def test_bad_input_is_refused_with_a_fix():
    for bad in [(9,), (9, 0, 1), "9.0", (9.0, 0), (2, 0), None]:
        with pytest.raises(InvalidInputError, match="compute_capability must be"):
            CudaEmulation(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="multiprocessors must be"):
        CudaEmulation((8, 0), multiprocessors=0)
    with CudaEmulation((8, 0)), pytest.raises(InvalidInputError, match="already active"):
        with CudaEmulation((8, 0)):
            pass
    with CudaEmulation((8, 0)):  # usable again after the refusal
        pass


# -- scaled_dot_product_attention -----------------------------------------------------------------


def _sdpa(cc, dtype, *, head=64, mask=False, dropout=0.0, causal=True, grad=True, L=1024):
    emu = CudaEmulation(cc)
    with FakeTensorMode(), emu:
        q = torch.empty(2, 8, L, head, dtype=dtype, requires_grad=grad)
        m = torch.empty(L, L, dtype=dtype) if mask else None
        fwd, out = _allocs(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q, q, q, attn_mask=m, dropout_p=dropout, is_causal=causal and not mask
            )
        )
        bwd, _ = _allocs(lambda: out.float().sum().backward()) if grad else ([], None)
    return emu.last_sdpa_backend, fwd, bwd, out


@pytest.mark.parametrize(
    ("cc", "dtype", "kw", "backend"),
    [
        ((8, 0), BF16, {}, "flash"),
        ((9, 0), F16, {"dropout": 0.1}, "flash"),
        ((8, 0), F32, {}, "efficient"),  # flash needs fp16/bf16
        ((8, 0), BF16, {"mask": True}, "efficient"),  # flash takes no attn_mask
        ((8, 0), BF16, {"head": 320}, "efficient"),  # flash: head dim <= 256
        ((8, 6), BF16, {"head": 200}, "efficient"),  # sm86 flash backward: head dim <= 192
        ((8, 6), BF16, {"head": 200, "grad": False}, "flash"),  # ... inference is fine
        ((7, 5), F16, {}, "efficient"),  # pre-Ampere: no flash
        ((7, 5), BF16, {}, "math"),  # pre-Ampere efficient: fp16/fp32 only
        ((8, 0), BF16, {"head": 36}, "flash"),  # efficient needs head % 8; flash pads
    ],
)
def test_sdpa_picks_cudas_backend(cc, dtype, kw, backend):
    assert _sdpa(cc, dtype, **kw)[0] == backend


def test_flash_attention_allocates_output_and_logsumexp_not_the_score_matrix():
    b, h, L, e = 2, 8, 1024, 64
    backend, fwd, bwd, out = _sdpa((8, 0), BF16)
    assert backend == "flash" and out.shape == (b, h, L, e)
    sizes = [n for _, n in fwd]
    # flash forward: output (B, L, H, E) in bf16 and softmax_lse (B, H, L) in fp32, plus the
    # RNG state (seed + offset, 24 B)
    assert sizes[:2] == [b * L * h * e * 2, b * h * L * 4]
    assert sum(sizes[2:]) <= 24
    assert max(n for _, n in bwd) == b * h * L * e * 4  # the fp32 upcast of out's grad
    assert b * h * L * L * 2 not in [n for _, n in fwd + bwd]  # no S x S anywhere
    # the math fallback (no flash/efficient on sm75 for bf16) materialises S x S (in fp32)
    backend, fwd, _, _ = _sdpa((7, 5), BF16)
    assert backend == "math" and b * h * L * L * 4 in [n for _, n in fwd]


def test_efficient_attention_pads_a_boolean_mask_to_16_columns():
    emu = CudaEmulation((8, 0))
    b, h, L, e = 1, 4, 100, 64
    with FakeTensorMode(), emu:
        q = torch.empty(b, h, L, e, dtype=F16)
        mask = torch.ones(L, L, dtype=torch.bool)
        fwd, _ = _allocs(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        )
    assert emu.last_sdpa_backend == "efficient"
    # attention.cpp: logical_not (bool L x L), two fp16 scalars, where -> additive fp16 mask;
    # preprocess_mask pads its 100 columns by 16 - 100 % 16 = 12 (stride 100 is not aligned);
    # then the output, an empty logsumexp (no grad) and the RNG seed/offset
    # (the C++ argument order of where(...) is the compiler's: compare the first three as a set)
    sizes = [n for _, n in fwd]
    assert sorted(sizes[:3]) == [2, 2, L * L] and sizes[3:5] == [L * L * 2, L * 112 * 2]
    assert [n for _, n in fwd][5:7] == [b * h * L * e * 2, 0]


# -- optimizers ---------------------------------------------------------------------------------


def _adamw_peak(fake: bool, foreach: bool | None) -> int:
    sizes = [(256, 256)] * 8 + [(256,)] * 4
    live = peak = 0

    def listener(ev, storage):
        nonlocal live, peak
        if ev.kind == EventKind.ALLOC:
            live += ev.nbytes
            peak = max(peak, live)
        elif ev.kind == EventKind.FREE:
            live -= ev.nbytes

    def body():
        params = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, foreach=foreach)
        opt.step()
        opt.step()

    with track(listeners=[listener]):
        if fake:
            with FakeTensorMode(), CudaEmulation((8, 0)):
                body()
        else:
            body()
    return peak


def test_adamw_defaults_to_foreach_like_on_cuda():
    # Ground truth: the same AdamW run for real on CPU with foreach forced on (the code path CUDA
    # takes by default) and off (what a plain CPU/fake run takes by default)
    real_foreach = _adamw_peak(fake=False, foreach=True)
    real_loop = _adamw_peak(fake=False, foreach=False)
    assert real_foreach > real_loop  # foreach allocates whole intermediate lists
    assert _adamw_peak(fake=True, foreach=None) == real_foreach
    assert _adamw_peak(fake=True, foreach=False) == real_loop
    with FakeTensorMode(), CudaEmulation((8, 0)):
        p = torch.nn.Parameter(torch.zeros(4))
        from torch.optim.optimizer import _default_to_fused_or_foreach

        assert _default_to_fused_or_foreach([p], False, False) == (False, True)


# -- sizes: cuBLAS workspace and reduction staging ---------------------------------------------------


def test_gemm_workspace_bytes(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    # the two 8,519,680-byte blocks of the pre-Hopper runs in gpu-truth.md; 32 MiB from sm90
    assert CudaEmulation((8, 6)).gemm_workspace_bytes == 8_519_680
    assert CudaEmulation((7, 5)).gemm_workspace_bytes == 8_519_680
    for cc in [(9, 0), (10, 0), (12, 0)]:
        assert CudaEmulation(cc).gemm_workspace_bytes == 32 * 2**20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert CudaEmulation((8, 0)).gemm_workspace_bytes == 32 * 2**20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the deterministic setting
    assert CudaEmulation((9, 0)).gemm_workspace_bytes == 16 * 1024 * 8


def test_lt_workspace_bytes(monkeypatch):
    for name in ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "CUBLASLT_WORKSPACE_SIZE",
                 "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    # its own 1 MiB block unless unified is asked for (the H100 runs of tests/data/gpu)
    assert CudaEmulation((9, 0)).lt_workspace_bytes == 1 << 20
    assert CudaEmulation((8, 6)).lt_workspace_bytes == 1 << 20
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "65536")  # KiB; capped at cuBLAS's size
    assert CudaEmulation((9, 0)).lt_workspace_bytes == 32 * 2**20
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")  # not capped
    assert CudaEmulation((9, 0)).lt_workspace_bytes == 64 * 2**20
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")  # shares cuBLAS's block
    assert CudaEmulation((9, 0)).lt_workspace_bytes == 0


def test_uses_cublaslt(monkeypatch):
    monkeypatch.delenv("DISABLE_ADDMM_CUDA_LT", raising=False)
    emu = CudaEmulation((9, 0))
    aten = torch.ops.aten
    addmm, act, mm = aten.addmm.default, aten._addmm_activation.default, aten.mm.default
    with FakeTensorMode():
        x, w, b = torch.empty(8, 4), torch.empty(4, 16), torch.empty(16)
        b2, row = torch.empty(8, 16), torch.empty(1, 4)
        xh, wh, bh = (t.half() for t in (x, w, b))
        xi, wi, bi = (t.long() for t in (x, w, b))
    assert emu.uses_cublaslt(addmm, (b, x, w), {})
    assert emu.uses_cublaslt(addmm, (bh, xh, wh), {})
    assert not emu.uses_cublaslt(mm, (x, w), {})
    assert not emu.uses_cublaslt(addmm, (b, x, w), {"beta": 0.5})
    assert not emu.uses_cublaslt(addmm, (b2, x, w), {})        # 2-D bias: plain cuBLAS
    assert emu.uses_cublaslt(act, (b2, x, w), {})              # unless an activation is fused
    assert not emu.uses_cublaslt(addmm, (b, row, w), {})       # a one-row matrix
    assert not emu.uses_cublaslt(addmm, (bi, xi, wi), {})      # integer GEMM
    monkeypatch.setenv("DISABLE_ADDMM_CUDA_LT", "1")
    assert not emu.uses_cublaslt(addmm, (b, x, w), {})


def test_efficient_attention_backward_scratch():
    from torchmem.fit.fakegpu.kernels._attention_scratch import _efficient_backward_transients

    def scratch(shape, dtype, cc):
        b, h, m, d = shape
        with FakeTensorMode():
            q = torch.empty(b, m, h, d, dtype=dtype).transpose(1, 2)  # the forward's layout
            g = torch.empty(b, m, h, d, dtype=dtype).transpose(1, 2)
        return [(n, label.split(": ")[1], *rest)
                for n, label, *rest in _efficient_backward_transients((g, q, q, q, None, q), {}, cc)]

    # fp32 (the GPT fp32 runs of tests/data/gpu, per layer): delta from the product and the
    # row sums, which go once delta exists; then the dQ workspace, 8 x 1 x (4 + 64 x 64) floats
    # per (batch, head)
    assert scratch((8, 16, 512, 64), torch.float32, (9, 0)) == [
        (16777216, "grad_out * out"), (262144, "row sums"), (262144, "delta", (1, 0)),
        (16793600, "workspace")]
    # bf16, head dim 128 on an A100: the 128 x 128 kernel keeps dK/dV in registers
    assert scratch((2, 4, 1024, 128), torch.bfloat16, (8, 0)) == [
        (32768, "delta"), (2 * 4 * 8 * 1 * (4 + 128 * 128) * 4, "workspace")]
    # ... on an RTX 4090 (less shared memory): 64-row blocks, dK/dV accumulated in fp32, one
    # key split (200 // (2 x 4) = 25 > 16 blocks of keys: 16 splits)
    gkv = 16 * 1024 * 128
    assert scratch((2, 4, 1024, 128), torch.bfloat16, (8, 9)) == [
        (32768, "delta"), (2 * 4 * (2 * gkv + 16 * 2 * (4 + 64 * 64)) * 4, "workspace")]


def _transients(cc, shape, op, *rest, layout=None, sms=None):
    emu = CudaEmulation(cc, multiprocessors=sms)
    with FakeTensorMode():
        x = torch.empty(*shape) if layout is None else layout()
        out = op(x, *rest)
    return emu.transients(op, (x, *rest), {}, out)


def test_reduction_staging_matches_the_recorded_traces():
    # MAGMA27 (gpu-truth.md): each RMSNorm weight gradient sums a (32*256, 768) fp32 product
    # over its rows; its trace shows a 50,331,648 B staging buffer and a 24 B semaphore.
    # Reduce.cuh: output-vectorised by 4, block 32 x 4, 6 output blocks (24 B of semaphores),
    # 128 blocks per output (values per thread 2048 / 16), 4 B x 768 x 128 x 32 x 4 staging.
    sum_rows = torch.ops.aten.sum.dim_IntList
    assert _transients((8, 6), (8192, 768), sum_rows, [0]) == [
        (50_331_648, "reduction staging"),
        (24, "reduction semaphores"),
    ]
    # a held-out run: max(dim=-1) over 512 x 10000 fp32 laid out with the reduced dim strided:
    # pair<float, int64> (16 B) x 512 outputs x 157 blocks x 32 x 4
    assert _transients(
        (8, 0), (), torch.ops.aten.max.dim, -1, layout=lambda: torch.empty(10000, 512).T
    ) == [(164_626_432, "reduction staging"), (16, "reduction semaphores")]
    # a small GPU caps the blocks per output: T4 has 40 SMs x 1024 threads -> 320 resident
    # 128-thread blocks, 6 output blocks -> 54 blocks per output (instead of 128)
    assert _transients((7, 5), (8192, 768), sum_rows, [0])[0] == (393_216 * 54, "reduction staging")
    # ... and the SM count is the caller's to give: 82 SMs x 8 blocks = 656 -> 110 per output
    assert _transients((7, 5), (8192, 768), sum_rows, [0], sms=82)[0][0] == 393_216 * 110


def test_reductions_that_fit_one_block_per_output_allocate_nothing():
    # RMSNorm's mean over 768 contiguous values per row (the forward): no staging in the traces
    mean = torch.ops.aten.mean.dim
    assert _transients((8, 6), (8192, 768), mean, [-1], True) == []
    # max over contiguous rows, elementwise max and non-reductions: nothing
    assert _transients((8, 0), (512, 10000), torch.ops.aten.max.dim, -1) == []
    emu = CudaEmulation((8, 0))
    with FakeTensorMode():
        a = torch.empty(4, 4)
        assert emu.transients(torch.ops.aten.max.other, (a, a), {}, torch.max(a, a)) == []
        assert emu.transients(torch.ops.aten.mm.default, (a, a), {}, a @ a) == []


def test_modelled_documents_every_case():
    names = [m[0] for m in MODELLED]
    assert len(names) == len(set(names)) >= 6
    assert all(isinstance(x, str) and x for m in MODELLED for x in m)
    assert any("not modelled" in m[2] for m in MODELLED)  # cuDNN RNNs, said plainly


def _flash_backward_scratch(layout_blhd: bool) -> list[tuple[int, str]]:
    emu = CudaEmulation((8, 0))
    got: list[tuple[int, str]] = []

    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "flash_attention_backward" in str(func):
                got.extend(emu.transients(func, args, kwargs or {}, out))
            return out

    b, h, L, d = 2, 8, 1000, 64
    with FakeTensorMode(), emu, Spy():
        if layout_blhd:  # the usual model code: (B, L, H*D) projections viewed as heads
            x = torch.empty(b, L, h * d, dtype=BF16, requires_grad=True)
            q = x.view(b, L, h, d).transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.transpose(1, 2).reshape(b, L, h * d).float().sum().backward()
        else:
            q = torch.empty(b, h, L, d, dtype=BF16, requires_grad=True)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.float().sum().backward()
    return got


def test_flash_backward_scratch_follows_flash_api():
    b, h, L, d = 2, 8, 1000, 64
    softmax_d = (b * h * 1024 * 4, "flash backward: softmax_d")  # L rounded up to 128
    dq_accum = (b * 1024 * h * 64 * 4, "flash backward: dq accumulator")  # D rounded to 32
    # (B, L, H, D)-laid-out q, out and grad_out: the kernel's layout, nothing to copy
    assert _flash_backward_scratch(layout_blhd=True) == [softmax_d, dq_accum]
    # (B, H, L, D)-contiguous q (so out, an empty_like of q, too) and grad_out: both copied
    copy = b * h * L * d * 2
    assert _flash_backward_scratch(layout_blhd=False) == [
        (copy, "flash backward: contiguous grad_out"),
        (copy, "flash backward: contiguous out"),
        softmax_d,
        dq_accum,
    ]


def test_activation_checkpointing_recomputes_under_the_captured_autocast_state():
    from torch.utils.checkpoint import checkpoint

    def run(use_checkpoint: bool) -> list[tuple[str | None, int]]:
        with FakeTensorMode(), CudaEmulation((8, 0)):
            lin = torch.nn.Linear(256, 512)
            x = torch.empty(8, 256, requires_grad=True)

            def body(t):
                return torch.relu(lin(t))

            with torch.autocast("cuda", dtype=BF16):
                y = checkpoint(body, x, use_reentrant=False) if use_checkpoint else body(x)
            seen, _ = _allocs(lambda: y.float().sum().backward())
        return seen

    plain, ckpt = run(False), run(True)
    # on CUDA the recomputation runs under the autocast state checkpoint captured: bf16 casts
    # of x and W and a bf16 (8 x 512) output, exactly what the forward allocated
    recomputed = [a for a in ckpt if a not in plain]
    assert ("aten::addmm", 8 * 512 * 2) in recomputed
    assert ("aten::_to_copy", 512 * 256 * 2) in recomputed
    assert all(n != 8 * 512 * 4 for op, n in recomputed if op == "aten::addmm")


def test_dropout_keeps_a_bool_mask_like_cudas_fused_kernel():
    n = 1024 * 1024

    def run(emulate: bool):
        with FakeTensorMode():
            x = torch.empty(1024, 1024, requires_grad=True)
            if emulate:
                with CudaEmulation((8, 0)):
                    return _allocs(lambda: torch.nn.functional.dropout(x, 0.1, True))[0]
            return _allocs(lambda: torch.nn.functional.dropout(x, 0.1, True))[0]

    # CUDA (Dropout.cpp: is_fused_kernel_acceptable): native_dropout -> output + bool mask
    assert run(True) == [("aten::native_dropout", 4 * n), ("aten::native_dropout", n)]
    # the CPU path a plain fake run takes: a float noise tensor, then the product
    assert sorted(b for _, b in run(False)) == [4 * n, 4 * n]
    with FakeTensorMode(), CudaEmulation((8, 0)):
        x = torch.empty(4, 4)
        assert torch.nn.functional.dropout(x, 0.1, False) is x  # eval: the input itself
        assert torch.nn.functional.dropout(x, 0.0, True) is x


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_over_a_zero_length_query_runs_and_holds_only_its_inputs(dtype):
    """A query of no tokens (an empty prompt chunk): the kernels' scratch buffers are empty,
    and PyTorch never calls the allocator for 0 bytes (before, the simulator was asked to)."""
    from torchmem.fit import estimate

    shapes = []

    def build(batch):
        q = torch.zeros(batch, 4, 0, 64, device="cuda", dtype=dtype)
        kv = torch.zeros(batch, 4, 16, 64, device="cuda", dtype=dtype)
        return lambda: shapes.append(
            tuple(torch.nn.functional.scaled_dot_product_attention(q, kv, kv).shape))

    e = estimate(build, "A100-40GB", 2, steps=1)
    assert e.fits and shapes == [(2, 4, 0, 64)]
    assert e.peak_requested_bytes >= 2 * 4 * 16 * 64 * dtype.itemsize  # the keys and values
