"""The tracker's hot path: the dispatch mode and the per-operator and per-free callbacks.

These run for every operator and every free while a tracker is active, so they are built once
per run by :meth:`_HotPath._make_hot_paths` as closures over local bindings (the trace's column
``append`` methods, the live-storage map, the per-device counters) instead of methods that look
attributes up on every call; the closures share those bindings, so they stay together in one
function. Events that need more (stacks, listeners, marks) go through the general path,
``_Recorder._record``.

Example:
    >>> import torch, torchmem
    >>> with torchmem.track() as tr:
    ...     a = torch.ones(4); a = a.add_(1); b = a.view(2, 2); del a, b
    >>> [(e.kind.label, e.op) for e in tr.events()]   # in-place ops and views allocate nothing
    [('alloc', 'aten::ones'), ('free', None)]
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchmem._containers import iter_items
from torchmem.capture._fast_mode import FastDispatchMode, frame_callback
from torchmem.capture.tracker._comm import _classify, special_kind
from torchmem.capture.tracker._hooks import _Hooks
from torchmem.capture.tracker._phases import _graph_task_id
from torchmem.capture.tracker._recorder import (
    _ALLOC,
    _C,
    _FREE,
    _P_BWD,
    _P_OTHER,
    _PROVISIONAL,
    _TEMP,
    _perf_ns,
    _SRef,
    plain_tensors,
)
from torchmem.capture.tracker._sites import call_site

__all__: list[str] = []

_strided = torch.strided
_OpOverload = torch._ops.OpOverload
_OTHER = int(_C.OTHER)


class _Mode(FastDispatchMode):
    """Sees every operator; reports non-aliasing outputs to the tracker."""

    def __init__(self, tracker: _HotPath) -> None:
        super().__init__()
        self._on_outputs = tracker._on_outputs
        self._unseen = tracker._unseen_op
        # keyed by id(operator): OpOverload's __hash__ is a Python method, a call per operator
        self._ops_get: Callable[[int], int | None] = tracker._ops.get

    inline_check = True  # the check below: no wrapper frame per operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if frame_callback() is not None:  # compiled code runs: under torch._dynamo.disable
            return self._under_disable(func, types, args, kwargs)
        # an OpOverload's __call__ is a Python frame that only calls its _op: call that
        out = (func._op if func.__class__ is _OpOverload else func)(*args, **(kwargs or {}))
        info = self._ops_get(id(func))
        if info is None:  # first call, or an operator handled by name (collectives)
            self._unseen(func, out, args, kwargs)
        elif info:
            self._on_outputs(func, out, info)
        return out

    def stop(self) -> None:
        """Report nothing from now on (in a forked child): every operator looks like a view.

        Example:
            >>> import torch, torchmem
            >>> with torchmem.track() as tr:
            ...     tr._mode.stop(); x = torch.ones(4)
            >>> len(tr)
            0
        """
        self._ops_get = _nothing_new


def _nothing_new(op_id: int) -> int:
    """The operator table's lookup once the mode is stopped: every operator's outputs alias
    its inputs (0), so nothing is recorded."""
    return 0


def _output_tensors(out: Any) -> Iterable[Any]:
    """The tensors of an operator's output (none for a non-tensor result)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    return iter_items(out) if isinstance(out, (tuple, list)) else ()


class _HotPath(_Hooks):
    """Builds the callbacks the dispatch mode and the storages' weak references call."""

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
        a_op, a_mod, a_phase, a_cat, a_step, a_thread, a_stack = (
            tr.op.append, tr.module.append, tr.phase.append, tr.category.append,
            tr.step.append, tr.thread.append, tr.stack.append,
        )
        me_thread = self._thread_idx
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
        plain = plain_tensors

        pending = self._pending
        orphans = self._orphans
        main_thread = self._thread
        get_ident = threading.get_ident
        current_thread = threading.current_thread
        intern, intern_thread, intern_stack = tr.intern, tr.intern_thread, tr.intern_stack

        def drain() -> None:
            while pending:
                item = pending.popleft()
                if len(item) == 4:
                    free(item[0], item[1], intern_thread(item[2]), item[3])
                else:
                    thread_alloc(*item)

        def thread_alloc(ref: _SRef, when: int, tname: str, op: str, stack: Any, device: Any) -> None:
            """An allocation another thread made (queued by ``on_thread_outputs``)."""
            if not me._active:
                return
            dev = dev_cache.get(device)
            if dev is None:
                dev = me._dev_index(device)
            ref.dev = dev
            ref.seq = me._record(
                _ALLOC, dev, ref.nbytes, -1, intern(op), 0, _P_OTHER, _OTHER, ref(),
                thread=intern_thread(tname), when=when,
                stack=-1 if stack is None else intern_stack(stack),
            )

        def free(ref: _SRef, when: int = -1, thread: int = me_thread, bw: bool = False) -> None:
            """A storage's free: called by its weak reference (``when`` -1: now), or for a
            queued free of another thread's, by ``drain`` on the tracking thread."""
            if when < 0:
                if get_ident() != main_thread:
                    # freed on another thread (a data-loader or autograd worker): record it on
                    # the tracking thread at its next event, so two threads never interleave
                    # appends
                    pending.append((ref, perf() - t0, current_thread().name, task() != -1))
                    return
                if pending:
                    drain()
                when = perf() - t0
            key = ref.key
            if live_get(key) is ref:
                del live[key]
            elif orphans.pop(id(ref), None) is None:
                return
            if not me._active:
                return
            seq = ref.seq
            if ref.region == me._region_id:
                cat = _TEMP
                cat_col[seq] = cat
            else:
                cat = cat_col[seq]
            if thread != me_thread:
                # freed on another thread: an autograd worker's backward (the last module seen
                # in backward), or a thread of the user's, outside the tracking thread's modules
                phase = _P_BWD if bw else _P_OTHER
                mod = me._bw_last if bw else 0
            elif task() != -1:
                phase = _P_BWD
                mod = me._bw_module()
            else:
                phase = me._phase
                mod = fw_names[-1] if fw_names else 0
            dev = ref.dev
            nbytes = ref.nbytes
            if me._slow or thread != me_thread:
                me._record(_FREE, dev, nbytes, seq + 1, 0, mod, phase, cat, None, thread=thread,
                           when=when, stack=-2 if thread == me_thread else -1)
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
            a_thread(me_thread)
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
                # a wrapper subclass (DTensor): its local tensors' storages are the memory
                tensors: Iterable[Any] = (out,) if out.__class__ is Tensor else plain(out)
            elif isinstance(out, (tuple, list)):
                tensors = [p for t in iter_items(out)
                           for p in ((t,) if t.__class__ is Tensor else plain(t))]
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
            step = me._step
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
                ref = SRef(s, free)
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
                a_step(step)
                a_thread(me_thread)
                a_stack(-1)
                v = live_dev[dev] + nbytes
                live_dev[dev] = v
                if v > peak_dev[dev]:
                    peak_dev[dev] = v
            if len(kind_col) >= me._midway_at:  # aggregated: the iteration in progress is long
                me._compact_midway()

        wops: dict[Any, str] = {}  # operator -> its name if its outputs are new storages, else ""
        skip_code = self._skip_code
        getframe = sys._getframe

        def on_thread_outputs(func: Any, out: Any, tname: str) -> None:
            """Outputs of an operator run on another thread: queue their allocations."""
            op = wops.get(func)
            if op is None:
                name, sign = _classify(func)
                op = wops[func] = name if sign > 0 else ""
            if not op:
                return
            tensors = _output_tensors(out)
            when = perf() - t0
            stack = call_site(getframe(2), skip_code, me.stack_depth) if me.stacks else None
            for t in tensors:
                if t.layout is not strided:
                    continue
                s = t.untyped_storage()
                key = s._cdata
                old = live_get(key)
                if old is not None:
                    if old() is not None:
                        continue
                    orphans[id(old)] = old  # freed, its free still queued: the address is reused
                ref = SRef(s, free)
                ref.key = key
                ref.seq = -1
                ref.dev = -1
                ref.nbytes = s.nbytes()
                ref.region = -1  # not in the tracking thread's phase regions
                live[key] = ref
                pending.append((ref, when, tname, op, stack, t.device))

        self._on_free_cb = free
        self._on_outputs = on_outputs
        self._on_thread_outputs = on_thread_outputs
        self._drain = drain

    def _unseen_op(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        """An operator not in the cache: classify it (an ordinary one is cached from now on),
        or handle a collective / FSDP2 copy-out, which are never cached."""
        kind = self._special.get(func)
        if kind is None:
            kind = self._special[func] = special_kind(func)
        if kind:
            self._special_op(func, out, args, kwargs, kind)
        else:
            self._on_outputs(func, out, None)

    def _op_info(self, func: Any) -> int:
        """String index of an operator whose outputs are new storages, 0 if they alias."""
        name, sign = _classify(func)
        info = sign * self.trace.intern(name) if sign else 0
        self._ops[id(func)] = info
        self._op_keep.append(func)  # its id stays its own while the table holds it
        return info
