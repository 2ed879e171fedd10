"""Ledger.capture(): storages from torchmem's event stream; moves credited exactly once."""

from __future__ import annotations

import gc

import pytest
import torch

import torchmem
from torchmem import Ledger


def live_truth(*tensors: torch.Tensor) -> int:
    return sum(torchmem.storage_bytes(list(tensors)).values())


def test_capture_counts_factories_and_op_outputs_not_views() -> None:
    led = Ledger()
    with led.capture():
        a = torch.randn(32, 32)  # factory
        b = a @ a  # op output
        v = b.t()[3:]  # views: nothing new
        a.add_(1)  # in place: nothing new
        c = torch.cat([a, b])  # op output
    assert led.allocated()[0] == live_truth(a, b, c) == 4096 * 4
    r = led.record()
    assert (r.allocations, r.live_storages, r.auto_frees) == (3, 3, 0)
    del v


def test_capture_ends_cleanly_and_changes_no_global_state() -> None:
    led = Ledger()
    with led.capture():
        x = torch.ones(10)
    after = torch.ones(1000)  # outside: not counted
    assert led.allocated()[0] == 40
    assert not led.is_counted(after)
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    del x


def test_capture_is_reentrant() -> None:
    led = Ledger()
    with led.capture():
        a = torch.zeros(10)
        with led.capture():
            b = torch.zeros(20)
        c = torch.zeros(30)  # still inside the outer block
    assert led.allocated()[0] == live_truth(a, b, c) == 240
    assert led.record().allocations == 3


def test_tensor_to_move_credited_once() -> None:
    led = Ledger()
    x = torch.randn(100, 10)  # 4000 bytes
    led.allocate(x)
    with led.capture():
        x = x.to(torch.float64)  # the old storage dies on rebinding
    gc.collect()
    r = led.record()
    assert r.allocated == live_truth(x) == 8000
    assert (r.freed, r.frees, r.auto_frees, r.allocations) == (4000, 1, 1, 2)


def test_non_blocking_move_credited_once() -> None:
    led = Ledger()
    x = torch.randn(64)
    led.allocate(x)
    with led.capture():
        y = x.to(torch.float64, non_blocking=True)
        z = y.to("cpu", non_blocking=True)  # already there: same tensor, nothing new
    assert z is y
    assert led.allocated()[0] == live_truth(x, y) == 256 + 512
    del x
    assert led.freed()[0] == 256
    del y, z
    assert led.record().freed == 256 + 512
    assert led.record().frees == 2


@pytest.mark.parametrize("non_blocking", [False, True])
def test_module_to_credited_once_and_matches_parameters(non_blocking: bool) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    before = live_truth(*m.parameters())
    led = Ledger()
    led.allocate(m)
    with led.capture():
        m.to(torch.float64, non_blocking=non_blocking)
    gc.collect()
    r = led.record()
    assert r.allocated == live_truth(*m.parameters()) == 2 * before
    assert r.freed == before
    assert r.frees == 4 and r.auto_frees == 4
    # and the new parameters are exactly the counted storages
    assert all(led.is_counted(p) for p in m.parameters())


def _shared_module() -> torch.nn.Module:
    flat = torch.zeros(40)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(flat[:24].view(4, 6))
    m.b = torch.nn.Parameter(flat[24:])
    return m


def test_memory_aware_to_credited_once() -> None:
    # reference: the temporaries memory_aware_to creates and drops, from a separate tracker run
    # on an identical module
    twin = _shared_module()
    with torchmem.track() as tr:
        torchmem.memory_aware_to(twin, dtype=torch.float64)
    temp_frees = [e.nbytes for e in tr.events() if e.kind.label == "free"]

    m = _shared_module()
    old = torchmem.capture.storage_ref(m.a)
    led = Ledger()
    assert led.allocate(m) == 160  # one shared storage
    with led.capture():
        torchmem.memory_aware_to(m, dtype=torch.float64)
    gc.collect()
    assert old() is None
    r = led.record()
    assert r.allocated == live_truth(m.a, m.b) == 320
    assert r.live_storages == 1
    # the old 160-byte storage credited exactly once, plus the temporaries, nothing else
    assert r.freed == 160 + sum(temp_frees)
    assert r.frees == 1 + len(temp_frees)


def test_memory_aware_to_meta_non_blocking() -> None:
    m = torch.nn.Linear(10, 10)
    truth = live_truth(*m.parameters())
    led = Ledger()
    led.allocate(m)
    with led.capture():
        torchmem.memory_aware_to(m, device="meta", non_blocking=True)
    gc.collect()
    cpu, meta = led.record("cpu"), led.record("meta")
    assert (cpu.allocated, cpu.freed) == (0, truth)
    assert meta.allocated == truth == live_truth(*m.parameters())


def test_capture_training_step_matches_live_storages() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    # SGD with momentum: its state is made by operators. (Adam's ``step`` counters are made by
    # torch.tensor(), which builds data outside the dispatcher: the tracker does not see them.)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    led = Ledger()
    led.allocate(model)
    with led.capture():
        for _ in range(2):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    gc.collect()
    alive = list(model.parameters()) + [p.grad for p in model.parameters()]
    alive += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    alive.append(loss)
    assert led.allocated()[0] == live_truth(*alive)
    r = led.record()
    assert r.allocations - r.frees == r.live_storages
    assert r.freed_total == r.freed > 0


def test_capture_in_two_threads_at_once() -> None:
    import threading

    led = Ledger()
    keep: list[torch.Tensor] = []
    barrier = threading.Barrier(2)
    lock = threading.Lock()

    def work(n: int) -> None:
        with led.capture():
            barrier.wait()  # both threads inside their own capture at the same time
            t = torch.zeros(n)
            with lock:
                keep.append(t)

    ws = [threading.Thread(target=work, args=(n,)) for n in (100, 300)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    assert led.allocated()[0] == live_truth(*keep) == 1600


@pytest.mark.cuda
def test_cuda_non_blocking_move_credited_once() -> None:  # pragma: no cover - needs a GPU
    src = torch.randn(1 << 20).pin_memory()  # 4 MiB pinned host memory
    led = Ledger()
    led.allocate(src)
    with led.capture():
        dst = src.to("cuda:0", non_blocking=True)
    torch.cuda.synchronize()
    assert led.allocated("cuda:0")[0] == dst.untyped_storage().nbytes()
    del src
    assert led.freed("cpu")[0] == 4 << 20
    assert led.record("cpu").frees == 1
