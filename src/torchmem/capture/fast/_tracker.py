"""``torchmem.track(..., mode="fast")``: allocator-level tracking with full attribution.

While the block runs, a wrapper around PyTorch's CPU allocator (C++, :mod:`._native`) records
every allocation and free with the outermost operator running (PyTorch's RecordFunction
callbacks, the profiler's hooks), the module and phase set by global module/optimizer hooks, and
the autograd node being evaluated in backward. Nothing runs in Python per operator or per
allocation; when the block ends, the records are turned into the same :class:`Trace` columns as
the dispatch tracker's (``mode="ops"``), in C++: frees paired with allocations by address,
phase regions, categories (parameter, buffer, gradient, optimizer_state, activation, input,
temporary, other, resolved as the dispatch tracker resolves them, from snapshots of gradient and
optimizer-state addresses taken by the hooks), the module of backward events from autograd
sequence numbers noted in forward.

Differences from ``mode="ops"`` (documented, tested):
  * operators are the outermost operator *called* (``aten::linear``), where the dispatch tracker
    names the kernels it sees below autograd (``aten::addmm``); in backward, the first operator
    inside the autograd node;
  * every allocation the CPU allocator makes is seen, including a kernel's own scratch buffers
    the dispatch tracker cannot see: the peak is the allocator's, equal or higher;
  * CPU memory only (CUDA tensors need ``mode="ops"``); no Python stacks, no listeners while it
    runs, no streaming to ``path`` (the file is written when the block ends);
  * storages that existed before the block and are freed inside it are seen freed only when
    their address is reused (the allocator did not make them while tracking).

Example:
    >>> import torch, torchmem
    >>> from torchmem.capture.fast import native_available
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> if native_available():
    ...     with torchmem.track(net, opt, mode="fast") as tr:
    ...         net(torch.ones(8, 64)).sum().backward(); opt.step()
    ...     print(sorted({e.category.label for e in tr.events()} - {"other"}))
    ... else:
    ...     print(['activation', 'gradient', 'input', 'parameter', 'temporary'])
    ['activation', 'gradient', 'input', 'parameter', 'temporary']
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from array import array
from collections.abc import Iterator
from typing import Any

import torch

from torchmem._containers import iter_tensors
from torchmem.capture._names import (
    _path_below,
    around_closure,
    check_track_args,
    initial_state,
    name_uncalled,
    note_params,
    seq_mark,
)
from torchmem.capture.fast._build import load_native
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import PathLike, save_trace
from torchmem.model.events import Category, Event, EventKind, Phase
from torchmem.model.trace import Trace

__all__ = ["FastTracker"]

#: Fast trackers between ``__enter__`` and ``__exit__`` in this process.
_RUNNING: weakref.WeakSet[FastTracker] = weakref.WeakSet()


def _stop_in_forked_child() -> None:
    """``os.fork`` child (a DataLoader worker): stop the native capture the parent had
    running; the child records nothing and writes no file."""
    for tracker in list(_RUNNING):
        tracker._leave_forked_child()
    _RUNNING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_in_forked_child)

# mark types shared with _native.cpp
_M_GRADS, _M_OPT_STATE, _M_PARAMS, _M_BUFFERS, _M_INPUTS, _M_STEP, _M_FWD_START, _M_USER = range(1, 9)
_P_OTHER, _P_FWD, _P_BWD, _P_OPT = (int(p) for p in Phase)
_graph_task_id = torch._C._current_graph_task_id
_OPT = object()  # the optimizer's entry on the module stack

# _native.cpp hard-codes these numbers
assert [int(Category[n]) for n in ("OTHER", "PARAMETER", "BUFFER", "GRADIENT", "ACTIVATION",
                                   "OPTIMIZER_STATE", "INPUT", "TEMPORARY")] == list(range(8))
assert (_P_OTHER, _P_FWD, _P_BWD, _P_OPT) == (0, 1, 2, 3)


def _ptrs(tensors: Any) -> list[int]:
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.device.type == "cpu":
            out.append(t.untyped_storage().data_ptr())
    return out


class FastTracker:
    """Result and context manager of ``torchmem.track(..., mode="fast")``.

    Same read API as :class:`~torchmem.Tracker`: :meth:`events`, :meth:`peak`,
    :meth:`live_bytes`, :meth:`save`, :meth:`mark`, :meth:`step`, ``trace``, ``len()``.

    Example:
        >>> import torch, torchmem
        >>> from torchmem.capture.fast import native_available
        >>> if native_available():
        ...     with torchmem.track(mode="fast") as tr:
        ...         x = torch.ones(1000)          # 4000 bytes
        ...     print(tr.peak())
        ... else:
        ...     print({'cpu': 4000})
        {'cpu': 4000}
    """

    def __init__(
        self,
        *targets: Any,
        modules: bool = True,
        step_marker: str = "optimizer",
        metadata: dict[str, Any] | None = None,
        path: PathLike | None = None,
    ) -> None:
        self._modules_in, self._optims_in = check_track_args(targets, step_marker, path)
        self.path = path
        self.module_attribution = bool(modules)
        self.step_marker = step_marker
        self.trace = Trace({"producer": "torchmem.track", "mode": "fast",
                            "torch_version": torch.__version__, "stacks": False,
                            **(metadata or {})})
        self._native: Any = None
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        #: ids of modules whose forward has returned once (their uncalled children named)
        self._settled: set[int] = set()
        self._stack: list[int] = []
        self._mods: list[Any] = []
        self._phase = _P_OTHER
        self._bounds = array("q")
        self._owners = array("i")
        self._optims: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._clock_opt: weakref.ref[torch.optim.Optimizer] | None = None
        self._params: dict[int, weakref.ref[torch.Tensor]] = {}
        self._initial: dict[int, tuple[int, int, int]] = {}  # ptr -> row, nbytes, category
        self._hooks: list[Any] = []
        self._thread = threading.get_ident()
        self._thread_idx = 0
        self._t0 = 0
        self._active = False
        self._used = False
        self._steps = 0
        self.records = 0

    # ------------------------------------------------------------------ hooks
    def _set(self) -> None:
        self._native.set_context(self._stack[-1] if self._stack else 0, self._phase)

    def _seq_mark(self, owner: int) -> None:
        seq_mark(self._bounds, self._owners, owner)

    def _note_params(self, params: Any) -> None:
        note_params(self._params, params)

    def _name_of(self, m: torch.nn.Module) -> int:
        parent = self._mods[-1] if self._mods and self._mods[-1] is not _OPT else None
        if parent is not None:
            pidx = self._names.get(parent)
            pname = self.trace.strings[pidx] if pidx is not None else type(parent).__name__
            name = _path_below(parent, m, pname)
        else:
            name = type(m).__name__
        idx = self._names[m] = self.trace.intern(name)
        self._note_params(m.parameters(recurse=False))
        # its parameters and buffers made while tracking get their categories now
        self._native.mark(_M_PARAMS, idx, _ptrs(m.parameters(recurse=False)))
        self._native.mark(_M_BUFFERS, idx, _ptrs(m.buffers(recurse=False)))
        return idx

    def _fw_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self._active or threading.get_ident() != self._thread:
            return
        idx = self._names.get(module)
        if idx is None:
            idx = self._name_of(module)
        if not self._mods and _graph_task_id() == -1:
            if self._phase == _P_OTHER:
                self._native.mark(_M_INPUTS, 0, _ptrs(iter_tensors(args)))
            if self._phase != _P_OPT:
                self._phase = _P_FWD
                self._native.mark(_M_FWD_START, 0, [])
        self._stack.append(idx)
        self._mods.append(module)
        self._seq_mark(idx)
        self._set()

    def _fw_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._mods or self._mods[-1] is not module or threading.get_ident() != self._thread:
            return
        self._mods.pop()
        self._stack.pop()
        self._seq_mark(self._stack[-1] if self._stack else 0)
        self._set()
        if id(module) not in self._settled:
            self._settled.add(id(module))
            self._name_uncalled(module)

    def _name_uncalled(self, m: torch.nn.Module) -> None:
        """On ``m``'s first return: its submodules its forward did not call
        (``nn.MultiheadAttention`` reads ``out_proj.weight`` itself) are named below it, so
        their parameters and buffers are parameters and buffers, not "other"."""
        for child, idx in name_uncalled(m, self._names, self.trace):
            self._note_params(child.parameters(recurse=False))
            self._native.mark(_M_PARAMS, idx, _ptrs(child.parameters(recurse=False)))
            self._native.mark(_M_BUFFERS, idx, _ptrs(child.buffers(recurse=False)))

    def _grads_mark(self) -> None:
        ptrs = []
        for k, r in list(self._params.items()):
            p = r()
            if p is None:
                del self._params[k]
                continue
            g = p.grad
            if g is not None and g.layout is torch.strided and g.device.type == "cpu":
                ptrs.append(g.untyped_storage().data_ptr())
        self._native.mark(_M_GRADS, 0, ptrs)

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if not self._active or threading.get_ident() != self._thread:
            return None
        if opt not in self._optims:
            self._optims.add(opt)
            for group in opt.param_groups:
                self._note_params(group["params"])
        if self._clock_opt is None:
            self._clock_opt = weakref.ref(opt)
        self._grads_mark()
        name = self.trace.intern(f"optimizer:{type(opt).__name__}")
        self._enter_optimizer(name)
        # a closure's forward and backward are the model's: the optimizer phase pauses
        return around_closure(args, kwargs, self._leave_optimizer,
                              lambda: self._enter_optimizer(name))

    def _enter_optimizer(self, name: int) -> None:
        if not self._active:
            return
        self._phase = _P_OPT
        self._stack.append(name)
        self._mods.append(_OPT)
        self._set()

    def _leave_optimizer(self) -> None:
        if not self._active:
            return
        if self._mods and self._mods[-1] is _OPT:
            self._mods.pop()
            self._stack.pop()
        self._phase = _P_OTHER
        self._set()

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active or threading.get_ident() != self._thread:
            return
        state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        self._native.mark(_M_OPT_STATE, 0, _ptrs(state))
        self._leave_optimizer()
        clock = self._clock_opt() if self._clock_opt is not None else None
        if self.step_marker == "optimizer" and clock is opt:
            self.step()

    # ------------------------------------------------------------------ public
    def step(self) -> int:
        """End an iteration: a step marker (``op="step"``), as :meth:`Tracker.step`.

        Example:
            >>> import torch, torchmem
            >>> from torchmem.capture.fast import native_available
            >>> if native_available():
            ...     with torchmem.track(mode="fast", step_marker="manual") as tr:
            ...         for _ in range(2):
            ...             y = torch.ones(10); _ = tr.step()
            ...     print([e.step for e in tr.events() if e.op == "step"])
            ... else:
            ...     print([0, 1])
            [0, 1]
        """
        if not self._active:
            raise InvalidInputError("step() is only valid inside the tracking block")
        self._grads_mark()
        self._native.mark(_M_STEP, self.trace.intern("step"), [])
        self._phase = _P_OTHER
        self._set()
        self._steps += 1
        return self._steps - 1

    def mark(self, name: str) -> None:
        """Record a MARK event named ``name`` where the block is now.

        Example:
            >>> import torchmem
            >>> from torchmem.capture.fast import native_available
            >>> if native_available():
            ...     with torchmem.track(mode="fast") as tr:
            ...         tr.mark("epoch-1")
            ...     print([e.op for e in tr.events()])
            ... else:
            ...     print(['epoch-1'])
            ['epoch-1']
        """
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"a mark name must be a non-empty str, got {name!r}")
        if not self._active:
            raise InvalidInputError("mark() is only valid inside the tracking block")
        self._native.mark(_M_USER, self.trace.intern(name), [])

    def events(self) -> Iterator[Event]:
        """Events in sequence order (after the block ends).

        Example:
            >>> import torchmem
            >>> list(torchmem.capture.FastTracker().events())
            []
        """
        return self.trace.events()

    def peak(self) -> dict[str, int]:
        """Peak live bytes per device (after the block ends; the initial state included).

        Example:
            >>> import torchmem
            >>> torchmem.capture.FastTracker().peak()
            {}
        """
        return self.trace.peak()

    def live_bytes(self, device: str | None = None) -> Any:
        """Live bytes at the end of the block, per device or for one device.

        Example:
            >>> import torchmem
            >>> torchmem.capture.FastTracker().live_bytes("cpu")
            0
        """
        return self.trace.live_bytes(device)

    def save(self, path: PathLike) -> None:
        """Write the trace to a ``.tmtrace`` file.

        Example:
            >>> import torchmem, tempfile, os
            >>> p = os.path.join(tempfile.mkdtemp(), "f.tmtrace")
            >>> torchmem.capture.FastTracker().save(p); len(torchmem.load_trace(p))
            0
        """
        self.trace.metadata["peak"] = self.peak()
        save_trace(self.trace, path)

    def __len__(self) -> int:
        return len(self.trace)

    # ------------------------------------------------------------------ lifecycle
    def _capture_initial(self) -> None:
        items = initial_state(self._modules_in, self._optims_in, self._names)
        tr = self.trace
        for t, cat, mod in items:
            if t.layout is not torch.strided or t.device.type != "cpu":
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr in self._initial or s.nbytes() == 0:
                continue
            row = len(tr)
            tr.append(EventKind.ALLOC, 0, "cpu", s.nbytes(), row + 1,
                      module=tr.strings[mod] if mod else None, category=cat)
            self._initial[ptr] = (row, s.nbytes(), int(cat))

    def __enter__(self) -> FastTracker:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        if self._used:
            raise InvalidInputError(
                "this tracker was already used; call torchmem.track(..., mode='fast') again")
        self._used = True
        self._native = load_native()
        if self._native.active():
            raise InvalidInputError(
                "another mode='fast' tracker is running: fast trackers do not nest; end that one "
                "first, or use mode='ops' for the inner one"
            )
        if torch.cuda.is_available():
            warnings.warn("mode='fast' records CPU memory only; CUDA tensors are not seen: use "
                          "mode='ops' to track them", RuntimeWarning, stacklevel=3)
        self._thread = threading.get_ident()
        self.trace.intern_device("cpu")
        self._thread_idx = self.trace.intern_thread(threading.current_thread().name)
        self.trace.metadata["start_unix_ns"] = time.time_ns()
        for root in self._modules_in:
            base = type(root).__name__
            for name, m in root.named_modules():
                if m not in self._names:
                    self._names[m] = self.trace.intern(f"{base}.{name}" if name else base)
            self._note_params(root.parameters())
        for o in self._optims_in:
            self._optims.add(o)
            for group in o.param_groups:
                self._note_params(group["params"])
        self._capture_initial()
        if self.module_attribution:
            self._hooks.append(nn_module.register_module_forward_pre_hook(self._fw_pre))
            self._hooks.append(nn_module.register_module_forward_hook(self._fw_post, always_call=True))
        self._hooks.append(optim_module.register_optimizer_step_pre_hook(self._opt_pre))
        self._hooks.append(optim_module.register_optimizer_step_post_hook(self._opt_post))
        self._t0 = time.perf_counter_ns()  # the native clock is the same monotonic clock
        self._native.start()
        self._active = True
        _RUNNING.add(self)
        return self

    def _leave_forked_child(self) -> None:
        """In a forked child: stop the native capture (the CPU allocator and the operator
        callback are restored) and drop the hooks' work; leaving the block there writes
        nothing (the parent owns the run and its file)."""
        self._active = False
        self.path = None
        if self._native is not None:
            self._native.stop()

    def __exit__(self, *exc: object) -> None:
        _RUNNING.discard(self)
        if not self._active:
            for h in self._hooks:  # in a forked child: the hooks are that process's own
                h.remove()
            self._hooks.clear()
            return
        try:
            self._grads_mark()
        finally:
            self._active = False
            self._native.stop()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
        self._convert()
        if self.path is not None:
            self.save(self.path)

    def _convert(self) -> None:
        tr = self.trace
        names = self._native.op_names()
        op_lut = [tr.intern(n) for n in names]
        ptrs = list(self._initial)
        rows = [self._initial[p][0] for p in ptrs]
        sizes = [self._initial[p][1] for p in ptrs]
        first = len(tr)
        out = self._native.convert(first, self._t0, ptrs, rows, sizes, op_lut,
                                   list(self._bounds), list(self._owners), list(range(256)), 0)
        self.records = int(out["records"])
        cols = ("kind", "time_ns", "nbytes", "storage", "op", "module", "phase", "category",
                "step", "thread")
        for name in cols:
            getattr(tr, name).frombytes(out[name])
        n = len(tr.kind) - first
        tr.device.frombytes(bytes(2 * n))  # device 0: "cpu", interned first
        tr.stack.extend(array("i", [-1]) * n)
        # frees of initial storages (address reused): their category is the initial one
        cat = tr.category
        init_cat = {row + 1: c for row, _, c in self._initial.values()}
        if n and max(cat[first:]) == 255:
            for i in range(first, len(tr)):
                if cat[i] == 255:
                    cat[i] = init_cat.get(tr.storage[i], int(Category.OTHER))
        # native thread numbers -> thread names (0: the tracking thread)
        th = tr.thread
        main = self._thread_idx
        if n and max(th[first:]) == 0:
            th[first:] = array("H", [main]) * n
        elif n:
            lut = {0: main}
            for i in range(first, len(tr)):
                k = th[i]
                if k not in lut:
                    lut[k] = tr.intern_thread(f"thread-{k}")
                th[i] = lut[k]
