"""The simplest correct model of the caching allocator: a plain list of blocks, linear scans.

:class:`ReferenceAllocator` makes the same decisions as :class:`~torchmem.sim.CachingAllocator`
(the same events, addresses and layout), written as directly as the rules read: every search
scans every block, every block is one object in one address-ordered list (unmapped pages of
expandable segments included). It exists to check the fast simulator (the property tests feed
both random request streams) and to show its speed-up (``benchmarks/bench_sim.py``). Not part
of the public API.

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
    """A block: its segment (start address), place, size, stream, pool and state."""

    __slots__ = ("seg", "addr", "size", "stream", "small", "state", "requested", "uses", "base")

    def __init__(self, seg: int, addr: int, size: int, stream: int, small: bool, state: str) -> None:
        self.seg = seg
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.state = state  # free | alloc | pending | unmapped | taken
        self.requested = 0
        self.uses: set[int] = set()
        self.base = 0  # the pool's get_free_block count when it entered the pool


class ReferenceAllocator:
    """Linear-scan model of PyTorch 2.13's caching allocator.

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
        self.cfg = cfg
        self.capacity = capacity
        frac = memory_fraction if memory_fraction is not None else cfg.per_process_memory_fraction
        self.allowed = None if frac is None or capacity is None else int(frac * capacity)
        self.events: list[tuple[str, int, int, int]] = []
        self.blocks: list[_B] = []  # every block of every segment, by address
        self.segs: dict[int, tuple[int, int, bool, int]] = {}  # start -> (size, stream, small, page)
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0
        self.gc_calls = {True: 0, False: 0}
        self.next_address = 1 << 32
        self.freed_order: list[_B] = []  # pending frees, in the order they were requested

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

    def expandable(self, b: _B) -> bool:
        return self.segs[b.seg][3] > 0

    def free_blocks(self, small: bool, stream: int | None = None) -> list[_B]:
        """The pool's free (mapped) blocks in (stream, size, address) order."""
        out = [b for b in self.blocks if b.state == "free" and b.small == small]
        if stream is not None:
            out = [b for b in out if b.stream == stream]
        return sorted(out, key=lambda b: (b.stream, b.size, b.addr))

    def neighbour(self, b: _B, step: int) -> _B | None:
        i = self.blocks.index(b) + step
        if 0 <= i < len(self.blocks) and self.blocks[i].seg == b.seg:
            return self.blocks[i]
        return None

    def whole(self, b: _B) -> bool:
        return self.segs[b.seg][0] == b.size and not self.expandable(b)

    def enter_pool(self, b: _B) -> None:
        b.state = "free"
        b.base = self.gc_calls[b.small]

    def add_reserved(self, n: int) -> None:
        self.reserved_bytes += n
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)

    # -- requests -----------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        if size < 1:
            raise InvalidInputError(f"size must be >= 1, got {size}")
        rounded = self.round(size)
        small = rounded <= MiB
        if self.gc_on():
            self.gc_calls[small] += 1
        block = self.best_fit(rounded, small, stream)
        if block is None:
            block = self.new_block(size, rounded, small, stream)
        rest = block.size - rounded
        if small or self.cfg.expandable_segments:
            split = rest >= KB512
        else:
            split = rest > MiB and rounded < self.cfg.max_split_size
        if split:
            r = _B(block.seg, block.addr + rounded, rest, stream, small, "free")
            self.blocks.insert(self.blocks.index(block) + 1, r)
            self.enter_pool(r)
            block.size = rounded
        block.state = "alloc"
        block.requested = size
        self.allocated_bytes += block.size
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        self.events.append(("alloc", block.addr, size, stream))
        return block.addr

    def best_fit(self, rounded: int, small: bool, stream: int) -> _B | None:
        fits = [b for b in self.free_blocks(small, stream) if b.size >= rounded]
        if not fits:
            return None
        k = 0
        if self.expandable(fits[0]):
            if self.cfg.expandable_segments:

                def grow(b: _B) -> int:
                    n = self.neighbour(b, 1)
                    return b.size + (n.size if n is not None and n.state == "unmapped" else 0)

                while self.expandable(fits[k]) and k + 1 < len(fits) and grow(fits[k + 1]) < grow(fits[k]):
                    k += 1
            else:
                k = 1
                while k < len(fits) and self.expandable(fits[k]):
                    k += 1
                if k == len(fits):
                    return None
        best = fits[k]
        mss = self.cfg.max_split_size
        if rounded < mss:
            too_big = best.size >= mss
        else:
            too_big = best.size >= rounded + self.cfg.max_non_split_rounding_size
        return None if too_big else best

    def free(self, addr: int) -> None:
        b = self.find(addr, "alloc")
        self.allocated_bytes -= b.size
        self.events.append(("free_requested", addr, b.requested, b.stream))
        if b.uses:
            b.state = "pending"
            self.freed_order.append(b)
        else:
            self.complete(b)

    def record_stream(self, addr: int, stream: int) -> None:
        b = self.find(addr, "alloc")
        if stream != b.stream:
            b.uses.add(stream)

    def process_events(self, streams: list[int] | None = None) -> None:
        for b in list(self.freed_order):
            if streams is not None:
                b.uses -= set(streams)
                if b.uses:
                    continue
            self.freed_order.remove(b)
            self.complete(b)

    def synchronize(self) -> None:
        self.process_events()

    def empty_cache(self) -> None:
        self.synchronize()
        for small in (False, True):
            to_unmap = []
            for b in self.free_blocks(small):
                if self.expandable(b):
                    to_unmap.append(b)
                elif self.whole(b):
                    self.release(b)
            for b in to_unmap:
                self.unmap(b)

    # -- helpers ------------------------------------------------------------------------------

    def find(self, addr: int, state: str) -> _B:
        for b in self.blocks:
            if b.addr == addr and b.state == state:
                return b
        raise InvalidInputError(f"no {state} block at {addr}")

    def merge(self, b: _B, state: str) -> _B:
        """Merge ``b`` with its neighbours in ``state``; the merged block is returned."""
        nxt = self.neighbour(b, 1)
        if nxt is not None and nxt.state == state:
            b.size += nxt.size
            self.blocks.remove(nxt)
        prv = self.neighbour(b, -1)
        if prv is not None and prv.state == state:
            prv.size += b.size
            self.blocks.remove(b)
            b = prv
        return b

    def complete(self, b: _B) -> None:
        self.events.append(("free_completed", b.addr, b.requested, b.stream))
        b.requested = 0
        b.uses = set()
        b.state = "freeing"
        b = self.merge(b, "free")
        self.enter_pool(b)

    def release(self, b: _B) -> None:
        self.blocks.remove(b)
        del self.segs[b.seg]
        self.reserved_bytes -= b.size
        self.events.append(("segment_free", b.addr, b.size, b.stream))

    def segment_bytes(self, rounded: int) -> int:
        if rounded <= MiB:
            return 2 * MiB
        if rounded < 10 * MiB:
            return self.cfg.large_segment_size
        return -(-rounded // (2 * MiB)) * (2 * MiB)

    def cuda_malloc(self, rounded: int, seg_size: int, stream: int, small: bool) -> _B | None:
        if self.allowed is not None and self.reserved_bytes + seg_size > self.allowed:
            return None
        if self.cfg.expandable_segments:
            return self.expandable_block(rounded, stream, small)
        if self.capacity is not None and self.reserved_bytes + seg_size > self.capacity:
            return None
        addr = self.next_address
        self.next_address += seg_size
        b = _B(addr, addr, seg_size, stream, small, "taken")
        self.blocks.append(b)
        self.blocks.sort(key=lambda x: x.addr)
        self.segs[addr] = (seg_size, stream, small, 0)
        self.add_reserved(seg_size)
        self.events.append(("segment_alloc", addr, seg_size, stream))
        return b

    def new_block(self, size: int, rounded: int, small: bool, stream: int) -> _B:
        if self.gc_on():
            self.garbage_collect()
        seg_size = self.segment_bytes(rounded)
        b = self.cuda_malloc(rounded, seg_size, stream, small)
        if b is None and self.release_oversize(rounded, small, stream):
            b = self.cuda_malloc(rounded, seg_size, stream, small)
        if b is None:
            self.empty_cache()
            b = self.cuda_malloc(rounded, seg_size, stream, small)
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
        if big_enough and not self.expandable(big_enough[0]):
            if not self.whole(big_enough[0]):
                return False
            self.release(big_enough[0])
            return True
        smaller = [b for b in pool if b.size < need] if not big_enough else pool[: pool.index(big_enough[0])]
        released = 0
        for b in reversed(smaller):  # from the largest down
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

    # -- expandable segments ------------------------------------------------------------------

    def expandable_block(self, rounded: int, stream: int, small: bool) -> _B | None:
        c = self.find_expandable(rounded, stream, small)
        if c.state == "unmapped":
            got = self.map(c, min(c.size, rounded))
            if got is None:
                return None
            c = got
        while c.size < rounded:
            nxt = self.neighbour(c, 1)
            assert nxt is not None and nxt.state == "unmapped"
            got = self.map(nxt, min(rounded - c.size, nxt.size))
            if got is None:
                return None
            c = got
        c.state = "taken"
        return c

    def find_expandable(self, rounded: int, stream: int, small: bool) -> _B:
        unmapped = sorted(
            (b for b in self.blocks if b.state == "unmapped" and b.stream == stream and b.small == small),
            key=lambda b: b.addr,
        )
        for u in unmapped:
            c = u
            p = self.neighbour(u, -1)
            if p is not None and p.state == "free":
                c = p
            total = 0
            b: _B | None = c
            while b is not None and b.state in ("free", "unmapped") and total < rounded:
                total += b.size
                b = self.neighbour(b, 1)
            if total >= rounded:
                return c
        page = 2 * MiB if small else self.cfg.large_segment_size
        device = self.capacity if self.capacity is not None else 80 << 30
        va = -(-(device + device // 8) // page) * page
        addr = self.next_address
        self.next_address += va
        self.segs[addr] = (va, stream, small, page)
        u = _B(addr, addr, va, stream, small, "unmapped")
        self.blocks.append(u)
        self.blocks.sort(key=lambda x: x.addr)
        return u

    def map(self, u: _B, size: int) -> _B | None:
        page = self.segs[u.seg][3]
        mapped = -(-size // page) * page
        if self.capacity is not None and self.reserved_bytes + mapped > self.capacity:
            return None
        if u.size > mapped:
            rest = _B(u.seg, u.addr + mapped, u.size - mapped, u.stream, u.small, "unmapped")
            self.blocks.insert(self.blocks.index(u) + 1, rest)
            u.size = mapped
        u.state = "mapping"
        start = u.addr
        u = self.merge(u, "free")
        self.enter_pool(u)
        self.add_reserved(mapped)
        self.events.append(("segment_map", start, mapped, u.stream))
        return u

    def unmap(self, b: _B) -> None:
        page = self.segs[b.seg][3]
        lo = b.seg + -(-(b.addr - b.seg) // page) * page
        hi = b.seg + (b.addr + b.size - b.seg) // page * page
        if lo >= hi:
            return
        i = self.blocks.index(b)
        parts = []
        if lo > b.addr:
            parts.append(_B(b.seg, b.addr, lo - b.addr, b.stream, b.small, "free"))
        middle = _B(b.seg, lo, hi - lo, b.stream, b.small, "unmapping")
        parts.append(middle)
        if b.addr + b.size > hi:
            parts.append(_B(b.seg, hi, b.addr + b.size - hi, b.stream, b.small, "free"))
        self.blocks[i : i + 1] = parts
        for p in parts:
            if p.state == "free":
                self.enter_pool(p)
        middle = self.merge(middle, "unmapped")
        middle.state = "unmapped"
        self.reserved_bytes -= hi - lo
        self.events.append(("segment_unmap", lo, hi - lo, b.stream))
        if middle.size == self.segs[b.seg][0]:
            self.blocks.remove(middle)
            del self.segs[b.seg]

    # -- views --------------------------------------------------------------------------------

    def layout(self) -> list[tuple[int, int, int, list[tuple[int, int, bool]]]]:
        out: list[Any] = []
        for start in sorted(self.segs):
            size, stream, _, _ = self.segs[start]
            run: list[_B] = []
            for b in [b for b in self.blocks if b.seg == start] + [None]:
                if b is None or b.state == "unmapped":
                    if run:
                        first = run[0].addr
                        out.append((first, sum(x.size for x in run), stream,
                                    [(x.addr - first, x.size, x.state != "free") for x in run]))
                    run = []
                else:
                    run.append(b)
        return out
