"""Storage census: exact tensor memory of a module, an optimizer, given tensors or the process.

:func:`inspect_memory` walks what you give it, names every tensor (``encoder.layers.0.linear1.
weight``, ``encoder.layers.0.linear1.weight.grad``, ``state[encoder.0.weight].exp_avg``), groups
tensors by storage and returns a :class:`~torchmem.model.census.MemoryReport` with per-device,
per-category and per-tensor numbers in which shared storage (tied weights, views, buffers that
view parameters, ``expand``) is counted once and the sharing is listed.

The work is linear in the number of tensors (one dict lookup per tensor, a sort per storage), so
a scan of every live tensor (``all_live=True``, based on :func:`gc.get_objects`) stays fast with
tens of thousands of tensors.

Example:
    >>> import torch, torchmem
    >>> lin = torch.nn.Linear(4, 4)                         # 64 + 16 bytes
    >>> lin.register_buffer("w_t", lin.weight.detach().t()) # a view: no new bytes
    >>> r = torchmem.inspect_memory(lin)
    >>> r.unique_bytes, r.naive_bytes
    ({'cpu': 80}, {'cpu': 144})
    >>> r.sharing_groups
    [['weight', 'w_t']]
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from itertools import compress
from operator import add, attrgetter, itemgetter, methodcaller, mul, not_, sub
from typing import Any

import torch

from torchmem._containers import tensors_with_paths
from torchmem.capture.storage import _check_tensor, device_str, merge_spans
from torchmem.errors import InvalidInputError, UnsupportedTensorError
from torchmem.model.census import MemoryReport, StorageRecord, TensorRecord

__all__ = ["inspect_memory", "Census", "param_names"]


_DEVICE = attrgetter("device")
_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")
_LAYOUT = attrgetter("layout")
_IS_NESTED = attrgetter("is_nested")
_STORAGE = methodcaller("untyped_storage")
_STRIDE = methodcaller("stride")
_OFFSET = methodcaller("storage_offset")
_CONTIGUOUS = methodcaller("is_contiguous")
_NUMEL = methodcaller("numel")
_REQUIRES_GRAD = attrgetter("requires_grad")
_type_name = attrgetter("__name__")
_CDATA = attrgetter("_cdata")
_NBYTES = methodcaller("nbytes")
_FIRST = itemgetter(0)
_REST = itemgetter(slice(1, None))


def _one(x: str) -> list[str]:
    return [x]


def _device_names(devices: list[torch.device]) -> list[str]:
    """``device_str`` of each device, computed once per distinct device."""
    names = {d: device_str(d) for d in set(devices)}
    return list(map(names.__getitem__, devices))


def _dtype_info(tensors: list[torch.Tensor]) -> tuple[list[str], list[int]]:
    """The dtype names (without ``torch.``) and element sizes of ``tensors``, each computed
    once per distinct dtype."""
    dtypes = list(map(_DTYPE, tensors))
    one = dict(zip(dtypes, tensors))  # a tensor of each dtype
    names = {d: str(d)[6:] for d in one}
    sizes = {d: t.element_size() for d, t in one.items()}
    return list(map(names.__getitem__, dtypes)), list(map(sizes.__getitem__, dtypes))


def param_names(module: torch.nn.Module) -> dict[int, str]:
    """``{id(param): qualified name}`` for the parameters of ``module`` (first name wins).

    The ids are only meaningful while ``module`` holds its parameters; use the mapping at once.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> sorted(param_names(m).values())
        ['0.bias', '0.weight']
    """
    out: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


class Census:
    """Accumulates named tensors and builds a :class:`MemoryReport` (used by inspect_memory).

    Each distinct tensor object becomes one row; further names of the same object become its
    aliases. The census holds strong references to the tensors it was given until
    :meth:`report` returns, so identities cannot be reused meanwhile.

    Example:
        >>> import torch
        >>> c = Census()
        >>> x = torch.zeros(4)
        >>> c.add("x", x, "other"); c.add("x_view", x[1:], "other"); c.add("again", x, "other")
        >>> r = c.report()
        >>> [t.names for t in r.tensors], r.unique_bytes
        ([['x', 'again'], ['x_view']], {'cpu': 16})
    """

    def __init__(self) -> None:
        self._index: dict[int, int] = {}  # id(tensor) -> row; valid because _keep holds them
        self._keep: list[torch.Tensor] = []
        self._storages: list[torch.UntypedStorage] = []
        self._names: list[list[str]] = []
        self._cats: list[str] = []
        self.skipped = 0
        self.skipped_kinds: dict[str, int] = {}

    def __contains__(self, t: object) -> bool:
        return id(t) in self._index and self._keep[self._index[id(t)]] is t

    def name_of(self, t: torch.Tensor) -> str | None:
        """The first name ``t`` was added under, or None.

        Example:
            >>> import torch
            >>> c = Census(); x = torch.zeros(1); c.add("x", x, "other"); c.name_of(x)
            'x'
        """
        i = self._index.get(id(t))
        if i is None or self._keep[i] is not t:
            return None
        return self._names[i][0]

    def add(self, name: str, t: torch.Tensor, category: str, *, strict: bool = True) -> None:
        """Add tensor ``t`` under ``name``; a second name for the same object becomes an alias.

        With ``strict=False`` an unmeasurable tensor (sparse, nested, no storage) is counted in
        ``skipped`` instead of raising.

        Example:
            >>> import torch
            >>> c = Census(); c.add("s", torch.eye(2).to_sparse(), "other", strict=False)
            >>> c.skipped, c.skipped_kinds
            (1, {'layout torch.sparse_coo': 1})
        """
        i = self._index.get(id(t))
        if i is not None and self._keep[i] is t:
            if name not in self._names[i]:
                self._names[i].append(name)
            return
        try:
            _check_tensor(t, name)
            storage = t.untyped_storage()
        except UnsupportedTensorError:
            if strict:
                raise
            kind = "nested" if getattr(t, "is_nested", False) else f"layout {t.layout}"
            self._skip(kind)
            return
        except (RuntimeError, NotImplementedError, TypeError) as e:
            if strict:
                raise UnsupportedTensorError(
                    f"{name}: cannot read the storage of this {type(t).__name__} ({e}); "
                    "torchmem measures tensors that have an untyped storage. Fix: pass its "
                    "inner tensors instead."
                ) from e
            self._skip(f"no storage ({type(t).__name__})")
            return
        self._index[id(t)] = len(self._keep)
        self._keep.append(t)
        self._storages.append(storage)
        self._names.append([name])
        self._cats.append(category)

    def add_distinct(self, names: list[str], tensors: list[torch.Tensor], category: str) -> bool:
        """Add distinct tensor objects, none added before, in one pass; ``False`` (nothing added)
        when one of them is not a plain strided tensor with a storage (then use :meth:`add`).

        The bulk path of a scan of every live tensor: the checks of :meth:`add` are read for
        all tensors at once.

        Example:
            >>> import torch
            >>> c = Census(); x = torch.zeros(2)
            >>> c.add_distinct(["a", "b"], [x, x[1:]], "other"), c.report().unique_bytes
            (True, {'cpu': 8})
            >>> Census().add_distinct(["s"], [torch.eye(2).to_sparse()], "other")
            False
        """
        if len(self):
            return False
        strided = torch.strided
        try:
            if any(lay is not strided for lay in map(_LAYOUT, tensors)) or any(
                map(_IS_NESTED, tensors)
            ):
                return False
            storages = list(map(_STORAGE, tensors))
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            return False
        self._index = dict(zip(map(id, tensors), range(len(tensors))))
        self._keep = list(tensors)
        self._storages = storages
        self._names = [[n] for n in names]
        self._cats = [category] * len(tensors)
        return True

    def _skip(self, kind: str) -> None:
        self.skipped += 1
        self.skipped_kinds[kind] = self.skipped_kinds.get(kind, 0) + 1

    def __len__(self) -> int:
        return len(self._keep)

    def report(self, source: str = "") -> MemoryReport:
        """Group by storage, merge byte spans and return the report.

        Every column is read from the tensors now; the records themselves are built when the
        report's ``tensors`` or ``storages`` are first read (see :class:`_Rows`).

        Example:
            >>> Census().report().tensors
            []
        """
        return MemoryReport._deferred(self.rows(), source=source, skipped=self.skipped,
                                      skipped_kinds=self.skipped_kinds)

    def rows(self) -> _Rows:
        """The census as columns (one entry per tensor), read from the tensors in one pass each.

        Example:
            >>> import torch
            >>> c = Census(); x = torch.zeros(3); c.add("x", x, "other"); c.add("v", x[1:], "other")
            >>> r = c.rows()
            >>> r.first_names, r.devices, r.unique_bytes()
            (['x', 'v'], ['cpu'], {'cpu': 12})
        """
        # Column by column: each attribute read by map() in C, no Python frame per tensor (a
        # scan of every live tensor has tens of thousands of rows).
        keep = self._keep
        n = len(keep)
        r = _Rows()
        r.names = list(self._names)
        r.cats = list(self._cats)
        r.devs = _device_names(list(map(_DEVICE, keep)))
        r.dtype_names, sizes = _dtype_info(keep)
        r.sizes = sizes
        r.shapes = shapes = list(map(_SHAPE, keep))  # torch.Size: tuples when records are built
        r.strides = list(map(_STRIDE, keep))
        r.offsets = offsets = list(map(_OFFSET, keep))
        numels = list(map(_NUMEL, keep))
        # byte spans, as torchmem.capture.storage.tensor_span: a dense row-major tensor views
        # its numel elements from its offset (an empty one views nothing); others are fixed up
        r.starts = starts = list(map(mul, offsets, sizes))
        r.ends = ends = list(map(mul, map(add, offsets, numels), sizes))
        for i in compress(range(n), map(not_, map(_CONTIGUOUS, keep))):
            if numels[i]:
                lo = hi = 0
                for size, st in zip(shapes[i], r.strides[i]):
                    reach = (size - 1) * st
                    if reach < 0:
                        lo += reach
                    else:
                        hi += reach
                es, offset = sizes[i], offsets[i]
                starts[i], ends[i] = (offset + lo) * es, (offset + hi + 1) * es
        storage_row: dict[int, int] = {}  # storage _cdata -> index (storages held in _storages)
        r.sids = [storage_row.setdefault(k, len(storage_row)) for k in map(_CDATA, self._storages)]
        r.distinct = len(storage_row) == n
        r.storage_nbytes = list(map(_NBYTES, self._storages))
        r.requires_grad = list(map(_REQUIRES_GRAD, keep))
        r.type_names = list(map(_type_name, map(type, keep)))
        return r


class _Rows:
    """A census's columns, one entry per tensor, holding plain values only (no tensor), and the
    records built from them on demand (:meth:`build`, called by a report when its records are
    first read); ``first_names``, ``devices`` and :meth:`unique_bytes` answer a printed report
    without building them.

    Example:
        >>> import torch
        >>> c = Census(); c.add("w", torch.zeros(2, 2), "parameter")
        >>> tensors, storages = c.rows().build()
        >>> tensors[0].shape, storages[0].used_bytes
        ((2, 2), 16)
    """

    __slots__ = ("names", "cats", "devs", "dtype_names", "sizes", "shapes", "strides",
                 "offsets", "starts", "ends", "sids", "distinct", "storage_nbytes",
                 "requires_grad", "type_names")

    names: list[list[str]]
    cats: list[str]
    devs: list[str]
    dtype_names: list[str]
    sizes: list[int]
    shapes: list[torch.Size]
    strides: list[tuple[int, ...]]
    offsets: list[int]
    starts: list[int]
    ends: list[int]
    sids: list[int]
    distinct: bool
    storage_nbytes: list[int]
    requires_grad: list[bool]
    type_names: list[str]

    @property
    def first_names(self) -> list[str]:
        """Each tensor's first name (later names are its aliases)."""
        return list(map(_FIRST, self.names))

    @property
    def devices(self) -> list[str]:
        """The devices present, in :attr:`MemoryReport.devices`' order."""
        return sorted(set(self.devs), key=lambda d: (d != "cpu", d))

    def unique_bytes(self) -> dict[str, int]:
        """Per device, the bytes viewed, each byte once (:attr:`MemoryReport.unique_bytes`)."""
        if not self.distinct:  # shared storages: their spans are merged by the records
            return MemoryReport(storages=self.build()[1]).unique_bytes
        devs = set(self.devs)
        if len(devs) == 1:
            return {devs.pop(): sum(map(sub, self.ends, self.starts))}
        out: dict[str, int] = {}
        for d, used in zip(self.devs, map(sub, self.ends, self.starts)):
            out[d] = out.get(d, 0) + used
        return out

    def build(self) -> tuple[list[TensorRecord], list[StorageRecord]]:
        """The tensor and storage records (:class:`MemoryReport`'s ``tensors``, ``storages``)."""
        names, cats, devs, starts, ends = self.names, self.cats, self.devs, self.starts, self.ends
        n = len(names)
        storages: list[StorageRecord]
        if self.distinct:  # each tensor its own storage: the bytes its span covers
            storages = list(map(StorageRecord, range(n), devs, self.storage_nbytes,
                                map(sub, ends, starts), map(list, names), map(_one, cats)))
        else:
            storages = []
            spans: list[list[tuple[int, int]]] = []
            for i, si in enumerate(self.sids):
                cat = cats[i]
                if si == len(storages):
                    storages.append(StorageRecord(si, devs[i], self.storage_nbytes[i], 0,
                                                  list(names[i]), [cat]))
                    spans.append([])
                else:
                    rec = storages[si]
                    rec.names.extend(names[i])
                    if cat not in rec.categories:
                        rec.categories.append(cat)
                spans[si].append((starts[i], ends[i]))
            for rec, sp in zip(storages, spans):
                if len(sp) == 1:
                    rec.used_bytes = sp[0][1] - sp[0][0]
                else:
                    rec.used_bytes = sum(m.nbytes for m in merge_spans(sp))
        tensors = list(map(
            TensorRecord, map(_FIRST, names), cats, devs, self.dtype_names,
            map(tuple, self.shapes), self.strides, self.offsets, self.sizes, starts, ends,
            self.sids, map(_REST, names), self.requires_grad, self.type_names,
        ))
        return tensors, storages


def _add_module(c: Census, module: torch.nn.Module, prefix: str = "") -> None:
    for name, p in module.named_parameters(remove_duplicate=False):
        c.add(prefix + name, p, "parameter")
    for name, b in module.named_buffers(remove_duplicate=False):
        c.add(prefix + name, b, "buffer")
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is not None:
            c.add(prefix + name + ".grad", p.grad, "gradient")


def _add_optimizer(c: Census, optimizer: torch.optim.Optimizer) -> None:
    names: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            known = c.name_of(p)
            if known is None:
                known = f"param_groups[{g}].params[{i}]"
                c.add(known, p, "parameter")
                if p.grad is not None:
                    c.add(known + ".grad", p.grad, "gradient")
            names.setdefault(id(p), known)
    for j, (p, st) in enumerate(optimizer.state.items()):
        pname = names.get(id(p)) if isinstance(p, torch.Tensor) else None
        if pname is None:
            pname = f"#{j}"
        for key, value in st.items():
            for name, t in tensors_with_paths(value, f"state[{pname}].{key}"):
                c.add(name, t, "optimizer_state")


def _add_tensors(c: Census, tensors: Any) -> None:
    if isinstance(tensors, torch.Tensor):
        c.add("tensor", tensors, "other")
        return
    if isinstance(tensors, Mapping):
        for k, v in tensors.items():
            if not isinstance(v, torch.Tensor):
                raise InvalidInputError(
                    f"tensors[{k!r}] should be a torch.Tensor, got {type(v).__name__}; "
                    "fix: pass a mapping of names to tensors"
                )
            c.add(str(k), v, "other")
        return
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise InvalidInputError(
            "tensors= expected a tensor, an iterable of tensors or a mapping name -> tensor, "
            f"got {type(tensors).__name__}"
        )
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(
                f"tensors[{i}] should be a torch.Tensor, got {type(t).__name__}"
            )
        c.add(f"tensors[{i}]", t, "other")


def _tensor_types() -> set[type]:
    """torch.Tensor and every subclass currently defined (Parameter, FakeTensor, user classes)."""
    out: set[type] = set()
    stack: list[type] = [torch.Tensor]
    while stack:
        cls = stack.pop()
        if cls not in out:
            out.add(cls)
            stack.extend(cls.__subclasses__())
    return out


def _add_live(c: Census) -> None:
    # One set lookup per gc object on its exact type (a comprehension, no per-object Python
    # call); type() rather than isinstance(), which consults __class__ and makes some lazy
    # objects (deprecated torch.distributed aliases) emit warnings.
    # itertools.compress over map(type): the filter runs in C, not a Python frame per object
    types = _tensor_types()
    objs = gc.get_objects()
    found = list(compress(objs, map(types.__contains__, map(type, objs))))
    del objs
    if len(c):
        found = [t for t in found if t not in c]
    elif c.add_distinct([f"live[{n}]" for n in range(len(found))], found, "other"):
        return
    for n, obj in enumerate(found):
        c.add(f"live[{n}]", obj, "other", strict=False)


def inspect_memory(
    module: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    tensors: torch.Tensor | Iterable[torch.Tensor] | Mapping[str, torch.Tensor] | None = None,
    all_live: bool = False,
    *,
    collect_garbage: bool = False,
) -> MemoryReport:
    """Exact storage report of a module, an optimizer, given tensors and/or every live tensor.

    - ``module``: parameters (category ``parameter``), buffers (``buffer``) and ``.grad`` of
      parameters (``gradient``), named by their qualified names; a tied weight lists all its names.
    - ``optimizer``: its state tensors (``optimizer_state``), named ``state[<param>].<key>``
      where ``<param>`` is the qualified parameter name when ``module`` is given too, else
      ``param_groups[g].params[i]``; parameters not in ``module`` are added as parameters.
    - ``tensors``: a tensor, an iterable (named ``tensors[i]``) or a mapping ``name -> tensor``.
    - ``all_live=True``: every tensor the garbage collector can see, named ``live[i]`` unless
      already named above. Tensors in unreachable reference cycles still hold their memory
      until the collector runs, so by default they are reported as they are, and the scan has
      no side effects; ``collect_garbage=True`` runs ``gc.collect()`` first (as torchlinops'
      MemReporter always did; it runs finalizers, so it changes the program's state);
      unmeasurable ones (sparse, nested) are counted in ``report.skipped``.

    With no arguments, every live tensor is reported. Raises
    :class:`~torchmem.errors.InvalidInputError` for arguments of the wrong type and
    :class:`~torchmem.errors.UnsupportedTensorError` for sparse/nested tensors given explicitly.

    Example:
        >>> import torch, torchmem
        >>> emb = torch.nn.Embedding(10, 4); head = torch.nn.Linear(4, 10, bias=False)
        >>> head.weight = emb.weight                          # tied: 160 bytes once
        >>> model = torch.nn.Sequential(emb, head)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.tensor([1, 2])).sum().backward(); opt.step()
        >>> r = torchmem.inspect_memory(model, opt)
        >>> r.by_category
        {'cpu': {'parameter': 160, 'gradient': 160, 'optimizer_state': 160}}
        >>> r.tensor("1.weight").name, [t.name for t in r.tensors][1:]
        ('0.weight', ['0.weight.grad', 'state[0.weight].momentum_buffer'])
    """
    if module is not None and not isinstance(module, torch.nn.Module):
        raise InvalidInputError(
            f"module= expected a torch.nn.Module, got {type(module).__module__}."
            f"{type(module).__name__}; fix: pass the model (or use tensors= for plain tensors)"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"optimizer= expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    nothing = module is None and optimizer is None and tensors is None
    # The census allocates a few objects per tensor; with tens of thousands of tensors the
    # cyclic GC would otherwise rescan the whole heap repeatedly (quadratic-looking time).
    # Pause it for the duration and restore the caller's setting.
    was_enabled = gc.isenabled()
    if all_live or nothing:
        _collect_first = collect_garbage
    else:
        _collect_first = False
    if _collect_first:
        gc.collect()
    gc.disable()
    try:
        return _inspect(module, optimizer, tensors, all_live or nothing)
    finally:
        if was_enabled:
            gc.enable()


def _inspect(
    module: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    tensors: Any,
    live: bool,
) -> MemoryReport:
    c = Census()
    parts = []
    if module is not None:
        _add_module(c, module)
        parts.append(f"module {type(module).__name__}")
    if optimizer is not None:
        _add_optimizer(c, optimizer)
        parts.append(f"optimizer {type(optimizer).__name__}")
    if tensors is not None:
        _add_tensors(c, tensors)
        parts.append("tensors")
    if live:
        _add_live(c)
        parts.append("all live tensors")
    return c.report(source=", ".join(parts))
