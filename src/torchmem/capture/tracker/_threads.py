"""Other threads: a dispatch mode on every thread started while a tracker is active.

Dispatch modes are thread-local, so the tracker's mode sees only the thread that entered
``track()`` (and the autograd engine's worker threads, which inherit it). While a tracker is
active, ``threading.Thread.start`` is wrapped: a thread started then runs its ``run()`` inside a
:class:`_ThreadMode` of its own, which queues the allocations of that thread (with its name) for
the tracking thread to record at its next event, so one thread alone appends to the trace.

What happens to which thread:

- started while tracking (``threading.Thread``, ``ThreadPoolExecutor`` workers, data-loader
  threads): its allocations and frees are recorded, named by the thread's ``name``. Its module
  calls are not attributed (module and phase attribution follow the tracking thread only): its
  events have no module, phase ``other``, category ``other``.
- still running when the block ends: its mode stays on that thread's mode stack, inert (it
  records nothing, one Python call per operator), until its ``run()`` returns and pops it.
- already running when tracking starts, or not a ``threading.Thread`` (threads made in C++):
  its allocations are not seen; frees on it of storages the tracker saw are recorded.

``Thread.start`` is restored when the block ends.

Limits: another thread's events reach the trace when the tracking thread records its next
event (or when the block ends), so while the tracking thread waits without running an operator
(``thread.join()``, ``time.sleep``) they are held in a queue, and a trace streamed to disk
(``track(path=...)``) gets them then. A storage another thread resizes in place (``resize_``) is
not seen there.

Example:
    >>> import threading, torch, torchmem
    >>> with torchmem.track() as tr:
    ...     t = threading.Thread(target=lambda: torch.zeros(256), name="worker"); t.start()
    ...     t.join()
    >>> [(e.kind.label, e.nbytes, e.thread) for e in tr.events()]
    [('alloc', 1024, 'worker'), ('free', 1024, 'worker')]
"""

from __future__ import annotations

import threading
from typing import Any

from torchmem.capture._fast_mode import FastDispatchMode
from torchmem.capture.tracker._hotpath import _HotPath

__all__: list[str] = []


class _ThreadMode(FastDispatchMode):
    """A started thread's mode: reports its operators' outputs while the tracker is active."""

    def __init__(self, tracker: _HotPath) -> None:
        super().__init__()
        self._tracker = tracker
        self._on = tracker._on_thread_outputs
        self._me = threading.current_thread()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self._tracker._active:
            self._on(func, out, self._me.name)
        return out


class _Threads(_HotPath):
    """Wraps ``threading.Thread.start`` while the tracker is installed."""

    def _install_threads(self) -> None:
        original = threading.Thread.start
        tracker = self

        def start(self: threading.Thread) -> None:
            if tracker._active and not getattr(self, "_torchmem_untracked", False):
                _wrap_run(tracker, self)
            original(self)

        start.__doc__ = original.__doc__
        threading.Thread.start = start  # type: ignore[method-assign]

        def restore() -> None:
            # another tracker may have wrapped ours: then ours stays in its chain, inert
            if threading.Thread.start is start:
                threading.Thread.start = original  # type: ignore[method-assign]

        self._exit.append(restore)


def _wrap_run(tracker: _HotPath, thread: threading.Thread) -> None:
    """Make ``thread.run()`` run inside a :class:`_ThreadMode` (an instance attribute, so a
    subclass's own ``run`` is wrapped too); the attribute is removed when it returns."""
    had = thread.__dict__.get("run")
    run = thread.run

    def tracked_run() -> Any:
        try:
            if not tracker._active:
                return run()
            with _ThreadMode(tracker):
                return run()
        finally:
            if had is None:
                thread.__dict__.pop("run", None)
            else:
                thread.__dict__["run"] = had

    thread.run = tracked_run  # type: ignore[method-assign]
