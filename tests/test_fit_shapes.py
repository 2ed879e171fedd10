"""Data-dependent shapes under the estimate (issue 24): a documented size, listed, not an error.

Ground truth is the same step written with the assumed sizes fixed by hand (a static layout that
allocates what the rule says), estimated the ordinary way.
"""

from __future__ import annotations

import pytest
import torch

import torchmem
from torchmem.errors import InvalidInputError

T, E, K, D = 256, 8, 2, 64   # tokens, experts, experts per token, width


def _experts():
    return torch.nn.ModuleList(torch.nn.Linear(D, D, device="cuda") for _ in range(E))


def _moe(tokens_of):
    """A mixture-of-experts step: one_hot of the top-k choices, then ``tokens_of(mask[e])``
    picks each expert's tokens."""
    def build(batch):
        x = torch.randn(T, D, device="cuda", requires_grad=True)
        router = torch.nn.Linear(D, E, device="cuda")
        experts = torch.nn.ModuleList(torch.nn.Linear(D, D, device="cuda") for _ in range(E))

        def step():
            _, chosen = torch.topk(router(x), K, dim=-1)
            mask = torch.nn.functional.one_hot(chosen, num_classes=E).permute(2, 1, 0)
            out = torch.zeros_like(x)
            for e in range(E):
                tok = tokens_of(mask[e])
                out = out.index_add(0, tok, experts[e](x[tok]))
            out.sum().backward()
        return step
    return build


def _where(expert_mask):
    """As transformers' Mixtral wrote it (4.x): data-dependent, which tokens go where."""
    _, tok = torch.where(expert_mask)
    return tok


routed = _moe(_where)


def static(per_expert: int):
    """The same step with ``per_expert`` tokens per expert fixed by hand: the index list a
    ``where`` of that many hits makes ((n, 2) int64, a column view), no routing."""
    return _moe(lambda _: torch.zeros(per_expert, 2, dtype=torch.long, device="cuda").select(1, 1))


@pytest.mark.parametrize("routing,per_expert", [("balanced", T * K // E), ("worst", T)])
def test_routing_rule_equals_the_static_layout(routing, per_expert):
    e = torchmem.estimate(routed, gpu="T4", steps=1, margin=0, routing=routing)
    ref = torchmem.estimate(static(per_expert), gpu="T4", steps=1, margin=0)
    assert (e.peak_requested_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes) == \
        (ref.peak_requested_bytes, ref.peak_allocated_bytes, ref.peak_reserved_bytes)
    rules = [a for a in e.assumed_values if a["op"] == "aten.nonzero.default"]
    assert len(rules) == 1 and rules[0]["count"] == E
    why = f"over {E} experts" if routing == "balanced" else f"top-{K}"
    assert rules[0]["value"].startswith(f"{per_expert} of {K * T} (") and why in rules[0]["value"]
    assert rules[0]["where"].endswith(f"test_fit_shapes.py:{_line('_, tok = torch.where')}")


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_masks_select_everything_and_unique_is_all_distinct():
    n = 64 * 1024
    seen = {}

    def build(batch):
        x = torch.randn(n, device="cuda")

        def step():
            m = x > 0
            seen["nonzero"] = tuple(m.nonzero().shape)
            seen["index"] = tuple(x[m].shape)
            seen["select"] = tuple(torch.masked_select(x, m).shape)
            seen["unique"] = tuple(torch.unique(x).shape)
            vals, inv, cnt = torch.unique(x, return_inverse=True, return_counts=True)
            seen["unique3"] = (tuple(vals.shape), tuple(inv.shape), tuple(cnt.shape))
            y = x.clone()
            y[m] = 0.0                                  # a masked fill: no index list
            seen["fill"] = tuple(y.shape)
        return step

    e = torchmem.estimate(build, gpu="T4", steps=1, margin=0)
    assert seen == {"nonzero": (n, 1), "index": (n,), "select": (n,), "unique": (n,),
                    "unique3": ((n,), (n,), (n,)), "fill": (n,)}
    ops = {a["op"] for a in e.assumed_values}
    assert {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
            "aten.index_put_.default"} <= ops
    with pytest.raises(InvalidInputError, match="nonzero"):
        torchmem.estimate(build, gpu="T4", steps=1, strict_values=True)
    with pytest.raises(InvalidInputError, match="routing must be one of balanced, worst"):
        torchmem.estimate(build, gpu="T4", steps=1, routing="even")
