"""The fake GPU's dispatch mode: what each operator does on CUDA that the fake CPU run would not.

:class:`_SimMode` runs above the tracker: it answers value reads (:mod:`~torchmem.fit.fakegpu._values`,
transformers' own through :mod:`~torchmem.fit.fakegpu._generate`), gives data-dependent outputs
their size by rule (:mod:`~torchmem.fit.fakegpu._shapes`), runs in place what CUDA runs in
place (gradient accumulation, backward scatters into fresh zeros, cuDNN's convolution backward
in two calls), tells the memory (:mod:`~torchmem.fit.fakegpu._memory`) each operator's
workspaces and counts FLOPs for the levers; it stops the run at the out-of-memory point
(``_Abort``) or where a stop was asked for (:func:`request_stop`: a script's time limit).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from torchmem.capture._fast_mode import FastDispatchMode, frame_callback
from torchmem.fit.fakegpu._bnb import KERNELS as LIBRARY_KERNELS
from torchmem.fit.fakegpu._generate import LOCAL_SCALAR, GenerationPatches
from torchmem.fit.fakegpu._memory import _State
from torchmem.fit.fakegpu._shapes import HANDLED as SHAPE_OPS
from torchmem.fit.fakegpu._shapes import DataDependentShapes
from torchmem.fit.fakegpu._values import ValueReads


class _Abort(BaseException):
    """Stops the user's step at the simulated out-of-memory point (not an Exception, so user
    code's ``except Exception`` does not swallow it)."""


_aten = torch.ops.aten
#: Backward formulas that scatter into a zero tensor they just made: done in place by a plain
#: run, out of place (one more full-size tensor) whenever a tensor subclass or a dispatch mode
#: is present (``areAnyTensorSubclassLike`` in gather_backward,
#: value_selecting_reduction_backward, cummaxmin_backward, masked_scatter_backward), which is
#: the case under fake tensors. The estimate runs the in-place form, as the GPU would.
_IN_PLACE = {
    _aten.scatter_add.default: _aten.scatter_add_.default,
    _aten.scatter.src: _aten.scatter_.src,
    _aten.scatter.value: _aten.scatter_.value,
    _aten.masked_scatter.default: _aten.masked_scatter_.default,
}
_ZEROS = {_aten.zeros, _aten.new_zeros, _aten.zeros_like}
#: floating-point operations per operator (torch.utils.flop_counter's formulas), for levers' costs
_FLOPS: dict[Any, Any] = dict(flop_registry)


#: formula -> how many positional arguments it takes (None: any number)
_TAKES: dict[Any, int | None] = {}


def _flops(count: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None,
           out: Any) -> int:
    """``count``'s floating-point operations for one call (``torch.utils.flop_counter``'s
    formula of the operator's packet), given only the positional arguments the formula takes:
    an overload with one more (``addmm.dtype_out``'s ``out_dtype``, which TRL's chunked
    log-probabilities call) would land on its ``out_shape`` and fail the step. A formula that
    still cannot take the call counts nothing for it (the FLOPs only feed the levers' cost).

    Example:
        >>> a, b = torch.ones(2, 3), torch.ones(3, 4)
        >>> _flops(_FLOPS[_aten.addmm], (torch.ones(2, 4), a, b, torch.float32), None, a @ b)
        48
    """
    import inspect

    if count not in _TAKES:
        n: int | None = 0
        for p in inspect.signature(inspect.unwrap(count)).parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                n = None
                break
            if p.name == "out_shape" or p.kind not in (p.POSITIONAL_ONLY,
                                                        p.POSITIONAL_OR_KEYWORD):
                break
            n += 1  # type: ignore[operator]
        _TAKES[count] = n
    n = _TAKES[count]
    try:
        return int(count(*(args if n is None else args[:n]), **(kwargs or {}), out_val=out))
    except TypeError:
        return 0


_CONV_BACKWARD = _aten.convolution_backward.default
_IS_NONZERO = _aten.is_nonzero.default
#: value reads that are composite (they become _local_scalar_dense with autograd on); under
#: torch.inference_mode the dispatch mode receives them as they are
_READS = frozenset({_aten.item.default, _IS_NONZERO})
_EQUAL = _aten.equal.default  # torch.equal: answered by ValueReads.equal
_ADD, _ADD_ = _aten.add.Tensor, _aten.add_.Tensor


def _accumulates_in_place(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
    """Whether this ``a + b`` is autograd summing two gradients of one input that a plain
    run does in place (``a.add_(b)``), where the fake run takes the out-of-place path.

    When a second gradient reaches an input that already has one, the engine's
    ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) repurposes the first:
    ``old_var.add_(var)`` when grad mode is off (no ``create_graph``), it holds the last
    reference to ``old_var`` and its storage, ``old_var`` is non-overlapping and dense, and
    neither is a tensor subclass; otherwise ``old_var + var``. Fake tensors are tensor
    subclasses, so under them it is always ``old_var + var``: one gradient-sized block more,
    allocated where the GPU allocates none. Taken here as the accumulation: an ``add`` with
    the default ``alpha`` run by the autograd engine (a graph task is running, grad mode
    off) on two tensors of one shape and dtype, the first a dense tensor that is its
    storage's only view and shares no storage with the second. (The use counts themselves
    are not visible under fake tensors; an add of that form inside a backward formula is
    taken as an accumulation too.)

    Example:
        >>> import torch
        >>> a, b = torch.ones(4), torch.ones(4)
        >>> _accumulates_in_place((a, b), None)          # not inside a backward pass
        False
    """
    if kwargs or len(args) != 2 or torch._C._current_graph_task_id() == -1:
        return False
    if torch.is_grad_enabled():
        return False
    a, b = args
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != torch.strided:
        return False
    if b.layout != torch.strided or not a.is_contiguous() or a.storage_offset():
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.nbytes() != a.numel() * a.element_size():
        return False
    return sa._cdata != sb._cdata


def _assume(values: ValueReads, func: Any, op: str, value: Any) -> None:
    """A size that depends on values, assumed by a library kernel's rule: listed, or refused
    (as the operator's own data-dependent output would be) with ``strict_values``."""
    if values.strict:
        from torch._subclasses.fake_tensor import DynamicOutputShapeException

        raise DynamicOutputShapeException(func)
    values.record(op, value)


def _conv_backward_halves(args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """``convolution_backward``'s arguments split into the input-gradient call and the
    weight/bias-gradient call, when both halves are asked for (``None`` otherwise).

    Example:
        >>> a = (None,) * 10 + ([True, True, False],)
        >>> [h[10] for h in _conv_backward_halves(a)]
        [[True, False, False], [False, True, False]]
    """
    if len(args) != 11:
        return None
    mask = [bool(m) for m in args[10]]
    if len(mask) != 3 or not mask[0] or not (mask[1] or mask[2]):
        return None
    head = tuple(args[:10])
    return head + ([True, False, False],), head + ([False, mask[1], mask[2]],)


#: thread ident -> the exception (a class) to raise in that thread before its next operator
#: starts: a script's time limit (from its timer signal or timer thread) lands there, where no
#: bookkeeping is half done (:func:`request_stop`)
_STOPS: dict[int, Callable[[], BaseException]] = {}
# what C++ asks of a tensor's metadata through the dispatch (where it cannot throw)
_METADATA = frozenset(
    op for packet in (torch.ops.prim.device, torch.ops.prim.layout, torch.ops.aten.sym_size,
                      torch.ops.aten.sym_stride, torch.ops.aten.sym_numel,
                      torch.ops.aten.sym_storage_offset, torch.ops.aten.is_contiguous,
                      torch.ops.aten.is_strides_like_format,
                      torch.ops.aten.is_non_overlapping_and_dense)
    for op in (getattr(packet, name) for name in packet.overloads()))


def request_stop(ident: int, exc: Callable[[], BaseException] | None) -> None:
    """Raise ``exc()`` in thread ``ident`` before the next operator it runs under an estimate
    starts (``None`` withdraws the request); :func:`stop_pending` says whether it is still
    waiting.

    Example:
        >>> import threading
        >>> me = threading.get_ident()
        >>> request_stop(me, KeyboardInterrupt); stop_pending(me)
        True
        >>> request_stop(me, None); stop_pending(me)
        False
    """
    if exc is None:
        _STOPS.pop(ident, None)
    else:
        _STOPS[ident] = exc


def stop_pending(ident: int) -> bool:
    """Whether a stop asked for with :func:`request_stop` still waits for thread ``ident``'s
    next operator.

    Example:
        >>> stop_pending(-1)
        False
    """
    return ident in _STOPS


class _SimMode(FastDispatchMode):
    """Runs above the tracker: workspaces after each op's outputs; stops at the OOM point;
    backward scatters into fresh zeros run in place (see ``_IN_PLACE``); transformers' own
    value reads are answered (:mod:`torchmem.fit.fakegpu._generate`)."""

    def __init__(self, state: _State, gen: GenerationPatches | None = None,
                 values: ValueReads | None = None, routing: str = "balanced") -> None:
        super().__init__()
        self.state = state
        self.values = values or ValueReads(strict=True)
        self.gen = gen or GenerationPatches(self.values)
        self.shapes = DataDependentShapes(self.values, routing)
        self.zeros: Any = None  # weak reference to the last zeros made in backward

    inline_check = True  # the check below: no wrapper frame per operator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if frame_callback() is not None:  # compiled code runs: under torch._dynamo.disable
            return self._under_disable(func, types, args, kwargs)
        pl = self.state.pl
        if (_STOPS and pl.depth == 0 and func not in _METADATA
                and torch._C._current_autograd_node() is None):
            # never inside backward nor in a metadata query (``prim.device``, sizes): C++ asks
            # those where it cannot throw, and an exception there aborts the process; the stop
            # waits for the next operator
            stop = _STOPS.pop(threading.get_ident(), None)
            if stop is not None:
                raise stop()  # before this operator: nothing of it is recorded yet
        pl.depth += 1
        saved = pl.current
        pl.current = pl.for_op(args, kwargs)
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            pl.current = saved
            pl.depth -= 1

    def _dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        gen = self.gen
        values = self.values
        if func in _READS:  # under torch.inference_mode item() and bool() arrive whole
            value = self._dispatch(LOCAL_SCALAR, types, args, kwargs)
            return bool(value) if func is _IS_NONZERO else value
        if func is LOCAL_SCALAR:
            if gen.installed:
                value = gen.answer(args[0])
                if value is not None:
                    if not values.strict:
                        values.record(values.stand_in(args[0])[0], value)
                    return value
            value = values.answer(args[0])
            if value is not None:
                return value
        if LIBRARY_KERNELS and func in LIBRARY_KERNELS:  # bitsandbytes' CUDA behaviour
            return LIBRARY_KERNELS[func](
                lambda op, *a, **k: self.__torch_dispatch__(op, types, a, k),
                lambda op, value: _assume(values, func, op, value), *args, **(kwargs or {}))
        if func is _EQUAL and len(args) == 2 and not kwargs:
            same = values.equal(args[0], args[1])
            if same is not None:
                return same
        if func is _CONV_BACKWARD and self.state.emu is not None and not kwargs:
            halves = _conv_backward_halves(args)
            if halves is not None:
                # CUDA (cudnn_convolution_backward) makes the input gradient, with its
                # workspace, before the weight gradient: two calls keep that order
                gi = self.__torch_dispatch__(func, types, halves[0])[0]
                _, gw, gb = self.__torch_dispatch__(func, types, halves[1])
                return (gi, gw, gb)
        if func is _ADD and _accumulates_in_place(args, kwargs):
            # autograd's InputBuffer would add the second gradient into the first in place
            return self.__torch_dispatch__(_ADD_, types, args)
        zeros, self.zeros = self.zeros, None
        if zeros is not None and args and func in _IN_PLACE and args[0] is zeros():
            func = _IN_PLACE[func]
        out: Any = NotImplemented
        if func in SHAPE_OPS and not values.strict:  # data-dependent: a size by rule
            out = self.shapes.run(func, args, kwargs)
        if out is NotImplemented and args:
            out = values.real_in_place(func, args, kwargs)
        if out is NotImplemented:
            commit = values.before_in_place(func, args, kwargs) if args else None
            out = func(*args, **(kwargs or {}))
            if commit is not None:
                commit()
        values.note_output(func, out, args, kwargs)
        self.shapes.note_output(func, args, out)
        if func.overloadpacket in _ZEROS and torch._C._current_autograd_node() is not None:
            self.zeros = weakref.ref(out)
        st = self.state
        if st.levers is not None and st.levers.count_flops:
            count = _FLOPS.get(func.overloadpacket)
            if count is not None:
                st.levers.flops += _flops(count, args, kwargs, out)
        if st.dist is not None:
            st.dist.after_op(func, args, kwargs, out)
        if st.oom is None:
            st.after_op(func, args, kwargs, out)
        if st.oom is not None:
            raise _Abort()
        return out
