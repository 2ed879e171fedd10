"""Tracker behaviour: attribution, phases, steps, listeners, stacks, re-entrancy, cleanup."""

from __future__ import annotations

import gc
import io
import warnings
import weakref

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import torchmem
from torchmem.analysis.summary import summarize_trace
from torchmem.errors import InvalidInputError
from torchmem.model.events import Phase


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _global_state() -> tuple[int, ...]:
    return (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(nn_module._global_backward_pre_hooks),
        len(nn_module._global_backward_hooks),
        len(optim_module._global_optimizer_pre_hooks),
        len(optim_module._global_optimizer_post_hooks),
        len(_get_current_dispatch_mode_stack()),
    )


def _allocs(tr: torchmem.Tracker) -> list[torchmem.Event]:  # type: ignore[name-defined]
    return [e for e in tr.events() if e.kind.label == "alloc" and e.op is not None]


def test_forward_and_backward_attribution_to_modules_and_optimizer() -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with torchmem.track(net, opt) as tr:
        x = torch.randn(2, 8)
        net(x).sum().backward()
        opt.step()
    by = {(e.op, e.phase.label, e.module) for e in _allocs(tr)}
    # forward: each Linear's addmm and the ReLU's output
    assert ("aten::addmm", "forward", "Net.fc1") in by
    assert ("aten::relu", "forward", "Net.act") in by
    assert ("aten::addmm", "forward", "Net.fc2") in by
    # backward: fc2's weight gradient (16*4*4 bytes) and input gradient, ReLU's backward, fc1's
    bw = {(e.op, e.module, e.nbytes) for e in _allocs(tr) if e.phase.label == "backward"}
    assert ("aten::mm", "Net.fc2", 16 * 4 * 4) in bw      # grad of fc2.weight
    assert ("aten::mm", "Net.fc2", 2 * 16 * 4) in bw      # grad of fc2's input
    assert ("aten::threshold_backward", "Net.act", 2 * 16 * 4) in bw
    assert ("aten::mm", "Net.fc1", 8 * 16 * 4) in bw      # grad of fc1.weight
    # optimizer step: momentum buffers (clones of the gradients) are optimizer state
    opt_allocs = [e for e in _allocs(tr) if e.phase.label == "optimizer"]
    assert {e.module for e in opt_allocs} == {"optimizer:SGD"}
    assert sum(e.nbytes for e in opt_allocs if e.category.label == "optimizer_state") == sum(
        p.numel() * 4 for p in net.parameters()
    )
    grads = [e for e in _allocs(tr) if e.category.label == "gradient"]
    assert sum(e.nbytes for e in grads) == sum(p.grad.untyped_storage().nbytes() for p in net.parameters())


def test_step_markers_iterations_and_leak_growth() -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kept = []
    with torchmem.track(net, opt) as tr:
        for _ in range(5):
            opt.zero_grad()
            loss = net(torch.randn(4, 8)).sum()
            loss.backward()
            opt.step()
            kept.append(torch.ones(250))  # a leak: 1000 bytes, recorded in the next iteration
    marks = [e for e in tr.events() if e.kind.label == "mark"]
    assert [(e.op, e.step) for e in marks] == [("step", i) for i in range(5)]
    s = summarize_trace(tr.trace)
    assert s.steps == 5
    growth = [it.retained_growth for it in s.iterations if it.complete]
    # iteration 0 keeps the gradients, fc1 (8*16+16) + fc2 (16*4+4) floats, and the 4-byte
    # loss still bound to `loss`; the leaked tensor is made after the step marker
    assert growth[0] == 4 * (8 * 16 + 16 + 16 * 4 + 4) + 4
    # later iterations replace gradients and loss; only the leaked 1000 bytes are retained
    assert growth[1:] == [1000] * 4
    assert s.leak_suspect


def test_manual_steps_and_marks() -> None:
    with torchmem.track(step_marker="manual") as tr:
        for i in range(3):
            tr.mark(f"it{i}")
            tr.step()
    assert [(e.op, e.step) for e in tr.events()] == [
        ("it0", 0), ("step", 0), ("it1", 1), ("step", 1), ("it2", 2), ("step", 2)
    ]
    with pytest.raises(InvalidInputError, match="step_marker"):
        torchmem.track(step_marker="sometimes")


def test_listener_contract() -> None:
    got: list[tuple[str, object]] = []

    def listener(event, storage) -> None:  # type: ignore[no-untyped-def]
        # never keep the storage itself: that would keep its memory alive
        got.append((event.kind.label, None if storage is None else (type(storage), storage.nbytes())))

    with torchmem.track(listeners=[listener]) as tr:
        a = torch.zeros(10)
        sref = weakref.ref(a.untyped_storage())
        tr.mark("m")
        del a
    assert [k for k, _ in got] == ["alloc", "mark", "free"]
    assert got[0][1] == (torch.UntypedStorage, 40)
    assert got[1][1] is None and got[2][1] is None
    assert sref() is None


def test_broken_listener_is_removed_with_a_warning() -> None:
    def bad(event, storage) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torchmem.track(listeners=[bad]) as tr:
            x = torch.ones(3)
            y = x + 1
    assert len(tr.listener_errors) == 1 and "boom" in str(w[0].message)
    assert len([e for e in tr.events() if e.kind.label == "alloc"]) == 2
    del x, y


def test_stacks_point_at_user_code_and_respect_depth() -> None:
    def inner() -> torch.Tensor:
        return torch.empty(5)  # the allocation site

    def outer() -> torch.Tensor:
        return inner()

    with torchmem.track(stacks=True, stack_depth=2) as tr:
        t = outer()
    ev = next(e for e in tr.events() if e.op == "aten::empty")
    assert ev.stack is not None and len(ev.stack) == 2
    assert ev.stack[-1].endswith(":inner") and __file__ in ev.stack[-1]
    assert ev.stack[0].endswith(":outer")
    assert all("site-packages/torch/" not in f for f in ev.stack)
    with torchmem.track() as tr2:
        t = torch.empty(5)
    assert all(e.stack is None for e in tr2.events())
    del t


def test_nested_trackers_both_record_and_leave_nothing_behind() -> None:
    before = _global_state()
    net = Net()
    with torchmem.track(net) as outer:
        a = torch.ones(100)
        with torchmem.track(net) as inner:
            b = net(torch.randn(3, 8))
            assert _global_state()[-1] == before[-1] + 2  # two dispatch modes
        c = torch.ones(50)
        del a, b, c
    assert _global_state() == before
    inner_ops = [e.op for e in _allocs(inner)]
    outer_ops = [e.op for e in _allocs(outer)]
    assert inner_ops == ["aten::randn", "aten::addmm", "aten::relu", "aten::addmm"]
    assert outer_ops == ["aten::ones", *inner_ops, "aten::ones"]
    params = sum(p.untyped_storage().nbytes() for p in net.parameters())
    assert params == 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert outer.live_bytes("cpu") == params  # a, b (and its graph) and c were freed
    inner_end = inner.live_bytes("cpu")  # params + what b's graph holds at inner's exit
    assert inner_end == params + 3 * 8 * 4 + 3 * 16 * 4 + 3 * 4 * 4  # x, relu output, b
    # outer saw everything inner saw plus `a` (400 B) and, after inner, `c` (200 B)
    assert outer.peak()["cpu"] == max(inner.peak()["cpu"] + 400, inner_end + 400 + 200)


def test_exception_inside_block_leaves_nothing_behind() -> None:
    before = _global_state()
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("inside forward")

    with pytest.raises(ValueError, match="inside forward"):
        with torchmem.track(net, opt) as tr:
            y = net(torch.randn(2, 8))
            torch.nn.Sequential(Boom())(y)
    assert _global_state() == before
    n = len(tr.trace)
    # a graph built while tracking runs backward after exit without touching the tracker
    y.sum().backward()
    opt.step()
    z = torch.ones(10)
    assert len(tr.trace) == n
    assert not tr._live and len(tr._seq_bounds) == 0
    del z


def test_tracker_cannot_be_reused_and_bad_targets_are_rejected() -> None:
    tr = torchmem.track()
    with tr:
        pass
    with pytest.raises(InvalidInputError, match="already used"):
        with tr:
            pass
    with pytest.raises(InvalidInputError, match="torch.nn.Module or torch.optim.Optimizer"):
        torchmem.track(torch.zeros(1))


def test_fake_tensors_and_meta_devices_are_tracked() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with torchmem.track() as tr:
            lin = torch.nn.Linear(100, 100)
            lin(torch.randn(8, 100)).sum().backward()
    # params 100*100*4 + 100*4, input 8*100*4, loss + grad seed 4 + 4, grads as params;
    # the Linear output (8*100*4) is freed by then: sum() does not save it
    params = 100 * 100 * 4 + 100 * 4
    assert tr.peak() == {"cpu": params + 8 * 100 * 4 + 4 + 4 + params}


def test_memory_tracker_compat_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    net = Net()
    mt = torchmem.compat.MemoryTracker()
    mt.start_monitor(net)
    net(torch.randn(4, 8)).sum().backward()
    mt.stop()
    mt.stop()  # harmless
    assert _global_state()[-1] == len(_get_current_dispatch_mode_stack())
    buf = io.StringIO()
    mt.summary(top=3, file=buf)  # PyTorch's format: MiB added per operator call
    lines = buf.getvalue().splitlines()[3:6]
    # fc1's weight gradient (16 x 8 floats = 512 B), named after the last forward module
    assert lines[0] == "fc2.forward.mm.default_2: 0.00048828125MB"
    assert lines[1:] == ["fc1.forward.addmm.default_0: 0.000244140625MB",
                         "act.forward.relu.default_0: 0.000244140625MB"]
    path = tmp_path / "stats.trace"
    mt.save_stats(path)
    mt2 = torchmem.compat.MemoryTracker()
    mt2.load(path)
    assert mt2.peak() == mt.peak()
    png = mt2.show_traces(output=tmp_path / "t.png")
    assert png is not None and open(png, "rb").read(4) == b"\x89PNG"
    with pytest.raises(InvalidInputError):
        mt.start_monitor("nope")


def test_frees_on_other_threads_are_recorded_on_the_tracking_thread() -> None:
    import threading

    box = [torch.ones(1000)]  # 4000 bytes
    with torchmem.track() as tr:
        box.append(torch.ones(500))  # 2000 bytes, tracked

        def drop() -> None:
            box.pop()  # the last reference dies on this thread

        th = threading.Thread(target=drop)
        th.start()
        th.join()
        assert tr.live_bytes("cpu") == 2000  # not applied yet: recorded at the next event
        y = torch.zeros(10)
        assert tr.live_bytes("cpu") == 40
    kinds = [(e.kind.label, e.nbytes) for e in tr.events()]
    assert kinds == [("alloc", 2000), ("free", 2000), ("alloc", 40)]
    del y


def test_lite_tracker_matches_full_tracker_totals() -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 8)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = net(x).sum()
        loss.backward()
        opt.step()
        return loss

    step()  # momentum buffers and grads exist before both runs
    with torchmem.track_lite() as lite:
        step()
        step()
    with torchmem.track() as full:
        step()
        step()
    assert [e.op for e in lite.events() if e.kind.label == "mark"] == ["step", "step"]
    # both see the same storage sizes for the linear outputs and the gradients
    def sizes(tr, phase):  # type: ignore[no-untyped-def]
        return sorted(e.nbytes for e in tr.events() if e.kind.label == "alloc" and e.phase.label == phase)

    # every storage the dispatch-level tracker saw in backward, the allocator saw too (the
    # allocator also sees buffers that never surface as an operator output)
    from collections import Counter

    missing = Counter(sizes(full, "backward")) - Counter(sizes(lite, "backward"))
    assert missing == Counter() and len(sizes(full, "backward")) >= 8
    assert lite.peak()["cpu"] >= 16 * 16 * 4  # at least fc1's output
    assert {e.category.label for e in lite.events()} <= {"temporary", "other"}
    assert _global_state()[-1] == len(_get_current_dispatch_mode_stack())


def test_lite_tracker_refuses_to_nest_instead_of_losing_the_outer_events() -> None:
    # a second profiler session takes over the first: the outer track_lite once returned an
    # empty trace without a word
    with torchmem.track_lite() as outer:
        with pytest.raises(InvalidInputError, match="another PyTorch profiler"):
            with torchmem.track_lite():
                pass
        x = torch.ones(100)
    allocs = [e.nbytes for e in outer.events() if e.kind.label == "alloc"]
    assert allocs == [x.untyped_storage().nbytes()] == [400]
    assert not torch.autograd._profiler_enabled()
    with torch.profiler.profile(profile_memory=True):
        with pytest.raises(InvalidInputError, match="torch.profiler.profile"):
            torchmem.track_lite().__enter__()


class _Blocker(torch.nn.Module):
    def forward(self, x: torch.Tensor, wait=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if wait is not None:
            wait()  # the same module instance runs on another thread meanwhile
        return x * 2


class _SharedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = _Blocker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import threading

        def run_worker() -> None:
            t = threading.Thread(target=lambda: self.b(torch.ones(3)))
            t.start()
            t.join()

        return self.b(x, wait=run_worker)


def test_module_running_on_another_thread_does_not_end_this_threads_call() -> None:
    # the worker's forward post-hook once popped the tracking thread's entry for the same
    # module, so the tracking thread's x * 2 inside "_SharedNet.b" was attributed to the parent
    net = _SharedNet()
    with torchmem.track(net) as tr:
        y = net(torch.ones(5))
    muls = [(e.module, e.nbytes) for e in tr.events()
            if e.op == "aten::mul" and e.thread == "MainThread"]
    assert muls == [("_SharedNet.b", y.untyped_storage().nbytes())] == [("_SharedNet.b", 20)]
    # the worker's own x * 2 (3 floats) is recorded too, on its thread, outside any module
    assert [(e.module, e.nbytes) for e in tr.events()
            if e.op == "aten::mul" and e.thread != "MainThread"] == [(None, 12)]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)[..., :8]


class _LM(torch.nn.Module):
    """GPT-2's shape: blocks in a ModuleList that is never called itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Module()
        self.body.h = torch.nn.ModuleList([_Block(), _Block(), _Block()])
        self.body.forward = self._body  # type: ignore[method-assign]
        self.head = torch.nn.Linear(8, 2)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.body.h:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_module_names_are_qualified_names_whether_or_not_the_root_was_passed() -> None:
    # the names users know from named_modules(): every layer of a ModuleList keeps its index
    def module_per_op(root_given: bool) -> list[tuple[str, str]]:
        torch.manual_seed(0)
        net = _LM()
        x = torch.ones(4, 8)
        with torchmem.track(*([net] if root_given else [])) as tr:
            net(x).sum().backward()
        return [(e.op or "", e.module or "") for e in tr.events() if e.phase == Phase.FORWARD]

    with_root, without_root = module_per_op(True), module_per_op(False)
    expected = {"_LM." + n for n, _ in _LM().named_modules() if n.startswith("body.h.") and n.count(".") == 4}
    assert expected == {f"_LM.body.h.{i}.mlp.{j}" for i in range(3) for j in range(2)}
    assert expected <= {m for _, m in without_root}
    assert with_root == without_root


def test_a_module_made_where_a_dead_one_was_gets_its_own_name() -> None:
    # the forward hook reads names by id(module): a module freed during tracking must not lend
    # its name to a new module that CPython puts at the same address (the same id)
    class First(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Second(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    x = torch.ones(3)
    with torchmem.track() as tr:
        first = First()
        first(x)
        old_id, first_ref = id(first), weakref.ref(first)
        del first

        def made_at_old_address() -> Second | None:
            # CPython reuses a freed object's memory for a later one of its size; which one
            # depends on what ran before, so two ways: one module at a time (each freed by
            # the next), then keeping every module made
            one = Second()
            for _ in range(1_000):
                if id(one) == old_id:
                    return one
                one = Second()
            made = [one]
            while id(made[-1]) != old_id and len(made) < 100_000:
                made.append(Second())
            return made[-1] if id(made[-1]) == old_id else None

        second = made_at_old_address() if first_ref() is None else None
        if second is None:
            gc.collect()  # the freed module may wait in a reference cycle
            second = made_at_old_address() if first_ref() is None else None
        if second is None:
            pytest.skip("this interpreter did not reuse the freed module's address")
        second(x)
    by_op = {e.op: e.module for e in tr.events() if e.kind.label == "alloc"}
    assert by_op == {"aten::mul": "First", "aten::add": "Second"}


def _closure_run(mode: str, closure: bool) -> list[tuple[str | None, str, str, int]]:
    """Allocations of two SGD steps, with the forward and backward run plainly or as the
    closure of ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(8, 16)

    def fb() -> torch.Tensor:
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        return loss

    with torchmem.track(net, opt, mode=mode) as tr:
        for _ in range(2):
            if closure:
                opt.step(fb)
            else:
                fb()
                opt.step()
    return [(e.module, e.phase.label, e.category.label, e.nbytes) for e in tr.events()
            if e.kind.label == "alloc"]


@pytest.mark.parametrize("mode", ["ops", "fast"])
def test_a_closure_given_to_the_optimizer_step_is_forward_and_backward(mode: str) -> None:
    if mode == "fast":
        from torchmem.capture.fast import native_available

        if not native_available():
            pytest.skip("mode='fast' needs a C++ compiler and ninja to build")
    plain, closure = _closure_run(mode, False), _closure_run(mode, True)
    # the same allocations with the same modules, phases and categories: the closure's forward
    # is not the optimizer's (before: phase "optimizer", activations "other", modules named
    # under "Identity")
    assert closure == plain
    assert ("Sequential.1", "forward", "activation", 8 * 64 * 4) in closure
    assert any(p == "optimizer" and c == "optimizer_state" for _, p, c, _ in closure)


@pytest.mark.parametrize("mode", ["ops", "fast"])
def test_a_submodule_the_forward_reads_without_calling_holds_parameters(mode: str) -> None:
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` in its own forward and never calls
    ``out_proj``: its weight and bias (and their gradients) were "other". Named on the
    module's first return, every parameter allocation is a parameter and every gradient a
    gradient, the sizes of ``parameters()`` exactly (ops mode gave 789,504 B of parameters
    and 526,336 B of "other" before; fast mode 263,168 B of "other")."""
    if mode == "fast":
        from torchmem.capture.fast import native_available

        if not native_available():
            pytest.skip("mode='fast' needs a C++ compiler and ninja to build")
    with torchmem.track(mode=mode) as tr:
        m = torch.nn.MultiheadAttention(256, 4, batch_first=True)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(4, 32, 256)
        out, _ = m(x, x, x)
        out.sum().backward()
        opt.step()
    by_cat: dict[str, int] = {}
    for e in tr.events():
        if e.kind.label == "alloc":
            by_cat[e.category.label] = by_cat.get(e.category.label, 0) + e.nbytes
    want = sum(p.numel() * p.element_size() for p in m.parameters())
    assert want == 1_052_672
    assert by_cat["parameter"] == want and by_cat.get("other", 0) == 0, by_cat
    assert by_cat["gradient"] == want
    names = {e.module for e in tr.events() if e.kind.label == "alloc"
             and e.category.label == "parameter"}
    assert "MultiheadAttention.out_proj" in names
