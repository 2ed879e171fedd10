"""CUDA graphs and memory pools in the estimate: captures allocate from private pools that stay
reserved while the graph lives.

``torch.cuda.CUDAGraph`` (and through it ``torch.cuda.graph(g)`` and
``torch.cuda.make_graphed_callables``, PyTorch's own Python code), ``torch.cuda.graph_pool_handle``,
``torch.cuda.MemPool`` and ``torch.cuda.use_mem_pool`` work under the estimate as the caching
allocator handles them (``c10/cuda/CUDACachingAllocator.cpp``: ``beginAllocateToPool``,
``releasePool``; rules in ``shared/docs/cuda-caching-allocator-2.13.md`` section 12):

- between ``capture_begin`` and ``capture_end`` every request goes to the graph's private pool
  (a new one, or the one ``pool=`` names: ``graph_pool_handle()``, another graph's ``pool()``),
  whose blocks the rest of the program never reuses; a block freed inside the capture goes back
  to that pool and is reused by the capture's later requests, as on the GPU;
- the code of a capture runs once, as the capture runs it (the GPU records its kernels);
  ``replay()`` allocates nothing: the graph's outputs stay the tensors the capture made;
- the pool's free segments stay reserved (``empty_cache`` and the allocator's out-of-memory
  retry leave them) until every graph captured into it is ``reset()`` or deleted; a
  ``MemPool``'s until it is deleted.

Example:
    >>> import torch, torchmem
    >>> def build(batch):
    ...     w = torch.randn(1024, 1024, device="cuda")
    ...     x = torch.randn(batch, 1024, device="cuda")
    ...     g = torch.cuda.CUDAGraph()
    ...     with torch.cuda.graph(g):
    ...         y = (x @ w).relu()          # captured: y and the matmul's output live in its pool
    ...     return lambda: (g.replay(), y.sum())
    >>> e = torchmem.estimate(build, gpu="H100-80GB", batch_size=4096, margin=0)
    >>> e.peak_reserved_bytes >> 20   # w and x: one 20 MiB segment; the graph's pool: the
    ...                               # two 16 MiB outputs and the capture stream's 32 MiB
    ...                               # cuBLAS workspace; the sum: 2 MiB
    86
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torchmem.fit.fakegpu._streams import ACTIVE

__all__ = ["FakeGraph", "FakeMemPool", "graph_pool_handle", "use_mem_pool"]

_IDS = itertools.count(1)


def _streams() -> Any:
    return ACTIVE[-1] if ACTIVE else None


def graph_pool_handle() -> tuple[int, int]:
    """``torch.cuda.graph_pool_handle()``: a new pool's token, to share between graphs."""
    return (0, next(_IDS))


def _pool_id(pool: Any) -> int:
    if pool is None:
        return next(_IDS)
    if isinstance(pool, FakeMemPool):
        return pool._pool
    if isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(v, int) for v in pool):
        return pool[1] or pool[0]
    raise TypeError(
        f"pool must be a token from torch.cuda.graph_pool_handle() or a graph's pool(), got "
        f"{type(pool).__name__} {pool!r}")


class FakeGraph:
    """``torch.cuda.CUDAGraph`` in the estimate (see the module)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._pool: int | None = None
        self._captured = False
        self._held: Any = None  # the simulator holding the pool

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                      check_input_liveness: bool = False) -> None:
        s = _streams()
        if s is None:
            raise RuntimeError("CUDA graph capture outside the estimate's fake GPU")
        if s.pool:
            raise RuntimeError("a CUDA graph capture is already underway (one at a time)")
        self.reset()
        self._pool = _pool_id(pool)
        s.sim.use_pool(self._pool)
        self._held = s.sim
        s.pool, s.capturing = self._pool, True

    def capture_end(self) -> None:
        s = _streams()
        if s is None or not s.pool or s.pool != self._pool:
            raise RuntimeError("capture_end without a capture_begin of this graph")
        s.pool, s.capturing = 0, False
        self._captured = True

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")

    def instantiate(self) -> None:
        return None

    def reset(self) -> None:
        if self._held is not None and self._pool is not None:
            self._held.release_pool(self._pool)
        self._held = None
        self._captured = False

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("this graph has no pool yet: capture it first")
        return (0, self._pool)

    def enable_debug_mode(self) -> None:
        return None

    def debug_dump(self, debug_path: str) -> None:
        return None

    def __del__(self) -> None:
        try:
            self.reset()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class FakeMemPool:
    """``torch.cuda.MemPool`` in the estimate: a private pool, in use while the object lives
    (``use_mem_pool(pool)`` routes the current stream's requests to it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        s = _streams()
        self._pool = next(_IDS)
        self._held = s.sim if s is not None else None
        if self._held is not None:
            self._held.use_pool(self._pool)

    @property
    def id(self) -> tuple[int, int]:
        return (self._pool, 0)

    def use_count(self) -> int:
        return self._held.pools_in_use.get(self._pool, 0) if self._held is not None else 0

    def __del__(self) -> None:
        try:
            if self._held is not None:
                self._held.release_pool(self._pool)
                self._held = None
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@contextmanager
def use_mem_pool(pool: Any, device: Any = None) -> Iterator[None]:
    """``torch.cuda.use_mem_pool(pool)``: requests inside go to ``pool``."""
    if not isinstance(pool, FakeMemPool):
        raise TypeError(f"use_mem_pool expects a torch.cuda.MemPool, got {type(pool).__name__}")
    s = _streams()
    if s is None:
        yield
        return
    before, s.pool = s.pool, pool._pool
    try:
        yield
    finally:
        s.pool = before
