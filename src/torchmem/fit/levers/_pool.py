"""Independent estimates side by side: forked worker processes, one estimate each
(``torchmem estimate --what-if`` runs its levers this way).

:func:`run_all` calls ``fn(job)`` for each job, in ``workers`` forked processes when the
machine has the cores (the build function and everything it closes over are inherited by the
fork, nothing is pickled but the results), else one after the other; results come back in the
jobs' order, an exception as the job's result. Forking is skipped where it is unsafe: a process
that has initialised CUDA, or a platform without ``fork``.

Example:
    >>> run_all(lambda x: x * x, [1, 2, 3], workers=1)
    [1, 4, 9]
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["WorkerLost", "default_workers", "run_all"]

_FN: Callable[[Any], Any] | None = None
_JOBS: Sequence[Any] = ()


def default_workers() -> int:
    """Worker processes to use: the cores this process may run on (at most 8), 1 where forking
    is unsafe (CUDA initialised, no ``fork``).

    Example:
        >>> default_workers() >= 1
        True
    """
    import torch

    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return 1
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


class WorkerLost(RuntimeError):
    """A job's worker process ended without handing back a result (killed, aborted by a
    crash in native code): the job's result, so the other jobs' results still come back.

    Example:
        >>> str(WorkerLost(0, -6))
        'its worker process ended without a result (killed by SIGABRT)'
    """

    def __init__(self, job: int, exitcode: int | None) -> None:
        import signal

        if exitcode is not None and exitcode < 0:
            try:
                how = f"killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"killed by signal {-exitcode}"
        else:
            how = f"exit code {exitcode}"
        super().__init__(f"its worker process ended without a result ({how})")
        self.job, self.exitcode = job, exitcode


def _call(i: int) -> Any:
    assert _FN is not None
    try:
        return _FN(_JOBS[i])
    except Exception as e:  # noqa: BLE001 - handed back to the parent, which raises or reports
        return e


def _child(i: int, conn: Any, quiet: bool) -> None:
    import torch

    # one thread: an OpenMP thread team the parent used (a real CPU operator on host data:
    # TRL's collator builds its masks with tril) is not in the forked child, whose next
    # parallel region would wait for it forever (libgomp's team barrier); the workers are
    # one per core anyway
    torch.set_num_threads(1)
    if quiet:  # the job's own output (a script's logs, run again per job) goes nowhere
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
    value = _call(i)
    try:
        conn.send(value)
    except Exception as e:  # noqa: BLE001 - a result pickle refuses: its error instead
        conn.send(RuntimeError(f"the job's result could not be handed back: {e!r}"))
    conn.close()


def run_all(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int | None = None,
            done: Callable[[int, Any], None] | None = None, quiet: bool = False) -> list[Any]:
    """``[fn(job) for job in jobs]``, in ``workers`` forked processes (default
    :func:`default_workers`), one process per job; an exception raised by ``fn`` is that job's
    result, and so is :class:`WorkerLost` where a job's process dies without one (the others
    go on). ``done(index, result)`` is told each result as it arrives. With ``quiet``, what the
    jobs print (to ``sys.stdout`` and ``sys.stderr``; in a worker process, to file descriptors 1
    and 2) is dropped.

    Example:
        >>> run_all(lambda x: 10 // x, [5, 0], workers=1)[1].__class__.__name__
        'ZeroDivisionError'
    """
    global _FN, _JOBS
    n = default_workers() if workers is None else max(1, int(workers))
    n = min(n, len(jobs))
    out: list[Any] = [None] * len(jobs)
    if n <= 1:
        for i, job in enumerate(jobs):
            try:
                with contextlib.ExitStack() as stack:
                    if quiet:
                        sink = stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115
                        stack.enter_context(contextlib.redirect_stdout(sink))
                        stack.enter_context(contextlib.redirect_stderr(sink))
                    out[i] = fn(job)
            except Exception as e:  # noqa: BLE001 - the job's result
                out[i] = e
            if done is not None:
                done(i, out[i])
        return out
    from multiprocessing.connection import wait

    _FN, _JOBS = fn, jobs
    ctx = multiprocessing.get_context("fork")
    running: dict[Any, tuple[int, Any]] = {}  # the parent's end of each pipe -> (job, process)
    todo = list(range(len(jobs)))
    try:
        while todo or running:
            while todo and len(running) < n:
                i = todo.pop(0)
                parent_end, child_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(i, child_end, quiet), daemon=True)
                proc.start()
                child_end.close()
                running[parent_end] = (i, proc)
            sentinels = {proc.sentinel: conn for conn, (_, proc) in running.items()}
            for ready in wait([*running, *sentinels]):
                conn = sentinels.get(ready, ready)  # type: ignore[call-overload]
                if conn not in running:
                    continue  # both ends of one job were ready: handled
                i, proc = running.pop(conn)
                try:
                    value = conn.recv()
                except (EOFError, OSError):
                    proc.join()
                    value = WorkerLost(i, proc.exitcode)
                conn.close()
                proc.join()
                out[i] = value
                if done is not None:
                    done(i, value)
    finally:
        for conn, (_, proc) in running.items():
            proc.kill()
            proc.join()
            conn.close()
        _FN, _JOBS = None, ()
    return out
