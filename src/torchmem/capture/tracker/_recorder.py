"""A tracker's state and its general recording path: events, devices, listeners, call sites.

:class:`_Recorder` holds every field a :class:`~torchmem.capture.tracker.Tracker` has (its
``__init__`` is the tracker's) and appends events to the tracker's
:class:`~torchmem.model.trace.Trace` one at a time: marks, the initial state, and every event
when stacks or listeners are on. The per-operator fast path is in ``_hotpath``; phases and
categories in ``_phases``; module and optimizer hooks in ``_hooks``.

Example:
    >>> import torchmem
    >>> with torchmem.track(listeners=[lambda e, s: print(e.kind.label, e.op)]) as tr:
    ...     _ = tr.mark("here")
    mark here
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import warnings
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import CodeType
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchmem.capture._names import check_track_args
from torchmem.capture.storage import device_str
from torchmem.capture.tracker._sites import call_site
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import PathLike, TraceStreamer
from torchmem.model.aggregate import DEFAULT_KEEP_LAST, DEFAULT_PERIOD, Aggregate
from torchmem.model.events import Category, Event, EventKind, Phase
from torchmem.model.trace import Trace

__all__ = ["Listener"]

#: ``fn(event, storage_or_None)``: called for every event a tracker records.
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
_NEVER = 1 << 62  # a trace length never reached: no midway compaction
_perf_ns = time.perf_counter_ns


class _SRef(weakref.ref):  # type: ignore[type-arg]
    """Weak reference to a live storage carrying what the free event needs."""

    __slots__ = ("key", "seq", "dev", "nbytes", "region")

    key: int
    seq: int  # of the ALLOC event; the trace's storage id is seq + 1
    region: int
    dev: int
    nbytes: int


class _ModuleNames(weakref.WeakKeyDictionary):  # type: ignore[type-arg]
    """Module -> its interned name, also readable by ``id(module)`` (``by_id``) for the forward
    hooks: a ``WeakKeyDictionary``'s ``get`` is a Python method, called per module call.

    Example:
        >>> import torch
        >>> names, m = _ModuleNames(), torch.nn.ReLU()
        >>> names[m] = 7
        >>> names.by_id[id(m)], names[m]
        (7, 7)
        >>> del m; len(names.by_id)
        0
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}

    def __setitem__(self, key: Any, value: int) -> None:
        super().__setitem__(key, value)
        k = id(key)
        self.by_id[k] = value
        if k not in self._refs:
            by_id, refs = self.by_id, self._refs

            def gone(_: Any, k: int = k) -> None:  # before its id can be reused
                by_id.pop(k, None)
                refs.pop(k, None)

            refs[k] = weakref.ref(key, gone)


_Tensor = torch.Tensor


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a wrapper subclass's inner tensors
    (a ``DTensor``'s local shard), recursively.

    Example:
        >>> import torch
        >>> [x.shape for x in plain_tensors(torch.ones(2))]
        [torch.Size([2])]
    """
    if t.__class__ is _Tensor or not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    out: list[torch.Tensor] = []
    for a in attrs:
        inner = getattr(t, a)
        if isinstance(inner, torch.Tensor):  # (DTensor also names its device mesh)
            out.extend(plain_tensors(inner))
    return out


def _ignore(*_: Any) -> None:
    return None


class _Recorder:
    """A tracker's state, its listeners and the general path that records one event."""

    def __init__(
        self,
        *targets: Any,
        stacks: bool = False,
        stack_depth: int = 8,
        listeners: Iterable[Listener] = (),
        modules: bool = True,
        step_marker: str = "optimizer",
        metadata: dict[str, Any] | None = None,
        path: PathLike | None = None,
        aggregate: bool | int = False,
        keep_last: int = DEFAULT_KEEP_LAST,
    ) -> None:
        if isinstance(aggregate, bool):
            after = DEFAULT_PERIOD if aggregate else 0
        elif isinstance(aggregate, int) and aggregate >= 1:
            after = aggregate
        else:
            raise InvalidInputError(
                f"aggregate must be True, False or an event count >= 1 (aggregate above it), "
                f"got {aggregate!r}; e.g. aggregate=True, or aggregate=5_000_000"
            )
        self._modules_in, self._optims_in = check_track_args(targets, step_marker, path)
        self.path = path
        self._streamer: TraceStreamer | None = None
        if not isinstance(stack_depth, int) or stack_depth < 1:
            raise InvalidInputError(f"stack_depth must be an int >= 1, got {stack_depth!r}")
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
        # id(operator) -> its name's string index, negated for in-place/out= operators, 0 if
        # its outputs alias its inputs; the operators themselves are kept in _op_keep
        self._ops: dict[int, int] = {}
        self._op_keep: list[Any] = []
        self._special: dict[Any, int] = {}  # operator -> what _comm does with it (0: nothing)
        # storages a collective used (communication buffers), by storage key, until freed
        self._comm_refs: dict[int, _SRef] = {}
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
        self._seq_cap = _NEVER  # entries the map may hold (aggregated: Aggregate.within)
        self._bw_last = 0
        self._names = _ModuleNames()
        #: ids of modules whose forward has returned once (their uncalled children named)
        self._settled: set[int] = set()
        self._optims: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._clock_opt: weakref.ref[torch.optim.Optimizer] | None = None
        self._skip_code: dict[CodeType, bool] = {}
        self._t0 = 0
        self._active = False
        self._used = False
        self._thread = threading.get_ident()
        self._pid = os.getpid()  # the process tracking (a forked child records nothing)
        self._mode: Any = None  # the dispatch mode while installed
        self._thread_idx = 0  # the tracking thread's name in the trace's thread table
        self._exit: list[Callable[[], None]] = []
        self._on_free_cb: Callable[[Any], None] = _ignore
        self._drain: Callable[[], None] = _ignore
        # events of other threads, recorded on the tracking thread at its next event (in order):
        # frees (ref, when, thread name, in backward) and allocations (ref, when, thread name, op, stack,
        # device); ``_orphans`` holds refs of storages freed there whose address was reused
        # before their free was recorded
        self._pending: deque[tuple[Any, ...]] = deque()
        self._orphans: dict[int, _SRef] = {}
        self._on_thread_outputs: Callable[[Any, Any, str], None] = _ignore
        self._on_outputs: Callable[[Any, Any, Any], None] = _ignore
        self.listener_errors: list[BaseException] = []
        self._slow = self.stacks or bool(self._listeners)
        self._params: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> parameter, for .grad
        # aggregated mode: folds finished iterations and compacts the trace at step markers
        self._agg = Aggregate(keep_last, after) if after else None
        self.trace.aggregate = self._agg
        # the trace length at which the hot path compacts the iteration in progress
        self._midway_at = _NEVER

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

    def _dev_index(self, device: torch.device) -> int:
        i = self._dev_cache.get(device)
        if i is None:
            i = self.trace.intern_device(device_str(device))
            while len(self._live_dev) <= i:
                self._live_dev.append(0)
                self._peak_dev.append(0)
            self._dev_cache[device] = i
        return i

    def _stack(self) -> int:
        """Intern the call site of the event being recorded (the caller of ``_record``)."""
        return self.trace.intern_stack(
            call_site(sys._getframe(2), self._skip_code, self.stack_depth)
        )

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
        thread: int = -1,
        when: int = -1,
        stack: int = -2,
    ) -> int:
        """Append one event (general path: marks, initial state, stacks, listeners).

        ``sid=-1`` means "this event's own sequence number + 1" (a new storage). ``thread``,
        ``when`` and ``stack`` (an interned stack) are given for an event that happened on
        another thread (-1, -1, -2: the tracking thread, now, this call's stack). Everything
        that can allocate Python objects (and so run the garbage collector, whose frees call
        back into the tracker) happens before the appends, so the columns stay aligned.
        """
        tr = self.trace
        if stack == -2:
            stack = self._stack() if self.stacks else -1
        if when >= 0:
            now = when
        else:
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
        tr.thread.append(self._thread_idx if thread < 0 else thread)
        tr.stack.append(stack)  # last: a streamer reading len(stack) sees complete rows
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
            agg = self._agg
            if agg is not None and agg.compactions:  # ids in the whole run: stable
                ev = replace(ev, seq=agg.original_row(seq), storage=agg.stable_id(ev.storage))
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
        if kind == _MARK and self._agg is not None and tr.strings[op] == "step":
            seq = self._aggregate_step(seq)
        return seq

    def _aggregate_step(self, seq: int) -> int:
        """After a step marker (row ``seq``): fold the finished iteration and, when enough rows
        are held, compact the trace and renumber the live storages' rows; returns the marker's
        row after that."""
        agg = self._agg
        assert agg is not None
        agg.fold(self.trace)
        if agg.due(self.trace):
            seq = int(self._compact_now(agg, midway=False)[seq])
        self._midway_at = agg.midway_at()
        return seq

    def _compact_midway(self) -> None:
        """The iteration in progress holds ``Aggregate.within`` new rows (a run without step
        markers, or a long iteration): compact it now (the hot path calls this between
        operators, so no row number is held anywhere but in the live storages' refs)."""
        agg = self._agg
        if agg is None or not self._active:
            self._midway_at = _NEVER
            return
        self._compact_now(agg, midway=True)
        self._midway_at = agg.midway_at()

    def _compact_now(self, agg: Aggregate, midway: bool) -> Any:
        enabled = gc.isenabled()
        gc.disable()  # a collection now would free storages, appending rows mid-compaction
        try:
            if self._streamer is not None:
                return self._streamer.restart(lambda: self._compact(agg, midway), agg.to_json)
            return self._compact(agg, midway)
        finally:
            if enabled:
                gc.enable()

    def _compact(self, agg: Aggregate, midway: bool = False) -> Any:
        pos = agg.compact(self.trace, midway)
        for ref in [*self._live.values(), *self._orphans.values()]:
            if ref.seq >= 0:
                ref.seq = int(pos[ref.seq])
        return pos

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
