"""Simulation of PyTorch's CUDA caching allocator, without torch or a GPU.

- :class:`CachingAllocator`: one device's allocator (default settings): rounding, small and
  large pools, segment sizes, best fit, splitting, merging, per-stream pools, ``empty_cache``
  and the out-of-memory path.
- :func:`replay`: feed a snapshot's trace (complete from empty) to the simulator and check that
  it makes the same ``segment_alloc`` decisions as the real allocator.

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> a = CachingAllocator()
    >>> a.free(a.malloc(4 << 20)); a.reserved_bytes >> 20
    20
"""

from __future__ import annotations

from torchmem.sim.allocator import CachingAllocator, round_size, segment_size
from torchmem.sim.replay import ReplayResult, replay

__all__ = ["CachingAllocator", "ReplayResult", "replay", "round_size", "segment_size"]
