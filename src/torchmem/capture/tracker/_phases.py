"""Phases, categories and module attribution: what each event is for and which module made it.

A tracker splits time into *phase regions* (forward, backward, optimizer, other). When a region
ends, its surviving allocations get their final category (gradient, optimizer state, or other;
forward survivors stay activations) and allocations freed inside it become temporaries. In
backward, the autograd node running now maps back to the module whose forward created it
through the sequence-number boundaries noted by the forward hooks (``_seq_mark``).

Example:
    >>> import torch, torchmem
    >>> with torchmem.track(step_marker="manual") as tr:
    ...     a = torch.ones(4)
    ...     _ = tr.step()
    >>> [(e.op, e.step) for e in tr.events()]
    [('aten::ones', 0), ('step', 0)]
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Iterable

import torch

from torchmem.capture._names import initial_state, next_seq, note_params, seq_mark
from torchmem.capture.tracker._recorder import (
    _C,
    _MARK,
    _P_BWD,
    _P_OPT,
    _P_OTHER,
    _Recorder,
    plain_tensors,
)
from torchmem.model.events import Category

__all__: list[str] = []

_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_next_seq = next_seq
_NO_SEQ = 2**63  # AccumulateGrad reports UINT64_MAX


class _Phases(_Recorder):
    """Step markers, phase regions, categories and the module an event is attributed to."""

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
        seq_mark(bounds, self._seq_owner, owner)
        if len(bounds) > self._seq_cap:  # aggregated and no step marker for a long while
            self._trim_seq_map()

    def _trim_seq_map(self) -> None:
        """Keep the newest half of the sequence-number map (aggregated runs only).

        The map gains an entry at each module boundary with an autograd node made since the
        last one and is emptied at step markers; a run without any (an inference loop with
        autograd on) would grow it without bound. An aggregated run keeps at most
        ``Aggregate.within`` entries: a backward through a graph whose forward began more than
        ``within / 2`` module boundaries earlier attributes its oldest nodes to no module
        (sizes, operators, phases and peaks are unaffected).
        """
        keep = max(1, self._seq_cap // 2)
        del self._seq_bounds[:-keep], self._seq_owner[:-keep]

    def _prune_seq_map(self) -> None:
        """At a step marker the graphs of earlier iterations have run backward: forget them."""
        if len(self._seq_bounds) > 1:
            owner = self._seq_owner[-1]
            del self._seq_bounds[:], self._seq_owner[:]
            self._seq_bounds.append(_next_seq())
            self._seq_owner.append(owner)

    def _phase_now(self) -> int:
        return _P_BWD if _graph_task_id() != -1 else self._phase

    def _end_region(self, new_phase: int) -> None:
        """Close the current phase region: resolve categories of its surviving allocations."""
        old = self._cur
        region = self._region_id
        if old == _P_BWD and self._comm_refs:
            self._comm_to_gradients()
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

    def _comm_to_gradients(self) -> None:
        """When backward ends: communication buffers that are now gradients (FSDP2's
        reduce-scatter output, a DDP bucket with ``gradient_as_bucket_view``) become gradients."""
        refs = self._comm_refs
        keys = self._grad_keys()
        cats = self.trace.category
        for key, ref in list(refs.items()):
            if self._live.get(key) is not ref:
                del refs[key]
            elif key in keys:
                cats[ref.seq] = int(_C.GRADIENT)
                del refs[key]

    def _note_params(self, params: Iterable[torch.Tensor]) -> None:
        note_params(self._params, params)

    def _grad_keys(self) -> set[int]:
        keys = set()
        dead = []
        for k, r in self._params.items():
            p = r()
            if p is None:
                dead.append(k)
                continue
            g = p.grad
            if g is not None:
                for t in plain_tensors(g):  # a DTensor's local shard
                    if t.layout is torch.strided:
                        keys.add(t.untyped_storage()._cdata)
        for k in dead:
            del self._params[k]
        return keys

    def _opt_state_keys(self) -> set[int]:
        keys = set()
        for o in list(self._optims):
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        for t in plain_tensors(v):
                            if t.layout is torch.strided:
                                keys.add(t.untyped_storage()._cdata)
        return keys

    def _reclassify(
        self, tensors: Iterable[torch.Tensor], cat: Category, only_from: int, module: int = 0
    ) -> None:
        for t in (p for x in tensors if x is not None for p in plain_tensors(x)):
            if t.layout is not torch.strided:
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
        items = initial_state(self._modules_in, self._optims_in, self._names)
        self._active = False
        for x, cat, mod in items:
            for t in plain_tensors(x):  # a DTensor's local shard
                if t.layout is not torch.strided or getattr(t, "is_nested", False):
                    continue
                self._add_storage(t.untyped_storage(), t.device, 0, mod, _P_OTHER, int(cat))
        self._active = True  # frees of initial storages are recorded from now on
