"""Build a :class:`~torchmem.model.snapshot.Snapshot` from the simulator's state and events.

Private helper of :meth:`torchmem.sim.CachingAllocator.snapshot`: segments with their blocks,
``segment_type``, ``is_expandable``, the ``allocator_settings`` and one device trace whose
``time_us`` is each event's index (the simulation has no clock).

Example:
    >>> snap = build_snapshot(0, [(4096, 2097152, 0, True, False, [(0, 2097152, 0, "inactive")])],
    ...                       [("segment_alloc", 4096, 2097152, 0)], {}, {}, None)
    >>> snap.segments[0].segment_type, snap.trace(0)[0].time_us
    ('small', 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Block, Frame, Segment, Snapshot

__all__ = ["Frames", "build_snapshot"]

#: A call stack given to ``malloc``: innermost first, each a Frame or {filename, line, name}.
Frames = Sequence[Union[Frame, Mapping[str, Any]]]


def _frames(snap: Snapshot, frames: Frames) -> tuple[Frame, ...]:
    out = []
    for f in frames:
        if isinstance(f, Frame):
            out.append(snap.intern_frame(f.filename, f.line, f.name))
        elif isinstance(f, Mapping):
            try:
                out.append(snap.intern_frame(str(f["filename"]), int(f["line"]), str(f["name"])))
            except (KeyError, TypeError, ValueError):
                raise InvalidInputError(
                    f"a malloc frame must be a Frame or a dict with filename, line (int) and "
                    f"name, got {dict(f)!r}"
                ) from None
        else:
            raise InvalidInputError(
                f"a malloc frame must be a Frame or a dict with filename, line and name, got "
                f"{type(f).__name__} {f!r}"
            )
    return tuple(out)


def build_snapshot(
    device: int,
    segments: Sequence[tuple[int, int, int, bool, bool, Sequence[tuple[int, int, int, str]]]],
    events: Sequence[tuple[str, int, int, int]],
    event_frames: Mapping[int, Frames],
    block_frames: Mapping[int, Frames],
    settings: dict[str, Any] | None,
    *,
    since: int = 0,
) -> Snapshot:
    """The snapshot of one device: ``segments`` as ``(address, size, stream, small, expandable,
    [(offset, size, requested, state)])``, ``events`` as ``(action, address, size, stream)``;
    the trace keeps the events from index ``since`` on (``time_us`` is the index in ``events``).

    Example:
        >>> build_snapshot(1, [], [], {}, {}, {"max_split_size": -1}).allocator_settings
        {'max_split_size': -1}
    """
    if not isinstance(device, int) or device < 0:
        raise InvalidInputError(f"device must be an int >= 0, got {device!r}")
    snap = Snapshot()
    snap.allocator_settings = settings
    snap.notes.append("simulated by torchmem.sim.CachingAllocator; time_us is the event index")
    private = 1 << 40  # allocator.PRIVATE_POOL: a private pool's streams
    for addr, size, stream, small, expandable, blocks in segments:
        snap.segments.append(
            Segment(
                device,
                addr,
                size,
                stream=stream % private,
                segment_pool_id=(0, stream // private),
                segment_type="small" if small else "large",
                is_expandable=expandable,
                blocks=[
                    Block(
                        addr + off,
                        bsize,
                        req,
                        state,
                        _frames(snap, block_frames[addr + off])
                        if state != "inactive" and addr + off in block_frames
                        else (),
                    )
                    for off, bsize, req, state in blocks
                ],
            )
        )
    trace = snap.new_trace(device)
    start = max(0, since)
    for i in range(start, len(events)):
        action, addr, size, stream = events[i]
        fr = event_frames.get(i)
        stack = snap.intern_stack(_frames(snap, fr)) if fr else 0
        trace.append(action, addr, size, stream % private, i, stack)
    return snap
