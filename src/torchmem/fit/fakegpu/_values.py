"""Values read from fake tensors during an estimate: answered by a documented policy, and listed.

Fake tensors have shapes but no values, so ``loss.item()``, ``float(norm)``, ``if mask.all():``
and ``t.tolist()`` cannot be computed. Real training code reads such values all the time
(logging the loss, a gradient norm, a mask check), and none of them changes how much memory a
step takes unless it decides control flow. While an estimate runs, :class:`ValueReads` answers
each read with a stand-in chosen from the operator that made the tensor:

=====================================================  ======================================
the tensor read                                        stand-in
=====================================================  ======================================
made by ``all`` (``(mask == 1).all()``, ``isfinite``   ``True``: masks are all ones, values
...``.all()``), or ``t.sum() == t.numel()``            are finite
made by ``any`` (``isnan(x).any()``, padding checks)   ``False``: nothing non-finite, no padding
any other boolean (a comparison: ``loss > 1e6``)       ``False``: the exceptional branch is not
                                                       taken
the sum of a boolean or integer tensor (a token count) its element count (all ones)
any other integer                                      ``1``
a floating-point value (a loss, a gradient norm)       ``1.0``: finite, non-zero, safe to log,
                                                       divide by and compare
=====================================================  ======================================

**Real values first.** Integer and boolean tensors of up to ``SHADOW_NUMEL`` elements carry a
*shadow*: the same operator run for real on the host, on the shadows of its inputs (a real
tensor is its own shadow; ``torch.randint`` draws real random numbers; a device argument becomes
the host). A read of such a tensor gets its real value, and is not listed: nanoGPT's
``i = torch.randint(len(data) - block_size, ...)`` lies in its range and ``data[i:i + block_size]``
has ``block_size`` rows, as in the real run. The chain stops at an operator with an input that
has no shadow (a float tensor, a large one): reads past it get the stand-ins below. An in-place
operator on a shadowed tensor updates the shadow, or drops it when it cannot be computed.

``torch.equal(a, b)`` (transformers asks it of tied weights loaded from a checkpoint) is answered
for real where the shapes or dtypes differ (``False``), where both views are the same memory
(``True``: tied weights that share storage) and where both have shadows; otherwise the stand-in is
``True`` (equal), listed as op ``aten.equal.default``.

``data_ptr()`` of a fake tensor is answered by :mod:`torchmem.fit.fakegpu._pointers` (the
simulated allocator's address: distinct per storage, shared by views) and listed as op
``Tensor.data_ptr``.

``Tensor.tolist()`` reads each element so (each element counts as one read of its entry). Every
answered read is listed (:attr:`ValueReads.reads`: where in the user's code, the operator that
made the tensor, the value assumed, how many times), so an estimate never hides a decision it made for the program: a read
that decides control flow (an early stop on the loss) took the branch its stand-in takes, and the
report names the line. ``strict=True`` refuses every read instead (the estimator's behaviour
before), with the clear error of :mod:`torchmem.fit.run._engine`.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> v = ValueReads()
    >>> with FakeTensorMode():
    ...     loss = torch.ones(4).mean(); v.note_output(torch.ops.aten.mean.default, loss, ())
    ...     v.answer(loss)
    1.0
    >>> [(r.op, r.value) for r in v.reads]
    [('aten.mean.default', 1.0)]
"""

from __future__ import annotations

import os
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["SHADOW_NUMEL", "AssumedValue", "ValueReads"]

#: The largest integer or boolean tensor (in elements) whose real values are kept beside the
#: fake one (a batch of token indices: 64 x 1024).
SHADOW_NUMEL = 1 << 16
_SHADOW_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                            torch.bool})
# operators that write all of their first argument: its old value is not needed
_OVERWRITE = frozenset({"copy_", "fill_", "zero_", "random_", "uniform_", "normal_",
                        "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_"})

_ALL = {torch.ops.aten.all.default, torch.ops.aten.all.dim, torch.ops.aten.all.dims}
_ANY = {torch.ops.aten.any.default, torch.ops.aten.any.dim, torch.ops.aten.any.dims}
_SUMS = {torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList}
_EQ = torch.ops.aten.eq.Scalar
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchmem/


@dataclass
class AssumedValue:
    """One place where the estimate answered a value read: ``where`` (``file:line`` of the
    innermost frame outside torch and torchmem), ``op`` (the operator that made the tensor
    read, or ``"?"``), ``value`` (the stand-in) and ``count`` (reads answered there so).

    Example:
        >>> AssumedValue("train.py:12", "aten.mean.default", 1.0, 3).to_dict()
        {'where': 'train.py:12', 'op': 'aten.mean.default', 'value': 1.0, 'count': 3}
    """

    where: str
    op: str
    value: Any
    count: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the estimate's ``assumed_values`` entries).

        Example:
            >>> AssumedValue("a.py:1", "?", True).to_dict()["value"]
            True
        """
        return {"where": self.where, "op": self.op, "value": self.value, "count": self.count}


def _where() -> str:
    """``file:line`` of the innermost frame that is neither torch's nor torchmem's, preferring
    one in a file (code run by ``eval``/``exec`` reads as ``<string>``) over one that is not."""
    fallback = None
    for fr in reversed(traceback.extract_stack()):
        if fr.filename.startswith("<"):
            if fallback is None and not fr.filename.startswith("<frozen"):
                fallback = f"{fr.filename}:{fr.lineno}"
            continue
        f = os.path.abspath(fr.filename)
        if not f.startswith(_TORCH_DIR) and not f.startswith(_OWN_DIR):
            return f"{f}:{fr.lineno}"
    return fallback or "?"


def _has_value(t: Any) -> bool:
    """True when a read of ``t`` has a real answer: a real tensor, or a fake one that carries its
    constant (a Python number lifted to a tensor, such as an optimizer's step count).

    Example:
        >>> _has_value(torch.ones(()))
        True
    """
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) or getattr(t, "constant", None) is not None


class ValueReads:
    """The policy and the list of the value reads of one estimate (see the module docstring).

    The estimate's dispatch mode calls :meth:`note_output` for each operator's output and
    :meth:`answer` for each read (``aten._local_scalar_dense``, behind ``.item()``, ``float()``,
    ``bool()``, ``if t:`` and each element of ``.tolist()``).

    Example:
        >>> v = ValueReads(strict=True)
        >>> v.strict, v.reads
        (True, [])
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        #: the answered reads, one entry per (where, op, value)
        self.reads: list[AssumedValue] = []
        self._index: dict[tuple[str, str, Any], AssumedValue] = {}
        # id(tensor) -> (weakref, op name, rule) for one-element outputs and the sums' numels
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], str, Any]] = {}
        # id(fake tensor) -> (weakref, its real values on the host): see "Real values first"
        self._shadows: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        #: reads answered with a real value (not listed in :attr:`reads`)
        self.real_reads = 0
        #: called at each read of a GPU tensor (the host waits for the GPU's work there)
        self.on_read: Any = None

    def shadow(self, t: Any) -> torch.Tensor | None:
        """The real values of ``t`` on the host, or ``None`` when they are not known: a real
        tensor is its own, a fake one has those computed for it (``SHADOW_NUMEL``) or its
        constant.

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> from torch.utils._python_dispatch import TorchDispatchMode
            >>> v = ValueReads()
            >>> class Note(TorchDispatchMode):
            ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ...         out = func(*args, **(kwargs or {}))
            ...         v.note_output(func, out, args, kwargs)
            ...         return out
            >>> with FakeTensorMode(), Note():
            ...     i = torch.arange(10)[7] + 100
            >>> v.shadow(i).item(), v.answer(i), v.reads
            (107, 107, [])
        """
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(t, FakeTensor):
            return t if isinstance(t, torch.Tensor) else None
        entry = self._shadows.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        constant = getattr(t, "constant", None)
        return constant if isinstance(constant, torch.Tensor) else None

    def _keep_shadow(self, t: torch.Tensor, real: torch.Tensor) -> None:
        shadows = self._shadows
        key = id(t)
        shadows[key] = (weakref.ref(t, lambda _: shadows.pop(key, None)), real)

    def _note_shadow(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        """Run ``func`` for real on the shadows of its inputs when its outputs are small
        integer or boolean tensors (see "Real values first")."""
        from torch._subclasses.fake_tensor import FakeTensor

        outs = out if isinstance(out, (tuple, list)) else (out,)
        fakes = [o for o in outs if isinstance(o, FakeTensor)]
        name = getattr(func, "__name__", "").split(".")[0]
        mutates = bool(getattr(getattr(func, "_schema", None), "is_mutable", False))
        if not fakes:
            if mutates and args:  # an in-place op that returns nothing (_foreach_add_)
                self._update_in_place(func, name, args, kwargs)
            return
        small = all(o.dtype in _SHADOW_DTYPES and isinstance(o.numel(), int)
                    and o.numel() <= SHADOW_NUMEL for o in fakes)
        if not small and not mutates:
            return
        real = self._run_on_shadows(func, name, args, kwargs) if small else _FAILED
        if real is _FAILED or real is None:
            if mutates:  # the written tensor's old shadow is stale now
                for o in fakes:
                    self._shadows.pop(id(o), None)
            return
        reals = real if isinstance(real, (tuple, list)) else (real,)
        for o, r in zip(outs, reals):
            if isinstance(o, FakeTensor) and isinstance(r, torch.Tensor) and r.shape == o.shape:
                self._keep_shadow(o, r)

    def _update_in_place(self, func: Any, name: str, args: Any, kwargs: Any) -> None:
        """``func`` wrote its first argument (a tensor or a list of them) and returned nothing:
        run it on their shadows too (AdamW's step counters: ``_foreach_add_(steps, 1)``), or
        drop shadows it made stale."""
        from torch._subclasses.fake_tensor import FakeTensor

        first = args[0]
        written = [t for t in (first if isinstance(first, (list, tuple)) else (first,))
                   if isinstance(t, FakeTensor)]
        entries = [self._shadows.get(id(t)) for t in written]  # ours (constants: see below)
        known = [e[1] if e is not None and e[0]() is t else None
                 for t, e in zip(written, entries)]
        if not written or all(k is None for k in known):
            return
        before = [None if k is None else k.clone() for k in known]
        if (all(k is not None for k in known)
                and self._run_on_shadows(func, name, args, kwargs) is not _FAILED):
            return
        for t, k, b in zip(written, known, before):  # stale (or half written): forget them
            if k is not None and b is not None:
                k.copy_(b)
            self._shadows.pop(id(t), None)

    def real_in_place(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An in-place operator on real host tensors only (their values are real: "host data
        is real") runs for real on them, below the fake mode (which would write a fake copy
        and leave them as they were: torch 2.11's AdamW keeps its step counters so, and
        divided by ``1 - beta1 ** 0``); ``NotImplemented`` for any other operator.

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> steps = [torch.tensor(0.0)]
            >>> with FakeTensorMode(allow_non_fake_inputs=True):
            ...     _ = ValueReads().real_in_place(torch.ops.aten._foreach_add_.Scalar, (steps, 1), {})
            >>> steps[0].item()
            1.0
        """
        first = args[0]
        if isinstance(first, (list, tuple)):
            first = first[0] if first else None
        if not isinstance(first, torch.Tensor) or isinstance(first, FakeTensor):
            return NotImplemented  # (every operator passes here: the cheap tests first)
        if not getattr(getattr(func, "_schema", None), "is_mutable", False):
            return NotImplemented
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_leaves, tree_map

        for x in tree_leaves((args, kwargs or {})):
            if isinstance(x, torch.Tensor) and (x.device.type != "cpu" or isinstance(
                    x, FakeTensor) and self.shadow(x) is None):
                return NotImplemented  # a value not known: the fake mode's own rule

        def real(x: Any) -> Any:  # a fake input read (a scalar tensor): its known value
            return self.shadow(x) if isinstance(x, FakeTensor) else x

        with _disable_current_modes(), torch.no_grad():
            return func(*tree_map(real, args), **tree_map(real, kwargs or {}))

    def before_in_place(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Before an in-place operator writes fake tensors that carry a constant (a scalar made
        from a Python number, such as an optimizer's step counter): their values after it,
        computed on copies of the inputs' known values; the function returned sets them once
        the operator ran (``None``: nothing to do). Fake tensor modes differ in whether they
        carry such a constant through a list operator (``_foreach_add_``: torch 2.11 kept the
        old value, and AdamW divided by ``1 - beta1 ** 0``); this makes them all agree.

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> v = ValueReads()
            >>> with FakeTensorMode():
            ...     steps = [torch.tensor(0.0)]
            ...     commit = v.before_in_place(torch.ops.aten._foreach_add_.Scalar, (steps, 1), {})
            ...     _ = torch._foreach_add_(steps, 1)
            >>> commit(); steps[0].constant.item()
            1.0
        """
        first = args[0] if args else None
        group = first if isinstance(first, (list, tuple)) else (first,)
        written = [t for t in group if isinstance(t, FakeTensor)
                   and isinstance(getattr(t, "constant", None), torch.Tensor)]
        if not written or not getattr(getattr(func, "_schema", None), "is_mutable", False):
            return None  # (every operator passes here: the cheap tests first)
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_map

        copies: dict[int, torch.Tensor] = {}

        def real(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                known = self.shadow(x)
                if known is None:
                    raise LookupError
                if id(x) not in copies:
                    copies[id(x)] = known.clone()
                return copies[id(x)]
            if isinstance(x, torch.device) and x.type != "cpu":
                return torch.device("cpu")
            return x

        try:
            with _disable_current_modes(), torch.no_grad():  # copies made below the modes
                sargs, skwargs = tree_map(real, args), tree_map(real, kwargs or {})
                func(*sargs, **skwargs)
        except Exception:  # noqa: BLE001 - values not known: the fake mode's own rule
            return None
        after = [copies[id(t)] for t in written]

        def commit() -> None:
            for t, value in zip(written, after):
                t.constant = value
        return commit

    def _run_on_shadows(self, func: Any, name: str, args: Any, kwargs: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_map

        missing = False
        first = args[0] if args else None

        def real(x: Any) -> Any:
            nonlocal missing
            if isinstance(x, torch.Tensor):
                s = self.shadow(x)
                if s is None:
                    t: torch.Tensor = x
                    if id(t) == id(first) and name in _OVERWRITE and t.dtype in _SHADOW_DTYPES:
                        s = torch.empty(tuple(t.shape), dtype=t.dtype)  # all written next
                        self._keep_shadow(t, s)
                        return s
                    missing = True
                return s
            if isinstance(x, torch.device) and x.type != "cpu":
                return torch.device("cpu")
            return x

        sargs = tree_map(real, args)
        skwargs = tree_map(real, kwargs or {})
        if missing:
            return _FAILED
        if skwargs.get("pin_memory"):
            skwargs["pin_memory"] = False
        try:
            with _disable_current_modes(), torch.no_grad():
                return func(*sargs, **skwargs)
        except Exception:  # noqa: BLE001 - a value that cannot be had this way: a stand-in
            return _FAILED

    def _remember(self, t: torch.Tensor, op: str, rule: Any) -> None:
        made = self._made
        key = id(t)
        made[key] = (weakref.ref(t, lambda _: made.pop(key, None)), op, rule)

    def _lookup(self, t: torch.Tensor) -> tuple[str, Any]:
        entry = self._made.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1], entry[2]
        return "?", None

    def note_output(self, func: Any, out: Any, args: Any, kwargs: Any = None) -> None:
        """Remember what made ``out`` when it may be read (one element) or counted (a sum);
        in strict mode too (transformers' own reads are still answered then).

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> v = ValueReads()
            >>> with FakeTensorMode():
            ...     m = torch.ones(2, 3, dtype=torch.bool)
            ...     s = m.sum(); v.note_output(torch.ops.aten.sum.default, s, (m,))
            ...     v.answer(s), v.answer(s == 6)
            (6, False)
        """
        self._note_shadow(func, out, args, kwargs)
        if isinstance(out, (tuple, list)):  # nll_loss_forward and friends: (output, ...)
            for o in out:
                if isinstance(o, torch.Tensor) and o.numel() == 1:
                    self._remember(o, str(func), None)
            return
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            return
        op = str(func)
        if func in _ALL:
            self._remember(out, op, True)
        elif func in _ANY:
            self._remember(out, op, False)
        elif func in _SUMS and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            counts = not (src.dtype.is_floating_point or src.dtype.is_complex)
            self._remember(out, op, ("numel", src.numel()) if counts else None)
        elif func is _EQ and len(args) == 2 and isinstance(args[0], torch.Tensor):
            _, rule = self._lookup(args[0])
            # transformers' fast_all: t.sum() == t.numel() is an all()
            if isinstance(rule, tuple) and args[1] == rule[1]:
                self._remember(out, op, True)
            else:
                self._remember(out, op, None)
        else:
            self._remember(out, op, None)

    def stand_in(self, t: torch.Tensor) -> tuple[str, Any]:
        """``(op, value)``: the operator that made ``t`` and the value a read of it gets.

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> with FakeTensorMode():
            ...     ValueReads().stand_in(torch.zeros((), dtype=torch.int64))
            ('?', 1)
        """
        op, rule = self._lookup(t)
        if t.dtype == torch.bool:
            return op, rule if isinstance(rule, bool) else False
        if isinstance(rule, tuple):
            return op, rule[1]
        if t.dtype.is_floating_point:
            return op, 1.0
        if t.dtype.is_complex:
            return op, complex(1.0)
        return op, 1

    def answer(self, t: torch.Tensor) -> Any:
        """The real value of ``t`` when it is known (see "Real values first"; strict mode too:
        it assumes nothing), else the stand-in for the read (recorded), or ``None`` in strict
        mode.

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> with FakeTensorMode():
            ...     ValueReads(strict=True).answer(torch.ones(()))
        """
        if _has_value(t):
            return None
        if self.on_read is not None:  # the host waits for the GPU's work
            self.on_read()
        known = self.shadow(t)
        if known is not None and known.numel() == 1:
            from torch.utils._python_dispatch import _disable_current_modes

            self.real_reads += 1
            with _disable_current_modes():  # the host's own read, below the estimate's modes
                return known.item()
        if self.strict:
            return None
        op, value = self.stand_in(t)
        self.record(op, value)
        return value

    def equal(self, a: Any, b: Any) -> bool | None:
        """``torch.equal(a, b)``: the real answer when it is known without values (shapes or
        dtypes differ; the same memory), from shadows, else the stand-in ``True`` (listed); in
        strict mode ``None`` for an unknown answer.

        Example:
            >>> from torch._subclasses import FakeTensorMode
            >>> v = ValueReads()
            >>> with FakeTensorMode():
            ...     w = torch.empty(3, 4)
            ...     same, other, shape = v.equal(w, w[:]), v.equal(w, torch.empty(3, 4)), v.equal(w, w.t())
            >>> same, other, shape, [r.value for r in v.reads]
            (True, True, False, [True])
        """
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        if _has_value(a) and _has_value(b):
            return None  # PyTorch computes it
        if a.shape != b.shape or a.dtype != b.dtype:
            self.real_reads += 1
            return False
        with torch._C.DisableTorchFunction():
            same = (a.untyped_storage()._cdata == b.untyped_storage()._cdata
                    and a.stride() == b.stride() and a.storage_offset() == b.storage_offset())
        if same:
            self.real_reads += 1
            return True
        sa, sb = self.shadow(a), self.shadow(b)
        if sa is not None and sb is not None:
            from torch.utils._python_dispatch import _disable_current_modes

            self.real_reads += 1
            with _disable_current_modes():
                return bool(torch.equal(sa, sb))
        if self.strict:
            return None
        self.record("aten.equal.default", True)
        return True

    def record(self, op: str, value: Any, where: str | None = None) -> None:
        """List one answered read (merged with the same read at the same place).

        Example:
            >>> v = ValueReads(); v.record("aten.sum.default", 3, "a.py:1")
            >>> v.record("aten.sum.default", 3, "a.py:1"); v.reads[0].count
            2
        """
        at = where or _where()
        key = (at, op, value)
        hit = self._index.get(key)
        if hit is not None:
            hit.count += 1
            return
        entry = AssumedValue(at, op, value)
        self._index[key] = entry
        self.reads.append(entry)

#: what :meth:`ValueReads._run_on_shadows` returns when the values cannot be had
_FAILED = object()
