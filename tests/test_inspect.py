"""inspect_memory / MemoryReport / table rendering, checked against independently computed bytes."""

from __future__ import annotations

import io
import json

import pytest
import torch

import torchmem
from torchmem.capture.census import Census, inspect_memory
from torchmem.errors import InvalidInputError, UnsupportedTensorError
from torchmem.examples import build_example, train_step
from torchmem.model.census import MemoryReport
from torchmem.render.table import render


def distinct_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Ground truth by data pointer of each storage (CPU): each storage's nbytes once."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_transformer_names_and_totals() -> None:
    m = build_example("transformer")
    r = inspect_memory(m)
    names = {n for t in r.tensors for n in t.names}
    assert "encoder.layers.0.linear1.weight" in names
    assert "encoder.layers.1.self_attn.in_proj_weight" in names
    assert names == {n for n, _ in m.named_parameters()} | {n for n, _ in m.named_buffers()}
    truth = distinct_storage_bytes(list(m.parameters()))
    assert r.unique_bytes == {"cpu": truth}
    assert r.storage_bytes == {"cpu": truth}
    assert r.naive_bytes == {"cpu": sum(p.numel() * p.element_size() for p in m.parameters())}
    assert sum(r.by_category["cpu"].values()) == truth
    w = r.tensor("encoder.layers.0.linear1.weight")
    p = m.encoder.layers[0].linear1.weight
    assert (w.shape, w.stride, w.dtype, w.nbytes) == (tuple(p.shape), p.stride(), "float32", p.numel() * 4)


def test_tied_lm_sharing_is_counted_once_and_shown() -> None:
    m = build_example("tied-lm")
    r = inspect_memory(m)
    groups = [sorted(g) for g in r.sharing_groups]
    assert sorted(["embed.weight", "head.weight", "embed_t"]) in groups
    assert sorted(["pos", "pos_slice"]) in groups
    assert r.tensor("head.weight").name == "embed.weight"
    assert r.tensor("head.weight").aliases == ["head.weight"]
    # ground truth: parameters' storages + pos storage (views add nothing)
    truth = distinct_storage_bytes(list(m.parameters()) + [m.pos])
    assert r.unique_bytes == {"cpu": truth}
    views = m.embed_t.numel() * 4 + m.pos_slice.numel() * 4
    assert r.naive_bytes["cpu"] - r.unique_bytes["cpu"] == views
    # embed_t's bytes are attributed to 'parameter' (priority), not counted again as buffer
    assert r.by_category["cpu"]["buffer"] == m.pos.numel() * 4
    assert r.by_category["cpu"]["parameter"] == distinct_storage_bytes(list(m.parameters()))


def test_gradients_and_optimizer_state_named_by_parameter() -> None:
    m = build_example("tied-lm")
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    train_step("tied-lm", m, opt)
    r = inspect_memory(m, opt)
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    assert r.by_category["cpu"]["gradient"] == distinct_storage_bytes(grads)
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert r.by_category["cpu"]["optimizer_state"] == distinct_storage_bytes(state)
    names = {t.name for t in r.tensors}
    assert "embed.weight.grad" in names
    assert {"state[embed.weight].exp_avg", "state[embed.weight].exp_avg_sq",
            "state[embed.weight].step", "state[body.0.bias].exp_avg"} <= names
    assert r.tensor("state[embed.weight].exp_avg").category == "optimizer_state"
    total = distinct_storage_bytes(list(m.parameters()) + [m.pos] + grads + state)
    assert r.total_unique_bytes == total


def test_optimizer_alone_names_params_by_group() -> None:
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1, momentum=0.9)
    (a.sum() + b.sum()).backward()
    opt.step()
    r = inspect_memory(optimizer=opt)
    names = {t.name: t for t in r.tensors}
    assert set(names) == {
        "param_groups[0].params[0]", "param_groups[0].params[0].grad",
        "param_groups[1].params[0]", "param_groups[1].params[0].grad",
        "state[param_groups[0].params[0]].momentum_buffer",
        "state[param_groups[1].params[0]].momentum_buffer",
    }
    assert r.by_category == {"cpu": {"parameter": 12 + 40, "gradient": 52, "optimizer_state": 52}}


def test_given_tensors_list_mapping_and_single() -> None:
    x = torch.zeros(10, 10, dtype=torch.float64)
    r = inspect_memory(tensors=[x, x[2:], x.t(), torch.ones(3, dtype=torch.int16)])
    assert r.unique_bytes == {"cpu": 800 + 6}
    assert [t.name for t in r.tensors] == ["tensors[0]", "tensors[1]", "tensors[2]", "tensors[3]"]
    r = inspect_memory(tensors={"a": x[:5], "b": x[5:]})
    assert r.unique_bytes == {"cpu": 800} and r.sharing_groups == [["a", "b"]]
    r = inspect_memory(tensors=x[1])
    assert r.unique_bytes == {"cpu": 80} and r.storage_bytes == {"cpu": 800}


def test_meta_module_and_parameter_subclass() -> None:
    class MyParam(torch.nn.Parameter):
        pass

    with torch.device("meta"):
        lin = torch.nn.Linear(100, 50)
    lin.extra = MyParam(torch.empty(7, device="meta"))
    r = inspect_memory(lin)
    assert r.unique_bytes == {"meta": (5000 + 50 + 7) * 4}
    assert r.tensor("extra").type_name == "MyParam"
    assert r.tensor("weight").requires_grad is True


def test_all_live_finds_new_tensors_and_skips_sparse() -> None:
    keep = [torch.zeros(1237 + i, dtype=torch.uint8) for i in range(50)]
    view = keep[0][5:]
    sparse = torch.eye(4).to_sparse()
    r = inspect_memory(all_live=True)
    by_size = {t.nbytes for t in r.tensors}
    assert all(1237 + i in by_size for i in range(50))
    assert r.skipped >= 1 and any("sparse" in k for k in r.skipped_kinds)
    row = next(t for t in r.tensors if t.shape == (1232,) and t.dtype == "uint8")
    assert row.span_start == 5 and row.span_end == 1237
    storage = next(s for s in r.storages if s.index == row.storage)
    assert storage.nbytes == 1237 and len(storage.names) >= 2
    del view, sparse, keep


def test_all_live_with_module_keeps_module_names() -> None:
    m = torch.nn.Linear(3, 3)
    r = inspect_memory(m, all_live=True)
    assert r.tensor("weight").category == "parameter"
    assert not any(t.name.startswith("live") and t.shape == (3, 3) and t.requires_grad
                   for t in r.tensors if t.storage == r.tensor("weight").storage)


def test_bad_inputs() -> None:
    with pytest.raises(InvalidInputError, match="torch.nn.Module"):
        inspect_memory(module="model")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="Optimizer"):
        inspect_memory(optimizer=[1])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="tensors"):
        inspect_memory(tensors=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"tensors\[1\]"):
        inspect_memory(tensors=[torch.zeros(1), "x"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="'b'"):
        inspect_memory(tensors={"a": torch.zeros(1), "b": 3})  # type: ignore[dict-item]
    with pytest.raises(UnsupportedTensorError, match="sparse"):
        inspect_memory(tensors=[torch.eye(2).to_sparse()])


def test_census_alias_and_strict() -> None:
    c = Census()
    x = torch.zeros(4)
    c.add("x", x, "other")
    c.add("y", x, "other")
    assert len(c) == 1 and c.name_of(x) == "x"
    r = c.report()
    assert r.tensors[0].aliases == ["y"]


def test_json_round_trip_and_select() -> None:
    m = build_example("tied-lm")
    r = inspect_memory(m)
    data = json.loads(r.to_json())
    assert data["unique_bytes"] == r.unique_bytes
    assert data["tensors"][0]["nbytes"] == r.tensors[0].nbytes
    assert MemoryReport.from_dict(data) == r
    mixed = inspect_memory(tensors={"c": torch.zeros(4), "m": torch.zeros(2, device="meta")})
    assert mixed.select(device="meta").unique_bytes == {"meta": 8}
    assert [t.name for t in mixed.select(device="cpu").tensors] == ["c"]


def test_render_plain_rich_json() -> None:
    m = build_example("tied-lm")
    r = inspect_memory(m)
    out = io.StringIO()
    render(r, out, fmt="plain", top=None)
    text = out.getvalue()
    assert "embed.weight (= head.weight)" in text
    assert "embed.weight, head.weight, embed_t" in text
    assert torchmem.format_bytes(r.unique_bytes["cpu"]) in text
    out = io.StringIO()
    render(r, out, fmt="rich")
    assert "Shared storages" in out.getvalue() and "pos_slice" in out.getvalue()
    out = io.StringIO()
    render(r, out, fmt="json")
    assert json.loads(out.getvalue())["storage_bytes"] == r.storage_bytes
    with pytest.raises(InvalidInputError, match="fmt"):
        render(r, out, fmt="html")
    with pytest.raises(InvalidInputError, match="MemoryReport"):
        render({}, out)  # type: ignore[arg-type]


def test_fake_tensor_module() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        m = torch.nn.Linear(300, 200)
        m.register_buffer("w_t", m.weight.detach().t())
        r = inspect_memory(m)
    assert r.unique_bytes == {"cpu": (300 * 200 + 200) * 4}
    assert r.naive_bytes == {"cpu": (2 * 300 * 200 + 200) * 4}
    assert r.tensor("weight").type_name == "FakeTensor"


def test_no_arguments_means_all_live() -> None:
    keep = torch.zeros(31337, dtype=torch.uint8)
    r = inspect_memory()
    assert "all live tensors" in r.source
    assert any(t.nbytes == 31337 for t in r.tensors)
    del keep


def test_collect_garbage_drops_unreachable_cycles_only_when_asked() -> None:
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        a: dict = {"t": torch.zeros(77777, dtype=torch.uint8)}
        b: dict = {"a": a}
        a["b"] = b
        del a, b  # an unreachable cycle: its tensor still holds memory until collected
        default = inspect_memory(all_live=True)
        assert any(t.nbytes == 77777 for t in default.tensors)
        collected = inspect_memory(all_live=True, collect_garbage=True)
        assert not any(t.nbytes == 77777 for t in collected.tensors)
        assert gc.isenabled() is False  # the caller's setting is restored
    finally:
        if was:
            gc.enable()


def _odd_tensors() -> list[torch.Tensor]:
    """Each its own storage: dense, transposed, strided slices, empty, expanded, 0-d, meta."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    return [x.clone(), x.clone().transpose(0, 2), x.clone()[:, 1:, ::3], torch.zeros(0, 3),
            torch.zeros(3).expand(5, 3), torch.tensor(2, dtype=torch.int16),
            torch.ones(6, dtype=torch.float16)[1:5], torch.empty(4, 4, device="meta")[:, 2],
            torch.nn.Parameter(torch.ones(3, 1))]


@pytest.mark.parametrize("bulk", [True, False])
def test_each_row_spans_the_bytes_tensor_span_gives(bulk: bool) -> None:
    # the census reads its columns in bulk; every span equals torchmem.tensor_span's (the
    # corners of each dimension), used bytes its length, whichever path added them
    from torchmem.capture.storage import tensor_span

    ts = _odd_tensors()
    names = [f"t{i}" for i in range(len(ts))]
    c = Census()
    if bulk:
        assert c.add_distinct(names, ts, "other")
    else:
        for n, t in zip(names, ts):
            c.add(n, t, "other")
    r = c.report()
    spans = [tensor_span(t) for t in ts]
    assert [(t.span_start, t.span_end) for t in r.tensors] == [(s.start, s.end) for s in spans]
    assert [s.used_bytes for s in r.storages] == [s.nbytes for s in spans]
    assert [s.nbytes for s in r.storages] == [t.untyped_storage().nbytes() for t in ts]
    assert [(t.shape, t.stride, t.storage_offset, t.element_size, t.type_name) for t in r.tensors] == [
        (tuple(t.shape), t.stride(), t.storage_offset(), t.element_size(), type(t).__name__)
        for t in ts]
    assert r.unique_bytes == {"cpu": sum(s.nbytes for s, t in zip(spans, ts) if not t.is_meta),
                              "meta": 4 * (3 * 4 + 1)}  # elements 2, 6, 10, 14


def test_the_bulk_add_leaves_unmeasurable_tensors_to_add() -> None:
    c = Census()
    assert not c.add_distinct(["d", "s"], [torch.zeros(2), torch.eye(2).to_sparse()], "other")
    assert len(c) == 0
    c.add("x", torch.zeros(1), "other")
    assert not c.add_distinct(["y"], [torch.zeros(1)], "other")  # only into an empty census


def test_records_are_built_when_first_read_and_hold_no_tensor() -> None:
    # the report is returned with its columns only; its records are built on the first read,
    # and what it keeps meanwhile are plain values: the tensors it measured can be freed
    import copy
    import pickle
    import weakref

    x = torch.zeros(1000)
    gone = weakref.ref(x)
    r = inspect_memory(tensors={"x": x, "x_tail": x[500:]})
    assert r._unbuilt() is not None
    del x
    assert gone() is None  # freed although the report's records are not built yet
    clone = copy.deepcopy(r)  # copy and pickle see built records
    assert clone._unbuilt() is None and r._unbuilt() is None
    again = pickle.loads(pickle.dumps(inspect_memory(tensors={"y": torch.zeros(3)})))
    assert [t.name for t in again.tensors] == ["y"] and again.unique_bytes == {"cpu": 12}
    assert clone == r and r.unique_bytes == {"cpu": 4000}
    assert [(t.name, t.span_start, t.span_end) for t in r.tensors] == [
        ("x", 0, 4000), ("x_tail", 2000, 4000)]
    assert r.sharing_groups == [["x", "x_tail"]]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        r.nope  # noqa: B018


@pytest.mark.parametrize("shared", [False, True])
def test_rows_answer_totals_as_the_records_do(shared: bool) -> None:
    # the columns a printed report reads (names, devices, unique bytes) equal the records'
    ts = _odd_tensors()
    if shared:
        base = torch.zeros(10)
        ts += [base[:6], base[4:]]  # overlap: 10 elements = 40 bytes of one storage
    c = Census()
    assert c.add_distinct([f"t{i}" for i in range(len(ts))], ts, "other")
    rows = c.rows()
    assert rows.distinct is not shared
    tensors, storages = rows.build()
    built = MemoryReport(tensors=tensors, storages=storages)
    assert rows.first_names == [t.name for t in tensors]
    assert rows.devices == built.devices == ["cpu", "meta"]
    assert rows.unique_bytes() == built.unique_bytes
    # ground truth by brute force: every element's byte address (data pointer, strides),
    # each tensor's span from its lowest to its highest byte, the union of spans counted
    covered: set[int] = set()
    for t in ts:
        if t.is_meta or t.numel() == 0:
            continue
        elems = torch.zeros(1, dtype=torch.long)  # element offsets from the tensor's first
        for n, st in zip(t.shape, t.stride()):
            elems = (elems.view(-1, 1) + torch.arange(n) * st).view(-1)
        first = t.data_ptr() + int(elems.min()) * t.element_size()
        covered |= set(range(first, t.data_ptr() + (int(elems.max()) + 1) * t.element_size()))
    assert rows.unique_bytes()["cpu"] == len(covered)


def test_records_read_from_many_threads_at_once_are_one_list() -> None:
    # the records of a deferred report are built by whichever thread reads first; threads
    # reading meanwhile (a build of 20,000 rows spans several GIL switches) get the same list
    import threading

    keep = [torch.zeros(1) for _ in range(20_000)]
    r = inspect_memory(tensors=keep)
    barrier = threading.Barrier(4)
    got: list[object] = []
    errors: list[BaseException] = []

    def read() -> None:
        barrier.wait()
        try:
            got.append(r.tensors)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 4 and all(g is got[0] for g in got)
    assert len(r.tensors) == 20_000 and r.unique_bytes == {"cpu": 80_000}
