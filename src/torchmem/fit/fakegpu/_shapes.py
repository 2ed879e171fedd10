"""Data-dependent shapes in an estimate: a documented size rule instead of an error.

``nonzero``, ``torch.where(mask)``, ``masked_select``, boolean-mask indexing (``x[mask]``,
``x[mask] = v``) and ``unique`` make outputs whose size depends on tensor values, which fake
tensors do not have. While an estimate runs, :class:`DataDependentShapes` gives each such
output a size by rule, and lists every assumption with the value reads
(``Estimate.assumed_values``: where, the operator, the size assumed):

====================================================  =========================================
the operator                                          size assumed
====================================================  =========================================
``nonzero`` / ``where(mask)`` / ``masked_select`` /   every element selected (an upper bound;
``x[mask]`` of a mask                                 masks are all ones, as the value policy
                                                      of :mod:`torchmem.fit.fakegpu._values` assumes)
the same on a mask made from ``one_hot(i, E)`` of     ``routing="balanced"`` (default): each of
``k`` choices per token (mixture-of-experts           the ``E`` experts gets its share,
routing: ``torch.where(expert_mask[e])``)             ``numel / E``; ``routing="worst"``: every
                                                      token picks this expert, ``numel / k``
``unique`` / ``unique_consecutive``                   every element distinct (an upper bound)
``x[mask] = scalar``                                  no index list (CUDA fills in place)
====================================================  =========================================

A ``one_hot`` mask is recognised by how PyTorch computes it on fake tensors
(``index.unsqueeze(-1) == arange(E)``), and followed through copies, views and indexing.
``strict=True`` (the estimate's ``strict_values``) refuses these operators instead.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> from torchmem.fit.fakegpu._values import ValueReads
    >>> shapes = DataDependentShapes(ValueReads())
    >>> with FakeTensorMode():
    ...     m = torch.empty(4, 6, dtype=torch.bool)
    ...     tuple(shapes.run(torch.ops.aten.nonzero.default, (m,), {}).shape)
    (24, 2)
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu._placement import _tensors
from torchmem.fit.fakegpu._values import ValueReads, _has_value

__all__ = ["DataDependentShapes", "ROUTINGS"]

_aten = torch.ops.aten
#: the routing rules for masks made by ``one_hot``
ROUTINGS = ("balanced", "worst")

_NONZERO = {_aten.nonzero.default}
_MASKED_SELECT = {_aten.masked_select.default}
_INDEX = {_aten.index.Tensor}
_INDEX_PUT = {_aten.index_put_.default, _aten.index_put.default}
_UNIQUE = {
    getattr(_aten, n).default for n in ("_unique2", "_unique", "unique_consecutive")
    if hasattr(_aten, n)
}
_UNIQUE_DIM = {_aten.unique_dim.default} if hasattr(_aten, "unique_dim") else set()
#: histc of an integer tensor: CUDA's kernel takes it (mixture-of-experts token counts per
#: expert), the CPU meta check the fake run would use refuses it; its shape is (bins,) anyway
_HISTC = {_aten.histc.default}
HANDLED = _NONZERO | _MASKED_SELECT | _INDEX | _INDEX_PUT | _UNIQUE | _UNIQUE_DIM | _HISTC
#: operators whose output keeps a one-hot mask's provenance
_FOLLOW = {getattr(getattr(_aten, n), o) for n, o in (
    ("_to_copy", "default"), ("clone", "default"), ("index", "Tensor"), ("squeeze", "dim"),
    ("squeeze", "default"), ("squeeze", "dims"), ("select", "int"), ("permute", "default"),
    ("transpose", "int"), ("view", "default"), ("unsqueeze", "default"), ("expand", "default"),
    ("slice", "Tensor"), ("alias", "default"), ("_unsafe_view", "default"),
) if hasattr(_aten, n) and hasattr(getattr(_aten, n), o)}


def _values_known(args: Any) -> bool:
    """True when the tensors an operator reads have values (real tensors, or fake ones that
    carry their constant): nothing to assume."""
    tensors = _tensors(args, None)
    return bool(tensors) and all(_has_value(t) for t in tensors)


def check_routing(routing: Any) -> str:
    """Validate a routing rule name.

    Example:
        >>> check_routing("worst")
        'worst'
    """
    if routing not in ROUTINGS:
        raise InvalidInputError(
            f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}; 'balanced' gives "
            "each expert its share of the tokens, 'worst' routes every token to each expert"
        )
    return str(routing)


class DataDependentShapes:
    """The size rules of one estimate (see the module docstring); assumptions are recorded in
    ``values`` (a :class:`~torchmem.fit.fakegpu._values.ValueReads`).

    Example:
        >>> DataDependentShapes(ValueReads(), routing="worst").routing
        'worst'
    """

    def __init__(self, values: ValueReads, routing: str = "balanced") -> None:
        self.values = values
        self.routing = check_routing(routing)
        # id(tensor) -> (weakref, classes E, choices k) for one-hot masks (and their copies)
        self._onehot: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._arange: dict[int, weakref.ref[torch.Tensor]] = {}

    # -- provenance ------------------------------------------------------------------------------

    def _mark(self, t: torch.Tensor, classes: int, k: int) -> None:
        table = self._onehot
        key = id(t)
        table[key] = (weakref.ref(t, lambda _: table.pop(key, None)), classes, k)

    def _classes(self, t: torch.Tensor) -> tuple[int, int] | None:
        hit = self._onehot.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1], hit[2]
        return None

    def note_output(self, func: Any, args: Any, out: Any) -> None:
        """Follow one-hot masks: ``unsqueeze(-1) == arange(E)`` makes one; copies, views and
        indexing of one keep it.

        Example:
            >>> DataDependentShapes(ValueReads()).note_output(torch.ops.aten.add.Tensor, (), None)
        """
        if not isinstance(out, torch.Tensor):
            return
        if func is _aten.arange.default:
            table = self._arange
            key = id(out)
            table[key] = weakref.ref(out, lambda _: table.pop(key, None))
            return
        if func is _aten.eq.Tensor and len(args) == 2:
            a, b = args
            ref = self._arange.get(id(b)) if isinstance(b, torch.Tensor) else None
            if ref is None or ref() is not b or not isinstance(a, torch.Tensor):
                return
            if isinstance(b, torch.Tensor) and b.dim() == 1 and a.dim() >= 1 and \
                    a.shape[-1] == 1:
                k = a.shape[-2] if a.dim() >= 2 else 1
                self._mark(out, b.numel(), max(1, k))
            return
        if func in _FOLLOW and args and isinstance(args[0], torch.Tensor):
            hit = self._classes(args[0])
            if hit is not None:
                self._mark(out, *hit)

    # -- the rules -------------------------------------------------------------------------------

    def _selected(self, mask: torch.Tensor, n: int | None = None) -> tuple[int, str]:
        """How many elements of ``mask`` (``n`` of them) are taken as true, and why."""
        n = mask.numel() if n is None else n
        hit = self._classes(mask)
        if hit is None:
            return n, "every element selected"
        classes, k = hit
        if self.routing == "balanced":
            return math.ceil(n / classes), f"routing balanced over {classes} experts"
        return math.ceil(n / k), f"routing worst case (every token to this expert, top-{k})"

    def _record(self, func: Any, count: int, of: int, why: str) -> None:
        self.values.record(str(func), f"{count} of {of} ({why})")

    def _nonzero(self, func: Any, mask: torch.Tensor) -> torch.Tensor:
        count, why = self._selected(mask)
        self._record(func, count, mask.numel(), why)
        return mask.new_empty((count, mask.dim()), dtype=torch.long)

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The output of ``func`` by rule, or ``NotImplemented`` when its shape does not
        depend on values (``x[long_index]``).

        Example:
            >>> DataDependentShapes(ValueReads()).run(torch.ops.aten.add.Tensor, (), {})
            NotImplemented
        """
        if _values_known(args):  # real tensors (a device mesh's ranks): PyTorch computes it
            return NotImplemented
        if func in _NONZERO:
            return self._nonzero(func, args[0])
        if func in _MASKED_SELECT:
            x, mask = args[0], args[1]
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            count, why = self._selected(mask, math.prod(shape))
            self._record(func, count, math.prod(shape), why)
            return x.new_empty((count,))
        if func in _INDEX or func in _INDEX_PUT:
            return self._index(func, args, kwargs)
        if func in _UNIQUE or func in _UNIQUE_DIM:
            return self._unique(func, args, kwargs)
        if func in _HISTC and not (args[0].dtype.is_floating_point or args[0].dtype.is_complex):
            bins = (kwargs or {}).get("bins", args[1] if len(args) > 1 else 100)
            return args[0].new_empty((int(bins),))
        return NotImplemented

    def _index(self, func: Any, args: Any, kwargs: Any) -> Any:
        x, indices = args[0], list(args[1])
        if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices):
            return NotImplemented
        rest = tuple(args[2:])
        if func in _INDEX_PUT and len(indices) == 1 and rest and isinstance(rest[0], torch.Tensor) \
                and rest[0].numel() == 1:
            # x[mask] = scalar: index_put_ fills in place with the mask, no index list
            self.values.record(str(func), "masked fill (no index list)")
            out = x.masked_fill_(indices[0], rest[0]) if func is _aten.index_put_.default \
                else x.masked_fill(indices[0], rest[0])
            return out
        longs: list[Any] = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                nz = self._nonzero(_aten.nonzero.default, i)
                longs.extend(nz.select(1, d) for d in range(i.dim()))
            else:
                longs.append(i)
        return func(x, longs, *rest, **(kwargs or {}))

    def _unique(self, func: Any, args: Any, kwargs: Any) -> Any:
        x = args[0]
        kw = dict(kwargs or {})
        n = x.numel()
        self._record(func, n, n, "every element distinct")
        values = x.new_empty((n,)) if func not in _UNIQUE_DIM else x.new_empty(x.shape)
        empty = x.new_empty((0,), dtype=torch.long)
        if func is _aten._unique2.default:
            inverse = kw.get("return_inverse", args[2] if len(args) > 2 else False)
            counts = kw.get("return_counts", args[3] if len(args) > 3 else False)
            return (values, x.new_empty(x.shape, dtype=torch.long) if inverse else empty,
                    x.new_empty((n,), dtype=torch.long) if counts else empty)
        if func is _aten._unique.default:
            inverse = kw.get("return_inverse", args[2] if len(args) > 2 else False)
            return values, x.new_empty(x.shape, dtype=torch.long) if inverse else empty
        # unique_consecutive / unique_dim: (values, inverse, counts)
        inverse = kw.get("return_inverse", args[1] if len(args) > 1 else False)
        counts = kw.get("return_counts", args[2] if len(args) > 2 else False)
        return (values, x.new_empty(x.shape[:1] if func in _UNIQUE_DIM else x.shape,
                                    dtype=torch.long) if inverse else empty,
                x.new_empty((values.shape[0],), dtype=torch.long) if counts else empty)
