"""Memory-aware move and deep copy that keep aliasing and never double memory.

``Module.to`` and ``copy.deepcopy`` treat every tensor on its own: a buffer that views a
parameter, two parameters carved out of one flat storage, or a transposed copy of a weight each
get their own new storage, so the moved or copied model can need more memory than the original
and views stop being views. The functions here work per *storage* instead:

1. collect every tensor the module holds (parameters, buffers, their ``.grad``, and optionally
   the optimizer's state for those parameters) and group them by storage;
2. allocate one new storage per old storage directly on the target device and copy its bytes
   (or convert its elements) once;
3. rebuild every tensor as a view of its new storage with the *same* storage offset, sizes and
   strides;
4. only when everything is built, swap the new data in. If anything fails before or during the
   swap, the module is left exactly as it was and :class:`~torchmem.errors.MoveError` is raised.

Tensor objects keep their identity (the swap assigns ``.data``, as ``Module.to`` does for
parameters and gradients), so optimizers, hooks and your own references still point at them.
:func:`move_module` is the one implementation: :func:`memory_aware_to` calls it with a plain
copy per storage, :func:`torchmem.transfer.transfer_module` with chunked, stream-ordered copies.
The module is longer than 600 lines on purpose: planning, building, the all-or-nothing swap and
the deep copy share the same collected records and rebuilding helpers, and the undo log spans
them.

dtype conversion follows ``Module.to``: only floating point and complex tensors are converted,
integer and bool tensors keep their dtype, and optimizer ``step`` counters are left alone.
Aliasing survives a dtype change because every view of a storage has the same dtype: the storage
is re-laid out with the new element size, so offsets and strides (in elements) stay the same
while byte offsets scale with the element size. A storage viewed with two different dtypes
(e.g. a float tensor and its ``.view(torch.int32)``) cannot be converted consistently and raises
:class:`~torchmem.errors.MoveError` before anything changes.

Example:
    >>> import torch, torchmem
    >>> lin = torch.nn.Linear(8, 8)
    >>> lin.register_buffer("w_t", lin.weight.detach().t())   # a view of the weight
    >>> plan = torchmem.plan_move(lin, "meta")
    >>> plan.gains, plan.shared_groups
    ({'meta': 288}, [['weight', 'w_t']])
    >>> _ = torchmem.memory_aware_to(lin, "meta")
    >>> lin.weight.device, torchmem.same_storage(lin.weight, lin.w_t), lin.w_t.stride()
    (device(type='meta'), True, (1, 8))
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchmem._containers import replace_tensors, tensors_with_paths
from torchmem.capture.storage import _check_tensor, device_str, resolve_device
from torchmem.errors import InvalidInputError, MoveError, TorchmemError, UnsupportedTensorError
from torchmem.model.census import MovePlan, PlannedStorage

__all__ = ["memory_aware_to", "memory_aware_deepcopy", "plan_move", "move_module", "MovePlan"]


@dataclass
class _Entry:
    """One distinct tensor object held by the module (or optimizer) and where it should go."""

    tensor: torch.Tensor
    names: list[str]
    kind: str  # "parameter" | "buffer" | "gradient" | "optimizer_state"
    target_device: torch.device
    target_dtype: torch.dtype


@dataclass
class _Group:
    """All entries viewing one storage."""

    storage: torch.UntypedStorage
    entries: list[_Entry] = field(default_factory=list)
    action: str = "keep"  # keep | move | convert
    target_device: torch.device | None = None
    source_dtype: torch.dtype | None = None
    target_dtype: torch.dtype | None = None


def _check_module(module: object, fn: str) -> torch.nn.Module:
    if not isinstance(module, torch.nn.Module):
        raise InvalidInputError(
            f"{fn} expected a torch.nn.Module, got {type(module).__module__}."
            f"{type(module).__name__}; fix: pass the model itself (for a plain tensor use "
            "tensor.to(device))"
        )
    return module


def _check_dtype(dtype: object) -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise InvalidInputError(
            f"dtype should be a torch.dtype such as torch.float16, got {type(dtype).__name__}: "
            f"{dtype!r}"
        )
    if not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidInputError(
            f"dtype should be a floating point or complex dtype (as for Module.to), got {dtype}; "
            "integer and bool tensors are never converted"
        )
    return dtype


def _check_layout(t: torch.Tensor, name: str) -> None:
    try:
        _check_tensor(t, name)
    except UnsupportedTensorError as e:
        raise UnsupportedTensorError(f"cannot move or copy {e}") from None
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
        raise UnsupportedTensorError(
            f"{name} is an uninitialized (lazy) parameter or buffer with no data yet; fix: run "
            "one forward pass (or initialize the lazy module) before moving or copying it"
        )
    if t.is_quantized:
        raise UnsupportedTensorError(
            f"{name} is a quantized tensor; torchmem moves plain strided tensors only. Fix: "
            "dequantize it or move the module with Module.to"
        )


def _target_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None and (t.is_floating_point() or t.is_complex()):
        return dtype
    return t.dtype


def _collect(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | None,
    dtype: torch.dtype | None,
) -> list[_Entry]:
    """Distinct tensors held by the module (and the optimizer state of its parameters)."""
    entries: list[_Entry] = []
    index: dict[int, int] = {}  # id -> entry; valid while `entries` holds the tensors

    def add(name: str, t: torch.Tensor, kind: str, keep_device: bool = False,
            keep_dtype: bool = False) -> None:
        i = index.get(id(t))
        if i is not None and entries[i].tensor is t:
            if name not in entries[i].names:
                entries[i].names.append(name)
            return
        _check_layout(t, name)
        index[id(t)] = len(entries)
        entries.append(_Entry(
            tensor=t,
            names=[name],
            kind=kind,
            target_device=t.device if (device is None or keep_device) else device,
            target_dtype=t.dtype if keep_dtype else _target_dtype(t, dtype),
        ))

    pnames: dict[int, str] = {}
    params: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        add(name, p, "parameter")
        if id(p) not in pnames:
            pnames[id(p)] = name
            params.append((name, p))
    for name, b in module.named_buffers(remove_duplicate=False):
        add(name, b, "buffer")
    for name, p in params:
        if p.grad is not None:
            add(name + ".grad", p.grad, "gradient")
    if optimizer is not None:
        for group in optimizer.param_groups:
            special = bool(group.get("capturable") or group.get("fused"))
            for p in group["params"]:
                pname = pnames.get(id(p))
                if pname is None or p not in optimizer.state:
                    continue  # not this module's parameter: its state stays where it is
                for key, value in optimizer.state[p].items():
                    for sname, t in tensors_with_paths(value, f"state[{pname}].{key}"):
                        step = key == "step"
                        add(sname, t, "optimizer_state", keep_device=step and not special,
                            keep_dtype=step)
    return entries


def _group(entries: list[_Entry], copy: bool = False) -> list[_Group]:
    groups: dict[int, _Group] = {}
    for e in entries:
        s = e.tensor.untyped_storage()
        g = groups.get(int(s._cdata))
        if g is None:
            g = groups[int(s._cdata)] = _Group(storage=s)
        g.entries.append(e)
    out = list(groups.values())
    for g in out:
        _decide(g, copy)
    return out


def _decide(g: _Group, copy: bool = False) -> None:
    changes = [
        e for e in g.entries
        if device_str(e.tensor.device) != device_str(e.target_device) or e.tensor.dtype != e.target_dtype
    ]
    if not changes and not copy:
        g.action = "keep"
        return
    targets = {device_str(e.target_device) for e in g.entries}
    if len(targets) != 1:
        raise MoveError(
            f"tensors {', '.join(n for e in g.entries for n in e.names)} share one storage but "
            f"would go to different devices ({', '.join(sorted(targets))}); the module is unchanged"
        )
    g.target_device = g.entries[0].target_device
    src = {e.tensor.dtype for e in g.entries}
    dst = {e.target_dtype for e in g.entries}
    if all(e.tensor.dtype == e.target_dtype for e in g.entries):
        g.action = "move"
        return
    if len(src) != 1 or len(dst) != 1:
        views = ", ".join(f"{n} ({e.tensor.dtype})" for e in g.entries for n in e.names)
        raise MoveError(
            f"cannot convert a storage viewed with several dtypes ({views}) to "
            f"{', '.join(sorted(map(str, dst)))}: the views would no longer alias consistently. "
            "Fix: move without dtype= (then convert), or make those views separate tensors. "
            "The module is unchanged"
        )
    g.action = "convert"
    g.source_dtype = next(iter(src))
    g.target_dtype = next(iter(dst))
    es = g.source_dtype.itemsize
    if g.storage.nbytes() % es:
        raise MoveError(
            f"storage of {g.entries[0].names[0]} has {g.storage.nbytes()} bytes, not a multiple of "
            f"the {g.source_dtype} element size {es}; cannot convert it. The module is unchanged"
        )


def _allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate the new flat storage on the target (a seam for tests that inject failures)."""
    return torch.empty(numel, dtype=dtype, device=device)


def _flat(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def _build_storage(g: _Group, device: torch.device, non_blocking: bool) -> torch.UntypedStorage:
    """One new storage on ``device`` holding ``g.storage``'s bytes (or converted elements)."""
    old = g.storage
    names = ", ".join(n for e in g.entries for n in e.names)
    if old.device.type == "meta" and device.type != "meta":
        raise MoveError(
            f"{names} live on the meta device and have no data to copy to {device}; fix: use "
            f"module.to_empty(device={str(device)!r}) and re-initialise. The module is unchanged"
        )
    if g.action == "convert":
        assert g.source_dtype is not None and g.target_dtype is not None
        numel = old.nbytes() // g.source_dtype.itemsize
        new = _allocate(numel, g.target_dtype, device)
        if device.type != "meta":
            new.copy_(_flat(old, g.source_dtype, numel), non_blocking=non_blocking)
    else:
        numel = old.nbytes()
        new = _allocate(numel, torch.uint8, device)
        if device.type != "meta":
            new.copy_(_flat(old, torch.uint8, numel), non_blocking=non_blocking)
    return new.untyped_storage()


def _view(storage: torch.UntypedStorage, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` on ``storage`` with ``like``'s offset (in elements), sizes and strides."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage, like.storage_offset(), like.size(), like.stride()
    )


def _plan(
    module: object,
    device: object,
    dtype: object,
    optimizer: torch.optim.Optimizer | None,
    fn: str,
    copy: bool = False,
) -> tuple[torch.device | None, torch.dtype | None, list[_Group]]:
    """Checked inputs and the storage groups of a move (the front end of plan and move)."""
    mod = _check_module(module, fn)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"optimizer should be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    dev = None if device is None else resolve_device(device)  # type: ignore[arg-type]
    dt = _check_dtype(dtype)
    return dev, dt, _group(_collect(mod, optimizer, dev, dt), copy)


def plan_move(
    module: torch.nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> MovePlan:
    """Dry run of :func:`memory_aware_to`: bytes each device gains and loses, shared storages.

    Nothing is allocated. ``losses`` counts old storages the module stops using (they are freed
    unless something outside the module still holds them).

    Example:
        >>> import torch, torchmem
        >>> m = torch.nn.Linear(4, 4)                       # 64 + 16 bytes of float32
        >>> p = torchmem.plan_move(m, dtype=torch.float64)
        >>> p.gains, p.losses, [s.action for s in p.storages]
        ({'cpu': 160}, {'cpu': 80}, ['convert', 'convert'])
    """
    dev, dt, groups = _plan(module, device, dtype, optimizer, "plan_move")
    out = MovePlan(device=None if dev is None else device_str(dev),
                   dtype=None if dt is None else str(dt).replace("torch.", ""))
    for g in groups:
        e0 = g.entries[0].tensor
        src_dev = device_str(g.storage.device)
        nbytes = int(g.storage.nbytes())
        if g.action == "convert":
            assert g.source_dtype is not None and g.target_dtype is not None
            es_old = g.source_dtype.itemsize
            es_new = g.target_dtype.itemsize
            tgt_bytes = nbytes // es_old * es_new
        else:
            tgt_bytes = nbytes
        tgt_dev = src_dev if g.target_device is None else device_str(g.target_device)
        out.storages.append(PlannedStorage(
            source_device=src_dev,
            target_device=tgt_dev,
            source_dtype=str(e0.dtype).replace("torch.", ""),
            target_dtype=str(g.target_dtype or e0.dtype).replace("torch.", ""),
            source_nbytes=nbytes,
            target_nbytes=tgt_bytes,
            names=[n for e in g.entries for n in e.names],
            action=g.action,
        ))
    return out


def memory_aware_to(
    module: torch.nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    non_blocking: bool = False,
) -> torch.nn.Module:
    """Move (and/or convert) a module in place, one new storage per old storage; returns it.

    Tensors that shared a storage before share one storage after, at the same offsets and
    strides. New storages are allocated directly on the target; tensors already in place are
    untouched (same storage, no copy). Tensor objects keep their identity (``.data`` is
    replaced). Where the tensor type changes (CPU -> meta), parameters get the new contents
    swapped in with ``torch.utils.swap_tensors`` unless a weak reference or a live autograd graph
    holds them; other tensors are replaced by new objects of their type in every slot of the
    module and optimizer. Parameter types, ``requires_grad`` and ``.grad`` are kept. With
    ``optimizer``, the state of this module's parameters moves too and stays keyed to the same
    parameter objects. See the module docstring for dtype rules. This is :func:`move_module`;
    :func:`torchmem.transfer.transfer_module` is the same move with chunked, stream-ordered copies.

    Raises :class:`~torchmem.errors.InvalidInputError` (not a module, bad dtype),
    :class:`~torchmem.errors.DeviceError` (unknown or absent device),
    :class:`~torchmem.errors.UnsupportedTensorError` (sparse, nested, lazy, quantized) and
    :class:`~torchmem.errors.MoveError` (a failure while building; the module is unchanged).

    Example:
        >>> import torch, torchmem
        >>> flat = torch.zeros(20)
        >>> m = torch.nn.Module()
        >>> m.a = torch.nn.Parameter(flat[:12].view(3, 4)); m.b = torch.nn.Parameter(flat[12:])
        >>> _ = torchmem.memory_aware_to(m, dtype=torch.float64)
        >>> m.a.dtype, torchmem.same_storage(m.a, m.b), m.b.storage_offset(), type(m.a).__name__
        (torch.float64, True, 12, 'Parameter')
    """
    _check_module(module, "memory_aware_to")
    move_module(module, device, dtype, optimizer, non_blocking=non_blocking)
    return module


StorageCopier = Callable[[list[torch.UntypedStorage], torch.device], Sequence[torch.UntypedStorage]]
"""Copies storages (their bytes, unconverted) to a device: one new storage per storage, in order."""


def move_module(
    module: torch.nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    non_blocking: bool = False,
    copy: bool = False,
    copier: StorageCopier | None = None,
) -> list[torch.Tensor]:
    """The one module move behind :func:`memory_aware_to` and ``transfer_module``.

    Collects the module's tensors (and ``optimizer``'s state for its parameters), groups them by
    storage, builds one new storage per group that changes, and only then swaps the new data in,
    undoing every swap if one fails: all or nothing. ``copy`` copies storages already on the
    target too (as ``Tensor.to(copy=True)``). ``copier`` builds the byte copies (storages whose
    dtype does not change), called once per target device with those storages; by default each
    is one allocation and one ``copy_`` (``non_blocking`` as given). Returns the tensors that now
    hold the new storages (one per moved tensor object).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> moved = move_module(lin, "cpu", copy=True)
        >>> len(moved), moved[0] is lin.weight
        (2, True)
    """
    groups = _plan(module, device, dtype, optimizer, "move_module", copy)[2]

    # 1) build everything (nothing in the module changes yet)
    new_data: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        built = _build(groups, non_blocking, copier)
        for g in groups:
            if g.action != "keep":
                storage = built[id(g)]
                for e in g.entries:
                    new_data.append((e.tensor, _view(storage, e.tensor, e.target_dtype)))
    except TorchmemError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure while building leaves the module as it was
        raise MoveError(
            f"moving {type(module).__name__} to device={device!r} dtype={dtype} failed while "
            f"allocating or copying ({type(e).__name__}: {e}); the module is unchanged"
        ) from e

    # 2) swap in; undo on failure
    undo: list[Any] = []
    try:
        with torch.no_grad():
            return _swap(module, optimizer, new_data, undo)
    except Exception as e:  # noqa: BLE001
        with torch.no_grad():
            for fn in reversed(undo):
                fn()
        raise MoveError(
            f"swapping the moved tensors into {type(module).__name__} failed "
            f"({type(e).__name__}: {e}); the module was restored as it was"
        ) from e


def _build(
    groups: list[_Group], non_blocking: bool, copier: StorageCopier | None
) -> dict[int, torch.UntypedStorage]:
    """New storage of every group that changes, keyed by ``id(group)``."""
    built: dict[int, torch.UntypedStorage] = {}
    if copier is not None:
        by_target: dict[str, list[_Group]] = {}
        for g in groups:
            if g.action == "move":
                assert g.target_device is not None
                by_target.setdefault(device_str(g.target_device), []).append(g)
        for gs in by_target.values():
            assert gs[0].target_device is not None
            new = copier([g.storage for g in gs], gs[0].target_device)
            built.update((id(g), s) for g, s in zip(gs, new))
    for g in groups:
        if g.action != "keep" and id(g) not in built:
            assert g.target_device is not None
            built[id(g)] = _build_storage(g, g.target_device, non_blocking)
    return built


def _fresh(t: torch.Tensor, new: torch.Tensor, attrs: bool = True) -> torch.Tensor:
    """A new object of ``t``'s type (and, with ``attrs``, its attributes) holding ``new``."""
    if isinstance(t, torch.nn.Parameter):
        obj: torch.Tensor = _new_param(t, new)
    elif type(t) is not torch.Tensor:
        obj = torch.Tensor._make_subclass(type(t), new, t.requires_grad)
    else:
        obj = new.requires_grad_(t.requires_grad) if t.is_leaf else new
    if attrs:
        obj.__dict__.update(t.__dict__)
    return obj


def _swappable(t: torch.Tensor, obj: torch.Tensor) -> bool:
    """Whether ``swap_tensors`` can exchange the two without side effects (no weak references,
    nothing else, such as a live autograd graph, holding either's data)."""
    return (
        not weakref.getweakrefs(t) and not weakref.getweakrefs(obj)
        and t._use_count() == 1 and obj._use_count() == 1  # type: ignore[attr-defined]
    )


def _swap(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    new_data: list[tuple[torch.Tensor, torch.Tensor]],
    undo: list[Any],
) -> list[torch.Tensor]:
    """Put the new data in place; returns the tensors now holding it.

    Compatible tensors keep their identity (``.data =``, as ``Module.to`` does). Otherwise (e.g.
    CPU -> meta) parameters get the new contents swapped into the same object when nothing else
    holds them (as ``Module.to`` does with ``swap_module_params_on_conversion``); other tensors,
    and parameters that cannot be swapped, are replaced by new objects of the same type in every
    slot that held them (module dicts, ``.grad``, optimizer groups and state), so references
    held outside the module keep the old data."""
    grads = {id(t): t.grad for t, _ in new_data if isinstance(t, torch.nn.Parameter)}
    replace: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    holders: list[torch.Tensor] = []
    for t, new in new_data:
        if torch._has_compatible_shallow_copy_type(t, new):
            old = t.data
            t.data = new
            undo.append(lambda t=t, old=old: setattr(t, "data", old))
            holders.append(t)
            continue
        obj = _fresh(t, new)
        if isinstance(t, torch.nn.Parameter) and _swappable(t, obj):
            torch.utils.swap_tensors(t, obj)
            undo.append(lambda t=t, obj=obj: torch.utils.swap_tensors(t, obj))
            holders.append(t)
        else:
            replace[id(t)] = (t, obj)
            holders.append(obj)

    def hit(v: Any) -> Any:
        found = replace.get(id(v))
        return found[1] if found is not None and found[0] is v else None

    def repl(v: Any) -> Any:
        n = hit(v)
        return v if n is None else n

    def set_item(d: Any, k: Any, v: Any) -> None:
        old = d[k]
        d[k] = v
        undo.append(lambda: d.__setitem__(k, old))

    for t, _ in new_data:  # each parameter (or its replacement) gets its moved gradient
        g = grads.get(id(t))
        p, new_g = repl(t), repl(g)
        if g is not None and p.grad is not new_g:
            old_g = p.grad
            p.grad = new_g
            undo.append(lambda p=p, old_g=old_g: setattr(p, "grad", old_g))
    if not replace:
        return holders
    for m in module.modules():
        for d in (m._parameters, m._buffers):
            for k, v in list(d.items()):
                if v is not None and repl(v) is not v:
                    set_item(d, k, repl(v))
    if optimizer is not None:
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if repl(p) is not p:
                    set_item(params, i, repl(p))
        state = optimizer.state
        for p in list(state):
            st = state[p]
            for k, v in list(st.items()):
                nv = replace_tensors(v, hit)
                if nv is not v:
                    set_item(st, k, nv)
            n = repl(p)
            if n is not p:
                state[n] = state.pop(p)
                undo.append(lambda p=p, n=n: state.__setitem__(p, state.pop(n)))
    return holders


def memory_aware_deepcopy(module: torch.nn.Module) -> torch.nn.Module:
    """An independent deep copy that keeps aliasing, gradients and Parameter types.

    One new storage per old storage (so the copy needs the module's storage bytes, not one
    copy per view), every parameter, buffer and gradient rebuilt as a view with the same
    offset and strides, then ``copy.deepcopy`` with those tensors pre-seeded so the rest of
    the module (submodules, hooks, plain attributes) is copied as usual. Plain tensor
    attributes that view the same storages are rebuilt on the new storages too. Writing to
    the copy never changes the original.

    Example:
        >>> import torch, torchmem
        >>> emb = torch.nn.Embedding(4, 2); head = torch.nn.Linear(2, 4, bias=False)
        >>> head.weight = emb.weight
        >>> m = torch.nn.Sequential(emb, head)
        >>> c = torchmem.memory_aware_deepcopy(m)
        >>> c[0].weight is c[1].weight, torchmem.same_storage(c[0].weight, m[0].weight)
        (True, False)
        >>> with torch.no_grad(): _ = c[0].weight.fill_(1.0)
        >>> bool((m[0].weight == 1.0).all())
        False
    """
    _check_module(module, "memory_aware_deepcopy")
    entries = _collect(module, None, None, None)
    groups = _group(entries)
    memo: dict[Any, Any] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    try:
        for g in groups:
            old = g.storage
            new = _allocate(old.nbytes(), torch.uint8, old.device)
            if old.device.type != "meta":
                new.copy_(_flat(old, torch.uint8, old.nbytes()))
            storages[int(old._cdata)] = new.untyped_storage()
        memo["torch"] = dict(storages)  # what UntypedStorage.__deepcopy__ looks up
        new_of: dict[int, torch.Tensor] = {}
        for e in entries:
            t = e.tensor
            view = _view(storages[int(t.untyped_storage()._cdata)], t, t.dtype)
            if e.kind == "gradient":
                new_of[id(t)] = view
                continue
            new_of[id(t)] = _fresh(t, view, attrs=False)
        for e in entries:
            t = e.tensor
            if e.kind == "parameter" and t.grad is not None:
                new_of[id(t)].grad = new_of[id(t.grad)]
        for e in entries:
            memo[id(e.tensor)] = new_of[id(e.tensor)]
            if e.tensor.__dict__:
                new_of[id(e.tensor)].__dict__.update(copy.deepcopy(e.tensor.__dict__, memo))
        return copy.deepcopy(module, memo)
    except TorchmemError:
        raise
    except Exception as e:  # noqa: BLE001
        raise MoveError(
            f"memory_aware_deepcopy of {type(module).__name__} failed ({type(e).__name__}: {e}); "
            "the original module is unchanged"
        ) from e


def _new_param(p: torch.nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """A Parameter of ``type(p)`` that aliases ``view`` (as Parameter.__deepcopy__ builds one)."""
    try:
        new = type(p)(view, p.requires_grad)
    except TypeError:
        new = torch.Tensor._make_subclass(type(p), view, p.requires_grad)
    if new.untyped_storage() is not view.untyped_storage():
        # a subclass constructor that copies: fall back to aliasing the view directly
        new = torch.Tensor._make_subclass(type(p), view, p.requires_grad)
    return new
