"""Stopping a script's run where it is safe: the time limit and argparse's exits.

:func:`_time_limit` delivers the stop from a timer (a signal on the main thread, a thread
otherwise) only in a frame where raising it leaves no bookkeeping half done
(:func:`_safe_to_stop`), retrying until one comes; :func:`_argparse_errors` turns an
``ArgumentParser.error`` exit into an error that names the option the script rejected.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torchmem.fit.fakegpu._dispatch import _Abort, request_stop, stop_pending
from torchmem.fit.targets._sandbox import owner as _owner


class _StopScript(_Abort):
    """Ends the script's run (enough optimizer steps, the time limit): a ``BaseException``, not
    an ``Exception``; the engine takes its ``_Abort`` base as a normal end of the run."""


#: Seconds between two tries of a stop that landed in torchmem's own bookkeeping.
_RETRY_S = 0.005
#: Off the main thread, seconds after a stop before it is delivered again if the run goes on.
_REFIRE_S = 0.25
#: Off the main thread, after this many seconds of tries in a loop without operators, the
#: stop is delivered wherever it lands.
_RETRY_FOR_S = 10.0


def _safe_to_stop(frame: Any) -> bool:
    """Whether an asynchronous stop may be raised in ``frame`` (the code a timer interrupted).

    Not inside torchmem's own code (the tracker, the simulator, the engine: a stop there would
    leave their state half-written, or be swallowed in a weakref callback), nor in what such code
    calls (torch's private modules, the standard library, generated ``<string>`` code), which
    are looked through up to the first other frame: the script's own code, a library it uses,
    torch's public modules (``torch.nn``, ``torch.optim``) are safe.

    Never while this thread runs a backward pass (a node of the autograd engine): raised there,
    the exception crosses the engine's C++ and aborts the process (``terminate called after
    throwing an instance of 'python_error'``); the stop then lands after the backward.

    Example:
        >>> import sys
        >>> _safe_to_stop(sys._getframe())    # a doctest's frame is nobody's bookkeeping
        True
        >>> _safe_to_stop(None)   # no frame (a thread that ended)
        True
    """
    import torch

    if torch._C._current_autograd_node() is not None:
        return False
    return _owner(frame, True) != "torchmem"


@contextlib.contextmanager
def _time_limit(seconds: float, stop: Callable[[], BaseException]) -> Iterator[None]:
    """Raise ``stop()`` in this thread after ``seconds``, where it is safe (:func:`_safe_to_stop`):
    on the main thread a timer signal raises it when it lands in the script's (or a library's)
    code; when it lands in torchmem's bookkeeping, the estimate's dispatch raises it before the
    thread's next operator (:func:`~torchmem.fit.fakegpu._dispatch.request_stop`) and the signal tries
    again :data:`_RETRY_S` later (a loop without operators). On another thread the dispatch
    raises it, and only a thread that runs no operator for :data:`_REFIRE_S` gets an
    asynchronous exception."""
    if seconds <= 0 or seconds == float("inf"):
        yield
        return
    ident = threading.get_ident()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        recorded: list[bool] = []
        ended: list[bool] = []

        def on_alarm(signum: int, frame: Any) -> None:
            if ended:  # a signal that was pending as the run ended: nothing to stop, no re-arm
                return  # (re-armed, it would fire after the default handler is back: SIGALRM)
            if not recorded:
                recorded.append(True)
                exc = stop()  # its side effects (the reason recorded)
            else:
                exc = _StopScript()
            if _safe_to_stop(frame):
                request_stop(ident, None)
                raise exc
            # in torchmem's bookkeeping: the estimate's dispatch raises it before the next
            # operator; a loop without operators is caught here at a later try
            request_stop(ident, _StopScript)
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            ended.append(True)
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            request_stop(ident, None)
        return
    give_up = time.monotonic() + seconds + _RETRY_FOR_S
    done = threading.Event()
    lock = threading.Lock()
    asked: list[float] = []  # when the stop was last asked of the engine

    def fire() -> None:
        with lock:
            if done.is_set():
                return
            if not asked:
                stop()  # its side effects (the reason recorded)
            if not asked or not stop_pending(ident):
                # the estimate's dispatch raises it before the thread's next operator starts,
                # where nothing is half-recorded (asked again while the run goes on: a script
                # may catch it)
                request_stop(ident, _StopScript)
                asked[:] = [time.monotonic()]
                start(_REFIRE_S)
                return
            if time.monotonic() - asked[0] < _REFIRE_S * 0.9:
                start(_REFIRE_S)
                return
            # no operator ran since: the thread loops in Python; deliver it between two
            # bytecodes, where that is safe (the look and the delivery can race, hence last)
            frame = sys._current_frames().get(ident)
            if _safe_to_stop(frame) or time.monotonic() > give_up:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                           ctypes.py_object(_StopScript))
                start(_REFIRE_S)
                return
            start(_RETRY_S)

    timers: list[threading.Timer] = []

    def start(after: float) -> None:
        t = threading.Timer(after, fire)
        t.daemon = True
        timers[:] = [t]
        t.start()

    start(seconds)
    try:
        yield
    finally:
        with lock:
            done.set()
            timers[0].cancel()
            request_stop(ident, None)


class _ArgparseRejected(SystemExit):
    """The script's argparse rejected its arguments (usage and message kept)."""

    def __init__(self, usage: str, message: str) -> None:
        super().__init__(2)
        self.usage, self.message = usage, message


@contextlib.contextmanager
def _argparse_errors() -> Iterator[None]:
    """``ArgumentParser.error`` raises :class:`_ArgparseRejected` (usage and message kept for
    torchmem's one-line error) instead of printing them and exiting 2."""
    original = argparse.ArgumentParser.error

    def error(self: argparse.ArgumentParser, message: str) -> Any:
        raise _ArgparseRejected(self.format_usage().strip(), message)

    argparse.ArgumentParser.error = error  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]
