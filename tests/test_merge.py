"""`torchmem.analysis.merge_ranks`: the merged view of a job's rank traces.

Ground truth comes another way: each rank's figures against :func:`summarize_trace` run on that
rank alone (a Python loop per event, not the merge's column passes), the difference between two
hand-built ranks whose bytes are known from their construction, and a real gloo job on loopback.
"""

from __future__ import annotations

import random

import pytest

from torchmem.analysis import merge_ranks, rank_stats
from torchmem.analysis.summary import summarize_trace
from torchmem.errors import InvalidInputError
from torchmem.model.events import Category as C
from torchmem.model.events import EventKind as K
from torchmem.model.events import Phase as P
from torchmem.model.trace import Trace

NO_SITE = "(no call site)"


def random_rank(rank: int, world: int, n: int, seed: int, devices: tuple[str, ...] = ("cpu",),
                reuse_ids: bool = False, job: str = "job") -> Trace:
    """A random rank trace: an initial state, allocations and frees on ``devices``, step
    markers, collectives and communication buffers, stacks on some events."""
    rnd = random.Random(seed)
    tr = Trace({"rank": rank, "world_size": world, "job_id": job})
    for j in range(5):
        tr.append(K.ALLOC, 0, devices[j % len(devices)], 1000 + j, 10_000 + j,
                  module=f"Net.l{j}", category=C.PARAMETER)
    live: dict[int, tuple[int, str]] = {}
    sid = 0
    step = 0
    ops = ["aten::mm", "aten::add", "aten::empty", "c10d::allgather_", "_c10d_functional::all_reduce"]
    mods = [None, "Net.l0", "Net.l1", "Net.l2"]
    for i in range(1, n):
        d = rnd.choice(devices)
        r = rnd.random()
        if r < 0.03:
            tr.append(K.MARK, i, d, 0, 0, op="step", step=step)
            step += 1
        elif r < 0.55 or not live:
            sid = sid + 1 if not (reuse_ids and rnd.random() < 0.3 and sid > 3) else sid - 2
            if sid in live:
                sid = max(live) + 1
            op = rnd.choice(ops)
            cat = rnd.choice([C.ACTIVATION, C.TEMPORARY, C.GRADIENT, C.COMMUNICATION, C.OTHER])
            nb = rnd.randint(1, 5000)
            stack = None if rnd.random() < 0.3 else (f"train.py:{rnd.randint(1, 9)}:step",)
            tr.append(K.ALLOC, i, d, nb, sid, op=op, module=rnd.choice(mods), category=cat,
                      phase=rnd.choice(list(P)), step=step, stack=stack)
            live[sid] = (nb, d)
        else:
            s = rnd.choice(sorted(live))
            nb, d = live.pop(s)
            tr.append(K.FREE, i, d, nb, s, step=step)
    return tr


@pytest.mark.parametrize(
    "devices,reuse", [(("cpu",), False), (("cpu", "cuda:0"), False), (("cuda:1",), True)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_figures_equal_summarize_trace(devices: tuple[str, ...], reuse: bool, seed: int) -> None:
    tr = random_rank(0, 1, 3000, seed, devices, reuse_ids=reuse)
    s = summarize_trace(tr, top=10**6)
    r = rank_stats(tr)
    assert s.device == r.device
    assert (s.peak[s.device], s.peak_seq, s.peak_time_ns) == (r.peak, r.peak_seq, r.peak_time_ns)
    assert r.peak > 0
    assert s.peak == r.peaks and s.final_live == r.final_lives
    assert s.final_live[s.device] == r.final_live
    assert s.iterations == r.iterations and len(r.iterations) > 20
    assert r.steps == s.steps
    assert s.categories_at_peak == r.at_peak["category"]
    assert {k: b for k, b, _ in s.top_modules_at_peak} == r.at_peak["module"]
    assert {k: b for k, b, _ in s.top_ops_at_peak} == r.at_peak["operator"]
    sites = {k: b for k, b in r.at_peak["call_site"].items() if k != NO_SITE}
    assert {k: b for k, b, _ in s.top_stacks_at_peak} == sites
    assert s.growth is not None
    assert (s.growth.bytes_per_iteration, s.growth.leak) == (r.growth_per_iteration, r.leak)


def test_collectives_counted_from_the_events() -> None:
    tr = random_rank(0, 1, 3000, 5)
    r = rank_stats(tr)
    want: dict[str, list[int]] = {}
    live: dict[int, int] = {}
    for e in tr.events(0, r.peak_seq + 1):  # a plain replay up to the peak
        if e.kind is K.ALLOC:
            live[e.storage] = e.seq
        elif e.kind is K.FREE:
            live.pop(e.storage, None)
    for e in tr.events():
        if e.kind is K.ALLOC and ("c10d" in (e.op or "") or e.category is C.COMMUNICATION):
            v = want.setdefault(e.op or "(initial state)", [0, 0, 0])
            v[0] += e.nbytes
            v[1] += 1
            v[2] += e.nbytes if live.get(e.storage) == e.seq else 0
    got = {c.operator: [c.allocated, c.count, c.live_at_peak] for c in r.collectives}
    assert got == want
    assert {"c10d::allgather_", "_c10d_functional::all_reduce", "aten::empty"} <= set(got)


def _hand_rank(rank: int, world: int = 2) -> Trace:
    """Two ranks whose difference is known byte for byte. Both: 4000 B of parameters in
    Net.l0 at the start. Rank 0 adds a 3000 B all_gather buffer (communication, Net.l1,
    fsdp.py:10) and 500 B of activations (Net.l1, model.py:5); rank 1 adds 1000 B of the same
    buffer and 700 B of gradients (Net.l0, no stack) and 100 B with no name at all."""
    tr = Trace({"rank": rank, "world_size": world, "job_id": "hand"})
    tr.append(K.ALLOC, 0, "cpu", 4000, 1, module="Net.l0", category=C.PARAMETER)
    if rank == 0:
        tr.append(K.ALLOC, 1, "cpu", 3000, 2, op="c10d::allgather_", module="Net.l1",
                  category=C.COMMUNICATION, stack=("fsdp.py:10:gather",))
        tr.append(K.ALLOC, 2, "cpu", 500, 3, op="aten::relu", module="Net.l1",
                  category=C.ACTIVATION, stack=("model.py:5:forward",))
    else:
        tr.append(K.ALLOC, 1, "cpu", 1000, 2, op="c10d::allgather_", module="Net.l1",
                  category=C.COMMUNICATION, stack=("fsdp.py:10:gather",))
        tr.append(K.ALLOC, 2, "cpu", 700, 3, op="aten::mm", module="Net.l0",
                  category=C.GRADIENT)
        tr.append(K.ALLOC, 3, "cpu", 100, 4, op="aten::empty")
    tr.append(K.ALLOC, 4, "cpu", 64, 9, op="aten::add", module="Net.l0", category=C.TEMPORARY)
    tr.append(K.FREE, 5, "cpu", 64, 9)  # after the peak on both: never counted
    return tr


def test_difference_of_hand_built_ranks() -> None:
    m = merge_ranks([_hand_rank(1), _hand_rank(0)], top=10)
    assert [r.rank for r in m.ranks] == [0, 1]
    assert [r.peak for r in m.ranks] == [4000 + 3000 + 500 + 64, 4000 + 1000 + 700 + 100 + 64]
    assert (m.heaviest, m.lightest) == (0, 1)
    assert m.imbalance == pytest.approx(7564 / 5864)
    d = m.difference
    assert d is not None and (d.heavy_rank, d.light_rank, d.bytes) == (0, 1, 1700)
    rows = {g: {r.name: (r.heavy, r.light, r.delta) for r in a.rows} for g, a in d.groupings.items()}
    assert rows["category"] == {
        "communication": (3000, 1000, 2000), "gradient": (0, 700, -700),
        "activation": (500, 0, 500), "other": (0, 100, -100), "parameter": (4000, 4000, 0),
        "temporary": (64, 64, 0),
    }
    assert rows["module"] == {"Net.l1": (3500, 1000, 2500), "Net.l0": (4064, 4764, -700),
                              "(no module)": (0, 100, -100)}
    assert rows["call_site"] == {"fsdp.py:10:gather": (3000, 1000, 2000),
                                 "model.py:5:forward": (500, 0, 500),
                                 NO_SITE: (4064, 4864, -800)}
    assert rows["combined"] == {
        "communication | Net.l1 | fsdp.py:10:gather": (3000, 1000, 2000),
        "activation | Net.l1 | model.py:5:forward": (500, 0, 500),
        "gradient | Net.l0 | (no call site)": (0, 700, -700),
        "other | (no module) | (no call site)": (0, 100, -100),
        "parameter | Net.l0 | (no call site)": (4000, 4000, 0),
        "temporary | Net.l0 | (no call site)": (64, 64, 0),
    }
    for g, a in d.groupings.items():  # every grouping sums to the difference exactly
        assert sum(r.delta for r in a.rows) + a.rest == 1700, g
        assert a.rest == 0
        assert sum(r.share or 0 for r in a.rows) == pytest.approx(1.0)
    # named: every row but the unnamed bucket; by category the "other" -100 B is not named
    assert d.groupings["category"].named == 1800
    assert d.groupings["category"].named_share == pytest.approx(1800 / 1700)
    assert d.groupings["module"].named == 1800
    assert d.groupings["call_site"].named == 2500
    assert d.groupings["combined"].named == 1800
    assert d.named_share == pytest.approx(1800 / 1700)
    # the first rows are the largest changes
    assert d.groupings["category"].rows[0].name == "communication"
    assert d.groupings["module"].rows[0].name == "Net.l1"


def test_top_keeps_the_sum() -> None:
    m = merge_ranks([_hand_rank(0), _hand_rank(1)], top=1)
    a = m.difference.groupings["category"]  # type: ignore[union-attr]
    assert [r.name for r in a.rows] == ["communication"]
    assert a.rows[0].delta + a.rest == 1700 and a.rest == -300
    assert a.named == 2000


def test_per_rank_tables_and_json() -> None:
    m = merge_ranks([_hand_rank(0), _hand_rank(1)])
    assert m.per_rank("category")["communication"] == {0: 3000, 1: 1000}
    assert m.per_rank("module")["Net.l0"] == {0: 4064, 1: 4764}
    d = m.to_dict()
    assert d["complete"] and d["missing"] == [] and d["ranks_present"] == [0, 1]
    assert d["per_rank"]["category"]["communication"] == {"0": 3000, "1": 1000}
    assert d["difference"]["bytes"] == 1700
    assert d["ranks"][0]["collectives"] == [
        {"operator": "c10d::allgather_", "category": "communication", "allocated": 3000,
         "count": 1, "live_at_peak": 3000}]
    import json

    assert json.loads(json.dumps(d)) == d
    with pytest.raises(InvalidInputError, match="grouping must be one of"):
        m.per_rank("thread")


def test_missing_rank_is_reported() -> None:
    m = merge_ranks([random_rank(r, 4, 300, r) for r in (0, 1, 3)])
    assert m.missing == [2] and not m.complete
    assert m.to_dict()["complete"] is False


def test_cut_short_rank_is_marked() -> None:
    t1 = random_rank(1, 2, 300, 1)
    t1.metadata["cut_short"] = "the run ended abruptly"
    m = merge_ranks([random_rank(0, 2, 300, 0), t1])
    assert m.cut_short == [1] and not m.complete and m.missing == []


def test_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="expected an integer 'rank'"):
        merge_ranks([Trace({"world_size": 2})], names=["x.tmtrace"])
    with pytest.raises(InvalidInputError, match="expected an integer 'world_size'"):
        merge_ranks([Trace({"rank": 0})])
    with pytest.raises(InvalidInputError, match="0 <= rank < world_size"):
        merge_ranks([Trace({"rank": 2, "world_size": 2})])
    with pytest.raises(InvalidInputError, match="0 <= rank < world_size"):
        merge_ranks([Trace({"rank": 0, "world_size": 0})])
    with pytest.raises(InvalidInputError, match="not from the same job"):
        merge_ranks([random_rank(0, 2, 50, 0), random_rank(1, 2, 50, 0, job="other")])
    with pytest.raises(InvalidInputError, match="not from the same job"):
        merge_ranks([random_rank(0, 2, 50, 0), random_rank(1, 4, 50, 0)])
    with pytest.raises(InvalidInputError, match="rank 1 is given twice"):
        merge_ranks([random_rank(1, 2, 50, 0), random_rank(1, 2, 50, 1)], names=["a", "b"])
    with pytest.raises(InvalidInputError, match="at least one rank trace"):
        merge_ranks([])
    with pytest.raises(InvalidInputError, match="top must be"):
        merge_ranks([random_rank(0, 1, 50, 0)], top=0)


def test_one_rank_and_empty_traces() -> None:
    m = merge_ranks([Trace({"rank": 0, "world_size": 1})])
    assert m.complete and m.difference is None and m.imbalance is None
    assert m.ranks[0].device is None and m.ranks[0].peak == 0


def _phased_rank(rank: int, peak_phase: P) -> Trace:
    """A rank whose peak is the 900 B allocation in ``peak_phase`` at step 1 (a 100 B
    forward activation stays; a 50 B temporary before it is freed)."""
    tr = Trace({"rank": rank, "world_size": 2, "job_id": "moments"})
    tr.append(K.MARK, 0, "cpu", 0, 0, op="step", step=0)
    tr.append(K.ALLOC, 1, "cpu", 100, 1, op="aten::relu", module="Net.l0",
              category=C.ACTIVATION, phase=P.FORWARD, step=1)
    tr.append(K.ALLOC, 2, "cpu", 50, 2, op="aten::add", phase=P.FORWARD, step=1)
    tr.append(K.FREE, 3, "cpu", 50, 2, step=1)
    tr.append(K.ALLOC, 4, "cpu", 900 + rank, 3, op="aten::mm", module="Net.l1",
              category=C.TEMPORARY, phase=peak_phase, step=1)
    tr.append(K.FREE, 5, "cpu", 900 + rank, 3, step=1)
    return tr


def test_where_each_rank_peaked_and_whether_the_moments_differ() -> None:
    import io

    from torchmem.render.ranks import merge_json, render_merge

    same = merge_ranks([_phased_rank(0, P.BACKWARD), _phased_rank(1, P.BACKWARD)])
    assert [(r.peak, r.peak_phase, r.peak_step, r.peak_op, r.peak_module) for r in same.ranks] \
        == [(1000, "backward", 1, "aten::mm", "Net.l1"), (1001, "backward", 1, "aten::mm", "Net.l1")]
    assert same.ranks[0].peak_at == "backward, step 1, aten::mm in Net.l1"
    assert same.difference is not None and not same.difference.different_moments

    moved = merge_ranks([_phased_rank(0, P.OPTIMIZER), _phased_rank(1, P.BACKWARD)])
    d = moved.difference
    assert d is not None and d.different_moments and (d.heavy_rank, d.light_rank) == (1, 0)
    assert (d.heavy_at, d.light_at) == ("backward, step 1, aten::mm in Net.l1",
                                        "optimizer, step 1, aten::mm in Net.l1")
    buf = io.StringIO()
    render_merge(moved, buf)
    text = buf.getvalue()
    assert "the two peaks are at different moments (rank 1: backward, step 1" in text
    assert "optimizer, step 1, aten::mm in Net.l1" in text     # the ranks table's "peak at"
    buf = io.StringIO()
    render_merge(same, buf)
    assert "different moments" not in buf.getvalue()
    import json
    data = json.loads(merge_json(moved))
    assert [r["peak_phase"] for r in data["ranks"]] == ["optimizer", "backward"]
    assert data["difference"]["different_moments"] is True
