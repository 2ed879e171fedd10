"""The results of :func:`torchmem.sim.whatif` and :func:`torchmem.sim.suggest` (plain data).

:class:`RunFigures` (one run's figures on one device), :class:`Suggestion` (one configuration
tried), :class:`DeviceWhatIf` (a device's what-if beside its recorded run) and :class:`WhatIf`;
each has ``to_dict()`` for JSON. Re-exported by :mod:`torchmem.sim.whatif`.

Example:
    >>> f = RunFigures("", 2 << 20, 1 << 20, 1 << 20, {"large": 0, "small": 1 << 20}, 1 << 20, 1, 0, 0, None, 0)
    >>> WhatIf((DeviceWhatIf(0, "cuda:0", "snapshot", f, f, f, True, True, None, None, "empty"),)).to_dict()["devices"][0]["identical"]
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LIMIT", "DeviceWhatIf", "RunFigures", "Suggestion", "WhatIf"]

#: The limit of every what-if, printed with its results.
LIMIT = (
    "a what-if keeps the program's requests fixed (the same sizes, streams and order, and its "
    "empty_cache() calls); it does not know what the program would have done differently"
)


@dataclass(frozen=True)
class RunFigures:
    """One run's figures on one device (the recorded run, or a what-if).

    ``fragmentation_bytes`` is reserved minus allocated at the peak of allocated bytes (reached
    after trace entry ``peak_entry``; -1: the state before the first entry), where
    ``largest_free_block_bytes`` (per pool, ``"large"`` and ``"small"``) and
    ``inactive_split_bytes`` (free blocks of split, non-expandable segments) are taken too.
    ``segment_allocs``/``segment_frees`` count cudaMalloc/cudaFree calls (and expandable pages
    mapped/unmapped). ``oom`` is ``None`` or a dict with ``entry``, ``request_bytes``,
    ``stream`` and ``recorded`` (whether the trace records an OOM there); ``complete`` is false
    when an OOM stopped the run before the trace's end. The three figures of the state at the
    peak are ``None`` where they were not measured (a suggestion's run: that takes a second
    replay up to the peak).

    Example:
        >>> f = RunFigures("", 40 << 20, 9 << 20, 31 << 20, {"large": 11 << 20, "small": 0}, 0, 2, 0, 0, None, 4)
        >>> f.to_dict()["peak_reserved_bytes"], f.key()
        (41943040, (False, 41943040, 2))
    """

    alloc_conf: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation_bytes: int | None
    largest_free_block_bytes: dict[str, int] | None
    inactive_split_bytes: int | None
    segment_allocs: int
    segment_frees: int
    alloc_retries: int
    oom: dict[str, Any] | None
    peak_entry: int
    complete: bool = True

    def key(self) -> tuple[bool, int, int]:
        """The ranking key: an OOM first, then peak reserved bytes, then cudaMalloc calls.

        Example:
            >>> RunFigures("", 5, 0, 0, {}, 0, 3, 0, 0, {"entry": 1}, 0).key()
            (True, 5, 3)
        """
        return (self.oom is not None, self.peak_reserved_bytes, self.segment_allocs)

    def same_as(self, other: RunFigures) -> bool:
        """Whether every figure equals ``other``'s (the OOM by entry and request size).

        Example:
            >>> from dataclasses import replace
            >>> f = RunFigures("", 1, 1, 0, {}, 0, 1, 0, 0, None, 0)
            >>> f.same_as(replace(f, alloc_conf="x")), f.same_as(replace(f, segment_allocs=2))
            (True, False)
        """
        def oom(f: RunFigures) -> tuple[int, int] | None:
            return None if f.oom is None else (f.oom["entry"], f.oom["request_bytes"])

        skip = ("alloc_conf", "oom")
        mine, theirs = asdict(self), asdict(other)
        return all(mine[k] == theirs[k] for k in mine if k not in skip) and oom(self) == oom(other)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the issue's keys first (``peak_reserved_bytes`` ... ``oom``).

        Example:
            >>> list(RunFigures("", 1, 1, 0, {}, 0, 1, 0, 0, None, 0).to_dict())[:6]
            ['peak_reserved_bytes', 'peak_allocated_bytes', 'segment_allocs', 'segment_frees', 'alloc_retries', 'oom']
        """
        d = asdict(self)
        first = ("peak_reserved_bytes", "peak_allocated_bytes", "segment_allocs", "segment_frees",
                 "alloc_retries", "oom")
        return {**{k: d.pop(k) for k in first}, **d}


@dataclass(frozen=True)
class Suggestion:
    """One configuration tried by :func:`suggest`.

    ``alloc_conf`` is the whole ``PYTORCH_CUDA_ALLOC_CONF`` (the recorded settings with
    ``change`` applied); ``figures`` its run (``None`` when it could not be simulated: then
    ``skipped`` says why); ``saved_bytes`` the peak reserved bytes it saves against the recorded
    settings replayed on the same device (negative: it costs that much), ``cost`` what it costs
    in words (cudaMalloc/cudaFree calls, retries, rounding).

    Example:
        >>> s = Suggestion("expandable_segments:True", "expandable_segments:True", None, False, 0, "",
        ...                "needs a capacity")
        >>> s.to_dict()["oom"], s.line
        (None, 'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True')
    """

    alloc_conf: str
    change: str
    figures: RunFigures | None
    avoids_oom: bool
    saved_bytes: int
    cost: str
    skipped: str | None = None

    @property
    def line(self) -> str:
        """The environment line to set.

        Example:
            >>> Suggestion("max_split_size_mb:128", "", None, False, 0, "").line
            'PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128'
        """
        return f"PYTORCH_CUDA_ALLOC_CONF={self.alloc_conf}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``alloc_conf``, ``peak_reserved_bytes``, ``oom``, then the rest.

        Example:
            >>> list(Suggestion("a", "a", None, False, 0, "", "why").to_dict())[:3]
            ['alloc_conf', 'peak_reserved_bytes', 'oom']
        """
        f = self.figures
        d: dict[str, Any] = {
            "alloc_conf": self.alloc_conf,
            "peak_reserved_bytes": None if f is None else f.peak_reserved_bytes,
            "oom": None if f is None else f.oom,
            "change": self.change,
            "avoids_oom": self.avoids_oom,
            "saved_bytes": self.saved_bytes,
            "cost": self.cost,
            "skipped": self.skipped,
        }
        if f is not None:
            d["figures"] = f.to_dict()
        return d


@dataclass(frozen=True)
class DeviceWhatIf:
    """The what-if of one device, side by side with the recorded run.

    ``source`` is ``"snapshot"``, ``"trace"`` (a torchmem trace: ``recorded`` is the default
    settings, simulated) or ``"estimate"``. ``identical`` says whether the what-if equals the
    recorded run in every figure; ``replay_exact`` whether the replay with the recorded settings
    reproduced every decision of the real allocator (``None`` for a torchmem trace).
    ``capacity`` is the simulated device's bytes (``None``: unlimited) and ``capacity_source``
    where it comes from. ``baseline`` is the recorded settings replayed on that device (what
    suggestions are measured against; ``None`` when no suggestion was asked for and the what-if
    ran under other settings). ``recorded_oom_avoided`` is ``None`` without a recorded
    OOM, else whether the what-if avoided the first one.

    Example:
        >>> f = RunFigures("", 1, 1, 0, {}, 0, 1, 0, 0, None, 0)
        >>> d = DeviceWhatIf(0, "cuda:0", "snapshot", f, f, f, True, True, None, None, "empty")
        >>> sorted(d.to_dict())[:4]
        ['capacity_bytes', 'capacity_source', 'device', 'identical']
    """

    device: int
    name: str
    source: str
    recorded: RunFigures
    whatif: RunFigures
    baseline: RunFigures | None
    identical: bool
    replay_exact: bool | None
    capacity: int | None
    capacity_source: str | None
    start: str
    recorded_oom_avoided: bool | None = None
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()
    best: Suggestion | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``device``, ``recorded``, ``whatif`` and the rest (``suggestions`` and
        ``best`` when suggestions were made).

        Example:
            >>> f = RunFigures("", 1, 1, 0, {}, 0, 1, 0, 0, None, 0)
            >>> list(DeviceWhatIf(0, "cuda:0", "snapshot", f, f, f, True, True, None, None, "empty").to_dict())[:3]
            ['device', 'recorded', 'whatif']
        """
        d: dict[str, Any] = {
            "device": self.device,
            "recorded": self.recorded.to_dict(),
            "whatif": self.whatif.to_dict(),
            "name": self.name,
            "source": self.source,
            "identical": self.identical,
            "replay_exact": self.replay_exact,
            "recorded_oom_avoided": self.recorded_oom_avoided,
            "capacity_bytes": self.capacity,
            "capacity_source": self.capacity_source,
            "start": self.start,
            "notes": list(self.notes),
        }
        if self.suggestions:
            d["baseline"] = None if self.baseline is None else self.baseline.to_dict()
            d["suggestions"] = [s.to_dict() for s in self.suggestions]
            d["best"] = None if self.best is None else self.best.to_dict()
        return d


@dataclass(frozen=True)
class WhatIf:
    """The result of :func:`whatif` or :func:`suggest`: one :class:`DeviceWhatIf` per device.

    Example:
        >>> WhatIf(()).to_dict()
        {'devices': [], 'limit': "a what-if keeps the program's requests fixed (the same sizes, streams and order, and its empty_cache() calls); it does not know what the program would have done differently"}
    """

    devices: tuple[DeviceWhatIf, ...]
    limit: str = LIMIT

    def to_dict(self) -> dict[str, Any]:
        """``{"devices": [...], "limit": ...}``.

        Example:
            >>> list(WhatIf(()).to_dict())
            ['devices', 'limit']
        """
        return {"devices": [d.to_dict() for d in self.devices], "limit": self.limit}


