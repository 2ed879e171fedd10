"""Who holds it: the chains of references that keep a tensor's memory alive (:func:`why_alive`).

A breadth-first search from the roots a user reads (module globals, the frames of running
threads, ``sys.last_traceback``, IPython's output cache, extra named roots) follows Python's
references, and the links PyTorch keeps out of Python's sight: a tensor's ``.grad`` and
``.grad_fn``, a graph node's saved tensors, ``next_functions`` and ``AccumulateGrad.variable``.
Every object whose storage is the target's (the tensor, its views, a tensor unpacked from a
graph node, the ``UntypedStorage``) ends a path. Each step is named as a user reads it::

    test_mod global LOSSES (list) [17] -> Tensor.grad_fn AddBackward0 -> saved tensor (self)
    -> Tensor float32[1024, 1024] 4.00 MiB

When no root reaches the memory, the collector's pending garbage is searched next (the
collection runs in ``gc.DEBUG_SAVEALL`` mode, so nothing is freed; the garbage is handed back
to the collector afterwards): the path then starts at the reference cycle that holds it, and
says so.

Cost is bounded: the search stops after ``max_depth`` steps from a root (default 24) or
``timeout`` seconds (default 10), and the result's ``stopped`` says which limit it hit. The
frames of :func:`why_alive` and of its caller are left out, so the caller's own variable does
not count as a holder.

Over 800 lines: the edge functions (which references each type has), the labels
(how each reference reads) and the two searches (from the roots, then through the collector's
garbage) share one notion of a link and change together; split, each part would be read
against the others anyway.

Example:
    >>> import torch
    >>> from torchmem.capture.retention import why_alive
    >>> CACHE = {"x": torch.zeros(256)}
    >>> paths = why_alive(torch.zeros(1), roots={"CACHE": CACHE})
    >>> list(paths)
    []
    >>> str(why_alive(CACHE["x"][:10], roots={"CACHE": CACHE})[0])
    "CACHE (dict) ['x'] -> Tensor float32[256] 1.00 KiB"
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import time
import types
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import Node as _Node

from torchmem.errors import InvalidInputError
from torchmem.units import format_bytes

__all__ = ["RetentionPath", "RetentionPaths", "why_alive"]

#: Defaults of :func:`why_alive`'s bounds.
DEFAULT_MAX_DEPTH = 24
DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_PATHS = 10

_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), range, types.CodeType,
           types.BuiltinFunctionType, types.ModuleType, memoryview)
_MODULE_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
    ("_state_dict_hooks", "state_dict hook"),
    ("_state_dict_pre_hooks", "state_dict pre-hook"),
    ("_load_state_dict_pre_hooks", "load_state_dict pre-hook"),
    ("_load_state_dict_post_hooks", "load_state_dict post-hook"),
)

# an edge: (label or None, child); None labels are worked out only for the paths reported
_Edge = tuple[Optional[str], Any]


@dataclass(frozen=True)
class RetentionPath:
    """One chain of references from a root to the memory; ``str(path)`` is its one-line text.

    ``root`` names where the chain starts, ``steps`` the links (each as a user reads it),
    ``target`` the object that holds the storage at the end. ``cycle`` is set when the chain
    starts in a reference cycle that only the garbage collector can free (the cycle's links).

    Example:
        >>> p = RetentionPath("m global X (list)", ("[0]",), "Tensor float32[4] 16 B")
        >>> str(p), len(p)
        ('m global X (list) [0] -> Tensor float32[4] 16 B', 1)
    """

    root: str
    steps: tuple[str, ...]
    target: str
    cycle: Optional[tuple[str, ...]] = None

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        text = self.root
        if self.cycle is not None:
            text = (f"reference cycle waiting for the garbage collector: {self.root}"
                    f"{_join(self.cycle)} -> (back to the start); held from it: {self.root}")
        return f"{text}{_join(self.steps)} -> {self.target}"


def _join(steps: tuple[str, ...]) -> str:
    return "".join((" " if s.startswith("[") else " -> ") + s for s in steps)


class RetentionPaths(list):  # type: ignore[type-arg]
    """The paths :func:`why_alive` found, shortest first (a ``list`` of :class:`RetentionPath`).

    ``stopped`` says why the search ended early (``None`` when it searched everything it could
    reach); ``searched`` is the number of objects it looked at; ``note`` explains an empty
    result.

    Example:
        >>> r = RetentionPaths([], stopped=None, searched=3, note="nothing holds it")
        >>> len(r), str(r)
        (0, 'no path found: nothing holds it')
    """

    def __init__(self, paths: list[RetentionPath], *, stopped: Optional[str], searched: int,
                 note: Optional[str] = None) -> None:
        super().__init__(paths)
        self.stopped = stopped
        self.searched = searched
        self.note = note

    def __str__(self) -> str:
        lines = [str(p) for p in self]
        if not lines:
            lines.append(f"no path found: {self.note}" if self.note else "no path found")
        if self.stopped:
            lines.append(f"(search stopped early: {self.stopped})")
        return "\n".join(lines)


# -- the target ---------------------------------------------------------------------------------


def _storage_key(o: Any) -> Optional[int]:
    try:
        if isinstance(o, torch.Tensor):
            return int(o.untyped_storage()._cdata)
        if isinstance(o, torch.UntypedStorage):
            return int(o._cdata)
        if isinstance(o, torch.TypedStorage):
            return int(o._untyped_storage._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, ...
        return None
    return None


def _describe_target(o: Any) -> str:
    if isinstance(o, torch.Tensor):
        dtype = str(o.dtype).replace("torch.", "")
        shape = ", ".join(str(d) for d in o.shape)
        where = "" if o.device.type == "cpu" else f" on {o.device}"
        try:
            nbytes = format_bytes(int(o.untyped_storage().nbytes()))
        except (RuntimeError, NotImplementedError):
            nbytes = "(no storage)"
        kind = "Parameter" if isinstance(o, torch.nn.Parameter) else "Tensor"
        return f"{kind} {dtype}[{shape}]{where} {nbytes}"
    if isinstance(o, (torch.UntypedStorage, torch.TypedStorage)):
        s = o if isinstance(o, torch.UntypedStorage) else o._untyped_storage
        return f"UntypedStorage {format_bytes(int(s.nbytes()))}"
    return type(o).__name__


def _matcher(obj: Any) -> Callable[[Any], bool]:
    if isinstance(obj, torch.nn.Module):
        return lambda o: o is obj
    if not isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
        raise InvalidInputError(
            f"why_alive expects a torch.Tensor, a storage (torch.UntypedStorage or "
            f"torch.TypedStorage) or a torch.nn.Module; received {type(obj).__name__}. Fix: pass "
            "the tensor whose memory you want explained (a view or any tensor sharing its "
            "storage works too)"
        )
    key = _storage_key(obj)
    if key is None:
        return lambda o: o is obj

    def match(o: Any) -> bool:
        if isinstance(o, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return _storage_key(o) == key
        return False

    return match


# -- edges ---------------------------------------------------------------------------------------


def _short(o: Any) -> str:
    text = repr(o) if isinstance(o, (str, int, float, bool, tuple, type(None))) else (
        f"<{type(o).__name__}>")
    return text if len(text) <= 40 else text[:37] + "..."


def _frame_text(f: types.FrameType, line: Optional[int] = None) -> str:
    code = f.f_code
    return (f"frame {code.co_name} ({os.path.basename(code.co_filename)}:"
            f"{line if line is not None else f.f_lineno})")


def _is_node(o: Any) -> bool:
    # By type, never by probing attributes: objects with a catch-all __getattr__ (pytest.mark
    # under --strict-markers raises on any unknown name) would run code or fail.
    return isinstance(o, _Node)


def _attrs(o: Any) -> Optional[dict[str, Any]]:
    try:
        d = object.__getattribute__(o, "__dict__")
    except AttributeError:
        return None
    return d if isinstance(d, dict) else None


def _tensor_edges(t: torch.Tensor) -> Iterator[_Edge]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grad = t._grad if hasattr(t, "_grad") else None
        fn = t.grad_fn
    if grad is not None:
        yield "Tensor.grad", grad
    if fn is not None:
        yield f"Tensor.grad_fn {fn.name()}", fn
    hooks = getattr(t, "_backward_hooks", None)
    if hooks:
        for h in hooks.values():
            yield f"Tensor backward hook {getattr(h, '__qualname__', type(h).__name__)}", h
    d = _attrs(t)
    if d:
        for k, v in d.items():
            yield f"Tensor.{k}", v


def _node_edges(n: Any) -> Iterator[_Edge]:
    for attr in dir(n):
        if not attr.startswith("_saved_"):
            continue
        try:
            v = getattr(n, attr)
        except RuntimeError:  # freed after backward
            continue
        label = f"saved tensor ({attr[len('_saved_'):]})"
        if isinstance(v, torch.Tensor):
            yield label, v
        elif isinstance(v, (tuple, list)):
            for i, item in enumerate(v):
                if isinstance(item, torch.Tensor):
                    yield f"{label}[{i}]", item
    variable = getattr(n, "variable", None)
    if isinstance(variable, torch.Tensor):
        yield "AccumulateGrad.variable (leaf)", variable
    for i, (fn, _) in enumerate(n.next_functions):
        if fn is not None:
            yield f"next_functions[{i}] {fn.name()}", fn
    meta = getattr(n, "metadata", None)
    if meta:
        yield f"{n.name()}.metadata", meta


def _function_edges(f: types.FunctionType) -> Iterator[_Edge]:
    if f.__closure__:
        for name, cell in zip(f.__code__.co_freevars, f.__closure__):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield f"{f.__qualname__} closure `{name}`", value
    if f.__defaults__:
        yield f"{f.__qualname__} default arguments", f.__defaults__
    if f.__kwdefaults__:
        yield f"{f.__qualname__} keyword defaults", f.__kwdefaults__
    d = _attrs(f)
    if d:
        for k, v in d.items():
            yield f"{f.__qualname__}.{k}", v


def _module_edges(m: torch.nn.Module) -> Iterator[_Edge]:
    cls = type(m).__name__
    d = _attrs(m) or {}
    for name, p in (d.get("_parameters") or {}).items():
        if p is not None:
            yield f"{cls}.{name} (parameter)", p
    for name, b in (d.get("_buffers") or {}).items():
        if b is not None:
            yield f"{cls}.{name} (buffer)", b
    for name, sub in (d.get("_modules") or {}).items():
        if sub is not None:
            yield f"{cls}.{name}", sub
    for attr, what in _MODULE_HOOKS:
        for hook in (d.get(attr) or {}).values():
            yield f"{cls} {what} {getattr(hook, '__qualname__', type(hook).__name__)}", hook
    skip = {"_parameters", "_buffers", "_modules", *(a for a, _ in _MODULE_HOOKS)}
    for k, v in d.items():
        if k not in skip:
            yield f"{cls}.{k}", v


def _optimizer_edges(opt: torch.optim.Optimizer) -> Iterator[_Edge]:
    cls = type(opt).__name__
    where: dict[int, str] = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            where[id(p)] = f"group {gi} param {pi}"
    for p, st in opt.state.items():
        if isinstance(p, torch.Tensor):
            name = where.get(id(p))
            if name is None:
                name = f"a parameter in no param group, {_describe_target(p)}"
            yield f"{cls}.state[{name}]", st
            yield f"{cls}.state key ({name})", p
        else:
            yield f"{cls}.state[{_short(p)}]", st
    for k, v in (_attrs(opt) or {}).items():
        if k != "state":
            yield f"{cls}.{k}", v


def _dict_edges(o: dict) -> Iterator[_Edge]:  # type: ignore[type-arg]
    for k, v in o.items():
        if not isinstance(k, _ATOMIC):
            yield "(dict key)", k
        yield None, v


def _seq_edges(o: Any) -> Iterator[_Edge]:
    for v in o:
        yield None, v


def _set_edges(o: Any) -> Iterator[_Edge]:
    for v in o:
        yield "(set member)", v


# A container's own subclass may override items() or __iter__ with code that runs on each call
# (transformers' lazy auto-mappings import every model module when iterated): its entries are
# read through the built-in type's methods, and its attributes as an object's. Decided once
# per type (_handler): the built-in containers themselves keep the plain loops above.
_CONTAINERS: tuple[type, ...] = (dict, list, tuple, collections.deque, set, frozenset)


def _builtin_iter(o: Any) -> Iterator[Any]:
    """``iter(o)`` of a sequence by the built-in type it derives from (a path's label)."""
    bases: tuple[Any, ...] = (list, tuple, collections.deque)
    for base in bases:
        if isinstance(o, base):
            return base.__iter__(o)  # type: ignore[no-any-return]
    return iter(o)


def _subclass_edges(t: type) -> _EdgeFn:
    """The edge function of a subclass ``t`` of a built-in container: its entries by the
    built-in type, then its attributes."""
    base = next(b for b in t.__mro__ if b in _CONTAINERS)
    label = "(set member)" if base in (set, frozenset) else None

    def edges(o: Any) -> Iterator[_Edge]:
        if base is dict:
            for k, v in dict.items(o):
                if not isinstance(k, _ATOMIC):
                    yield "(dict key)", k
                yield None, v
        else:
            for v in base.__iter__(o):  # type: ignore[attr-defined]
                yield label, v
        for k, v in (_attrs(o) or {}).items():
            yield f"{t.__name__}.{k}", v

    return edges


def _method_edges(o: types.MethodType) -> Iterator[_Edge]:
    yield f"bound method {o.__func__.__qualname__} .__self__", o.__self__
    yield None, o.__func__


def _traceback_edges(o: types.TracebackType) -> Iterator[_Edge]:
    yield _frame_text(o.tb_frame, o.tb_lineno), o.tb_frame
    if o.tb_next is not None:
        yield "tb_next", o.tb_next


def _frame_edges(o: types.FrameType) -> Iterator[_Edge]:
    for k, v in o.f_locals.items():
        yield f"local `{k}`", v


def _exception_edges(o: BaseException) -> Iterator[_Edge]:
    name = type(o).__name__
    if o.__traceback__ is not None:
        yield f"{name}.__traceback__", o.__traceback__
    if o.__context__ is not None:
        yield f"{name}.__context__", o.__context__
    yield f"{name}.args", o.args
    for k, v in (_attrs(o) or {}).items():
        yield f"{name}.{k}", v


def _type_edges(o: type) -> Iterator[_Edge]:
    if o.__module__ != "builtins":
        for k, v in vars(o).items():
            if not k.startswith("__"):
                yield f"class {o.__name__}.{k}", v


def _cell_edges(o: types.CellType) -> Iterator[_Edge]:
    try:
        yield "cell", o.cell_contents
    except ValueError:  # an empty cell
        pass


def _no_edges(o: Any) -> Iterator[_Edge]:
    return iter(())


def _object_edges(o: Any) -> Iterator[_Edge]:
    d = _attrs(o)
    if d is not None:
        for v in d.values():
            yield None, v
    t = type(o)
    for v in gc.get_referents(o):
        if v is not d and v is not t:
            yield None, v


_EdgeFn = Callable[[Any], Iterator[_Edge]]
_HANDLERS: dict[type, _EdgeFn] = {}


def _handler(o: Any) -> _EdgeFn:
    """The edge function for the type of ``o`` (decided once per type)."""
    t = type(o)
    fn = _HANDLERS.get(t)
    if fn is not None:
        return fn
    table: tuple[tuple[Any, _EdgeFn], ...] = (
        (dict, _dict_edges), ((list, tuple, collections.deque), _seq_edges),
        ((set, frozenset), _set_edges), (torch.Tensor, _tensor_edges),
        (torch.nn.Module, _module_edges), (torch.optim.Optimizer, _optimizer_edges),
        (types.FunctionType, _function_edges), (types.MethodType, _method_edges),
        (types.TracebackType, _traceback_edges), (types.FrameType, _frame_edges),
        (BaseException, _exception_edges), (type, _type_edges), (types.CellType, _cell_edges),
        (_ATOMIC, _no_edges),
    )
    fn = next((f for k, f in table if issubclass(t, k)), None)
    if fn in (_dict_edges, _seq_edges, _set_edges) and t not in _CONTAINERS:
        fn = _subclass_edges(t)
    if fn is None:
        fn = _node_edges if _is_node(o) else _object_edges
    _HANDLERS[t] = fn
    return fn


def _children(o: Any) -> Iterator[_Edge]:
    """The references of ``o`` to follow; a ``None`` label is named later by :func:`_label`."""
    return _handler(o)(o)


def _label(parent: Any, child: Any) -> str:
    """How ``parent`` refers to ``child``, for the generic containers and objects."""
    if isinstance(parent, dict):
        for k, v in dict.items(parent):
            if v is child:
                return f"[{_short(k)}]"
    elif isinstance(parent, (list, tuple, collections.deque)):
        for i, v in enumerate(_builtin_iter(parent)):
            if v is child:
                return f"[{i}]"
    elif isinstance(parent, types.MethodType):
        return f"bound method {parent.__func__.__qualname__}"
    d = _attrs(parent)
    if d:
        for k, v in d.items():
            if v is child:
                return f"{type(parent).__name__}.{k}"
    return f"(referenced by {type(parent).__name__})"


def _with_type(label: str, child: Any) -> str:
    if isinstance(child, torch.Tensor) or _is_node(child) or isinstance(
        child, (types.FrameType, types.TracebackType)
    ):
        return label
    name = type(child).__name__
    if label.endswith(f"({name})") or (label.startswith("<") and label.endswith(" object>")):
        return label
    return f"{label} ({name})"


# -- roots ---------------------------------------------------------------------------------------


def _module_display(name: str, module: types.ModuleType) -> str:
    if name == "__main__":
        f = getattr(module, "__file__", None)
        return os.path.basename(f) if isinstance(f, str) else "__main__"
    return name


def _roots(skip_frames: set[int], extra: Optional[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    roots: list[tuple[str, Any]] = []
    if extra:
        roots.extend((str(k), v) for k, v in extra.items())
    ipython = sys.modules.get("IPython")
    ip = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    user_ns: dict[str, Any] = getattr(ip, "user_ns", None) or {}
    out = user_ns.get("Out")
    if isinstance(out, dict):
        roots.extend((f"IPython output cache Out[{n}]", v) for n, v in out.items())
    for k, v in user_ns.items():
        if k in ("_", "__", "___") or (k.startswith("_") and k[1:].isdigit()):
            roots.append((f"IPython output cache {k}", v))
        elif not k.startswith("_") and k not in ("In", "Out"):
            roots.append((f"IPython global {k}", v))
    for name in ("last_exc", "last_value", "last_traceback"):
        if getattr(sys, name, None) is not None:
            roots.append((f"sys.{name}", getattr(sys, name)))
    top: Optional[types.FrameType]
    for top in sys._current_frames().values():
        f: Optional[types.FrameType] = top
        while f is not None:
            own = f.f_code.co_filename == __file__
            module_level = f.f_code.co_name == "<module>" and f.f_locals is f.f_globals
            if id(f) not in skip_frames and not own and not module_level:
                text = _frame_text(f)
                for k, v in f.f_locals.items():
                    roots.append((f"{text} local `{k}`", v))
            f = f.f_back
    # this thread's top frame is this function's own: kept in a local, it would make a cycle
    # (frame -> local -> frame) holding every root until the collector runs
    top = f = None
    seen_dicts: set[int] = set()
    for mod_name, module in list(sys.modules.items()):
        d = _attrs(module) if isinstance(module, types.ModuleType) else None
        if not d or id(d) in seen_dicts:
            continue
        seen_dicts.add(id(d))
        shown = _module_display(mod_name, module)
        for k, v in list(d.items()):
            if mod_name == "sys" and k in ("last_exc", "last_value", "last_traceback"):
                continue
            if not isinstance(v, _ATOMIC):
                roots.append((f"{shown} global {k}", v))
    return roots


# -- the search ----------------------------------------------------------------------------------


class _Search:
    """Breadth-first search; the loop is the hot path of a whole-heap search (hundreds of
    thousands of objects), so it decides per type, once, whether an object can end a path
    (``_MAY_MATCH``), has nothing to follow (``_ATOMIC``) or is walked."""

    def __init__(self, match: Callable[[Any], bool], max_depth: int, deadline: float,
                 max_paths: int, skip: set[int]) -> None:
        self.match = match
        self.skip = skip
        self.max_depth = max_depth
        self.deadline = deadline
        self.max_paths = max_paths
        self.stopped: Optional[str] = None
        self.depth_cut = False
        self.searched = 0
        self.keep: dict[int, Any] = {}  # the targets found: strong references, ids stay valid
        # id -> (parent id or None for a root, label, the object: a strong reference while
        # searching, so that ids stay valid)
        self.parent: dict[int, tuple[Optional[int], Optional[str], Any]] = {}

    def run(self, roots: list[tuple[str, Any]], allowed: Optional[set[int]] = None
            ) -> list[tuple[list[tuple[Optional[str], Any]], Any]]:
        """Breadth-first from ``roots``; each hit is (the chain of (label, object), the target)."""
        found: list[tuple[list[tuple[Optional[str], Any]], Any]] = []
        queue: collections.deque[tuple[Any, int]] = collections.deque()
        match, parent, keep, skip = self.match, self.parent, self.keep, self.skip
        for label, obj in roots:
            if self.match(obj):
                found.append(([(label, None)], obj))
                continue
            if isinstance(obj, _ATOMIC) or id(obj) in parent:
                continue
            parent[id(obj)] = (None, label, obj)
            queue.append((obj, 0))
        kinds = _KINDS
        handlers = _HANDLERS
        max_paths, max_depth, deadline = self.max_paths, self.max_depth, self.deadline
        searched = self.searched
        while queue and len(found) < max_paths:
            obj, depth = queue.popleft()
            searched += 1
            if not searched & 511 and time.perf_counter() > deadline:
                self.stopped = f"time limit reached after {searched} objects"
                break
            if depth >= max_depth:
                self.depth_cut = True
                continue
            try:
                fn = handlers.get(type(obj)) or _handler(obj)
                edges = list(fn(obj))
            except Exception:  # noqa: BLE001 - an object whose attributes raise: skip it
                continue
            oid = id(obj)
            below = depth + 1
            for link, child in edges:
                cid = id(child)
                if cid in parent:  # seen (a target is never entered here: it stays findable)
                    continue
                kind = kinds.get(type(child))
                if kind is None:
                    kind = _kind(child)
                if kind is _SKIP:
                    continue
                if kind is _MAY_MATCH and match(child):
                    found.append((self.chain(obj) + [(link, child)], child))
                    keep[cid] = child
                    continue
                if cid in skip or (allowed is not None and cid not in allowed):
                    continue
                parent[cid] = (oid, link, child)
                queue.append((child, below))
        self.searched = searched
        return found

    def chain(self, obj: Any) -> list[tuple[Optional[str], Any]]:
        """(label, object) from the root to ``obj``; the root's label is its root text."""
        out: list[tuple[Optional[str], Any]] = []
        oid: Optional[int] = id(obj)
        while oid is not None:
            pid, label, o = self.parent[oid]
            out.append((label, o))
            oid = pid
        out.reverse()
        return out


# what the search does with an object of a type: nothing to follow, may end a path, walk it
_SKIP, _MAY_MATCH, _WALK = "skip", "may match", "walk"
_KINDS: dict[type, str] = {}


def _kind(o: Any) -> str:
    """The search's decision for the type of ``o`` (made once per type)."""
    t = type(o)
    if issubclass(t, _ATOMIC):
        kind = _SKIP
    elif issubclass(t, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage,
                        torch.nn.Module)):
        kind = _MAY_MATCH
    else:
        kind = _WALK
    _KINDS[t] = kind
    return kind


def _to_path(chain: list[tuple[Optional[str], Any]], target: Any,
             cycle: Optional[tuple[str, ...]] = None) -> RetentionPath:
    root_label, root_obj = chain[0]
    root = str(root_label)
    if root_obj is not None and root_obj is not target:
        root = _with_type(root, root_obj)
    steps: list[str] = []
    prev = root_obj
    for label, obj in chain[1:]:
        text = label if label is not None else _label(prev, obj)
        steps.append(text if obj is target else _with_type(text, obj))
        prev = obj
    return RetentionPath(root=root, steps=tuple(steps), target=_describe_target(target),
                         cycle=cycle)


def _pending_garbage() -> list[Any]:
    """What the collector would free now, kept alive (``DEBUG_SAVEALL``), not freed."""
    flags = gc.get_debug()
    before = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(flags)
    found = gc.garbage[before:]
    del gc.garbage[before:]
    return found


def _on_cycles(objs: list[Any], allowed: set[int], deadline: float) -> set[int]:
    """The ids of the objects of ``objs`` that lie on a reference cycle inside ``allowed``.

    One pass of Tarjan's strongly-connected-components algorithm (iterative): an object is on
    a cycle when its component has more than one object or it refers to itself. Linear in the
    links, where asking each object for a cycle through it would be quadratic.
    """
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: set[int] = set()
    counter = 0
    by_id = {id(o): o for o in objs}

    def succ(o: Any) -> list[int]:
        try:
            return [id(c) for _, c in _children(o) if id(c) in allowed]
        except Exception:  # noqa: BLE001 - an object whose attributes raise: no links
            return []

    for start in objs:
        if id(start) in index:
            continue
        if time.perf_counter() > deadline:
            break
        work: list[tuple[int, list[int], int]] = [(id(start), succ(start), 0)]
        index[id(start)] = low[id(start)] = counter
        counter += 1
        stack.append(id(start))
        on_stack.add(id(start))
        while work:
            v, nexts, i = work[-1]
            if i < len(nexts):
                work[-1] = (v, nexts, i + 1)
                w = nexts[i]
                if w == v:
                    out.add(v)
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, succ(by_id[w]), 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.update(component)
    return out


def _cycle_through(start: Any, allowed: set[int], deadline: float) -> Optional[tuple[str, ...]]:
    """The links of a reference cycle from ``start`` back to it, inside ``allowed``."""
    parent: dict[int, tuple[Any, Optional[str], Any]] = {}
    queue: collections.deque[Any] = collections.deque([start])
    seen = {id(start)}
    while queue and time.perf_counter() < deadline:
        obj = queue.popleft()
        for label, child in list(_children(obj)):
            if child is start:
                links = [label if label is not None else _label(obj, child)]
                node = obj
                while node is not start:
                    prev, lab, _ = parent[id(node)]
                    links.append(lab if lab is not None else _label(prev, node))
                    node = prev
                links.reverse()
                return tuple(links)
            if id(child) in seen or id(child) not in allowed:
                continue
            seen.add(id(child))
            parent[id(child)] = (obj, label, child)
            queue.append(child)
    return None


def why_alive(
    obj: Any,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    timeout: float = DEFAULT_TIMEOUT,
    max_paths: int = DEFAULT_MAX_PATHS,
    roots: Optional[Mapping[str, Any]] = None,
    cycles: bool = True,
    _skip: int = 0,
) -> RetentionPaths:
    """The chains of references that keep ``obj``'s memory alive, shortest first.

    ``obj`` is a tensor or a storage (the search follows the storage: a view, or a tensor saved
    by an autograd node, is the same memory) or an ``nn.Module`` (followed as that object).
    Roots are module globals, the frames of every thread (but not this call's caller: the
    variable you passed in does not count), ``sys.last_traceback``/``sys.last_value``,
    IPython's user namespace and output cache, and ``roots`` (extra named roots). Links named
    on the way: containers, attributes, module parameters, buffers, submodules and hooks,
    function closures, optimizer state (also of parameters no longer in any group), autograd
    graphs (``.grad_fn``, saved tensors, ``next_functions``), exceptions and their tracebacks'
    frames. With ``cycles`` (the default), memory that no root reaches is looked for in the
    collector's pending garbage, and the path names the reference cycle.

    The search stops after ``max_depth`` links or ``timeout`` seconds and at ``max_paths``
    paths; ``result.stopped`` says when a limit cut it short (the depth limit only when nothing
    was found: chains longer than it cannot come before the ones found).

    Example:
        >>> import torch
        >>> from torchmem.capture.retention import why_alive
        >>> model = torch.nn.Linear(2, 2)
        >>> hook = lambda m, i, out, kept=[]: kept.append(out)   # a hook that keeps outputs
        >>> _ = model.register_forward_hook(hook)
        >>> loss = model(torch.ones(1, 2)).sum()
        >>> for path in why_alive(hook.__defaults__[0][0], roots={"model": model}, max_paths=1):
        ...     print(path)
        model (Linear) -> Linear forward hook <lambda> (function) -> <lambda> default arguments (tuple) [0] (list) [0] -> Tensor float32[1, 2] 8 B
        >>> why_alive("text")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: why_alive expects a torch.Tensor, a storage ...
    """
    enabled = gc.isenabled()
    gc.disable()  # an automatic collection during the search would free the cycles it reports
    try:
        with warnings.catch_warnings():  # isinstance() on deprecated torch proxies warns
            warnings.simplefilter("ignore")
            return _why_alive(obj, max_depth, timeout, max_paths, roots, cycles, _skip + 1)
    finally:
        if enabled:
            gc.enable()


def _why_alive(obj: Any, max_depth: int, timeout: float, max_paths: int,
               roots: Optional[Mapping[str, Any]], cycles: bool, skip_callers: int
               ) -> RetentionPaths:
    match = _matcher(obj)
    for name, value, low in (("max_depth", max_depth, 1), ("max_paths", max_paths, 1)):
        if not isinstance(value, int) or value < low:
            raise InvalidInputError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidInputError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    start = time.perf_counter()
    deadline = start + float(timeout)
    here = sys._getframe()
    skip = {id(here)}
    f: Optional[types.FrameType] = here.f_back
    for _ in range(1 + max(0, skip_callers)):
        if f is None:
            break
        skip.add(id(f))
        f = f.f_back
    root_list = _roots(skip, roots)
    del here, f
    search = _Search(match, max_depth, deadline, max_paths, skip)
    hits = search.run(root_list)
    del root_list
    paths = [_to_path(chain, target) for chain, target in hits]
    note = None
    if not paths and cycles and search.stopped is None:
        garbage = _pending_garbage()
        try:
            allowed = {id(g) for g in garbage}
            in_cycle = _on_cycles(garbage, allowed, deadline)
            gsearch = _Search(match, max_depth, deadline, max_paths, skip)
            ghits = gsearch.run([(f"<{type(g).__name__} object>", g) for g in garbage
                                 if id(g) in in_cycle])
            found_cycles: dict[int, Optional[tuple[str, ...]]] = {}
            for chain, target in ghits:
                root = chain[0][1]
                if id(root) not in found_cycles:  # the links named for the roots of hits only
                    found_cycles[id(root)] = _cycle_through(root, allowed, deadline)
                cycle = found_cycles[id(root)]
                if cycle is not None:
                    paths.append(_to_path(chain, target, cycle=cycle))
            search.searched += gsearch.searched
            search.stopped = search.stopped or gsearch.stopped
            gsearch.parent.clear()
            gsearch.keep.clear()
        finally:
            del garbage
    if not paths:
        note = ("no root reaches it and it is not in a reference cycle: only the caller's "
                "variables (left out) or references Python cannot see (C++ or an extension) "
                "hold it")
    if search.depth_cut and search.stopped is None and not paths:
        search.stopped = f"depth limit {max_depth} reached (longer chains were not followed)"
    paths.sort(key=len)
    result = RetentionPaths(paths[:max_paths], stopped=search.stopped, searched=search.searched,
                            note=note)
    # the search's own bookkeeping may have reached itself (its dict among the heap's objects):
    # emptied here, it is freed now instead of waiting, a cycle, for the collector (a next
    # why_alive would walk its hundreds of thousands of entries as pending garbage)
    search.keep.clear()
    search.parent.clear()
    return result
