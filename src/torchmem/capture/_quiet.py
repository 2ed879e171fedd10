"""Keep the PyTorch profiler's own start/stop lines off the user's stderr.

Starting and stopping ``torch.profiler`` makes its C++ backend (Kineto) write lines such as
``USDT:2026-11-23 09:15:12 13231:13231 SyncActivityProfilerHandler.cpp:52] profiler_start``
straight to file descriptor 2, whatever ``KINETO_LOG_LEVEL`` says. :func:`quiet_profiler`
sends file descriptor 2 to a temporary file while the profiler starts or stops, then writes
back every captured line that is not one of those (so a warning that happens to be printed in
that window still reaches the user, in order).

Example:
    >>> import torch
    >>> from torchmem.capture._quiet import quiet_profiler, is_profiler_noise
    >>> prof = torch.profiler.profile(profile_memory=True)
    >>> with quiet_profiler():
    ...     _ = prof.__enter__()
    >>> with quiet_profiler():
    ...     prof.__exit__(None, None, None)
    >>> is_profiler_noise("USDT:2026-11-23 09:15:12 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start")
    True
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["quiet_profiler", "is_profiler_noise"]

# Kineto's session lines: "... SyncActivityProfilerHandler.cpp:52] profiler_start" and the
# matching stop; other Kineto INFO lines of a session start/stop carry "ActivityProfiler".
_NOISE = re.compile(
    r"(\] profiler_(start|stop)\s*$)|(ActivityProfiler\w*\.cpp:\d+\])|(^USDT:.*\] profiler_)"
)


def is_profiler_noise(line: str) -> bool:
    """True for a line the profiler's backend writes when a session starts or stops.

    Example:
        >>> is_profiler_noise("my own warning"), is_profiler_noise(
        ...     "USDT:2026-11-23 09:15:12 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop")
        (False, True)
    """
    return bool(_NOISE.search(line))


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Run the block with file descriptor 2 captured; re-emit all but the profiler's lines.

    Does nothing (lets everything through) when file descriptor 2 cannot be duplicated, e.g.
    in an embedded interpreter without one.

    Example:
        >>> with quiet_profiler():
        ...     x = 1 + 1
        >>> x
        2
    """
    try:
        sys.stderr.flush()
    except (AttributeError, ValueError, OSError):
        pass
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 2)
        except OSError:
            os.close(saved)
            yield
            return
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().splitlines(keepends=True)
                    if not is_profiler_noise(ln.decode("utf-8", "replace").rstrip("\r\n"))]
            if kept:
                try:
                    os.write(2, b"".join(kept))
                except OSError:
                    pass
