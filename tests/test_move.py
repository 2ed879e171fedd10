"""memory_aware_to / plan_move / memory_aware_deepcopy: aliasing, identity, atomicity, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchmem
from torchmem import move as move_mod
from torchmem.capture.census import inspect_memory
from torchmem.errors import DeviceError, InvalidInputError, MoveError, UnsupportedTensorError
from torchmem.examples import build_example, train_step
from torchmem.move import memory_aware_deepcopy, memory_aware_to, plan_move


class TaggedParam(nn.Parameter):
    """A Parameter subclass (as quantization / sharding libraries define)."""


def layout(m: nn.Module) -> dict[str, tuple]:
    """name -> (storage group label, offset, shape, stride, dtype, requires_grad, type)."""
    groups: dict[int, int] = {}
    out = {}
    items = list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False))
    for name, t in items:
        sid = torchmem.storage_id(t)
        g = groups.setdefault(sid, len(groups))
        out[name] = (g, t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad, type(t))
    return out


def flat_model() -> nn.Module:
    """Parameters carved out of one flat storage, a buffer viewing a parameter, an int buffer."""
    flat = torch.arange(40, dtype=torch.float32)
    m = nn.Module()
    m.a = nn.Parameter(flat[:12].view(3, 4))
    m.b = TaggedParam(flat[12:32].view(4, 5).t())  # non-contiguous, offset 12
    m.c = nn.Parameter(flat[32:], requires_grad=False)
    m.register_buffer("a_t", m.a.detach().t())
    m.register_buffer("steps", torch.arange(5))  # int64: never converted
    m.b.tag = "special"
    return m


def snapshot_values(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in list(m.named_parameters()) + list(m.named_buffers())}


# -- move ------------------------------------------------------------------------------------

def test_dtype_conversion_keeps_aliasing_offsets_identity() -> None:
    m = flat_model()
    before = layout(m)
    values = snapshot_values(m)
    params = {n: p for n, p in m.named_parameters()}
    steps_storage = m.steps.untyped_storage().data_ptr()
    out = memory_aware_to(m, dtype=torch.float64)
    assert out is m
    after = layout(m)
    assert after == before  # same groups, offsets (elements), shapes, strides, flags, types
    for n, p in m.named_parameters():
        assert p is params[n]  # identity kept (.data swap), so optimizers stay valid
        assert p.dtype == torch.float64
        assert torch.equal(p.detach(), values[n].double())
    assert m.a_t.dtype == torch.float64 and torch.equal(m.a_t, values["a_t"].double())
    # one storage of 40 float64 for a, b, c, a_t; byte offset of b scaled by element size
    assert m.a.untyped_storage().nbytes() == 40 * 8
    assert torchmem.tensor_span(m.b).start == 12 * 8
    assert m.steps.dtype == torch.int64 and m.steps.untyped_storage().data_ptr() == steps_storage
    assert m.b.tag == "special" and isinstance(m.b, TaggedParam)
    # writing through one view is seen by the others (they really alias)
    with torch.no_grad():
        m.a[0, 1] = -7.0
    assert m.a_t[1, 0].item() == -7.0


def test_move_to_meta_keeps_sharing_types_and_grads() -> None:
    m = build_example("tied-lm")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    train_step("tied-lm", m, opt)
    before = layout(m)
    truth = inspect_memory(m)
    memory_aware_to(m, "meta")
    assert layout(m) == before
    assert {t.device.type for t in list(m.parameters()) + list(m.buffers())} == {"meta"}
    assert m.head.weight is m.embed.weight
    assert torchmem.same_storage(m.embed_t, m.embed.weight)
    assert torchmem.same_storage(m.pos_slice, m.pos)
    for p in m.parameters():
        assert isinstance(p, nn.Parameter) and p.grad is not None and p.grad.device.type == "meta"
    after = inspect_memory(m)
    assert after.unique_bytes == {"meta": truth.unique_bytes["cpu"]}
    assert after.storage_bytes == {"meta": truth.storage_bytes["cpu"]}


def test_move_to_meta_replaces_objects_everywhere_incl_optimizer() -> None:
    m = flat_model()
    opt = torch.optim.Adam([m.a, m.b], lr=0.1)
    (m.a.sum() + m.b.sum()).backward()
    opt.step()
    memory_aware_to(m, "meta", optimizer=opt)
    assert isinstance(m.b, TaggedParam) and m.b.tag == "special"
    assert opt.param_groups[0]["params"][0] is m.a and opt.param_groups[0]["params"][1] is m.b
    assert set(opt.state) == {m.a, m.b}
    st = opt.state[m.b]
    assert st["exp_avg"].device.type == "meta" and st["exp_avg"].shape == m.b.shape
    assert st["step"].device.type == "cpu"  # step counters stay on CPU (as load_state_dict does)
    assert m.a.grad is not None and m.a.grad.device.type == "meta"


def test_nested_optimizer_state_moves_at_every_depth_and_matches_plan() -> None:
    # Regression: state nested two lists deep was planned (and counted) but left on the CPU by
    # the swap, and tensors inside a dict were neither planned nor moved (inspect_memory counted
    # them). Every state tensor, at any depth, must end on the target and be in the plan.
    lin = nn.Linear(2, 2, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    deep, shallow, in_dict = torch.zeros(2), torch.ones(2, dtype=torch.float64), torch.zeros(3)
    opt.state[lin.weight]["nested"] = [[deep], shallow]
    opt.state[lin.weight]["d"] = {"m": in_dict, "n": 7}
    original_nested = opt.state[lin.weight]["nested"]
    expected = sum(t.untyped_storage().nbytes() for t in (lin.weight, deep, shallow, in_dict))
    plan = plan_move(lin, "meta", optimizer=opt)
    assert plan.gains == {"meta": expected} and expected == 4 * 4 + 2 * 4 + 2 * 8 + 3 * 4
    assert sorted(n for s in plan.storages for n in s.names) == [
        "state[weight].d.m", "state[weight].nested[0][0]", "state[weight].nested[1]", "weight"]
    memory_aware_to(lin, "meta", optimizer=opt)
    st = opt.state[lin.weight]
    assert st["nested"][0][0].device.type == "meta" and st["nested"][0][0].shape == (2,)
    assert st["nested"][1].device.type == "meta" and st["nested"][1].dtype == torch.float64
    assert st["d"]["m"].device.type == "meta" and st["d"]["n"] == 7
    assert original_nested[0][0] is deep and deep.device.type == "cpu"  # containers not mutated
    assert inspect_memory(lin, opt).unique_bytes == {"meta": expected}  # nothing left behind


def test_optimizer_state_follows_dtype_and_still_steps() -> None:
    m = nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    w = m.weight
    exp_avg = opt.state[w]["exp_avg"].clone()
    memory_aware_to(m, dtype=torch.float64, optimizer=opt)
    assert m.weight is w and opt.state[w]["exp_avg"].dtype == torch.float64
    assert torch.equal(opt.state[w]["exp_avg"], exp_avg.double())
    assert opt.state[w]["step"].dtype == torch.float32  # steps keep their dtype
    assert w.grad is not None and w.grad.dtype == torch.float64
    m(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()  # state and params agree: the optimizer still works
    assert opt.state[w]["step"].item() == 2.0


def test_tensors_already_in_place_are_untouched() -> None:
    m = build_example("tied-lm")
    ptrs = {n: t.data_ptr() for n, t in m.state_dict(keep_vars=True).items()}
    objs = {n: t for n, t in m.state_dict(keep_vars=True).items()}
    plan = plan_move(m, "cpu")
    assert plan.gains == {} and plan.losses == {}
    assert {s.action for s in plan.storages} == {"keep"}
    memory_aware_to(m, "cpu")
    for n, t in m.state_dict(keep_vars=True).items():
        assert t is objs[n] and t.data_ptr() == ptrs[n]


def test_mixed_devices_only_moves_what_is_elsewhere() -> None:
    m = nn.Module()
    m.x = nn.Parameter(torch.ones(4))
    m.register_buffer("y", torch.empty(6, device="meta"))
    ptr = m.x.data_ptr()
    plan = plan_move(m, "cpu")
    assert [s.action for s in plan.storages] == ["keep", "move"]
    with pytest.raises(MoveError, match="to_empty"):
        memory_aware_to(m, "cpu")  # meta has no data: clear error, nothing changed
    assert m.x.data_ptr() == ptr and m.y.device.type == "meta"


def test_plan_numbers() -> None:
    m = flat_model()
    p = plan_move(m, "meta")
    assert p.gains == {"meta": 40 * 4 + 5 * 8}
    assert p.losses == {"cpu": 40 * 4 + 5 * 8}
    assert p.net == {"cpu": -200, "meta": 200}
    assert sorted(p.shared_groups[0]) == ["a", "a_t", "b", "c"]
    h = plan_move(m, dtype=torch.float16)
    conv = next(s for s in h.storages if "a" in s.names)
    assert (conv.action, conv.source_nbytes, conv.target_nbytes) == ("convert", 160, 80)
    keep = next(s for s in h.storages if "steps" in s.names)
    assert keep.action == "keep"
    assert h.gains == {"cpu": 80} and h.losses == {"cpu": 160}
    assert p.to_dict()["gains"] == {"meta": 200}


# -- atomicity -------------------------------------------------------------------------------

def test_failure_while_building_leaves_module_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    m = build_example("mlp")
    before = {n: (t.data_ptr(), t.dtype) for n, t in m.state_dict(keep_vars=True).items()}
    calls = {"n": 0}
    real = move_mod._allocate

    def flaky(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated out of memory on the target")
        return real(numel, dtype, device)

    monkeypatch.setattr(move_mod, "_allocate", flaky)
    with pytest.raises(MoveError, match="simulated out of memory.*unchanged"):
        memory_aware_to(m, dtype=torch.float64)
    assert calls["n"] == 5
    after = {n: (t.data_ptr(), t.dtype) for n, t in m.state_dict(keep_vars=True).items()}
    assert after == before


class RefusesData(torch.Tensor):
    """A tensor subclass whose .data cannot be replaced: a real failure during the swap."""

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return super().data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        raise RuntimeError("this tensor refuses new data")


def test_failure_during_swap_is_rolled_back() -> None:
    m = flat_model()
    m.register_buffer("bad", torch.Tensor._make_subclass(RefusesData, torch.ones(3)))
    before = {n: (t.data_ptr(), t.dtype, t.stride()) for n, t in m.state_dict(keep_vars=True).items()}
    values = snapshot_values(m)
    with pytest.raises(MoveError, match="refuses new data.*restored"):
        memory_aware_to(m, dtype=torch.float64)
    after = {n: (t.data_ptr(), t.dtype, t.stride()) for n, t in m.state_dict(keep_vars=True).items()}
    assert after == before
    for n, v in snapshot_values(m).items():
        assert torch.equal(v, values[n])
    assert torchmem.same_storage(m.a, m.a_t)


def test_mixed_dtype_views_cannot_be_converted() -> None:
    m = nn.Linear(4, 4)
    m.register_buffer("bits", m.weight.detach().view(torch.int32))
    ptr = m.weight.data_ptr()
    with pytest.raises(MoveError, match="several dtypes"):
        memory_aware_to(m, dtype=torch.float16)
    assert m.weight.dtype == torch.float32 and m.weight.data_ptr() == ptr
    memory_aware_to(m, "meta")  # a plain move keeps the mixed views aliased
    assert torchmem.same_storage(m.bits, m.weight) and m.bits.dtype == torch.int32


# -- bad input -------------------------------------------------------------------------------

def test_bad_inputs() -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(InvalidInputError, match="torch.nn.Module"):
        memory_aware_to(torch.zeros(2), "cpu")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="torch.nn.Module"):
        memory_aware_deepcopy({"w": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="torch.nn.Module"):
        plan_move("model", "cpu")  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="unknown device 'gpu0'"):
        memory_aware_to(m, "gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="not available"):
            memory_aware_to(m, "cuda:0")
    with pytest.raises(InvalidInputError, match="floating point or complex"):
        memory_aware_to(m, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="torch.dtype"):
        memory_aware_to(m, dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="Optimizer"):
        memory_aware_to(m, "cpu", optimizer=object())  # type: ignore[arg-type]
    s = nn.Module()
    s.register_buffer("sp", torch.eye(3).to_sparse())
    with pytest.raises(UnsupportedTensorError, match="sparse"):
        memory_aware_to(s, "meta")
    with pytest.raises(UnsupportedTensorError, match="sparse"):
        memory_aware_deepcopy(s)
    lazy = nn.LazyLinear(3)
    with pytest.raises(UnsupportedTensorError, match="lazy"):
        memory_aware_to(lazy, "meta")
    assert m.weight.device.type == "cpu"


# -- deep copy -------------------------------------------------------------------------------

def test_deepcopy_is_independent_and_keeps_aliasing_grads_types() -> None:
    m = build_example("tied-lm")
    m.body[0].weight.requires_grad_(False)
    m.extra = TaggedParam(torch.ones(5))
    m.extra.note = ["kept"]
    m.plain_view = m.embed.weight.detach()[:3]  # plain attribute viewing a parameter
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    train_step("tied-lm", m, opt)
    originals = snapshot_values(m)
    c = memory_aware_deepcopy(m)
    assert layout(c) == layout(m)
    assert c.head.weight is c.embed.weight
    assert isinstance(c.extra, TaggedParam) and c.extra.note == ["kept"] and c.extra.note is not m.extra.note
    assert c.body[0].weight.requires_grad is False
    assert torchmem.same_storage(c.plain_view, c.embed.weight)
    # grads copied, equal values, separate storage
    for (n, p), (_, q) in zip(m.named_parameters(), c.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad) and not torchmem.same_storage(p.grad, q.grad)
    # no storage shared with the original
    ids_m = {torchmem.storage_id(t) for t in m.state_dict(keep_vars=True).values()}
    ids_c = {torchmem.storage_id(t) for t in c.state_dict(keep_vars=True).values()}
    assert ids_m.isdisjoint(ids_c)
    # writing the copy never changes the original
    with torch.no_grad():
        for t in list(c.parameters()) + list(c.buffers()) + [c.plain_view]:
            t.fill_(123.0)
        for p in c.parameters():
            if p.grad is not None:
                p.grad.fill_(5.0)
    for n, v in snapshot_values(m).items():
        assert torch.equal(v, originals[n]), n
    assert m.embed.weight.grad is not None and not bool((m.embed.weight.grad == 5.0).all())
    # the copy costs the original's unique bytes; copy.deepcopy duplicates the views
    ours = inspect_memory(c).unique_bytes["cpu"]
    assert ours == inspect_memory(m).unique_bytes["cpu"]
    dc = copy.deepcopy(m)
    assert dc.embed.weight.grad is None  # copy.deepcopy drops .grad (Parameter.__deepcopy__)

    def weights_and_buffers(mod: nn.Module) -> int:
        cats = inspect_memory(mod).by_category["cpu"]
        return cats["parameter"] + cats.get("buffer", 0)

    # copy.deepcopy clones each Parameter on its own, so the buffer viewing the embedding gets
    # its own storage (buffers viewing buffers stay shared through its storage memo)
    assert weights_and_buffers(dc) - weights_and_buffers(c) == m.embed_t.numel() * 4


def test_deepcopy_output_matches_and_meta_works() -> None:
    m = build_example("transformer").eval()
    c = memory_aware_deepcopy(m)
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        assert torch.allclose(m(x), c(x))
    with torch.device("meta"):
        big = nn.Linear(1000, 1000)
    cm = memory_aware_deepcopy(big)
    assert cm.weight.device.type == "meta" and not torchmem.same_storage(cm.weight, big.weight)


def test_gradients_viewing_one_flat_buffer_stay_views() -> None:
    """Like DDP's gradient_as_bucket_view: all grads are views of one flat buffer."""
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    bucket = torch.arange(sum(p.numel() for p in m.parameters()), dtype=torch.float32)
    off = 0
    for p in m.parameters():
        p.grad = bucket[off:off + p.numel()].view_as(p)
        off += p.numel()
    offsets = [p.grad.storage_offset() for p in m.parameters()]  # type: ignore[union-attr]
    plan = plan_move(m, dtype=torch.float64)
    grad_storage = next(s for s in plan.storages if "0.weight.grad" in s.names)
    assert grad_storage.target_nbytes == bucket.numel() * 8 and len(grad_storage.names) == 4
    memory_aware_to(m, dtype=torch.float64)
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and g.dtype == torch.float64 for g in grads)
    assert len({torchmem.storage_id(g) for g in grads if g is not None}) == 1
    assert [g.storage_offset() for g in grads if g is not None] == offsets
    flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
    assert torch.equal(flat, bucket.double())
    c = memory_aware_deepcopy(m)
    cgrads = [p.grad for p in c.parameters()]
    assert len({torchmem.storage_id(g) for g in cgrads if g is not None}) == 1
    assert not torchmem.same_storage(cgrads[0], grads[0])  # type: ignore[arg-type]


@pytest.mark.cuda
def test_move_to_cuda_allocates_exactly_the_plan_and_keeps_aliasing() -> None:
    m = build_example("tied-lm")
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    train_step("tied-lm", m, opt)
    before = layout(m)
    plan = plan_move(m, "cuda:0", optimizer=opt)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(0)
    memory_aware_to(m, "cuda:0", optimizer=opt)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(0) - base
    # the caching allocator rounds each block up to a multiple of 512 bytes
    expected = sum(-(-s.target_nbytes // 512) * 512 for s in plan.storages if s.action != "keep")
    assert grown == expected
    assert layout(m) == before
    assert torchmem.same_storage(m.embed_t, m.embed.weight)
    assert opt.state[m.embed.weight]["exp_avg"].device.type == "cuda"
    train_step_input = torch.randint(0, 1000, (2, 16), device="cuda:0")
    m(train_step_input).float().pow(2).mean().backward()
    opt.step()
