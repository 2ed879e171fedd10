"""Expandable segments for :class:`torchmem.sim.CachingAllocator` (``expandable_segments:True``).

Each (stream, pool) reserves a virtual range of 1.125 x the device's memory, rounded up to whole
pages (2 MiB in the small pool, ``large_segment_size`` in the large one), and maps pages on
demand: the lowest-address run of free and unmapped blocks that covers a request is mapped
(``segment_map``) and merged with its free neighbours; ``empty_cache`` unmaps the whole pages
inside free blocks (``segment_unmap``) and gives back a range with nothing mapped. Best fit
compares a block by the size it could grow to (itself plus the unmapped block after it).
(``find_expandable_block``, ``map_block``, ``unmap_block``, ``release_blocks`` and the
expandable branch of ``get_free_block`` in ``c10/cuda/CUDACachingAllocator.cpp``.)

:class:`ExpandableMixin` holds those methods; it works on the allocator's own state, declared
below. Private: use :class:`~torchmem.sim.CachingAllocator`.

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> a = CachingAllocator(capacity=1 << 30, config="expandable_segments:True")
    >>> a.free(a.malloc(30 << 20)); a.empty_cache()
    >>> [(e[0], e[2] >> 20) for e in a.events if e[0].startswith("segment")]
    [('segment_map', 40), ('segment_unmap', 40)]
"""

from __future__ import annotations

from bisect import bisect_left, insort

from torchmem.errors import InvalidInputError

__all__ = ["SMALL_BUFFER", "ExpandableMixin", "Seg"]

SMALL_BUFFER = 2 << 20  # 2 MiB: every small-pool segment, and the small pool's page
_DEFAULT_DEVICE_BYTES = 80 << 30  # device memory assumed for expandable ranges without a capacity
_SHIFT = 64  # free-block keys: size << 64 | address
_MASK = (1 << _SHIFT) - 1


class Seg:
    """A segment: one cudaMalloc, or one expandable virtual range (``page`` > 0).

    Example:
        >>> Seg(4096, 2 << 20, 0, True, 0).page
        0
    """

    __slots__ = ("addr", "size", "stream", "small", "page")

    def __init__(self, addr: int, size: int, stream: int, small: bool, page: int) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.page = page


class ExpandableMixin:
    """The expandable-segment methods of :class:`~torchmem.sim.CachingAllocator`.

    Example:
        >>> issubclass(__import__("torchmem.sim").sim.CachingAllocator, ExpandableMixin)
        True
    """

    # the allocator's state these methods use (set in CachingAllocator.__init__)
    capacity: int | None
    reserved_bytes: int
    max_reserved_bytes: int
    events: list[tuple[str, int, int, int]]
    _expandable: bool
    _large_seg: int
    _segs: dict[int, Seg]
    _fsize: dict[int, int]
    _fend: dict[int, int]
    _usize: dict[int, int]
    _uend: dict[int, int]
    _unmapped: dict[tuple[bool, int], list[int]]
    _xstarts: list[int]
    _gc_base: dict[int, int]
    _next_address: int

    def _insert_free(self, addr: int, size: int, stream: int, small: bool) -> None:
        raise NotImplementedError  # CachingAllocator's

    def _remove_free(self, addr: int, size: int, stream: int, small: bool) -> None:
        raise NotImplementedError  # CachingAllocator's

    def _in_expandable(self, addr: int) -> bool:
        xs = self._xstarts
        if not xs:
            return False
        i = bisect_left(xs, addr + 1) - 1
        if i < 0:
            return False
        seg = self._segs[xs[i]]
        return addr < seg.addr + seg.size

    def _expandable_address(self, size: int) -> int:
        """Where the next expandable virtual range of ``size`` bytes starts (a subclass may choose
        another free address: the range is cut short before the next segment above it)."""
        addr = self._next_address
        for seg in self._segs.values():  # past every range (a seeded one may end above it)
            addr = max(addr, seg.addr + seg.size)
        self._next_address = addr + size
        return addr

    def _range_start(self, address: int, stream: int, small: bool) -> int:
        """Where a seeded virtual range whose lowest mapped page is ``address`` begins (a
        subclass that knows of lower pages may say; a lower start that does not fit is ignored)."""
        return address

    def _room_at(self, addr: int) -> bool:
        """Whether a new virtual range can start at ``addr``: outside every segment, or in the
        unmapped tail of an expandable range (guessed too long), which is then cut there."""
        for seg in self._segs.values():
            if not seg.addr <= addr < seg.addr + seg.size:
                continue
            if not seg.page:
                return False
            end = seg.addr + seg.size
            cut = seg.addr + (addr - seg.addr) // seg.page * seg.page
            ua = self._uend.get(end)
            if ua is None or ua < seg.addr or ua > cut or cut == seg.addr:
                return False  # pages mapped above the cut, or nothing below it
            self._remove_unmapped(ua, seg.stream, seg.small)
            if cut > ua:
                self._insert_unmapped(ua, cut - ua, seg.stream, seg.small)
            seg.size = cut - seg.addr
            return True
        return True

    def _range_size(self, addr: int, va: int, page: int) -> int:
        """``va`` bytes, cut to whole pages before the next segment above ``addr``."""
        later = [s for s in self._segs if s > addr]
        if later:
            va = min(va, (min(later) - addr) // page * page)
        return va

    def _expandable_best_fit(self, lst: list[int], i: int) -> int:
        """get_free_block's expandable twist: with expandable segments on, compare a block in an
        expandable range by the size it could grow to (itself plus the unmapped block after
        it); with them off (ranges seeded earlier), skip such blocks. -1: nothing fits."""
        n = len(lst)
        usize, segs = self._usize, self._segs
        only_expandable = len(segs) == len(self._xstarts)  # no cudaMalloc'd segment to tell apart
        in_exp = self._in_expandable
        if not only_expandable and not in_exp(lst[i] & _MASK):
            return i
        if not self._expandable:
            i += 1
            while i < n and in_exp(lst[i] & _MASK):
                i += 1
            return i if i < n else -1

        def grow(key: int) -> int:
            a, s = key & _MASK, key >> _SHIFT
            nxt = a + s
            return s + (usize.get(nxt, 0) if nxt not in segs else 0)

        g = grow(lst[i])
        while i + 1 < n:
            g_next = grow(lst[i + 1])
            if g_next >= g or not (only_expandable or in_exp(lst[i] & _MASK)):
                break
            i += 1
            g = g_next
        return i

    def _va_size(self, page: int) -> int:
        total = self.capacity if self.capacity is not None else _DEFAULT_DEVICE_BYTES
        want = total + total // 8
        return page * ((want + page - 1) // page)

    def _new_expandable_range(self, addr: int, size: int, stream: int, small: bool, page: int) -> None:
        self._segs[addr] = Seg(addr, size, stream, small, page)
        insort(self._xstarts, addr)
        self._insert_unmapped(addr, size, stream, small)

    def _insert_unmapped(self, addr: int, size: int, stream: int, small: bool) -> None:
        self._usize[addr] = size
        self._uend[addr + size] = addr
        insort(self._unmapped.setdefault((small, stream), []), addr)

    def _remove_unmapped(self, addr: int, stream: int, small: bool) -> int:
        size = self._usize.pop(addr)
        del self._uend[addr + size]
        lst = self._unmapped[(small, stream)]
        del lst[bisect_left(lst, addr)]
        return size

    def _find_expandable_block(self, rounded: int, small: bool, stream: int) -> int:
        fsize, usize, segs = self._fsize, self._usize, self._segs
        for ua in self._unmapped.get((small, stream), ()):
            c = ua
            if ua not in segs and ua in self._fend:
                c = self._fend[ua]
            total, b = 0, c
            while total < rounded:
                s = fsize.get(b)
                if s is None:
                    s = usize.get(b)
                if s is None:
                    break
                total += s
                b += s
                if b in segs:
                    break
            if total >= rounded:
                return c
        page = SMALL_BUFFER if small else self._large_seg
        va = self._va_size(page)
        if va < rounded:  # a virtual range of the device's size cannot hold it: out of memory
            return -1
        addr = self._expandable_address(va)
        va = self._range_size(addr, va, page)
        if va < rounded:
            return -1
        self._new_expandable_range(addr, va, stream, small, page)
        return addr

    def _try_allocate_expandable_block(self, rounded: int, small: bool, stream: int) -> tuple[int, int] | None:
        c = self._find_expandable_block(rounded, small, stream)
        if c < 0:
            return None
        if c in self._usize:
            c = self._map_block(c, min(self._usize[c], rounded), stream, small)
            if c < 0:
                return None
        while self._fsize[c] < rounded:
            nxt = c + self._fsize[c]
            c = self._map_block(nxt, min(rounded - self._fsize[c], self._usize[nxt]), stream, small)
            if c < 0:
                return None
        size = self._fsize[c]
        self._remove_free(c, size, stream, small)
        return c, size

    def _seg_of(self, addr: int) -> Seg:
        return self._segs[self._xstarts[bisect_left(self._xstarts, addr + 1) - 1]]

    def _map_block(self, addr: int, size: int, stream: int, small: bool) -> int:
        """Map the pages covering ``size`` bytes from the unmapped block at ``addr``; merge the
        mapped part with free neighbours; return the merged free block's address, -1 if full."""
        seg = self._seg_of(addr)
        page = seg.page
        off = addr - seg.addr
        first = off // page
        last = (off + size + page - 1) // page
        mapped = (last - first) * page
        if self.capacity is not None and self.reserved_bytes + mapped > self.capacity:
            return -1
        map_start = seg.addr + first * page
        usz = self._remove_unmapped(addr, stream, small)
        if usz > mapped:
            self._insert_unmapped(addr + mapped, usz - mapped, stream, small)
        # merge with free mapped neighbours (try_merge_blocks with prev, then next)
        start, total = addr, mapped
        if addr not in self._segs and addr in self._fend:
            p = self._fend[addr]
            psize = self._fsize[p]
            self._remove_free(p, psize, stream, small)
            start, total = p, total + psize
        end = start + total
        if end not in self._segs and end in self._fsize:
            nsize = self._fsize[end]
            self._remove_free(end, nsize, stream, small)
            total += nsize
        self._insert_free(start, total, stream, small)
        self.reserved_bytes += mapped
        if self.reserved_bytes > self.max_reserved_bytes:
            self.max_reserved_bytes = self.reserved_bytes
        self.events.append(("segment_map", map_start, mapped, stream))
        return start

    def _unmap_block(self, addr: int, size: int, stream: int, small: bool) -> None:
        """Unmap the whole pages inside the free block; release the range if all is unmapped."""
        seg = self._seg_of(addr)
        page = seg.page
        begin = -(-(addr - seg.addr) // page) * page + seg.addr
        end = ((addr + size - seg.addr) // page) * page + seg.addr
        if begin >= end:
            return
        self._remove_free(addr, size, stream, small)
        self._gc_base.pop(addr, None)
        if begin > addr:
            self._insert_free(addr, begin - addr, stream, small)
        if addr + size > end:
            self._insert_free(end, addr + size - end, stream, small)
        ustart, usize = begin, end - begin
        if ustart not in self._segs and ustart in self._uend:
            p = self._uend[ustart]
            usize += self._remove_unmapped(p, stream, small)
            ustart = p
        if ustart + usize in self._usize and ustart + usize not in self._segs:
            usize += self._remove_unmapped(ustart + usize, stream, small)
        self._insert_unmapped(ustart, usize, stream, small)
        self.reserved_bytes -= end - begin
        self.events.append(("segment_unmap", begin, end - begin, stream))
        if ustart == seg.addr and usize == seg.size:  # nothing mapped: release the range
            self._remove_unmapped(ustart, stream, small)
            del self._segs[seg.addr]
            self._xstarts.remove(seg.addr)

    def _seed_expandable_range(self, address: int, size: int, stream: int, small: bool) -> None:
        page = SMALL_BUFFER if small else self._large_seg
        if size % page:
            raise InvalidInputError(
                f"add_segment(address={address:#x}, size={size}, expandable=True): a mapped range "
                f"is whole pages of {page} bytes in the {'small' if small else 'large'} pool"
            )
        host = None
        for ua in self._unmapped.get((small, stream), ()):
            if ua <= address and address + size <= ua + self._usize[ua]:
                host = ua
                break
        if host is None:
            for start, seg in self._segs.items():
                if address < start + seg.size and start < address + size:
                    raise InvalidInputError(
                        f"add_segment(address={address:#x}, size={size}): overlaps the existing "
                        f"segment [{start:#x}, {start + seg.size:#x}); segments must not overlap"
                    )
            host = self._range_start(address, stream, small)
            if host > address or (address - host) % page or any(
                host < start + seg.size and start < address for start, seg in self._segs.items()
            ):
                host = address  # a lower start that does not fit: the lowest mapped page
            va = self._range_size(host, self._va_size(page), page)
            self._new_expandable_range(host, va, stream, small, page)
        elif (address - self._seg_of(address).addr) % page:
            raise InvalidInputError(
                f"add_segment(address={address:#x}, expandable=True): not on a page boundary of "
                "the expandable range that holds it"
            )
        usz = self._remove_unmapped(host, stream, small)
        if address > host:
            self._insert_unmapped(host, address - host, stream, small)
        if host + usz > address + size:
            self._insert_unmapped(address + size, host + usz - address - size, stream, small)
        self.reserved_bytes += size
