"""Transfers as linear operators: :class:`ToDevice`, composed with ``@`` into :class:`Chain` s.

A device transfer is linear: moving ``a*x + b*y`` moves ``a*x`` and ``b*y``. Its adjoint is the
transfer back and its normal ``T.H @ T`` is the identity, so it composes with other linear
operators (and with plain callables that carry their adjoint, see :class:`LinearOp`) and
adjoints stay right through a composition: ``(A @ B).H`` applies ``A.H`` first, then ``B.H``.

Conventions: ``A @ B`` is "B, then A" (as in mathematics); ``Chain(B, A)`` lists operators in
the order they are *applied*, so ``A @ B == Chain(B, A)``. ``A @ tensor`` applies ``A``.

Reprs are flat: they show devices and streams, never nest deeper than a few levels, and print
``<cycle>`` for an operator that contains itself, so they cannot recurse without bound.

Example:
    >>> import torch
    >>> T = ToDevice("cpu", "meta", ioshape=("N",))
    >>> T, T.H, T.N
    (ToDevice(cpu -> meta, ioshape=('N',)), ToDevice(meta -> cpu, ioshape=('N',)), Identity(ioshape=('N',)))
    >>> double = LinearOp(lambda x: 2 * x, adjoint=lambda y: 2 * y, name="double")
    >>> A = T @ double                       # double, then move to meta
    >>> A
    Chain(double -> ToDevice(cpu -> meta, ioshape=('N',)))
    >>> A.H
    Chain(ToDevice(meta -> cpu, ioshape=('N',)) -> double.H)
    >>> A(torch.ones(3)).device.type
    'meta'
"""

from __future__ import annotations

import copy
import reprlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from torchmem.errors import InvalidInputError
from torchmem.transfer.engine import _transfer
from torchmem.transfer.staging import DEFAULT_CHUNK_BYTES, StagingBuffers, _chunk_size
from torchmem.transfer.streams import (
    DeviceLike,
    DeviceSpec,
    device_available,
    is_accelerator,
    peek_transfer_stream,
    transfer_stream,
)

__all__ = ["Operator", "Identity", "LinearOp", "Chain", "ToDevice", "adjoint_of"]

_MAX_DEPTH = 4  # reprs show nested operators this deep, then "..."
_MAX_ITEMS = 12  # and at most this many operators of one chain
_repr_state = threading.local()


def _short(obj: Any, depth: int) -> str:
    """Bounded, cycle-safe text for an operator or callable."""
    if isinstance(obj, Operator):
        return obj._repr(depth)
    if isinstance(obj, nn.Module):
        return type(obj).__name__  # never nn.Module's recursive repr
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(name, str):
        return name
    return reprlib.repr(obj)


class Operator(nn.Module):
    """Base class of torchmem's linear operators (an ``nn.Module``).

    Subclasses implement ``forward`` and :meth:`adjoint`. ``.H`` caches the adjoint (and the
    adjoint's ``.H`` is this operator again); ``.N`` / :meth:`normal` is ``A.H @ A`` unless a
    subclass knows better. The cache is kept outside ``nn.Module``'s submodule registry, so
    ``A`` and ``A.H`` referencing each other never makes ``repr``, ``modules()`` or ``.to()``
    loop.

    Example:
        >>> I = Identity()
        >>> I.H is I, I.N is I
        (True, True)
    """

    def adjoint(self) -> Operator:
        """A new operator for the adjoint (override in subclasses).

        Example:
            >>> Identity().adjoint()
            Identity()
        """
        raise NotImplementedError(f"{type(self).__name__} does not define adjoint()")

    @property
    def H(self) -> Operator:
        """The adjoint, built once and cached (``A.H.H is A``).

        Example:
            >>> T = ToDevice("cpu", "meta"); T.H.H is T
            True
        """
        cache = self.__dict__.get("_adjoint_cache")
        if cache:
            return cache[0]
        adj = self.adjoint()
        if adj is not self:
            adj.__dict__["_adjoint_cache"] = [self]
        self.__dict__["_adjoint_cache"] = [adj]
        return adj

    def normal(self) -> Operator:
        """The normal operator ``A.H @ A``.

        Example:
            >>> LinearOp(abs, adjoint=abs, name="f").normal()
            Chain(f -> f.H)
        """
        return Chain(self, self.H)

    @property
    def N(self) -> Operator:
        """The normal operator, built once and cached.

        Example:
            >>> ToDevice("cpu", "meta").N
            Identity()
        """
        cache = self.__dict__.get("_normal_cache")
        if cache:
            return cache[0]
        n = self.normal()
        self.__dict__["_normal_cache"] = [n]
        return n

    def split_forward(
        self, ibatch: Optional[Sequence[slice]] = None, obatch: Optional[Sequence[slice]] = None
    ) -> Operator:
        """An independent copy of this operator for one tile of its input/output.

        ``ibatch`` / ``obatch`` are slices, one per input / output dimension. The default copies
        the operator (no data depends on the tile).

        Example:
            >>> I = Identity(); J = I.split_forward(); J is not I
            True
        """
        new = copy.copy(self)
        new.__dict__.pop("_adjoint_cache", None)
        new.__dict__.pop("_normal_cache", None)
        new._modules = dict(self._modules)  # type: ignore[assignment]
        new._parameters = dict(self._parameters)  # type: ignore[assignment]
        new._buffers = dict(self._buffers)  # type: ignore[assignment]
        return new

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, torch.Tensor):
            return self(other)
        if callable(other):
            return Chain(other, self)
        return NotImplemented

    def __rmatmul__(self, other: Any) -> Any:
        if callable(other) and not isinstance(other, torch.Tensor):
            return Chain(self, other)
        return NotImplemented

    def _repr(self, depth: int) -> str:
        return type(self).__name__ + "()"

    def __repr__(self) -> str:
        return self._repr(0)


def adjoint_of(op: Any) -> Any:
    """The adjoint of an operator or callable: ``op.H`` or ``op.adjoint()`` when it has one.

    Anything else has no known adjoint: wrap it in :class:`LinearOp` with its adjoint.

    Example:
        >>> adjoint_of(ToDevice("cpu", "meta"))
        ToDevice(meta -> cpu)
        >>> adjoint_of(abs)
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: abs has no adjoint (no .H or .adjoint()). Fix: wrap it as torchmem.transfer.LinearOp(fn, adjoint=fn_adjoint).
    """
    if isinstance(op, Operator):
        return op.H
    h = getattr(op, "H", None)
    if h is not None and not isinstance(op, torch.Tensor):
        return h
    adj = getattr(op, "adjoint", None)
    if callable(adj):
        return adj()
    raise InvalidInputError(
        f"{_short(op, _MAX_DEPTH)} has no adjoint (no .H or .adjoint()). Fix: wrap it as "
        "torchmem.transfer.LinearOp(fn, adjoint=fn_adjoint)."
    )


class Identity(Operator):
    """The identity operator (the normal of a transfer): returns its input unchanged.

    Example:
        >>> import torch
        >>> x = torch.ones(2); Identity(("N",))(x) is x
        True
    """

    def __init__(self, ioshape: Optional[Iterable[str]] = None) -> None:
        super().__init__()
        self.ioshape = tuple(ioshape) if ioshape is not None else None

    def forward(self, x: Any) -> Any:
        return x

    def adjoint(self) -> Operator:
        return self

    def normal(self) -> Operator:
        return self

    def _repr(self, depth: int) -> str:
        return f"Identity(ioshape={self.ioshape})" if self.ioshape is not None else "Identity()"


class LinearOp(Operator):
    """A callable with a known adjoint callable, usable in chains (``adjoint`` is required).

    Example:
        >>> import torch
        >>> M = torch.tensor([[1., 2.], [3., 4.]])
        >>> A = LinearOp(lambda x: M @ x, adjoint=lambda y: M.T @ y, name="M")
        >>> A(torch.tensor([1., 0.])), A.H(torch.tensor([1., 0.]))
        (tensor([1., 3.]), tensor([1., 2.]))
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        adjoint: Callable[[Any], Any],
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        if not callable(fn) or not callable(adjoint):
            raise InvalidInputError(
                f"LinearOp needs two callables (fn and adjoint), got {type(fn).__name__} and "
                f"{type(adjoint).__name__}. Fix: pass adjoint=<function computing A^H y>."
            )
        self.fn = fn
        self.adjoint_fn = adjoint
        self.name = name if name is not None else _short(fn, _MAX_DEPTH)

    def forward(self, x: Any) -> Any:
        return self.fn(x)

    def adjoint(self) -> Operator:
        name = self.name[:-2] if self.name.endswith(".H") else self.name + ".H"
        return LinearOp(self.adjoint_fn, adjoint=self.fn, name=name)

    def _repr(self, depth: int) -> str:
        return self.name


class Chain(Operator):
    """Operators and callables applied in the order given: ``Chain(A, B)(x) == B(A(x))``.

    Nested chains are flattened and identities dropped. ``Chain(...).H`` is the chain of the
    adjoints in reverse order, and ``.normal()`` uses the last operator's own normal (so a chain
    ending in a transfer does not move the data there and back). Module elements are registered
    as submodules (``.parameters()`` and ``.to()`` see them) unless that would make the module
    tree cyclic. The repr is bounded and cycle-safe.

    Example:
        >>> import torch
        >>> c = Chain(LinearOp(lambda x: x + 0, adjoint=lambda x: x, name="f"), ToDevice("cpu", "meta"))
        >>> c
        Chain(f -> ToDevice(cpu -> meta))
        >>> c.N
        Chain(f -> f.H)
        >>> len(c), c(torch.ones(2)).device.type
        (2, 'meta')
    """

    def __init__(self, *ops: Any) -> None:
        super().__init__()
        self._ops: list[Any] = []
        for op in ops:
            self.append(op)

    def append(self, op: Any) -> Chain:
        """Apply ``op`` after the current operators (a chain is flattened into this one).

        Example:
            >>> c = Chain(); _ = c.append(Identity()); len(c)
            0
        """
        if isinstance(op, Chain) and op is not self:
            for inner in list(op._ops):
                self.append(inner)
            return self
        if isinstance(op, Identity):
            return self
        if not callable(op):
            raise InvalidInputError(
                f"Chain elements must be callables (operators, modules or functions), got "
                f"{type(op).__name__}. Fix: wrap data in a LinearOp or apply it with @."
            )
        self._ops.append(op)
        if isinstance(op, nn.Module) and not any(m is self for m in op.modules()):
            self.add_module(str(len(self._ops) - 1), op)
        self.__dict__.pop("_adjoint_cache", None)
        self.__dict__.pop("_normal_cache", None)
        return self

    @property
    def ops(self) -> tuple[Any, ...]:
        """The operators, in the order they are applied.

        Example:
            >>> T = ToDevice("cpu", "meta"); Chain(T).ops == (T,)
            True
        """
        return tuple(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def forward(self, x: Any) -> Any:
        for op in self._ops:
            x = op(x)
        return x

    def _check_acyclic(self, what: str) -> None:
        if any(op is self for op in self._ops):
            raise InvalidInputError(
                f"cannot take the {what} of a chain that contains itself. Fix: build the chain "
                "without appending it to itself."
            )

    def adjoint(self) -> Operator:
        self._check_acyclic("adjoint")
        return Chain(*[adjoint_of(op) for op in reversed(self._ops)])

    def normal(self) -> Operator:
        self._check_acyclic("normal")
        if not self._ops:
            return Identity()
        *head, last = self._ops
        inner = last.normal() if isinstance(last, Operator) else Chain(last, adjoint_of(last))
        return Chain(*head, inner, *[adjoint_of(op) for op in reversed(head)])

    def split_forward(
        self, ibatch: Optional[Sequence[slice]] = None, obatch: Optional[Sequence[slice]] = None
    ) -> Operator:
        """A new chain of each element's ``split_forward`` copy (plain callables are shared).

        Example:
            >>> T = ToDevice("cpu", "meta"); c = Chain(T); s = c.split_forward()
            >>> s.ops[0] is not T and s.ops[0].ospec == T.ospec
            True
        """
        parts = []
        for op in self._ops:
            if op is self:
                raise InvalidInputError(
                    "cannot split a chain that contains itself. Fix: build the chain without "
                    "appending it to itself."
                )
            split = getattr(op, "split_forward", None)
            parts.append(split(ibatch, obatch) if callable(split) else op)
        return Chain(*parts)

    def _repr(self, depth: int) -> str:
        active: set[int] = getattr(_repr_state, "active", None) or set()
        _repr_state.active = active
        if id(self) in active:
            return "<cycle>"
        if depth >= _MAX_DEPTH:
            return f"Chain(<{len(self._ops)} ops>)"
        active.add(id(self))
        try:
            shown = [_short(op, depth + 1) for op in self._ops[:_MAX_ITEMS]]
            if len(self._ops) > _MAX_ITEMS:
                shown.append(f"... ({len(self._ops) - _MAX_ITEMS} more)")
        finally:
            active.discard(id(self))
        return "Chain(" + " -> ".join(shown) + ")"


class ToDevice(Operator):
    """Move tensors from ``idevice`` to ``odevice`` as a linear operator (an ``nn.Module``).

    ``forward`` moves a tensor on ``idevice`` to ``odevice`` (see :func:`torchmem.transfer` for
    how each device pair is handled: streams, events, pinned staging); ``.H`` / :meth:`adjoint`
    moves it back; :meth:`normal` is the identity. ``idevice`` / ``odevice`` are devices or
    :class:`DeviceSpec` s (to choose compute and transfer streams). ``ioshape`` optionally names
    the dimensions (the same for input and output); when given without ``"..."``, inputs must have
    that many dimensions. Non-pinned CPU inputs bound for an accelerator are staged through a
    reusable pair of pinned buffers of ``chunk_bytes`` that this operator keeps. ``ledger``
    (a :class:`torchmem.Ledger` or anything with ``allocate``/``free``) is told about every
    tensor the operator creates.

    A tensor on the wrong device raises :class:`~torchmem.errors.TransferError` naming both
    devices.

    Example:
        >>> import torch
        >>> T = ToDevice("cpu", "meta", ioshape=("B", "N"))
        >>> y = T(torch.ones(2, 3))
        >>> y.device.type, tuple(y.shape)
        ('meta', (2, 3))
        >>> ToDevice("cpu", "meta")(y)
        Traceback (most recent call last):
        ...
        torchmem.errors.TransferError: ToDevice(cpu -> meta) expected its input on cpu (the source device), got a tensor on meta. Fix: move it first with x.to('cpu'), or use the operator in the other direction (its adjoint .H takes tensors on meta).
    """

    def __init__(
        self,
        idevice: Optional[DeviceLike] = None,
        odevice: Optional[DeviceLike] = None,
        ioshape: Optional[Iterable[str]] = None,
        *,
        chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
        staging: Optional[StagingBuffers] = None,
        ledger: Any = None,
    ) -> None:
        super().__init__()
        self.ledger = ledger  # anything with allocate(tensor) / free(tensor), or None
        self.ispec = idevice if isinstance(idevice, DeviceSpec) else DeviceSpec(idevice or "cpu")
        self.ospec = odevice if isinstance(odevice, DeviceSpec) else DeviceSpec(odevice or "cpu")
        self.ioshape = tuple(ioshape) if ioshape is not None else None
        self.chunk_bytes = _chunk_size(chunk_bytes)
        self._staging = [staging]  # a list keeps it out of nn.Module's registry
        # Like a peer-to-peer setup: create the pair's transfer stream now when the devices exist,
        # so the first transfer does not pay for it and the repr can show it.
        engine = self._engine()
        if engine is not None and engine.transfer_stream is None and device_available(engine.device):
            transfer_stream(self.ispec.device, self.ospec.device)

    def _engine(self) -> Optional[DeviceSpec]:
        """The spec whose device drives the copy (holds the transfer stream), if any."""
        if self.ispec.is_accelerator:
            return self.ispec
        if self.ospec.is_accelerator:
            return self.ospec
        return None

    @property
    def idevice(self) -> torch.device:
        """The input (source) device.

        Example:
            >>> ToDevice("cpu", "meta").idevice
            device(type='cpu')
        """
        return self.ispec.device

    @property
    def odevice(self) -> torch.device:
        """The output (target) device.

        Example:
            >>> ToDevice("cpu", "meta").odevice
            device(type='meta')
        """
        return self.ospec.device

    @property
    def is_gpu2gpu(self) -> bool:
        """True when both ends are accelerators (the copy runs on a transfer stream).

        Example:
            >>> ToDevice("cuda:0", "cuda:1").is_gpu2gpu
            True
        """
        return is_accelerator(self.ispec.device) and is_accelerator(self.ospec.device)

    def _pool(self) -> Optional[StagingBuffers]:
        if self._staging[0] is None and is_accelerator(self.ospec.device):
            self._staging[0] = StagingBuffers(self.chunk_bytes)
        return self._staging[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.ioshape is not None
            and "..." not in self.ioshape
            and isinstance(x, torch.Tensor)
            and x.dim() != len(self.ioshape)
        ):
            raise InvalidInputError(
                f"{self._repr(0)} expected a tensor with {len(self.ioshape)} dimensions "
                f"{self.ioshape}, got shape {tuple(x.shape)}. Fix: reshape the input or build the "
                "operator with a matching ioshape (or '...' for any)."
            )
        out, _ = _transfer(
            x, self.ispec, self.ospec, staging=self._pool(), chunk_bytes=self.chunk_bytes,
            ledger=self.ledger, label=self._repr(0),
        )
        return out

    def adjoint(self) -> Operator:
        """The transfer back: a new ``ToDevice(odevice -> idevice)`` sharing the specs.

        Example:
            >>> ToDevice("cpu", "meta").adjoint()
            ToDevice(meta -> cpu)
        """
        return ToDevice(
            self.ospec, self.ispec, self.ioshape, chunk_bytes=self.chunk_bytes, ledger=self.ledger
        )

    def normal(self) -> Operator:
        """``T.H @ T`` is the identity: a round trip returns the same values.

        Example:
            >>> ToDevice("cpu", "meta").normal()
            Identity()
        """
        return Identity(self.ioshape)

    def split_forward(
        self, ibatch: Optional[Sequence[slice]] = None, obatch: Optional[Sequence[slice]] = None
    ) -> Operator:
        """An independent copy for one tile (a transfer does not depend on the tile).

        ``ibatch`` and ``obatch`` are the tile's slices per dimension; a transfer is diagonal, so
        they must be equal, and with an ``ioshape`` they must have one slice per named
        dimension. The copy has its own :class:`DeviceSpec` objects (same devices and streams),
        its own staging buffers and no shared adjoint cache.

        Example:
            >>> T = ToDevice("cpu", "meta", ioshape=("N",))
            >>> S = T.split_forward([slice(0, 2)], [slice(0, 2)])
            >>> S is not T, S.ispec is not T.ispec, S.ispec == T.ispec
            (True, True, True)
        """
        for name, batch in (("ibatch", ibatch), ("obatch", obatch)):
            if batch is None:
                continue
            if not all(isinstance(s, slice) for s in batch):
                raise InvalidInputError(
                    f"{name} must be a sequence of slices (one per dimension), got {batch!r}. "
                    "Fix: pass e.g. [slice(0, 8)]."
                )
            if self.ioshape is not None and "..." not in self.ioshape and len(batch) != len(self.ioshape):
                raise InvalidInputError(
                    f"{name} has {len(batch)} slices but the operator's ioshape {self.ioshape} has "
                    f"{len(self.ioshape)} dimensions. Fix: give one slice per dimension."
                )
        if ibatch is not None and obatch is not None and list(ibatch) != list(obatch):
            raise InvalidInputError(
                f"a transfer is diagonal: its input and output tiles must match, got ibatch="
                f"{list(ibatch)} and obatch={list(obatch)}. Fix: split both sides the same way."
            )
        return ToDevice(
            self.ispec.copy(), self.ospec.copy(), self.ioshape, chunk_bytes=self.chunk_bytes,
            ledger=self.ledger,
        )

    @staticmethod
    def split(linop: ToDevice, tile: Mapping[str, slice]) -> Operator:
        """torchlinops 0.8.3's form of :meth:`split_forward`: ``tile`` maps dimension names to
        slices; a transfer does not depend on the tile, so this is an independent copy.

        Example:
            >>> T = ToDevice("cpu", "meta", ioshape=("N",))
            >>> ToDevice.split(T, {"N": slice(0, 4)}) is not T
            True
        """
        if not isinstance(tile, Mapping):
            raise InvalidInputError(
                f"tile must map dimension names to slices, got {type(tile).__name__}. Fix: pass "
                "e.g. {'N': slice(0, 4)}."
            )
        unknown = [k for k in tile if linop.ioshape is not None and k not in linop.ioshape]
        if unknown:
            raise InvalidInputError(
                f"tile names {unknown} are not dimensions of {linop._repr(0)}. Fix: use names from "
                f"its ioshape {linop.ioshape}."
            )
        return linop.split_forward()

    def _repr(self, depth: int) -> str:
        engine = self._engine()
        ts = None
        if engine is not None and engine.transfer_stream is None:
            ts = peek_transfer_stream(self.ispec.device, self.ospec.device)
        src = self.ispec.describe(transfer=ts if engine is self.ispec else None)
        dst = self.ospec.describe(transfer=ts if engine is self.ospec else None)
        shape = f", ioshape={self.ioshape}" if self.ioshape is not None else ""
        return f"ToDevice({src} -> {dst}{shape})"
