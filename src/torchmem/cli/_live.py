"""``torchmem run --live``: the figures the live panel shows, kept as the run goes, and the panel.

:class:`LiveCounter` is a tracker listener: per device it keeps the live bytes by category,
the peak and the bytes by category at the moment of the peak (the first time live bytes reach
their maximum, as :func:`torchmem.analysis.summarize` defines it), and at each step marker each
iteration's retained growth; O(1) per event. :class:`LiveView` draws
:func:`torchmem.render.live.live_panel` from it and from the host-memory sampler's latest sample
in a rich ``Live`` on stderr, redrawn twice a second (rich's refresh thread reads the counters; a
dict copy under the GIL needs no lock). On a terminal the script's own ``print`` output and
stderr are shown above the panel (rich's redirection; stdout only when it is the terminal too,
so ``> out.txt`` still gets it); otherwise nothing is drawn until the final panel. Output that
bypasses Python's ``sys.stdout``/``sys.stderr`` (C extensions writing to the file descriptors,
child processes started with their own streams) is not redirected and can leave stray lines in
the panel's area until the next redraw.

When the run ends (also on Ctrl-C) the panel is drawn once more from the whole trace, with its
final categories (while the run goes, an allocation's category is the tracker's provisional one,
by phase).

Example:
    >>> import io, torch, torchmem
    >>> counter = LiveCounter()
    >>> with torchmem.track(listeners=[counter.on_event]) as tr:
    ...     keep = [torch.zeros(256)]
    ...     for _ in range(3):
    ...         keep.append(torch.zeros(64)); _ = tr.step()
    >>> dev = counter.state("demo", 0.0).devices[0]
    >>> dev.device, dev.live, dev.iterations, dev.growth
    ('cpu', 1792, 3, [1280, 256, 256])
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

from torchmem.model.events import Category, Event, EventKind
from torchmem.model.trace import Trace
from torchmem.render.live import DeviceLive, HostRow, LiveState, live_panel

__all__ = ["LiveCounter", "LiveView", "cuda_reading"]

#: The panel is redrawn at most this many times a second.
REFRESH_PER_SECOND = 2


class LiveCounter:
    """Per-device live, peak and iteration figures from a tracker's events (a listener).

    Example:
        >>> from torchmem.model.events import Event, EventKind
        >>> c = LiveCounter()
        >>> c.on_event(Event(0, EventKind.ALLOC, 0, "cpu", 100, 1))
        >>> c.on_event(Event(1, EventKind.FREE, 0, "cpu", 100, 1))
        >>> d = c.state("x", 0.0).devices[0]
        >>> d.live, d.peak, d.peak_by_category
        (0, 100, {'other': 100})
    """

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.by_category: dict[str, dict[str, int]] = {}
        self.at_peak: dict[str, dict[str, int]] = {}
        self.growth: dict[str, list[int]] = {}
        self.iterations = 0
        self._it_start: dict[str, int] = {}
        self._storages: dict[int, tuple[str, str, int]] = {}

    def on_event(self, event: Event, storage: Any = None) -> None:
        """The listener: pass it to ``torchmem.track(listeners=[...])``.

        Example:
            >>> from torchmem.model.events import Event, EventKind
            >>> c = LiveCounter(); c.on_event(Event(0, EventKind.MARK, 0, "cpu", 0, 0, op="step"))
            >>> c.iterations
            1
        """
        kind = event.kind
        if kind is EventKind.MARK:
            if event.op == "step":
                self._step()
            return
        self._apply(kind is EventKind.ALLOC, event.device, event.category.label, event.nbytes,
                    event.storage)

    def _step(self) -> None:
        self.iterations += 1
        for dev, live in list(self.live.items()):
            self.growth.setdefault(dev, []).append(live - self._it_start.get(dev, 0))
            self._it_start[dev] = live

    def _apply(self, alloc: bool, dev: str, cat: str, nbytes: int, sid: int) -> None:
        if alloc:
            self._storages[sid] = (dev, cat, nbytes)
        else:
            known = self._storages.pop(sid, None)
            if known is None:  # allocated before the listener was attached
                return
            dev, cat, nbytes = known
            nbytes = -nbytes
        cats = self.by_category.get(dev)
        if cats is None:
            cats = self.by_category[dev] = {}
            # a device first seen now started every earlier iteration at 0 bytes
            self.growth[dev] = [0] * self.iterations
        cats[cat] = cats.get(cat, 0) + nbytes
        live = self.live.get(dev, 0) + nbytes
        self.live[dev] = live
        if live > self.peak.get(dev, 0):
            self.peak[dev] = live
            self.at_peak[dev] = dict(cats)

    @classmethod
    def from_trace(cls, trace: Trace) -> LiveCounter:
        """The figures of a whole trace, with its final categories (the final panel's).

        Example:
            >>> from torchmem.model.trace import Trace
            >>> from torchmem.model.events import Category
            >>> tr = Trace(); _ = tr.append(EventKind.ALLOC, 0, "cpu", 64, 1, category=Category.PARAMETER)
            >>> LiveCounter.from_trace(tr).by_category
            {'cpu': {'parameter': 64}}
        """
        out = cls()
        cats = [c.label for c in Category]
        alloc, free, mark = int(EventKind.ALLOC), int(EventKind.FREE), int(EventKind.MARK)
        devices, strings = trace.devices, trace.strings
        for k, d, n, sid, c, op in zip(trace.kind, trace.device, trace.nbytes, trace.storage,
                                       trace.category, trace.op):
            if k == mark:
                if strings[op] == "step":
                    out._step()
            elif k == alloc or k == free:
                out._apply(k == alloc, devices[d], cats[c], n, sid)
        return out

    def state(self, label: str, elapsed_s: float, host: Optional[list[HostRow]] = None,
              final: bool = False) -> LiveState:
        """A copy of the figures as the panel's plain data; the device with the highest peak
        first (a CUDA device wins a tie).

        Example:
            >>> LiveCounter().state("x", 1.0).devices
            []
        """
        devices = []
        for dev, cats in list(self.by_category.items()):
            devices.append(DeviceLive(
                dev, self.live.get(dev, 0), self.peak.get(dev, 0),
                {c: b for c, b in list(cats.items()) if b},
                dict(self.at_peak.get(dev, {})), self.iterations, list(self.growth.get(dev, [])),
            ))
        devices.sort(key=lambda d: (-d.peak, not d.device.startswith("cuda"), d.device))
        return LiveState(label, elapsed_s, devices, list(host or []), final)


def cuda_reading(device: str) -> Optional[tuple[int, int]]:
    """``(memory_allocated, memory_reserved)`` of a CUDA device, read without initialising CUDA
    (``None`` before the script has used it, or without CUDA).

    Example:
        >>> import torch
        >>> torch.cuda.is_initialized() or cuda_reading("cuda:0") is None
        True
    """
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    dev = torch.device(device)
    return int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev))


class LiveView:
    """The rich ``Live`` panel of a run (a context manager); ``finish(summary)`` draws the
    final panel once.

    ``console`` defaults to stderr; ``sampler`` is the run's
    :class:`~torchmem.capture.host.HostSampler` (or ``None``); ``allocator(device)`` reads a
    CUDA device's allocated and reserved bytes (default :func:`cuda_reading`).

    Example:
        >>> import io
        >>> from rich.console import Console
        >>> out = io.StringIO()
        >>> with LiveView("demo", console=Console(file=out, width=60)) as view:
        ...     pass
        >>> _ = view.finish(None)
        >>> "torchmem run --live: demo" in out.getvalue()
        True
    """

    def __init__(self, label: str, sampler: Any = None, console: Any = None,
                 allocator: Optional[Callable[[str], Optional[tuple[int, int]]]] = None) -> None:
        from rich.console import Console

        self.allocator = allocator or cuda_reading
        self.label = label
        self.sampler = sampler
        self.counter = LiveCounter()
        self.console = console if console is not None else Console(stderr=True)
        self._t0 = time.monotonic()
        self._live: Any = None

    def on_event(self, event: Event, storage: Any = None) -> None:
        """The tracker listener (the counter's).

        Example:
            >>> from torchmem.model.events import Event, EventKind
            >>> v = LiveView("x"); v.on_event(Event(0, EventKind.ALLOC, 0, "cpu", 8, 1))
            >>> v.counter.live
            {'cpu': 8}
        """
        self.counter.on_event(event, storage)

    def _host(self, all_seen: bool) -> list[HostRow]:
        if self.sampler is None:
            return []
        return [HostRow(m.pid, m.role, m.rss, m.uss, growth)
                for m, growth in self.sampler.latest(all_seen)]

    def state(self, final: bool = False) -> LiveState:
        """What the panel shows now; the final panel lists every process sampled (DataLoader
        workers that have exited too, as last seen), a live one those running.

        Example:
            >>> LiveView("x").state().label
            'x'
        """
        state = self.counter.state(self.label, time.monotonic() - self._t0, self._host(final),
                                   final)
        for dev in state.devices:
            if dev.device.startswith("cuda"):
                dev.allocator = self.allocator(dev.device)
        return state

    def __rich__(self) -> Any:  # rich's refresh thread calls this at each redraw
        return live_panel(self.state())

    def __enter__(self) -> LiveView:
        from rich.live import Live

        stdout_is_terminal = sys.stdout.isatty()
        self._live = Live(self, console=self.console, refresh_per_second=REFRESH_PER_SECOND,
                          transient=True, redirect_stdout=stdout_is_terminal,
                          redirect_stderr=True)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.__exit__(None, None, None)

    def finish(self, trace: Optional[Trace]) -> LiveState:
        """Draw the final panel and return its data: the figures of the whole ``trace`` with
        its final categories (without a trace, the live counters').

        Example:
            >>> import io
            >>> from rich.console import Console
            >>> v = LiveView("x", console=Console(file=io.StringIO(), width=60))
            >>> v.finish(None).final, "final" in v.console.file.getvalue()
            (True, True)
        """
        if trace is not None:
            self.counter = LiveCounter.from_trace(trace)
        state = self.state(final=True)
        self.console.print(live_panel(state))
        return state
