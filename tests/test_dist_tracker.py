"""The tracker under ``torch.distributed`` in one process (PyTorch's fake process group: rank 0
of a world of 2, no peers; the collectives are dispatched as on a real group).

Collectives make their buffers ``communication`` with the collective's name as the operator,
but leave model state alone; a functional collective's new output is an allocation of the
collective; a storage resized outside the dispatcher (``UntypedStorage.resize_``, as FSDP2
frees and re-makes its unsharded parameters) is followed; ``DTensor`` outputs count their local
shard, not their global shape. Sizes are computed from the tensors' shapes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import torchmem

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _allocs(tr: torchmem.Tracker) -> list[tuple[str | None, str, int]]:
    return [(e.op, e.category.label, e.nbytes) for e in tr.events() if e.kind.label == "alloc"]


def test_a_collective_buffer_is_communication_and_model_state_is_not(group: None) -> None:
    lin = torch.nn.Linear(8, 4)                       # 128 + 16 bytes of parameters
    with torchmem.track(lin) as tr:
        bucket = torch.empty(36)                      # a flat buffer for the collective
        dist.all_reduce(bucket)
        dist.all_reduce(lin.weight.data)              # a parameter stays a parameter
        del bucket
    allocs = _allocs(tr)
    assert ("c10d::allreduce_", "communication", 36 * 4) in allocs
    assert sorted(n for op, c, n in allocs if c == "parameter") == [16, 128]
    assert [c for op, c, n in allocs if op == "c10d::allreduce_"] == ["communication"]
    free = [e for e in tr.events() if e.kind.label == "free"]
    assert [(e.category.label, e.nbytes) for e in free] == [("communication", 144)]


def test_a_functional_collective_output_is_an_allocation_of_the_collective(group: None) -> None:
    from torch.distributed import _functional_collectives as fc

    x = torch.ones(10)
    with torchmem.track() as tr:
        y = fc.all_reduce(x, "sum", dist.group.WORLD)
        y = fc.wait_tensor(y)
    comm = [(op, n) for op, c, n in _allocs(tr) if c == "communication"]
    assert ("_c10d_functional::all_reduce", 40) in comm
    del y


def test_a_storage_resized_outside_the_dispatcher_is_followed() -> None:
    with torchmem.track() as tr:
        t = torch.empty(100)                          # 400 bytes
        s = t.untyped_storage()
        s.resize_(0)                                  # FSDP2's free_storage
        s.resize_(400)                                # FSDP2's alloc_storage
        s.resize_(800)                                # grown in place
        peak_now = tr.live_bytes("cpu")
    assert peak_now == 800
    kinds = [(e.kind.label, e.op, e.nbytes) for e in tr.events()][:5]
    assert kinds == [("alloc", "aten::empty", 400), ("free", None, 400),
                     ("alloc", "UntypedStorage.resize_", 400), ("free", None, 400),
                     ("alloc", "UntypedStorage.resize_", 800)]
    assert tr.peak() == {"cpu": 800}
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # restored after
    del t, s


def test_dtensor_outputs_count_their_local_shard(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    with torchmem.track() as tr:
        e = d * 2                                     # a DTensor: the local shard is new
    local = e.to_local()
    assert local.shape == (3, 4)                      # half of the rows on rank 0 of 2
    # the local shard's 48 bytes, not the global shape's 96
    assert [n for op, c, n in _allocs(tr) if op == "aten::mul"] == [3 * 4 * 4]
    del e, local


def test_a_collective_on_a_tensor_made_before_tracking_allocates_nothing(group: None) -> None:
    x = torch.ones(64)                                # untracked: made before the block
    with torchmem.track() as tr:
        dist.all_reduce(x)                            # c10d::allreduce_ returns its argument
        y = torch.ones(8)
        dist.all_reduce(y)
    assert _allocs(tr) == [("c10d::allreduce_", "communication", 32)]
    del y
