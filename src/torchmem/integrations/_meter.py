"""The per-step memory meter both trainer callbacks share.

A :func:`torchmem.track` tracker runs for the whole training (given the model and optimizer, so
their parameters, gradients and state count from the start) with a listener that keeps, per
device, the live bytes, the step's peak and the peak of each phase (forward, backward,
optimizer, other) in O(1) per event. The tracker keeps its events (compactly, column-wise) so
that an out-of-memory error can be dumped as a trace of the whole run.

Peak counters: the step peak is this meter's own counter, reset at each step start to the
bytes live then. PyTorch's ``max_memory_allocated`` / ``reset_peak_memory_stats`` are never
called to reset anything, so other readers of the allocator's peak see it undisturbed; on
CUDA the allocator's running peak (``torch.cuda.max_memory_allocated``, never reset) is logged
beside the step peak.

Under DDP (``torch.distributed`` initialised), each figure is the maximum across ranks
(one ``all_reduce(MAX)`` per step).

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

from torchmem.errors import InvalidInputError
from torchmem.model.events import Event, EventKind

__all__ = ["StepMeter", "StepPeaks", "check_min_version", "oom_path"]


@dataclass
class StepPeaks:
    """One step's figures per device (bytes): live at the start, peak, peak per phase.

    Example:
        >>> StepPeaks({"cpu": 10}, {"cpu": 30}, {"forward": {"cpu": 30}}).metrics()
        {'memory/peak_bytes': 30, 'memory/live_at_start_bytes': 10, 'memory/forward_peak_bytes': 30}
    """

    live_at_start: dict[str, int]
    peak: dict[str, int]
    by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    allocator_peak: dict[str, int] = field(default_factory=dict)

    def metrics(self, prefix: str = "memory/") -> dict[str, int]:
        """Flat names for a logger; a device other than the first is named in the key.

        Example:
            >>> StepPeaks({"cpu": 1, "cuda:0": 5}, {"cpu": 2, "cuda:0": 9}).metrics()
            {'memory/peak_bytes': 2, 'memory/live_at_start_bytes': 1, 'memory/cuda:0/peak_bytes': 9, 'memory/cuda:0/live_at_start_bytes': 5}
        """
        out: dict[str, int] = {}
        devices = list(self.peak)
        for i, dev in enumerate(devices):
            p = prefix if i == 0 else f"{prefix}{dev}/"
            out[f"{p}peak_bytes"] = self.peak[dev]
            out[f"{p}live_at_start_bytes"] = self.live_at_start.get(dev, 0)
            for phase, per_dev in self.by_phase.items():
                if dev in per_dev:
                    out[f"{p}{phase}_peak_bytes"] = per_dev[dev]
            if dev in self.allocator_peak:
                out[f"{p}allocator_peak_so_far_bytes"] = self.allocator_peak[dev]
        return out


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

    Example:
        >>> m = StepMeter().start(); m.begin_step(); _ = m.end_step(); m.stop()
        >>> m.steps
        1
    """

    def __init__(self, *objects: Any) -> None:
        from torchmem.capture.tracker import track

        self.live: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._phase_peak: dict[tuple[str, str], int] = {}
        self._start: dict[str, int] = {}
        self.steps = 0
        self.tracker = track(*objects, stacks=False, step_marker="manual",
                             listeners=[self._on_event])
        self._active = False

    def _on_event(self, event: Event, storage: Optional[torch.UntypedStorage]) -> None:
        kind = event.kind
        if kind is EventKind.MARK:
            return
        dev = event.device
        now = self.live.get(dev, 0) + (event.nbytes if kind is EventKind.ALLOC else -event.nbytes)
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

    def begin_step(self) -> None:
        """Reset this meter's step counters to the bytes live now.

        Example:
            >>> m = StepMeter(); m.begin_step(); m.end_step().peak
            {}
        """
        self._start = dict(self.live)
        self._peak = dict(self.live)
        self._phase_peak = {}

    def end_step(self) -> StepPeaks:
        """The step's figures (max across ranks under DDP); adds a step marker to the trace.

        Example:
            >>> m = StepMeter(); m.begin_step(); m.end_step().live_at_start
            {}
        """
        by_phase: dict[str, dict[str, int]] = {}
        for (dev, phase), value in self._phase_peak.items():
            by_phase.setdefault(phase, {})[dev] = value
        alloc: dict[str, int] = {}
        for dev in self._peak:
            if dev.startswith("cuda") and torch.cuda.is_available():
                alloc[dev] = int(torch.cuda.max_memory_allocated(torch.device(dev)))
        peaks = StepPeaks(dict(self._start), dict(self._peak), by_phase, alloc)
        self.steps += 1
        self.tracker.mark("step")
        return _max_across_ranks(peaks)


def _max_across_ranks(peaks: StepPeaks) -> StepPeaks:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return peaks
    metrics = peaks.metrics()
    keys = sorted(metrics)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.get_backend() == "nccl") else torch.device("cpu")
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    reduced = dict(zip(keys, (int(v) for v in values.tolist())))
    first = next(iter(peaks.peak), None)
    out = StepPeaks({}, {}, {}, {})
    for dev in peaks.peak:
        p = "memory/" if dev == first else f"memory/{dev}/"
        out.peak[dev] = reduced[f"{p}peak_bytes"]
        out.live_at_start[dev] = reduced[f"{p}live_at_start_bytes"]
        for phase, per_dev in peaks.by_phase.items():
            if dev in per_dev:
                out.by_phase.setdefault(phase, {})[dev] = reduced[f"{p}{phase}_peak_bytes"]
        if dev in peaks.allocator_peak:
            out.allocator_peak[dev] = reduced[f"{p}allocator_peak_so_far_bytes"]
    return out
