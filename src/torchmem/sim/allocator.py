"""A pure-Python model of PyTorch 2.13's CUDA caching allocator for one device.

The rules (``c10/cuda/CUDACachingAllocator.cpp``, restated; options in :mod:`.config`):

- a request is rounded up to a multiple of 512 B, or with ``roundup_power2_divisions`` to the
  next of ``d`` equal steps of its power-of-two interval (:func:`round_size`); the rounded size
  picks the pool: small (at most 1 MiB) or large;
- best fit: the free block with the smallest ``(stream, size, address)`` on the request's stream
  whose size is at least the rounded request; freed memory is never reused across streams. A
  request under ``max_split_size`` never takes a block of at least that size, and a larger
  request never takes a block ``max_non_split_rounding`` or more bytes bigger than itself;
- nothing fits: with a memory fraction and ``garbage_collection_threshold``, free cached whole
  segments by age first; then a new segment (:func:`segment_size`: 2 MiB for small requests,
  ``large_segment_size`` (20 MiB) for large requests under 10 MiB, else the request rounded up
  to 2 MiB). If it does not fit (``capacity`` or the fraction): release cached oversize blocks
  (only with ``max_split_size``) and retry, then synchronize, release every cached whole
  segment and retry, then record an ``oom`` event and raise
  :class:`~torchmem.errors.SimulatedOutOfMemoryError`;
- the chosen block is split when the leftover is at least 512 B (small pool, or expandable
  segments on) or, in the large pool, more than 1 MiB and the request is under
  ``max_split_size``; the leftover keeps the higher address and goes back to the pool;
- a freed block merges with its free neighbours in the same segment; a block used on other
  streams (:meth:`CachingAllocator.record_stream`) is only requested free until
  :meth:`CachingAllocator.process_events` (``free_requested``, later ``free_completed``);
- :meth:`CachingAllocator.empty_cache` synchronizes, then releases every free segment that is
  one unsplit block (large pool, then small) and unmaps the free pages of expandable segments;
- with ``expandable_segments:True`` each (stream, pool) grows one virtual range (1.125 x the
  device memory), mapping pages (2 MiB small, ``large_segment_size`` large) on demand
  (``segment_map``) and unmapping them in ``empty_cache`` (``segment_unmap``).

- private pools (CUDA graph captures, MemPools): :meth:`CachingAllocator.pool_stream` numbers
  their blocks apart, :meth:`~CachingAllocator.use_pool` keeps them from ``empty_cache``.

Not modelled: IPC, ``backend:cudaMallocAsync``, MemPools with their own allocator.
A pending cross-stream free completes when the program calls :meth:`~CachingAllocator.process_events`
(the simulation has no GPU clock to say when the other stream is done).

Over 800 lines: it is one state machine (pools, the
out-of-memory chain, GC, deferred frees, seeding, views) and half of it is docstrings with
examples; expandable segments live in :mod:`._expandable`, the seeding checks in :mod:`._checks`.

Example:
    >>> a = CachingAllocator()
    >>> p = a.malloc(1000)
    >>> a.events
    [('segment_alloc', 4294967296, 2097152, 0), ('alloc', 4294967296, 1000, 0)]
    >>> a.free(p); a.allocated_bytes, a.reserved_bytes
    (0, 2097152)
    >>> a.events[-2:]
    [('free_requested', 4294967296, 1000, 0), ('free_completed', 4294967296, 1000, 0)]
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.model.snapshot import Snapshot
from torchmem.sim._checks import check_segment
from torchmem.sim._expandable import SMALL_BUFFER, ExpandableMixin, Seg
from torchmem.sim._snapshot import Frames, build_snapshot
from torchmem.sim.config import AllocatorConfig

__all__ = [
    "CachingAllocator",
    "PRIVATE_POOL",
    "round_size",
    "segment_size",
]

MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 << 20  # 1 MiB: the largest small-pool request
LARGE_BUFFER = 20 << 20  # 20 MiB: the default segment of a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # 10 MiB
ROUND_LARGE = 2 << 20  # 2 MiB: larger segments are rounded up to this
SIZE_MAX = (1 << 64) - 1
_BASE_ADDRESS = 1 << 32  # where simulated segments start (any 2 MiB-aligned value would do)
_SHIFT = 64  # free-block keys: size << 64 | address (one int compares faster than a tuple)
_MASK = (1 << _SHIFT) - 1
_HUGE = 1 << 60  # PyTorch refuses requests of 1 EiB and more outright
#: A private pool's stream numbers (CUDA graph captures, ``torch.cuda.MemPool``): pool ``p``'s
#: blocks of stream ``s`` are the stream ``p * PRIVATE_POOL + s`` (see
#: :meth:`CachingAllocator.pool_stream`), so they are never shared with another pool's.
PRIVATE_POOL = 1 << 40

#: One decision of the allocator: (action, address, size, stream). ``alloc``, ``free_requested``
#: and ``free_completed`` carry the requested (unrounded) size, ``segment_*`` the segment (or
#: mapped range) size, ``oom`` the device's free bytes instead of an address and the rounded size.
Event = tuple[str, int, int, int]


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """The block size the allocator gives a request of ``size`` bytes.

    Without ``roundup_power2_divisions`` a multiple of 512 B; with ``d`` divisions for the
    request's interval (and ``size > 512 * d``), the next of ``d`` equal steps between the
    powers of two around ``size``.

    Example:
        >>> [round_size(n) for n in (1, 512, 513, 1 << 20, (1 << 20) + 1)]
        [512, 512, 1024, 1048576, 1049088]
        >>> c = AllocatorConfig.parse("roundup_power2_divisions:4")
        >>> [round_size(n, c) >> 20 for n in (5 << 20, (5 << 20) + 1, (6 << 20) + 1)]
        [5, 6, 7]
    """
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if config is not None:
        d = config.divisions_for(size)
        if d > 1 and size > MIN_BLOCK_SIZE * d:
            return _roundup_power2_next_division(size, d)
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return 2 * floor
    rem = size % step
    return size if rem == 0 else size - rem + step


def segment_size(rounded: int, config: AllocatorConfig | None = None) -> int:
    """The size of the new segment (cudaMalloc) for a request already rounded by :func:`round_size`.

    Example:
        >>> [segment_size(n) >> 20 for n in (512, 1 << 20, (1 << 20) + 512, 10 << 20, (10 << 20) + 512)]
        [2, 2, 20, 10, 12]
        >>> segment_size(4 << 20, AllocatorConfig(large_segment_size_mb=64)) >> 20
        64
    """
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER if config is None else config.large_segment_size
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


class _SegmentLayout(tuple[int, int, int, list[tuple[int, int, bool]]]):
    """One entry of :meth:`CachingAllocator.layout`: a 4-tuple that also says its pool and
    whether it is a mapped range of an expandable segment."""

    is_expandable: bool
    small: bool

    def __new__(
        cls, address: int, size: int, stream: int, blocks: list[tuple[int, int, bool]],
        is_expandable: bool, small: bool,
    ) -> _SegmentLayout:
        self = super().__new__(cls, (address, size, stream, blocks))
        self.is_expandable = is_expandable
        self.small = small
        return self


def _check_fraction(fraction: object, bool_ok: bool = True) -> None:
    """A memory fraction is a number in [0.0, 1.0] (``bool_ok=False``: not True or False);
    else the error that says so."""
    if (not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0
            or (not bool_ok and isinstance(fraction, bool))):
        raise InvalidInputError(f"memory_fraction must be a number in [0.0, 1.0], got {fraction!r}")


class CachingAllocator(ExpandableMixin):
    """PyTorch 2.13's CUDA caching allocator for one device, simulated in Python.

    ``capacity`` (bytes, ``None`` for unlimited) is what cudaMalloc may reserve in total (the
    device's memory less the CUDA context and other processes). ``config`` is an
    :class:`~torchmem.sim.AllocatorConfig` or a ``PYTORCH_CUDA_ALLOC_CONF`` string.
    ``memory_fraction`` (or the config's ``per_process_memory_fraction``) limits this process to
    that fraction of ``capacity``, as ``torch.cuda.set_per_process_memory_fraction`` does, and
    turns on ``garbage_collection_threshold``.

    :attr:`events` lists every decision as ``(action, address, size, stream)`` with PyTorch's
    trace actions (``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``,
    ``alloc``, ``free_requested``, ``free_completed``, ``oom``). Addresses are simulated:
    segments are laid out one after another from 4 GiB up (above any seeded segment) and never
    reused. :attr:`allocated_bytes` counts allocated blocks (it drops when a free is requested),
    :attr:`active_bytes` also counts blocks whose free is pending, :attr:`reserved_bytes` the
    segments and mapped pages; ``max_*`` are the peaks since :meth:`reset_peak`.

    Example:
        >>> a = CachingAllocator(capacity=40 << 20)
        >>> x = a.malloc(3 << 20)            # large pool: a 20 MiB segment, split after 3 MiB
        >>> y = a.malloc(3 << 20)            # best fit: the 17 MiB leftover
        >>> y - x, a.reserved_bytes >> 20, a.allocated_bytes >> 20
        (3145728, 20, 6)
        >>> a.free(x); a.free(y); a.empty_cache(); a.reserved_bytes, a.max_allocated_bytes >> 20
        (0, 6)
        >>> a.events[-1]
        ('segment_free', 4294967296, 20971520, 0)
    """

    def __init__(
        self,
        capacity: int | None = None,
        config: AllocatorConfig | str | None = None,
        *,
        memory_fraction: float | None = None,
    ) -> None:
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise InvalidInputError(
                f"capacity must be an int >= 0 (bytes) or None for unlimited, got {capacity!r}"
            )
        if config is None:
            cfg = AllocatorConfig()
        elif isinstance(config, str):
            cfg = AllocatorConfig.parse(config)
        elif isinstance(config, AllocatorConfig):
            cfg = config
        else:
            raise InvalidInputError(
                "config must be an AllocatorConfig, a PYTORCH_CUDA_ALLOC_CONF string or None, got "
                f"{type(config).__name__}"
            )
        fraction = memory_fraction if memory_fraction is not None else cfg.per_process_memory_fraction
        allowed: int | None = None
        if fraction is not None:
            _check_fraction(fraction)
            if capacity is None:
                raise InvalidInputError(
                    f"memory_fraction={fraction} needs the device's capacity (bytes): pass "
                    "capacity=... as well"
                )
            allowed = int(fraction * capacity)
        self.capacity = capacity
        self.config = cfg
        #: The per-process limit in bytes (``memory_fraction`` x ``capacity``), or ``None``.
        self.allowed_bytes = allowed
        #: Every decision, in order: ``(action, address, size, stream)``.
        self.events: list[Event] = []
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        #: Requested (unrounded) bytes of active blocks, as PyTorch's ``requested_bytes``.
        self.requested_bytes = 0
        self.max_requested_bytes = 0
        self.max_active_bytes = 0
        #: Block bytes and requested bytes allocated since creation (``*.all.allocated``).
        self.total_allocated_bytes = 0
        self.total_requested_bytes = 0
        self._pending_bytes = 0  # block bytes whose free waits for other streams
        self._seeded = [0, 0]  # block and requested bytes allocated by add_segment
        self._max_split = cfg.max_split_size
        self._max_nsr = cfg.max_non_split_rounding_size
        self._large_seg = cfg.large_segment_size
        self._divisions = cfg if any(cfg.roundup_power2_divisions) else None
        self._expandable = cfg.expandable_segments
        self._gc = allowed is not None and cfg.garbage_collection_threshold > 0.0
        self._gc_count = {True: 0, False: 0}  # get_free_block calls per pool (small?)
        self._gc_base: dict[int, int] = {}  # free block -> its pool's count when inserted
        # free (mapped) blocks: per pool, per stream a sorted list of size << 64 | address;
        # by address their size; by end address their start
        self._free: dict[bool, dict[int, list[int]]] = {True: {}, False: {}}
        self._fsize: dict[int, int] = {}
        self._fend: dict[int, int] = {}
        # allocated blocks: address -> (size, requested, stream, small)
        self._alloc: dict[int, tuple[int, int, int, bool]] = {}
        # blocks whose free waits for other streams: address -> (size, requested, stream, small)
        self._pending: dict[int, tuple[int, int, int, bool]] = {}
        self._uses: dict[int, set[int]] = {}  # record_stream: address -> other streams
        self._segs: dict[int, Seg] = {}  # by start address
        # expandable segments: unmapped blocks by address / end, and sorted per (small, stream)
        self._usize: dict[int, int] = {}
        self._uend: dict[int, int] = {}
        self._unmapped: dict[tuple[bool, int], list[int]] = {}
        self._xstarts: list[int] = []  # sorted starts of expandable ranges
        self._frames: dict[int, Frames] = {}  # allocated block -> its allocation's frames
        self._event_frames: dict[int, Frames] = {}  # event index -> frames
        self._next_address = _BASE_ADDRESS
        #: private pools in use -> how many users (graphs, MemPool contexts) hold them
        self.pools_in_use: dict[int, int] = {}
        # frees off the inlined path: GC ages, frames to drop
        self._special = self._gc

    # -- requests -----------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0, frames: Frames | None = None) -> int:
        """Allocate ``size`` bytes on ``stream``; return the block's (simulated) address.

        ``frames`` (a list of ``{"filename", "line", "name"}`` dicts or
        :class:`~torchmem.model.snapshot.Frame` objects, innermost first) is kept with the
        ``alloc`` event and the block, for :meth:`snapshot`.

        Example:
            >>> a = CachingAllocator()
            >>> a.malloc(513) == a.events[0][1], a.allocated_bytes
            (True, 1024)
        """
        if type(size) is not int or not 0 < size < _HUGE:
            size = self._check_size(size)
        div = self._divisions
        if div is None:
            rounded = MIN_BLOCK_SIZE if size <= MIN_BLOCK_SIZE else (size + 511) & -512
        else:
            rounded = round_size(size, div)
        small = rounded <= SMALL_SIZE
        lst = self._free[small].get(stream)
        if self._gc:
            self._gc_count[small] += 1
        addr = -1
        if lst:
            i = bisect_left(lst, rounded << _SHIFT)
            if i < len(lst) and self._xstarts:
                i = self._expandable_best_fit(lst, i)
            if 0 <= i < len(lst):
                key = lst[i]
                bsize = key >> _SHIFT
                mss = self._max_split
                if (bsize < mss) if rounded < mss else (bsize < rounded + self._max_nsr):
                    del lst[i]
                    addr = key & _MASK
                    del self._fsize[addr]
                    del self._fend[addr + bsize]
        if addr < 0:
            addr, bsize = self._alloc_new(size, rounded, small, stream, frames)
            lst = self._free[small].get(stream)
        remaining = bsize - rounded
        if (
            (remaining >= MIN_BLOCK_SIZE)
            if small or self._expandable
            else (remaining > SMALL_SIZE and rounded < self._max_split)
        ):
            rest = addr + rounded
            if lst is None:
                lst = self._free[small][stream] = []
            insort(lst, remaining << _SHIFT | rest)
            self._fsize[rest] = remaining
            self._fend[rest + remaining] = rest
            if self._gc:
                self._gc_base[rest] = self._gc_count[small]
            bsize = rounded
        self._alloc[addr] = (bsize, size, stream, small)
        allocated = self.allocated_bytes = self.allocated_bytes + bsize
        if allocated > self.max_allocated_bytes:
            self.max_allocated_bytes = allocated
        if allocated + self._pending_bytes > self.max_active_bytes:
            self.max_active_bytes = allocated + self._pending_bytes
        requested = self.requested_bytes = self.requested_bytes + size
        if requested > self.max_requested_bytes:
            self.max_requested_bytes = requested
        self.total_allocated_bytes += bsize
        self.total_requested_bytes += size
        if frames is not None:
            self._frames[addr] = frames
            self._event_frames[len(self.events)] = frames
            self._special = True
        self.events.append(("alloc", addr, size, stream))
        return addr

    def free(self, address: int) -> None:
        """Free the block at ``address`` (from :meth:`malloc`), merging it with free neighbours.

        A block used on other streams (:meth:`record_stream`) stays active until
        :meth:`process_events`; only ``free_requested`` is recorded now.

        Example:
            >>> a = CachingAllocator()
            >>> p, q = a.malloc(512), a.malloc(512)
            >>> a.free(p); a.free(q); a.layout()
            [(4294967296, 2097152, 0, [(0, 2097152, False)])]
        """
        t = self._alloc.pop(address, None)
        if t is None:
            self._bad_free(address)
        size, requested, stream, small = t
        self.allocated_bytes -= size
        events = self.events
        events.append(("free_requested", address, requested, stream))
        if self._uses and address in self._uses:
            self._pending[address] = t
            self._pending_bytes += size
            return
        self.requested_bytes -= requested
        if self._special:
            self._free_block(address, size, requested, stream, small)
            return
        # the common case, inlined: free_block with its merges (see _free_block)
        events.append(("free_completed", address, requested, stream))
        fsize = self._fsize
        fend = self._fend
        lst = self._free[small].get(stream)
        if lst is None:
            lst = self._free[small][stream] = []
        segs = self._segs
        if address not in segs:
            p = fend.pop(address, None)
            if p is not None:
                psize = fsize.pop(p)
                del lst[bisect_left(lst, psize << _SHIFT | p)]
                address = p
                size += psize
        end = address + size
        if end not in segs:
            nsize = fsize.pop(end, None)
            if nsize is not None:
                del fend[end + nsize]
                del lst[bisect_left(lst, nsize << _SHIFT | end)]
                size += nsize
        insort(lst, size << _SHIFT | address)
        fsize[address] = size
        fend[address + size] = address

    def record_stream(self, address: int, stream: int) -> None:
        """Mark the allocated block at ``address`` as used on ``stream`` (``Tensor.record_stream``).

        Its free is then deferred until :meth:`process_events`. The block's own stream is
        ignored, as in PyTorch.

        Example:
            >>> a = CachingAllocator()
            >>> p = a.malloc(512, stream=0); a.record_stream(p, 7); a.free(p)
            >>> a.events[-1][0], a.allocated_bytes, a.active_bytes
            ('free_requested', 0, 512)
            >>> a.process_events(); a.events[-1][0], a.active_bytes
            ('free_completed', 0)
        """
        t = self._alloc.get(address)
        if t is None:
            raise InvalidInputError(
                f"record_stream of address {address}, which is not an allocated block; call it "
                "between malloc and free"
            )
        if stream != t[2]:
            self._uses.setdefault(address, set()).add(stream)

    def process_events(self, streams: Iterable[int] | None = None) -> None:
        """Complete pending cross-stream frees whose other streams have passed their events.

        ``streams`` names the streams that caught up (``None``: all of them). A block waits for
        every stream recorded on it; when the last one has passed, it returns to its pool with
        a ``free_completed`` event. Blocks complete in the order their frees were requested
        (each stream's events are a FIFO). Call it where the real program's next allocation
        would find those streams done; :meth:`synchronize` and :meth:`empty_cache` wait for all.

        Example:
            >>> a = CachingAllocator()
            >>> p = a.malloc(512); a.record_stream(p, 3); a.record_stream(p, 4); a.free(p)
            >>> a.process_events([3]); a.events[-1][0]
            'free_requested'
            >>> a.process_events([4]); [e[0] for e in a.events]
            ['segment_alloc', 'alloc', 'free_requested', 'free_completed']
        """
        pending = self._pending
        if not pending:
            return
        done = None if streams is None else set(streams)
        for address in list(pending):
            waiting = self._uses[address]
            if done is not None:
                waiting -= done
                if waiting:
                    continue
            bsize, requested, stream, small = pending.pop(address)
            del self._uses[address]
            self._pending_bytes -= bsize
            self.requested_bytes -= requested
            self._free_block(address, bsize, requested, stream, small)

    def synchronize(self) -> None:
        """Wait for every stream: the same as :meth:`process_events` in the simulation.

        Example:
            >>> a = CachingAllocator(); a.synchronize(); a.events
            []
        """
        self.process_events()

    def pool_stream(self, pool: int, stream: int = 0) -> int:
        """The stream number of private pool ``pool``'s blocks on ``stream`` (pool 0: the
        default pools, ``stream`` itself).

        A CUDA graph capture (or ``torch.cuda.use_mem_pool``) allocates from a private pool:
        its blocks are reused only by requests to that pool, and ``empty_cache`` releases its
        free segments only once :meth:`release_pool` has given back every :meth:`use_pool`
        (``release_cached_blocks`` frees a private pool when its ``use_count`` is 0); the
        memory-fraction collector never takes them.

        Example:
            >>> a = CachingAllocator(); a.use_pool(1)
            >>> p = a.malloc(4 << 20, stream=a.pool_stream(1)); a.free(p)
            >>> q = a.malloc(4 << 20); a.reserved_bytes >> 20          # not from the graph's pool
            40
            >>> a.empty_cache(); a.reserved_bytes >> 20                # the graph still holds it
            40
            >>> a.release_pool(1); a.free(q); a.empty_cache(); a.reserved_bytes
            0
        """
        if not isinstance(pool, int) or pool < 0 or not isinstance(stream, int) or not (
                0 <= stream < PRIVATE_POOL):
            raise InvalidInputError(
                f"pool must be an int >= 0 and stream an int in [0, 2**40), got pool={pool!r}, "
                f"stream={stream!r}")
        return pool * PRIVATE_POOL + stream

    def use_pool(self, pool: int) -> None:
        """One more user of private pool ``pool`` (a graph captured into it)."""
        self.pools_in_use[pool] = self.pools_in_use.get(pool, 0) + 1

    def release_pool(self, pool: int) -> None:
        """One user fewer of private pool ``pool`` (a graph reset or deleted); with none left,
        the next ``empty_cache`` releases its free segments."""
        n = self.pools_in_use.get(pool, 0) - 1
        if n > 0:
            self.pools_in_use[pool] = n
        else:
            self.pools_in_use.pop(pool, None)

    def empty_cache(self) -> None:
        """Synchronize, then release every free segment that is a single unsplit block (large pool,
        then small) and unmap the free whole pages of expandable segments.

        Example:
            >>> a = CachingAllocator()
            >>> p, q = a.malloc(512), a.malloc(20 << 20)
            >>> a.free(q); a.empty_cache(); a.reserved_bytes
            2097152
        """
        self._release_cached_blocks()

    @property
    def active_bytes(self) -> int:
        """Bytes of active blocks: allocated, or freed but waiting for other streams.

        Example:
            >>> a = CachingAllocator(); p = a.malloc(100); a.active_bytes
            512
        """
        return self.allocated_bytes + self._pending_bytes

    def memory_stats(self) -> dict[str, int]:
        """The counters ``torch.cuda.memory_stats()`` reports, under its key names, for what the
        simulation tracks: ``allocated_bytes``, ``reserved_bytes``, ``active_bytes`` and
        ``requested_bytes`` for ``all`` pools (``current``, ``peak`` since :meth:`reset_peak`,
        ``allocated`` and ``freed`` since creation; blocks seeded with :meth:`add_segment`
        count as allocated before it), ``allocation`` and ``segment`` (``current``; mapped
        ranges count as one segment each), ``num_alloc_retries``, ``num_ooms``,
        ``num_device_alloc`` / ``num_device_free`` (cudaMalloc/cudaFree and page map/unmap
        calls).

        Example:
            >>> a = CachingAllocator(); p = a.malloc(1000); s = a.memory_stats()
            >>> s["allocated_bytes.all.current"], s["requested_bytes.all.current"], s["segment.all.current"]
            (1024, 1000, 1)
            >>> a.free(p); s = a.memory_stats()
            >>> s["requested_bytes.all.peak"], s["active_bytes.all.freed"], s["reserved_bytes.all.allocated"]
            (1000, 1024, 2097152)
        """
        counts = {"segment_alloc": 0, "segment_map": 0, "segment_free": 0, "segment_unmap": 0}
        sizes = dict.fromkeys(counts, 0)
        for e in self.events:
            if e[0] in counts:
                counts[e[0]] += 1
                sizes[e[0]] += e[2]
        tot_alloc = self.total_allocated_bytes + self._seeded[0]
        tot_req = self.total_requested_bytes + self._seeded[1]
        active = self.active_bytes
        return {
            "allocated_bytes.all.current": self.allocated_bytes,
            "allocated_bytes.all.peak": self.max_allocated_bytes,
            "allocated_bytes.all.allocated": tot_alloc,
            "allocated_bytes.all.freed": tot_alloc - self.allocated_bytes,
            "reserved_bytes.all.current": self.reserved_bytes,
            "reserved_bytes.all.peak": self.max_reserved_bytes,
            "reserved_bytes.all.allocated": sizes["segment_alloc"] + sizes["segment_map"],
            "reserved_bytes.all.freed": sizes["segment_free"] + sizes["segment_unmap"],
            "active_bytes.all.current": active,
            "active_bytes.all.peak": self.max_active_bytes,
            "active_bytes.all.allocated": tot_alloc,
            "active_bytes.all.freed": tot_alloc - active,
            "requested_bytes.all.current": self.requested_bytes,
            "requested_bytes.all.peak": self.max_requested_bytes,
            "requested_bytes.all.allocated": tot_req,
            "requested_bytes.all.freed": tot_req - self.requested_bytes,
            "allocation.all.current": len(self._alloc),
            "segment.all.current": len(self._segment_states()),
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_device_alloc": counts["segment_alloc"] + counts["segment_map"],
            "num_device_free": counts["segment_free"] + counts["segment_unmap"],
        }

    def set_memory_fraction(self, fraction: float, total: int | None = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction)``: from now on new segments
        fit within ``fraction`` x ``total`` bytes (the device's whole memory, as PyTorch takes
        it from ``cudaMemGetInfo``; default :attr:`capacity`), and ``garbage_collection_threshold``
        applies. The CUDA context is not counted against it, only this allocator's segments.

        Example:
            >>> a = CachingAllocator(capacity=90 << 20)
            >>> a.set_memory_fraction(0.25, total=100 << 20); a.allowed_bytes >> 20
            25
            >>> a.malloc(30 << 20)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.SimulatedOutOfMemoryError: ...
        """
        _check_fraction(fraction, bool_ok=False)
        base = self.capacity if total is None else total
        if base is None:
            raise InvalidInputError(
                f"memory fraction {fraction} needs the device's memory (bytes): pass total=... "
                "or make the allocator with a capacity")
        self.allowed_bytes = int(fraction * base)
        if self.config.garbage_collection_threshold > 0.0 and not self._gc:
            self._gc = self._special = True
            # blocks cached before: aged from now (PyTorch counts the pool's free-block
            # searches only while the collector is on)
            for small, pools in self._free.items():
                for keys in pools.values():
                    for key in keys:
                        self._gc_base.setdefault(key & _MASK, self._gc_count[small])

    def reset_peak(self) -> None:
        """Reset :attr:`max_allocated_bytes`, :attr:`max_reserved_bytes`,
        :attr:`max_active_bytes` and :attr:`max_requested_bytes` to the current values, as
        ``torch.cuda.reset_peak_memory_stats()`` does.

        Example:
            >>> a = CachingAllocator(); a.free(a.malloc(4096)); a.reset_peak()
            >>> a.max_allocated_bytes, a.max_reserved_bytes
            (0, 2097152)
        """
        self.max_allocated_bytes = self.allocated_bytes
        self.max_reserved_bytes = self.reserved_bytes
        self.max_active_bytes = self.active_bytes
        self.max_requested_bytes = self.requested_bytes

    # -- seeding ------------------------------------------------------------------------------

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

        ``expandable=True`` seeds one mapped range of an expandable segment: the first such
        range of a (stream, pool) opens a virtual range at ``address`` (as large as the
        allocator would reserve, cut short before the next segment); later ranges inside it
        are mapped into it, with unmapped pages between.

        Example:
            >>> a = CachingAllocator()
            >>> a.add_segment(1 << 30, 2 << 20, 0, [(0, 1024, 1000), (1024, (2 << 20) - 1024, 0)],
            ...               small=True)
            [1073741824]
            >>> a.allocated_bytes, a.reserved_bytes, a.malloc(512) - (1 << 30)
            (1024, 2097152, 1024)
        """
        check_segment(address, size, stream, blocks)
        small = bool(small)
        if expandable:
            self._seed_expandable_range(address, size, stream, small)
        else:
            for start, seg in self._segs.items():
                if address < start + seg.size and start < address + size:
                    raise InvalidInputError(
                        f"add_segment(address={address:#x}, size={size}): overlaps the existing "
                        f"segment [{start:#x}, {start + seg.size:#x}); segments must not overlap"
                    )
            self._segs[address] = Seg(address, size, stream, small, 0)
            self.reserved_bytes += size
        allocated: list[int] = []
        for offset, bsize, requested in blocks:
            addr = address + offset
            if requested > 0:
                self._alloc[addr] = (bsize, requested, stream, small)
                self.allocated_bytes += bsize
                self.requested_bytes += requested
                self._seeded[0] += bsize
                self._seeded[1] += requested
                allocated.append(addr)
            else:
                self._insert_free(addr, bsize, stream, small)
        self._next_address = max(self._next_address, address + size)
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        self.max_active_bytes = max(self.max_active_bytes, self.active_bytes)
        self.max_requested_bytes = max(self.max_requested_bytes, self.requested_bytes)
        return allocated

    # -- views --------------------------------------------------------------------------------

    def layout(self) -> list[tuple[int, int, int, list[tuple[int, int, bool]]]]:
        """The segments, by address: ``(address, size, stream, [(offset, size, allocated)])``.

        ``allocated`` is true for active blocks (including those whose free is pending). An
        expandable segment shows one entry per contiguous mapped range; each entry also has the
        attributes ``is_expandable`` and ``small`` (its pool).

        Example:
            >>> a = CachingAllocator()
            >>> _ = a.malloc(1000)
            >>> a.layout()
            [(4294967296, 2097152, 0, [(0, 1024, True), (1024, 2096128, False)])]
            >>> a.layout()[0].is_expandable, a.layout()[0].small
            (False, True)
        """
        return [
            _SegmentLayout(
                start, size, stream,
                [(off, bsize, state != "inactive") for off, bsize, _, state in blocks],
                expandable, small,
            )
            for start, size, stream, small, expandable, blocks in self._segment_states()
        ]

    def snapshot(self, device: int = 0, *, since: int = 0) -> Snapshot:
        """The allocator's state and trace as a :class:`~torchmem.model.snapshot.Snapshot`.

        ``since`` keeps only the trace from event ``since`` on (what
        ``torch.cuda.memory._record_memory_history()`` would have recorded had it started
        there); ``time_us`` stays the event's index in :attr:`events`.

        Segments with their blocks (``active_allocated``, ``active_pending_free``, ``inactive``),
        ``segment_type``, ``is_expandable``, the config's ``allocator_settings`` and the device
        trace with every event (``time_us`` = the event's index), as PyTorch's
        ``torch.cuda.memory._snapshot()`` would give, so torchmem's analyses, its writer and
        PyTorch's ``_memory_viz`` read it.

        Example:
            >>> a = CachingAllocator()
            >>> p = a.malloc(1000, frames=[{"filename": "t.py", "line": 3, "name": "f"}])
            >>> s = a.snapshot()
            >>> s.segments[0].blocks[0].state, s.segments[0].blocks[0].frames[0].name
            ('active_allocated', 'f')
            >>> [e.action for e in s.trace(0)], s.allocator_settings["max_split_size"]
            (['segment_alloc', 'alloc'], -1)
            >>> [(e.action, e.time_us) for e in a.snapshot(since=1).trace(0)]
            [('alloc', 1)]
        """
        return build_snapshot(
            device,
            self._segment_states(),
            self.events,
            self._event_frames,
            self._frames,
            self.config.to_settings(),
            since=since,
        )

    # -- internals: states --------------------------------------------------------------------

    def _segment_states(self) -> list[tuple[int, int, int, bool, bool, list[tuple[int, int, int, str]]]]:
        """``(address, size, stream, small, expandable, [(offset, size, requested, state)])``."""
        out = []
        for start in sorted(self._segs):
            seg = self._segs[start]
            end = start + seg.size
            a = start
            run: list[tuple[int, int, int, str]] = []
            run_start = start
            while a < end:
                t = self._alloc.get(a)
                if t is not None:
                    run.append((a - run_start, t[0], t[1], "active_allocated"))
                    a += t[0]
                    continue
                t = self._pending.get(a)
                if t is not None:
                    run.append((a - run_start, t[0], t[1], "active_pending_free"))
                    a += t[0]
                    continue
                s = self._fsize.get(a)
                if s is not None:
                    run.append((a - run_start, s, 0, "inactive"))
                    a += s
                    continue
                s = self._usize[a]  # unmapped: ends a mapped range
                if run:
                    out.append((run_start, a - run_start, seg.stream, seg.small, True, run))
                a += s
                run, run_start = [], a
            if run:
                out.append((run_start, end - run_start, seg.stream, seg.small, seg.page > 0, run))
        return out

    # -- internals: the pools -----------------------------------------------------------------

    def _insert_free(self, addr: int, size: int, stream: int, small: bool) -> None:
        pools = self._free[small]
        lst = pools.get(stream)
        if lst is None:
            lst = pools[stream] = []
        insort(lst, size << _SHIFT | addr)
        self._fsize[addr] = size
        self._fend[addr + size] = addr
        if self._gc:
            self._gc_base[addr] = self._gc_count[small]

    def _remove_free(self, addr: int, size: int, stream: int, small: bool) -> None:
        lst = self._free[small][stream]
        del lst[bisect_left(lst, size << _SHIFT | addr)]
        del self._fsize[addr]
        del self._fend[addr + size]

    def _free_block(self, addr: int, size: int, requested: int, stream: int, small: bool) -> None:
        if self._frames:
            self._frames.pop(addr, None)
        self.events.append(("free_completed", addr, requested, stream))
        fsize = self._fsize
        fend = self._fend
        lst = self._free[small].get(stream)
        if lst is None:
            lst = self._free[small][stream] = []
        segs = self._segs
        if addr not in segs:
            p = fend.pop(addr, None)
            if p is not None:
                psize = fsize.pop(p)
                del lst[bisect_left(lst, psize << _SHIFT | p)]
                addr = p
                size += psize
        end = addr + size
        if end not in segs:
            nsize = fsize.pop(end, None)
            if nsize is not None:
                del fend[end + nsize]
                del lst[bisect_left(lst, nsize << _SHIFT | end)]
                size += nsize
        insort(lst, size << _SHIFT | addr)
        fsize[addr] = size
        fend[addr + size] = addr
        if self._gc:
            self._gc_base[addr] = self._gc_count[small]

    def _alloc_size(self, rounded: int) -> int:
        if rounded <= SMALL_SIZE:
            return SMALL_BUFFER
        if rounded < MIN_LARGE_ALLOC:
            return self._large_seg
        return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)

    def _alloc_new(
        self, size: int, rounded: int, small: bool, stream: int, frames: Frames | None = None
    ) -> tuple[int, int]:
        """No cached block fits: GC, a new segment, the two retries, else the OOM event and error.

        Every event this records carries the request's ``frames`` (PyTorch records them with
        the allocation's context)."""
        n0 = len(self.events)
        try:
            if self._gc:
                self._garbage_collect()
            alloc_size = self._alloc_size(rounded)
            got = self._alloc_block(rounded, alloc_size, small, stream)
            if got is None and self._release_available_cached_blocks(rounded, small, stream):
                got = self._alloc_block(rounded, alloc_size, small, stream)
            if got is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                got = self._alloc_block(rounded, alloc_size, small, stream)
            if got is None:
                self._oom(size, rounded, alloc_size, stream)
            return got
        finally:
            if frames is not None:
                for k in range(n0, len(self.events)):
                    self._event_frames[k] = frames
                self._special = True

    def _alloc_block(self, rounded: int, alloc_size: int, small: bool, stream: int) -> tuple[int, int] | None:
        """cudaMalloc (or map pages of) a new segment; ``None`` when it does not fit."""
        if self.allowed_bytes is not None and self.reserved_bytes + alloc_size > self.allowed_bytes:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(rounded, small, stream)
        if self.capacity is not None and self.reserved_bytes + alloc_size > self.capacity:
            return None
        addr = self._segment_address(alloc_size)
        self._segs[addr] = Seg(addr, alloc_size, stream, small, 0)
        self.reserved_bytes += alloc_size
        if self.reserved_bytes > self.max_reserved_bytes:
            self.max_reserved_bytes = self.reserved_bytes
        self.events.append(("segment_alloc", addr, alloc_size, stream))
        return addr, alloc_size

    def _segment_address(self, size: int) -> int:
        """Where the next new segment of ``size`` bytes starts (a subclass may choose)."""
        addr = self._next_address
        self._next_address += size
        return addr

    def _release_block(self, addr: int, size: int, stream: int, small: bool) -> None:
        """cudaFree a whole free segment."""
        self._remove_free(addr, size, stream, small)
        self._gc_base.pop(addr, None)
        del self._segs[addr]
        self.reserved_bytes -= size
        self.events.append(("segment_free", addr, size, stream))

    def _is_whole_segment(self, addr: int, size: int) -> bool:
        seg = self._segs.get(addr)
        return seg is not None and seg.size == size and seg.page == 0

    def _release_cached_blocks(self) -> None:
        """emptyCache: synchronize, then release whole free segments and unmap free pages (a
        private pool's only once nothing uses it)."""
        self.synchronize()
        in_use = self.pools_in_use
        for small in (False, True):
            pools = self._free[small]
            to_unmap: list[tuple[int, int, int]] = []
            for stream in sorted(pools):
                if stream >= PRIVATE_POOL and in_use.get(stream // PRIVATE_POOL):
                    continue
                for key in list(pools[stream]):
                    addr, size = key & _MASK, key >> _SHIFT
                    if self._xstarts and self._in_expandable(addr):
                        to_unmap.append((addr, size, stream))
                    elif self._is_whole_segment(addr, size):
                        self._release_block(addr, size, stream, small)
            for addr, size, stream in to_unmap:
                self._unmap_block(addr, size, stream, small)

    def _release_available_cached_blocks(self, rounded: int, small: bool, stream: int) -> bool:
        """Free cached oversize blocks (at least ``max_split_size``) of the stream; only with it set."""
        mss = self._max_split
        if mss == SIZE_MAX:
            return False
        lst = self._free[small].get(stream) or []
        key = max(rounded, mss)
        i = bisect_left(lst, key << _SHIFT)
        if i < len(lst) and not self._in_expandable(lst[i] & _MASK):
            addr, size = lst[i] & _MASK, lst[i] >> _SHIFT
            if not self._is_whole_segment(addr, size):
                return False
            self._release_block(addr, size, stream, small)
            return True
        released = 0
        j = i - 1
        while released < key and j >= 0 and (lst[j] >> _SHIFT) >= mss:
            addr, size = lst[j] & _MASK, lst[j] >> _SHIFT
            if not self._in_expandable(addr) and self._is_whole_segment(addr, size):
                self._release_block(addr, size, stream, small)
                released += size
            j -= 1
        return released >= key

    def _garbage_collect(self) -> None:
        """Free cached whole large-pool segments whose age is at least the average, until the
        reserved bytes fall under ``garbage_collection_threshold`` x the allowed bytes."""
        assert self.allowed_bytes is not None
        threshold = int(self.config.garbage_collection_threshold * self.allowed_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        count = self._gc_count[False]
        pools = self._free[False]

        def candidates() -> list[tuple[int, int, int]]:
            return [
                (key & _MASK, key >> _SHIFT, stream)
                for stream in sorted(pools)
                if stream < PRIVATE_POOL  # the collector frees the default pool's blocks only
                for key in pools[stream]
                if self._is_whole_segment(key & _MASK, key >> _SHIFT)
            ]

        cands = candidates()
        total_age = sum(count - self._gc_base[a] for a, _, _ in cands)
        n = len(cands)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and n > 0:
            threshold_age = total_age / n
            freed = False
            for addr, size, stream in candidates():
                age = count - self._gc_base[addr]
                if age >= threshold_age:
                    freed = True
                    reclaimed += size
                    total_age -= age
                    n -= 1
                    self._release_block(addr, size, stream, False)

    def _oom(self, size: int, rounded: int, alloc_size: int, stream: int) -> NoReturn:
        free = 0 if self.capacity is None else max(self.capacity - self.reserved_bytes, 0)
        self.events.append(("oom", free, rounded, stream))
        self.num_ooms += 1
        limit = f"capacity {self.capacity} bytes"
        if self.allowed_bytes is not None:
            limit += f" ({self.allowed_bytes} allowed by the memory fraction)"
        raise SimulatedOutOfMemoryError(
            f"simulated CUDA out of memory: tried to allocate {alloc_size} bytes for a request of "
            f"{size} bytes on stream {stream} (rounded to {rounded}); {limit}, {free} free, "
            f"{self.reserved_bytes} reserved, {self.allocated_bytes} allocated, "
            f"{self.reserved_bytes - self.allocated_bytes} reserved but unallocated after "
            "emptying the cache. Fix: a smaller request, a larger capacity, or free memory first"
        )

    # -- internals: input checks --------------------------------------------------------------

    def _check_size(self, size: Any) -> int:
        try:
            n = size.__index__()
        except (AttributeError, TypeError):
            n = None
        if n is None or isinstance(size, bool) or n < 1:
            raise InvalidInputError(
                f"malloc size must be an int >= 1 byte, got {size!r} (PyTorch never calls the "
                "allocator for 0 bytes)"
            )
        if n >= _HUGE:
            raise SimulatedOutOfMemoryError(
                f"simulated CUDA out of memory: tried to allocate {n} bytes, more than 1 EiB "
                "(PyTorch refuses such requests before the allocator)"
            )
        return int(n)

    def _bad_free(self, address: int) -> NoReturn:
        if address in self._pending:
            raise InvalidInputError(f"double free of address {address}: its free is pending")
        raise InvalidInputError(
            f"free of address {address}, which is not an allocated block; pass an address "
            "malloc returned, once"
        )
