"""Low-overhead capture: allocator-level memory events from PyTorch's profiler, no Python per op.

:func:`track_lite` runs the block under ``torch.profiler.profile(profile_memory=True)``: the
allocator reports every allocation and free (pointer, size, device) from C++, with the
operator it happened in, and nothing runs in Python per operator. When the block ends, the
profiler's event tree is converted into the same event stream as :func:`torchmem.track`
(ALLOC/FREE events paired by pointer, the outermost ``aten::`` operator, the phase from the
profiler's ``autograd::engine::evaluate_function`` and ``Optimizer.step#`` ranges, a step marker
after each optimizer step).

What it does not give, compared with :func:`torchmem.track`: no module attribution, no
forward phase (operators outside backward and optimizer steps are phase "other"), categories
only "temporary" (freed within the operator/phase region it was allocated in) and "other", no
Python stacks, listeners are called when the block ends rather than as events happen, and
memory allocated before the block and freed inside it is not seen. The conversion at the end
costs time proportional to the number of profiler events.

Example:
    >>> import torch, torchmem
    >>> with torchmem.track_lite() as tr:
    ...     a = torch.ones(1000); b = a + a; del a
    >>> tr.peak()
    {'cpu': 8000}
    >>> [(e.kind.label, e.op, e.nbytes) for e in tr.events()]
    [('alloc', 'aten::ones', 4000), ('alloc', 'aten::add', 4000), ('free', None, 4000)]
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from torchmem._device import device_name
from torchmem.capture._quiet import quiet_profiler
from torchmem.capture.tracker import Listener
from torchmem.errors import InvalidInputError
from torchmem.io.tmtrace import PathLike, save_trace
from torchmem.model.events import Category, Event, EventKind, Phase
from torchmem.model.trace import Trace

__all__ = ["track_lite", "LiteTracker"]

_BW_PREFIX = "autograd::engine::evaluate_function"
_OPT_PREFIX = "Optimizer.step#"


class LiteTracker:
    """Result of :func:`track_lite`; the read API of :class:`~torchmem.Tracker`.

    Example:
        >>> import torchmem
        >>> with torchmem.track_lite() as tr:
        ...     pass
        >>> len(tr), tr.peak()
        (0, {})
    """

    def __init__(self, listeners: Iterable[Listener] = (), metadata: dict[str, Any] | None = None):
        self.trace = Trace(
            {"producer": "torchmem.track_lite", "torch_version": torch.__version__, **(metadata or {})}
        )
        self._listeners = list(listeners)
        self._prof: Any = None
        self._used = False
        self.convert_seconds = 0.0

    def __enter__(self) -> LiteTracker:
        if self._used:
            raise InvalidInputError("this tracker was already used; call track_lite() again")
        self._used = True
        if torch.autograd._profiler_enabled():
            # a second profiler session takes over the running one: the outer session (an
            # enclosing track_lite or the user's own torch.profiler) would silently lose events
            raise InvalidInputError(
                "track_lite() cannot start while another PyTorch profiler is running (an "
                "enclosing track_lite() or torch.profiler.profile()); end that one first, or use "
                "torchmem.track(), which nests"
            )
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, profile_memory=True)
        with quiet_profiler():  # the profiler's "profiler_start" line is not the user's business
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        with quiet_profiler():
            prof.__exit__(None, None, None)
        t0 = time.perf_counter()
        self._convert(prof)
        self.convert_seconds = time.perf_counter() - t0
        for seq in range(len(self.trace)):
            ev = self.trace.event(seq)
            for fn in self._listeners:
                fn(ev, None)

    def _convert(self, prof: Any) -> None:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
        rows: list[tuple[int, int, int, str, str | None, int]] = []  # time, size, ptr, dev, op, phase
        steps: list[int] = []
        # iterative DFS carrying (outermost aten op, phase)
        stack: list[tuple[Any, str | None, int]] = [(e, None, int(Phase.OTHER)) for e in roots]
        while stack:
            e, op, phase = stack.pop()
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                dev = device_name(f.device)
                rows.append((e.start_time_ns, int(f.alloc_size), int(f.ptr), dev, op, phase))
                continue
            name = e.name
            if name.startswith(_BW_PREFIX):
                phase = int(Phase.BACKWARD)
                op = None
            elif name.startswith(_OPT_PREFIX):
                phase = int(Phase.OPTIMIZER)
                steps.append(e.end_time_ns)
                op = None
            elif op is None and name.startswith("aten::"):
                op = name
            for c in e.children:
                stack.append((c, op, phase))
        rows.sort(key=lambda r: r[0])
        steps.sort()
        start = min([r[0] for r in rows[:1]] + steps[:1] or [0])
        tr = self.trace
        live: dict[tuple[str, int], tuple[int, int, int]] = {}  # (dev, ptr) -> seq, size, region
        si = 0
        step = 0
        region = 0
        last_phase = -1
        for when, size, ptr, dev, op, phase in rows:
            while si < len(steps) and steps[si] <= when:
                tr.append(EventKind.MARK, steps[si] - start, dev, 0, 0, op="step", step=step)
                step += 1
                si += 1
                region += 1
            if phase != last_phase:
                region += 1
                last_phase = phase
            if size > 0:
                seq = len(tr)
                live[(dev, ptr)] = (seq, size, region)
                tr.append(EventKind.ALLOC, when - start, dev, size, seq + 1, op=op, phase=phase,
                          category=Category.OTHER, step=step)
            elif size < 0:
                hit = live.pop((dev, ptr), None)
                if hit is None:  # allocated before the block
                    continue
                aseq, asize, aregion = hit
                cat = Category.TEMPORARY if aregion == region else Category(tr.category[aseq])
                if cat is Category.TEMPORARY:
                    tr.set_category(aseq, cat)
                tr.append(EventKind.FREE, when - start, dev, asize, aseq + 1, op=op, phase=phase,
                          category=cat, step=step)
        dev0 = tr.devices[0] if tr.devices else "cpu"
        while si < len(steps):
            tr.append(EventKind.MARK, steps[si] - start, dev0, 0, 0, op="step", step=step)
            step += 1
            si += 1

    # read API (same names as Tracker)
    def events(self) -> Iterator[Event]:
        """Events in sequence order (available after the block).

        Example:
            >>> import torchmem
            >>> list(torchmem.capture.LiteTracker().events())
            []
        """
        return self.trace.events()

    def peak(self) -> dict[str, int]:
        """Peak live bytes per device (after the block).

        Example:
            >>> import torchmem
            >>> torchmem.capture.LiteTracker().peak()
            {}
        """
        return self.trace.peak()

    def live_bytes(self, device: str | None = None) -> Any:
        """Live bytes at the end of the block, per device or for one device.

        Example:
            >>> import torchmem
            >>> torchmem.capture.LiteTracker().live_bytes("cpu")
            0
        """
        return self.trace.live_bytes(device)

    def save(self, path: PathLike) -> None:
        """Write a ``.tmtrace`` file.

        Example:
            >>> import torchmem, tempfile, os
            >>> p = os.path.join(tempfile.mkdtemp(), "l.tmtrace"); torchmem.capture.LiteTracker().save(p)
        """
        save_trace(self.trace, path)

    def __len__(self) -> int:
        return len(self.trace)


def track_lite(
    listeners: Iterable[Listener] = (), metadata: dict[str, Any] | None = None
) -> LiteTracker:
    """Low-overhead tracking through the profiler's allocator events (see the module docs).

    Example:
        >>> import torch, torchmem
        >>> lin = torch.nn.Linear(16, 16); opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        >>> with torchmem.track_lite() as tr:
        ...     lin(torch.randn(4, 16)).sum().backward(); opt.step()
        >>> sorted({e.phase.label for e in tr.events()}), [e.op for e in tr.events() if e.kind.label == "mark"]
        (['backward', 'other'], ['step'])
    """
    return LiteTracker(listeners=listeners, metadata=metadata)
