"""The :class:`Tracker` and :func:`track`: the public face, read API and lifecycle of a run.

See :mod:`torchmem.capture.tracker` for the contract other parts of torchmem code against.

Example:
    >>> import torch, torchmem
    >>> with torchmem.track() as tr:
    ...     x = torch.zeros(10)
    >>> len(tr), tr.peak()
    (1, {'cpu': 40})
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

from torchmem._distributed import keep_defaults_groupless
from torchmem.capture.storage import device_str
from torchmem.capture.tracker._hotpath import _Mode
from torchmem.capture.tracker._recorder import _MARK, _P_OTHER, Listener
from torchmem.capture.tracker._threads import _Threads
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import PathLike, TraceStreamer, save_trace
from torchmem.model.aggregate import DEFAULT_KEEP_LAST
from torchmem.model.events import Event

if TYPE_CHECKING:
    from torchmem.capture.fast import FastTracker

__all__ = ["Tracker", "track"]

#: Trackers between ``__enter__`` and ``__exit__`` in this process (a forked child stops them).
_RUNNING: weakref.WeakSet[Tracker] = weakref.WeakSet()


def _stop_in_forked_child() -> None:
    """``os.fork`` child (a DataLoader or multiprocessing worker): stop every tracker the
    parent had running; the parent records its own run, the child records nothing."""
    for tracker in list(_RUNNING):
        tracker._leave_forked_child()
    _RUNNING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_in_forked_child)


class Tracker(_Threads):
    """Records storage allocations and frees with operator, module, phase and category.

    Create it with :func:`track` (the constructor takes the same arguments). Between
    ``__enter__`` and ``__exit__`` it is active; after the block its results stay readable
    (:meth:`events`, :meth:`peak`, :meth:`save`).

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
        if self._agg is not None:
            self._agg.fold(self.trace)
        save_trace(self.trace, path)

    def __len__(self) -> int:
        return len(self.trace)

    def __enter__(self) -> Tracker:
        if self._active or self._used:
            raise InvalidInputError(
                "this Tracker was already used; call torchmem.track(...) again for a new run"
            )
        self._used = True
        self._thread = threading.get_ident()
        self._thread_idx = self.trace.intern_thread(threading.current_thread().name)
        self._t0 = time.perf_counter_ns()
        self._make_hot_paths()
        self.trace.metadata["start_unix_ns"] = time.time_ns()
        try:
            if self.path is not None:
                self._streamer = TraceStreamer(self.trace, self.path)
                self._streamer.start()
            self._install()
        except BaseException:
            self._uninstall()
            if self._streamer is not None:
                self._streamer.close()
                self._streamer = None
            raise
        self._active = True
        if self._agg is not None:
            self._midway_at = self._agg.midway_at()
            self._seq_cap = max(2, self._agg.within)
        self._pid = os.getpid()
        _RUNNING.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _RUNNING.discard(self)
        if self._pid != os.getpid():  # a forked child leaving the block: the parent's run
            self._leave_forked_child()
            self._uninstall(forked=True)
            return
        try:
            if self._active:
                self._drain()
                self._end_region(_P_OTHER)
                if self._agg is not None:
                    self._agg.fold(self.trace)
        finally:
            self._active = False
            try:
                self._uninstall()
            finally:
                self._finish_file()

    def _finish_file(self) -> None:
        """With ``path``: stop streaming and replace the streamed file with the complete one."""
        streamer, self._streamer = self._streamer, None
        if streamer is None or self.path is None:
            return
        streamer.close()
        self.save(self.path)

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
        self._install_threads()
        self._install_resize()
        keep_defaults_groupless()  # before the mode's first entry imports torch._dynamo
        mode = self._mode = _Mode(self)
        mode.__enter__()
        self._exit.append(lambda: mode.__exit__(None, None, None))

    def _leave_forked_child(self) -> None:
        """In a forked child: record nothing more and write nothing (the parent owns the run
        and its file). The dispatch mode stays on the child's mode stack, inert, until the
        block ends there (a DataLoader worker never gets there: it exits first). The trace,
        the live-storage map and the rest are left untouched: they are the parent's pages,
        shared until written, so leaving them costs the child no private memory."""
        self._active = False
        self._streamer = None  # its thread did not survive the fork; the parent closes the file
        self.path = None
        if self._mode is not None:
            self._mode.stop()

    def _uninstall(self, forked: bool = False) -> None:
        errors = []
        while self._exit:
            fn = self._exit.pop()
            try:
                fn()
            except Exception as e:  # keep removing the rest
                errors.append(e)
        if forked:  # the parent's state: freeing it would copy its pages into the child
            if errors:
                raise errors[0]
            return
        self._live.clear()  # drops the weak references: no callback after exit
        self._pending.clear()  # (drained at exit) and other threads' refs with it
        self._orphans.clear()
        self._fw_names.clear()
        self._fw_mods.clear()
        del self._seq_bounds[:], self._seq_owner[:]
        if errors:
            raise errors[0]


@overload
def track(
    *modules_and_optimizers: Any,
    stacks: bool = False,
    stack_depth: int = 8,
    listeners: Iterable[Listener] = (),
    modules: bool = True,
    step_marker: str = "optimizer",
    metadata: dict[str, Any] | None = None,
    path: PathLike | None = None,
    aggregate: bool | int = False,
    keep_last: int = DEFAULT_KEEP_LAST,
    mode: Literal["ops"] = "ops",
) -> Tracker: ...


@overload
def track(
    *modules_and_optimizers: Any,
    stacks: bool = False,
    stack_depth: int = 8,
    listeners: Iterable[Listener] = (),
    modules: bool = True,
    step_marker: str = "optimizer",
    metadata: dict[str, Any] | None = None,
    path: PathLike | None = None,
    aggregate: bool | int = False,
    keep_last: int = DEFAULT_KEEP_LAST,
    mode: Literal["fast"],
) -> FastTracker: ...


@overload
def track(
    *modules_and_optimizers: Any,
    stacks: bool = False,
    stack_depth: int = 8,
    listeners: Iterable[Listener] = (),
    modules: bool = True,
    step_marker: str = "optimizer",
    metadata: dict[str, Any] | None = None,
    path: PathLike | None = None,
    aggregate: bool | int = False,
    keep_last: int = DEFAULT_KEEP_LAST,
    mode: str = "ops",
) -> Tracker | FastTracker: ...


def track(
    *modules_and_optimizers: Any,
    stacks: bool = False,
    stack_depth: int = 8,
    listeners: Iterable[Listener] = (),
    modules: bool = True,
    step_marker: str = "optimizer",
    metadata: dict[str, Any] | None = None,
    path: PathLike | None = None,
    aggregate: bool | int = False,
    keep_last: int = DEFAULT_KEEP_LAST,
    mode: str = "ops",
) -> Tracker | FastTracker:
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
        path: a ``.tmtrace`` file to stream the trace to while the block runs (new events are
            written at least every half second, so a run killed by SIGKILL or the OOM killer
            leaves a file that ``torchmem summary`` reads, missing at most its last second);
            when the block ends the complete trace replaces it (as :meth:`Tracker.save`).
        aggregate: bounded memory for long runs (:mod:`torchmem.model.aggregate`): ``True``
            folds finished iterations into per-iteration figures, counters and the leak trend
            at step markers and drops their events, keeping every event of each device's peak
            iteration, of the last ``keep_last`` iterations and of the storages still alive;
            an int ``N`` does so once the trace holds ``N`` events (full detail for shorter
            runs). Without step markers (an inference loop) or in a long iteration, the
            iteration in progress is compacted every ``trace.aggregate.within`` rows (default
            262,144), keeping its live storages and those alive at the peak, and the map from
            autograd nodes to modules keeps at most ``within`` entries (a backward through a
            graph made more than ``within / 2`` module calls before it attributes its oldest
            nodes to no module): bounded memory over any run length. ``torchmem.analysis.summarize`` gives the same figures as for
            a full trace.
        keep_last: complete iterations an aggregated trace keeps in full (default 5).
        mode: ``"ops"`` (default): the dispatch tracker, which sees every operator's outputs
            (CPU and CUDA, stacks, listeners, streaming). ``"fast"``: allocator-level capture in
            C++ with the same attribution (module, phase, category, operator, exact peak) at a
            fraction of the cost, CPU memory only, no stacks/listeners/streaming; returns a
            :class:`~torchmem.capture.FastTracker` (see :mod:`torchmem.capture.fast`). Its
            native part is built once per torch version (needs a C++ compiler and ninja).

    Example:
        >>> import torch, torchmem
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> with torchmem.track(net) as tr:
        ...     net(torch.randn(3, 4)).sum().backward()
        >>> sorted({e.module for e in tr.events() if e.phase.label == "backward" and e.module})
        ['Sequential.0', 'Sequential.1', 'Sequential.2']
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "run.tmtrace")
        >>> with torchmem.track(path=p):              # streamed while it runs, complete after
        ...     x = torch.ones(4)
        >>> torchmem.load_trace(p).peak(), "cut_short" in torchmem.load_trace(p).metadata
        ({'cpu': 16}, False)
        >>> with torchmem.track(step_marker="manual", aggregate=1, keep_last=1) as tr:
        ...     for _ in range(10):
        ...         x = torch.ones(256); _ = tr.step()
        >>> len(tr), tr.trace.aggregate.events, tr.peak()    # held: 2 iterations and their storages
        (9, 29, {'cpu': 2048})
    """
    if mode == "fast":
        bad = [name for name, on in (("stacks=True", stacks), ("listeners", bool(list(listeners))),
                                     ("aggregate", aggregate is not False)) if on]
        if bad:
            raise InvalidInputError(
                f"mode='fast' does not support {' and '.join(bad)} (it runs no Python per "
                "allocation and builds the trace when the block ends); use mode='ops' for stacks, "
                "live listeners and aggregated long runs"
            )
        from torchmem.capture.fast import FastTracker

        return FastTracker(*modules_and_optimizers, modules=modules, step_marker=step_marker,
                           metadata=metadata, path=path)
    if mode != "ops":
        raise InvalidInputError(
            f"mode must be 'ops' (the dispatch tracker) or 'fast' (allocator-level, CPU), got "
            f"{mode!r}"
        )
    return Tracker(
        *modules_and_optimizers,
        stacks=stacks,
        stack_depth=stack_depth,
        listeners=listeners,
        modules=modules,
        step_marker=step_marker,
        metadata=metadata,
        path=path,
        aggregate=aggregate,
        keep_last=keep_last,
    )
