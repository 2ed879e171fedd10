"""Which storages are the KV cache: found by walking the cache objects a model holds or returns.

During a fake run, :class:`KVWatch` installs a global module forward hook. After each module's
forward it looks for

- transformers cache objects (any instance of a ``transformers`` class named ``Cache`` or a
  subclass: ``DynamicCache``, ``StaticCache``, ...) among the module's arguments and in its
  output (``outputs.past_key_values``), and
- the attributes the user names (``kv_cache_attr=["k_cache", "v_cache"]``) on the module, or
  keyword arguments of its forward by those names (a cache passed as ``forward(x,
  kv_cache=...)``),

and walks them (their attributes, lists, tuples and dicts, a few levels deep) for tensors.
Every storage seen there is the KV cache's: the estimate reports it under ``kv_cache`` instead
of the category the tracker gave it. A dynamic cache replaces its tensors as it grows (``cat``),
so both the old and the new tensor count as cache while both are alive.

Bytes per token come from the cache tensors' shapes, read as transformers lays them out,
``(batch, kv_heads, tokens, head_dim)``: for each tensor, its bytes over ``batch x tokens``
(dimension 0 and dimension -2), summed; for a standard cache that is ``2 x layers x kv_heads x
head_dim x dtype bytes``. A static cache is allocated at its maximum length, so its ``tokens``
is that length. Tensors named by ``kv_cache_attr`` are read with the same layout.

Example:
    >>> import torch
    >>> class Attn(torch.nn.Module):
    ...     def forward(self, x):
    ...         self.k_cache = torch.zeros(2, 4, 10, 8)       # (batch, heads, tokens, head dim)
    ...         return x
    >>> seen = {}
    >>> with KVWatch(["k_cache"], lambda key: seen.setdefault(key, len(seen))) as w:
    ...     _ = Attn()(torch.ones(1))
    >>> w.max_bytes, w.bytes_per_token, w.tokens, w.batch, len(w.ids)
    (2560, 128, 10, 2, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook

from torchmem.errors import InvalidInputError
from torchmem.model.events import EventKind

__all__ = ["KVWatch", "is_cache", "kv_live_bytes", "check_attrs"]

_DEPTH = 4
_is_cache_type: dict[type, bool] = {}


def is_cache(obj: object) -> bool:
    """Whether ``obj`` is a transformers cache object (``Cache`` or a subclass).

    Example:
        >>> is_cache([1, 2]), is_cache(None)
        (False, False)
    """
    t = type(obj)
    known = _is_cache_type.get(t)
    if known is None:
        known = any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
                    for c in t.__mro__)
        _is_cache_type[t] = known
    return known


def check_attrs(attrs: object) -> tuple[str, ...]:
    """``kv_cache_attr`` as a tuple of attribute names; a clear error for anything else.

    Example:
        >>> check_attrs(["k_cache", "v_cache"]), check_attrs("kv"), check_attrs(None)
        (('k_cache', 'v_cache'), ('kv',), ())
    """
    if attrs is None:
        return ()
    names = (attrs,) if isinstance(attrs, str) else attrs
    if not isinstance(names, Iterable) or not all(
        isinstance(n, str) and n.isidentifier() for n in names
    ):
        raise InvalidInputError(
            f"kv_cache_attr must name attributes of the model's modules that hold the KV cache, "
            f"e.g. ['k_cache', 'v_cache'], got {attrs!r}"
        )
    return tuple(names)


def _tensors(obj: Any, depth: int = _DEPTH) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth <= 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth - 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth - 1)
    elif not isinstance(obj, torch.nn.Module) and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _tensors(x, depth - 1)


def _values(x: Any) -> Iterator[Any]:
    """``x`` and, for a tuple, list or dict (a ModelOutput), its items: where a cache object
    travels between modules."""
    yield x
    if isinstance(x, (tuple, list)):
        yield from x
    elif isinstance(x, dict):
        yield from x.values()


class KVWatch:
    """Collects the storages of the KV cache during a run (see the module docstring).

    ``storage_id(key)`` maps a live storage's key (``UntypedStorage._cdata``) to the tracker's
    storage id (``None`` when not tracked). After the run: ``ids`` (storage ids that were
    cache), ``max_bytes`` (the most the cache held at once, deduplicated), with the
    ``bytes_per_token``, ``tokens`` and ``batch`` read at that moment, and ``sources`` (what
    held it).

    Example:
        >>> w = KVWatch([], lambda key: None)
        >>> with w:
        ...     pass
        >>> w.max_bytes, w.bytes_per_sequence, sorted(w.sources)
        (0, 0, [])
    """

    def __init__(self, attrs: Sequence[str], storage_id: Callable[[int], int | None]) -> None:
        self.attrs = tuple(attrs)
        self.storage_id = storage_id
        self.ids: set[int] = set()
        self.max_bytes = 0
        self.bytes_per_token = 0
        self.tokens = 0
        self.batch = 0
        self.sources: set[str] = set()
        self._handle: Any = None

    def __enter__(self) -> KVWatch:
        self._handle = register_module_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def bytes_per_sequence(self) -> int:
        """The cache's bytes per sequence of the batch at its fullest (``max_bytes / batch``).

        Example:
            >>> w = KVWatch([], lambda key: None); w.max_bytes, w.batch = 4096, 4
            >>> w.bytes_per_sequence
            1024
        """
        return self.max_bytes // self.batch if self.batch else 0

    def _hook(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        seen: dict[int, tuple[Any, str]] = {}
        for x in (*args, *kwargs.values(), output):
            for v in _values(x):
                if is_cache(v):
                    seen[id(v)] = (v, f"transformers {type(v).__name__}")
        for attr in self.attrs:
            v = module.__dict__.get(attr)
            if v is None:
                v = getattr(module, attr, None)
            if v is not None:
                seen[id(v)] = (v, f"attribute {attr!r}")
            v = kwargs.get(attr)
            if v is not None:
                seen[id(v)] = (v, f"argument {attr!r}")
        if seen:
            self._observe(seen.values())

    def _observe(self, holders: Iterable[tuple[Any, str]]) -> None:
        keys: set[int] = set()
        total = 0
        per_token = 0.0
        tokens = batch = 0
        for obj, label in holders:
            found = False
            for t in _tensors(obj):
                if t.dim() < 2:
                    continue
                found = True
                s = t.untyped_storage()
                key = s._cdata
                if key not in keys:
                    keys.add(key)
                    total += s.nbytes()
                    sid = self.storage_id(key)
                    if sid is not None:
                        self.ids.add(sid)
                b, n = t.shape[0], t.shape[-2]
                if b and n:
                    per_token += t.numel() * t.element_size() / (b * n)
                    tokens, batch = max(tokens, n), max(batch, b)
            if found:
                self.sources.add(label)
        if total > self.max_bytes:
            self.max_bytes = total
            self.bytes_per_token = round(per_token)
            self.tokens, self.batch = tokens, batch


def kv_live_bytes(events: Iterable[Any], ids: set[int], at: Sequence[int]) -> list[int]:
    """Bytes of the storages in ``ids`` live after each event sequence number in ``at``
    (ascending), from a tracker's events.

    Example:
        >>> from torchmem.model.events import Event
        >>> evs = [Event(0, EventKind.ALLOC, 0, "cpu", 100, 1), Event(1, EventKind.ALLOC, 0,
        ...        "cpu", 50, 2), Event(2, EventKind.FREE, 0, "cpu", 100, 1)]
        >>> kv_live_bytes(evs, {1}, [1, 2])
        [100, 0]
    """
    out: list[int] = []
    pending = list(at)
    live = 0
    if not pending:
        return out
    for ev in events:
        if ev.storage in ids:
            if ev.kind == EventKind.ALLOC:
                live += ev.nbytes
            elif ev.kind == EventKind.FREE:
                live -= ev.nbytes
        while pending and ev.seq >= pending[0]:
            out.append(live)
            pending.pop(0)
        if not pending:
            break
    out.extend(live for _ in pending)
    return out
