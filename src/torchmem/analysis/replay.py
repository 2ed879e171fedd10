"""The replay engine: one device's allocator trace replayed against the snapshot's end state.

Every analysis that needs memory *over time* (peak, events, flame at the peak, OOM) and the
viewer's payload read the trace through this module, so they agree on what was live when.

Model: an allocation is live from its ``alloc`` entry to its ``free_completed`` entry (a
``free_requested`` block is still held by the allocator until its stream events complete). Sizes
are the entries' requested sizes, as in PyTorch's Active Memory Timeline. Traces are ring buffers
that usually start mid-run, so the live set *before* the first entry is derived backwards from
the snapshot's state at the end: the active blocks at the end, minus the allocations in the
trace, plus the frees in the trace. Reserved bytes are replayed the same way from
``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap``.

:class:`DeviceReplay` holds one device's replay: the running allocated and reserved bytes
(:attr:`~DeviceReplay.allocated`, :attr:`~DeviceReplay.reserved`, ``len(trace) + 1`` values,
computed with C-speed ``map``/``accumulate`` over the trace's columns), the live set at any
entry (:meth:`~DeviceReplay.live_at`) and the allocations with their lifetimes
(:meth:`~DeviceReplay.lifetimes`, what the viewer draws).

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> snap = from_pytorch({"segments": [], "device_traces": [[
    ...     {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "alloc", "addr": 512, "size": 50, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 0, "size": 100, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 512, "size": 50, "stream": 0, "frames": []}]]})
    >>> r = DeviceReplay(snap, 0)
    >>> r.allocated, r.peak_index, sorted(r.live_at(2).items())
    ([0, 100, 150, 50, 0], 2, [(0, (100, 0)), (512, (50, 0))])
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate, compress
from operator import mul

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import ACTIONS, Snapshot

__all__ = ["DeviceReplay", "Lifetimes", "initial_live", "replay", "running", "select_devices"]

#: Action codes of a :class:`~torchmem.model.snapshot.DeviceTrace` (its ``action_names`` start
#: with :data:`~torchmem.model.snapshot.ACTIONS`).
(ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
 SNAPSHOT, OOM) = range(9)
assert ACTIONS[FREE_COMPLETED] == "free_completed" and ACTIONS[OOM] == "oom"

_PAD = (0,) * 247
_SIGN = (1, 0, -1, 0, 0, 0, 0, 0, 0) + _PAD  # alloc +size, free_completed -size
_SIGN_RESERVED = (0, 0, 0, 1, -1, 1, -1, 0, 0) + _PAD  # segment_alloc/map +, segment_free/unmap -
_ALLOC_OR_FREE = (True, False, True) + (False,) * 253
_IS_ALLOC = (True,) + (False,) * 255
_CHANGES = frozenset((ALLOC, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP))

Live = dict[int, tuple[int, int]]  # address -> (requested size, stack id)


def running(initial: int, deltas: list[int]) -> list[int]:
    """Running totals: ``initial`` then the total after each delta (``len(deltas) + 1`` values).

    Example:
        >>> running(10, [5, -3, 0])
        [10, 15, 12, 12]
    """
    return list(accumulate(deltas, initial=initial))


def select_devices(snap: Snapshot, device: int | None) -> list[int]:
    """All devices with data (``device=None``) or ``[device]``; an index without data is an error
    (it would otherwise report zeros as if the device had been idle).

    Example:
        >>> select_devices(Snapshot(), None)
        []
        >>> select_devices(Snapshot(), 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: device 3 has no segments or trace entries ...
    """
    devices = snap.devices
    if device is None:
        return devices
    if device not in devices:
        have = ", ".join(map(str, devices)) or "none (the snapshot is empty)"
        raise InvalidInputError(
            f"device {device!r} has no segments or trace entries in this snapshot; expected one "
            f"of: {have}. Fix: pass one of those indexes, or no device for all of them"
        )
    return [device]


@dataclass
class Lifetimes:
    """Every allocation of one device's trace, with the entries that start and end it.

    Allocation ids are in stacking order: first the allocations live before the trace began
    (end-state active blocks the trace does not allocate, in address order; then frees with no
    alloc, in trace order), then the trace's allocations in order. Per allocation: ``addr``,
    ``size`` (requested), ``stack`` (snapshot stack id), ``stream``, ``entry`` (the trace entry
    that names it, -1 for an end-state block), ``start`` (its alloc entry, -1 before the trace),
    ``requested`` (its first ``free_requested``, -1 if none) and ``end`` (its
    ``free_completed``, ``len(trace)`` if live at the end). ``event_alloc`` is, per trace entry,
    the allocation an alloc or free entry refers to (else -1); ``live_at_end`` maps the
    addresses live at the end to their allocation; ``peak_bytes`` is the maximum of
    :meth:`live_bytes`.

    Example:
        >>> Lifetimes().n_pre
        0
    """

    n_pre: int = 0
    addr: array = field(default_factory=lambda: array("Q"))
    size: array = field(default_factory=lambda: array("Q"))
    stack: array = field(default_factory=lambda: array("I"))
    stream: array = field(default_factory=lambda: array("q"))
    entry: array = field(default_factory=lambda: array("i"))
    start: array = field(default_factory=lambda: array("i"))
    requested: array = field(default_factory=lambda: array("i"))
    end: array = field(default_factory=lambda: array("i"))
    event_alloc: array = field(default_factory=lambda: array("i"))
    live_at_end: dict[int, int] = field(default_factory=dict)
    signs: array = field(default_factory=lambda: array("B"))  # action codes, legacy free mapped
    peak_bytes: int = 0

    def live_bytes(self) -> list[int]:
        """Bytes live before the first entry and after each entry, from these lifetimes.

        Example:
            >>> from torchmem.io.pytorch_snapshot import from_pytorch
            >>> s = from_pytorch({"segments": [], "device_traces": [[
            ...     {"action": "alloc", "addr": 0, "size": 8, "stream": 0, "frames": []}]]})
            >>> DeviceReplay(s, 0).lifetimes().live_bytes()
            [0, 8]
        """
        size_of = array("Q", self.size)
        size_of.append(0)  # an entry with no allocation (-1) reads this 0
        # +size at an alloc, -size at the free_completed of one, 0 otherwise
        deltas = map(mul, map(size_of.__getitem__, self.event_alloc),
                     map(_SIGN.__getitem__, self.signs))
        return list(accumulate(deltas, initial=sum(self.size[: self.n_pre])))


class DeviceReplay:
    """One device's trace replayed against the snapshot's end state (see the module docs).

    Results are computed on first use and kept; the snapshot must not change meanwhile.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "segment_alloc", "addr": 0, "size": 4096, "stream": 0, "frames": []},
        ...     {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []},
        ...     {"action": "free_completed", "addr": 0, "size": 100, "stream": 0, "frames": []},
        ...     {"action": "segment_free", "addr": 0, "size": 4096, "stream": 0, "frames": []}]]})
        >>> r = DeviceReplay(s, 0)
        >>> r.allocated, r.reserved
        ([0, 0, 100, 0, 0], [0, 4096, 4096, 4096, 0])
    """

    def __init__(self, snap: Snapshot, device: int) -> None:
        self.snap = snap
        self.device = device
        self.trace = snap.trace(device)
        self._end_live: Live | None = None
        self._allocated: list[int] | None = None
        self._reserved: list[int] | None = None

    def end_live(self) -> Live:
        """``{addr: (requested size, stack id)}`` of the active blocks at the end (shared: copy
        it before changing it).

        Example:
            >>> from torchmem.model.snapshot import Snapshot, Segment, Block
            >>> s = Snapshot(); s.segments = [Segment(0, 0, 1024, blocks=[
            ...     Block(0, 512, 500, "active_allocated"), Block(512, 512, 0, "inactive")])]
            >>> DeviceReplay(s, 0).end_live()
            {0: (500, 0)}
        """
        if self._end_live is None:
            live: Live = {}
            intern = self.snap.intern_stack
            for seg in self.snap.segments:
                if seg.device != self.device:
                    continue
                for b in seg.blocks:
                    if b.state != "inactive":
                        live[b.address] = (b.requested_size, intern(b.frames))
            self._end_live = live
        return self._end_live

    def _deltas(self, sign: tuple[int, ...]) -> list[int]:
        t = self.trace
        return list(map(mul, t.sizes, map(sign.__getitem__, t.actions)))

    @property
    def allocated(self) -> list[int]:
        """Allocated (requested) bytes before the first entry and after each entry.

        Starts from the bytes of :meth:`end_live` minus the trace's net change, so it ends at
        the snapshot's active (requested) bytes.

        Example:
            >>> DeviceReplay(Snapshot(), 0).allocated
            [0]
        """
        if self._allocated is None:
            deltas = self._deltas(_SIGN)
            end = sum(v[0] for v in self.end_live().values())
            self._allocated = running(end - sum(deltas), deltas)
        return self._allocated

    @property
    def reserved(self) -> list[int]:
        """Reserved bytes before the first entry and after each entry (ends at the segments' total).

        Example:
            >>> DeviceReplay(Snapshot(), 0).reserved
            [0]
        """
        if self._reserved is None:
            deltas = self._deltas(_SIGN_RESERVED)
            end = sum(s.total_size for s in self.snap.segments if s.device == self.device)
            self._reserved = running(end - sum(deltas), deltas)
        return self._reserved

    @property
    def peak_index(self) -> int:
        """Entries applied at the first maximum of :attr:`allocated` (0 = before the first entry).

        Example:
            >>> DeviceReplay(Snapshot(), 0).peak_index
            0
        """
        a = self.allocated
        return a.index(max(a))

    @property
    def last_change(self) -> int:
        """Index of the last entry that changes allocated or reserved bytes (-1 if none).

        Example:
            >>> DeviceReplay(Snapshot(), 0).last_change
            -1
        """
        acts = self.trace.actions
        return next((i for i in range(len(acts) - 1, -1, -1) if acts[i] in _CHANGES), -1)

    def live_at(self, k: int) -> Live:
        """Allocations live after the first ``k`` entries, derived from the end state backwards.

        For every address touched by an ``alloc``/``free_completed`` at or after entry ``k``, the
        earliest such entry decides: a free means it was live at ``k`` (with the free's size),
        an alloc means it was not. Untouched addresses keep their end state. The stack of a block
        live at ``k`` is that of its ``alloc`` entry, where the trace holds it (a snapshot
        recorded with ``context="all"`` gives a free the stack of the code that freed it);
        else the free's own.

        Example:
            >>> from torchmem.io.pytorch_snapshot import from_pytorch
            >>> s = from_pytorch({"segments": [], "device_traces": [[
            ...     {"action": "free_completed", "addr": 8, "size": 7, "stream": 0, "frames": []}]]})
            >>> DeviceReplay(s, 0).live_at(0), DeviceReplay(s, 0).live_at(1)
            ({8: (7, 0)}, {})
        """
        t = self.trace
        acts, addrs, sizes, sids = t.actions, t.addrs, t.sizes, t.stack_ids
        idx = list(compress(range(k, len(acts)), map(_ALLOC_OR_FREE.__getitem__, acts[k:])))
        idx.reverse()
        first = dict(zip(map(addrs.__getitem__, idx), idx))  # later keys overwrite: earliest wins
        live = {a: v for a, v in self.end_live().items() if a not in first}
        freed = {a: i for a, i in first.items() if acts[i] == FREE_COMPLETED}
        for a, i in freed.items():
            live[a] = (sizes[i], sids[i])
        # the allocation's own stack: the last alloc of each such address before entry k
        need = set(freed)
        for i in reversed(list(compress(range(k), map(_IS_ALLOC.__getitem__, acts[:k])))):
            a = addrs[i]
            if a in need:
                need.discard(a)
                live[a] = (live[a][0], sids[i])
                if not need:
                    break
        return live

    def undo(self, live: Live, stop: int) -> int:
        """Walk the trace backwards from its end down to entry ``stop`` (inclusive), undoing
        entries in ``live``; returns the inconsistencies (an alloc whose address was not live).

        Example:
            >>> from torchmem.io.pytorch_snapshot import from_pytorch
            >>> s = from_pytorch({"segments": [], "device_traces": [[
            ...     {"action": "alloc", "addr": 8, "size": 7, "stream": 0, "frames": []}]]})
            >>> live = {8: (7, 0)}; DeviceReplay(s, 0).undo(live, 0), live
            (0, {})
        """
        t = self.trace
        acts, addrs, sizes, sids = t.actions, t.addrs, t.sizes, t.stack_ids
        bad = 0
        pop = live.pop
        for i in range(len(acts) - 1, stop - 1, -1):
            a = acts[i]
            if a == ALLOC:
                if pop(addrs[i], None) is None:
                    bad += 1
            elif a == FREE_COMPLETED:
                live[addrs[i]] = (sizes[i], sids[i])
        return bad

    def lifetimes(self) -> Lifetimes:
        """The allocations with their lifetimes, found by replaying the trace forwards.

        An allocation that predates the trace comes from the end state (an active block whose
        address the trace leaves untouched) or from its first free (``free_requested`` or
        ``free_completed``, or the legacy ``free``) with no alloc before it.

        Example:
            >>> from torchmem.io.pytorch_snapshot import from_pytorch
            >>> s = from_pytorch({"segments": [], "device_traces": [[
            ...     {"action": "free_completed", "addr": 0, "size": 7, "stream": 0, "frames": []},
            ...     {"action": "alloc", "addr": 8, "size": 5, "stream": 0, "frames": []}]]})
            >>> lt = DeviceReplay(s, 0).lifetimes()
            >>> lt.n_pre, list(lt.start), list(lt.end), lt.live_at_end
            (1, [-1, 1], [0, 2], {8: 1})
        """
        t = self.trace
        n = len(t)
        acts = t.actions
        if "free" in t.action_names:  # an older name; PyTorch's viewer also ends it there
            legacy = t.action_names.index("free")
            acts = array("B", (FREE_COMPLETED if a == legacy else a for a in acts))
        addrs, sizes, sids, streams = t.addrs, t.sizes, t.stack_ids, t.streams

        # Pass 1: which addresses are live at the end, and which frees have no alloc in the
        # trace (the first free of an address with no live alloc introduces one from before).
        live: set[int] = set()
        add, discard = live.add, live.discard
        pre_from_free: list[int] = []
        for i, (a, addr) in enumerate(zip(acts, addrs)):
            if a == ALLOC:
                add(addr)
            elif a == FREE_REQUESTED or a == FREE_COMPLETED:
                if addr not in live:
                    pre_from_free.append(i)
                    add(addr)
                if a == FREE_COMPLETED:
                    discard(addr)

        # typed arrays, not lists: a million entries hold no Python int objects
        al_addr, al_size = array("Q"), array("Q")
        al_stack, al_stream = array("I"), array("q")
        al_entry, al_start = array("i"), array("i")
        by_addr: dict[int, int] = {}  # address -> live allocation id
        intern = self.snap.intern_stack
        for seg in sorted(self.snap.segments_of(self.device), key=lambda s: s.address):
            for b in seg.blocks:  # live the whole trace: the bottom of the stack
                if b.state != "inactive" and b.address not in live:
                    by_addr[b.address] = len(al_addr)
                    al_addr.append(b.address)
                    al_size.append(b.requested_size or b.size)
                    al_stack.append(intern(b.frames))
                    al_stream.append(seg.stream)
                    al_entry.append(-1)
        pre_free: dict[int, int] = {}
        for i in pre_from_free:
            pre_free[i] = len(al_addr)
            al_addr.append(addrs[i])
            al_size.append(sizes[i])
            al_stack.append(sids[i])
            al_stream.append(streams[i])
            al_entry.append(i)
        n_pre = len(al_addr)
        al_start.extend(array("i", [-1]) * n_pre)
        al_req = array("i", [-1]) * n_pre
        al_end = array("i", [n]) * n_pre

        # Pass 2: allocations, free requests and frees; the peak of the live bytes on the way.
        ref = array("i", [-1]) * n
        live_bytes = peak = sum(al_size)
        for i, (a, addr) in enumerate(zip(acts, addrs)):
            if a == ALLOC:
                old = by_addr.get(addr)
                if old is not None and al_end[old] == n:  # a missing free_completed: close it here
                    al_end[old] = i
                ref[i] = by_addr[addr] = len(al_addr)
                size = sizes[i]
                live_bytes += size
                if live_bytes > peak:
                    peak = live_bytes
                al_addr.append(addr)
                al_size.append(size)
                al_stack.append(sids[i])
                al_stream.append(streams[i])
                al_entry.append(i)
                al_start.append(i)
                al_req.append(-1)
                al_end.append(n)
            elif a == FREE_REQUESTED or a == FREE_COMPLETED:
                pre = pre_free.get(i)
                if pre is not None:
                    by_addr[addr] = pre
                aid = by_addr.get(addr, -1)
                ref[i] = aid
                if aid >= 0:
                    if a == FREE_REQUESTED:
                        if al_req[aid] == -1:
                            al_req[aid] = i
                    else:
                        al_end[aid] = i
                        live_bytes -= al_size[aid]
                        del by_addr[addr]
        return Lifetimes(
            n_pre=n_pre, addr=al_addr, size=al_size, stack=al_stack, stream=al_stream,
            entry=al_entry, start=al_start, requested=al_req, end=al_end, event_alloc=ref,
            live_at_end=by_addr, signs=acts, peak_bytes=peak,
        )


def initial_live(snap: Snapshot, device: int) -> Live:
    """Allocations live *before* the first trace entry: ``{addr: (size, stack id)}``.

    Derived backwards: active blocks at the end, minus allocations in the trace, plus frees.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "free_completed", "addr": 512, "size": 7, "stream": 0, "frames": []}]]})
        >>> initial_live(s, 0)
        {512: (7, 0)}
    """
    r = DeviceReplay(snap, device)
    live = dict(r.end_live())
    r.undo(live, 0)
    return live


def replay(snap: Snapshot, device: int, initial: Live | None = None) -> Live:
    """Replay the trace forward from ``initial`` (default: :func:`initial_live`); the live set at the end.

    On a trace that is complete from an empty allocator, ``replay(snap, d, {})`` equals the
    snapshot's active blocks (checked on a real snapshot in the tests).

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "alloc", "addr": 0, "size": 7, "stream": 0, "frames": []}]]})
        >>> replay(s, 0, {})
        {0: (7, 0)}
    """
    live = dict(initial_live(snap, device) if initial is None else initial)
    t = snap.trace(device)
    for a, addr, size, sid in zip(t.actions, t.addrs, t.sizes, t.stack_ids):
        if a == ALLOC:
            live[addr] = (size, sid)
        elif a == FREE_COMPLETED:
            live.pop(addr, None)
    return live
