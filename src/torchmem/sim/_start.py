"""The allocator's state at the start of a trace, rebuilt from a snapshot's end state.

Walking the trace backwards: a segment the trace ``segment_alloc``-ed did not exist before it,
one it ``segment_free``-d did; pages it mapped (expandable segments) were unmapped, pages it
unmapped were mapped and free; a block it allocates was free before (part of a larger free block,
since free neighbours always merge), one it frees was allocated with the requested size the free
carries (``active_pending_free`` when the trace holds its ``free_completed`` but not its
``free_requested``). Blocks live at the start that the trace never touches keep their end-state
size; the size of a block freed in the trace is its rounded request plus the slack the allocator
must have left (a large-pool gap of at most 1 MiB cannot be a free block: every large-pool block is
larger than 1 MiB), or the slack the first alloc the trace puts after it shows. Free memory is what
the live blocks leave of each segment. Used by :mod:`torchmem.sim.replay` (which settles the slack
that no entry shows against the trace's decisions).

Example:
    >>> StartSegment(0, 2 << 20, 0, True, False, [[0, 512, 100, False]]).layout()
    [(0, 512, 100), (512, 2096640, 0)]
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Snapshot
from torchmem.sim.allocator import round_size
from torchmem.sim.config import AllocatorConfig

__all__ = ["StartSegment", "start_state"]

SMALL_SIZE = 1 << 20  # the largest small-pool block; every large-pool block is larger
_SMALL_BUFFER = 2 << 20  # every small-pool segment


@dataclass
class StartSegment:
    """One segment of the allocator's state at the start of a trace (see :func:`start_state`).

    ``blocks`` are ``[address, size, requested, pending]`` for the live blocks only, in address
    order (free memory is the rest); ``pending`` marks an ``active_pending_free`` block.
    :meth:`layout` gives the ``(offset, size, requested)`` cover that
    :meth:`~torchmem.sim.CachingAllocator.add_segment` takes (requested 0 = free).

    Example:
        >>> s = StartSegment(4096, 2 << 20, 0, True, False, [[4096, 1024, 1000, False]])
        >>> s.layout()
        [(0, 1024, 1000), (1024, 2096128, 0)]
    """

    address: int
    size: int
    stream: int
    small: bool
    expandable: bool
    blocks: list[list[Any]]
    inferred: int = 0
    undetermined: int = 0
    #: Blocks whose slack the trace leaves open: address -> (rounded request, gap to the next
    #: live block, the most slack the block can carry); see :func:`slack_candidates`.
    open_slack: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: Mapped pieces of an expandable run whose pool no block of the trace shows (only their
    #: size or the nearest block of the stream does): their starts; see :func:`start_state`'s
    #: ``pools``.
    guessed_pools: tuple[int, ...] = ()

    def layout(self) -> list[tuple[int, int, int]]:
        """The segment as ``(offset, size, requested)``, free gaps included (requested 0).

        Example:
            >>> StartSegment(0, 2 << 20, 0, True, False, []).layout()
            [(0, 2097152, 0)]
        """
        out: list[tuple[int, int, int]] = []
        pos = 0
        for addr, size, requested, _pending in self.blocks:
            off = addr - self.address
            if off > pos:
                out.append((pos, off - pos, 0))
            out.append((off, size, requested))
            pos = off + size
        if pos < self.size:
            out.append((pos, self.size - pos, 0))
        return out


def _fail(device: int, i: int | None, what: str) -> InvalidInputError:
    where = f"device {device}" if i is None else f"device {device}, trace entry {i}"
    return InvalidInputError(
        f"{where}: {what}; the trace does not agree with the snapshot's "
        "segments (was the snapshot taken from another process, or edited?), so the allocator's "
        "state at the start of the trace cannot be rebuilt"
    )


def start_state(
    snapshot: Snapshot,
    device: int = 0,
    config: AllocatorConfig | None = None,
    pools: dict[int, bool] | None = None,
) -> list[StartSegment]:
    """The allocator's segments and live blocks at the start of ``device``'s trace.

    Rebuilt from the snapshot's end state by walking the trace backwards (see the module
    docstring); ``config`` is the allocator's configuration (the default settings when not
    given): its rounding, and its ``max_split_size`` (a block at least that large is never
    split, so it may carry up to ``max_non_split_rounding`` of slack). Expandable pages that the
    trace unmaps were mapped at its start; their pool is the pool of the blocks the trace shows
    there, else a guess (listed in ``guessed_pools``) that ``pools`` (piece start -> small)
    overrides. A device without segments
    at the end whose trace does not agree with that starts empty (a trace without an end state).
    Raises :class:`~torchmem.errors.InvalidInputError` when the
    trace contradicts the end state (it frees a block twice, allocates in a segment that did not
    exist, ...).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> e = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0}
        >>> snap = from_pytorch({"segments": [{"device": 0, "address": 0, "total_size": 2097152,
        ...     "stream": 0, "segment_type": "small", "blocks": [
        ...       {"address": 0, "size": 2097152, "requested_size": 0, "state": "inactive"}]}],
        ...   "device_traces": [[e("free_requested", 1024, 700), e("free_completed", 1024, 700)]]})
        >>> [(s.address, s.blocks) for s in start_state(snap)]
        [(0, [[1024, 1024, 700, False]])]
    """
    if snapshot.segments_of(device):
        return _walk_back(snapshot, device, config, pools)
    try:  # no segment at the end: everything may have been released, or there is no end state
        return _walk_back(snapshot, device, config, pools)
    except InvalidInputError:
        return []  # a trace without an end state (hand-made): start empty


def _walk_back(
    snapshot: Snapshot, device: int, config: AllocatorConfig | None,
    pools: dict[int, bool] | None = None,
) -> list[StartSegment]:
    t = snapshot.trace(device)
    names = t.action_names
    acts, addrs, sizes, streams = t.actions, t.addrs, t.sizes, t.streams
    segs: dict[int, StartSegment] = {}
    live: dict[int, list[Any]] = {}  # address -> [size or None, requested, pending]
    first_free: dict[int, int] = {}  # address -> index of its earliest free entry
    # expandable segments: mapped pieces, start -> [end, stream, small]; merged into runs later
    # (small None: a piece the trace unmaps, whose pool is settled after the walk)
    mapped: dict[int, list[Any]] = {}
    for end_seg in snapshot.segments_of(device):
        small = end_seg.segment_type == "small"
        if end_seg.is_expandable:
            mapped[end_seg.address] = [end_seg.address + end_seg.total_size, end_seg.stream, small]
        else:
            segs[end_seg.address] = StartSegment(
                end_seg.address, end_seg.total_size, end_seg.stream, small, False, []
            )
        for blk in end_seg.blocks:
            if blk.state != "inactive":
                live[blk.address] = [blk.size, blk.requested_size, blk.state == "active_pending_free"]
    # the three common actions by code (a name the trace does not use gets no code: -1)
    code = {name: k for k, name in enumerate(names)}
    c_alloc, c_fc, c_fr = (code.get(x, -1) for x in ("alloc", "free_completed", "free_requested"))
    pop, get = live.pop, live.get
    for i in range(len(acts) - 1, -1, -1):
        c = acts[i]
        a = addrs[i]
        if c == c_alloc:
            if pop(a, None) is None:
                raise _fail(device, i, f"the alloc at {a:#x} is neither freed later nor live at the end")
            continue
        if c == c_fc:
            if a in live:
                raise _fail(device, i, f"the block at {a:#x} is freed while it was already free")
            live[a] = [None, sizes[i], True]
            first_free[a] = i
            continue
        if c == c_fr:
            first_free[a] = i
            row = get(a)
            if row is None:
                raise _fail(device, i, f"free_requested of {a:#x} without a live block there")
            row[2] = False
            continue
        act = names[c]
        if act == "segment_alloc":
            if segs.pop(a, None) is None:
                raise _fail(
                    device, i, f"the segment_alloc at {a:#x} is neither freed later nor in the end state"
                )
        elif act == "segment_free":
            if a in segs:
                raise _fail(device, i, f"the segment at {a:#x} is freed while it did not exist")
            size = sizes[i]
            segs[a] = StartSegment(a, size, streams[i], size == _SMALL_BUFFER, False, [])
        elif act == "segment_map":  # the pages were unmapped before
            if not _unmap_piece(mapped, a, a + sizes[i]):
                raise _fail(device, i, f"the pages mapped at {a:#x} are not mapped later")
        elif act == "segment_unmap":  # the pages were mapped (and free) before
            _map_piece(mapped, a, a + sizes[i], streams[i])
    cfg = config if config is not None else AllocatorConfig()
    guessed: set[int] = set()
    if any(v[2] is None for v in mapped.values()):
        guessed = _settle_pools(
            mapped, _pool_evidence(snapshot, device, cfg), cfg.large_segment_size, pools or {}
        )
    for start, end, stream, small in _runs(mapped):
        mine = tuple(sorted(a for a in guessed if start <= a < end))
        segs[start] = StartSegment(start, end - start, stream, small, True, [], guessed_pools=mine)
    # assign the live blocks to their segments, then size the ones freed in the trace
    order = sorted(segs)
    for a in sorted(live):
        k = bisect_right(order, a) - 1
        seg = segs[order[k]] if k >= 0 else None
        if seg is None or a >= seg.address + seg.size:
            raise _fail(device, None, f"the block at {a:#x}, live at the start, lies in no segment")
        seg.blocks.append([a, *live[a]])
    max_split = cfg.max_split_size
    oversize_limit = max(cfg.max_non_split_rounding_size, _SMALL_BUFFER) - 512
    for seg in segs.values():
        blocks = seg.blocks
        end = seg.address + seg.size
        for j, row in enumerate(blocks):
            nxt = blocks[j + 1][0] if j + 1 < len(blocks) else end
            if row[1] is None:
                seg.inferred += 1
                r = round_size(row[2], cfg)
                gap = nxt - (row[0] + r)
                large = not seg.small and not seg.expandable
                # a split leaves more than 1 MiB; an oversize block (>= max_split_size) is never
                # split: it took a whole free block less than max_non_split_rounding larger
                limit = oversize_limit if r >= max_split else SMALL_SIZE
                if large and 0 < gap <= SMALL_SIZE:
                    row[1] = r + gap  # too small to be a free large-pool block: slack
                elif large and gap > SMALL_SIZE:
                    # slack and a free block after it, or no slack: the first alloc the trace puts
                    # in that free block (before this block's free) lands at its front
                    stop = first_free.get(row[0], len(t))
                    slack = _front_slack(t, row[0] + r, nxt, stop, limit)
                    if slack is None:  # not shown by the trace: see slack_candidates
                        seg.undetermined += 1
                        seg.open_slack[row[0]] = (r, gap, limit)
                        slack = slack_candidates(r >= max_split, gap, limit)[0]
                    row[1] = r + slack
                else:
                    row[1] = r
            if row[0] + row[1] > nxt:
                raise _fail(
                    device, None,
                    f"the block at {row[0]:#x} ({row[1]} bytes), live at the start, overlaps the "
                    "next block or its segment's end",
                )
    return [segs[a] for a in order]


def seeding_order(segs: list[StartSegment]) -> list[StartSegment]:
    """Ordinary segments first; then the lowest mapped run of each expandable (stream, pool),
    highest first (a virtual range opened by the simulator ends before any range seeded
    already), then the other runs in address order (mapped into the range below them)."""
    plain = [s for s in segs if not s.expandable]
    firsts: dict[tuple[int, bool], StartSegment] = {}
    for s in segs:
        if s.expandable:
            firsts.setdefault((s.stream, s.small), s)
    heads = sorted(firsts.values(), key=lambda s: -s.address)
    rest = [s for s in segs if s.expandable and firsts[(s.stream, s.small)] is not s]
    return plain + heads + rest


def _same_pool(a: bool | None, b: bool | None) -> bool:
    """Whether two pieces can be one pool's (a pool not known yet, None, fits either)."""
    return a is None or b is None or a == b


def _unmap_piece(mapped: dict[int, list[Any]], lo: int, hi: int) -> bool:
    """Remove ``[lo, hi)`` from the mapped pieces (False when it is not mapped)."""
    for start, (end, stream, small) in list(mapped.items()):
        while end < hi and end in mapped and mapped[end][1] == stream and _same_pool(
            mapped[end][2], small
        ):
            nxt = mapped.pop(end)  # a run mapped in pieces
            end, small = nxt[0], small if small is not None else nxt[2]
            mapped[start] = [end, stream, small]
        if start <= lo and hi <= end:
            del mapped[start]
            if start < lo:
                mapped[start] = [lo, stream, small]
            if hi < end:
                mapped[hi] = [end, stream, small]
            return True
    return False


def _map_piece(mapped: dict[int, list[Any]], lo: int, hi: int, stream: int) -> None:
    """Add ``[lo, hi)`` to the mapped pieces, coalesced with its mapped neighbours of the same
    stream; its pool is theirs, else open (None: settled by :func:`_settle_pools`)."""
    small: bool | None = None
    for start, (end, s, sm) in list(mapped.items()):
        if s == stream and (end == lo or start == hi) and _same_pool(sm, small):
            del mapped[start]
            small = small if sm is None else sm
            lo, hi = min(lo, start), max(hi, end)
    mapped[lo] = [hi, stream, small]


def _pool_evidence(
    snapshot: Snapshot, device: int, cfg: AllocatorConfig
) -> dict[int, list[tuple[int, bool]]]:
    """stream -> sorted ``(address, small)`` of every block the trace or the end state shows:
    a request rounded to at most 1 MiB is served by the small pool, any other by the large one,
    and each pool's expandable pages lie in virtual ranges of their own."""
    t = snapshot.trace(device)
    names = t.action_names
    blocks = {k for k, name in enumerate(names) if name in ("alloc", "free_completed")}
    out: dict[int, set[tuple[int, bool]]] = {}
    for i in range(len(t)):
        if t.actions[i] in blocks:
            small = round_size(t.sizes[i], cfg) <= SMALL_SIZE
            out.setdefault(t.streams[i], set()).add((t.addrs[i], small))
    for seg in snapshot.segments_of(device):
        if seg.is_expandable:
            out.setdefault(seg.stream, set()).add((seg.address, seg.segment_type == "small"))
    return {stream: sorted(points) for stream, points in out.items()}


def _settle_pools(
    mapped: dict[int, list[Any]],
    evidence: dict[int, list[tuple[int, bool]]],
    page: int,
    pools: dict[int, bool],
) -> set[int]:
    """Give each piece of an open pool the pool of the blocks the trace shows inside it; else
    the small pool when it is not whole pages of ``page`` bytes (the large pool's page); else
    ``pools``' choice, or the pool of the nearest block of its stream (two pools' ranges are
    separate reservations). Returns the starts of the pieces whose pool was so guessed."""
    guessed: set[int] = set()
    for start, row in mapped.items():
        end, stream, small = row
        if small is not None:
            continue
        points = evidence.get(stream, [])
        k = bisect_right(points, (start, True))  # points[k - 1] at or below start, points[k] above
        if k and points[k - 1][0] == start:
            row[2] = points[k - 1][1]
        elif k < len(points) and points[k][0] < end:
            row[2] = points[k][1]
        elif (end - start) % page:
            row[2] = True
        else:
            guessed.add(start)
            near = min(points[max(k - 1, 0):k + 1], key=lambda p: abs(p[0] - start), default=None)
            row[2] = pools.get(start, near[1] if near is not None else False)
    return guessed


def _runs(mapped: dict[int, list[Any]]) -> list[tuple[int, int, int, bool]]:
    """Contiguous mapped runs (as a snapshot shows them): (start, end, stream, small)."""
    runs: list[list[Any]] = []
    for start in sorted(mapped):
        end, stream, small = mapped[start]
        if runs and runs[-1][1] == start and runs[-1][2] == stream and runs[-1][3] == small:
            runs[-1][1] = end
        else:
            runs.append([start, end, stream, small])
    return [(a, b, c, d) for a, b, c, d in runs]


def slack_candidates(oversize: bool, gap: int, limit: int) -> list[int]:
    """The slacks a large block can carry before a gap of ``gap`` bytes to the next live block,
    most likely first: up to ``limit``, leaving a free large-pool block (over 1 MiB) or nothing.
    A split block (under ``max_split_size``) most often has none; an oversize block took a whole
    cached block, so the whole gap when it can be slack.

    Example:
        >>> slack_candidates(False, 3 << 20, 1 << 20)[:3], slack_candidates(True, 3 << 20, 20 << 20)[0]
        ([0, 512, 1024], 3145728)
    """
    top = min(limit, gap - SMALL_SIZE - 512)
    out = list(range(0, top + 1, 512)) if top >= 0 else []
    if gap <= limit:
        out.insert(0, gap) if oversize else out.append(gap)
    return out or [0]


def _front_slack(t: Any, lo: int, hi: int, stop: int, limit: int) -> int | None:
    """Slack implied by the first ``alloc`` before entry ``stop`` in ``[lo, hi)`` (None if none)."""
    names, acts, addrs = t.action_names, t.actions, t.addrs
    for i in range(stop):
        a = addrs[i]
        if lo <= a < hi and names[acts[i]] == "alloc":
            return a - lo if a - lo <= limit else 0
    return None
