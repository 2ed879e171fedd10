"""Distributed training as the dispatch mode sees it: collectives, FSDP2, storage resizes.

Measured on torch 2.13 (gloo, CPU) with a dispatch mode printing every operator:

* DDP: the gradient bucket is an ``aten::empty`` made by the C++ reducer (in the constructor,
  and again when it rebuilds its buckets in the second iteration's forward); backward copies
  the gradients into it and runs ``c10d::allreduce_`` on it. The constructor broadcasts the
  parameters through an ``aten::cat`` coalesced buffer (``c10d::broadcast_``) and checks
  shapes with a small ``c10d::allgather_``.
* FSDP2 (``fully_shard``): an all-gather is ``aten::empty`` (the output buffer),
  ``fsdp::all_gather_copy_in`` (the input, a view into it), ``c10d::_allgather_base_``, then
  ``fsdp::split_with_sizes_copy(..., out=unsharded parameters)``; a reduce-scatter is
  ``aten::empty`` + ``fsdp::chunk_cat`` (its input), ``aten::empty`` (its output) and
  ``c10d::_reduce_scatter_base_``; the output becomes the sharded gradient (a view of it).
  The unsharded parameters are freed and re-made with ``UntypedStorage.resize_(0)`` /
  ``resize_(n)``, which no operator sees, and parameters, gradients and optimizer state are
  ``DTensor`` wrappers, whose operators the mode sees at the wrapper (global shape) while the
  local shard is made below it, unseen.

So the tracker, for every operator in the ``c10d``, ``_c10d_functional`` and
``c10d_functional`` namespaces (a *collective*), marks each storage it reads or writes that is
not a parameter, buffer, gradient, optimizer state or input as a **communication** buffer
(``Category.COMMUNICATION``, and the ALLOC's operator becomes the collective's name:
``c10d::allreduce_`` for a DDP bucket, ``c10d::_allgather_base_`` and
``c10d::_reduce_scatter_base_`` for FSDP2's buffers); new outputs of functional collectives are
recorded as allocations of the collective. A communication buffer that is a parameter's
gradient when backward ends (FSDP2's reduce-scatter output, a DDP bucket with
``gradient_as_bucket_view=True``) becomes a gradient. The outputs of
``fsdp::split_with_sizes_copy`` are the unsharded parameters: category parameter, operator
``fsdp::split_with_sizes_copy``. While tracking, ``torch.UntypedStorage.resize_`` is wrapped: a
tracked storage resized to 0 is a free, resized to another size a free and an allocation, and
an untracked empty storage resized up an allocation (operator ``UntypedStorage.resize_``).
Operator outputs that are traceable wrapper subclasses (``DTensor``) are recorded by their
inner tensors' storages (the local shard), not the wrapper's.

Example:
    >>> import torch, torchmem
    >>> with torchmem.track() as tr:
    ...     s = torch.empty(256).untyped_storage()
    ...     _ = s.resize_(0); _ = s.resize_(512)
    >>> [(e.kind.label, e.op, e.nbytes) for e in tr.events()][:3]
    [('alloc', 'aten::empty', 1024), ('free', None, 1024), ('alloc', 'UntypedStorage.resize_', 512)]
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from torchmem._containers import iter_items
from torchmem.capture.tracker._phases import _Phases
from torchmem.capture.tracker._recorder import _C, _PROVISIONAL, _SRef, plain_tensors

__all__: list[str] = []

_COLLECTIVE_NAMESPACES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_COPY_OUT = "fsdp::split_with_sizes_copy"
#: categories a collective's buffer may have before it is known to be one
_TRANSIENT = frozenset({int(_C.OTHER), int(_C.ACTIVATION), int(_C.TEMPORARY)})
_COMM = int(_C.COMMUNICATION)
_PARAMETER = int(_C.PARAMETER)
_RESIZE = "UntypedStorage.resize_"
_COLLECTIVE, _FSDP_COPY_OUT = 1, 2


def _classify(func: Any) -> tuple[str, int]:
    """An operator's name and what its outputs are: 1 new storages, -1 written in place and
    possibly resized (``out=``, ``resize_``, ``set_``, operators outside ATen: new only if
    resized), 0 aliases of inputs (views, and ATen's other in-place operators).

    Example:
        >>> import torch
        >>> aten = torch.ops.aten
        >>> [_classify(op)[1] for op in (aten.mm.default, aten.add.out, aten.add_.Tensor, aten.t.default)]
        [1, -1, 0, 0]
    """
    schema = func._schema
    # lift_fresh returns (an alias of) a tensor built from Python data outside the
    # dispatcher (torch.tensor(...)): its storage is new to us
    if schema.name.startswith("aten::lift_fresh") or (
        not func.is_view and all(r.alias_info is None for r in schema.returns)
    ):
        return schema.name, 1
    if not func.is_view and any(
        r.alias_info is not None and r.alias_info.is_write for r in schema.returns
    ):
        # in-place / out= operators allocate nothing, unless they resize their output's
        # storage (resize_, set_, out= into a too-small tensor): negative = "check the size".
        # ATen's other in-place operators (add_, mul_, copy_, the _foreach_*_ of optimizers)
        # write into their inputs as they are and never resize: nothing to check
        name = schema.name
        if (name.startswith("aten::") and "resize" not in name and not name.startswith("aten::set")
                and not any(a.is_out for a in schema.arguments)):
            return name, 0
        return name, -1
    return schema.name, 0


def special_kind(func: Any) -> int:
    """0 for an ordinary operator, or what the tracker does with it: a collective, or FSDP2's
    copy-out into the unsharded parameters.

    Example:
        >>> import torch
        >>> special_kind(torch.ops.aten.add.Tensor), special_kind(torch.ops.c10d.allreduce_.default)
        (0, 1)
    """
    name = func._schema.name
    if name.startswith(_COLLECTIVE_NAMESPACES):
        return _COLLECTIVE
    if name == _COPY_OUT:
        return _FSDP_COPY_OUT
    return 0


class _Comm(_Phases):
    """Collectives, FSDP2's copy-out and storage resizes, for the tracker."""

    def _special_op(self, func: Any, out: Any, args: Any, kwargs: Any, kind: int) -> None:
        """An operator the tracker handles by name (every call comes here, with its args)."""
        name, sign = _classify(func)
        op = self.trace.intern(name)
        if kind == _COLLECTIVE:
            inputs = [p for t in iter_items((args, kwargs or {})) for p in plain_tensors(t)]
            outputs = [p for t in iter_items((out,)) for p in plain_tensors(t)]
            if sign > 0:
                # a functional collective's new outputs are allocations of the collective; an
                # output on an input's storage (c10d's in-place collectives return their
                # arguments, unannotated) is not, even when that storage predates tracking
                seen = {t.untyped_storage()._cdata for t in inputs if t.layout is torch.strided}
                new = [p for p in outputs
                       if p.layout is torch.strided and p.untyped_storage()._cdata not in seen]
                if new:
                    self._on_outputs(func, tuple(new), op)
            for p in inputs + outputs:
                self._mark(p, op, _COMM)
        else:  # fsdp::split_with_sizes_copy: its out= tensors are the unsharded parameters
            for t in iter_items(((kwargs or {}).get("out", ()),)):
                for p in plain_tensors(t):
                    self._mark(p, op, _PARAMETER)

    def _mark(self, t: torch.Tensor, op: int, cat: int) -> None:
        """Give a live transient storage its real category and operator."""
        if t.layout is not torch.strided:
            return
        key = t.untyped_storage()._cdata
        ref = self._live.get(key)
        if ref is None or ref.seq < 0:
            return
        cats = self.trace.category
        if cats[ref.seq] not in _TRANSIENT:
            return
        cats[ref.seq] = cat
        self.trace.op[ref.seq] = op
        ref.region = -1  # known now: not a temporary of its phase region
        if cat == _COMM:
            self._comm_refs[key] = ref

    def _install_resize(self) -> None:
        """Wrap ``torch.UntypedStorage.resize_`` while tracking (FSDP2 frees and re-makes the
        unsharded parameters with it, outside the dispatcher)."""
        cls = torch.UntypedStorage
        had = "resize_" in cls.__dict__
        original = cls.resize_
        tracker = self

        def resize_(storage: Any, size: int) -> Any:
            old = storage.nbytes()
            out = original(storage, size)
            if tracker._active and threading.get_ident() == tracker._thread:
                tracker._storage_resized(storage, old)
            return out

        resize_.__doc__ = original.__doc__
        cls.resize_ = resize_  # type: ignore[method-assign,assignment]

        def restore() -> None:
            if cls.__dict__.get("resize_") is resize_:  # another tracker may have wrapped ours
                if had:
                    cls.resize_ = original  # type: ignore[method-assign]
                else:
                    del cls.resize_

        self._exit.append(restore)

    def _storage_resized(self, s: torch.UntypedStorage, old: int) -> None:
        new = s.nbytes()
        if new == old:
            return
        self._drain()
        ref: _SRef | None = self._live.get(s._cdata)
        if ref is not None:
            if ref.seq < 0:  # another thread's allocation, not recorded yet
                return
            if new == 0:
                self._on_free_cb(ref)
                return
            self._resized(ref, s, s.device, self.trace.intern(_RESIZE))
        elif old == 0:
            phase = self._phase_now()
            self._add_storage(s, s.device, self.trace.intern(_RESIZE), self._cur_module(),
                              phase, _PROVISIONAL[phase])

    def _resized(self, ref: _SRef, s: torch.UntypedStorage, device: torch.device, op: int) -> None:
        """A live storage changed size in place: record a free of the old size and an
        allocation of the new one (a new storage id for the same storage)."""
        self._on_free_cb(ref)
        phase, module = self._phase_now(), self._cur_module()
        self._add_storage(s, device, op, module, phase, self.trace.category[ref.seq])
