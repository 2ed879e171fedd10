"""Replay a snapshot's trace through :class:`~torchmem.sim.CachingAllocator` and compare.

The trace must be complete from empty (the allocator held no segments when it started; most
traces are a ring buffer that starts mid-run). Its ``alloc`` and ``free_completed`` entries are
fed to a fresh simulator; ``free_requested`` is ignored (the block is freed when its
``free_completed`` arrives); a run of ``segment_free`` entries becomes one ``empty_cache()``.
Ties in best fit are broken by address, so each new simulated segment takes the address of the
trace's next ``segment_alloc`` (a fresh address when the trace has none left); block addresses
are then mapped from real to simulated in the order of the allocs. The simulator's k-th
``segment_alloc`` must have the same size and stream as the trace's k-th. At the end the
simulator's segments are compared with the snapshot's (``final_layout_equal``): the same multiset
of segments (size, stream, and each block's offset, size and whether it is active).

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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Snapshot
from torchmem.sim.allocator import CachingAllocator

__all__ = ["ReplayResult", "replay"]


@dataclass(frozen=True)
class ReplayResult:
    """How well the simulator reproduced one device trace's ``segment_alloc`` decisions.

    ``first_divergence`` is ``None`` when every one matched, else a dict with ``index`` (k, the
    0-based ``segment_alloc`` count), ``entry`` (the trace-entry index of the expected one, or of
    the last entry when the trace had fewer), ``expected`` and ``got`` (each ``{"size", "stream"}``
    or ``None`` when that side made no k-th ``segment_alloc``). ``final_layout_equal`` says
    whether the simulator's final segments equal the snapshot's (see the module docstring).

    Example:
        >>> ReplayResult(0, 2, 2, None, True).to_dict()["segment_allocs_matched"]
        2
    """

    device: int
    segment_allocs_expected: int
    segment_allocs_matched: int
    first_divergence: dict[str, Any] | None
    final_layout_equal: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields.

        Example:
            >>> ReplayResult(0, 1, 0, None, False).to_dict()["device"]
            0
        """
        return asdict(self)


class _TraceAllocator(CachingAllocator):
    """A simulator whose new segments take the addresses the real allocator got, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.real_addresses: list[int] = []  # the trace's segment_alloc addresses, in order
        self._used = 0

    def _segment_address(self, size: int) -> int:
        if self._used < len(self.real_addresses):
            addr = self.real_addresses[self._used]
            self._used += 1
            self._next_address = max(self._next_address, addr + size)
            return addr
        return super()._segment_address(size)


def replay(snapshot: Snapshot, device: int = 0) -> ReplayResult:
    """Replay ``snapshot``'s trace of ``device`` (complete from empty) through the simulator.

    Raises :class:`~torchmem.errors.InvalidInputError` when the trace frees an address it never
    allocated (it does not start from empty).

    Example:
        >>> from torchmem.model.snapshot import Snapshot
        >>> replay(Snapshot()).segment_allocs_expected
        0
    """
    sim = _TraceAllocator()
    entries = list(snapshot.trace(device))
    sim.real_addresses = [e.addr for e in entries if e.action == "segment_alloc"]
    addr_map: dict[int, int] = {}
    expected: list[tuple[int, int, int]] = []  # (entry index, size, stream)
    last_action = ""
    for i, e in enumerate(entries):
        action = e.action
        if action == "alloc":
            addr_map[e.addr] = sim.malloc(e.size, e.stream)
        elif action == "free_completed":
            sim_addr = addr_map.pop(e.addr, None)
            if sim_addr is None:
                raise InvalidInputError(
                    f"trace entry {i} of device {device} frees address {e.addr:#x}, which the trace "
                    "never allocated: replay needs a trace that is complete from empty"
                )
            sim.free(sim_addr)
        elif action == "segment_alloc":
            expected.append((i, e.size, e.stream))
        elif action == "segment_free" and last_action != "segment_free":
            sim.empty_cache()
        last_action = action
    got = [(size, stream) for act, _, size, stream in sim.events if act == "segment_alloc"]
    matched = 0
    divergence: dict[str, Any] | None = None
    n_trace = len(entries)
    for k in range(max(len(expected), len(got))):
        exp = expected[k] if k < len(expected) else None
        sim_k = got[k] if k < len(got) else None
        if exp is not None and sim_k == (exp[1], exp[2]):
            matched += 1
            continue
        divergence = {
            "index": k,
            "entry": exp[0] if exp is not None else n_trace - 1,
            "expected": None if exp is None else {"size": exp[1], "stream": exp[2]},
            "got": None if sim_k is None else {"size": sim_k[0], "stream": sim_k[1]},
        }
        break
    real_layout = sorted(
        (
            seg.total_size,
            seg.stream,
            tuple((b.address - seg.address, b.size, b.state != "inactive") for b in seg.blocks),
        )
        for seg in snapshot.segments
        if seg.device == device
    )
    sim_layout = sorted((size, stream, tuple(blocks)) for _, size, stream, blocks in sim.layout())
    return ReplayResult(device, len(expected), matched, divergence, real_layout == sim_layout)
