"""Repeated calls replayed: a script's later micro-steps and evaluation forwards fed to the
simulator without running the model again.

A training script calls its model many times with the same shapes: nanoGPT's defaults run 400
evaluation forwards under ``torch.no_grad()`` and 40 micro-steps (a forward and its backward)
per optimizer step. Each such call asks the caching allocator for the same sizes in the same
order, frees the same blocks and returns tensors of the same shapes. :class:`RepeatedCalls`
records what a call of the outermost module does to the simulator (its forward; and, when its
outputs require grad, its backward, from the first backward node of the module to the end of
that backward pass), and once two calls with the same signature did exactly the same, replays
each later one: the simulator gets the same requests in the same order (so every address, every
peak and the out-of-memory point are those of running the model), the call returns tensors of
the recorded shapes made at the recorded points (through the fake mode: real storages, freed
when the program drops them), and their backward replays the recorded backward.

The signature of a call: the module, its ``training`` flag, grad mode, autocast, the shapes,
strides, dtypes and devices of its tensor arguments and the values of the others, and each
parameter's dtype and whether it has a gradient (the first micro-step after ``zero_grad``
makes the gradients; later ones add into them). A call is replayed only when its record is
self-contained: every block it frees it allocated (or, in backward, is the gradient arriving
for its output or an argument its graph saved; after a forward under autocast, a cast copy
autocast's cache frees at its exit), every block it allocated is freed by the end of its
backward except the storages of its outputs, each output a whole storage of its own on the GPU
(a call that returns a KV cache object, as transformers' models do unless ``use_cache=False``,
is run); neither the module nor a submodule or parameter carries a hook (those would not run
again, or run beside their record), except FSDP2's in a call without grad under the fake
ranks; a call with grad under the fake ranks is run (its backward reduces); no snapshot
frames are being recorded. The replay goes through the global module hooks (the tracker's
scope), not the rest of ``__call__`` (the levers' wrapper is in the record). A forward whose
allocations change with Python state of its own (a counter, a schedule) while its signature
stays the same would be replayed as its recorded calls: ``replay_repeats=False`` runs every
call. The per-category split stays exact: each replayed block carries the category and
module of the block it repeats (the live bytes at a peak are the trace's plus the replay's),
and each output's trace entry names the module that made it.

What is found only after a call was replayed (its backward asked with gradients for other
outputs than recorded, or its graph dropped without a backward) makes :attr:`valid` false: the
estimate then runs again without replaying (:func:`torchmem.fit.run._engine.run_once`).

Example:
    >>> import torch
    >>> from torchmem.fit.run._engine import run_once
    >>> def build(batch):
    ...     model = torch.nn.Linear(256, 256, device="cuda")
    ...     x = torch.randn(batch, 256, device="cuda")
    ...     def step():
    ...         for _ in range(8):                     # 8 micro-steps
    ...             model(x).sum().backward()
    ...     return step
    >>> e = run_once(build, 64, "T4", steps=1)
    >>> e.calls_replayed, e.peak_requested_bytes == run_once(build, 64, "T4", steps=1,
    ...     replay_repeats=False).peak_requested_bytes
    (5, True)
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchmem.fit.fakegpu._dispatch import _Abort
from torchmem.fit.fakegpu._memory import _KEYS, _State
from torchmem.fit.run._repeat_window import (
    _ALLOC_KIND,
    _KEPT,
    _OP,
    _SIMPLE,
    _Call,
    _hooked,
    _Out,
    _Replayed,
    _signature,
    _strided_bytes,
    _Window,
    _with_global_hooks,
)
from torchmem.model.events import Category
from torchmem.sim.allocator import PRIVATE_POOL

__all__ = ["RepeatedCalls"]


class RepeatedCalls:
    """Records the outermost module calls of a fake run and replays those that repeat.

    :meth:`install` wraps ``torch.nn.Module.__call__`` (:meth:`remove` restores it);
    :attr:`replayed` counts the calls replayed, :attr:`valid` is false when something found
    after a replay could not be reproduced (the caller then runs the estimate again without).

    Example:
        >>> import torch
        >>> from torchmem.fit.run._engine import run_once
        >>> def build(batch):
        ...     model = torch.nn.Linear(64, 64, device="cuda")
        ...     x = torch.randn(batch, 64, device="cuda")
        ...     def step():
        ...         with torch.no_grad():
        ...             for _ in range(10):        # ten evaluation forwards
        ...                 model(x)
        ...     return step
        >>> run_once(build, 8, "T4", steps=1).calls_replayed   # the first three run
        7
    """

    def __init__(self, st: _State, tracker: Any, values: Any) -> None:
        self.st, self.tracker, self.values = st, tracker, values
        self.trace = tracker.trace
        self.replayed = 0
        self.valid = True
        self.why_invalid = ""
        self.rec: _Window | None = None  # the window being recorded
        self.last: dict[Any, _Window] = {}  # key -> its last finished window
        self.verified: dict[Any, _Window] = {}  # key -> the window replayed for it
        #: windows whose forward was recorded and whose backward (or the autocast cache's
        #: clear) has not run yet; replayed calls waiting for that clear
        self.open: list[_Window] = []
        self.pending: list[_Call] = []
        self.clearing = False
        self.orig_clear: Any = None
        self.depth = 0
        self.thread = threading.get_ident()
        self.orig_call: Any = None
        #: live bytes of the replay's own blocks, by category and by module (see held)
        self.cat: dict[str, int] = {}
        self.mod: dict[str, int] = {}
        self.live = 0
        sim = st.sim
        malloc, free, empty = sim.malloc, sim.free, sim.empty_cache

        def rec_malloc(size: int, *a: Any, **kw: Any) -> int:
            addr = malloc(size, *a, **kw)
            w = self.rec
            if w is not None:
                w.handle[addr] = w.n
                stream = kw.get("stream", 0)  # another stream's pool: replayed on that stream
                if stream >= PRIVATE_POOL and w.bad is None:
                    w.bad = "it runs inside a CUDA graph capture"
                w.cur.append(("m", size, w.n, stream) if stream else ("m", size, w.n))
                w.n += 1
            return addr

        def rec_free(addr: int, *a: Any, **kw: Any) -> Any:
            w = self.rec
            for ow in self.open:  # a block freed outside a window: its address is new later
                if ow is not w:
                    h = ow.handle.pop(addr, None)
                    if h is not None and self.clearing:
                        ow.cleared.append(h)
            if w is not None:
                h = w.handle.pop(addr, None)
                if h is not None:
                    w.cur.append(("f", h))
                else:
                    self._outside_free(w)
            return free(addr, *a, **kw)

        def rec_empty(*a: Any, **kw: Any) -> Any:
            if self.rec is not None:
                self.rec.cur.append(("e",))
            return empty(*a, **kw)

        sim.malloc, sim.free, sim.empty_cache = rec_malloc, rec_free, rec_empty  # type: ignore[method-assign,assignment]
        if st.streams is not None:
            def on_stream_event(kind: str) -> None:
                if self.rec is not None:  # the replay would free at once what waits here
                    self.rec.bad = self.rec.bad or f"other streams' frees ({kind}) inside it"
            st.streams.on_event = on_stream_event
        requested, host = st._requested, st._host

        def rec_requested(delta: int, sid: int = -1) -> None:
            if self.rec is not None:
                self.rec.cur.append(("r", delta, sid))
            requested(delta, sid)

        def rec_host(n: int) -> None:
            if self.rec is not None:
                self.rec.cur.append(("h", n))
            host(n)

        st._requested = rec_requested  # type: ignore[method-assign]
        st._host = rec_host  # type: ignore[method-assign]
        st.on_peak_req = self._at_peak

    # -- recording ------------------------------------------------------------------------------

    def _outside_free(self, w: _Window) -> None:
        """A free of a block the window did not allocate: the gradient arriving for an output
        (named by the ``"r"`` just before it) in backward, or the window cannot be replayed."""
        prev = w.cur[-1] if w.cur else None
        sid = prev[2] if prev is not None and prev[0] == "r" else None
        if w.cur is w.bwd and sid in w.grads_in:
            w.cur[-1] = ("r", prev[1], -1)  # type: ignore[index]
            w.cur.append(("g", w.grads_in[sid]))  # type: ignore[index]
        elif sid in w.inputs:  # an argument the graph saved, freed as its node releases it
            w.cur[-1] = ("r", prev[1], -2)  # type: ignore[index]
            w.cur.append(("i", w.inputs[sid]))  # type: ignore[index]
        elif w.bad is None:
            w.bad = "it frees a block allocated before it"

    def _flops(self) -> int:
        lev = self.st.levers
        return int(lev.flops) if lev is not None and getattr(lev, "count_flops", False) else 0

    def _calls(self) -> dict[Any, int]:
        """The counts a call adds to: the CUDA emulation's attention calls, and under the
        fake ranks each collective's calls (its largest buffer: the ``"max"`` entries)."""
        emu, dist = self.st.emu, self.st.dist
        out: dict[Any, int] = dict(emu.sdpa_calls) if emu is not None else {}
        if dist is not None:
            for name, (calls, size) in dist.collectives.items():
                out[("calls", name)] = calls
                out[("max", name)] = size
        return out

    @staticmethod
    def _delta(before: dict[Any, int], after: dict[Any, int]) -> dict[Any, int]:
        """What a call added (a largest buffer: its value after the call, see _add_calls)."""
        return {k: n if k[0] == "max" else n - before.get(k, 0) for k, n in after.items()
                if n != before.get(k, 0) or k[0] == "max" and ("calls", k[1]) in after
                and after[("calls", k[1])] != before.get(("calls", k[1]), 0)}

    def _add_calls(self, calls: dict[Any, int]) -> None:
        emu, dist = self.st.emu, self.st.dist
        for k, n in calls.items():
            if k[0] == "calls":
                dist.collectives.setdefault(k[1], [0, 0])[0] += n
            elif k[0] == "max":
                stat = dist.collectives.setdefault(k[1], [0, 0])
                stat[1] = max(stat[1], n)
            else:
                emu.sdpa_calls[k] = emu.sdpa_calls.get(k, 0) + n

    def _add_flops(self, n: int) -> None:
        lev = self.st.levers
        if n and lev is not None:
            lev.flops += n

    def _finish_forward(self, w: _Window, out: Any) -> None:
        """After a recorded forward: the outputs, and the backward's start when they need one."""
        st = self.st
        w.flops = self._flops() - w.flops
        w.calls_f = self._delta(w.calls_f, self._calls())
        leaves, w.spec = tree_flatten(out)
        grad_fns: list[tuple[Any, int]] = []
        seen: set[int] = set()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = x.untyped_storage()._cdata
                sid = st.sid_of.get(key)
                addr = st.addr.get(sid) if sid is not None else None
                h = w.handle.get(addr) if addr is not None else None
                whole = x.untyped_storage().nbytes()
                if (h is None or sid is None or key in seen or x._base is not None or x.storage_offset()
                        or x.layout is not torch.strided or sid in st.pl.host
                        or whole != _strided_bytes(x)):
                    w.bad = w.bad or "an output is not a whole GPU storage made by the call"
                    return
                seen.add(key)
                made = self.values._lookup(x) if x.numel() == 1 else None
                w.outs.append(_Out(tuple(x.shape), x.stride(), x.dtype, x.requires_grad, h,
                                   made))
                w.out_handles.add(h)
                w.out_rows[h] = self._row_of(sid)
                if x.requires_grad and x.grad_fn is not None:
                    grad_fns.append((x.grad_fn, len(w.outs) - 1))
            elif isinstance(x, _SIMPLE):
                w.outs.append(("c", x))
            else:
                w.bad = w.bad or f"an output is a {type(x).__name__}"
                return
        if not grad_fns:
            if not set(w.handle.values()) - w.out_handles:
                w.done = True
                w.handle = {}
            elif torch.is_autocast_enabled("cuda"):  # autocast's cast copies, freed at its exit
                w.wait_clear = True
                self.open.append(w)
            else:
                w.bad = w.bad or "it keeps tensors that are not its outputs"
            return
        w.bwd_flops = 0
        started = [False]

        def pre(k: int) -> Any:
            def hook(grad_outputs: Any) -> None:
                if threading.get_ident() != self.thread:
                    return
                if not started[0]:
                    started[0] = True
                    self._begin_backward(w, grad_outputs, k)
                elif self.rec is w:
                    for g in grad_outputs:
                        if isinstance(g, torch.Tensor):
                            sid = st.sid_of.get(g.untyped_storage()._cdata)
                            addr = st.addr.get(sid) if sid is not None else None
                            if addr is not None and addr not in w.handle:
                                w.bad = w.bad or "gradients arrive for two of its outputs"
            return hook

        for fn, k in grad_fns:
            fn.register_prehook(pre(k))
        self.open.append(w)
        while len(self.open) > 4:  # forwards whose backward never came
            self.open.pop(0).bad = "its backward did not come"

    def _begin_backward(self, w: _Window, grad_outputs: Any, k: int) -> None:
        if self.rec is not None or w.done:  # another window is being recorded: not this one
            w.bad = w.bad or "its backward ran inside another call"
            return
        for g in grad_outputs:
            if isinstance(g, torch.Tensor):
                sid = self.st.sid_of.get(g.untyped_storage()._cdata)
                if sid is not None:
                    w.grads_in[sid] = k
        w.cur = w.bwd
        w.bwd_flops = self._flops()
        w.calls_b = self._calls()
        self.rec = w
        try:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(w))
        except RuntimeError:
            self.rec = None
            w.bad = w.bad or "its backward could not be followed"

    def _end_backward(self, w: _Window) -> None:
        if self.rec is w:
            self.rec = None
        if w in self.open:
            self.open.remove(w)
        w.bwd_flops = self._flops() - w.bwd_flops
        w.calls_b = self._delta(w.calls_b, self._calls())
        if set(w.handle.values()) - w.out_handles:
            w.bad = w.bad or "it keeps tensors that are not its outputs after its backward"
        w.done = True
        w.handle = {}

    def _row_of(self, sid: int) -> int:
        """The trace row where storage ``sid`` was allocated (the last one)."""
        tr = self.trace
        for seq in range(len(tr) - 1, -1, -1):
            if tr.storage[seq] == sid and tr.kind[seq] == _ALLOC_KIND:
                return seq
        return -1

    def _label(self, w: _Window) -> None:
        """Replace each request's storage tag with the index of its (category, module) label,
        read from the trace now that every storage of the window is settled."""
        tr = self.trace
        over: dict[int, str] = self.st.dist.cat if self.st.dist is not None else {}
        want = {ev[2] for ev in (*w.fwd, *w.bwd) if ev[0] == "r" and ev[2] >= 0}
        found: dict[int, tuple[str, str]] = {}
        rows: dict[int, int] = {}
        for seq in range(w.start, len(tr)):
            sid = tr.storage[seq]
            if sid in want and tr.kind[seq] == _ALLOC_KIND:
                cat = over.get(sid) or _KEYS.get(Category(tr.category[seq]), "other")
                found[sid] = (cat, tr.strings[tr.module[seq]] or "")
                rows[sid] = seq
        index: dict[tuple[str, str], int] = {}
        for evs in (w.fwd, w.bwd):
            for ev, nxt in zip(evs, evs[1:]):
                if ev[0] == "m" and nxt[0] == "r" and nxt[2] >= 0:
                    w.size_of[ev[2]] = (nxt[1], nxt[2])

        def tag(sid: int) -> int:
            label = found.get(sid, ("other", ""))
            if label not in index:
                index[label] = len(w.labels)
                w.labels.append(label)
            return index[label]

        w.site_of = {h: rows.get(sid, -1) for h, (n, sid) in w.size_of.items()}
        w.size_of = {h: (n, tag(sid)) for h, (n, sid) in w.size_of.items()}
        w.fwd = [("r", ev[1], tag(ev[2])) if ev[0] == "r" and ev[2] >= 0 else ev for ev in w.fwd]
        w.bwd = [("r", ev[1], tag(ev[2])) if ev[0] == "r" and ev[2] >= 0 else ev for ev in w.bwd]

    @staticmethod
    def _same(a: _Window, b: _Window) -> bool:
        """Whether two finished windows repeat each other (storage tags compared by their
        order of first appearance, as the storages differ)."""
        if a.bad or b.bad or not (a.done and b.done):
            return False

        def norm(w: _Window) -> tuple[Any, ...]:
            order: dict[int, int] = {}
            out = []
            for ev in (*w.fwd, ("|",), *w.bwd):
                if ev[0] == "r":
                    out.append(("r", ev[1], order.setdefault(ev[2], len(order)) if ev[2] >= 0
                                else -1))
                else:
                    out.append(ev)
            return (tuple(out), tuple(w.outs), repr(w.spec), w.flops, w.bwd_flops,
                    tuple(sorted(w.grads_in.values())), tuple(w.cleared),
                    sorted(w.calls_f.items()), sorted(w.calls_b.items()))

        return norm(a) == norm(b)

    # -- replaying ------------------------------------------------------------------------------

    def apply(self, ev: tuple[Any, ...], addr: dict[int, int], w: _Window) -> None:
        """Feed one recorded request of ``w`` to the simulator (``addr``: handle ->
        address)."""
        st = self.st
        kind = ev[0]
        if kind == "m":
            streams, before = st.streams, 0
            if len(ev) > 3 and streams is not None:
                before, streams.current = streams.current, ev[3]
            try:
                a = st._malloc(ev[1], None, _OP, "tensor storage")
            finally:
                if len(ev) > 3 and streams is not None:
                    streams.current = before
            if a is None or st.oom is not None:
                self._site(w, ev[2])
                raise _Abort()
            addr[ev[2]] = a
        elif kind == "f":
            a = addr.pop(ev[1], None)
            if a is None:
                self.invalid("a replayed call freed a block it does not hold")
                return
            st.sim.free(a)
        elif kind == "r":
            st._requested(ev[1])
            key, mod = w.labels[ev[2]]
            self.held(key, mod, ev[1])
            if st.live_req > st.peak_req:
                st.peak_req = st.live_req
                st.peak_req_seq = len(self.tracker) - 1
                st.ws_at_peak = st.ws_bytes
                self._at_peak()
        elif kind == "h":
            st._host(ev[1])
        elif kind == "e":
            st.sim.empty_cache()

    def _site(self, w: _Window, h: int) -> None:
        """An out-of-memory point in a replay: the operator, module, phase and stack of the
        recorded allocation it repeats."""
        st, row = self.st, w.site_of.get(h, -1)
        if st.oom is None or st.stopped or row < 0:
            return
        ev = self.trace.event(row)
        st.oom = dataclasses.replace(
            st.oom, op=ev.op, module=ev.module or None, phase=ev.phase.label,
            stack=tuple(ev.stack or ()))

    def held(self, key: str, mod: str, n: int) -> None:
        """The replay's own live bytes change by ``n`` (category ``key``, module ``mod``)."""
        self.live += n
        self.cat[key] = self.cat.get(key, 0) + n
        name = mod or "(outside any module)"
        self.mod[name] = self.mod.get(name, 0) + n

    def _at_peak(self) -> None:
        """At a new peak of requested bytes: the replay's own live bytes then (the trace
        holds the rest)."""
        st = self.st
        if self.live or any(self.cat.values()):
            st.peak_extra = ({k: v for k, v in self.cat.items() if v},
                             {k: v for k, v in self.mod.items() if v})
        else:
            st.peak_extra = None

    def free_real(self, t: torch.Tensor, gone: list[tuple[str, str, int]]) -> None:
        """Free a real storage's block now (the gradient arriving for a replayed call's
        output, freed by its backward); its later death changes nothing."""
        st = self.st
        sid = st.sid_of.get(t.untyped_storage()._cdata)
        a = st.addr.pop(sid, None) if sid is not None else None
        if sid is None or a is None:
            self.invalid("a replayed call's incoming gradient is not on the GPU")
            return
        n = t.untyped_storage().nbytes()
        st._requested(-n, sid)
        st.gone.add(sid)
        row = self._row_of(sid)
        tr = self.trace
        key = _KEYS.get(Category(tr.category[row]), "other") if row >= 0 else "other"
        mod = tr.strings[tr.module[row]] if row >= 0 else ""
        self.held(key, mod, -n)  # the trace still holds it until its real death
        gone.append((key, mod, n))
        st.sim.free(a)

    def make_output(self, w: _Window, h: int) -> torch.Tensor:
        """Make output ``h`` through the fake mode (its storage's malloc and requested bytes
        as the record has them) and give its trace row the recorded module and category."""
        leaf = next(x for x in w.outs if isinstance(x, _Out) and x.handle == h)
        t = torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype, device="cuda")
        if leaf.made is not None and leaf.made[0] != "?":  # a read of it: as the record's
            self.values._remember(t, *leaf.made)
        if self.st.oom is not None:
            raise _Abort()
        row, src = len(self.tracker) - 1, w.out_rows.get(h, -1)
        tr = self.trace
        if src >= 0 and row >= 0 and tr.kind[row] == _ALLOC_KIND:
            tr.module[row], tr.category[row] = tr.module[src], tr.category[src]
            tr.stack[row] = tr.stack[src]
        return t

    def invalid(self, why: str) -> None:
        if self.valid:
            self.valid, self.why_invalid = False, why

    # -- the call -------------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap ``torch.nn.Module.__call__`` for the run."""
        self.orig_call = orig = torch.nn.Module.__call__
        me = self

        def call(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != me.thread:
                return orig(mod, *args, **kwargs)
            if me.depth:
                me.depth += 1
                try:
                    return orig(mod, *args, **kwargs)
                finally:
                    me.depth -= 1
            return me._outer(orig, mod, args, kwargs)

        torch.nn.Module.__call__ = call  # type: ignore[method-assign]
        self.orig_clear = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear  # type: ignore[assignment]

    def remove(self) -> None:
        if self.orig_call is not None:
            torch.nn.Module.__call__ = self.orig_call  # type: ignore[method-assign]
            torch.clear_autocast_cache = self.orig_clear  # type: ignore[assignment]
            self.orig_call = None

    def _clear(self) -> None:
        """``torch.clear_autocast_cache()`` (autocast's outermost exit): the cast copies a
        recorded call left go now, and a replayed call's blocks that did."""
        if self.rec is not None and self.pending:
            self.rec.bad = self.rec.bad or "autocast's cache was cleared inside it"
        self.clearing = True
        try:
            self.orig_clear()
        finally:
            self.clearing = False
        for ow in [w for w in self.open if w.wait_clear]:
            self.open.remove(ow)
            if set(ow.handle.values()) - ow.out_handles:
                ow.bad = ow.bad or "it keeps tensors that are not its outputs"
            else:
                ow.done = True
            ow.handle = {}
        pending, self.pending = self.pending, []
        for call in pending:
            call.clear()

    def _outer(self, orig: Any, mod: torch.nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        st = self.st
        key = None
        grad = torch.is_grad_enabled()
        if (self.rec is None and self.valid and st.oom is None and not st.frames
                and st.feed is None and (st.dist is None or not grad)):
            key = _signature(mod, args, kwargs)
        if key is not None and _hooked(mod, grad, st.dist is not None):
            key = None
        if key is None:
            return self._plain(orig, mod, args, kwargs)
        w = self.verified.get(key)
        if w is not None:
            return self._replay(orig, mod, args, kwargs, w)
        prev = self.last.get(key)
        if prev is not None and prev.done:
            twice = self.last.get(("prev", key))
            if twice is not None and self._same(twice, prev):
                self._label(prev)
                self.verified[key] = prev
                while len(self.verified) > _KEPT:
                    del self.verified[next(iter(self.verified))]
                return self._replay(orig, mod, args, kwargs, prev)
        w = _Window(key, len(self.tracker))
        for j, x in enumerate(tree_flatten((args, kwargs))[0]):
            if isinstance(x, torch.Tensor):
                sid = st.sid_of.get(x.untyped_storage()._cdata)
                if sid is not None:
                    w.inputs.setdefault(sid, j)
        w.flops = self._flops()
        w.calls_f = self._calls()
        self.rec = w
        try:
            out = self._plain(orig, mod, args, kwargs)
        finally:
            if self.rec is w:
                self.rec = None
        self._finish_forward(w, out)
        if prev is not None:
            self.last[("prev", key)] = prev
        self.last[key] = w
        while len(self.last) > _KEPT:  # many shapes (a script whose batches vary): the oldest go
            del self.last[next(iter(self.last))]
        return out

    def _plain(self, orig: Any, mod: torch.nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        self.depth += 1
        try:
            return orig(mod, *args, **kwargs)
        finally:
            self.depth -= 1

    def _replay(self, orig: Any, mod: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], w: _Window) -> Any:
        """The replay of ``w`` in place of ``mod``'s ``__call__``, between the global module
        hooks (the tracker's module scope). The record holds all the rest of the call (the
        levers' wrapper, FSDP's hooks on the root), so none of it runs again."""
        call = _Call(self, w, tree_flatten((args, kwargs))[0])
        needs_grad = any(isinstance(x, _Out) and x.grad for x in w.outs)
        anchor = next((p for p in mod.parameters() if p.requires_grad), None)
        if needs_grad and anchor is None:
            self.invalid("a replayed call has outputs that need grad but no trainable parameter")
            return self._plain(orig, mod, args, kwargs)

        def forward(*_a: Any, **_k: Any) -> Any:
            if needs_grad:
                tensors = iter(_Replayed.apply(call, anchor))
                outs = [next(tensors) if isinstance(x, _Out) else x[1] for x in w.outs]
            else:
                outs = call.forward()
            return tree_unflatten(outs, w.spec)

        self.depth += 1
        try:
            out = _with_global_hooks(mod, args, kwargs, forward)
        finally:
            self.depth -= 1
        self.replayed += 1
        return out


