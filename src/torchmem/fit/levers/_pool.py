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

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["default_workers", "run_all"]

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


def _call(i: int) -> Any:
    assert _FN is not None
    try:
        return _FN(_JOBS[i])
    except Exception as e:  # noqa: BLE001 - handed back to the parent, which raises or reports
        return e


def run_all(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int | None = None,
            done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(job) for job in jobs]``, in ``workers`` forked processes (default
    :func:`default_workers`); an exception raised by ``fn`` is that job's result.
    ``done(index, result)`` is told each result as it arrives.

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
                out[i] = fn(job)
            except Exception as e:  # noqa: BLE001 - the job's result
                out[i] = e
            if done is not None:
                done(i, out[i])
        return out
    _FN, _JOBS = fn, jobs
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(n, maxtasksperchild=1) as pool:
            for i, value in enumerate(pool.imap(_call, range(len(jobs)))):
                out[i] = value
                if done is not None:
                    done(i, value)
    finally:
        _FN, _JOBS = None, ()
    return out
