"""Simulation of PyTorch's CUDA caching allocator, without torch or a GPU.

- :class:`CachingAllocator`: one device's allocator as PyTorch 2.13 runs it: rounding (512 B or
  ``roundup_power2_divisions``), small and large pools, segment sizes, best fit, splitting and
  the ``max_split_size`` rules, merging, per-stream pools, deferred cross-stream frees
  (``record_stream``), ``empty_cache``, the out-of-memory path, the memory fraction with
  garbage collection, expandable segments, seeding a mid-run state (``add_segment``) and
  snapshots in PyTorch's format (``snapshot()``).
- :class:`AllocatorConfig`: the allocator's options, parsed from a ``PYTORCH_CUDA_ALLOC_CONF``
  string, the environment or a snapshot's ``allocator_settings``.
- :func:`replay`: feed a snapshot's trace to the simulator, from the allocator's state at the
  trace's start (rebuilt from the end state when the trace starts mid-run; see
  :mod:`torchmem.sim.replay`, which also has :class:`~torchmem.sim.replay.TraceReplay` for
  stepping), and check that it makes the same decisions as the real allocator.
- :func:`whatif` / :func:`suggest`: replay a snapshot's recorded requests under other settings
  (and another capacity) and compare with the recorded run; rank the documented alternatives
  (:mod:`torchmem.sim.whatif`, result :class:`WhatIf`).

Example:
    >>> from torchmem.sim import AllocatorConfig, CachingAllocator
    >>> a = CachingAllocator()
    >>> a.free(a.malloc(4 << 20)); a.reserved_bytes >> 20
    20
    >>> b = CachingAllocator(config="expandable_segments:True")
    >>> b.free(b.malloc(4 << 20)); b.reserved_bytes >> 20, b.events[0][0]
    (20, 'segment_map')
"""

from __future__ import annotations

from torchmem.sim.allocator import CachingAllocator, round_size, segment_size
from torchmem.sim.config import AllocatorConfig
from torchmem.sim.replay import ReplayResult, replay
from torchmem.sim.whatif import WhatIf, suggest, whatif

__all__ = [
    "AllocatorConfig",
    "CachingAllocator",
    "ReplayResult",
    "WhatIf",
    "replay",
    "round_size",
    "segment_size",
    "suggest",
    "whatif",
]
