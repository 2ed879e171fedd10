"""The dispatch-mode memory tracker: every storage created while active, with attribution.

CONTRACT (other parts of torchmem code against this; it is stable):

* ``torchmem.track(*modules_and_optimizers, stacks=False, stack_depth=8, listeners=(), ...)``
  is a context manager yielding a :class:`Tracker`.
* ``tracker.add_listener(fn)`` / ``tracker.remove_listener(fn)`` / ``listeners=``:
  ``fn(event, storage)`` is called synchronously for every event as it is recorded. ALLOC events
  pass the ``torch.UntypedStorage`` (attach your own ``weakref.finalize`` to it if you need to;
  do not keep it alive), FREE and MARK events pass ``None``. The category an ALLOC carries at
  that moment is *provisional* (by phase: forward -> activation, backward/optimizer ->
  temporary, otherwise other); ``tracker.events()`` returns the final categories (see
  "Categories" below).
* ``tracker.events()`` (in sequence order), ``tracker.peak()`` (device -> peak live bytes),
  ``tracker.live_bytes(device=None)``, ``tracker.save(path)``, ``tracker.trace`` (a torch-free
  :class:`~torchmem.model.trace.Trace`); ``torchmem.load_trace(path)`` reads a saved file.
* ``tracker.mark(name)`` adds a MARK event with ``op=name``. A *step marker* is a MARK with
  ``op == "step"``: added after each ``optimizer.step()`` (``step_marker="optimizer"``, the
  default) or by ``tracker.step()``. ``Event.step`` counts the step markers recorded before the
  event, so iteration *k* is the events with ``step == k``.

How it works: a ``TorchDispatchMode`` sees every operator output (forward, backward, optimizer,
autograd's saved tensors are operator outputs too). An output whose ``UntypedStorage`` is not
already live is a new allocation (outputs of view and in-place/``out=`` operators alias their
inputs and are skipped; an in-place op allocates nothing). A weak reference with a callback on
the ``UntypedStorage`` records the free when PyTorch destroys the storage; the tracker never holds
a tensor or a storage. Module attribution uses global forward pre/post hooks; they also note the
autograd sequence number at each module boundary, so in backward the node being executed
(``torch._C._current_autograd_node()``) maps back to the module whose forward created it, with
no per-call tensor hooks. The optimizer phase uses the global optimizer step pre/post hooks.

Categories (heuristics):
  parameter / buffer / gradient / optimizer_state: storages of ``module.parameters()``,
  ``module.buffers()``, ``param.grad`` and ``optimizer.state`` of the objects passed to
  ``track()`` (recorded as ALLOC events at time 0), and of any module seen running or optimizer
  seen stepping (reclassified when seen). activation: allocated in the forward phase and still
  alive when forward ends (the forward phase runs from the first module call to the start of
  backward, an optimizer step or a step marker). temporary: freed within the phase it was
  allocated in. gradient (new): allocated in backward and the ``.grad`` of a known parameter when
  backward ends. optimizer_state: allocated in ``optimizer.step`` and held in
  ``optimizer.state``. input: allocated outside any phase and passed to an outermost module
  call. other: the rest.

Storage ids: ``Event.storage`` is the ALLOC's sequence number + 1. A storage resized in place
(``resize_``, an ``out=`` into a too-small tensor) is recorded as a FREE of the old size and an
ALLOC of the new size (a new id). Frees that happen on another thread are recorded on the
tracking thread at its next event.

Limits: allocations inside one aten kernel that never surface as an output (workspaces) are
invisible (:func:`torchmem.track_lite` sees them); storages a kernel resizes without returning
them are missed; frees of storages in reference cycles are recorded when the garbage collector
runs; tensors created from Python data (``torch.tensor``) are seen through ``lift_fresh``.

Example:
    >>> import torch, torchmem
    >>> model = torch.nn.Linear(4, 3)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with torchmem.track(model, opt) as tr:
    ...     model(torch.randn(2, 4)).sum().backward()
    ...     opt.step()
    >>> tr.peak()["cpu"] >= 48 + 12          # the parameters are counted from the start
    True
    >>> sorted({e.category.label for e in tr.events()})
    ['activation', 'gradient', 'input', 'other', 'parameter', 'temporary']
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
import weakref
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchmem.capture.storage import device_str
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import PathLike, save_trace
from torchmem.model.events import Category, Event, EventKind, Phase
from torchmem.model.trace import Trace

__all__ = ["track", "Tracker", "Listener"]

Listener = Callable[[Event, Optional[torch.UntypedStorage]], None]

_ALLOC = int(EventKind.ALLOC)
_FREE = int(EventKind.FREE)
_MARK = int(EventKind.MARK)
_P_OTHER, _P_FWD, _P_BWD, _P_OPT = (int(p) for p in Phase)
_C = Category
_PROVISIONAL = {
    _P_OTHER: int(_C.OTHER),
    _P_FWD: int(_C.ACTIVATION),
    _P_BWD: int(_C.TEMPORARY),
    _P_OPT: int(_C.TEMPORARY),
}
_TEMP = int(_C.TEMPORARY)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCHMEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIP_FILES = {os.path.abspath(getattr(sys.modules.get("runpy"), "__file__", "") or "runpy.py")}
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_next_seq = torch._C._autograd._get_sequence_nr  # the sequence number the next node will get
_NO_SEQ = 2**63  # AccumulateGrad reports UINT64_MAX
_OPT_SENTINEL: Any = torch.nn.Identity()  # marks the optimizer entry on the module stack
_perf_ns = time.perf_counter_ns
_grad_enabled = torch.is_grad_enabled
_strided = torch.strided


class _SRef(weakref.ref):  # type: ignore[type-arg]
    """Weak reference to a live storage carrying what the free event needs."""

    __slots__ = ("key", "seq", "dev", "nbytes", "region")

    key: int
    seq: int  # of the ALLOC event; the trace's storage id is seq + 1
    region: int
    dev: int
    nbytes: int


class _Mode(TorchDispatchMode):
    """Sees every operator; reports non-aliasing outputs to the tracker."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self._on_outputs = tracker._on_outputs
        self._ops = tracker._ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        info = self._ops.get(func)
        if info is None or info:
            self._on_outputs(func, out, info)
        return out


class Tracker:
    """Records storage allocations and frees with operator, module, phase and category.

    Create it with :func:`track`. Between ``__enter__`` and ``__exit__`` it is active; after
    the block its results stay readable (:meth:`events`, :meth:`peak`, :meth:`save`).

    Example:
        >>> import torch, torchmem
        >>> seen = []
        >>> with torchmem.track(listeners=[lambda e, s: seen.append(e.kind.label)]) as tr:
        ...     x = torch.ones(1000)                 # 4000 bytes
        ...     _ = tr.mark("here")
        ...     del x
        >>> seen, tr.peak()
        (['alloc', 'mark', 'free'], {'cpu': 4000})
    """

    def __init__(
        self,
        *targets: Any,
        stacks: bool = False,
        stack_depth: int = 8,
        listeners: Iterable[Listener] = (),
        modules: bool = True,
        step_marker: str = "optimizer",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if step_marker not in ("optimizer", "manual"):
            raise InvalidInputError(
                f"step_marker must be 'optimizer' or 'manual', got {step_marker!r}; use 'manual' "
                "and call tracker.step() yourself when optimizer.step() is not your iteration"
            )
        if not isinstance(stack_depth, int) or stack_depth < 1:
            raise InvalidInputError(f"stack_depth must be an int >= 1, got {stack_depth!r}")
        self._modules_in: list[torch.nn.Module] = []
        self._optims_in: list[torch.optim.Optimizer] = []
        for i, t in enumerate(targets):
            if isinstance(t, torch.nn.Module):
                self._modules_in.append(t)
            elif isinstance(t, torch.optim.Optimizer):
                self._optims_in.append(t)
            else:
                raise InvalidInputError(
                    f"track() argument {i} must be a torch.nn.Module or torch.optim.Optimizer, "
                    f"got {type(t).__name__}; pass tensors' owners, or nothing to track all ops"
                )
        self.stacks = bool(stacks)
        self.stack_depth = stack_depth
        self.module_attribution = bool(modules)
        self.step_marker = step_marker
        self._listeners: list[Listener] = list(listeners)
        self.trace = Trace(
            {
                "producer": "torchmem.track",
                "torch_version": torch.__version__,
                "stacks": self.stacks,
                **(metadata or {}),
            }
        )
        self._ops: dict[Any, Any] = {}
        self._live: dict[int, _SRef] = {}
        self._region_id = 0  # allocations freed in the region they were made in are temporaries
        self._live_dev: list[int] = []
        self._peak_dev: list[int] = []
        self._dev_cache: dict[torch.device, int] = {}
        self._step = 0
        self._phase = _P_OTHER  # the non-backward phase (forward/optimizer/other)
        self._cur = _P_OTHER  # phase of the current region
        self._bw_task = -1
        # graph tasks whose end callback is queued: a reentrant backward (checkpointing with
        # use_reentrant=True) runs inside the outer one, whose phase must not end with it
        self._bw_tasks: set[int] = set()
        self._fw_names: list[int] = []  # interned module names (trace string indexes)
        self._fw_mods: list[torch.nn.Module] = []
        # backward attribution: the autograd sequence number where the innermost running
        # module changed (sorted) and that module's interned name, recorded in forward
        self._seq_bounds = array("q")
        self._seq_owner = array("I")
        self._bw_last = 0
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self._optims: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._clock_opt: weakref.ref[torch.optim.Optimizer] | None = None
        self._skip_code: dict[Any, bool] = {}
        self._t0 = 0
        self._active = False
        self._used = False
        self._thread = threading.get_ident()
        self._exit: list[Callable[[], None]] = []
        self._on_free_cb: Callable[[Any], None] = _ignore
        self._drain: Callable[[], None] = _ignore
        self._pending: deque[tuple[_SRef, int]] = deque()
        self._on_outputs: Callable[[Any, Any, Any], None] = _ignore
        self.listener_errors: list[BaseException] = []
        self._slow = self.stacks or bool(self._listeners)
        self._params: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> parameter, for .grad

    # ------------------------------------------------------------------ public API
    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, storage_or_None)`` for every event recorded from now on.

        Example:
            >>> import torchmem
            >>> with torchmem.track() as tr:
            ...     got = []; tr.add_listener(lambda e, s: got.append(e.op)); _ = tr.mark("m")
            >>> got
            ['m']
        """
        if not callable(fn):
            raise InvalidInputError(f"a listener must be callable, got {type(fn).__name__}")
        self._listeners.append(fn)
        self._slow = True

    def remove_listener(self, fn: Listener) -> None:
        """Stop calling ``fn`` (no error if it was not registered).

        Example:
            >>> import torchmem
            >>> f = lambda e, s: None
            >>> tr = torchmem.Tracker(listeners=[f]); tr.remove_listener(f); tr.remove_listener(f)
        """
        try:
            self._listeners.remove(fn)
        except ValueError:
            pass
        self._slow = self.stacks or bool(self._listeners)

    def mark(self, name: str) -> int:
        """Record a MARK event named ``name``; returns its sequence number.

        Example:
            >>> import torchmem
            >>> with torchmem.track() as tr:
            ...     _ = tr.mark("epoch-1")
            >>> [e.op for e in tr.events()]
            ['epoch-1']
        """
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"a mark name must be a non-empty str, got {name!r}")
        self._drain()
        return self._record(_MARK, 0, 0, 0, self.trace.intern(name), self._cur_module(), self._cur, 0, None)

    def step(self) -> int:
        """End an iteration: close the current phase and record a step marker (``op="step"``).

        With ``step_marker="optimizer"`` (default) this happens after every ``optimizer.step()``
        of the first optimizer seen stepping; call it yourself with ``step_marker="manual"``.

        Example:
            >>> import torch, torchmem
            >>> with torchmem.track(step_marker="manual") as tr:
            ...     for _ in range(3):
            ...         y = torch.ones(10); _ = tr.step()
            >>> [e.step for e in tr.events() if e.op == "step"]
            [0, 1, 2]
        """
        self._drain()
        self._end_region(_P_OTHER)
        self._phase = _P_OTHER
        self._prune_seq_map()
        seq = self._record(_MARK, 0, 0, 0, self.trace.intern("step"), 0, _P_OTHER, 0, None)
        self._step += 1
        return seq

    def events(self) -> Iterator[Event]:
        """All events recorded so far, in sequence order (final categories).

        Example:
            >>> import torch, torchmem
            >>> with torchmem.track() as tr:
            ...     y = torch.zeros(4) + 1
            >>> [(e.kind.label, e.op, e.nbytes) for e in tr.events()][:2]
            [('alloc', 'aten::zeros', 16), ('alloc', 'aten::add', 16)]
        """
        return self.trace.events()

    def peak(self) -> dict[str, int]:
        """Peak live bytes per device since the start (initial state included).

        Example:
            >>> import torch, torchmem
            >>> with torchmem.track() as tr:
            ...     a = torch.zeros(100); del a; b = torch.zeros(50)
            >>> tr.peak()
            {'cpu': 400}
        """
        return dict(zip(self.trace.devices, self._peak_dev))

    def live_bytes(self, device: str | None = None) -> Any:
        """Bytes of tracked storages alive now: a dict per device, or an int for ``device``.

        Example:
            >>> import torch, torchmem
            >>> with torchmem.track() as tr:
            ...     a = torch.zeros(100)
            ...     tr.live_bytes("cpu")
            400
        """
        per = dict(zip(self.trace.devices, self._live_dev))
        if device is not None:
            return per.get(device_str(device), 0)
        return per

    def save(self, path: PathLike) -> None:
        """Write the events recorded so far to a ``.tmtrace`` file (see
        :mod:`torchmem.io.tmtrace` for the format).

        Example:
            >>> import tempfile, os, torch, torchmem
            >>> with torchmem.track() as tr:
            ...     _ = torch.zeros(8)
            >>> p = os.path.join(tempfile.mkdtemp(), "t.tmtrace"); tr.save(p)
            >>> torchmem.load_trace(p).peak()
            {'cpu': 32}
        """
        self.trace.metadata["peak"] = self.peak()
        save_trace(self.trace, path)

    def __len__(self) -> int:
        return len(self.trace)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Tracker:
        if self._active or self._used:
            raise InvalidInputError(
                "this Tracker was already used; call torchmem.track(...) again for a new run"
            )
        self._used = True
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter_ns()
        self._make_hot_paths()
        self.trace.metadata["start_unix_ns"] = time.time_ns()
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._active:
                self._drain()
                self._end_region(_P_OTHER)
        finally:
            self._active = False
            self._uninstall()

    def _install(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        for root in self._modules_in:
            base = type(root).__name__
            for name, m in root.named_modules():
                if m not in self._names:
                    self._names[m] = self.trace.intern(f"{base}.{name}" if name else base)
        for o in self._optims_in:
            self._optims.add(o)
            for group in o.param_groups:
                self._note_params(group["params"])
        for root in self._modules_in:
            self._note_params(root.parameters())
        self._capture_initial()
        if self.module_attribution:
            h1 = nn_module.register_module_forward_pre_hook(self._fw_pre)
            self._exit.append(h1.remove)
            h2 = nn_module.register_module_forward_hook(self._fw_post, always_call=True)
            self._exit.append(h2.remove)
        h3 = optim_module.register_optimizer_step_pre_hook(self._opt_pre)
        self._exit.append(h3.remove)
        h4 = optim_module.register_optimizer_step_post_hook(self._opt_post)
        self._exit.append(h4.remove)
        mode = _Mode(self)
        mode.__enter__()
        self._exit.append(lambda: mode.__exit__(None, None, None))

    def _uninstall(self) -> None:
        errors = []
        while self._exit:
            fn = self._exit.pop()
            try:
                fn()
            except Exception as e:  # keep removing the rest
                errors.append(e)
        self._live.clear()  # drops the weak references: no callback after exit
        self._fw_names.clear()
        self._fw_mods.clear()
        del self._seq_bounds[:], self._seq_owner[:]
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ recording
    def _dev_index(self, device: torch.device) -> int:
        i = self._dev_cache.get(device)
        if i is None:
            i = self.trace.intern_device(device_str(device))
            while len(self._live_dev) <= i:
                self._live_dev.append(0)
                self._peak_dev.append(0)
            self._dev_cache[device] = i
        return i

    def _cur_module(self) -> int:
        if _graph_task_id() != -1:
            return self._bw_module()
        return self._fw_names[-1] if self._fw_names else 0

    def _bw_module(self) -> int:
        """The module whose forward created the autograd node running now (0 if none)."""
        node = _current_node()
        if node is None:
            return 0
        nr = node._sequence_nr()
        if nr >= _NO_SEQ:  # AccumulateGrad and other graph roots: keep the last module
            return self._bw_last
        i = bisect_right(self._seq_bounds, nr) - 1
        mod = self._seq_owner[i] if i >= 0 else 0
        self._bw_last = mod
        return mod

    def _seq_mark(self, owner: int) -> None:
        bounds = self._seq_bounds
        nr = _next_seq()
        if bounds and bounds[-1] == nr:  # no autograd node since the last change
            self._seq_owner[-1] = owner
        else:
            bounds.append(nr)
            self._seq_owner.append(owner)

    def _prune_seq_map(self) -> None:
        """At a step marker the graphs of earlier iterations have run backward: forget them."""
        if len(self._seq_bounds) > 1:
            owner = self._seq_owner[-1]
            del self._seq_bounds[:], self._seq_owner[:]
            self._seq_bounds.append(_next_seq())
            self._seq_owner.append(owner)

    def _phase_now(self) -> int:
        return _P_BWD if _graph_task_id() != -1 else self._phase

    def _stack(self) -> int:
        f: Any = sys._getframe(2)
        out: list[str] = []
        skip = self._skip_code
        depth = self.stack_depth
        while f is not None and len(out) < depth:
            code = f.f_code
            s = skip.get(code)
            if s is None:
                fn = code.co_filename
                s = skip[code] = (
                    fn.startswith(_TORCH_DIR)
                    or (fn.startswith(_TORCHMEM_DIR) and not fn.endswith("_example_train.py"))
                    or fn.startswith("<frozen")
                    or fn == "<frozen runpy>"
                    or os.path.abspath(fn) in _SKIP_FILES
                )
            if not s:
                out.append(f"{code.co_filename}:{f.f_lineno}:{code.co_name}")
            f = f.f_back
        out.reverse()
        return self.trace.intern_stack(out)

    def _record(
        self,
        kind: int,
        dev: int,
        nbytes: int,
        sid: int,
        op: int,
        module: int,
        phase: int,
        cat: int,
        storage: torch.UntypedStorage | None,
    ) -> int:
        """Append one event (general path: marks, initial state, stacks, listeners).

        ``sid=-1`` means "this event's own sequence number + 1" (a new storage). Everything
        that can allocate Python objects (and so run the garbage collector, whose frees call
        back into the tracker) happens before the appends, so the columns stay aligned.
        """
        tr = self.trace
        stack = self._stack() if self.stacks else -1
        now = _perf_ns() - self._t0 if kind != _ALLOC or self._active else 0
        seq = len(tr.kind)
        tr.kind.append(kind)
        tr.time_ns.append(now)
        tr.device.append(dev)
        tr.nbytes.append(nbytes)
        tr.storage.append(seq + 1 if sid < 0 else sid)
        tr.op.append(op)
        tr.module.append(module)
        tr.phase.append(phase)
        tr.category.append(cat)
        tr.step.append(self._step)
        tr.stack.append(stack)
        if kind == _ALLOC:
            v = self._live_dev[dev] + nbytes
            self._live_dev[dev] = v
            if v > self._peak_dev[dev]:
                self._peak_dev[dev] = v
        elif kind == _FREE:
            self._live_dev[dev] -= nbytes
        elif not tr.devices:
            self._dev_index(torch.device("cpu"))
        if self._listeners:
            ev = tr.event(seq)
            for fn in list(self._listeners):
                try:
                    fn(ev, storage)
                except Exception as e:  # a broken listener must not break the user's op
                    self.listener_errors.append(e)
                    self.remove_listener(fn)
                    warnings.warn(
                        f"torchmem: listener {fn!r} raised {type(e).__name__}: {e}; removed",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        return seq

    def _add_storage(
        self, s: torch.UntypedStorage, device: torch.device, op: int, module: int,
        phase: int, cat: int,
    ) -> int:
        """Record a new live storage (general path); returns the ALLOC's sequence number."""
        key = s._cdata
        if key in self._live:
            return -1
        nbytes = s.nbytes()
        dev = self._dev_cache.get(device)
        if dev is None:
            dev = self._dev_index(device)
        ref = _SRef(s, self._on_free_cb)
        ref.key = key
        ref.seq = -1
        ref.dev = dev
        ref.nbytes = nbytes
        ref.region = self._region_id
        self._live[key] = ref
        seq = ref.seq = self._record(_ALLOC, dev, nbytes, -1, op, module, phase, cat, s)
        return seq

    def _make_hot_paths(self) -> None:
        """Build the per-operator and per-free callbacks as closures over local bindings:
        they run for every allocation and free, so they avoid attribute lookups."""
        tr = self.trace
        live = self._live
        live_get = live.get
        dev_cache = self._dev_cache
        live_dev = self._live_dev
        peak_dev = self._peak_dev
        cat_col = tr.category
        a_kind, a_time, a_dev, a_nb, a_sid = (
            tr.kind.append, tr.time_ns.append, tr.device.append, tr.nbytes.append,
            tr.storage.append,
        )
        a_op, a_mod, a_phase, a_cat, a_step, a_stack = (
            tr.op.append, tr.module.append, tr.phase.append, tr.category.append,
            tr.step.append, tr.stack.append,
        )
        kind_col = tr.kind
        fw_names = self._fw_names
        t0 = self._t0
        perf = _perf_ns
        task = _graph_task_id
        strided = _strided
        Tensor = torch.Tensor
        SRef = _SRef
        provisional = _PROVISIONAL
        me = self

        pending = self._pending
        main_thread = self._thread
        get_ident = threading.get_ident

        def on_free(ref: _SRef) -> None:
            if get_ident() != main_thread:
                # freed on another thread (a data-loader or autograd worker): record it on the
                # tracking thread at its next event, so two threads never interleave appends
                pending.append((ref, perf() - t0))
                return
            if pending:
                drain()
            free(ref, perf() - t0)

        def drain() -> None:
            while pending:
                ref, when = pending.popleft()
                free(ref, when)

        def free(ref: _SRef, when: int) -> None:
            key = ref.key
            if live_get(key) is not ref or not me._active:
                return
            del live[key]
            seq = ref.seq
            if ref.region == me._region_id:
                cat = _TEMP
                cat_col[seq] = cat
            else:
                cat = cat_col[seq]
            if task() != -1:
                phase = _P_BWD
                mod = me._bw_module()
            else:
                phase = me._phase
                mod = fw_names[-1] if fw_names else 0
            dev = ref.dev
            nbytes = ref.nbytes
            if me._slow:
                me._record(_FREE, dev, nbytes, seq + 1, 0, mod, phase, cat, None)
                return
            a_kind(_FREE)
            a_time(when)
            a_dev(dev)
            a_nb(nbytes)
            a_sid(seq + 1)
            a_op(0)
            a_mod(mod)
            a_phase(phase)
            a_cat(cat)
            a_step(me._step)
            a_stack(-1)
            live_dev[dev] -= nbytes

        def on_outputs(func: Any, out: Any, info: Any) -> None:
            if info is None:
                info = me._op_info(func)
                if not info:
                    return
            if pending:
                drain()
            if isinstance(out, Tensor):
                tensors: Iterable[Any] = (out,)
            elif isinstance(out, (tuple, list)):
                tensors = _flatten(out)
            else:
                return
            if info < 0:  # in-place / out=: only a resized storage is news
                for t in tensors:
                    if t.layout is strided:
                        s = t.untyped_storage()
                        ref = live_get(s._cdata)
                        if ref is not None and s.nbytes() != ref.nbytes:
                            me._resized(ref, s, t.device, -info)
                return
            tid = task()
            if tid != -1:
                phase = _P_BWD
                if tid != me._bw_task:
                    me._begin_backward(tid)
                module = me._bw_module()
            else:
                phase = me._phase
                if phase != me._cur:
                    me._end_region(phase)
                module = fw_names[-1] if fw_names else 0
            cat = provisional[phase]
            region = me._region_id
            slow = me._slow
            for t in tensors:
                if t.layout is not strided:
                    continue
                s = t.untyped_storage()
                key = s._cdata
                if key in live:
                    continue
                if slow:
                    me._add_storage(s, t.device, info, module, phase, cat)
                    continue
                nbytes = s.nbytes()
                device = t.device
                dev = dev_cache.get(device)
                if dev is None:
                    dev = me._dev_index(device)
                # make the weak reference first: creating it can run the garbage collector,
                # whose frees append FREE events, so the sequence number is read after it
                ref = SRef(s, on_free)
                seq = len(kind_col)
                ref.key = key
                ref.seq = seq
                ref.dev = dev
                ref.nbytes = nbytes
                ref.region = region
                live[key] = ref
                a_kind(_ALLOC)
                a_time(perf() - t0)
                a_dev(dev)
                a_nb(nbytes)
                a_sid(seq + 1)
                a_op(info)
                a_mod(module)
                a_phase(phase)
                a_cat(cat)
                a_step(me._step)
                a_stack(-1)
                v = live_dev[dev] + nbytes
                live_dev[dev] = v
                if v > peak_dev[dev]:
                    peak_dev[dev] = v

        self._on_free_cb = on_free
        self._on_outputs = on_outputs
        self._drain = drain

    def _op_info(self, func: Any) -> int:
        """String index of an operator whose outputs are new storages, 0 if they alias."""
        schema = func._schema
        # lift_fresh returns (an alias of) a tensor built from Python data outside the
        # dispatcher (torch.tensor(...)): its storage is new to us
        fresh = schema.name.startswith("aten::lift_fresh") or (
            not func.is_view and all(r.alias_info is None for r in schema.returns)
        )
        if fresh:
            info = self.trace.intern(schema.name)
        elif not func.is_view and any(
            r.alias_info is not None and r.alias_info.is_write for r in schema.returns
        ):
            # in-place / out= operators allocate nothing, unless they resize their output's
            # storage (resize_, out= into a too-small tensor): negative = "check the size"
            info = -self.trace.intern(schema.name)
        else:
            info = 0
        self._ops[func] = info
        return info

    def _resized(self, ref: _SRef, s: torch.UntypedStorage, device: torch.device, op: int) -> None:
        """A live storage changed size in place: record a free of the old size and an
        allocation of the new one (a new storage id for the same storage)."""
        self._on_free_cb(ref)
        phase, module = self._phase_now(), self._cur_module()
        self._add_storage(s, device, op, module, phase, self.trace.category[ref.seq])

    # ------------------------------------------------------------------ phases / categories
    def _end_region(self, new_phase: int) -> None:
        """Close the current phase region: resolve categories of its surviving allocations."""
        old = self._cur
        region = self._region_id
        if old == _P_BWD or old == _P_OPT:
            survivors = [ref for ref in self._live.values() if ref.region == region]
            if survivors:
                if old == _P_BWD:
                    keys, hit = self._grad_keys(), int(_C.GRADIENT)
                else:
                    keys, hit = self._opt_state_keys(), int(_C.OPTIMIZER_STATE)
                cat = self.trace.category
                other = int(_C.OTHER)
                for ref in survivors:
                    cat[ref.seq] = hit if ref.key in keys else other
        self._region_id = region + 1
        self._cur = new_phase

    def _note_params(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            r = self._params.get(id(p))
            if r is None or r() is not p:
                self._params[id(p)] = weakref.ref(p)

    def _grad_keys(self) -> set[int]:
        keys = set()
        dead = []
        for k, r in self._params.items():
            p = r()
            if p is None:
                dead.append(k)
                continue
            g = p.grad
            if g is not None and g.layout is torch.strided:
                keys.add(g.untyped_storage()._cdata)
        for k in dead:
            del self._params[k]
        return keys

    def _opt_state_keys(self) -> set[int]:
        keys = set()
        for o in list(self._optims):
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.layout is torch.strided:
                        keys.add(v.untyped_storage()._cdata)
        return keys

    def _reclassify(
        self, tensors: Iterable[torch.Tensor], cat: Category, only_from: int, module: int = 0
    ) -> None:
        for t in tensors:
            if t is None or t.layout is not torch.strided:
                continue
            ref = self._live.get(t.untyped_storage()._cdata)
            if ref is not None and self.trace.category[ref.seq] == only_from:
                self.trace.category[ref.seq] = int(cat)
                if module:  # a parameter made in __init__ belongs to its module
                    self.trace.module[ref.seq] = module
                ref.region = -1  # reclassified: not a temporary even if freed soon

    def _begin_backward(self, tid: int) -> None:
        self._bw_task = tid
        if self._cur != _P_BWD:
            self._bw_tasks.clear()  # not inside a backward: tasks left here ended by raising
            self._end_region(_P_BWD)
        self._phase = _P_OTHER  # forward is over
        if tid in self._bw_tasks:  # back in an outer task after a reentrant one ended
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._end_backward, tid)
            )
        except RuntimeError:  # not inside the engine (should not happen); phase ends later
            return
        self._bw_tasks.add(tid)

    def _end_backward(self, tid: int) -> None:
        self._bw_tasks.discard(tid)
        if not self._active:
            return
        self._bw_task = -1
        if not self._bw_tasks and self._cur == _P_BWD:
            self._end_region(_P_OTHER)

    def _capture_initial(self) -> None:
        """ALLOC events at time 0 for the state of the modules and optimizers passed in."""
        items: list[tuple[torch.Tensor, Category, int]] = []
        for root in self._modules_in:
            for m in root.modules():
                mname = self._names[m]  # interned by _install
                for p in m.parameters(recurse=False):
                    items.append((p, _C.PARAMETER, mname))
                for b in m.buffers(recurse=False):
                    items.append((b, _C.BUFFER, mname))
            for p in root.parameters():
                if p.grad is not None:
                    items.append((p.grad, _C.GRADIENT, 0))
        for o in self._optims_in:
            for group in o.param_groups:
                for p in group["params"]:
                    items.append((p, _C.PARAMETER, 0))
                    if p.grad is not None:
                        items.append((p.grad, _C.GRADIENT, 0))
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        items.append((v, _C.OPTIMIZER_STATE, 0))
        self._active = False
        for t, cat, mod in items:
            if t.layout is not torch.strided or getattr(t, "is_nested", False):
                continue
            self._add_storage(t.untyped_storage(), t.device, 0, mod, _P_OTHER, int(cat))
        self._active = True  # frees of initial storages are recorded from now on

    # ------------------------------------------------------------------ hooks
    def _name_of(self, m: torch.nn.Module) -> int:
        idx = self._names.get(m)
        if idx is not None:
            return idx
        strings = self.trace.strings
        parent = self._fw_mods[-1] if self._fw_mods else None
        if parent is not None:
            pidx = self._names.get(parent)
            pname = strings[pidx] if pidx is not None else type(parent).__name__
            for attr, child in parent._modules.items():
                if child is m:
                    name = f"{pname}.{attr}"
                    break
            else:
                name = f"{pname}.{type(m).__name__}"
        else:
            name = type(m).__name__
        idx = self._names[m] = self.trace.intern(name)
        self._note_params(m.parameters(recurse=False))
        # a module seen for the first time: its parameters/buffers made while tracking get
        # their categories now
        self._reclassify(m.parameters(recurse=False), _C.PARAMETER, int(_C.OTHER), idx)
        self._reclassify(m.buffers(recurse=False), _C.BUFFER, int(_C.OTHER), idx)
        return idx

    def _fw_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self._active or threading.get_ident() != self._thread:
            return
        idx = self._names.get(module)
        if idx is None:
            idx = self._name_of(module)
        if _graph_task_id() == -1:
            if not self._fw_mods:
                if self._phase == _P_OTHER:
                    # tensors made outside any phase and fed to the outermost module: inputs
                    self._reclassify(_tensors_in(args), _C.INPUT, int(_C.OTHER))
                if self._phase != _P_OPT:
                    self._phase = _P_FWD
        self._fw_names.append(idx)
        self._fw_mods.append(module)
        self._seq_mark(idx)

    def _fw_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        mods = self._fw_mods
        # the same module object may also run on another thread: only this thread's calls
        # were pushed by _fw_pre
        if not mods or mods[-1] is not module or threading.get_ident() != self._thread:
            return
        mods.pop()
        self._fw_names.pop()
        self._seq_mark(self._fw_names[-1] if self._fw_names else 0)

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active or threading.get_ident() != self._thread:
            return
        if opt not in self._optims:
            self._optims.add(opt)
            for group in opt.param_groups:
                self._note_params(group["params"])
        if self._clock_opt is None:
            self._clock_opt = weakref.ref(opt)
        self._end_region(_P_OPT)
        self._phase = _P_OPT
        # optimizer-phase events are attributed to the optimizer, e.g. "optimizer:Adam"
        self._fw_names.append(self.trace.intern(f"optimizer:{type(opt).__name__}"))
        self._fw_mods.append(_OPT_SENTINEL)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active or threading.get_ident() != self._thread:
            return
        if self._fw_mods and self._fw_mods[-1] is _OPT_SENTINEL:
            self._fw_mods.pop()
            self._fw_names.pop()
        self._end_region(_P_OTHER)
        self._phase = _P_OTHER
        clock = self._clock_opt() if self._clock_opt is not None else None
        if self.step_marker == "optimizer" and clock is opt:
            self.step()


def _ignore(*_: Any) -> None:
    return None


def _flatten(out: Any) -> Iterator[Any]:
    for x in out:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (tuple, list)):
            yield from _flatten(x)


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


def track(
    *modules_and_optimizers: Any,
    stacks: bool = False,
    stack_depth: int = 8,
    listeners: Iterable[Listener] = (),
    modules: bool = True,
    step_marker: str = "optimizer",
    metadata: dict[str, Any] | None = None,
) -> Tracker:
    """Track every storage created while the block runs; yields a :class:`Tracker`.

    Args:
        modules_and_optimizers: modules and optimizers whose parameters, buffers, gradients and
            optimizer state are counted from the start (ALLOC events at time 0) and whose
            submodules get path names (``"Net.encoder.0"``). Everything else that runs is
            tracked too.
        stacks: record a short Python stack (innermost last, torch/torchmem frames skipped)
            with every event; ``stack_depth`` frames at most.
        listeners: callables ``fn(event, storage_or_None)`` called for every event.
        modules: attribute events to modules (global module hooks); ``False`` skips the hooks.
        step_marker: ``"optimizer"`` (a step marker after each step of the first optimizer seen)
            or ``"manual"`` (call ``tracker.step()``).
        metadata: extra JSON-able metadata stored in the trace file.

    Example:
        >>> import torch, torchmem
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> with torchmem.track(net) as tr:
        ...     net(torch.randn(3, 4)).sum().backward()
        >>> sorted({e.module for e in tr.events() if e.phase.label == "backward" and e.module})
        ['Sequential.0', 'Sequential.1', 'Sequential.2']
    """
    return Tracker(
        *modules_and_optimizers,
        stacks=stacks,
        stack_depth=stack_depth,
        listeners=listeners,
        modules=modules,
        step_marker=step_marker,
        metadata=metadata,
    )
