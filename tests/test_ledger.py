"""Ledger core: exact counts against storage sizes, dedup, automatic frees, devices, sites.

Ground truth everywhere is the size of the live storages, computed independently of the ledger
(``numel * element_size`` of freshly made contiguous tensors, or ``torchmem.storage_bytes``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchmem
from torchmem import Ledger
from torchmem.errors import DeviceError, InvalidInputError
from torchmem.ledger import LedgerRecord


def nbytes(t: torch.Tensor) -> int:
    """Ground truth for a fresh contiguous tensor: elements times element size."""
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------------------
# A model of MemLord's documented counting (its package is not installable here: the package
# index's "memlord" is an unrelated project). Per-call dedup only, a move hook that credits the
# source's free at .to() time, finalizers that credit the free again at death, and no view of
# operator outputs. Written from MemLord's README/API description, not from its code.


class MemLordModel:
    def __init__(self) -> None:
        self.allocated = 0
        self.freed = 0

    def _size(self, objs: list[torch.Tensor]) -> int:
        seen: set[int] = set()  # dedup inside ONE call only
        total = 0
        for t in objs:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def allocate(self, *objs: torch.Tensor) -> None:
        self.allocated += self._size(list(objs))
        for t in objs:  # finalizer with a precomputed size snapshot, per object
            weakref.finalize(t, self._finalized, self._size([t]))

    def _finalized(self, n: int) -> None:
        self.allocated = max(0, self.allocated - n)
        self.freed += n

    def move(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = t.to(dtype)
        self.allocated += self._size([out])
        self._finalized(self._size([t]))  # the move hook credits the source now...
        return out  # ...and the finalizer registered at allocate() credits it again at death


def test_memlord_drift_view_counted_twice_ours_exact() -> None:
    x = torch.zeros(1000)
    truth = nbytes(x)
    model = MemLordModel()
    v = x[10:]
    model.allocate(x)
    model.allocate(v)  # a view in a second call
    assert model.allocated == 2 * truth  # drift: counted twice
    led = Ledger()
    assert led.allocate(x) == truth
    assert led.allocate(v) == 0
    assert led.allocate(x.view(10, 100).t()) == 0
    assert led.allocated() == (truth, "3.91 KiB")
    assert led.record().live_storages == 1


def test_memlord_drift_move_credited_twice_ours_once() -> None:
    x = torch.zeros(256)  # float32: 1024 bytes
    src_bytes = nbytes(x)
    model = MemLordModel()
    model.allocate(x)
    y = model.move(x, torch.float64)
    del x
    gc.collect()
    assert model.freed == 2 * src_bytes  # drift: the move and the finalizer both credited
    del y

    led = Ledger()
    x = torch.zeros(256)
    led.allocate(x)
    with led.capture():
        y = x.to(torch.float64)
    assert led.allocated() == (src_bytes + nbytes(y), "3.00 KiB")
    del x  # the source dies now: credited once
    assert led.freed()[0] == src_bytes
    assert led.allocated()[0] == nbytes(y)
    gc.collect()
    assert led.freed()[0] == src_bytes
    assert led.record().frees == 1


def test_memlord_drift_operator_outputs_ours_counted() -> None:
    a = torch.ones(100)
    model = MemLordModel()
    model.allocate(a)
    b = a * 2 + 1  # two operator outputs (one dies at once)
    assert model.allocated == nbytes(a)  # drift: the outputs are never seen
    led = Ledger()
    with led.capture():
        b = a * 2 + 1
        c = torch.mm(a.view(10, 10), a.view(10, 10))
    truth_live = torchmem.storage_bytes([b, c])["cpu"]
    assert led.allocated()[0] == truth_live
    # (a * 2) died inside the block: allocated and freed, counted once each
    r = led.record("cpu")
    assert r.allocations == 3 and r.auto_frees == 1 and r.freed == nbytes(a)
    # peak: (a * 2) and (a * 2 + 1) alive together, before the temporary died and c was made
    assert r.peak == 2 * nbytes(a) == nbytes(b) + nbytes(c)


def test_allocate_module_params_buffers_grads_nested_containers() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    m(torch.randn(3, 8)).sum().backward()
    tensors = list(m.parameters()) + list(m.buffers()) + [p.grad for p in m.parameters()]
    truth = torchmem.storage_bytes(tensors)["cpu"]
    led = Ledger()
    assert led.allocate(m) == truth
    # the same storages again, through nested containers and views: nothing new
    extra = torch.zeros(7, dtype=torch.float64)
    assert led.allocate({"m": [m[0].weight.t(), (m[1].running_mean,)], "x": [[extra]]}) == nbytes(extra)
    assert led.allocated() == (truth + nbytes(extra), torchmem.format_bytes(truth + nbytes(extra)))
    assert led.record().live_storages == len({t.untyped_storage()._cdata for t in tensors}) + 1


def test_tied_weights_counted_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    led = Ledger()
    assert led.allocate([emb, head]) == nbytes(emb.weight)


def test_free_is_idempotent_and_death_after_free_credits_nothing() -> None:
    led = Ledger()
    x = torch.zeros(50, dtype=torch.int16)
    led.allocate(x)
    assert led.free(x[3:]) == nbytes(x)  # any view frees the storage
    assert led.free(x) == 0
    assert led.free(torch.zeros(3)) == 0  # never allocated
    assert led.untracked_frees == 2
    del x
    gc.collect()
    r = led.record()
    assert (r.allocated, r.freed, r.frees, r.auto_frees) == (0, 100, 1, 0)


def test_automatic_free_when_last_view_dies() -> None:
    led = Ledger()
    x = torch.zeros(64)
    v = x[1:5]
    led.allocate(x)
    del x
    assert led.allocated()[0] == 256  # the view keeps the storage alive
    del v
    assert led.allocated()[0] == 0 and led.freed()[0] == 256
    assert led.record().auto_frees == 1


def test_reallocate_after_free_counts_again() -> None:
    led = Ledger()
    x = torch.zeros(10)
    led.allocate(x)
    led.free(x)
    assert led.allocate(x) == 40
    assert led.record() == LedgerRecord("all", 40, 40, 40, 40, 2, 1, 0, 1, 0)


def test_resized_storage_updates_on_reallocate() -> None:
    led = Ledger()
    x = torch.zeros(10)
    led.allocate(x)
    x.resize_(100)  # grows the storage in place
    assert led.allocate(x) == 360
    assert led.allocated()[0] == x.untyped_storage().nbytes() == 400
    del x
    assert led.freed()[0] == 400


def test_peak_and_reset() -> None:
    led = Ledger()
    a, b = torch.zeros(100), torch.zeros(200)
    led.allocate(a)
    led.allocate(b)
    led.free(a)
    c = torch.zeros(50)
    led.allocate(c)
    assert led.peak() == (1200, "1.17 KiB")
    assert led.record().allocated == 1000
    led.reset()
    assert led.record() == LedgerRecord("all")
    del b, c  # forgotten by reset: no credit
    assert led.freed()[0] == 0 and led.allocated()[0] == 0


def test_device_selection_type_and_index_with_fake_cuda() -> None:
    # Fake tensors stand for CUDA devices without a GPU; their storages are meta, their device
    # is the CUDA index the ledger must count them under.
    with FakeTensorMode():
        a = torch.empty(10, device="cuda:0")
        b = torch.empty(20, device="cuda:1")
        c = torch.empty(30, device="cuda:1", dtype=torch.float64)
    x = torch.zeros(5)
    led = Ledger()
    led.allocate([a, b, c, x])
    assert led.allocated(torch.device("cuda", 0)) == (40, "40 B")
    assert led.allocated("cuda:1")[0] == 80 + 240
    assert led.allocated(torch.device("cuda"))[0] == 40 + 80 + 240
    assert led.allocated("cpu")[0] == 20
    assert led.allocated()[0] == 40 + 80 + 240 + 20
    assert sorted(led.records()) == ["cpu", "cuda:0", "cuda:1"]
    del b
    assert led.freed("cuda:1")[0] == 80 and led.freed("cuda:0")[0] == 0
    assert led.peak("cuda")[0] == 360 and led.peak("cuda:1")[0] == 320
    assert led.allocated("cuda:7") == (0, "0 B")
    with pytest.raises(DeviceError, match="expected a device"):
        led.allocated("gpu0")


def test_bad_input_raises_with_message() -> None:
    led = Ledger()
    with pytest.raises(InvalidInputError, match="expected a tensor, an nn.Module"):
        led.allocate("not a tensor")
    with pytest.raises(InvalidInputError, match="builtins.int"):
        led.free(3)


def test_sparse_tensor_counts_components() -> None:
    s = torch.eye(6).to_sparse()
    truth = s._indices().untyped_storage().nbytes() + s._values().untyped_storage().nbytes()
    led = Ledger()
    assert led.allocate(s) == truth
    csr = torch.eye(5).to_sparse_csr()
    truth_csr = sum(
        t.untyped_storage().nbytes() for t in (csr.crow_indices(), csr.col_indices(), csr.values())
    )
    assert led.allocate(csr) == truth_csr


def test_optimizer_state_counted() -> None:
    m = torch.nn.Linear(6, 6)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    led = Ledger()
    assert led.allocate(opt) == torchmem.storage_bytes(state)["cpu"]


def test_callsite_tracking_off_by_default_and_skips_internal_frames() -> None:
    led = Ledger()
    led.allocate(torch.zeros(10))
    assert led.top_alloc_site() is None
    led.set_callsite_tracking(True)

    def make_big() -> torch.Tensor:
        return torch.zeros(1000)

    keep = []
    for _ in range(3):
        t = make_big()
        keep.append(t)
        led.allocate(t)  # line A (3 x 4000 bytes)
    small = torch.zeros(10)
    led.allocate(small)  # line B
    dev, site, n = led.top_alloc_site()
    file, line = site.rsplit(":", 1)
    assert dev == "cpu" and n == 12000 and file == __file__
    import inspect

    src = inspect.getsource(test_callsite_tracking_off_by_default_and_skips_internal_frames)
    first = test_callsite_tracking_off_by_default_and_skips_internal_frames.__code__.co_firstlineno
    expect = first + next(i for i, s in enumerate(src.splitlines()) if "# line A" in s)
    assert int(line) == expect
    # frees: the line that dropped the last reference
    del t
    keep.clear()  # line C: 12000 bytes die here
    dev, site, n = led.top_free_site("cpu")
    expect_c = first + next(i for i, s in enumerate(src.splitlines()) if "# line C" in s)
    assert (dev, site, n) == ("cpu", f"{__file__}:{expect_c}", 12000)
    assert led.top_free_site("cuda") is None
    rows = led.sites("alloc")
    assert rows[0][2] == 12000 and rows[1][2] == 40


def test_callsite_through_capture_points_at_user_line() -> None:
    led = Ledger(track_callsite=True)
    a = torch.ones(300)
    with led.capture():
        b = a + 1  # the op
    dev, site, n = led.top_alloc_site()
    assert n == nbytes(b) and site.startswith(__file__ + ":")
    import linecache

    assert "the op" in linecache.getline(__file__, int(site.rsplit(":", 1)[1]))


def test_ledger_holds_no_strong_reference() -> None:
    led = Ledger()
    x = torch.zeros(10)
    r = weakref.ref(x.untyped_storage())
    led.allocate(x)
    del x
    assert r() is None
    assert led.record().live_storages == 0


def test_address_reuse_never_confuses_identity() -> None:
    # Many short-lived storages of the same size reuse addresses (and StorageImpl addresses).
    led = Ledger()
    for i in range(2000):
        t = torch.empty(16)
        assert led.allocate(t) == 64, i
        del t
    r = led.record()
    assert (r.allocated, r.allocations, r.frees, r.auto_frees, r.freed) == (0, 2000, 2000, 2000, 128000)
