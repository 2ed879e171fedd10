"""Accuracy of the tracker against ground truth computed another way.

Ground truth: an independent TorchDispatchMode (entered outside the tracker) keeps a weak
reference to the storage of EVERY tensor any operator returns (views included) plus the state
of the modules/optimizers passed in. At every event the tracker reports (via a listener), the
bytes of those storages that are still alive, counted once per storage object, must equal the
tracker's live bytes for the device.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchmem
from torchmem.analysis.series import category_series
from torchmem.analysis.summary import summarize_trace


class _Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[weakref.ref[torch.UntypedStorage], int]] = []
        self.calls = 0
        self.reported: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def add(self, t: torch.Tensor) -> None:
        self.refs.append((weakref.ref(t.untyped_storage()), self.calls))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out

    def alive_bytes(self) -> dict[str, int]:
        """Bytes of every alive storage seen, once per storage object. Storages returned by
        the operator call in flight that the tracker has not reported yet are left out (a
        multi-output operator reports its outputs one event at a time)."""
        seen: dict[int, tuple[str, int]] = {}
        for r, call in self.refs:
            s = r()
            if s is None:
                continue
            if call == self.calls and call > 0:
                rep = self.reported.get(id(s))
                if rep is None or rep() is not s:
                    continue
            seen[id(s)] = (str(s.device), s.nbytes())
        out: dict[str, int] = {}
        for dev, n in seen.values():
            out[dev] = out.get(dev, 0) + n
        return out


def _check_every_event(build, steps: int = 3) -> tuple[int, torchmem.Tracker, torch.nn.Module]:
    torch.manual_seed(0)
    model, opt, make_batch = build()
    census = _Census()
    for p in model.parameters():
        census.add(p)
    for b in model.buffers():
        census.add(b)
    mismatches: list[tuple[int, str, dict[str, int], dict[str, int]]] = []
    checked = [0]

    def check(event: torchmem.Event, storage: object) -> None:  # type: ignore[name-defined]
        checked[0] += 1
        if storage is not None:
            census.reported[id(storage)] = weakref.ref(storage)  # type: ignore[arg-type]
        if event.kind.label == "alloc" and event.op is None:
            return  # the initial state is being recorded one storage at a time
        truth = census.alive_bytes()
        mine = tracker.live_bytes()
        if {d: b for d, b in mine.items() if b} != {d: b for d, b in truth.items() if b}:
            mismatches.append((event.seq, event.kind.label, mine, truth))

    with census:
        tracker = torchmem.track(model, opt, listeners=[check])
        with tracker:
            for _ in range(steps):
                x, y = make_batch()
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                del x, y, loss
    assert mismatches == []
    return checked[0], tracker, model


def _mlp_sgd():
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt, lambda: (torch.randn(8, 32), torch.randn(8, 32))


def _transformer_adam():
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.1)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, lambda: (torch.randn(4, 10, 32), torch.randn(4, 10, 32))


@pytest.mark.parametrize("build", [_mlp_sgd, _transformer_adam], ids=["mlp-sgd-momentum", "transformer-adam"])
def test_live_bytes_equal_alive_storages_at_every_event(build) -> None:
    n, tracker, model = _check_every_event(build)
    assert n == len(tracker.trace) > 100
    initial = sum(1 for e in tracker.events() if e.kind.label == "alloc" and e.op is None)
    state = [*model.parameters(), *model.buffers()]
    assert initial == len({id(t.untyped_storage()) for t in state})


def test_live_bytes_on_meta_device_match_storage_sizes() -> None:
    with torchmem.track() as tr:
        a = torch.empty(1000, device="meta")           # 4000 bytes
        b = torch.empty(10, 10, dtype=torch.float64, device="meta")  # 800 bytes
        v = a[10:]                                      # a view: no new storage
        assert tr.live_bytes("meta") == 4000 + 800
        del a
        assert tr.live_bytes("meta") == 4000 + 800     # the view keeps the storage alive
        del v
        assert tr.live_bytes("meta") == 800
        del b
    assert tr.peak() == {"meta": 4800}
    assert tr.live_bytes() == {"meta": 0}


def test_inplace_ops_allocate_nothing_and_views_are_not_new() -> None:
    x = torch.zeros(100)
    with torchmem.track() as tr:
        x.add_(1)
        x.mul_(2)
        _ = x.view(10, 10).t()[3]
        torch.add(x, 1, out=x)
    assert [e for e in tr.events() if e.kind.label == "alloc"] == []


def test_linear_4_3_per_category_peaks_match_hand_computed_values() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)                # weight 3*4*4 = 48 B, bias 3*4 = 12 B
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)  # plain SGD keeps no state
    with torchmem.track(lin, opt) as tr:
        x = torch.randn(2, 4)                  # input: 2*4*4 = 32 B
        out = lin(x)                           # activation: 2*3*4 = 24 B
        loss = out.sum()                       # activation: 4 B (scalar)
        loss.backward()                        # seed ones_like(loss) 4 B; grads 48 + 12 B
        opt.step()                             # in-place update: no allocation
        del out, loss, x
    _, _, series, _ = category_series(tr.trace, max_points=0)
    peaks = {c: max(v) for c, v in series.items() if max(v)}
    assert peaks == {
        "parameter": 48 + 12,
        "gradient": 48 + 12,
        "input": 2 * 4 * 4,
        "activation": 24 + 4 + 4,  # the implicit gradient seed of loss.backward() counts here
    }
    s = summarize_trace(tr.trace)
    assert s.peak == {"cpu": 60 + 60 + 32 + 32}
    assert s.categories_at_peak == peaks
    assert tr.peak() == s.peak


def test_adam_state_and_gradients_are_categorised() -> None:
    lin = torch.nn.Linear(16, 8)                # 16*8*4 + 8*4 = 544 B
    opt = torch.optim.Adam(lin.parameters())
    with torchmem.track(lin, opt) as tr:
        lin(torch.randn(4, 16)).sum().backward()
        opt.step()
    live: dict[str, int] = {}
    alive: dict[int, torchmem.Event] = {}  # type: ignore[name-defined]
    for e in tr.events():
        if e.kind.label == "alloc":
            alive[e.storage] = e
        elif e.kind.label == "free":
            alive.pop(e.storage)
    for e in alive.values():
        live[e.category.label] = live.get(e.category.label, 0) + e.nbytes
    # exp_avg and exp_avg_sq per parameter (2 * 544) + two 4-byte 'step' counters
    assert live["optimizer_state"] == 2 * 544 + 2 * 4
    assert live["gradient"] == 544
    assert live["parameter"] == 544
    state_bytes = sum(
        v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
    )
    assert live["optimizer_state"] == state_bytes


def test_tracker_never_keeps_tensors_alive() -> None:
    with torchmem.track() as tr:
        t = torch.ones(256)
        ref = weakref.ref(t)
        sref = weakref.ref(t.untyped_storage())
        del t
        assert ref() is None and sref() is None
        assert tr.live_bytes("cpu") == 0
    kinds = [(e.kind.label, e.nbytes) for e in tr.events()]
    assert kinds == [("alloc", 1024), ("free", 1024)]


def test_resized_storages_are_recorded_with_their_new_size() -> None:
    a = torch.ones(10)
    b = torch.ones(10)
    with torchmem.track() as tr:
        x = torch.empty(0)
        x.resize_(100)                     # 400 bytes now
        assert tr.live_bytes("cpu") == x.untyped_storage().nbytes() == 400
        c = torch.empty(0)
        torch.add(a, b, out=c)             # out= grows c's storage to 10 floats
        assert tr.live_bytes("cpu") == 400 + 40
        x.add_(1)                          # in-place: nothing new
        assert tr.live_bytes("cpu") == 440
        del x
        assert tr.live_bytes("cpu") == 40
    kinds = [(e.kind.label, e.op, e.nbytes) for e in tr.events()]
    assert kinds[:3] == [("alloc", "aten::empty", 0), ("free", None, 0), ("alloc", "aten::resize_", 400)]
    assert tr.peak() == {"cpu": 440}
    del c


class _Cycle:
    """A reference cycle holding a tensor: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self
        self.t = torch.ones(256)  # 1024 bytes


def test_garbage_collection_during_an_allocation_keeps_storage_ids_aligned() -> None:
    # A collection can run while the tracker records an allocation (creating its weak
    # reference); the frees it triggers append events, and the allocation must still get its
    # own sequence number as storage id (it once took the number of the interleaved free).
    import gc

    old = gc.get_threshold()
    n_cycles = 150
    keep = []
    try:
        gc.collect()
        gc.set_threshold(1)  # collect on (almost) every container allocation
        with torchmem.track() as tr:
            for _ in range(n_cycles):
                _Cycle()
                keep.append(torch.zeros(64) + 1)  # 256 bytes each, alive at the end
            gc.collect()
            live_end = tr.live_bytes("cpu")
    finally:
        gc.set_threshold(*old)
    trace = tr.trace
    allocs = {}
    freed_sizes = []
    for i in range(len(trace)):
        if trace.kind[i] == 0:
            assert trace.storage[i] == i + 1, f"ALLOC {i} has storage id {trace.storage[i]}"
            allocs[trace.storage[i]] = trace.nbytes[i]
        elif trace.kind[i] == 1:
            assert allocs[trace.storage[i]] == trace.nbytes[i]  # a free matches its alloc
            freed_sizes.append(trace.nbytes[i])
    # ground truth from the loop: every cycle's 1024-byte storage was freed once
    assert freed_sizes.count(1024) == n_cycles
    assert live_end == sum(t.untyped_storage().nbytes() for t in keep) == n_cycles * 256


def test_iteration_start_includes_initial_state_when_it_ends_on_another_device() -> None:
    # the initial state's last ALLOC is on "meta" (a buffer): iteration 0 on cpu once started
    # from 0 bytes, reporting the parameters as growth of the first iteration
    lin = torch.nn.Linear(4, 3)
    lin.register_buffer("scale", torch.ones(5, device="meta"))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with torchmem.track(lin, opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            lin(x).sum().backward()
            opt.step()
    initial = [e for e in tr.events() if e.time_ns == 0 and e.op is None and e.kind.label == "alloc"]
    assert initial[-1].device == "meta"
    params = sum(p.untyped_storage().nbytes() for p in lin.parameters())  # 48 + 12
    grads = sum(p.grad.untyped_storage().nbytes() for p in lin.parameters())
    s = summarize_trace(tr.trace, device="cpu")
    first = s.iterations[0]
    assert first.start_bytes == params == 60
    # what the first iteration keeps is its gradients (no momentum: SGD keeps no state)
    assert first.retained_growth == grads == 60
    assert s.iterations[1].start_bytes == params + grads


def test_reentrant_checkpointing_does_not_end_the_outer_backward_phase() -> None:
    # checkpoint(use_reentrant=True) runs a backward inside the backward; its end once closed
    # the outer backward's region, so the outer's later-freed buffers became "other" instead of
    # "temporary". Ground truth: the same model with non-reentrant checkpointing.
    import warnings as _w
    from collections import Counter

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(3)]
    )
    x = torch.randn(8, 32, requires_grad=True)

    def run(reentrant: bool):  # type: ignore[no-untyped-def]
        with torchmem.track(layers) as tr, _w.catch_warnings():
            _w.simplefilter("ignore")
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=reentrant)
            h.sum().backward()
            grads = sum(p.grad.untyped_storage().nbytes() for p in layers.parameters())
            grad_live = sum(
                e.nbytes for e in tr.events()
                if e.kind.label == "alloc" and e.category.label == "gradient"
            )
            for p in layers.parameters():
                p.grad = None
            x.grad = None
        bw_frees = Counter(
            e.category.label for e in tr.events() if e.kind.label == "free" and e.phase.label == "backward"
        )
        return bw_frees, grads, grad_live

    frees_re, grads_re, live_re = run(True)
    frees_nr, grads_nr, live_nr = run(False)
    assert "other" not in frees_re
    assert frees_re["temporary"] == frees_nr["temporary"] > 0
    assert live_re == grads_re == live_nr == grads_nr == 3 * (32 * 32 + 32) * 4
