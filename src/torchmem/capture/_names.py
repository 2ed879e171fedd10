"""What both trackers (``mode="ops"`` and ``mode="fast"``) share: module names as users know
them from ``named_modules()``, the checks of ``track()``'s arguments and the initial state of
the modules and optimizers passed in.

Example:
    >>> import torch
    >>> from torchmem.capture._names import _path_below
    >>> net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(1, 1)]))
    >>> _path_below(net, net[0][0], "Net")
    'Net.0.0'
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from typing import Any

import torch

from torchmem.errors import InvalidInputError
from torchmem.model.events import Category

__all__: list[str] = []


def _path_below(parent: torch.nn.Module, m: torch.nn.Module, pname: str) -> str:
    """``m``'s qualified name under ``parent`` (``"Net.h.0"``), as ``named_modules()`` gives it.

    A direct child is found at once; a module reached through a container that is never called
    itself (the blocks of a ``ModuleList`` or ``ModuleDict``) is found in the parent's subtree,
    so each layer keeps its index. A module that is not below ``parent`` (called from a
    parent's forward without being registered in it) is named by its type under the parent.
    """
    for attr, child in parent._modules.items():
        if child is m:
            return f"{pname}.{attr}"
    for qualified, sub in parent.named_modules():
        if sub is m and qualified:
            return f"{pname}.{qualified}"
    return f"{pname}.{type(m).__name__}"


def uncalled_below(m: torch.nn.Module, pname: str, named: Callable[[torch.nn.Module], bool]
                   ) -> Iterator[tuple[torch.nn.Module, str]]:
    """The submodules of ``m`` (named ``pname``) that ``named`` does not know, depth first,
    with their qualified names: what ``m``'s forward did not call (``nn.MultiheadAttention``
    reads ``out_proj.weight`` itself), for the trackers to name on ``m``'s first return.

    Example:
        >>> import torch
        >>> mha = torch.nn.MultiheadAttention(4, 1)
        >>> [n for _, n in uncalled_below(mha, "MHA", lambda m: False)]
        ['MHA.out_proj']
    """
    for attr, child in m._modules.items():
        if child is None or named(child):
            continue
        name = f"{pname}.{attr}"
        yield child, name
        yield from uncalled_below(child, name, named)


def name_uncalled(m: torch.nn.Module, names: Any, trace: Any
                  ) -> Iterator[tuple[torch.nn.Module, int]]:
    """Name in ``names`` (module -> interned name index in ``trace``) the submodules of ``m``
    its forward did not call (:func:`uncalled_below`), yielding each with its new index; nothing
    when ``m`` itself has no name. The trackers then mark the children's tensors their way.

    Example:
        >>> import torch
        >>> from torchmem.model.trace import Trace
        >>> mha, trace = torch.nn.MultiheadAttention(4, 1), Trace()
        >>> names = {mha: trace.intern("MHA")}
        >>> [trace.strings[i] for _, i in name_uncalled(mha, names, trace)]
        ['MHA.out_proj']
    """
    pidx = names.get(m)
    if pidx is None:
        return
    for child, name in uncalled_below(m, trace.strings[pidx], lambda c: names.get(c) is not None):
        idx = names[child] = trace.intern(name)
        yield child, idx


def check_track_args(
    targets: tuple[Any, ...], step_marker: str, path: Any
) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """Check ``track()``'s shared arguments; returns the modules and optimizers passed in.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1)
        >>> mods, opts = check_track_args((lin,), "optimizer", None)
        >>> mods == [lin], opts
        (True, [])
    """
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder):
            raise InvalidInputError(
                f"path {os.fspath(path)!r} cannot be written: expected a file path in an "
                "existing folder; create the folder or pass another path"
            )
    if step_marker not in ("optimizer", "manual"):
        raise InvalidInputError(
            f"step_marker must be 'optimizer' or 'manual', got {step_marker!r}; use 'manual' "
            "and call tracker.step() yourself when optimizer.step() is not your iteration"
        )
    modules: list[torch.nn.Module] = []
    optims: list[torch.optim.Optimizer] = []
    for i, t in enumerate(targets):
        if isinstance(t, torch.nn.Module):
            modules.append(t)
        elif isinstance(t, torch.optim.Optimizer):
            optims.append(t)
        else:
            raise InvalidInputError(
                f"track() argument {i} must be a torch.nn.Module or torch.optim.Optimizer, "
                f"got {type(t).__name__}; pass tensors' owners, or nothing to track all ops"
            )
    return modules, optims


def initial_state(
    modules: list[torch.nn.Module], optims: list[torch.optim.Optimizer], names: Any
) -> list[tuple[torch.Tensor, Category, int]]:
    """``(tensor, category, module name index)`` for the state of the objects passed to
    ``track()``: parameters and buffers (named by ``names[module]``), their gradients, and the
    optimizers' parameters, gradients and state (module 0).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1)
        >>> [(c.label, m) for _, c, m in initial_state([lin], [], {lin: 7})]
        [('parameter', 7), ('parameter', 7)]
    """
    items: list[tuple[torch.Tensor, Category, int]] = []
    for root in modules:
        for m in root.modules():
            mname = names[m]
            items += [(p, Category.PARAMETER, mname) for p in m.parameters(recurse=False)]
            items += [(b, Category.BUFFER, mname) for b in m.buffers(recurse=False)]
        items += [(p.grad, Category.GRADIENT, 0) for p in root.parameters() if p.grad is not None]
    for o in optims:
        for group in o.param_groups:
            for p in group["params"]:
                items.append((p, Category.PARAMETER, 0))
                if p.grad is not None:
                    items.append((p.grad, Category.GRADIENT, 0))
        for st in o.state.values():
            items += [(v, Category.OPTIMIZER_STATE, 0) for v in st.values()
                      if isinstance(v, torch.Tensor)]
    return items


#: the sequence number the next autograd node will get
next_seq = torch._C._autograd._get_sequence_nr


def seq_mark(bounds: MutableSequence[int], owners: MutableSequence[int], owner: int) -> None:
    """Note that autograd nodes made from now on belong to ``owner`` (a module's interned name):
    ``bounds[i]`` is the first sequence number of ``owners[i]``'s nodes (both trackers map a
    backward node back to the module whose forward made it this way).

    Example:
        >>> from array import array
        >>> b, o = array("q"), array("I")
        >>> seq_mark(b, o, 3); seq_mark(b, o, 5)   # no node made in between: 5 replaces 3
        >>> list(o)
        [5]
    """
    nr = next_seq()
    if bounds and bounds[-1] == nr:  # no autograd node since the last change
        owners[-1] = owner
    else:
        bounds.append(nr)
        owners.append(owner)


def note_params(registry: dict[int, weakref.ref[torch.Tensor]],
                params: Iterable[torch.Tensor]) -> None:
    """Remember ``params`` weakly by ``id`` (their ``.grad`` is a gradient when backward ends).

    Example:
        >>> reg = {}; w = torch.nn.Parameter(torch.ones(2)); note_params(reg, [w])
        >>> reg[id(w)]() is w
        True
    """
    for p in params:
        r = registry.get(id(p))
        if r is None or r() is not p:
            registry[id(p)] = weakref.ref(p)


def around_closure(args: tuple[Any, ...], kwargs: dict[str, Any], enter: Any, leave: Any
                   ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``optimizer.step(closure)``'s arguments with the closure wrapped in ``enter()`` /
    ``leave()`` (what an optimizer step pre-hook returns to replace them), or ``None`` when no
    closure is given. The forward and backward a closure runs (LBFGS, Lightning's automatic
    optimization) are the model's, not the optimizer's: the trackers leave the optimizer phase
    while it runs.

    Example:
        >>> seen = []
        >>> args, kwargs = around_closure((), {"closure": lambda: seen.append("run") or 1.0},
        ...                               lambda: seen.append("in"), lambda: seen.append("out"))
        >>> kwargs["closure"](), seen
        (1.0, ['in', 'run', 'out'])
        >>> around_closure((), {}, None, None) is None
        True
    """
    # the hook's args start with the optimizer itself (``step``'s ``self``)
    at = 1 if args and isinstance(args[0], torch.optim.Optimizer) else 0
    if kwargs.get("closure") is not None:
        closure, where = kwargs["closure"], "kw"
    elif len(args) > at and callable(args[at]):
        closure, where = args[at], "arg"
    else:
        return None

    def wrapped(*a: Any, **k: Any) -> Any:
        enter()
        try:
            return closure(*a, **k)
        finally:
            leave()

    if where == "kw":
        return args, {**kwargs, "closure": wrapped}
    return (*args[:at], wrapped, *args[at + 1:]), kwargs
