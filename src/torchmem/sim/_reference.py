"""The simplest correct model of the caching allocator: a plain list of blocks, linear scans.

:class:`ReferenceAllocator` makes the same decisions as :class:`~torchmem.sim.CachingAllocator`
(the same events, addresses and layout) for everything but expandable segments, written as
directly as the rules read: every search scans every block. It exists to check the fast
simulator (the property tests feed both random request streams) and to show its speed-up
(``benchmarks/bench_sim.py``). Not part of the public API.

Example:
    >>> r = ReferenceAllocator(capacity=64 << 20)
    >>> x = r.malloc(3 << 20); r.free(x); r.empty_cache()
    >>> [e[0] for e in r.events]
    ['segment_alloc', 'alloc', 'free_requested', 'free_completed', 'segment_free']
"""

from __future__ import annotations

from typing import Any

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.sim.config import AllocatorConfig

__all__ = ["ReferenceAllocator"]

KB512 = 512
MiB = 1 << 20


class _B:
    """A block: its segment, place, size, stream, pool and state."""

    __slots__ = ("seg", "addr", "size", "stream", "small", "state", "requested", "uses", "base")

    def __init__(self, seg: _B | None, addr: int, size: int, stream: int, small: bool) -> None:
        self.seg = seg  # the segment's first block at creation (identity of the segment)
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.state = "free"  # free | alloc | pending
        self.requested = 0
        self.uses: set[int] = set()
        self.base = 0  # gc count when it entered the pool


class ReferenceAllocator:
    """Linear-scan model of PyTorch 2.13's caching allocator (not expandable segments).

    Example:
        >>> r = ReferenceAllocator()
        >>> r.malloc(1000), r.allocated_bytes
        (4294967296, 1024)
    """

    def __init__(
        self,
        capacity: int | None = None,
        config: AllocatorConfig | str | None = None,
        *,
        memory_fraction: float | None = None,
    ) -> None:
        cfg = AllocatorConfig.parse(config) if isinstance(config, str) else (config or AllocatorConfig())
        if cfg.expandable_segments:
            raise InvalidInputError("ReferenceAllocator does not model expandable segments")
        self.cfg = cfg
        self.capacity = capacity
        frac = memory_fraction if memory_fraction is not None else cfg.per_process_memory_fraction
        self.allowed = None if frac is None or capacity is None else int(frac * capacity)
        self.events: list[tuple[str, int, int, int]] = []
        self.blocks: list[_B] = []  # every block of every segment
        self.segs: dict[int, tuple[int, int, bool]] = {}  # start -> (size, stream, small)
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0
        self.gc_calls = {True: 0, False: 0}
        self.next_address = 1 << 32

    # -- the rules ----------------------------------------------------------------------------

    def round(self, size: int) -> int:
        if size < KB512:
            return KB512
        d = self.cfg.divisions_for(size)
        if d > 1 and size > KB512 * d:
            p = 1
            while p * 2 <= size:
                p *= 2
            if p == size:
                return size
            step = p // d
            if step == 0:
                return 2 * p
            return -(-size // step) * step
        return -(-size // KB512) * KB512

    def gc_on(self) -> bool:
        return self.allowed is not None and self.cfg.garbage_collection_threshold > 0

    def free_blocks(self, small: bool, stream: int | None = None) -> list[_B]:
        """The pool's free blocks in (stream, size, address) order."""
        out = [b for b in self.blocks if b.state == "free" and b.small == small]
        if stream is not None:
            out = [b for b in out if b.stream == stream]
        return sorted(out, key=lambda b: (b.stream, b.size, b.addr))

    def whole(self, b: _B) -> bool:
        s = self.segs.get(b.addr)
        return s is not None and s[0] == b.size

    def enter_pool(self, b: _B) -> None:
        b.state = "free"
        b.base = self.gc_calls[b.small]

    # -- requests -----------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        if size < 1:
            raise InvalidInputError(f"size must be >= 1, got {size}")
        rounded = self.round(size)
        small = rounded <= MiB
        mss = self.cfg.max_split_size
        if self.gc_on():
            self.gc_calls[small] += 1
        block = None
        fits = [b for b in self.free_blocks(small, stream) if b.size >= rounded]
        if fits:
            best = fits[0]
            too_big = best.size >= mss if rounded < mss else best.size >= rounded + self.cfg.max_non_split_rounding_size
            if not too_big:
                block = best
        if block is None:
            block = self.new_block(size, rounded, small, stream)
        rest = block.size - rounded
        if small:
            split = rest >= KB512
        else:
            split = rest > MiB and rounded < mss
        if split:
            r = _B(block.seg, block.addr + rounded, rest, stream, small)
            self.blocks.insert(self.blocks.index(block) + 1, r)
            self.enter_pool(r)
            block.size = rounded
        block.state = "alloc"
        block.requested = size
        self.allocated_bytes += block.size
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        self.events.append(("alloc", block.addr, size, stream))
        return block.addr

    def free(self, addr: int) -> None:
        b = self.find(addr, "alloc")
        self.allocated_bytes -= b.size
        self.events.append(("free_requested", addr, b.requested, b.stream))
        if b.uses:
            b.state = "pending"
        else:
            self.complete(b)

    def record_stream(self, addr: int, stream: int) -> None:
        b = self.find(addr, "alloc")
        if stream != b.stream:
            b.uses.add(stream)

    def process_events(self) -> None:
        for b in list(self.pending_order):
            self.complete(b)

    synchronize = process_events

    @property
    def pending_order(self) -> list[_B]:
        # frees complete in the order they were requested: find that order from the events
        pend = {b.addr: b for b in self.blocks if b.state == "pending"}
        order: list[_B] = []
        for act, a, _, _ in self.events:
            if act == "free_requested" and a in pend:
                b = pend[a]
                if b in order:
                    order.remove(b)
                order.append(b)
        return order

    def empty_cache(self) -> None:
        self.synchronize()
        for small in (False, True):
            for b in self.free_blocks(small):
                if self.whole(b):
                    self.release(b)

    # -- helpers ------------------------------------------------------------------------------

    def find(self, addr: int, state: str) -> _B:
        for b in self.blocks:
            if b.addr == addr and b.state == state:
                return b
        raise InvalidInputError(f"no {state} block at {addr}")

    def complete(self, b: _B) -> None:
        self.events.append(("free_completed", b.addr, b.requested, b.stream))
        b.requested = 0
        b.uses = set()
        i = self.blocks.index(b)
        nxt = self.blocks[i + 1] if i + 1 < len(self.blocks) else None
        if nxt is not None and nxt.seg is b.seg and nxt.state == "free":
            b.size += nxt.size
            self.blocks.pop(i + 1)
        prv = self.blocks[i - 1] if i > 0 else None
        if prv is not None and prv.seg is b.seg and prv.state == "free":
            prv.size += b.size
            self.blocks.pop(i)
            b = prv
        self.enter_pool(b)

    def release(self, b: _B) -> None:
        self.blocks.remove(b)
        del self.segs[b.addr]
        self.reserved_bytes -= b.size
        self.events.append(("segment_free", b.addr, b.size, b.stream))

    def segment_bytes(self, rounded: int) -> int:
        if rounded <= MiB:
            return 2 * MiB
        if rounded < 10 * MiB:
            return self.cfg.large_segment_size
        return -(-rounded // (2 * MiB)) * (2 * MiB)

    def cuda_malloc(self, seg_size: int, stream: int, small: bool) -> _B | None:
        if self.allowed is not None and self.reserved_bytes + seg_size > self.allowed:
            return None
        if self.capacity is not None and self.reserved_bytes + seg_size > self.capacity:
            return None
        addr = self.next_address
        self.next_address += seg_size
        b = _B(None, addr, seg_size, stream, small)
        b.seg = b
        b.state = "taken"
        self.blocks.append(b)
        self.blocks.sort(key=lambda x: x.addr)
        self.segs[addr] = (seg_size, stream, small)
        self.reserved_bytes += seg_size
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        self.events.append(("segment_alloc", addr, seg_size, stream))
        return b

    def new_block(self, size: int, rounded: int, small: bool, stream: int) -> _B:
        if self.gc_on():
            self.garbage_collect()
        seg_size = self.segment_bytes(rounded)
        b = self.cuda_malloc(seg_size, stream, small)
        if b is None and self.release_oversize(rounded, small, stream):
            b = self.cuda_malloc(seg_size, stream, small)
        if b is None:
            self.empty_cache()
            b = self.cuda_malloc(seg_size, stream, small)
        if b is None:
            free = 0 if self.capacity is None else max(self.capacity - self.reserved_bytes, 0)
            self.events.append(("oom", free, rounded, stream))
            raise SimulatedOutOfMemoryError(f"reference allocator: out of memory for {size} bytes")
        return b

    def release_oversize(self, rounded: int, small: bool, stream: int) -> bool:
        mss = self.cfg.max_split_size
        if self.cfg.max_split_size_mb is None:
            return False
        need = max(rounded, mss)
        pool = self.free_blocks(small, stream)
        big_enough = [b for b in pool if b.size >= need]
        if big_enough:
            if not self.whole(big_enough[0]):
                return False
            self.release(big_enough[0])
            return True
        released = 0
        for b in reversed(pool):  # from the largest down
            if released >= need or b.size < mss:
                break
            if self.whole(b):
                self.release(b)
                released += b.size
        return released >= need

    def garbage_collect(self) -> None:
        assert self.allowed is not None
        limit = int(self.cfg.garbage_collection_threshold * self.allowed)
        if self.reserved_bytes <= limit:
            return
        target = self.reserved_bytes - limit
        now = self.gc_calls[False]
        cands = [b for b in self.free_blocks(False) if self.whole(b)]
        if not cands:
            return
        total_age = sum(now - b.base for b in cands)
        n = len(cands)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and n > 0:
            avg = total_age / n
            freed = False
            for b in [b for b in self.free_blocks(False) if self.whole(b)]:
                if now - b.base >= avg:
                    freed = True
                    reclaimed += b.size
                    total_age -= now - b.base
                    n -= 1
                    self.release(b)

    def layout(self) -> list[tuple[int, int, int, list[tuple[int, int, bool]]]]:
        out: list[Any] = []
        for start in sorted(self.segs):
            size, stream, _ = self.segs[start]
            blocks = [
                (b.addr - start, b.size, b.state != "free")
                for b in self.blocks
                if start <= b.addr < start + size
            ]
            out.append((start, size, stream, blocks))
        return out
