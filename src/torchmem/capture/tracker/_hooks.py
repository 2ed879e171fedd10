"""Module and optimizer hooks: module names, the forward module stack and the optimizer phase.

Global forward pre/post hooks keep the stack of running modules (named by their qualified
path as ``named_modules()`` gives it, ``"Net.encoder.0"``, below a tracked root or below the
outermost module that ran, which is named by its type) and note the autograd sequence number at
each module boundary for backward attribution. Global optimizer step pre/post hooks open and
close the optimizer phase and add a step marker after each step of the first optimizer seen.
Hooks ignore calls on threads other than the tracking one.

Example:
    >>> import torch, torchmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> with torchmem.track(net) as tr:
    ...     _ = net(torch.ones(1, 2))
    >>> sorted({e.module for e in tr.events() if e.module})
    ['Sequential', 'Sequential.0', 'Sequential.1']
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from torchmem._containers import iter_tensors
from torchmem.capture._names import _path_below, around_closure, name_uncalled
from torchmem.capture.tracker._comm import _Comm
from torchmem.capture.tracker._phases import _graph_task_id
from torchmem.capture.tracker._recorder import _C, _P_FWD, _P_OPT, _P_OTHER

__all__: list[str] = []

_OPT_SENTINEL: Any = torch.nn.Identity()  # marks the optimizer entry on the module stack


class _Hooks(_Comm):
    """The callbacks a tracker registers as global module and optimizer hooks."""

    def _name_of(self, m: torch.nn.Module) -> int:
        idx = self._names.get(m)
        if idx is not None:
            return idx
        strings = self.trace.strings
        parent = self._fw_mods[-1] if self._fw_mods else None
        if parent is not None:
            pidx = self._names.get(parent)
            pname = strings[pidx] if pidx is not None else type(parent).__name__
            name = _path_below(parent, m, pname)
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
        idx = self._names.by_id.get(id(module))
        if idx is None:
            idx = self._name_of(module)
        if _graph_task_id() == -1:
            if not self._fw_mods:
                if self._phase == _P_OTHER:
                    # tensors made outside any phase and fed to the outermost module: inputs
                    self._reclassify(iter_tensors(args), _C.INPUT, int(_C.OTHER))
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
        if id(module) not in self._settled:
            self._settled.add(id(module))
            self._name_uncalled(module)

    def _name_open_modules(self) -> None:
        """Name the uncalled children of every module still running (outermost first): a
        report made in the middle of a forward (an out-of-memory point) sees the parameters of
        the blocks the forward has not reached yet as parameters."""
        for m in list(self._fw_mods):
            if m is not _OPT_SENTINEL:
                self._name_uncalled(m)

    def _name_uncalled(self, m: torch.nn.Module) -> None:
        """On ``m``'s first return: its submodules its forward did not call
        (``nn.MultiheadAttention`` reads ``out_proj.weight`` itself) are named below it, so
        their parameters and buffers are parameters and buffers, not "other"."""
        for child, idx in name_uncalled(m, self._names, self.trace):
            self._note_params(child.parameters(recurse=False))
            self._reclassify(child.parameters(recurse=False), _C.PARAMETER, int(_C.OTHER), idx)
            self._reclassify(child.buffers(recurse=False), _C.BUFFER, int(_C.OTHER), idx)

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if not self._active or threading.get_ident() != self._thread:
            return None
        if opt not in self._optims:
            self._optims.add(opt)
            for group in opt.param_groups:
                self._note_params(group["params"])
        if self._clock_opt is None:
            self._clock_opt = weakref.ref(opt)
        name = self.trace.intern(f"optimizer:{type(opt).__name__}")
        self._enter_optimizer(name)
        # a closure's forward and backward are the model's: the optimizer phase pauses
        return around_closure(args, kwargs, self._leave_optimizer,
                              lambda: self._enter_optimizer(name))

    def _enter_optimizer(self, name: int) -> None:
        if not self._active:
            return
        self._end_region(_P_OPT)
        self._phase = _P_OPT
        # optimizer-phase events are attributed to the optimizer, e.g. "optimizer:Adam"
        self._fw_names.append(name)
        self._fw_mods.append(_OPT_SENTINEL)

    def _leave_optimizer(self) -> None:
        if not self._active:
            return
        if self._fw_mods and self._fw_mods[-1] is _OPT_SENTINEL:
            self._fw_mods.pop()
            self._fw_names.pop()
        self._end_region(_P_OTHER)
        self._phase = _P_OTHER

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active or threading.get_ident() != self._thread:
            return
        self._leave_optimizer()
        clock = self._clock_opt() if self._clock_opt is not None else None
        if self.step_marker == "optimizer" and clock is opt:
            self.step()
