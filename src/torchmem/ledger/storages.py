"""The storages behind what a user hands the ledger: tensors, modules, optimizers, containers.

The ledger counts storages, not tensors. :func:`storages_of` lists the ``UntypedStorage``
objects behind an object -- a tensor (sparse and nested layouts through their component
tensors), an ``nn.Module`` (parameters, their gradients and buffers), an optimizer (its state),
or lists, tuples, sets and dicts of these, nested -- each with the device it stands for when that
is not the storage's own (a fake tensor's meta storage standing for ``cuda:1``).

Example:
    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> [(st.nbytes(), dev) for st, dev in storages_of({"model": m, "step": 3})]
    [(16, None), (8, None)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from torchmem.errors import InvalidInputError, UnsupportedTensorError

__all__ = ["storages_of", "describe"]

Pair = tuple[torch.UntypedStorage, Optional[str]]  # a storage and its device if not its own


def describe(obj: Any) -> str:
    """A short description of what was counted, for debug logs.

    Example:
        >>> import torch
        >>> describe(torch.zeros(2, 3)), describe([1])
        ('tensor (2, 3) torch.float32 on cpu', 'list')
    """
    if isinstance(obj, torch.Tensor):
        return f"tensor {tuple(obj.shape)} {obj.dtype} on {obj.device}"
    return type(obj).__name__


def _tensor_storages(t: torch.Tensor, out: list[Pair]) -> None:
    layout = t.layout
    if layout is torch.strided or layout is torch.jagged:
        # nested tensors: their storage is the packed data buffer, which is what they hold
        try:
            st = t.untyped_storage()
            dev = t.device
            out.append((st, None if st.device == dev else str(dev)))
        except (RuntimeError, NotImplementedError) as e:
            raise UnsupportedTensorError(
                f"a {type(t).__name__} without a storage cannot be counted ({e}); allocate the "
                "tensors it wraps instead"
            ) from None
    elif layout is torch.sparse_coo:
        _tensor_storages(t._indices(), out)
        _tensor_storages(t._values(), out)
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        for part in (t.crow_indices(), t.col_indices(), t.values()):
            _tensor_storages(part, out)
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        for part in (t.ccol_indices(), t.row_indices(), t.values()):
            _tensor_storages(part, out)
    else:
        raise UnsupportedTensorError(f"tensor layout {layout} is not supported by the ledger")


def storages_of(obj: Any) -> list[Pair]:
    """``(storage, device or None)`` for every storage behind ``obj``, in the order walked.

    Raises :class:`~torchmem.errors.InvalidInputError` for anything else (and
    :class:`~torchmem.errors.UnsupportedTensorError` for a tensor without a storage).

    Example:
        >>> import torch
        >>> x = torch.zeros(4)
        >>> [st.nbytes() for st, _ in storages_of([x, (x[1:],)])]
        [16, 16]
    """
    if type(obj) is torch.Tensor:
        try:
            return [(obj.untyped_storage(), None)]  # fast path: a plain strided (or nested) tensor
        except (RuntimeError, NotImplementedError):
            pass  # sparse layouts: counted through their component tensors below
    out: list[Pair] = []
    _gather(obj, out, 0)
    return out


def _gather(obj: Any, out: list[Pair], depth: int) -> None:
    # Not torchmem._containers: this walk is the ledger's input contract (modules, optimizers and
    # sets count, nesting is bounded, anything else is refused by name), not a container walk.
    if depth > 64:
        raise InvalidInputError(
            "expected objects nested at most 64 levels deep, got deeper nesting (a cycle?); "
            "pass the tensors, modules or optimizers themselves"
        )
    if isinstance(obj, torch.Tensor):
        _tensor_storages(obj, out)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            _tensor_storages(p, out)
            if p.grad is not None:
                _tensor_storages(p.grad, out)
        for b in obj.buffers():
            _tensor_storages(b, out)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            _gather(state, out, depth + 1)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            if v is not None:
                _gather(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            if v is not None:
                _gather(v, out, depth + 1)
    elif depth > 0 and isinstance(obj, (int, float, bool, str)):
        return  # e.g. an optimizer's "step" counter
    else:
        raise InvalidInputError(
            "Ledger.allocate/free expected a tensor, an nn.Module, an optimizer, or a "
            f"list/tuple/dict of them, got {type(obj).__module__}.{type(obj).__name__}"
        )
