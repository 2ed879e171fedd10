"""``torchmem.compat.MemoryTracker``: the API of ``torch.distributed._tools.memory_tracker.MemoryTracker``.

PyTorch's MemoryTracker reads ``torch.cuda.memory_allocated()`` after every operator, so it
raises without a GPU and misses which storage belongs to what. This class keeps its methods
(``start_monitor``, ``stop``, ``summary``, ``show_traces``, ``save_stats``, ``load``) on top of
:func:`torchmem.track`, so it works on CPU, meta and fake tensors as well as CUDA. Differences:
files are torchmem trace files (no pickle), ``show_traces`` writes a PNG instead of opening a
window, and ``summary`` reports bytes allocated per ``module.operator (phase)``.

Example:
    >>> import torch, torchmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    >>> mt = torchmem.compat.MemoryTracker()
    >>> mt.start_monitor(net)
    >>> net(torch.randn(4, 8)).sum().backward()
    >>> mt.stop()
    >>> mt.peak()["cpu"] > 0
    True
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import PathLike, load_trace, save_trace
from torchmem.model.events import EventKind
from torchmem.model.trace import Trace
from torchmem.units import format_bytes

__all__ = ["MemoryTracker"]


class MemoryTracker:
    """Drop-in for torch's ``MemoryTracker`` that works on any device.

    Example:
        >>> import torch, torchmem, io
        >>> lin = torch.nn.Linear(4, 4)
        >>> mt = torchmem.compat.MemoryTracker(); mt.start_monitor(lin)
        >>> _ = lin(torch.randn(2, 4)); mt.stop()
        >>> buf = io.StringIO(); mt.summary(top=3, file=buf)
        >>> "Linear.aten::addmm (forward)" in buf.getvalue()
        True
    """

    def __init__(self) -> None:
        self._tracker: Any = None
        self._trace: Trace | None = None

    def start_monitor(self, root_module: Any) -> None:
        """Start recording, attributing operators to ``root_module``'s submodules.

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().start_monitor("not a module")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: start_monitor expects a torch.nn.Module...
        """
        import torch

        from torchmem.capture.tracker import track

        if not isinstance(root_module, torch.nn.Module):
            raise InvalidInputError(
                f"start_monitor expects a torch.nn.Module, got {type(root_module).__name__}"
            )
        if self._tracker is not None:
            raise InvalidInputError("start_monitor was called twice; call stop() first")
        self._tracker = track(root_module, metadata={"producer": "torchmem.compat.MemoryTracker"})
        self._tracker.__enter__()
        self._trace = self._tracker.trace

    def stop(self) -> None:
        """Stop recording and remove every hook and the dispatch mode (safe to call twice).

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().stop()
        """
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)

    def _need(self) -> Trace:
        if self._trace is None:
            raise InvalidInputError(
                "nothing recorded yet; call start_monitor(model) and run a step, or load(path)"
            )
        return self._trace

    def peak(self) -> dict[str, int]:
        """Peak live bytes per device.

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().peak()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: nothing recorded yet; ...
        """
        return self._need().peak()

    def summary(self, top: int = 20, file: IO[str] | None = None) -> None:
        """Print the ``top`` operators (as ``module.operator (phase)``) that allocated most.

        Example:
            >>> import torchmem
            >>> mt = torchmem.compat.MemoryTracker()
            >>> mt.summary()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: nothing recorded yet; ...
        """
        tr = self._need()
        out = file if file is not None else sys.stdout
        groups: dict[str, int] = {}
        alloc = int(EventKind.ALLOC)
        s = tr.strings
        for i in range(len(tr)):
            if tr.kind[i] != alloc or not tr.op[i]:
                continue
            mod = s[tr.module[i]] or "(no module)"
            key = f"{mod}.{s[tr.op[i]]} ({_phase_label(tr.phase[i])})"
            groups[key] = groups.get(key, 0) + tr.nbytes[i]
        peak = ", ".join(f"{d} {format_bytes(b)}" for d, b in tr.peak().items()) or "none"
        print("------------------------------------------------", file=out)
        print(f"Peak live tensor memory: {peak}", file=out)
        print(f"Top {top} ops that generate memory are:", file=out)
        for key, b in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{key}: {format_bytes(b)}", file=out)
        print("------------------------------------------------", file=out)

    def show_traces(self, path: str = "", output: PathLike = "memory_traces.png") -> str:
        """Plot the memory timeline to ``output`` (a PNG); with ``path``, load that trace first.

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().show_traces("/no/such.tmtrace")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.MissingFileError: /no/such.tmtrace: no such file; ...
        """
        from torchmem.render.plot import plot_timeline

        if path:
            self.load(path)
        return plot_timeline(self._need(), output, title="MemoryTracker: live tensor memory")

    def save_stats(self, path: PathLike) -> None:
        """Save what was recorded as a torchmem trace file (no pickle).

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().save_stats("/tmp/x.tmtrace")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: nothing recorded yet; ...
        """
        save_trace(self._need(), os.fspath(path))

    def load(self, path: PathLike) -> None:
        """Load a trace saved by :meth:`save_stats` (or any torchmem trace file).

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().load("/no/such.tmtrace")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.MissingFileError: /no/such.tmtrace: no such file; ...
        """
        self._trace = load_trace(path)


def _phase_label(code: int) -> str:
    from torchmem.model.events import Phase

    return Phase(code).label
