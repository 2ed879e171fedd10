"""What holds the leaked memory in a ``torchmem run``: the retention paths of leaked storages.

A tracker listener keeps a weak reference to every storage allocated after the first step
marker (so the model, its optimizer state and the first step's buffers are not candidates) and
drops it when the storage is freed. When the summary suspects a leak, the largest storages
still alive are explained with :func:`torchmem.capture.retention.why_alive`, each path ending
with where the storage was allocated. Given the call sites that the trend analysis
(:func:`torchmem.analysis.growth`) found growing, only storages allocated there, from the step
where the growth starts on, are candidates: a gradient replaced every step is not explained as
a leak.

Example:
    >>> import torch, torchmem
    >>> KEPT = []
    >>> watch = LeakWatch()
    >>> with torchmem.track(listeners=[watch.on_event]) as tr:
    ...     for _ in range(4):
    ...         KEPT.append(torch.zeros(256))
    ...         _ = tr.step()
    >>> for leak in watch.explain(1, {"KEPT": KEPT}):
    ...     print(leak.text())
    Leaked 1.00 KiB (allocated in step 1): held by
      KEPT (list) [1] -> Tensor float32[256] 1.00 KiB
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from torchmem.capture.retention import RetentionPath, why_alive
from torchmem.model.events import Event, EventKind
from torchmem.units import format_bytes

__all__ = ["LeakExplanation", "LeakWatch", "explain_largest"]


@dataclass(frozen=True)
class LeakExplanation:
    """One leaked storage: its size, the step that allocated it, where, and what holds it.

    Example:
        >>> LeakExplanation(4096, 2, "train.py:9", [], None).text()
        'Leaked 4.00 KiB (allocated in step 2 at train.py:9): no path found'
    """

    nbytes: int
    step: int
    site: Optional[str]
    paths: list[RetentionPath]
    note: Optional[str]

    def text(self) -> str:
        """Plain lines for the run summary.

        Example:
            >>> p = RetentionPath("train.py global L (list)", ("[0]",), "Tensor float32[4] 16 B")
            >>> print(LeakExplanation(16, 1, None, [p], None).text())
            Leaked 16 B (allocated in step 1): held by
              train.py global L (list) [0] -> Tensor float32[4] 16 B
        """
        where = f" at {self.site}" if self.site else ""
        head = f"Leaked {format_bytes(self.nbytes)} (allocated in step {self.step}{where})"
        if not self.paths:
            return f"{head}: no path found" + (f" ({self.note})" if self.note else "")
        return "\n".join([f"{head}: held by", *(f"  {p}" for p in self.paths)])

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``leak_paths`` in ``torchmem run --json``).

        Example:
            >>> LeakExplanation(8, 1, None, [], "x").to_dict()["paths"]
            []
        """
        return {"nbytes": self.nbytes, "step": self.step, "site": self.site,
                "paths": [str(p) for p in self.paths], "note": self.note}


def _site(event: Event) -> Optional[str]:
    if not event.stack:
        return None
    file, line, *_ = event.stack[-1].rsplit(":", 2) + [""]
    return f"{file.rsplit('/', 1)[-1]}:{line}"


class LeakWatch:
    """A tracker listener that remembers the storages allocated after the first step.

    Example:
        >>> LeakWatch().explain(3, {})
        []
    """

    def __init__(self) -> None:
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], Event]] = {}
        self._last_step = 0

    def on_event(self, event: Event, storage: Optional[torch.UntypedStorage]) -> None:
        """The listener: pass it to ``torchmem.track(listeners=[...])``.

        Example:
            >>> from torchmem.model.events import Event, EventKind
            >>> LeakWatch().on_event(Event(0, EventKind.FREE, 0, "cpu", 4, 1), None)
        """
        if event.kind is EventKind.ALLOC:
            self._last_step = max(self._last_step, event.step)
            if storage is not None and event.step >= 1:
                self._live[event.storage] = (weakref.ref(storage), event)
        elif event.kind is EventKind.FREE:
            self._live.pop(event.storage, None)

    def explain(self, n: int, roots: dict[str, Any], *, sites: Optional[set[str]] = None,
                start_step: int = 0) -> list[LeakExplanation]:
        """Retention paths of the ``n`` largest storages still alive, largest first.

        Storages of the last iteration that allocated anything are left out: they are that
        iteration's state (its gradients, its loss), replaced in the next one, not a leak.
        ``sites`` (innermost frames, ``"file:line:function"``, as
        :class:`~torchmem.analysis.GrowingGroup` names call sites) keeps only storages allocated
        there; ``start_step`` only those allocated in that step or later.

        Example:
            >>> LeakWatch().explain(0, {}, sites={"train.py:9:main"}, start_step=2)
            []
        """
        alive = []
        for ref, event in self._live.values():
            if event.step >= self._last_step or event.step < start_step:
                continue
            if sites is not None and (not event.stack or event.stack[-1] not in sites):
                continue
            s = ref()
            if s is not None:
                alive.append((event, s))
        alive.sort(key=lambda es: (-es[0].nbytes, es[0].seq))
        out = []
        for event, storage in alive[:max(0, n)]:
            site = _site(event)
            found = why_alive(storage, roots=roots, max_paths=3, timeout=30.0, _skip=1)
            paths = [dataclasses.replace(p, target=p.target + (f" (allocated at {site})"
                                                                if site else "")) for p in found]
            out.append(LeakExplanation(event.nbytes, event.step, site, paths, found.note))
        del alive
        return out


def _tensors_of(objs: tuple[Any, ...], live: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for o in objs:
        if isinstance(o, torch.nn.Module):
            out += list(o.parameters()) + list(o.buffers())
            out += [p.grad for p in o.parameters() if p.grad is not None]
        elif isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        elif isinstance(o, torch.Tensor):
            out.append(o)
    if live:
        import gc

        out += [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return out


def explain_largest(objs: tuple[Any, ...], n: int, roots: dict[str, Any], *,
                    live: bool = False) -> list[str]:
    """Text lines: what holds each of the ``n`` largest storages of ``objs`` (a module's
    parameters, buffers and gradients, an optimizer's state, tensors; with ``live`` every live
    tensor), largest first.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> for line in explain_largest((lin,), 1, {"lin (Linear)": lin}):
        ...     print(line)
        Parameter float32[2, 4] 32 B:
          lin (Linear) -> Linear.weight (parameter) -> Parameter float32[2, 4] 32 B
    """
    seen: dict[int, torch.Tensor] = {}
    for t in _tensors_of(objs, live):
        try:
            key = int(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            continue
        seen.setdefault(key, t)
    biggest = sorted(seen.values(), key=lambda t: -int(t.untyped_storage().nbytes()))[:max(0, n)]
    seen.clear()
    lines: list[str] = []
    from torchmem.capture.retention import _describe_target

    for t in biggest:
        found = why_alive(t, roots=roots, max_paths=3, timeout=30.0, _skip=1)
        lines.append(f"{_describe_target(t)}:")
        lines += [f"  {p}" for p in found] or [f"  no path found ({found.note})"]
        if found.stopped:
            lines.append(f"  (search stopped early: {found.stopped})")
    return lines
