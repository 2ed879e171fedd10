"""Storage identity, spans, overlap and dedup against ground truth computed other ways.

Ground truths used here:
- element byte offsets from PyTorch's own indexing (``t[idx].data_ptr()`` minus the storage's
  data pointer) for CPU tensors;
- element offsets from explicit index arithmetic (``offset + sum(i_k * stride_k)`` over every
  index, with ``torch.arange`` broadcasting) for any device, including meta;
- union sizes from a byte bitmap (numpy) rather than sorting and merging.
"""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchmem.capture.storage import (
    Span,
    device_str,
    merge_spans,
    overlaps,
    resolve_device,
    same_storage,
    storage_bytes,
    storage_id,
    storage_nbytes,
    storage_of,
    storage_ref,
    tensor_span,
    unique_bytes,
)
from torchmem.errors import DeviceError, InvalidInputError, UnsupportedTensorError

DTYPES = [
    (torch.bool, 1), (torch.uint8, 1), (torch.int8, 1),
    (torch.int16, 2), (torch.float16, 2), (torch.bfloat16, 2),
    (torch.float32, 4), (torch.int32, 4),
    (torch.float64, 8), (torch.int64, 8), (torch.complex64, 8),
    (torch.complex128, 16),
]


# -- ground truths ---------------------------------------------------------------------------

def element_offsets(t: torch.Tensor) -> torch.Tensor:
    """Storage offsets (in elements) of every element, by explicit index arithmetic."""
    off = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        off = off + torch.arange(size, dtype=torch.int64).view(shape) * stride
    return off.reshape(-1) if t.dim() else off.reshape(1)


def truth_span(t: torch.Tensor) -> Span:
    es = t.element_size()
    if t.numel() == 0:
        return Span(t.storage_offset() * es, t.storage_offset() * es)
    offs = element_offsets(t)
    return Span(int(offs.min()) * es, (int(offs.max()) + 1) * es)


def ptr_span(t: torch.Tensor) -> Span:
    """Byte span from PyTorch's own per-element data pointers (CPU only)."""
    base = t.untyped_storage().data_ptr()
    es = t.element_size()
    addrs = [t[idx].data_ptr() - base for idx in itertools.product(*(range(s) for s in t.shape))]
    return Span(min(addrs), max(addrs) + es)


def bitmap_union(tensors: list[torch.Tensor]) -> dict[str, int]:
    maps: dict[int, tuple[str, np.ndarray]] = {}
    for t in tensors:
        s = t.untyped_storage()
        key = int(s._cdata)
        if key not in maps:
            maps[key] = (device_str(t.device), np.zeros(s.nbytes(), dtype=bool))
        sp = truth_span(t)
        maps[key][1][sp.start:sp.end] = True
    out: dict[str, int] = {}
    for dev, m in maps.values():
        out[dev] = out.get(dev, 0) + int(m.sum())
    return out


# -- spans -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,size", DTYPES)
def test_element_size_and_span_for_every_dtype(dtype: torch.dtype, size: int) -> None:
    x = torch.zeros(5, 6, dtype=dtype)
    assert x.element_size() == size
    assert storage_nbytes(x) == 30 * size
    views = [x, x.t(), x[1:, 2:], x[:, ::2], x[2], x[1:4, 1:5].t(), x[3, 4], x[:, 5]]
    for v in views:
        assert tensor_span(v) == truth_span(v) == ptr_span(v), (dtype, v.shape, v.stride())
    assert tensor_span(x[1:, 2:]) == Span(8 * size, 30 * size)
    assert tensor_span(x[3, 4]) == Span(22 * size, 23 * size)


def test_expand_has_zero_strides_and_small_span() -> None:
    row = torch.arange(4, dtype=torch.float32)
    e = row.expand(1000, 4)
    assert e.stride() == (0, 1)
    assert tensor_span(e) == truth_span(e) == Span(0, 16)
    col = torch.arange(3, dtype=torch.float64).view(3, 1).expand(3, 7)
    assert tensor_span(col) == ptr_span(col) == Span(0, 24)
    scalar = torch.tensor(2.0).expand(5, 5)
    assert tensor_span(scalar) == Span(0, 4)
    assert unique_bytes([e, row]) == {"cpu": 16}
    assert storage_bytes([e]) == {"cpu": 16}


def test_empty_tensors() -> None:
    x = torch.zeros(10, dtype=torch.int16)
    assert tensor_span(x[:0]) == Span(0, 0)
    assert tensor_span(x[4:4]) == Span(8, 8)
    e = torch.empty(0, 3)
    assert tensor_span(e) == Span(0, 0)
    assert unique_bytes([e]) == {"cpu": 0}
    assert storage_bytes([e]) == {"cpu": 0}
    assert not overlaps(x[:0], x)
    assert not overlaps(x, x[5:5])
    assert same_storage(x[:0], x)


def test_scalar_and_0d_views() -> None:
    x = torch.arange(12, dtype=torch.int32).view(3, 4)
    v = x[2, 3]
    assert v.dim() == 0
    assert tensor_span(v) == Span(44, 48)
    assert tensor_span(torch.tensor(1.5, dtype=torch.float64)) == Span(0, 8)


def test_transposes_and_permutes_match_pointer_ground_truth() -> None:
    x = torch.zeros(2, 3, 4, dtype=torch.float32)
    for perm in itertools.permutations(range(3)):
        v = x.permute(*perm)
        assert tensor_span(v) == ptr_span(v) == Span(0, 96)
    v = x[1:, ::2, 1:3].permute(2, 0, 1)
    assert tensor_span(v) == ptr_span(v) == truth_span(v)


@st.composite
def strided(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], int, int, torch.dtype]:
    ndim = draw(st.integers(0, 4))
    sizes = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    strides = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    offset = draw(st.integers(0, 9))
    extra = draw(st.integers(0, 5))
    dtype = draw(st.sampled_from([d for d, _ in DTYPES]))
    return sizes, strides, offset, extra, dtype


@settings(max_examples=150, deadline=None)
@given(strided())
def test_span_of_any_as_strided_matches_brute_force(case: tuple) -> None:
    sizes, strides, offset, extra, dtype = case
    reach = sum((s - 1) * st for s, st in zip(sizes, strides)) if all(sizes) else 0
    base = torch.zeros(offset + reach + 1 + extra, dtype=dtype)
    t = base.as_strided(sizes, strides, offset)
    assert tensor_span(t) == truth_span(t)
    if t.numel():
        assert tensor_span(t) == ptr_span(t)
    m = torch.empty(base.shape, dtype=dtype, device="meta").as_strided(sizes, strides, offset)
    assert tensor_span(m) == truth_span(m) == tensor_span(t)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=8),
       st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.complex128]))
def test_unique_bytes_of_slices_matches_bitmap(ranges: list[tuple[int, int]], dtype: torch.dtype) -> None:
    x = torch.zeros(40, dtype=dtype)
    y = torch.zeros(7, dtype=dtype)
    views = [x[min(a, b):max(a, b)] for a, b in ranges] + [y[1:5]]
    assert unique_bytes(views) == bitmap_union(views)
    assert storage_bytes(views) == {"cpu": (40 + 7) * x.element_size()}
    # pairwise overlap against the bitmap intersection of spans
    for a, b in itertools.combinations(views, 2):
        sa, sb = truth_span(a), truth_span(b)
        inter = same_storage(a, b) and max(sa.start, sb.start) < min(sa.end, sb.end)
        assert overlaps(a, b) == inter


def test_overlaps_cases() -> None:
    x = torch.zeros(10)
    assert overlaps(x[:5], x[4:])
    assert not overlaps(x[:5], x[5:])
    assert overlaps(x[::2], x[1::2])  # interleaved: covering spans intersect (documented)
    assert overlaps(x.view(2, 5).t(), x[3:4])
    assert not overlaps(x, x.clone())
    assert overlaps(x, x)


# -- identity ----------------------------------------------------------------------------------

def test_same_storage_views_and_copies() -> None:
    a = torch.arange(24.0).view(4, 6)
    views = [a.t(), a[1:], a[:, 2:4], a.view(-1)[::3], a.unsqueeze(0), a.view(torch.int32),
             a[2].expand(9, 6), a.detach(), a.narrow(1, 1, 2)]
    for v in views:
        assert same_storage(a, v) and same_storage(v, a)
        assert storage_id(v) == storage_id(a)
        assert storage_of(v) is storage_of(a)
        # ground truth: same underlying data pointer of the storage
        assert v.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    for c in (a.clone(), a.contiguous().t().contiguous(), a + 0, torch.zeros(4, 6)):
        assert not same_storage(a, c)
        assert storage_id(a) != storage_id(c)


def test_meta_tensors_have_identity_without_pointers() -> None:
    a = torch.empty(100, device="meta")
    b = torch.empty(100, device="meta")
    assert a.data_ptr() == 0 and b.data_ptr() == 0
    assert same_storage(a, a[10:].view(10, 9))
    assert not same_storage(a, b)
    assert unique_bytes([a, a[10:20], b[50:]]) == {"meta": 400 + 200}
    assert storage_bytes([a, a[10:20], b[50:]]) == {"meta": 800}
    assert tensor_span(a[10:20]) == Span(40, 80)


def test_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(64, 32)
        wt = w.t()
        other = torch.empty(10, dtype=torch.float64)
        assert same_storage(w, wt) and not same_storage(w, other)
        assert tensor_span(w[1:, :16]) == Span(128, 64 * 32 * 4 - 64)
        assert unique_bytes([w, wt, w[3:], other]) == {"cpu": 64 * 32 * 4 + 80}
        assert storage_bytes([w, wt, other]) == {"cpu": 64 * 32 * 4 + 80}


def test_tied_weights_and_buffers_viewing_parameters() -> None:
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    m = torch.nn.Sequential(emb, head)
    m.register_buffer("emb_t", emb.weight.detach().t())
    m.register_buffer("first_rows", emb.weight.detach()[:10])
    tensors = [p for _, p in m.named_parameters(remove_duplicate=False)]
    tensors += [b for _, b in m.named_buffers()]
    naive = sum(t.numel() * t.element_size() for t in tensors)
    assert naive == 4 * (1600 * 3 + 160)
    assert unique_bytes(tensors) == {"cpu": emb.weight.untyped_storage().nbytes()} == {"cpu": 6400}
    assert storage_bytes(tensors) == {"cpu": 6400}


def test_partial_views_of_a_flat_buffer() -> None:
    flat = torch.zeros(1000, dtype=torch.float16)
    a = flat[:300].view(10, 30)
    b = flat[200:500]
    c = flat[900:]
    assert unique_bytes([a, b, c]) == bitmap_union([a, b, c]) == {"cpu": (500 + 100) * 2}
    assert storage_bytes([a, b, c]) == {"cpu": 2000}


def test_storage_ref_follows_lifetime() -> None:
    a = torch.zeros(8)
    r = storage_ref(a[2:])
    assert r() is storage_of(a)
    del a
    gc.collect()
    assert r() is None


def test_per_device_totals_are_separate() -> None:
    c = torch.zeros(10)
    m = torch.empty(3, device="meta", dtype=torch.float64)
    assert unique_bytes([c, m, c[2:]]) == {"cpu": 40, "meta": 24}
    assert unique_bytes(c) == {"cpu": 40}
    assert unique_bytes([]) == {}


def test_merge_spans() -> None:
    assert merge_spans([(0, 4), (4, 8), (10, 12), (11, 20), (30, 30)]) == [Span(0, 8), Span(10, 20)]
    assert merge_spans([]) == []


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_bad_inputs_raise_torchmem_errors() -> None:
    sp = torch.eye(3).to_sparse()
    with pytest.raises(UnsupportedTensorError, match="sparse"):
        tensor_span(sp)
    with pytest.raises(UnsupportedTensorError, match="layout"):
        unique_bytes([torch.zeros(2), sp])
    with pytest.raises(UnsupportedTensorError, match="nested"):
        storage_bytes([torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])])
    with pytest.raises(InvalidInputError, match="expected a torch.Tensor"):
        same_storage(torch.zeros(1), [1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="iterable of tensors"):
        unique_bytes(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        unique_bytes("abc")  # type: ignore[arg-type]


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("meta")) == torch.device("meta")
    with pytest.raises(DeviceError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(DeviceError, match="expected a device"):
        resolve_device(None)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="not available on this machine"):
            resolve_device("cuda:0")
        with pytest.raises(DeviceError, match="none is available"):
            resolve_device(0)


@pytest.mark.cuda
def test_resolve_device_cuda_index_out_of_range() -> None:
    n = torch.cuda.device_count()
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(DeviceError, match="does not exist"):
        resolve_device(f"cuda:{n}")
