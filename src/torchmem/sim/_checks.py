"""Input checks of :meth:`torchmem.sim.CachingAllocator.add_segment` (private).

Example:
    >>> check_segment(0, 512, 0, [(0, 512, 0)])
"""

from __future__ import annotations

from collections.abc import Sequence

from torchmem.errors import InvalidInputError

__all__ = ["check_segment"]

MIN_BLOCK_SIZE = 512


def check_segment(address: int, size: int, stream: int, blocks: Sequence[tuple[int, int, int]]) -> None:
    """Validate ``CachingAllocator.add_segment``'s arguments; raise InvalidInputError saying
    what is wrong and how to fix it.

    Example:
        >>> check_segment(4096, 1024, 0, [(0, 512, 1), (512, 512, 1)])
        >>> check_segment(4096, 1024, 0, [(0, 512, 0), (512, 512, 0)])
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: add_segment(address=4096, size=1024): blocks 0 and 1 are both free; the allocator always merges free neighbours, so give them as one free block
    """
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
