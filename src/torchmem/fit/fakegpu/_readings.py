"""The script's own CUDA memory readings during an estimate: the simulated GPU's.

A training script often measures itself: ``torch.cuda.reset_peak_memory_stats()`` at the start
of a phase, ``torch.cuda.max_memory_allocated()`` at its end, ``memory_stats()``,
``memory_summary()``, ``mem_get_info()``, or a memory snapshot with
``torch.cuda.memory._record_memory_history()`` and ``torch.cuda.memory._snapshot()``. Under
:func:`torchmem.estimate` there is no GPU; :class:`SimReadings` answers each of these from the
simulated caching allocator (:class:`~torchmem.sim.CachingAllocator`) the estimate runs, so the
script prints what the GPU would have printed:

- ``memory_allocated`` / ``memory_reserved`` are the simulator's current allocated (rounded
  blocks) and reserved (segments) bytes; ``max_memory_allocated`` / ``max_memory_reserved``
  its peaks since the last ``reset_peak_memory_stats()``, which (as PyTorch's allocator does)
  sets every peak to the current value;
- ``memory_stats()`` has PyTorch's key names for what the simulator tracks (``*.all.*`` of
  ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``, ``requested_bytes``;
  ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``, ``num_device_free``, ...);
  ``reset_accumulated_memory_stats()`` restarts the ``allocated`` / ``freed`` totals and the
  ``num_*`` counts; per-pool figures are not kept;
- ``mem_get_info()`` is the device's memory less the CUDA context and the reserved bytes;
- ``_record_memory_history(enabled="all")`` starts a trace (``enabled=None`` stops it and drops
  it, ``clear_history=True`` drops what was recorded so far, ``max_entries`` keeps the newest
  entries); ``_snapshot()`` gives PyTorch's snapshot dict from the simulator's segments and
  the trace recorded since (``time_us`` is the simulator's event index), and so
  ``_dump_snapshot(path)`` and ``memory_snapshot()`` work too.

:meth:`SimReadings.patches` gives the functions :func:`torchmem.fit.fakegpu._env.fake_cuda` installs in
``torch.cuda`` and ``torch.cuda.memory``.

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> sim = CachingAllocator(80 << 30)
    >>> r = SimReadings(sim, total_bytes=80 << 30)
    >>> p = sim.malloc(3 << 20); sim.free(p); q = sim.malloc(1 << 20)
    >>> r.max_memory_allocated() >> 20, r.memory_allocated() >> 20
    (3, 1)
    >>> r.reset_peak_memory_stats(); r.max_memory_allocated() >> 20
    1
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torchmem.sim import CachingAllocator

__all__ = ["SimReadings"]

#: ``memory_stats`` keys that ``reset_accumulated_memory_stats`` sets back to zero.
_ACCUMULATED = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
_METRICS = (
    ("allocated_bytes", "Allocated memory"),
    ("active_bytes", "Active memory"),
    ("requested_bytes", "Requested memory"),
    ("reserved_bytes", "GPU reserved memory"),
)


def _format_size(sz: int, pref_sz: float) -> str:
    """PyTorch's ``memory_summary`` size column."""
    prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_sz < 768 * 1024:
            break
        prefix = new_prefix
        sz //= 1024
        pref_sz /= 1024
    return f"{sz:6d} {prefix}"


class SimReadings:
    """``torch.cuda``'s memory readings answered from a simulated caching allocator.

    ``sim`` is the estimate's :class:`~torchmem.sim.CachingAllocator`; ``total_bytes`` the
    device's memory (``mem_get_info()[1]``), ``context_bytes`` what the CUDA context holds
    outside the allocator. ``on_record(True/False)`` is called when a memory history starts or
    stops recording call stacks (the estimate then passes stacks to the simulator).

    Example:
        >>> from torchmem.sim import CachingAllocator
        >>> sim = CachingAllocator(1 << 30)
        >>> r = SimReadings(sim, total_bytes=1 << 30, context_bytes=100 << 20)
        >>> p = sim.malloc(1000)
        >>> r.memory_stats()["requested_bytes.all.current"], r.mem_get_info()[0] >> 20
        (1000, 922)
    """

    def __init__(
        self,
        sim: CachingAllocator,
        *,
        total_bytes: int = 0,
        context_bytes: int = 0,
        on_record: Callable[[bool], None] | None = None,
    ) -> None:
        self.sim = sim
        self.total_bytes = total_bytes
        self.context_bytes = context_bytes
        self._on_record = on_record
        #: index in ``sim.events`` where the recorded trace starts; ``None`` when none is kept
        self._trace_start: int | None = None
        self._trace_on = False
        self._max_entries = sys.maxsize
        self._base: dict[str, int] = {}
        self._fraction: float | None = None  # set by the program's set_per_process_memory_fraction

    # -- counters ------------------------------------------------------------------------------

    def memory_allocated(self, device: Any = None) -> int:
        """``torch.cuda.memory_allocated()``: bytes of allocated blocks now.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); _ = sim.malloc(100)
            >>> r.memory_allocated()
            512
        """
        return int(self.sim.allocated_bytes)

    def memory_reserved(self, device: Any = None) -> int:
        """``torch.cuda.memory_reserved()``: bytes of segments now.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); _ = sim.malloc(100)
            >>> r.memory_reserved()
            2097152
        """
        return int(self.sim.reserved_bytes)

    def max_memory_allocated(self, device: Any = None) -> int:
        """``torch.cuda.max_memory_allocated()``: the peak of :meth:`memory_allocated` since the
        start or the last :meth:`reset_peak_memory_stats`.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); sim.free(sim.malloc(4096))
            >>> r.max_memory_allocated(), r.memory_allocated()
            (4096, 0)
        """
        return int(self.sim.max_allocated_bytes)

    def max_memory_reserved(self, device: Any = None) -> int:
        """``torch.cuda.max_memory_reserved()``: the peak of :meth:`memory_reserved` since the
        start or the last :meth:`reset_peak_memory_stats`.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); sim.free(sim.malloc(30 << 20))
            >>> sim.empty_cache(); r.max_memory_reserved() >> 20, r.memory_reserved()
            (30, 0)
        """
        return int(self.sim.max_reserved_bytes)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak (allocated, reserved, active,
        requested) becomes the current value, as in PyTorch's allocator.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim)
            >>> p = sim.malloc(8192); sim.free(sim.malloc(4096))
            >>> r.reset_peak_memory_stats(); r.max_memory_allocated()
            8192
        """
        self.sim.reset_peak()

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: the ``allocated`` / ``freed`` totals
        and the ``num_*`` counts of :meth:`memory_stats` start again from zero.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); sim.free(sim.malloc(512))
            >>> r.reset_accumulated_memory_stats(); s = r.memory_stats()
            >>> s["allocated_bytes.all.allocated"], s["num_device_alloc"]
            (0, 0)
        """
        stats = self.sim.memory_stats()
        self._base = {
            k: v for k, v in stats.items()
            if k.endswith((".allocated", ".freed")) or k in _ACCUMULATED
        }

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: PyTorch's flat key names (sorted, as PyTorch returns
        them) for what the simulator tracks; see
        :meth:`torchmem.sim.CachingAllocator.memory_stats`.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); p = sim.malloc(1000)
            >>> s = r.memory_stats()
            >>> s["allocated_bytes.all.peak"], s["active_bytes.all.peak"], s["num_device_alloc"]
            (1024, 1024, 1)
        """
        stats = self.sim.memory_stats()
        for k, v in self._base.items():
            stats[k] -= v
        stats["num_sync_all_streams"] = 0
        return dict(sorted(stats.items()))

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict()``: :meth:`memory_stats` split on dots.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); p = sim.malloc(1000)
            >>> r.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"]
            1024
        """
        out: dict[str, Any] = {}
        for key, value in self.memory_stats().items():
            *path, last = key.split(".")
            d = out
            for part in path:
                d = d.setdefault(part, {})
            d[last] = value
        return out

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        """``torch.cuda.memory_summary()``: PyTorch's table for the figures the simulator keeps
        (all pools together), headed as a simulation.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); p = sim.malloc(3 << 20)
            >>> [ln for ln in r.memory_summary().splitlines() if "Allocated" in ln]
            ['| Allocated memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   |']
        """
        s = self.memory_stats()
        lines = ["=" * 75,
                 f" {'':16} PyTorch CUDA memory summary, device ID {0:<17d} ",
                 f" {'':13} (simulated by torchmem: no GPU ran this) {'':20}",
                 "-" * 75,
                 f"  {'':9} CUDA OOMs: {s['num_ooms']:<12d} | {'':6} cudaMalloc retries: "
                 f"{s['num_alloc_retries']:<8d}  ",
                 "=" * 75,
                 "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
        for key, name in _METRICS:
            p = key + ".all."
            cur = s[p + "current"]
            lines.append("-" * 75)
            lines.append(
                f" {name:<21} | {_format_size(cur, cur)} | {_format_size(s[p + 'peak'], s[p + 'peak'])} | "
                f"{_format_size(s[p + 'allocated'], s[p + 'allocated'])} | "
                f"{_format_size(s[p + 'freed'], s[p + 'freed'])} "
            )
        lines.append("-" * 75)
        seg = s["segment.all.current"]
        lines.append(f" {'GPU reserved segments':<21} | {seg:7d}   | {'':10} | {'':10} | {'':10} ")
        lines.append("=" * 75)
        return "|" + "|\n|".join(lines) + "|\n"

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """``torch.cuda.mem_get_info()``: ``(free, total)`` bytes of the device, free being the
        total less the CUDA context and the reserved bytes.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim, total_bytes=1 << 30)
            >>> _ = sim.malloc(100); r.mem_get_info() == ((1 << 30) - (2 << 20), 1 << 30)
            True
        """
        free = max(0, self.total_bytes - self.context_bytes - self.sim.reserved_bytes)
        return free, self.total_bytes

    def set_per_process_memory_fraction(self, fraction: Any, device: Any = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction)``: the simulated allocator's
        segments fit within ``fraction`` x the device's whole memory from now on (the CUDA
        context not counted, as in PyTorch); the same errors as PyTorch's for a bad value.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(900 << 20); r = SimReadings(sim, total_bytes=1 << 30)
            >>> r.set_per_process_memory_fraction(0.5); sim.allowed_bytes >> 20
            512
            >>> r.get_per_process_memory_fraction()
            0.5
        """
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.sim.set_memory_fraction(fraction, self.total_bytes or None)
        self._fraction = fraction

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        """``torch.cuda.get_per_process_memory_fraction()``: the last fraction set (by the
        program or ``per_process_memory_fraction`` in the allocator settings), else 1.0.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> SimReadings(CachingAllocator()).get_per_process_memory_fraction()
            1.0
        """
        fraction = self._fraction
        if fraction is None:
            fraction = self.sim.config.per_process_memory_fraction
        return 1.0 if fraction is None else float(fraction)

    # -- memory history ------------------------------------------------------------------------

    def record_memory_history(
        self,
        enabled: str | bool | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``torch.cuda.memory._record_memory_history()``: ``enabled="all"`` records the trace
        from now on (keeping what was recorded while it was already on), ``"state"`` only the
        call stacks of live blocks, ``None`` stops and drops the trace; ``clear_history`` drops
        it too; ``max_entries`` keeps the newest entries. ``context=None`` records no stacks.
        The legacy form (``enabled`` a bool, ``trace_alloc_max_entries``) works as in PyTorch.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); _ = sim.malloc(100)
            >>> r.record_memory_history(max_entries=2); p = sim.malloc(100); sim.free(p)
            >>> [e["action"] for e in r.snapshot()["device_traces"][0]]
            ['free_requested', 'free_completed']
        """
        if isinstance(enabled, bool):  # _record_memory_history_legacy
            record_context = args[0] if args else kwargs.get("record_context", True)
            max_entries = kwargs.get("trace_alloc_max_entries", 1)
            clear_history = bool(kwargs.get("clear_history", False))
            context = "all" if record_context else None
            enabled = "all" if enabled else None
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
        if context not in (None, "state", "alloc", "all"):
            raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
        n = len(self.sim.events)
        if enabled == "all":
            if self._trace_start is None or clear_history:
                self._trace_start = n
        else:
            self._trace_start = None
        self._trace_on = enabled == "all"
        self._max_entries = max(0, int(max_entries))
        if self._on_record is not None:
            self._on_record(enabled is not None and context is not None)

    def snapshot(self, device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: PyTorch's snapshot dict (``segments``,
        ``device_traces``, ``allocator_settings``) of the simulator's state now and the trace
        recorded since :meth:`record_memory_history` started it (empty when it is off).

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); r.record_memory_history()
            >>> p = sim.malloc(100); s = r.snapshot()
            >>> s["segments"][0]["blocks"][0]["state"], [e["action"] for e in s["device_traces"][0]]
            ('active_allocated', ['segment_alloc', 'alloc'])
        """
        from torchmem.io.pytorch_snapshot import to_pytorch_dict

        n = len(self.sim.events)
        if self._trace_start is None:
            since = n
        else:
            since = max(self._trace_start, n - self._max_entries)
        return to_pytorch_dict(self.sim.snapshot(since=since))

    def memory_snapshot(self, device: Any = None) -> list[dict[str, Any]]:
        """``torch.cuda.memory_snapshot()``: the segments of :meth:`snapshot`.

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> sim = CachingAllocator(); r = SimReadings(sim); p = sim.malloc(100)
            >>> r.memory_snapshot()[0]["total_size"]
            2097152
        """
        segments: list[dict[str, Any]] = self.snapshot()["segments"]
        return segments

    # -- installation --------------------------------------------------------------------------

    def patches(self) -> dict[str, Callable[..., Any]]:
        """The functions to install, by name, in ``torch.cuda`` and ``torch.cuda.memory`` (a
        name absent from a module is skipped there).

        Example:
            >>> from torchmem.sim import CachingAllocator
            >>> p = SimReadings(CachingAllocator()).patches()
            >>> p["max_memory_allocated"](), sorted(p)[:2]
            (0, ['_record_memory_history', '_snapshot'])
        """
        return {
            "memory_allocated": self.memory_allocated,
            "memory_reserved": self.memory_reserved,
            "memory_cached": self.memory_reserved,
            "max_memory_allocated": self.max_memory_allocated,
            "max_memory_reserved": self.max_memory_reserved,
            "max_memory_cached": self.max_memory_reserved,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "reset_max_memory_allocated": self.reset_peak_memory_stats,
            "reset_max_memory_cached": self.reset_peak_memory_stats,
            "reset_accumulated_memory_stats": self.reset_accumulated_memory_stats,
            "memory_stats": self.memory_stats,
            "memory_stats_as_nested_dict": self.memory_stats_as_nested_dict,
            "memory_summary": self.memory_summary,
            "mem_get_info": self.mem_get_info,
            "set_per_process_memory_fraction": self.set_per_process_memory_fraction,
            "get_per_process_memory_fraction": self.get_per_process_memory_fraction,
            "memory_snapshot": self.memory_snapshot,
            "_record_memory_history": self.record_memory_history,
            "_snapshot": self.snapshot,
        }
