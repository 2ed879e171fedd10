"""The per-step memory meter both trainer callbacks share.

A :func:`torchmem.track` tracker runs for the whole training (given the model and optimizer, so
their parameters, gradients and state count from the start) with a listener that keeps, per
device, the live bytes, the step's peak and the peak of each phase (forward, backward,
optimizer, other) in O(1) per event. The tracker keeps its events (compactly, column-wise) so
that an out-of-memory error can be dumped as a trace of the whole run.

Peaks are read without disturbing anyone else's: PyTorch's ``reset_peak_memory_stats`` is never
called (it would restart ``max_memory_allocated`` for every reader in the process).

- The tensor peak (every device; the one figure on CPU) is this meter's own counter, restarted
  at each step start at the bytes live then.
- On CUDA, the allocator's peak of the step is *followed*
  (:class:`~torchmem.integrations._allocator.AllocatorFollower`): ``memory_allocated()`` read at
  the step's start, plus each storage the tracker sees allocated, rounded as the allocator rounds
  it, minus each one freed; checked against ``memory_allocated()`` at the step's end, the
  difference logged as ``allocator_unseen_bytes`` (library workspaces and the slack of reused
  blocks, which no tensor shows). The allocator's running peak
  (``torch.cuda.max_memory_allocated``, never reset) is logged beside it.

Under DDP (``torch.distributed`` initialised), each figure is the maximum across ranks, matched
by name (one gather of a small dict per step, :func:`torchmem._distributed.gather_dicts`; rank
r's ``cuda:r`` figures are the unprefixed ones on every rank).

Example:
    >>> import torch
    >>> from torchmem.integrations._meter import StepMeter
    >>> net = torch.nn.Linear(256, 256)       # 256 KiB + 1 KiB of parameters
    >>> meter = StepMeter(net).start()
    >>> meter.begin_step()
    >>> y = net(torch.ones(64, 256)); del y  # input 64 KiB, output 64 KiB
    >>> peaks = meter.end_step(); meter.stop()
    >>> peaks.peak["cpu"] - peaks.live_at_start["cpu"] == 2 * 65536
    True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from torchmem._distributed import gather_dicts
from torchmem.errors import InvalidInputError
from torchmem.integrations._allocator import AllocatorFollower
from torchmem.model.events import Event, EventKind

__all__ = ["StepMeter", "StepPeaks", "check_min_version", "oom_path"]


@dataclass
class StepPeaks:
    """One step's figures per device (bytes): live at the start, peak, peak per phase; on CUDA
    also the allocator's step peak, the bytes it holds that no tensor showed, and its running
    peak (see the module docstring).

    Example:
        >>> StepPeaks({"cpu": 10}, {"cpu": 30}, {"forward": {"cpu": 30}}).metrics()
        {'memory/peak_bytes': 30, 'memory/live_at_start_bytes': 10, 'memory/forward_peak_bytes': 30}
    """

    live_at_start: dict[str, int]
    peak: dict[str, int]
    by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    allocator_peak: dict[str, int] = field(default_factory=dict)
    allocator_step_peak: dict[str, int] = field(default_factory=dict)
    allocator_unseen: dict[str, int] = field(default_factory=dict)

    def _slots(self) -> list[tuple[str, dict[str, int]]]:
        """(metric name, per-device dict) for every figure, in the order metrics() lists them."""
        slots: list[tuple[str, dict[str, int]]] = [
            ("peak_bytes", self.peak), ("live_at_start_bytes", self.live_at_start)
        ]
        slots += [(f"{phase}_peak_bytes", per_dev) for phase, per_dev in self.by_phase.items()]
        return slots + [
            ("allocator_peak_bytes", self.allocator_step_peak),
            ("allocator_unseen_bytes", self.allocator_unseen),
            ("allocator_peak_so_far_bytes", self.allocator_peak),
        ]

    def _cells(self, prefix: str) -> list[tuple[str, dict[str, int], str]]:
        """(metric key, per-device dict, device) for every figure metrics() lists, in order."""
        cells = []
        slots = self._slots()
        devices = sorted(self.peak, key=lambda d: not d.startswith("cuda"))  # stable
        for i, dev in enumerate(devices):
            p = prefix if i == 0 else f"{prefix}{dev}/"
            for name, per_dev in slots:
                if dev in per_dev or name == "live_at_start_bytes":
                    cells.append((f"{p}{name}", per_dev, dev))
        return cells

    def metrics(self, prefix: str = "memory/") -> dict[str, int]:
        """Flat names for a logger; a device other than the first is named in the key (CUDA
        devices come first, so on a GPU run the unnamed figures are the GPU's).

        Example:
            >>> StepPeaks({"cpu": 1, "cuda:0": 5}, {"cpu": 2, "cuda:0": 9}).metrics()
            {'memory/peak_bytes': 9, 'memory/live_at_start_bytes': 5, 'memory/cpu/peak_bytes': 2, 'memory/cpu/live_at_start_bytes': 1}
            >>> StepPeaks({"cuda:0": 0}, {"cuda:0": 9}, allocator_step_peak={"cuda:0": 1024},
            ...           allocator_unseen={"cuda:0": 0}).metrics()["memory/allocator_peak_bytes"]
            1024
        """
        return {key: per_dev.get(dev, 0) for key, per_dev, dev in self._cells(prefix)}


def check_min_version(
    label: str, dist: str, version: str, minimum: tuple[int, ...], supported: str
) -> None:
    """Raise a clear error when ``version`` of a trainer (its first ``len(minimum)`` numeric
    components) is below ``minimum``; ``supported`` is the requirement as users read it.

    Example:
        >>> check_min_version("Lightning", "lightning", "2.6.6", (2,), ">=2.0")
        >>> check_min_version("transformers", "transformers", "4.3", (4, 40), ">=4.40")
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: torchmem's transformers MemoryCallback supports transformers >=4.40; this is '4.3'. Fix: pip install 'transformers>=4.40' (or torchmem[transformers])
    """
    try:
        got = tuple(int(p) for p in str(version).split(".")[: len(minimum)])
    except ValueError:
        got = ()
    if len(got) < len(minimum) or got < minimum:
        raise InvalidInputError(
            f"torchmem's {label} MemoryCallback supports {label} {supported}; this is "
            f"{version!r}. Fix: pip install '{dist}{supported}' (or torchmem[{dist}])"
        )


def oom_path(directory: str, step: int) -> str:
    """Where an out-of-memory dump of this rank goes: ``<dir>/torchmem-oom-rank<r>-step<s>.tmtrace``.

    Example:
        >>> oom_path("/tmp", 3).endswith("torchmem-oom-rank0-step3.tmtrace")
        True
    """
    rank = 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0") or 0)
    return os.path.join(directory, f"torchmem-oom-rank{rank}-step{step}.tmtrace")


class StepMeter:
    """Per-step peaks of the tensors of a training run (see the module docstring).

    ``follower`` follows the CUDA allocator's step peak (default: one reading
    ``torch.cuda.memory_allocated``; tests pass one reading a simulated allocator).

    Example:
        >>> m = StepMeter().start(); m.begin_step(); _ = m.end_step(); m.stop()
        >>> m.steps
        1
    """

    def __init__(self, *objects: Any, follower: Optional[AllocatorFollower] = None) -> None:
        from torchmem.capture.tracker import track

        self.follower = follower if follower is not None else AllocatorFollower()
        self._in_step = False
        self.live: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._phase_peak: dict[tuple[str, str], int] = {}
        self._start: dict[str, int] = {}
        self.steps = 0
        self.tracker = track(*objects, stacks=False, step_marker="manual",
                             listeners=[self.on_event])
        self._active = False

    def on_event(self, event: Event, storage: Optional[torch.UntypedStorage] = None) -> None:
        """The tracker's listener: one allocation, free or marker.

        Example:
            >>> from torchmem.model.events import Event, EventKind
            >>> m = StepMeter(); m.begin_step()
            >>> m.on_event(Event(0, EventKind.ALLOC, 0, "cpu", 100, 1)); m.end_step().peak
            {'cpu': 100}
        """
        kind = event.kind
        if kind is EventKind.MARK:
            return
        dev = event.device
        alloc = kind is EventKind.ALLOC
        if self._in_step and dev.startswith("cuda"):
            if alloc:
                self.follower.alloc(dev, event.nbytes)
            else:
                self.follower.free(dev, event.nbytes)
        now = self.live.get(dev, 0) + (event.nbytes if alloc else -event.nbytes)
        self.live[dev] = now
        if now > self._peak.get(dev, 0):
            self._peak[dev] = now
        key = (dev, event.phase.label)
        if now > self._phase_peak.get(key, -1):
            self._phase_peak[key] = now

    def start(self) -> StepMeter:
        """Start the tracker (training begins).

        Example:
            >>> StepMeter().start().stop()
        """
        if not self._active:
            self.tracker.__enter__()
            self._active = True
        return self

    def stop(self) -> None:
        """Stop the tracker (training ended or failed).

        Example:
            >>> StepMeter().stop()
        """
        if self._active:
            self._active = False
            self.tracker.__exit__(None, None, None)

    def fail(self, exc: BaseException, folder: Optional[str], step: int) -> Optional[str]:
        """Stop after ``exc`` ended training; on an out-of-memory error write the run's trace
        to :func:`oom_path` in ``folder`` (default: the working directory) and return its path.

        Example:
            >>> import tempfile
            >>> m = StepMeter().start()
            >>> m.fail(ValueError("not memory"), None, 0) is None
            True
            >>> StepMeter().start().fail(MemoryError(), tempfile.mkdtemp(), 3).endswith("step3.tmtrace")
            True
        """
        from torchmem.capture.recording import is_oom_error

        self.stop()
        if not is_oom_error(exc):
            return None
        folder = folder or os.getcwd()
        os.makedirs(folder, exist_ok=True)
        path = oom_path(folder, step)
        self.tracker.save(path)
        return path

    def begin_step(self) -> None:
        """Reset this meter's step counters to the bytes live now.

        Example:
            >>> m = StepMeter(); m.begin_step(); m.end_step().peak
            {}
        """
        self._start = dict(self.live)
        self._peak = dict(self.live)
        self._phase_peak = {}
        cuda = {d for d in self.live if d.startswith("cuda")}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda.add(f"cuda:{torch.cuda.current_device()}")
        self.follower.begin(sorted(cuda))
        self._in_step = True

    def end_step(self) -> StepPeaks:
        """The step's figures (max across ranks under DDP); adds a step marker to the trace.

        Example:
            >>> m = StepMeter(); m.begin_step(); m.end_step().live_at_start
            {}
        """
        by_phase: dict[str, dict[str, int]] = {}
        for (dev, phase), value in self._phase_peak.items():
            by_phase.setdefault(phase, {})[dev] = value
        self._in_step = False
        followed = self.follower.end()
        so_far: dict[str, int] = {}
        for dev in followed:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                so_far[dev] = int(torch.cuda.max_memory_allocated(torch.device(dev)))
        peak = dict(self._peak)
        for dev in followed:  # a device only the allocator saw still gets a row
            peak.setdefault(dev, 0)
        peaks = StepPeaks(dict(self._start), peak, by_phase, so_far,
                          {d: s.peak for d, s in followed.items()},
                          {d: s.unseen for d, s in followed.items()})
        self.steps += 1
        self.tracker.mark("step")
        return _max_across_ranks(peaks)


def _max_across_ranks(peaks: StepPeaks) -> StepPeaks:
    """Each figure set to its maximum over the ranks, matched by metric name: every rank's GPU
    figures are the unprefixed ones (rank r's ``cuda:r``), and a rank that saw a phase or a
    device the others did not still takes part (a gather of each rank's dict, not a fixed-length
    ``all_reduce``, which would hang on such a mismatch)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return peaks
    cells = peaks._cells("memory/")
    gathered = gather_dicts({key: per_dev.get(dev, 0) for key, per_dev, dev in cells})
    merged: dict[str, int] = {}
    for figures in gathered:
        for key, value in figures.items():
            merged[key] = max(merged.get(key, value), value)
    for key, per_dev, dev in cells:
        per_dev[dev] = merged[key]
    return peaks
