"""A per-step peak of the CUDA caching allocator that resets nothing PyTorch counts.

PyTorch's allocator keeps one running peak per device (``torch.cuda.max_memory_allocated``);
the only way to restart it is ``torch.cuda.reset_peak_memory_stats``, which restarts it for
every reader in the process (a profiler, a logger, the user's own code). PyTorch's public API has
no callback on each allocation either (``torch.cuda.memory._record_memory_history`` is private
and process-wide: turning it on or off would change what another recorder sees).

So the step peak is *followed*, not read: :class:`AllocatorFollower` reads
``torch.cuda.memory_allocated(device)`` once at the step's start (a plain read of the
allocator's current figure, which disturbs no one), then adds every storage the tracker sees
allocated on the device rounded as the allocator rounds it (:func:`torchmem.sim.round_size`,
with the ``PYTORCH_CUDA_ALLOC_CONF`` of the process: 512-byte multiples, or
``roundup_power2_divisions``) and subtracts every storage freed; the highest value is the step's
peak. At the step's end it reads ``memory_allocated`` again: the difference between that read and
the followed figure is reported as ``unseen`` bytes.

What it cannot see (and ``unseen`` measures at the step's end):

- allocations that never surface as a tensor's storage: library workspaces (cuBLAS, cuDNN,
  NCCL buffers), scratch memory inside a kernel, ``torch.cuda.caching_allocator_alloc``;
  a workspace made and freed inside the step raises the true peak without leaving a trace in
  ``unseen``;
- the slack of a reused large block: the allocator hands out a cached block of up to 1 MiB more
  than the rounded request without splitting it (more with ``max_split_size_mb``), and
  ``memory_allocated`` counts the whole block;
- allocations made by other threads between the tracker's events are counted when the tracker
  records them.

The reported peak is therefore ``max(followed peak, memory_allocated at the end)``: a lower
bound of the true peak that is exact when the step allocates only through tensors.

Example:
    >>> readings = {"cuda:0": 4096}                  # a fake allocator: 4 KiB allocated
    >>> f = AllocatorFollower(read=readings.__getitem__)
    >>> f.begin(["cuda:0"])
    >>> f.alloc("cuda:0", 1000)                      # rounded to 1024
    >>> f.free("cuda:0", 1000)
    >>> readings["cuda:0"] = 4096
    >>> step = f.end()["cuda:0"]
    >>> step.start, step.peak, step.unseen
    (4096, 5120, 0)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, Optional

from torchmem.errors import InvalidInputError
from torchmem.sim.allocator import round_size
from torchmem.sim.config import AllocatorConfig

__all__ = ["AllocatorFollower", "AllocatorStep", "cuda_allocated"]


def cuda_allocated(device: str) -> int:
    """``torch.cuda.memory_allocated`` of a device named ``"cuda:N"`` (a read; resets nothing).

    Example:
        >>> cuda_allocated("cpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: cuda_allocated expects a CUDA device name...
    """
    if not device.startswith("cuda"):
        raise InvalidInputError(
            f"cuda_allocated expects a CUDA device name such as 'cuda:0', received {device!r}"
        )
    import torch

    return int(torch.cuda.memory_allocated(torch.device(device)))


@dataclass(frozen=True)
class AllocatorStep:
    """One device's allocator figures over a step (bytes).

    ``start``/``end``: ``memory_allocated`` read at the step's start and end; ``followed_peak``:
    the highest followed value; ``followed_end``: the followed value at the end.

    Example:
        >>> s = AllocatorStep(start=100, followed_peak=900, followed_end=100, end=612)
        >>> s.peak, s.unseen
        (900, 512)
    """

    start: int
    followed_peak: int
    followed_end: int
    end: int

    @property
    def peak(self) -> int:
        """The step's peak: the followed peak, or the end reading if that is higher.

        Example:
            >>> AllocatorStep(0, 10, 10, 50).peak
            50
        """
        return max(self.followed_peak, self.end)

    @property
    def unseen(self) -> int:
        """``memory_allocated`` at the end minus the followed figure (0 when nothing was missed).

        Example:
            >>> AllocatorStep(0, 10, 10, 10).unseen
            0
        """
        return self.end - self.followed_end


class AllocatorFollower:
    """Follows the allocated bytes of CUDA devices through a step (see the module docstring).

    ``read(device) -> int`` reads the allocator's current figure (default: :func:`cuda_allocated`);
    ``config`` gives the rounding (default: from the environment, as PyTorch reads it).

    Example:
        >>> f = AllocatorFollower(read=lambda dev: 3 << 20, config=AllocatorConfig())
        >>> f.begin([]); f.alloc("cuda:1", 3 << 20)   # the first allocation seen on cuda:1
        >>> f.end()["cuda:1"]
        AllocatorStep(start=0, followed_peak=3145728, followed_end=3145728, end=3145728)
    """

    def __init__(
        self,
        read: Optional[Callable[[str], int]] = None,
        config: Optional[AllocatorConfig] = None,
    ) -> None:
        self.read = read or cuda_allocated
        self._round: Callable[[int], int]
        if config is None:
            try:
                config = AllocatorConfig.from_env()
            except InvalidInputError:  # PYTORCH_NO_CUDA_MEMORY_CACHING: one cudaMalloc per tensor
                config = None
                self._round = int
            else:
                self._round = self._rounder(config)
        else:
            self._round = self._rounder(config)
        self.config = config
        self._start: dict[str, int] = {}
        self._now: dict[str, int] = {}
        self._peak: dict[str, int] = {}

    @staticmethod
    def _rounder(config: AllocatorConfig) -> Callable[[int], int]:
        def rounded(nbytes: int) -> int:
            return round_size(nbytes, config) if nbytes > 0 else 0  # no block for 0 bytes

        return rounded

    def begin(self, devices: Iterable[str]) -> None:
        """Start a step: read each device's allocated bytes now.

        Example:
            >>> f = AllocatorFollower(read=lambda dev: 2048); f.begin(["cuda:0"])
            >>> f.end()["cuda:0"].start
            2048
        """
        self._start, self._now, self._peak = {}, {}, {}
        for dev in devices:
            self._open(dev, self.read(dev))

    def _open(self, dev: str, value: int) -> None:
        self._start[dev] = self._now[dev] = self._peak[dev] = value

    def alloc(self, device: str, nbytes: int) -> None:
        """A storage of ``nbytes`` was allocated on ``device``.

        A device first seen inside the step starts from its reading now, less this allocation.

        Example:
            >>> f = AllocatorFollower(read=lambda dev: 512); f.begin([])
            >>> f.alloc("cuda:0", 1); f.end()["cuda:0"].start
            0
        """
        r = self._round(nbytes)
        now = self._now.get(device)
        if now is None:
            self._open(device, self.read(device) - r)
            now = self._now[device]
        now += r
        self._now[device] = now
        if now > self._peak[device]:
            self._peak[device] = now

    def free(self, device: str, nbytes: int) -> None:
        """A storage of ``nbytes`` on ``device`` was freed.

        Example:
            >>> f = AllocatorFollower(read=lambda dev: 1024); f.begin(["cuda:0"])
            >>> f.free("cuda:0", 600); f.end()["cuda:0"].followed_end
            0
        """
        if device not in self._now:
            self._open(device, self.read(device))
            return
        self._now[device] -= self._round(nbytes)

    def end(self) -> dict[str, AllocatorStep]:
        """End the step: read each device again; its figures, by device.

        Example:
            >>> AllocatorFollower(read=lambda dev: 0).end()
            {}
        """
        return {
            dev: AllocatorStep(self._start[dev], self._peak[dev], self._now[dev], self.read(dev))
            for dev in self._now
        }
