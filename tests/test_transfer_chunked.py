"""Chunked, double-buffered transfers on CPU and meta: chunk arithmetic, byte-exact results,
measured staging memory, modules, offloaded inference and the ledger."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchmem.capture.storage import storage_bytes
from torchmem.errors import InvalidInputError, TransferError
from torchmem.transfer import (
    StagingBuffers,
    chunked_transfer,
    offload_forward,
    transfer_module,
)

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int64, torch.bool, torch.complex64,
]


class AllocRecorder(TorchDispatchMode):
    """Independent ground truth: every tensor allocation torch performs inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: list[tuple[torch.dtype, str, int, weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like):
            s = out.untyped_storage()
            self.allocs.append((out.dtype, out.device.type, int(s.nbytes()), weakref.ref(s)))
        return out

    def uint8(self, result: torch.Tensor | None = None) -> list[int]:
        """Sizes of uint8 allocations (the staging buffers), leaving out ``result``'s storage."""
        keep = result.untyped_storage() if result is not None else None
        return [
            n for dt, _, n, ref in self.allocs
            if dt == torch.uint8 and (keep is None or ref() is not keep)
        ]


class RecordingLedger:
    """A small real recorder of allocate/free calls, counting each storage once."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0
        self.calls: list[tuple[str, int]] = []

    def allocate(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self.calls.append(("allocate", int(s.nbytes())))
        self.live[int(s._cdata)] = int(s.nbytes())
        self.peak = max(self.peak, sum(self.live.values()))

    def free(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self.calls.append(("free", int(s.nbytes())))
        self.live.pop(int(s._cdata), None)


def expected_chunks(nbytes: int, chunk_bytes: int, es: int) -> list[int]:
    step = (chunk_bytes // es) * es
    full, rest = divmod(nbytes, step)
    return [step] * full + ([rest] if rest else [])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (NaN payloads and -0.0 included), independent of strides."""
    ca, cb = a.contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        ca.reshape(-1).view(torch.uint8), cb.reshape(-1).view(torch.uint8)
    )


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
        if x.numel() > 2:
            flat = x.view(-1)
            flat[0], flat[1] = float("nan"), -0.0
        return x
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


# ---------------------------------------------------------------- chunk arithmetic


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_not_dividing_size_are_byte_exact(dtype):
    x = make(dtype, (37, 11))
    es = x.element_size()
    cb = 5 * es + (es // 2 if es > 1 else 0) + 1  # not a multiple of the element size
    with AllocRecorder() as rec:
        r = chunked_transfer(x, "cpu", chunk_bytes=cb)
    n = x.numel() * es
    assert list(r.chunk_sizes) == expected_chunks(n, cb, es)
    assert r.bytes_moved == n == sum(r.chunk_sizes)
    assert same_bytes(r.tensor, x) and r.tensor.data_ptr() != x.data_ptr()
    step = (cb // es) * es
    # staging measured by the transfer == staging torch really allocated (dispatch-level record)
    assert rec.uint8(r.tensor) == [step, step]
    assert r.peak_staging_bytes == sum(rec.uint8(r.tensor)) == 2 * step
    assert r.staging_buffers_created == 2
    # and it was freed when the transfer ended (temporary buffers)
    gc.collect()
    out_storage = r.tensor.untyped_storage()
    staging_refs = [ref for dt, _, _, ref in rec.allocs if dt == torch.uint8 and ref() is not out_storage]
    assert len(staging_refs) == 2 and all(ref() is None for ref in staging_refs)


def test_single_chunk_uses_one_small_buffer():
    x = torch.arange(10, dtype=torch.float32)
    with AllocRecorder() as rec:
        r = chunked_transfer(x, "cpu", chunk_bytes=1 << 20)
    assert r.chunk_sizes == (40,) and rec.uint8() == [40]
    assert r.peak_staging_bytes == 40 and r.staging_buffers_created == 1


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 5)])
def test_empty_tensors(shape):
    x = torch.empty(shape)
    with AllocRecorder() as rec:
        r = chunked_transfer(x, "cpu", chunk_bytes=8)
    assert r.chunks == 0 and r.bytes_moved == 0 and r.peak_staging_bytes == 0
    assert rec.uint8() == [] and r.tensor.shape == x.shape
    m = chunked_transfer(x, "meta", chunk_bytes=8)
    assert m.tensor.is_meta and m.tensor.shape == x.shape and m.chunks == 0


def test_zero_dim_tensor():
    x = torch.tensor(3.5, dtype=torch.float64)
    r = chunked_transfer(x, "cpu", chunk_bytes=3 * 8)
    assert r.tensor.shape == () and r.tensor.item() == 3.5 and r.chunk_sizes == (8,)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[::2, 1::3],
        lambda t: t[2:, :5],
        lambda t: t.reshape(4, 6, 4).permute(2, 0, 1),
        lambda t: t[0].expand(7, 24),  # stride 0: the same bytes repeated
        lambda t: t.reshape(2, 2, 3, 2, 4).permute(4, 2, 0, 3, 1)[:, 1:, :, :, ::-1 if False else 1],
    ],
)
def test_non_contiguous_inputs_are_byte_exact(view):
    base = make(torch.float32, (4, 24), seed=3)
    x = view(base)
    assert not x.is_contiguous() or x.numel() == 0
    for cb in (4, 12, 28, 100, 10_000):
        with AllocRecorder() as rec:
            r = chunked_transfer(x, "cpu", chunk_bytes=cb)
        n = x.numel() * 4
        assert list(r.chunk_sizes) == expected_chunks(n, cb, 4)
        assert same_bytes(r.tensor, x)
        # result layout as Tensor.to gives it: strides kept for dense permutations, else contiguous
        assert r.tensor.stride() == x.to("cpu", copy=True).stride()
        # no full contiguous copy of the input was made: only the output and the staging
        float_allocs = [m for dt, _, m, _ in rec.allocs if dt == torch.float32]
        assert float_allocs == [n]
        assert r.peak_staging_bytes == sum(rec.uint8()) <= 2 * min(cb, n)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    perm_seed=st.integers(0, 1000),
    chunk_elems=st.integers(1, 50),
    extra=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.int16, torch.complex128, torch.bool]),
)
def test_property_any_layout_any_chunk(shape, perm_seed, chunk_elems, extra, dtype):
    base = make(dtype, tuple(shape), seed=perm_seed)
    g = torch.Generator().manual_seed(perm_seed)
    perm = torch.randperm(len(shape), generator=g).tolist()
    x = base.permute(*perm)
    es = x.element_size()
    cb = chunk_elems * es + min(extra, es - 1)
    r = chunked_transfer(x, "cpu", chunk_bytes=cb)
    assert list(r.chunk_sizes) == expected_chunks(x.numel() * es, cb, es)
    assert same_bytes(r.tensor, x)
    assert r.peak_staging_bytes == min(2, r.chunks) * min(chunk_elems * es, x.numel() * es)


def test_chunk_size_errors():
    x = torch.ones(4, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="smaller than one element"):
        chunked_transfer(x, "cpu", chunk_bytes=7)
    for bad in (0, -5, 1.5, True, "lots"):
        with pytest.raises(InvalidInputError):
            chunked_transfer(x, "cpu", chunk_bytes=bad)
    assert chunked_transfer(x, "cpu", chunk_bytes="16 B").chunk_sizes == (16, 16)
    with pytest.raises(InvalidInputError, match="expected a torch.Tensor"):
        chunked_transfer([1.0], "cpu")


# ---------------------------------------------------------------- meta


def test_cpu_to_meta_runs_the_same_loop_shape_only():
    x = torch.randn(1000)
    with AllocRecorder() as rec:
        r = chunked_transfer(x, "meta", chunk_bytes=1024)
    assert r.shape_only and r.tensor.is_meta and r.tensor.shape == x.shape
    assert list(r.chunk_sizes) == expected_chunks(4000, 1024, 4)
    staging = [(dev, n) for dt, dev, n, _ in rec.allocs if dt == torch.uint8]
    assert staging == [("meta", 1024), ("meta", 1024)]  # no host memory used
    assert r.peak_staging_bytes == 2048


def test_meta_to_meta_and_meta_to_cpu():
    m = torch.empty(10, 3, device="meta")
    r = chunked_transfer(m, "meta", chunk_bytes=50)
    assert r.tensor.is_meta and r.chunk_sizes == (48, 48, 24)
    with pytest.raises(TransferError, match="meta tensor has shapes but no data"):
        chunked_transfer(m, "cpu")


# ---------------------------------------------------------------- staging reuse


def test_staging_buffers_are_reused_across_transfers():
    pool = StagingBuffers(256, pin=False)
    xs = [make(torch.float32, (100,), seed=i) for i in range(3)]
    with AllocRecorder() as rec:
        results = [chunked_transfer(x, "cpu", staging=pool) for x in xs]
    assert rec.uint8() == [256, 256]  # allocated once, reused by the next transfers
    assert [r.staging_buffers_created for r in results] == [2, 0, 0]
    assert all(r.peak_staging_bytes == 512 for r in results)
    assert all(same_bytes(r.tensor, x) for r, x in zip(results, xs))
    assert pool.live_bytes == 512
    pool.release()
    gc.collect()
    assert pool.live_bytes == 0


def test_staging_buffer_validation():
    with pytest.raises(InvalidInputError, match="host memory"):
        StagingBuffers(64, device="cuda:0")
    if not torch.accelerator.is_available():
        with pytest.raises(InvalidInputError, match="pin=True needs an accelerator"):
            StagingBuffers(64, pin=True)
        assert StagingBuffers(64).pinned is False
    pool = StagingBuffers(64, pin=False)
    with pytest.raises(InvalidInputError, match="at most chunk_bytes"):
        pool.acquire(0, 65)
    with pytest.raises(InvalidInputError, match="slot must be 0 or 1"):
        pool.acquire(2, 8)
    with pytest.raises(InvalidInputError, match="StagingBuffers"):
        chunked_transfer(torch.ones(2), "cpu", staging=object())


# ---------------------------------------------------------------- ledger


def test_ledger_sees_staging_and_result_recording_object():
    led = RecordingLedger()
    x = torch.randn(300)
    r = chunked_transfer(x, "cpu", chunk_bytes=512, ledger=led)
    assert led.calls == [("allocate", 512), ("allocate", 512), ("allocate", 1200),
                         ("free", 512), ("free", 512)]
    assert led.peak == 2 * 512 + 1200 == r.peak_staging_bytes + r.bytes_moved


def test_real_ledger_counts_staging_and_result():
    from torchmem import Ledger

    led = Ledger()
    x = torch.randn(300)
    r = chunked_transfer(x, "cpu", chunk_bytes=512, ledger=led)
    assert led.allocated("cpu")[0] == 1200 == r.bytes_moved  # staging freed, result alive
    assert led.record("cpu").peak == 1200 + 2 * 512
    assert led.freed("cpu")[0] == 1024
    out = r.tensor
    del r, out
    gc.collect()
    assert led.allocated("cpu")[0] == 0  # the result's death is credited by the ledger itself


# ---------------------------------------------------------------- modules


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.norm = nn.BatchNorm1d(6)
        self.register_buffer("first_row", self.emb.weight.data[0])  # a view of a parameter


def test_transfer_module_cpu_to_cpu_keeps_identity_aliasing_and_values():
    torch.manual_seed(0)
    m = Tied()
    m.emb.weight.grad = torch.randn(10, 6)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    all_tensors = [t for t in list(m.parameters()) + list(m.buffers())] + [m.emb.weight.grad]
    truth = storage_bytes(all_tensors)["cpu"]  # each distinct storage once
    old_ptr = m.emb.weight.data_ptr()
    n_storages = len({t.untyped_storage()._cdata for t in all_tensors})  # before the move
    with AllocRecorder() as rec:
        r = transfer_module(m, "cpu", chunk_bytes=64)
    assert r.bytes_moved == truth and r.storages == n_storages == 7
    assert list(r.chunk_sizes) == expected_chunks(truth, 64, 1)
    assert r.peak_staging_bytes == 128 and rec.uint8().count(64) == 2
    assert list(m.parameters()) == params  # same Parameter objects
    assert m.emb.weight.data_ptr() != old_ptr
    assert m.head.weight is m.emb.weight
    assert m.first_row.untyped_storage() is m.emb.weight.untyped_storage()  # aliasing kept
    assert m.first_row.storage_offset() == 0 and torch.equal(m.first_row, m.emb.weight[0])
    for k, v in m.state_dict().items():
        assert same_bytes(v, before[k]), k
    assert m.emb.weight.grad is not None and m.emb.weight.grad.shape == (10, 6)


def test_transfer_module_to_meta_and_ledger():
    from torchmem import Ledger

    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    w = m[0].weight
    truth = storage_bytes(list(m.parameters()))["cpu"]
    led = Ledger()
    r = transfer_module(m, "meta", chunk_bytes=100, ledger=led)
    assert m[0].weight is w and w.is_meta  # identity kept even where .data cannot change type
    assert r.shape_only and r.bytes_moved == truth == 8 * 8 * 4 + 8 * 4 * 3
    assert led.allocated("meta")[0] == truth
    # meta targets stage through meta buffers: two 100-byte chunks, freed before the results
    assert led.freed("meta")[0] == 200 and led.record("meta").peak == truth
    with pytest.raises(TransferError, match="no data"):
        transfer_module(m, "cpu")
    with pytest.raises(InvalidInputError, match="nn.Module"):
        transfer_module(torch.ones(2), "cpu")


def test_transfer_module_is_all_or_nothing_and_shares_the_move_with_memory_aware_to():
    # one storage cannot be copied (meta has no data): nothing is swapped, whatever was copied
    m = nn.Linear(4, 4)
    m.register_buffer("shape_only", torch.empty(3, device="meta"))
    w, ptr = m.weight, m.weight.data_ptr()
    with pytest.raises(TransferError, match="no data"):
        transfer_module(m, "cpu", chunk_bytes=16)
    assert m.weight is w and m.weight.data_ptr() == ptr and m.shape_only.is_meta
    # the same move as memory_aware_to, with its optimizer-free, dtype-free arguments
    import torchmem.move

    t = nn.Linear(3, 3)
    t.register_buffer("w_t", t.weight.detach().t())
    moved = torchmem.move.move_module(t, "meta", copy=True)
    assert moved[0] is t.weight and t.w_t.untyped_storage() is t.weight.untyped_storage()


# ---------------------------------------------------------------- offloaded inference


def mlp(widths: list[int], seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("overlap", [True, False])
def test_offload_forward_cpu_matches_model_and_bounds_residency(overlap):
    model = mlp([16, 64, 8, 32, 4])
    x = torch.randn(5, 16)
    ref = model(x)
    wptr = model[0].weight.data_ptr()
    led = RecordingLedger()
    r = offload_forward(model, x, "cpu", chunk_bytes=512, ledger=led, overlap=overlap)
    assert torch.equal(r.output, ref)
    per_layer = [sum(storage_bytes(list(m.parameters())).values()) for m in model]
    assert list(r.layer_bytes) == per_layer and r.bytes_moved == sum(per_layer)
    pairs = [a + b for a, b in zip(per_layer, per_layer[1:])]
    if overlap:  # fetch i + 1 races with layer i: at most two layers, at least the largest one
        assert max(per_layer) <= r.peak_resident_bytes <= max(pairs)
    else:  # fixed order: layer i + 1 is fetched while layer i is still held
        assert r.peak_resident_bytes == max(pairs)
    assert r.peak_staging_bytes == 2 * min(512, max(per_layer))
    assert r.staging_buffers_created == 2
    assert r.chunks == sum(len(expected_chunks(n, 512, 1)) for n in per_layer)
    # the model itself was not touched
    assert model[0].weight.data_ptr() == wptr and model[0].weight.device.type == "cpu"
    # the ledger saw everything come and go; its peak is staging plus two layers
    assert led.live == {}
    if not overlap:
        assert led.peak == r.peak_staging_bytes + r.peak_resident_bytes


def test_offload_forward_meta_dry_run_and_real_ledger():
    from torchmem import Ledger

    model = mlp([32, 128, 128, 16])
    led = Ledger()
    r = offload_forward(
        list(model), torch.randn(2, 32), "meta", chunk_bytes=4096, ledger=led, overlap=False
    )
    assert r.shape_only and r.output.is_meta and r.output.shape == (2, 16)
    per_layer = [sum(storage_bytes(list(m.parameters())).values()) for m in model]
    assert list(r.layer_bytes) == per_layer
    assert r.peak_resident_bytes == max(a + b for a, b in zip(per_layer, per_layer[1:]))
    gc.collect()
    assert led.allocated("meta")[0] == 0
    assert led.record("meta").peak == r.peak_staging_bytes + r.peak_resident_bytes


def test_offload_forward_frees_shared_storages_once():
    # Regression: a layer whose names share a storage (a buffer viewing the weight, a tied
    # weight) was allocated once per storage but freed once per name, so a real Ledger counted
    # a spurious "untracked" free for every alias.
    from torchmem import Ledger

    lin = nn.Linear(4, 4)
    lin.register_buffer("w_t", lin.weight.detach().t())
    other = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    ref = other(lin(x))
    led, rec = Ledger(), RecordingLedger()
    for ledger in (led, rec):
        r = offload_forward([lin, other], x, "cpu", chunk_bytes=64, ledger=ledger, overlap=False)
        assert torch.allclose(r.output, ref)
    per_layer = [sum(storage_bytes([t for t in m.state_dict().values()]).values())
                 for m in (lin, other)]
    assert per_layer == [4 * 4 * 4 + 4 * 4, 4 * 4 * 4 + 4 * 4]
    assert led.untracked_frees == 0
    # every storage (2 weights of each layer's copy + 2 staging buffers) freed exactly once
    frees = [n for kind, n in rec.calls if kind == "free"]
    allocs = [n for kind, n in rec.calls if kind == "allocate"]
    assert sorted(frees) == sorted(allocs) and sum(frees) == sum(per_layer) + 2 * 64
    assert led.freed()[0] == sum(per_layer) + 2 * 64


def test_offload_forward_errors_and_empty():
    with pytest.raises(InvalidInputError, match=r"layers\[1\]"):
        offload_forward([nn.ReLU(), abs], torch.ones(2), "cpu")
    # an error inside a layer propagates (and the prefetch thread is joined)
    with pytest.raises(RuntimeError):
        offload_forward([nn.Linear(4, 4), nn.Linear(3, 3)], torch.ones(2, 4), "cpu")
    x = torch.ones(3)
    r = offload_forward([], x, "cpu")
    assert r.output is x and r.layers == 0 and r.peak_staging_bytes == 0
