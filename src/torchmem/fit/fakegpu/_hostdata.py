"""Host data under an estimate: tensors made from it, and what is computed from them alone, are real.

Data preparation (tokenizing a corpus into ``torch.tensor(ids)`` per line, ``torch.cat``, slicing
batches, collating) touches only the host and decides nothing about the GPU but through the shapes
it produces. Run under fake tensors, every one of those calls goes through the fake mode, the
tracker and the value shadows, 20 times slower than the plain run. So while an estimate runs (the
rule is applied by :class:`~torchmem.fit.fakegpu._env._CudaToCpu`):

- a tensor made from host data (:data:`_FROM_DATA`: ``torch.tensor``, ``torch.as_tensor``,
  ``torch.asarray``, ``torch.from_numpy``, ``torch.frombuffer``) with no device named is real;
- a call whose tensor inputs are all real host tensors without gradients (and which names no
  GPU) runs for real, outside the fake mode and the tracker, and gives real tensors;
- an integer draw on the host (:data:`_DRAWS`: ``torch.randint``, ``torch.randperm``) of at
  most :data:`_DRAW_MAX` elements with no device named is real: the batch indices a script
  slices its data with (nanoGPT's ``get_batch``: ``for i in torch.randint(...)``), which as
  fake tensors made every ``i + 1`` and ``data[i:j]`` an operator of the fake mode;
- each new storage such a call makes is host memory in the estimate from then until it is freed
  (:meth:`Placement.on_real_host <torchmem.fit.fakegpu._placement.Placement>`);
- a real tensor becomes fake where the run moves it to the GPU or mixes it with fake tensors.

Example:
    >>> _host_data([[1, 2], [3, 4]]), _host_data(torch.ones(2)), _host_data([torch.ones(2)])
    (True, True, True)
"""

from __future__ import annotations

from threading import get_ident, main_thread
from typing import Any

import torch

from torchmem.fit.fakegpu._placement import Placement, _tensors

#: functions that make a tensor from host data (Python lists and numbers, NumPy arrays, buffers)
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy,
                        torch.frombuffer})
#: how many elements of a nested list :func:`_host_data` looks through for tensors before it
#: gives up (the fake path then takes the call)
_DATA_SCAN = 100_000
_SCALARS = frozenset({int, float, bool, complex, str, bytes, type(None)})
#: integer draws made real on the host (batch indices, shuffles), up to _DRAW_MAX elements
_DRAWS = frozenset({torch.randint, torch.randperm})
_DRAW_MAX = 1 << 20
#: what a call on one real host tensor may take besides it and take :func:`_fast_inputs`
#: (none of them names a device: a device is a string or a ``torch.device``, and the copies that
#: read an index as one, ``.to(0)`` and ``.cuda(0)``, never take the fast path)
_PLAIN_ARGS = frozenset({torch.dtype, int, float, bool, slice, type(None), type(Ellipsis)})
_MAIN = main_thread().ident
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction()  # entered and left by the main thread


def _fast_inputs(func: Any, args: tuple[Any, ...]) -> list[torch.Tensor] | None:
    """:func:`_on_host_data`'s answer, found at once for the two calls data preparation makes
    most (a call without keyword arguments that is neither a copy nor a special function of the
    fake CUDA): ``torch.tensor(ids)`` on a flat list of numbers, and a call on one real host
    tensor with plain arguments (``x.type(torch.int64)``, ``x[i:j]``, ``x.view(-1, 35)``); None
    where the general path decides.

    Example:
        >>> _fast_inputs(torch.tensor, ([1, 2, 3],)), len(_fast_inputs(torch.Tensor.view, (torch.ones(4), 2, 2)))
        ([], 1)
        >>> _fast_inputs(torch.Tensor.view, (torch.ones(4, requires_grad=True), 2, 2)) is None
        True
    """
    if func is torch.tensor:
        if len(args) == 1:
            data = args[0]
            if (type(data) is list and len(data) <= _DATA_SCAN
                    and _SCALARS.issuperset(map(type, data))):
                return []
        return None
    if not args:
        return None
    t = args[0]
    if type(t) is not torch.Tensor or t.requires_grad or not t.is_cpu:
        return None
    if len(args) > 1 and not _PLAIN_ARGS.issuperset(map(type, args[1:])):
        return None
    return [t]


def _real_host(t: torch.Tensor) -> bool:
    """``t`` is a real host tensor without gradients (not fake, not a subclass, not meta)."""
    # is_cpu, not device.type: the placement's ``device`` property is Python, 6x slower
    return type(t) is torch.Tensor and not t.requires_grad and t.is_cpu


def _host_data(x: Any) -> bool:
    """``x`` holds no tensor but real host ones (so a tensor made from it can be real): a
    number, a NumPy array, a buffer, a real CPU tensor, or lists and tuples of them (up to
    ``_DATA_SCAN`` elements are looked at).

    Example:
        >>> _host_data([[1, 2], [3, 4]]), _host_data(torch.ones(2)), _host_data([torch.ones(2)])
        (True, True, True)
        >>> _host_data(torch.ones(2, device="meta"))
        False
    """
    if type(x) is list and len(x) <= _DATA_SCAN and _SCALARS.issuperset(map(type, x)):
        return True  # a flat list of numbers (token ids): the common case, one pass in C
    budget = _DATA_SCAN
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, torch.Tensor):
            if not _real_host(y):
                return False
        elif isinstance(y, (list, tuple)):
            budget -= len(y)
            if budget < 0:
                return False
            if not _SCALARS.issuperset(map(type, y)):  # token ids: one pass in C
                stack.extend(z for z in y if isinstance(z, (list, tuple, torch.Tensor)))
    return True


def _on_host_data(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor] | None:
    """The tensor inputs of ``func(*args, **kwargs)`` (no device named) when it works on host
    data only, so it runs for real, else None: a tensor made from host data
    (``torch.tensor(ids)``, ``torch.from_numpy``), or an operator whose tensor inputs are all
    real host tensors without gradients (what data preparation does with them:
    ``.type(torch.int64)``, ``torch.cat``, slicing, collating)."""
    if kwargs and (kwargs.get("requires_grad") or kwargs.get("out") is not None):
        return None
    if func in _FROM_DATA:
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        if not _host_data(data):
            return None
        return [data] if isinstance(data, torch.Tensor) else []
    if func in _DRAWS:
        n = _draw_size(func, args, kwargs)
        return [] if n is not None and n <= _DRAW_MAX else None
    tensors = _tensors(args, kwargs)
    return tensors if tensors and all(map(_real_host, tensors)) else None


def _draw_size(func: Any, args: Any, kwargs: Any) -> int | None:
    """The elements ``torch.randint(...)`` or ``torch.randperm(n)`` makes (None: unknown).

    Example:
        >>> _draw_size(torch.randint, (100, (12,)), {}), _draw_size(torch.randperm, (5,), {})
        (12, 5)
        >>> _draw_size(torch.randint, (0, 9), {"size": (2, 3)})
        6
    """
    if func is torch.randperm:
        n = args[0] if args else kwargs.get("n")
        return n if type(n) is int else None
    size = kwargs.get("size")
    if size is None:
        size = next((a for a in args if isinstance(a, (tuple, list, torch.Size))), None)
    if size is None or not all(type(d) is int for d in size):
        return None
    total = 1
    for d in size:
        total *= d
    return total


def _real_on_host(pl: Placement, func: Any, args: Any, kwargs: Any,
                  inputs: list[torch.Tensor]) -> Any:
    """``func`` run for real, outside the fake mode and the tracker (host data preparation at
    the speed of a plain run); each new host storage it makes (not one of ``inputs``') is
    counted as host memory."""
    # no torch-function mode, no dispatch mode (the fake mode, the tracker): plain PyTorch.
    # The main thread reuses one torch-function guard (nothing inside can come back here:
    # both kinds of mode are off); the dispatch guard is one that acts when it is made.
    with (_NO_TORCH_FUNCTION if get_ident() == _MAIN else torch._C.DisableTorchFunction()), \
            torch._C._DisableTorchDispatch():
        out = func(*args, **kwargs)
        adopt = pl.on_real_host
        assert adopt is not None
        if type(out) is torch.Tensor:  # the common case: one plain tensor
            for t in inputs:
                if out is t:  # x.type(its own dtype), x.to(x.dtype)
                    return out
            if out.layout is not torch.strided:
                return out
            st = out.untyped_storage()
            if inputs:
                cdata = st._cdata
                for t in inputs:
                    if t.untyped_storage()._cdata == cdata:  # a view of an input
                        return out
            adopt(st)
            return out
        if not isinstance(out, (tuple, list)):
            return out
        known = {t.untyped_storage()._cdata for t in inputs}
        for t in out:
            if type(t) is torch.Tensor and t.layout is torch.strided:
                st = t.untyped_storage()
                if st._cdata not in known:
                    known.add(st._cdata)
                    adopt(st)
    return out
