"""``why_alive``: the retention paths of each holder the issue names, with their text checked.

The sizes in the expected texts are hand-computed (numel x itemsize of the storage, not of the
view); the links are the ones each test builds.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchmem.capture.retention import RetentionPath, why_alive
from torchmem.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[1]
MOD = __name__  # how module globals of this file are named in a path
# the whole test suite's heap is large (hundreds of thousands of objects): no time limit cuts
# these searches short
T = 300.0

LOSSES: list[torch.Tensor] = []
CACHE: dict[str, object] = {}


def _texts(paths: list[RetentionPath]) -> list[str]:
    return [str(p) for p in paths]


def test_list_of_losses_kept_with_their_graphs_names_the_saved_tensor() -> None:
    w = torch.randn(1024, 1024, requires_grad=True)       # 4 MiB
    x = torch.randn(1024, 1024)                             # 4 MiB, saved by mm for backward
    for _ in range(3):
        LOSSES.append((x @ w).sum())
    try:
        target_view = x[0]                   # a view: the same memory, found through the storage
        del x
        paths = why_alive(target_view, max_paths=1, timeout=T)
        assert _texts(paths) == [
            f"{MOD} global LOSSES (list) [0] -> Tensor.grad_fn SumBackward0 -> next_functions[0] "
            "MmBackward0 -> saved tensor (self) -> Tensor float32[1024, 1024] 4.00 MiB"
        ]
        assert len(paths[0]) == 4 and paths.stopped is None
    finally:
        LOSSES.clear()


def test_caller_variable_is_left_out_and_a_freeable_tensor_has_no_path() -> None:
    t = torch.zeros(1000)
    paths = why_alive(t, timeout=T)
    assert list(paths) == []
    assert "no root reaches it" in str(paths)
    assert paths.searched > 1000                            # it did walk the heap


def test_module_parameters_buffers_and_submodules() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    CACHE["model"] = model
    try:
        w = why_alive(model[0].weight.detach(), max_paths=1, timeout=T)
        assert _texts(w) == [
            f"{MOD} global CACHE (dict) ['model'] (Sequential) -> Sequential.0 (Linear) -> "
            "Linear.weight (parameter) -> Parameter float32[4, 8] 128 B"
        ]
        b = why_alive(model[1].running_mean, max_paths=1, timeout=T)
        assert str(b[0]).endswith(
            "-> Sequential.1 (BatchNorm1d) -> BatchNorm1d.running_mean (buffer) -> "
            "Tensor float32[4] 16 B"
        )
        # a module itself is followed as an object
        m = why_alive(model[1], max_paths=1, timeout=T)
        assert str(m[0]) == (
            f"{MOD} global CACHE (dict) ['model'] (Sequential) -> Sequential.1 -> BatchNorm1d"
        )
    finally:
        CACHE.clear()


def _attach_keeping_hook(model: torch.nn.Module) -> None:
    kept: list[torch.Tensor] = []

    def keep_output(module: torch.nn.Module, inp: object, out: torch.Tensor) -> None:
        kept.append(out)

    model.register_forward_hook(keep_output)


def test_forward_hook_closure_keeps_outputs() -> None:
    model = torch.nn.Linear(16, 16)
    _attach_keeping_hook(model)  # only the hook's closure holds the list of outputs
    model(torch.ones(4, 16))
    CACHE["m"] = model
    try:
        hook = next(iter(model._forward_hooks.values()))
        held = hook.__closure__[0].cell_contents[0]  # type: ignore[attr-defined]
        paths = why_alive(held, max_paths=1, timeout=T)
        assert _texts(paths) == [
            f"{MOD} global CACHE (dict) ['m'] (Linear) -> Linear forward hook "
            "_attach_keeping_hook.<locals>.keep_output (function) -> "
            "_attach_keeping_hook.<locals>.keep_output closure `kept` (list) "
            "[0] -> Tensor float32[4, 16] 256 B"
        ]
    finally:
        CACHE.clear()


def test_dict_set_and_several_paths_shortest_first() -> None:
    t = torch.zeros(256)
    CACHE["direct"] = t
    CACHE["nested"] = {"a": [t]}
    CACHE["set"] = {t}
    del t
    try:
        paths = why_alive(CACHE["direct"], timeout=T)  # type: ignore[arg-type]
        texts = _texts(paths)
        assert texts == [
            f"{MOD} global CACHE (dict) ['direct'] -> Tensor float32[256] 1.00 KiB",
            f"{MOD} global CACHE (dict) ['set'] (set) -> (set member) -> Tensor float32[256] 1.00 KiB",
            f"{MOD} global CACHE (dict) ['nested'] (dict) ['a'] (list) [0] -> Tensor float32[256] 1.00 KiB",
        ]
        assert [len(p) for p in paths] == [1, 2, 3]
    finally:
        CACHE.clear()


def test_optimizer_state_also_for_a_parameter_that_no_longer_exists() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    CACHE["opt"] = opt
    try:
        avg = opt.state[model.bias]["exp_avg"]
        paths = why_alive(avg, max_paths=1, timeout=T)
        assert str(paths[0]) == (
            f"{MOD} global CACHE (dict) ['opt'] (Adam) -> Adam.state[group 0 param 1] (dict) "
            "['exp_avg'] -> Tensor float32[2] 8 B"
        )
        # the parameter leaves the model and the optimizer's groups; its state stays
        opt.param_groups[0]["params"] = [model.weight]
        model.bias = None
        sq = opt.state[next(p for p in opt.state if p.shape == (2,))]["exp_avg_sq"]
        paths = why_alive(sq, max_paths=1, timeout=T)
        assert str(paths[0]) == (
            f"{MOD} global CACHE (dict) ['opt'] (Adam) -> Adam.state[a parameter in no param "
            "group, Parameter float32[2] 8 B] (dict) ['exp_avg_sq'] -> Tensor float32[2] 8 B"
        )
    finally:
        CACHE.clear()


def _fail_with(big: torch.Tensor) -> None:
    local_copy = big * 1  # noqa: F841 - held by this frame, which the traceback keeps
    raise RuntimeError("CUDA out of memory (simulated)")


def test_caught_exception_kept_in_a_variable_holds_its_frames() -> None:
    try:
        _fail_with(torch.ones(64))
    except RuntimeError as e:
        CACHE["err"] = e
    try:
        frame_local = CACHE["err"].__traceback__.tb_next.tb_frame.f_locals["local_copy"]  # type: ignore[union-attr]
        paths = why_alive(frame_local, max_paths=1, timeout=T)
        assert str(paths[0]) == (
            f"{MOD} global CACHE (dict) ['err'] (RuntimeError) -> RuntimeError.__traceback__ -> "
            "tb_next -> frame _fail_with (test_why_alive.py:" + str(_fail_with.__code__.co_firstlineno + 2)
            + ") -> local `local_copy` -> Tensor float32[64] 256 B"
        )
    finally:
        CACHE.clear()


def test_sys_last_traceback_after_an_uncaught_error() -> None:
    try:
        _fail_with(torch.ones(32))
    except RuntimeError as e:
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        del e
    try:
        tb = sys.last_traceback.tb_next  # type: ignore[union-attr]
        held = tb.tb_frame.f_locals["big"]  # type: ignore[union-attr]
        texts = _texts(why_alive(held, max_paths=2, timeout=T))
        line = _fail_with.__code__.co_firstlineno + 2
        assert f"sys.last_traceback -> tb_next -> frame _fail_with (test_why_alive.py:{line}) -> local `big` -> Tensor float32[32] 128 B" in texts
    finally:
        del sys.last_type, sys.last_value, sys.last_traceback


class _Node:
    pass


def test_reference_cycle_waiting_for_the_collector_is_named_with_the_cycle() -> None:
    import gc

    # the garbage earlier tests in this process left (a worker of the whole run holds a lot)
    # is collected first: the search looks through all pending garbage
    gc.collect()
    gc.disable()  # so that no automatic collection frees the cycle before the search
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        a.data = torch.zeros(100)  # type: ignore[attr-defined]
        t = a.data  # type: ignore[attr-defined]
        del a, b
        paths = why_alive(t, timeout=T)
        assert _texts(paths) == [
            "reference cycle waiting for the garbage collector: <_Node object> -> _Node.other -> "
            "_Node.other -> (back to the start); held from it: <_Node object> -> _Node.data -> "
            "Tensor float32[100] 400 B"
        ], (paths.stopped, paths.note)
        assert paths[0].cycle == ("_Node.other", "_Node.other")
        assert gc.isenabled() is False  # why_alive restores the collector's state
    finally:
        gc.enable()
    # the search did not free the cycle: the collector still finds it afterwards
    assert gc.collect() >= 2


def test_ipython_output_cache_in_a_real_shell() -> None:
    pytest.importorskip("IPython")
    script = textwrap.dedent(
        """
        import torch
        from IPython.core.interactiveshell import InteractiveShell
        from torchmem.capture.retention import why_alive
        sh = InteractiveShell.instance(history_length=0)
        sh.history_manager.enabled = False
        sh.run_cell("import torch; x = torch.zeros(1000)", store_history=True)
        sh.run_cell("x[:10]", store_history=True)
        sh.run_cell("del x", store_history=True)
        for p in why_alive(sh.user_ns["Out"][2], max_paths=3):
            print(p)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("IPython")]
    assert lines[0] == "IPython output cache Out[2] -> Tensor float32[10] 3.91 KiB"
    assert "IPython output cache _2 -> Tensor float32[10] 3.91 KiB" in lines


def test_limits_are_reported() -> None:
    deep: list[object] = [torch.zeros(4)]
    for _ in range(30):
        deep = [deep]
    CACHE["deep"] = deep
    try:
        inner = CACHE["deep"]
        while isinstance(inner, list) and not isinstance(inner[0], torch.Tensor):
            inner = inner[0]
        target = inner[0]  # type: ignore[index]
        paths = why_alive(target, max_depth=5, cycles=False, timeout=T)
        assert list(paths) == []
        assert paths.stopped is not None and "depth limit 5" in paths.stopped
        found = why_alive(target, max_depth=40, max_paths=1, timeout=T)
        assert len(found[0]) == 32  # ['deep'] + 31 list indexes... and the tensor
    finally:
        CACHE.clear()


def test_time_limit_is_reported() -> None:
    paths = why_alive(torch.zeros(1), timeout=1e-9, cycles=False)
    assert paths.stopped is not None and paths.stopped.startswith("time limit")


@pytest.mark.parametrize("bad", ["text", 3, [torch.zeros(1)], None])
def test_bad_input_says_what_it_accepts(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="expects a torch.Tensor, a storage .* or a torch.nn.Module; received"):
        why_alive(bad, timeout=T)


def test_bad_limits() -> None:
    with pytest.raises(InvalidInputError, match="max_depth must be an integer >= 1, got 0"):
        why_alive(torch.zeros(1), max_depth=0, timeout=T)
    with pytest.raises(InvalidInputError, match="timeout must be a number of seconds > 0"):
        why_alive(torch.zeros(1), timeout=0)


def test_storage_target_and_top_level_name() -> None:
    import torchmem

    t = torch.zeros(8, dtype=torch.float64)
    CACHE["t"] = t
    try:
        paths = torchmem.why_alive(t.untyped_storage(), max_paths=1, timeout=T)
        assert str(paths[0]) == f"{MOD} global CACHE (dict) ['t'] -> Tensor float64[8] 64 B"
    finally:
        CACHE.clear()


LEAKY_SCRIPT = textwrap.dedent(
    """
    import torch
    LOSSES = []
    net = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad()
        out = net(torch.randn(64, 256))
        loss = (out * out).sum()         # MulBackward0 saves `out` (64 KiB) for backward
        LOSSES.append(loss)              # kept with its graph: `out` stays alive
        opt.step()
    """
)


def test_torchmem_run_explains_leaked_memory(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY_SCRIPT)
    res = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--json", "--why", "4", "-o", "t.tmtrace",
         "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert res.returncode == 0, res.stderr
    data = __import__("json").loads(res.stdout)
    assert data["leak_suspect"] is True
    leaks = data["leak_paths"]
    # each of steps 1 and 2 leaked two 64x256 float32 tensors (64 KiB each): the input, saved
    # by addmm for the weight's gradient, and `out`, saved twice by mul; step 3 is the last
    assert [(leak["nbytes"], leak["step"], leak["site"]) for leak in leaks] == [
        (65536, 1, "train.py:8"), (65536, 1, "train.py:8"),
        (65536, 2, "train.py:8"), (65536, 2, "train.py:8"),
    ]
    head = "train.py global LOSSES (list) [{k}] -> Tensor.grad_fn SumBackward0 -> next_functions[0] MulBackward0 -> "
    tail = " -> Tensor float32[64, 256] 64.00 KiB (allocated at train.py:8)"
    for k in (1, 2):
        inp, out = leaks[2 * k - 2], leaks[2 * k - 1]
        assert inp["paths"] == [
            head.format(k=k) + "next_functions[0] AddmmBackward0 -> saved tensor (mat1)" + tail
        ]
        assert out["paths"] == [
            head.format(k=k) + "saved tensor (other)" + tail,
            head.format(k=k) + "saved tensor (self)" + tail,
        ]


def test_inspect_why_prints_paths_of_the_largest_storages(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "torchmem", "inspect", "--example", "mlp", "--format", "plain",
         "--top", "1", "--why", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert res.returncode == 0, res.stderr
    why = res.stdout[res.stdout.index("== Why alive"):].splitlines()
    # the largest storages are the 256x256 float32 weights (256 KiB); Adam holds the first one
    # as a state key and in its param group, the model as Sequential.0's weight
    assert why[1:] == [
        "Parameter float32[256, 256] 256.00 KiB:",
        "  mlp optimizer (Adam) -> Adam.state key (group 0 param 0) -> Parameter float32[256, 256] 256.00 KiB",
        "  mlp (Sequential) -> Sequential.0 (Linear) -> Linear.weight (parameter) -> Parameter float32[256, 256] 256.00 KiB",
        "  mlp optimizer (Adam) -> Adam.param_groups (list) [0] (dict) ['params'] (list) [0] -> Parameter float32[256, 256] 256.00 KiB",
    ]


def test_objects_with_a_catch_all_getattr_are_never_probed():
    """pytest.mark under --strict-markers fails on any unknown attribute (a BaseException): the
    search recognises graph nodes by type, so such an object on the way is only walked through."""

    class Trap(BaseException):
        pass

    class CatchAll:
        def __init__(self, held):
            self.held = held

        def __getattr__(self, name):
            raise Trap(name)

    t = torch.zeros(64)
    box = CatchAll([t])
    paths = why_alive(t, roots={"BOX": box})
    assert [str(p) for p in paths][:1] == ["BOX (CatchAll) -> CatchAll.held (list) [0] -> Tensor float32[64] 256 B"]


def test_cycle_members_among_pending_garbage_are_found_in_one_pass() -> None:
    """_on_cycles marks exactly the objects on a cycle (built by hand here): a ring of 300, a
    self-loop, and not the objects that only hang off a cycle; the path then starts at the
    cycle whose member holds the tensor, past the long ring beside it."""
    import gc
    import time

    from torchmem.capture.retention import _on_cycles

    gc.collect()  # earlier tests' garbage: the search looks through all of it
    gc.disable()
    try:
        ring = [_Node() for _ in range(300)]
        for x, y in zip(ring, ring[1:] + ring[:1]):
            x.next = y  # type: ignore[attr-defined]
        loop = _Node()
        loop.me = loop  # type: ignore[attr-defined]
        tail = _Node()  # held by the loop, not on a cycle
        loop.tail = tail  # type: ignore[attr-defined]
        tail.data = torch.zeros(10)  # type: ignore[attr-defined]
        objs = [*ring, loop, tail]
        on = _on_cycles(objs, {id(o) for o in objs}, time.perf_counter() + 60)
        assert on == {id(o) for o in ring} | {id(loop)}
        t = tail.data  # type: ignore[attr-defined]
        del ring, loop, tail, objs, x, y
        paths = why_alive(t, timeout=T)
        assert _texts(paths) == [
            "reference cycle waiting for the garbage collector: <_Node object> -> _Node.me -> "
            "(back to the start); held from it: <_Node object> -> _Node.tail (_Node) -> "
            "_Node.data -> Tensor float32[10] 40 B"
        ], (paths.stopped, paths.note)
    finally:
        gc.enable()


class _LazyMapping(dict):  # type: ignore[type-arg]
    """A dict subclass whose own items() and __iter__ run code (as transformers' lazy
    auto-mappings import every model module): the search must not call them."""

    calls = 0

    def items(self):  # type: ignore[override]
        type(self).calls += 1
        raise RuntimeError("items() ran")

    def __iter__(self):  # type: ignore[override]
        type(self).calls += 1
        raise RuntimeError("__iter__ ran")


class _LazyList(list):  # type: ignore[type-arg]
    calls = 0

    def __iter__(self):  # type: ignore[override]
        type(self).calls += 1
        raise RuntimeError("__iter__ ran")


def test_container_subclasses_are_read_without_running_their_code() -> None:
    """The entries of a dict or list subclass are followed through the built-in storage, its
    attributes as an object's; its overridden ``items()``/``__iter__`` never run."""
    t = torch.zeros(7)
    lazy = _LazyMapping()
    dict.__setitem__(lazy, "w", t)
    lazy_list = _LazyList([None, t])
    lazy_list.note = {"kept": t}  # type: ignore[attr-defined]
    CACHE["lazy"], CACHE["lazy_list"] = lazy, lazy_list
    try:
        texts = sorted(_texts(why_alive(t, max_paths=5, timeout=T)))
        assert texts == sorted([
            f"{MOD} global CACHE (dict) ['lazy'] (_LazyMapping) ['w'] -> Tensor float32[7] 28 B",
            f"{MOD} global CACHE (dict) ['lazy_list'] (_LazyList) [1] -> Tensor float32[7] 28 B",
            f"{MOD} global CACHE (dict) ['lazy_list'] (_LazyList) -> _LazyList.note (dict) "
            "['kept'] -> Tensor float32[7] 28 B",
        ]), texts
        assert _LazyMapping.calls == 0 and _LazyList.calls == 0
    finally:
        CACHE.clear()


def test_a_search_leaves_no_cycle_of_its_own_behind() -> None:
    """A search's bookkeeping (its parents map, its root list: its own frame among the roots)
    is freed when it returns, not left as cyclic garbage that the next search would walk."""
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        first = why_alive(torch.zeros(3), timeout=T)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            left = gc.collect()
        finally:
            gc.set_debug(0)
        kinds = sorted({type(o).__name__ for o in gc.garbage})
        del gc.garbage[:]
        gc.collect()
        second = why_alive(torch.zeros(3), timeout=T)
    finally:
        if enabled:
            gc.enable()
    assert left == 0, kinds
    assert second.searched <= first.searched + 1000  # the second walks no leftovers of the first
