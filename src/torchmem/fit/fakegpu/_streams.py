"""CUDA streams and events in the estimate: each stream its own pool, ``record_stream``'s frees
deferred until the other stream's work is done.

PyTorch's caching allocator keeps a free block for reuse on the stream it was allocated on only
(``BlockComparatorSize`` orders the free pools by stream first); a block that
``Tensor.record_stream(s)`` marked as used on another stream ``s`` is not free when the tensor
dies: ``free()`` records a CUDA event on ``s`` (``insert_events``) and the block returns to its
pool when ``process_events`` (at the start of every ``malloc``) finds that event done, or when
``synchronize_and_free_events`` waits for it (``empty_cache``, and the out-of-memory path's
``release_cached_blocks`` before the retry) (``c10/cuda/CUDACachingAllocator.cpp``; the rules are
in ``shared/docs/cuda-caching-allocator.md``). Allocated bytes drop at the free; active and
reserved bytes keep the block until then.

The fake run tells the simulator which stream each request is made on (``torch.cuda.stream(s)``,
``with s:``, ``torch.cuda.set_stream``; the default stream is 0, each ``torch.cuda.Stream()`` a
new number) and which blocks ``record_stream`` marked (:meth:`Streams.record`). *When* the GPU
finishes the other stream's work depends on how far the host runs ahead of the GPU, which an
offline run cannot know; the estimate bounds it by the order of the work (:attr:`Streams.events`):

- ``"late"`` (the estimate's figures and verdict): an event is done only where the program waits
  for the GPU: ``torch.cuda.synchronize()``, ``Stream.synchronize()``, ``Event.synchronize()``
  or ``query()``, a value read (``.item()``, ``.tolist()``, ``if t:``: the current stream's
  work), ``empty_cache`` and the allocator's own out-of-memory retry. The host is as far ahead
  as it can be, so this is the most the blocks can hold, and never a false "fits".
- ``"early"`` (the lower figure, ``Estimate.peak_reserved_lower_bytes``): every event is done by
  the next allocation, as when the GPU keeps up with the host.

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> sim = CachingAllocator()
    >>> s = Streams(sim); side = s.new_stream()
    >>> with s.using(side):
    ...     p = sim.malloc(4 << 20, stream=s.current)      # made on the side stream
    >>> sim.record_stream(p, 0); sim.free(p)               # used on the default stream too
    >>> sim.active_bytes, sim.allocated_bytes              # freed, not reusable yet
    (4194304, 0)
    >>> s.synchronize(); sim.active_bytes
    0
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Streams", "FakeStream", "FakeEvent", "ACTIVE", "fake_record_stream"]

#: the estimate's streams while it runs (one estimate at a time per process; empty: none)
ACTIVE: list[Streams] = []


def _active() -> Streams | None:
    return ACTIVE[-1] if ACTIVE else None


class Streams:
    """The fake run's streams: which is current, and when other streams' frees complete.

    ``sim`` is the simulated allocator; ``address`` maps a tensor to its block's address (or
    ``None``: a host tensor, an empty one); ``events`` is ``"late"`` or ``"early"`` (see the
    module). :attr:`recorded` counts the blocks ``record_stream`` marked for another stream.

    Example:
        >>> from torchmem.sim import CachingAllocator
        >>> s = Streams(CachingAllocator()); s.current, s.new_stream().id, s.new_stream().id
        (0, 1, 2)
    """

    def __init__(self, sim: Any, address: Any = None, events: str = "late") -> None:
        if events not in ("late", "early"):
            raise ValueError(f"events must be 'late' or 'early', got {events!r}")
        self.sim = sim
        self.address = address
        self.events = events
        self.current = 0
        self._ids = itertools.count(1)
        self.default = FakeStream(_id=0)
        self._by_id: dict[int, FakeStream] = {0: self.default}
        self.recorded = 0
        #: the private pool requests go to (a CUDA graph capture, ``use_mem_pool``; 0: none)
        #: and whether a graph capture is underway (:mod:`torchmem.fit.fakegpu._graphs`)
        self.pool = 0
        self.capturing = False
        #: called with "record" at each block marked, "sync" where pending frees complete
        #: (the replay of repeated calls refuses a call that does either)
        self.on_event: Any = None

    def new_stream(self, s: FakeStream | None = None) -> FakeStream:
        """Number ``s`` (or a new stream) with the next number."""
        if s is None:
            s = FakeStream(_id=-1)
        s.id = s.stream_id = next(self._ids)
        self._by_id[s.id] = s
        return s

    def adopt(self, s: FakeStream) -> None:
        """Give a stream made outside the run (``id`` -1) a number of this run."""
        if s.id < 0 or self._by_id.get(s.id) is not s:
            self.new_stream(s)

    def stream(self) -> FakeStream:
        """The current stream (``torch.cuda.current_stream()``)."""
        return self._by_id.get(self.current, self.default)

    def set(self, s: Any) -> None:
        """``torch.cuda.set_stream(s)``."""
        if isinstance(s, FakeStream):
            self.adopt(s)
            self.current = s.id

    @contextlib.contextmanager
    def using(self, s: Any) -> Iterator[None]:
        """``with torch.cuda.stream(s):`` (``None``: no change)."""
        if not isinstance(s, FakeStream):
            yield
            return
        before = self.current
        self.set(s)
        try:
            yield
        finally:
            self.current = before

    def key(self) -> int:
        """The simulator's stream number of the next request: the current stream's, in the
        private pool when one is in use."""
        return self.sim.pool_stream(self.pool, self.current) if self.pool else self.current

    def before_malloc(self) -> None:
        """``process_events`` at the start of ``malloc``: under ``"early"`` every event is done."""
        if self.events == "early" and self.sim._pending:
            if self.on_event is not None:
                self.on_event("sync")
            self.sim.process_events()

    def record(self, t: torch.Tensor, s: Any) -> None:
        """``t.record_stream(s)``: mark ``t``'s block as used on ``s``."""
        if not isinstance(s, (FakeStream, torch.Stream)):
            raise TypeError(f"record_stream expects a stream, got {type(s).__name__}")
        if not isinstance(s, FakeStream) or self.address is None:
            return
        self.adopt(s)
        addr = self.address(t)
        if addr is None:
            return
        block = self.sim._alloc.get(addr)
        if block is not None and block[2] != s.id:
            self.sim.record_stream(addr, s.id)
            self.recorded += 1
            if self.on_event is not None:
                self.on_event("record")

    def synchronize(self, streams: Any = None) -> None:
        """The host waits for ``streams`` (``None``: all): their events are done."""
        if not self.sim._pending:
            return
        if self.on_event is not None:
            self.on_event("sync")
        if streams is None:
            self.sim.process_events()
        else:
            self.sim.process_events([s for s in streams if s >= 0])


class FakeEvent:
    """``torch.cuda.Event`` in the estimate: it remembers the stream it was recorded on, and
    ``synchronize()`` / ``query()`` wait for that stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream_id = -1

    def record(self, stream: Any = None) -> None:
        s = _active()
        if s is None:
            return
        if stream is None:
            stream = s.stream()
        if isinstance(stream, FakeStream):
            s.adopt(stream)
            self.stream_id = stream.id

    def wait(self, *args: Any, **kwargs: Any) -> None:
        return None  # the GPU's order, not the host's: no memory effect

    def synchronize(self) -> None:
        s = _active()
        if s is not None and self.stream_id >= 0:
            s.synchronize([self.stream_id])

    def query(self) -> bool:
        self.synchronize()  # the answer "done" holds once the host has waited for it
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakeStream(FakeEvent):
    """``torch.cuda.Stream`` in the estimate: a number for the simulator's pools (see the
    module); work on it runs in program order."""

    def __init__(self, *args: Any, _id: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.id = self.stream_id = -1 if _id is None else _id
        self._entered: list[int] = []
        s = _active()
        if _id is None and s is not None:
            s.new_stream(self)

    def record(self, stream: Any = None) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        s = _active()
        if s is not None:
            s.adopt(self)
            s.synchronize([self.id])

    def is_capturing(self) -> bool:
        s = _active()
        return s is not None and s.capturing and s.current == self.id

    def record_event(self, event: Any = None) -> FakeEvent:
        e = event if event is not None else FakeEvent()
        if isinstance(e, FakeEvent):
            FakeEvent.record(e, self)
        return e

    def __enter__(self) -> FakeStream:
        s = _active()
        if s is not None:
            self._entered.append(s.current)
            s.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        s = _active()
        if s is not None and self._entered:
            s.current = self._entered.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("stream", self.id))


def fake_record_stream(self: torch.Tensor, stream: Any) -> None:
    """``Tensor.record_stream`` in the estimate (torch's own refuses the stand-in stream)."""
    s = _active()
    if s is None:
        if not isinstance(stream, (FakeStream, torch.Stream)):
            raise TypeError(f"record_stream expects a stream, got {type(stream).__name__}")
        return
    s.record(self, stream)
