"""The one nested-container walker: names, containers pytree knows, no mutation."""

from __future__ import annotations

from collections import OrderedDict, deque, namedtuple

import torch

from torchmem._containers import replace_tensors, tensors_with_paths

Pair = namedtuple("Pair", ["first", "second"])


def test_paths_name_sequences_mappings_and_named_tuples() -> None:
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    value = {"x": [a, (b, 3)], "y": OrderedDict(z=c), "p": Pair(d, "s"), "n": None}
    names = [n for n, _ in tensors_with_paths(value, "s")]
    assert names == ["s.x[0]", "s.x[1][0]", "s.y.z", "s.p.first"]
    assert [t for _, t in tensors_with_paths(value)] == [a, b, c, d]
    assert list(tensors_with_paths(a, "t")) == [("t", a)]
    assert list(tensors_with_paths("no tensors", "t")) == []


def test_replace_keeps_types_and_never_mutates() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    value = {"q": deque([a, 1]), "p": Pair(b, [a])}
    new = replace_tensors(value, lambda t: t + 10 if t is a else None)
    assert isinstance(new["q"], deque) and isinstance(new["p"], Pair)
    assert new["q"][0].item() == 10.0 and new["q"][1] == 1 and new["p"].first is b
    assert value["q"][0] is a and value["p"].second[0] is a  # originals untouched
    assert replace_tensors(value, lambda t: None) is value


def test_iter_tensors_finds_what_pytree_finds_in_the_same_order() -> None:
    """The tracker's fast walk against pytree's leaves (ground truth), on tuples, lists, dicts."""
    from torch.utils import _pytree as pytree

    from torchmem._containers import iter_items, iter_tensors

    a, b, c, d = (torch.full((i + 1,), float(i)) for i in range(4))
    values = [
        a,
        (a, b, c),
        [a, None, (b, [c, {"x": d, "y": 3}]), "s"],
        {"k": (a, b), "j": [c], "n": None},
        (),
        7,
    ]
    for v in values:
        truth = [x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]
        got = list(iter_tensors(v))
        assert [id(t) for t in got] == [id(t) for t in truth]
        if isinstance(v, (tuple, list)):
            assert [id(t) for t in iter_items(v)] == [id(t) for t in truth]
    # a; (a, b, c); [a, b, c, d]; {k: (a, b), j: [c]}: 1 + 6 + 10 + 6 elements
    assert sum(t.numel() for t in iter_tensors(values)) == 23
