"""A pure-Python model of PyTorch's CUDA caching allocator for one device (default settings).

The rules (from ``c10/cuda/CUDACachingAllocator.cpp``, restated):

- a request is rounded up to a multiple of 512 B (:func:`round_size`); the rounded size picks
  the pool: small (at most 1 MiB) or large;
- best fit: the free block with the smallest ``(stream, size, address)`` on the request's stream
  whose size is at least the rounded request; freed memory is never reused across streams;
- nothing fits: a new segment (:func:`segment_size`: 2 MiB for small requests, 20 MiB for large
  requests under 10 MiB, else the request rounded up to 2 MiB);
- the chosen block is split when the leftover is at least 512 B (small pool) or more than 1 MiB
  (large pool); the leftover keeps the higher address and goes back to the pool;
- a freed block merges with its free neighbours in the same segment;
- :meth:`CachingAllocator.empty_cache` releases every free segment that is one unsplit block;
- with a ``capacity``, a new segment that does not fit first empties the cache and retries, then
  raises :class:`~torchmem.errors.SimulatedOutOfMemoryError`.

Not modelled yet: allocator options (``max_split_size_mb``, ``roundup_power2_divisions``, ...),
expandable segments, deferred cross-stream frees, garbage collection, private pools.

Example:
    >>> a = CachingAllocator()
    >>> p = a.malloc(1000)
    >>> a.events
    [('segment_alloc', 4294967296, 2097152, 0), ('alloc', 4294967296, 1000, 0)]
    >>> a.free(p); a.allocated_bytes, a.reserved_bytes
    (0, 2097152)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError

__all__ = [
    "CachingAllocator",
    "round_size",
    "segment_size",
]

MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 << 20  # 1 MiB: the largest small-pool request
SMALL_BUFFER = 2 << 20  # 2 MiB: every small-pool segment
LARGE_BUFFER = 20 << 20  # 20 MiB: the segment of a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # 10 MiB
ROUND_LARGE = 2 << 20  # 2 MiB: larger segments are rounded up to this
_BASE_ADDRESS = 1 << 32  # where simulated segments start (any 2 MiB-aligned value would do)

#: One decision of the allocator: (action, address, size, stream). ``alloc`` and
#: ``free_completed`` carry the requested (unrounded) size, ``segment_*`` the segment size.
Event = tuple[str, int, int, int]


def round_size(size: int) -> int:
    """The block size the allocator gives a request of ``size`` bytes (default settings).

    Example:
        >>> [round_size(n) for n in (1, 512, 513, 1 << 20, (1 << 20) + 1)]
        [512, 512, 1024, 1048576, 1049088]
    """
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(rounded: int) -> int:
    """The size of the new segment (cudaMalloc) for a request already rounded by :func:`round_size`.

    Example:
        >>> [segment_size(n) >> 20 for n in (512, 1 << 20, (1 << 20) + 512, 10 << 20, (10 << 20) + 512)]
        [2, 2, 20, 10, 12]
    """
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = (
        "addr", "size", "stream", "small", "requested", "allocated", "prev", "next", "expandable",
    )

    def __init__(self, addr: int, size: int, stream: int, small: bool) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.requested = 0
        self.allocated = False
        self.expandable = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class CachingAllocator:
    """PyTorch's CUDA caching allocator for one device, default settings, simulated in Python.

    ``capacity`` (bytes, ``None`` for unlimited) is what cudaMalloc may reserve in total.
    :attr:`events` lists every decision as ``(action, address, size, stream)`` with the actions
    ``segment_alloc``, ``segment_free``, ``alloc`` and ``free_completed``. Addresses are
    simulated: segments are laid out one after another from 4 GiB up and never reused.

    Example:
        >>> a = CachingAllocator(capacity=40 << 20)
        >>> x = a.malloc(3 << 20)            # large pool: a 20 MiB segment, split after 3 MiB
        >>> y = a.malloc(3 << 20)            # best fit: the 17 MiB leftover
        >>> y - x, a.reserved_bytes >> 20, a.allocated_bytes >> 20
        (3145728, 20, 6)
        >>> a.free(x); a.free(y); a.empty_cache(); a.reserved_bytes
        0
        >>> a.events[-1]
        ('segment_free', 4294967296, 20971520, 0)
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise InvalidInputError(f"capacity must be >= 0 bytes or None, got {capacity}")
        self.capacity = capacity
        #: Every decision, in order: ``(action, address, size, stream)``.
        self.events: list[Event] = []
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        # free blocks per pool, sorted by (stream, size, address); blocks by address
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._free_blocks: dict[int, _Block] = {}
        self._active: dict[int, _Block] = {}
        self._next_address = _BASE_ADDRESS
        self._seeded: list[tuple[int, int]] = []  # (start, end) of seeded segments

    # -- requests -----------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes on ``stream``; return the block's (simulated) address.

        Example:
            >>> a = CachingAllocator()
            >>> a.malloc(513) == a.events[0][1], a.allocated_bytes
            (True, 1024)
        """
        if size < 1:
            raise InvalidInputError(f"malloc size must be >= 1 byte, got {size}")
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        block = self._take_free(small, stream, rounded)
        if block is None:
            block = self._new_segment(size, rounded, small, stream)
        remaining = block.size - rounded
        if (remaining >= MIN_BLOCK_SIZE) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.addr + rounded, remaining, stream, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        block.requested = size
        self._active[block.addr] = block
        self.allocated_bytes += block.size
        self.events.append(("alloc", block.addr, size, stream))
        return block.addr

    def free(self, address: int) -> None:
        """Free the block at ``address`` (from :meth:`malloc`), merging it with free neighbours.

        Example:
            >>> a = CachingAllocator()
            >>> p, q = a.malloc(512), a.malloc(512)
            >>> a.free(p); a.free(q); a.layout()
            [(4294967296, 2097152, 0, [(0, 2097152, False)])]
        """
        block = self._active.pop(address, None)
        if block is None:
            raise InvalidInputError(f"free of address {address}, which is not an allocated block")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.events.append(("free_completed", address, block.requested, block.stream))
        block.requested = 0
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._remove_free(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if prev.prev is not None:
                prev.prev.next = block
        if nxt is not None and not nxt.allocated:
            self._remove_free(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._insert_free(block)

    def empty_cache(self) -> None:
        """Release every free segment that is a single unsplit block (large pool, then small).

        Example:
            >>> a = CachingAllocator()
            >>> p, q = a.malloc(512), a.malloc(20 << 20)
            >>> a.free(q); a.empty_cache(); a.reserved_bytes
            2097152
        """
        for small in (False, True):
            keys = self._free[small]
            kept: list[tuple[int, int, int]] = []
            for key in keys:
                block = self._free_blocks[key[2]]
                if block.prev is None and block.next is None:
                    del self._free_blocks[block.addr]
                    self.reserved_bytes -= block.size
                    self.events.append(("segment_free", block.addr, block.size, block.stream))
                else:
                    kept.append(key)
            self._free[small] = kept

    def add_segment(
        self,
        address: int,
        size: int,
        stream: int,
        blocks: Sequence[tuple[int, int, int]],
        *,
        small: bool,
        expandable: bool = False,
    ) -> list[int]:
        """Seed a segment that already exists (a mid-run state, e.g. from a snapshot).

        ``blocks`` are ``(offset, size, requested)`` covering the segment in address order;
        ``requested == 0`` marks a free block (it enters the pool), ``> 0`` an allocated block
        of that requested size. Returns the addresses of the allocated blocks, in order. No
        event is recorded: the segment was there before the simulation started. Segments the
        simulator creates later never overlap a seeded one.

        Example:
            >>> a = CachingAllocator()
            >>> a.add_segment(1 << 30, 2 << 20, 0, [(0, 1024, 1000), (1024, (2 << 20) - 1024, 0)],
            ...               small=True)
            [1073741824]
            >>> a.allocated_bytes, a.reserved_bytes, a.malloc(512) - (1 << 30)
            (1024, 2097152, 1024)
        """
        self._check_segment(address, size, stream, blocks)
        made: list[_Block] = []
        allocated: list[int] = []
        prev: _Block | None = None
        for offset, bsize, requested in blocks:
            block = _Block(address + offset, bsize, stream, small)
            block.expandable = expandable
            block.prev = prev
            if prev is not None:
                prev.next = block
            made.append(block)
            prev = block
            if requested > 0:
                block.allocated = True
                block.requested = requested
        for block in made:
            if block.allocated:
                self._active[block.addr] = block
                self.allocated_bytes += block.size
                allocated.append(block.addr)
            else:
                self._insert_free(block)
        self.reserved_bytes += size
        self._seeded.append((address, address + size))
        self._seeded.sort()
        self._next_address = max(self._next_address, address + size)
        return allocated

    def layout(self) -> list[tuple[int, int, int, list[tuple[int, int, bool]]]]:
        """The segments, by address: ``(address, size, stream, [(offset, size, allocated)])``.

        Example:
            >>> a = CachingAllocator()
            >>> _ = a.malloc(1000)
            >>> a.layout()
            [(4294967296, 2097152, 0, [(0, 1024, True), (1024, 2096128, False)])]
        """
        heads = [b for b in (*self._active.values(), *self._free_blocks.values()) if b.prev is None]
        out = []
        for head in sorted(heads, key=lambda b: b.addr):
            blocks: list[tuple[int, int, bool]] = []
            b: _Block | None = head
            while b is not None:
                blocks.append((b.addr - head.addr, b.size, b.allocated))
                b = b.next
            out.append((head.addr, sum(s for _, s, _ in blocks), head.stream, blocks))
        return out

    # -- internals ----------------------------------------------------------------------------

    def _check_segment(
        self, address: int, size: int, stream: int, blocks: Sequence[tuple[int, int, int]]
    ) -> None:
        """Validate :meth:`add_segment`'s arguments; raise InvalidInputError saying what is wrong."""
        where = f"add_segment(address={address!r}, size={size!r})"
        if not isinstance(address, int) or address < 0 or address % MIN_BLOCK_SIZE:
            raise InvalidInputError(
                f"{where}: address must be a non-negative multiple of {MIN_BLOCK_SIZE}, got "
                f"{address!r}; pass the segment's address from the snapshot"
            )
        if not isinstance(size, int) or size < MIN_BLOCK_SIZE or size % MIN_BLOCK_SIZE:
            raise InvalidInputError(
                f"{where}: size must be a positive multiple of {MIN_BLOCK_SIZE} bytes, got {size!r}"
            )
        if not isinstance(stream, int) or stream < 0:
            raise InvalidInputError(f"{where}: stream must be an int >= 0, got {stream!r}")
        if not blocks:
            raise InvalidInputError(
                f"{where}: blocks is empty; give (offset, size, requested) tuples covering the "
                "segment"
            )
        expected_offset = 0
        prev_free = False
        for i, item in enumerate(blocks):
            if len(item) != 3:
                raise InvalidInputError(
                    f"{where}: block {i} must be (offset, size, requested), got {item!r}"
                )
            offset, bsize, requested = item
            if offset != expected_offset:
                raise InvalidInputError(
                    f"{where}: block {i} starts at offset {offset}, expected {expected_offset}: "
                    "blocks must cover the segment in order without gaps or overlaps"
                )
            if bsize < MIN_BLOCK_SIZE or bsize % MIN_BLOCK_SIZE:
                raise InvalidInputError(
                    f"{where}: block {i} size must be a positive multiple of {MIN_BLOCK_SIZE} "
                    f"bytes, got {bsize}"
                )
            if requested < 0 or requested > bsize:
                raise InvalidInputError(
                    f"{where}: block {i} requested size must be 0 (free) or 1..{bsize} (the "
                    f"block's size), got {requested}"
                )
            if requested == 0 and prev_free:
                raise InvalidInputError(
                    f"{where}: blocks {i - 1} and {i} are both free; the allocator always merges "
                    "free neighbours, so give them as one free block"
                )
            prev_free = requested == 0
            expected_offset += bsize
        if expected_offset != size:
            raise InvalidInputError(
                f"{where}: the blocks cover {expected_offset} bytes, not the segment's {size}"
            )
        for start, end in self._segment_ranges():
            if address < end and start < address + size:
                raise InvalidInputError(
                    f"{where}: overlaps the existing segment [{start:#x}, {end:#x}); seeded "
                    "segments must not overlap"
                )

    def _segment_ranges(self) -> list[tuple[int, int]]:
        return [(addr, addr + size) for addr, size, _, _ in self.layout()]

    def _segment_address(self, size: int) -> int:
        """Where the next new segment of ``size`` bytes starts (a subclass may choose)."""
        addr = self._next_address
        self._next_address += size
        return addr

    def _insert_free(self, block: _Block) -> None:
        insort(self._free[block.small], (block.stream, block.size, block.addr))
        self._free_blocks[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        keys = self._free[block.small]
        i = bisect_left(keys, (block.stream, block.size, block.addr))
        del keys[i]
        del self._free_blocks[block.addr]

    def _take_free(self, small: bool, stream: int, size: int) -> _Block | None:
        keys = self._free[small]
        i = bisect_left(keys, (stream, size, -1))
        if i == len(keys) or keys[i][0] != stream:
            return None
        addr = keys.pop(i)[2]
        return self._free_blocks.pop(addr)

    def _new_segment(self, size: int, rounded: int, small: bool, stream: int) -> _Block:
        seg = segment_size(rounded)
        cap = self.capacity
        if cap is not None and self.reserved_bytes + seg > cap:
            self.empty_cache()
            if self.reserved_bytes + seg > cap:
                raise SimulatedOutOfMemoryError(
                    f"simulated CUDA out of memory: a request of {size} bytes on stream {stream} "
                    f"(rounded to {rounded}) needs a new {seg}-byte segment, but {self.reserved_bytes} "
                    f"of the capacity {cap} are reserved ({self.allocated_bytes} allocated) after "
                    "emptying the cache"
                )
        addr = self._segment_address(seg)
        self.reserved_bytes += seg
        self.events.append(("segment_alloc", addr, seg, stream))
        return _Block(addr, seg, stream, small)
