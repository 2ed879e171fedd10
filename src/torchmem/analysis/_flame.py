"""Folded stacks (``root;...;leaf bytes``) of a snapshot for flame-graph tools.

The output opens in speedscope, ``flamegraph.pl`` and ``inferno``.

Example:
    >>> from torchmem.model.snapshot import Snapshot, Segment, Block, Frame
    >>> s = Snapshot()
    >>> s.segments = [Segment(0, 0, 1024, blocks=[Block(0, 1024, 1000, "active_allocated",
    ...                                                 (Frame("m.py", 4, "fwd"),))])]
    >>> flame(s)
    ['cuda:0;m.py:4:fwd 1024']
"""

from __future__ import annotations

from torchmem.analysis.frames import NO_STACK, is_internal_frame
from torchmem.analysis.replay import DeviceReplay, select_devices
from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Frame, Snapshot

__all__ = ["flame", "folded_stacks"]


def _flame_label(f: Frame) -> str:
    return f.label().replace(";", ":").replace(" ", "_")


def folded_stacks(
    snap: Snapshot,
    *,
    at: str = "end",
    device: int | None = None,
    filter_internal: bool = True,
    include_state: bool = False,
) -> list[str]:
    """Folded stacks (``root;...;leaf bytes``) for flamegraph.pl, speedscope, inferno.

    ``at="end"``: active blocks at the snapshot's end (their rounded block sizes);
    ``at="peak"``: allocations live at each device's peak (requested sizes). Each line starts
    with the device name (and the block state if ``include_state``); identical stacks are summed.
    ``device`` selects one device index (one with no data raises
    :class:`~torchmem.errors.InvalidInputError`).

    Example:
        >>> from torchmem.model.snapshot import Snapshot, Segment, Block, Frame
        >>> s = Snapshot()
        >>> st = (Frame("m.py", 4, "fwd"), Frame("t.py", 9, "main"))
        >>> s.segments = [Segment(0, 0, 2048, blocks=[Block(0, 1024, 1000, "active_allocated", st),
        ...                                           Block(1024, 1024, 1024, "active_allocated", st)])]
        >>> folded_stacks(s)
        ['cuda:0;t.py:9:main;m.py:4:fwd 2048']
    """
    if at not in ("end", "peak"):
        raise InvalidInputError(f"folded_stacks: at={at!r}; expected 'end' or 'peak'")
    acc: dict[str, int] = {}
    cache: dict[tuple[int, int], str] = {}

    def path(dev: int, sid: int) -> str:
        p = cache.get((dev, sid))
        if p is None:
            frames = snap.stacks[sid]
            kept = [f for f in frames if not (filter_internal and is_internal_frame(f))]
            parts = [snap.device_name(dev).replace(";", ":")]
            parts += [_flame_label(f) for f in reversed(kept)] or [NO_STACK]
            p = cache[(dev, sid)] = ";".join(parts)
        return p

    for dev in select_devices(snap, device):
        if at == "end":
            for seg in snap.segments:
                if seg.device != dev:
                    continue
                for b in seg.blocks:
                    if b.state == "inactive":
                        continue
                    line = path(dev, snap.intern_stack(b.frames))
                    if include_state:
                        a, _, rest = line.partition(";")
                        line = f"{a};{b.state};{rest}"
                    acc[line] = acc.get(line, 0) + b.size
        else:
            r = DeviceReplay(snap, dev)
            for size, sid in r.live_at(r.peak_index).values():
                line = path(dev, sid)
                acc[line] = acc.get(line, 0) + size
    return [f"{k} {v}" for k, v in sorted(acc.items()) if v > 0]


#: The short name, as in ``torchmem.analysis.flame(snap)``.
flame = folded_stacks
