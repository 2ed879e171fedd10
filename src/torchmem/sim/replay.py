"""Replay a snapshot's trace through :class:`~torchmem.sim.CachingAllocator` and compare.

Most traces are a ring buffer that starts mid-run, so the allocator's state at the start of the
trace is rebuilt from the snapshot's end state by walking the trace backwards
(:func:`start_state`, in :mod:`torchmem.sim._start`); slack that no entry records is then settled
against the trace's own best-fit decisions.

The simulator (configured from the snapshot's ``allocator_settings``) is seeded with that state
(:meth:`~torchmem.sim.CachingAllocator.add_segment`, at the real addresses), then fed the trace:
``alloc`` -> ``malloc``, ``free_completed`` -> ``free`` (a ``free_requested`` only lowers the
allocated bytes, as PyTorch's statistics do), a run of ``segment_free``/``segment_unmap`` ->
one ``empty_cache()``, unless it is the out-of-memory retry of the next alloc with
``max_split_size`` set (only oversize blocks released): then the simulator retries that alloc
itself on a device just too small for it. New simulated segments take the addresses of the
trace's ``segment_alloc`` entries in order, so with a correct simulator every block lands at its
real address. Expandable segments' virtual ranges are the driver's too: a range the simulator
opens starts at the real address of the request that opens it (its first block lies at the
range's start), and a range seeded from the start state begins at the lowest page the trace maps
in that stream's pool, when no other segment lies between.

Checks: the k-th simulated ``segment_alloc`` must have the size, stream and pool of the trace's
k-th (the pool of the request it served); every ``alloc`` should land at its real address, every
``segment_map`` at its address with its size; at the end the simulator's segments must equal the
snapshot's (``final_layout_equal``: the same multiset of segments, each with its size, stream and
blocks as offset, size and whether active). The peaks of allocated (whole blocks, lowered at ``free_requested``), requested and reserved bytes over the
trace are reported too.

Over 800 lines: the replay loop, the settling of open slack, which reruns it, and the
explanation of its divergences share one class's state.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> e = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0, "frames": []}
    >>> snap = from_pytorch({"segments": [], "device_traces": [[
    ...     e("segment_alloc", 1 << 30, 2 << 20), e("alloc", 1 << 30, 100),
    ...     e("free_requested", 1 << 30, 100), e("free_completed", 1 << 30, 100)]]})
    >>> r = replay(snap)
    >>> r.segment_allocs_matched, r.segment_allocs_expected, r.first_divergence
    (1, 1, None)
    >>> r.final_layout_equal     # the snapshot lists no segments, the simulator keeps one
    False
    >>> r.peak_allocated_bytes, r.peak_requested_bytes, r.peak_reserved_bytes
    (512, 100, 2097152)
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError, TorchmemError
from torchmem.model.snapshot import Snapshot
from torchmem.sim._start import (
    SMALL_SIZE,
    StartSegment,
    seeding_order,
    slack_candidates,
    start_state,
)
from torchmem.sim.allocator import CachingAllocator, round_size, segment_size
from torchmem.sim.config import AllocatorConfig
from torchmem.units import format_bytes

__all__ = ["ReplayResult", "StartSegment", "TraceReplay", "replay", "start_state"]



@dataclass(frozen=True)
class ReplayResult:
    """How well the simulator reproduced one device trace.

    ``first_divergence`` is ``None`` when every decision matched, else a dict with ``kind``
    (``"segment_alloc"``: the k-th new segment differs in size, stream or pool, or is missing on
    one side; ``"alloc"``: a block landed at another address), ``index`` (k, the 0-based ``segment_alloc`` count, or the
    0-based ``alloc`` count), ``entry`` (the trace-entry index where it shows), ``expected`` and
    ``got`` (for ``segment_alloc``: each ``{"size", "stream", "pool"}`` or ``None`` when that side
    made no k-th ``segment_alloc``; for ``alloc``: ``{"address", "segment", "offset"}``), ``request`` (the
    ``alloc`` entry behind it: ``{"entry", "size", "stream"}``), ``simulated`` (what the simulator
    did instead: the block it gave and its segment) and ``explanation`` (in words).
    ``final_layout_equal`` says whether the simulator's final segments equal the snapshot's.
    ``segment_maps_expected`` counts the trace's ``segment_map`` entries (expandable segments),
    ``segment_maps_matched`` those the simulator mapped at the same address and size, in order.

    ``start`` is ``"empty"`` (the trace starts from an empty allocator) or ``"rebuilt"`` (a
    mid-run trace: the state at its start was rebuilt, see :func:`start_state`); ``notes`` say
    what could not be checked and why (a state-only file, ...). The peaks cover the start state
    and every entry.

    Example:
        >>> ReplayResult(0, 2, 2, None, True).to_dict()["segment_allocs_matched"]
        2
    """

    device: int
    segment_allocs_expected: int
    segment_allocs_matched: int
    first_divergence: dict[str, Any] | None
    final_layout_equal: bool
    allocs_expected: int = 0
    allocs_matched: int = 0
    segment_maps_expected: int = 0
    segment_maps_matched: int = 0
    start: str = "empty"
    start_segments: int = 0
    start_live_blocks: int = 0
    peak_allocated_bytes: int = 0
    peak_requested_bytes: int = 0
    peak_reserved_bytes: int = 0
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields (the issue's five keys first).

        Example:
            >>> list(ReplayResult(0, 1, 0, None, False).to_dict())[:5]
            ['device', 'segment_allocs_expected', 'segment_allocs_matched', 'final_layout_equal', 'first_divergence']
        """
        d = asdict(self)
        d["notes"] = list(self.notes)
        first = ("device", "segment_allocs_expected", "segment_allocs_matched",
                 "final_layout_equal", "first_divergence")
        return {**{k: d.pop(k) for k in first}, **d}


class _TraceAllocator(CachingAllocator):
    """A simulator whose new segments take the addresses the real allocator got, in order."""

    def __init__(
        self,
        capacity: int | None = None,
        config: AllocatorConfig | None = None,
        memory_fraction: float | None = None,
    ) -> None:
        super().__init__(capacity, config, memory_fraction=memory_fraction)
        self.real_addresses: list[int] = []  # the trace's segment_alloc addresses, in order
        self._used = 0
        #: the real address of the request being replayed: where a new expandable range starts
        #: (its first block is at the range's start), None when the real addresses are not used
        self.request_address: int | None = None
        #: (stream, small) -> the lowest page the trace shows of that pool's virtual range
        self.range_starts: dict[tuple[int, bool], int] = {}

    def _segment_address(self, size: int) -> int:
        if self._used < len(self.real_addresses):
            addr = self.real_addresses[self._used]
            self._used += 1
            self._next_address = max(self._next_address, addr + size)
            return addr
        return super()._segment_address(size)

    def _expandable_address(self, size: int) -> int:
        a = self.request_address
        if a is not None and self._room_at(a):
            return a
        return super()._expandable_address(size)

    def _range_start(self, address: int, stream: int, small: bool) -> int:
        return min(address, self.range_starts.get((stream, small), address))


def _config_from(snapshot: Snapshot, config: AllocatorConfig | str | None) -> AllocatorConfig:
    """The allocator configuration: ``config`` if given, else the snapshot's settings."""
    if isinstance(config, str):
        return AllocatorConfig.parse(config)
    if config is not None:
        return config
    cfg = AllocatorConfig.from_settings(snapshot.allocator_settings)
    if not cfg.expandable_segments and shows_expandable(snapshot):
        # a snapshot without settings (older PyTorch, or removed) whose segments or trace show
        # expandable segments was recorded with them
        cfg = replace(cfg, expandable_segments=True)
    return cfg


def shows_expandable(snapshot: Snapshot, device: int | None = None) -> bool:
    """Whether the snapshot (one ``device`` of it, or any) shows expandable segments: a
    segment is one, or a trace maps or unmaps pages.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> shows_expandable(from_pytorch({"segments": [], "device_traces": [[]]}))
        False
    """
    devices = snapshot.devices if device is None else [device]
    segments = snapshot.segments if device is None else snapshot.segments_of(device)
    if any(s.is_expandable for s in segments):
        return True
    return any(snapshot.trace(d).count(a) for d in devices
               for a in ("segment_map", "segment_unmap"))


def ran_expandable(snapshot: Snapshot, device: int) -> bool:
    """Whether ``device`` ran with expandable segments: the snapshot's allocator settings say
    so, or its segments or trace show them (:func:`shows_expandable`).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> ran_expandable(from_pytorch({"segments": [], "device_traces": [[]],
        ...     "allocator_settings": {"expandable_segments": True}}), 0)
        True
    """
    return (AllocatorConfig.from_settings(snapshot.allocator_settings).expandable_segments
            or shows_expandable(snapshot, device))


class TraceReplay:
    """Step one device's trace through a simulator seeded with the state at the trace's start.

    :func:`replay` runs it to the end and returns :meth:`result`; the viewer and the OOM report
    use it directly: :meth:`run` stops before any entry (then :attr:`allocator` is the simulated
    state there), :attr:`block_sizes` gives the simulated block size of every ``alloc`` entry
    replayed so far (0 for other entries). ``config`` overrides the snapshot's allocator settings
    (an ``AllocatorConfig`` or a ``PYTORCH_CUDA_ALLOC_CONF`` string) and ``capacity`` limits the
    simulated device (then an ``alloc`` may raise
    :class:`~torchmem.errors.SimulatedOutOfMemoryError`), ``memory_fraction`` as in
    :class:`~torchmem.sim.CachingAllocator`. ``real_addresses=False`` gives new segments fresh
    simulated addresses instead of the trace's (for what-if runs under other settings, whose
    segments differ from the real ones). ``start`` is a start state to use instead of the one
    rebuilt from the snapshot. ``stop_at_divergence`` makes :meth:`run` stop after the first
    ``alloc`` that lands at another address than the real one (when only an exact replay is
    useful).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> e = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0}
        >>> snap = from_pytorch({"segments": [], "device_traces": [[
        ...     e("segment_alloc", 1 << 30, 20 << 20), e("alloc", 1 << 30, 19 << 20)]]})
        >>> r = TraceReplay(snap); r.run(1); r.allocator.allocated_bytes
        0
        >>> r.run(); list(r.block_sizes)    # the 1 MiB tail is too small to split off
        [0, 20971520]
    """

    def __init__(
        self,
        snapshot: Snapshot,
        device: int = 0,
        *,
        config: AllocatorConfig | str | None = None,
        capacity: int | None = None,
        start: list[StartSegment] | None = None,
        memory_fraction: float | None = None,
        real_addresses: bool = True,
        stop_at_divergence: bool = False,
    ) -> None:
        self.snapshot = snapshot
        self.device = device
        t = snapshot.trace(device)
        self._trace = t
        self._names = t.action_names
        n = len(t)
        #: Entries applied so far.
        self.position = 0
        #: Simulated block size of each ``alloc`` entry (0 for the other entries).
        self.block_sizes = array("q", bytes(8 * n))
        self.notes: list[str] = []
        cfg = _config_from(snapshot, config)
        self._cfg = cfg
        self._round = _rounding(cfg)
        if start is None:
            start = _settle(snapshot, device, cfg)
        self.start_segments = start
        sim = _TraceAllocator(capacity, cfg, memory_fraction)
        self._real_addresses = real_addresses
        if real_addresses:
            sim.real_addresses = [
                t.addrs[i] for i in range(n) if self._names[t.actions[i]] == "segment_alloc"
            ]
        # the seeded ranges are the real ones whatever the new segments' addresses: they begin
        # where the trace shows their pages (so they end where the real ranges end)
        sim.range_starts = self._mapped_floors()
        self.allocator: CachingAllocator = sim
        self._pending: set[int] = set()  # addresses whose free_requested came, free_completed not
        self._bsize: dict[int, int] = {}  # real address of a live block -> its block size
        self._req: dict[int, int] = {}  # real address of a live block -> requested size
        self._addr_map: dict[int, int] = {}  # real -> simulated, for blocks allocated in the trace
        allocated = requested = 0
        for seg in seeding_order(self.start_segments):
            sim.add_segment(
                seg.address, seg.size, seg.stream, seg.layout(), small=seg.small,
                expandable=seg.expandable,
            )
        #: the virtual ranges seeded: (start, stream, small); a range may begin below its
        #: lowest run mapped at the start, where the trace maps pages
        self._seeded_ranges = [(s.addr, s.stream, s.small) for s in sim._segs.values() if s.page]
        for seg in self.start_segments:
            for addr, size, req, pending in seg.blocks:
                self._bsize[addr] = size
                self._req[addr] = req
                requested += req
                if pending:
                    self._pending.add(addr)
                else:
                    allocated += size
        self.allocated_bytes = allocated  # PyTorch's allocated_bytes (lowered at free_requested)
        self.requested_bytes = requested
        self.peak_allocated_bytes = allocated
        self.peak_requested_bytes = requested
        self.peak_reserved_bytes = sim.reserved_bytes
        #: The ``alloc`` entry after which the allocated bytes first reached their peak (-1: the
        #: start state, before any entry).
        self.peak_allocated_entry = -1
        self._expected: list[tuple[int, int, int]] = []  # (entry, size, stream)
        self._maps_expected: list[tuple[int, int]] = []  # the trace's segment_map (addr, size)
        self._maps_got: list[tuple[int, int]] = []  # the simulator's, in order
        self._got: list[tuple[int, int, int, int]] = []  # (entry, size, stream, address)
        self._allocs = 0
        self._allocs_matched = 0
        self._alloc_divergence: dict[str, Any] | None = None
        self._last = ""
        self._at = 0
        #: (entry, segments the trace released, segments empty_cache released) at the first run
        #: of segment_free entries that empty_cache did not reproduce
        self._release_mismatch: tuple[int, int, int] | None = None
        #: the alloc entry whose out-of-memory retry released the segments of a run of
        #: segment_free that is not a whole empty_cache, and the addresses it released
        self._retry: tuple[int, set[int]] | None = None
        self._halt = stop_at_divergence  # stop at the first alloc that lands elsewhere

    def skip(self, stop: int) -> None:
        """Pass over the entries up to (not including) ``stop`` without applying them (the
        what-if skips the allocator's own release before a recorded OOM: the simulator does
        what it needs itself when the request is tried again).

        Example:
            >>> r = TraceReplay(Snapshot()); r.skip(3); r.position
            3
        """
        self.position = self._at = max(self.position, stop)

    def run(self, stop: int | None = None) -> None:
        """Apply the trace's entries up to (not including) entry ``stop`` (default: all).

        Example:
            >>> r = TraceReplay(Snapshot()); r.run(); r.position
            0
        """
        t = self._trace
        n = len(t)
        stop = n if stop is None else min(max(stop, 0), n)
        names, acts, addrs, sizes, streams = self._names, t.actions, t.addrs, t.sizes, t.streams
        sim = self.allocator
        events = sim.events
        amap = self._addr_map
        halt = self._halt
        i = self.position
        try:
            self._run(i, stop, names, acts, addrs, sizes, streams, sim, events, amap, halt)
        finally:
            self.position = max(self.position, self._at)

    def _run(
        self, first: int, stop: int, names: list[str], acts: Any, addrs: Any, sizes: Any,
        streams: Any, sim: CachingAllocator, events: list[Any], amap: dict[int, int], halt: bool,
    ) -> None:
        code = {name: k for k, name in enumerate(names)}
        c_alloc, c_fr, c_fc = (code.get(x, -1) for x in ("alloc", "free_requested", "free_completed"))
        bsizes, reqs, pending = self._bsize, self._req, self._pending
        block_sizes, got = self.block_sizes, self._got
        malloc, free = sim.malloc, sim.free
        allocated, requested = self.allocated_bytes, self.requested_bytes
        peak_a, peak_q, peak_r = (
            self.peak_allocated_bytes, self.peak_requested_bytes, self.peak_reserved_bytes
        )
        n_allocs, matched, last = self._allocs, self._allocs_matched, self._last
        peak_at = self.peak_allocated_entry
        tsim = sim if self._real_addresses and isinstance(sim, _TraceAllocator) else None
        i = first
        try:
            for i in range(first, stop):
                c = acts[i]
                a = addrs[i]
                if c == c_alloc:
                    size = sizes[i]
                    n_events = len(events)
                    before = sim.allocated_bytes
                    if tsim is not None:
                        tsim.request_address = a
                    if self._retry is not None and self._retry[0] == i:
                        sa = self._malloc_after_release(size, streams[i])
                    else:
                        sa = malloc(size, streams[i])
                    bsize = sim.allocated_bytes - before
                    if len(events) - n_events > 1:  # more than the alloc: a new segment, ...
                        for ev in events[n_events:]:
                            if ev[0] == "segment_alloc":
                                got.append((i, ev[2], ev[3], ev[1]))
                            elif ev[0] == "segment_map":
                                self._maps_got.append((ev[1], ev[2]))
                    block_sizes[i] = bsize
                    bsizes[a] = bsize
                    reqs[a] = size
                    amap[a] = sa
                    n_allocs += 1
                    if sa == a:
                        matched += 1
                    elif self._alloc_divergence is None:
                        self._alloc_divergence = self._describe_alloc(n_allocs - 1, i, a, sa, bsize)
                        if halt:
                            i += 1
                            return
                    allocated += bsize
                    requested += size
                    if allocated > peak_a:
                        peak_a = allocated
                        peak_at = i
                    if requested > peak_q:
                        peak_q = requested
                    if sim.reserved_bytes > peak_r:
                        peak_r = sim.reserved_bytes
                    last = "alloc"
                    continue
                if c == c_fc:
                    try:
                        free(amap.pop(a, a))
                    except InvalidInputError:
                        raise InvalidInputError(
                            f"device {self.device}, trace entry {i} frees the address {a:#x}, "
                            "which the trace never allocated and the start state does not hold "
                            "(when the snapshot lists no segments of this device, the state "
                            "before the trace cannot be rebuilt); replay needs the snapshot's "
                            "segments or a trace that is complete from empty"
                        ) from None
                    if a in pending:
                        pending.discard(a)
                    else:
                        allocated -= bsizes.get(a, 0)
                    requested -= reqs.pop(a, 0)
                    bsizes.pop(a, None)
                    last = "free_completed"
                    continue
                if c == c_fr:
                    if a not in pending:
                        pending.add(a)
                        allocated -= bsizes.get(a, 0)
                    last = "free_requested"
                    continue
                act = names[c]
                if act == "segment_alloc":
                    self._expected.append((i, sizes[i], streams[i]))
                elif act == "segment_map":
                    self._maps_expected.append((a, sizes[i]))
                elif act in ("segment_free", "segment_unmap") and last not in (
                    "segment_free", "segment_unmap"
                ):
                    if act != "segment_free" or not self._oversize_release(i):
                        n_events = len(events)
                        sim.empty_cache()
                        if act == "segment_free" and self._release_mismatch is None:
                            self._check_release(i, n_events)
                last = act
            i = stop
        finally:
            self._at = i  # the entry an error stopped at, or where the replay ends
            self.allocated_bytes, self.requested_bytes = allocated, requested
            self.peak_allocated_bytes, self.peak_requested_bytes = peak_a, peak_q
            self.peak_reserved_bytes = peak_r
            self.peak_allocated_entry = peak_at
            self._allocs, self._allocs_matched, self._last = n_allocs, matched, last

    def _free_run(self, i: int) -> tuple[set[int], int]:
        """The addresses of the run of segment_free entries from ``i``, and the entry after it."""
        t, names = self._trace, self._names
        real: set[int] = set()
        j = i
        while j < len(t) and names[t.actions[j]] == "segment_free":
            real.add(t.addrs[j])
            j += 1
        return real, j

    def _oversize_release(self, i: int) -> bool:
        """Whether the run of segment_free from entry ``i`` is the out-of-memory retry of the
        alloc after it, releasing fewer segments than empty_cache would (``max_split_size``'s
        oversize release): then that alloc is replayed on a device just too small for a new
        segment, so that the simulator takes the same retry path itself."""
        if self._cfg.max_split_size_mb is None or self._cfg.expandable_segments:
            return False
        t, names = self._trace, self._names
        real, j = self._free_run(i)
        if j + 1 >= len(t) or names[t.actions[j]] != "segment_alloc" or names[t.actions[j + 1]] != "alloc":
            return False
        cached = {
            addr for addr, _size, _stream, blocks in self.allocator.layout()
            if len(blocks) == 1 and not blocks[0][2]
        }
        if cached == real:
            return False  # a whole empty_cache: replayed as one
        self._retry = (j + 1, real)
        return True

    def _malloc_after_release(self, size: int, stream: int) -> int:
        sim = self.allocator
        rounded = round_size(size, self._cfg)
        need = segment_size(rounded, self._cfg)
        n_events = len(sim.events)
        saved = sim.capacity
        sim.capacity = sim.reserved_bytes + need - 1  # the new segment does not fit as things are
        try:
            sa = sim.malloc(size, stream)
        except SimulatedOutOfMemoryError:  # it released all it could and still did not fit
            sim.capacity = saved
            sa = sim.malloc(size, stream)
        finally:
            sim.capacity = saved
        assert self._retry is not None
        at, real = self._retry
        done = {ev[1] for ev in sim.events[n_events:] if ev[0] == "segment_free"}
        if done != real and self._release_mismatch is None:
            self._release_mismatch = (at, len(real), len(done))
        self._retry = None
        return sa

    def _check_release(self, i: int, n_events: int) -> None:
        """Compare the run of segment_free entries from ``i`` with what empty_cache released."""
        real, _ = self._free_run(i)
        done = {ev[1] for ev in self.allocator.events[n_events:] if ev[0] == "segment_free"}
        if done != real:
            self._release_mismatch = (i, len(real), len(done))

    # -- reporting ------------------------------------------------------------------------------

    def _segment_of(self, address: int) -> tuple[int, int] | None:
        for seg_addr, size, _stream, _blocks in self.allocator.layout():
            if seg_addr <= address < seg_addr + size:
                return seg_addr, size
        return None

    def _describe_alloc(self, k: int, i: int, real: int, sim_addr: int, bsize: int) -> dict[str, Any]:
        t = self._trace
        seg = self._segment_of(sim_addr)
        real_seg = self._segment_of(real)
        size, stream = t.sizes[i], t.streams[i]
        got = {"address": sim_addr, "segment": seg[0] if seg else None,
               "offset": sim_addr - seg[0] if seg else None}
        expected = {"address": real, "segment": real_seg[0] if real_seg else None,
                    "offset": real - real_seg[0] if real_seg else None}
        where = (
            f"offset {expected['offset']} of the segment at {real_seg[0]:#x}" if real_seg
            else "memory the simulator does not hold"
        )
        why = (
            f"alloc #{k} (trace entry {i}): a request of {format_bytes(size)} ({size} B) on stream "
            f"{stream} got the block at {real:#x} ({where}) from the real allocator, but the "
            f"simulator gave it the {format_bytes(bsize)} block at {sim_addr:#x}"
        )
        if seg:
            why += f" (offset {sim_addr - seg[0]} of its {format_bytes(seg[1])} segment at {seg[0]:#x})"
        return {
            "kind": "alloc", "index": k, "entry": i, "expected": expected, "got": got,
            "request": {"entry": i, "size": size, "stream": stream},
            "simulated": {"address": sim_addr, "block_size": bsize,
                          "segment": seg[0] if seg else None, "segment_size": seg[1] if seg else None},
            "explanation": why,
        }

    def _next_alloc(self, i: int) -> int | None:
        t, names = self._trace, self._names
        for j in range(i, len(t)):
            if names[t.actions[j]] == "alloc":
                return j
        return None

    def _pool_of(self, entry: int | None) -> str | None:
        """The pool of the request at ``entry`` (small: rounded to at most 1 MiB)."""
        if entry is None:
            return None
        return "small" if self._round(self._trace.sizes[entry]) <= SMALL_SIZE else "large"

    def _segment_divergence(self) -> tuple[int, dict[str, Any] | None]:
        expected, got = self._expected, self._got
        matched = 0
        n_trace = len(self._trace)
        for k in range(max(len(expected), len(got))):
            exp = expected[k] if k < len(expected) else None
            sim_k = got[k] if k < len(got) else None
            exp_pool = self._pool_of(self._next_alloc(exp[0])) if exp is not None else None
            got_pool = self._pool_of(sim_k[0]) if sim_k is not None else None
            if (exp is not None and sim_k is not None and sim_k[1:3] == exp[1:3]
                    and exp_pool == got_pool):
                matched += 1
                continue
            entry = min(x[0] for x in (exp, sim_k) if x is not None) if (exp or sim_k) else n_trace - 1
            req_entry = self._next_alloc(exp[0]) if exp is not None else sim_k[0] if sim_k else None
            request = None
            if req_entry is not None:
                t = self._trace
                request = {"entry": req_entry, "size": t.sizes[req_entry], "stream": t.streams[req_entry]}
            d: dict[str, Any] = {
                "kind": "segment_alloc",
                "index": k,
                "entry": exp[0] if exp is not None else entry,
                "expected": None if exp is None else {"size": exp[1], "stream": exp[2], "pool": exp_pool},
                "got": None if sim_k is None else {"size": sim_k[1], "stream": sim_k[2], "pool": got_pool},
                "request": request,
                "simulated": None,
            }
            d["explanation"] = self._explain_segment(k, d)
            return matched, d
        return matched, None

    def _explain_segment(self, k: int, d: dict[str, Any]) -> str:
        exp, got, req = d["expected"], d["got"], d["request"]
        what = (
            f"request at trace entry {req['entry']} ({format_bytes(req['size'])}, {req['size']} B "
            f"on stream {req['stream']})" if req else "no request"
        )
        if exp is not None and got is not None:
            return (
                f"segment_alloc #{k}: for the {what} the real allocator created a "
                f"{format_bytes(exp['size'])} {exp['pool']}-pool segment on stream {exp['stream']}, "
                f"the simulator a {format_bytes(got['size'])} {got['pool']}-pool segment on stream "
                f"{got['stream']}"
            )
        if exp is not None:
            reuse = ""
            if req is not None and self.block_sizes[req["entry"]]:
                real = self._trace.addrs[req["entry"]]
                sim_addr = self._addr_map.get(real, real)
                seg = self._segment_of(sim_addr)
                bs = self.block_sizes[req["entry"]]
                d["simulated"] = {"address": sim_addr, "block_size": bs,
                                  "segment": seg[0] if seg else None,
                                  "segment_size": seg[1] if seg else None}
                reuse = f": it reused the free memory at {sim_addr:#x} (a {format_bytes(bs)} block"
                reuse += f" in its {format_bytes(seg[1])} segment at {seg[0]:#x})" if seg else ")"
            return (
                f"segment_alloc #{k}: for the {what} the real allocator created a new "
                f"{format_bytes(exp['size'])} segment on stream {exp['stream']}, the simulator "
                f"made no new segment{reuse}"
            )
        return (
            f"segment_alloc #{k}: for the {what} the simulator created a "
            f"{format_bytes(got['size'])} segment on stream {got['stream']}, the real allocator "
            "found room in its cache (the trace has no such segment_alloc)"
        )

    def _mapped_floors(self) -> dict[tuple[int, bool], int]:
        """(stream, small) -> the lowest page the trace maps of that pool's range below its
        lowest run mapped at the start (that range began there or lower); the pool of a
        ``segment_map`` is the pool of the request it maps for (the next ``alloc``)."""
        t, names = self._trace, self._names
        floors: dict[tuple[int, bool], int] = {}
        if "segment_map" not in names or not any(s.expandable for s in self.start_segments):
            return floors
        c_map = names.index("segment_map")
        for i in range(len(t)):
            if t.actions[i] == c_map:
                key = (t.streams[i], self._pool_of(self._next_alloc(i)) == "small")
                floors[key] = min(floors.get(key, t.addrs[i]), t.addrs[i])
        lowest: dict[tuple[int, bool], int] = {}
        for seg in self.start_segments:
            if seg.expandable:
                key = (seg.stream, seg.small)
                lowest[key] = min(lowest.get(key, seg.address), seg.address)
        # a floor with another start segment between it and the range's lowest run is not that
        # range's (a later range of the pool, or a page the pool's guess got wrong): not used
        return {
            key: lo for key, lo in floors.items()
            if key in lowest and lo < lowest[key] and not any(
                lo < s.address + s.size and s.address < lowest[key]
                for s in self.start_segments if (s.stream, s.small) != key or not s.expandable
            )
        }

    def _expandable_prefix(self) -> bool:
        """Whether the trace maps pages below the start of a seeded virtual range (the range
        above the page belongs to another pool than the range below it, or none is)."""
        runs: dict[int, list[tuple[int, bool]]] = {}
        for start, stream, small in self._seeded_ranges:
            runs.setdefault(stream, []).append((start, small))
        if not runs:
            return False
        t = self._trace
        for i in range(len(t)):
            if self._names[t.actions[i]] != "segment_map" or t.streams[i] not in runs:
                continue
            a = t.addrs[i]
            rs = runs[t.streams[i]]
            above = min((r for r in rs if r[0] > a), default=None)
            below = max((r for r in rs if r[0] <= a), default=None)
            if above is not None and (below is None or below[1] != above[1]):
                return True
        return False

    def _layouts_equal(self) -> bool:
        real_layout = sorted(
            (
                seg.total_size,
                seg.stream,
                tuple((b.address - seg.address, b.size, b.state != "inactive") for b in seg.blocks),
            )
            for seg in self.snapshot.segments_of(self.device)
        )
        sim_layout = sorted(
            (size, stream, tuple(blocks)) for _, size, stream, blocks in self.allocator.layout()
        )
        return real_layout == sim_layout

    def result(self) -> ReplayResult:
        """The comparison so far (complete once :meth:`run` reached the end).

        Example:
            >>> r = TraceReplay(Snapshot()); r.run(); r.result().final_layout_equal
            True
        """
        matched, seg_div = self._segment_divergence()
        divs = [d for d in (seg_div, self._alloc_divergence) if d is not None]
        first = min(divs, key=lambda d: d["entry"]) if divs else None
        notes = list(self.notes)
        t = self._trace
        n_replayable = sum(t.count(x) for x in ("alloc", "free_requested", "free_completed"))
        n_segs = len(self.start_segments)
        n_live = sum(len(s.blocks) for s in self.start_segments)
        if not self._allocs and not self._expected:
            notes.append(
                f"nothing to check: the trace of device {self.device} has {len(t)} entries and "
                f"no alloc or segment_alloc among them ({n_replayable} frees; a state-only "
                "snapshot), so no decision of the allocator is recorded to compare with; the "
                "simulator was only seeded with the rebuilt state and the layout comparison is "
                "trivial"
            )
        if self._release_mismatch is not None:
            at, n_real, n_sim = self._release_mismatch
            notes.append(
                f"at trace entry {at} the real allocator released {n_real} cached segment(s), the "
                f"replay {n_sim}: a run of segment_free is replayed as empty_cache (every free "
                "unsplit segment) unless it is the out-of-memory retry of the next alloc with "
                "max_split_size_mb set (oversize blocks only), which the simulator then retries "
                "itself"
            )
        if first is not None and self._expandable_prefix():
            notes.append(
                "underdetermined: the trace maps expandable-segment pages below the lowest page "
                "mapped at its start, so that virtual range began lower than any state in the "
                "file shows; the simulator's range starts at its lowest mapped page and places "
                "blocks differently there (the likely cause of the divergence)"
            )
        if n_segs and (self._allocs or self._expected):
            inferred = sum(s.inferred for s in self.start_segments)
            open_ = sum(s.undetermined for s in self.start_segments)
            note = (
                f"mid-run trace: the state at its start was rebuilt from the end state ({n_segs} "
                f"segments, {n_live} live blocks; {inferred} of them freed in the trace and sized "
                "from the layout: rounded request, plus the slack up to the next live block when "
                "that gap is too small to be a free large-pool block)"
            )
            if open_:
                note += (
                    f"; the slack of {open_} of those is not recorded anywhere (up to 1 MiB, "
                    "before a free block no alloc of the trace reached first): chosen to agree "
                    "with the trace's decisions"
                )
            notes.append(note)
        return ReplayResult(
            device=self.device,
            segment_allocs_expected=len(self._expected),
            segment_allocs_matched=matched,
            first_divergence=first,
            final_layout_equal=self._layouts_equal(),
            allocs_expected=self._allocs,
            allocs_matched=self._allocs_matched,
            segment_maps_expected=len(self._maps_expected),
            segment_maps_matched=sum(
                self._maps_expected[k] == self._maps_got[k]
                for k in range(min(len(self._maps_expected), len(self._maps_got)))
            ),
            start="empty" if n_segs == 0 else "rebuilt",
            start_segments=n_segs,
            start_live_blocks=n_live,
            peak_allocated_bytes=self.peak_allocated_bytes,
            peak_requested_bytes=self.peak_requested_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            notes=tuple(notes),
        )


def _rounding(cfg: AllocatorConfig) -> Callable[[int], int]:
    return lambda size: round_size(size, cfg)


def _free_block_at(sim: CachingAllocator, address: int) -> int | None:
    """Size of the simulator's free block that starts at ``address`` (None if there is none)."""
    for seg_addr, size, _stream, blocks in sim.layout():
        if seg_addr <= address < seg_addr + size:
            for off, bsize, allocated in blocks:
                if seg_addr + off == address and not allocated:
                    return bsize
            return None
    return None


def _settle(snapshot: Snapshot, device: int, cfg: AllocatorConfig) -> list[StartSegment]:
    """:func:`start_state`, its open slack (:func:`_settle_slack`) and the pools of expandable
    pages no block of the trace shows chosen to agree with the trace: while the replay diverges,
    each guessed piece's other pool is tried (up to 16 pieces), and kept when the replay then
    matches more allocations before it diverges."""
    pools: dict[int, bool] = {}
    segs = _settle_slack(snapshot, device, cfg, start_state(snapshot, device, cfg))
    guessed = {
        a: s.small for s in segs if s.expandable for a in s.guessed_pools
    }
    if not guessed:
        return segs
    best = _matched_before_divergence(snapshot, device, cfg, segs)
    for piece, small in sorted(guessed.items())[:16]:
        if best is None:
            break
        trial = {**pools, piece: not small}
        try:
            other = _settle_slack(snapshot, device, cfg, start_state(snapshot, device, cfg, trial))
            got = _matched_before_divergence(snapshot, device, cfg, other)
        except TorchmemError:  # that pool makes the start state impossible
            continue
        if got is None or got > best:
            pools, segs, best = trial, other, got
    return segs


def _matched_before_divergence(
    snapshot: Snapshot, device: int, cfg: AllocatorConfig, segs: list[StartSegment]
) -> int | None:
    """The allocations a replay from ``segs`` matches before it diverges (None: it does not)."""
    try:
        probe = TraceReplay(snapshot, device, config=cfg, start=segs, stop_at_divergence=True)
        probe.run()
    except TorchmemError:
        return -1
    if probe._alloc_divergence is None and probe._segment_divergence()[1] is None:
        return None
    return probe._allocs_matched


def _settle_slack(
    snapshot: Snapshot, device: int, cfg: AllocatorConfig, segs: list[StartSegment]
) -> list[StartSegment]:
    """The slack the trace leaves open in ``segs`` chosen to agree with it.

    A large block freed in the trace may carry up to 1 MiB of slack before a free block; when no
    alloc lands in that free block first, only best fit can tell its size: no slack (a block
    split off a larger one, the common case) is tried first, and each time the simulator takes that free block
    where the real allocator did not (request ``q``, real choice of size ``B``, or a new
    segment), free-block sizes in ``[q, B]`` (counting what merged into it since) are excluded
    and the replay is tried again with the smallest slack left.
    """
    rounding = _rounding(cfg)
    rows = {row[0]: (seg, row) for seg in segs for row in seg.blocks if row[0] in seg.open_slack}
    excluded: dict[int, list[tuple[int, int]]] = {}
    t = snapshot.trace(device)
    for _ in range(4 * len(rows) + 4 if rows else 0):
        probe = TraceReplay(snapshot, device, config=cfg, start=segs, stop_at_divergence=True)
        probe.run()
        d = probe._alloc_divergence
        if d is None:
            break
        got = d["got"]["address"]
        hit = next((a for a, (_s, row) in rows.items() if row[0] + row[1] == got), None)
        if hit is None:
            break
        seg, row = rows[hit]
        r, gap, limit = seg.open_slack[hit]
        i = d["entry"]
        before = TraceReplay(snapshot, device, config=cfg, start=segs)
        before.run(i)
        q = rounding(t.sizes[i])
        big = _free_block_at(before.allocator, d["expected"]["address"])
        # the free block the simulator took may have grown by merges since the start
        now = _free_block_at(before.allocator, got) or (gap - (row[1] - r))
        grown = gap + now - (gap - (row[1] - r))  # gap plus what merged into it
        excluded.setdefault(hit, []).append((grown - big if big is not None else -1, grown - q))
        slack = next(
            (x for x in slack_candidates(r >= cfg.max_split_size, gap, limit)
             if not any(lo <= x <= hi for lo, hi in excluded[hit])),
            None,
        )
        if slack is None or r + slack == row[1]:
            break
        row[1] = r + slack
    return segs


def replay(snapshot: Snapshot, device: int = 0, *, config: AllocatorConfig | str | None = None) -> ReplayResult:
    """Replay ``snapshot``'s trace of ``device`` through the simulator and compare.

    A mid-run trace starts from the state :func:`start_state` rebuilds. ``config`` overrides the
    snapshot's ``allocator_settings``. Raises :class:`~torchmem.errors.InvalidInputError` when the
    trace contradicts the snapshot's end state.

    Example:
        >>> replay(Snapshot()).segment_allocs_expected
        0
    """
    r = TraceReplay(snapshot, device, config=config)
    r.run()
    return r.result()
