"""What a what-if replays: a snapshot, a torchmem trace or an estimate, its devices, a capacity.

:func:`what_to_replay` turns the input of :func:`torchmem.sim.whatif` into the snapshot to replay
(a torchmem trace: its requests only), where it came from and a known capacity (an estimate's
GPU); :func:`replay_devices` picks the devices with allocator history, or says how to record it;
:func:`parse_capacity` reads bytes or a size. Private to :mod:`torchmem.sim.whatif`.

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> a = CachingAllocator(); _ = a.malloc(100)
    >>> inp = what_to_replay(a.snapshot()); inp.source, replay_devices(inp.snapshot, None)
    ('snapshot', [0])
    >>> parse_capacity("2 MiB")
    2097152
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Snapshot
from torchmem.units import parse_bytes

__all__ = ["HISTORY_HINT", "Input", "parse_capacity", "replay_devices", "what_to_replay"]

_REQUESTS = ("alloc", "free_requested", "free_completed")

#: How to record the allocator history a what-if needs.
HISTORY_HINT = (
    "record with torch.cuda.memory._record_memory_history(max_entries=1000000) (or "
    "torchmem.record_history()) before the run and dump the snapshot after it "
    "(torch.cuda.memory._dump_snapshot)"
)


@dataclass
class Input:
    """The snapshot a what-if replays, its ``source`` (``"snapshot"``, ``"trace"`` or
    ``"estimate"``), a known ``capacity`` (an estimate's GPU) and ``notes`` on it.

    Example:
        >>> Input(Snapshot(), "snapshot").capacity is None
        True
    """

    snapshot: Snapshot
    source: str
    capacity: int | None = None
    notes: list[str] = field(default_factory=list)


def _requests_only(snap: Snapshot) -> Snapshot:
    """A torchmem trace's snapshot with only its requests (no one-segment-per-storage entries)."""
    out = Snapshot()
    out.source = snap.source
    out.device_names = dict(snap.device_names)
    out.stacks = snap.stacks
    for dev, t in snap.traces.items():
        nt = out.new_trace(dev)
        names = t.action_names
        keep = {names.index(a) for a in _REQUESTS if a in names}
        for i in range(len(t)):
            if t.actions[i] in keep:
                nt.append(names[t.actions[i]], t.addrs[i], t.sizes[i], t.streams[i],
                          t.times[i] if t.has_time else None, t.stack_ids[i])
    return out


def what_to_replay(obj: Any) -> Input:
    """A snapshot, a torchmem trace, or an estimate, as what the what-if replays.

    Example:
        >>> what_to_replay(42)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: what-if replays a Snapshot (torchmem.io.load_snapshot), ... got int
    """
    from torchmem.model.trace import Trace

    if isinstance(obj, Trace):
        from torchmem.io.convert import snapshot_from_trace

        obj = snapshot_from_trace(obj)
    if isinstance(obj, Snapshot):
        if obj.source.format != "torchmem-events":
            return Input(obj, "snapshot")
        notes = [n for n in obj.notes if "left out" in n]
        notes.insert(0, (
            "a torchmem trace: its storage allocations and frees are the requests (stream 0), fed "
            "to the simulated CUDA caching allocator; no caching allocator was recorded, so the "
            "'recorded' column is the default settings, simulated"
        ))
        return Input(_requests_only(obj), "trace", notes=notes)
    if hasattr(obj, "snapshot") and hasattr(obj, "usable_bytes"):  # torchmem.fit.Estimate
        if obj.snapshot is None:
            raise InvalidInputError(
                "the estimate holds no simulated run; make it with "
                "torchmem.estimate(..., keep_snapshot=True) and pass that estimate"
            )
        return Input(obj.snapshot, "estimate", capacity=int(obj.usable_bytes),
                      notes=[f"an estimate on {getattr(obj, 'gpu', '?')}: its simulated run"])
    raise InvalidInputError(
        f"what-if replays a Snapshot (torchmem.io.load_snapshot), a torchmem Trace or an Estimate "
        f"made with keep_snapshot=True, got {type(obj).__name__}"
    )


def parse_capacity(capacity: int | str | None) -> int | None:
    """Bytes from an int or a size such as ``"24 GiB"`` (``None`` stays ``None``: unlimited).

    Example:
        >>> parse_capacity("1 GiB"), parse_capacity(None)
        (1073741824, None)
    """
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, (int, str)):
        raise InvalidInputError(
            f"capacity must be bytes (an int > 0) or a size such as '24 GiB', got "
            f"{type(capacity).__name__} {capacity!r}"
        )
    n = parse_bytes(capacity) if isinstance(capacity, str) else capacity
    if n <= 0:
        raise InvalidInputError(f"capacity must be > 0 bytes, got {capacity!r}")
    return n


def replay_devices(snap: Snapshot, device: int | None) -> list[int]:
    """The devices to replay: ``device``, or every one whose trace has an ``alloc`` entry; a
    snapshot without that history gets the error that says how to record it.

    Example:
        >>> replay_devices(Snapshot(), None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: what-if needs the allocator history: the snapshot has 0 segments ...
    """
    with_history = [d for d in sorted(snap.traces) if snap.trace(d).count("alloc")]
    where = snap.source.path or "the snapshot"
    if device is not None:
        if device not in snap.devices and device not in snap.traces:
            raise InvalidInputError(
                f"device {device} is not in {where}; it has devices {snap.devices or '(none)'}"
            )
        if device not in with_history:
            raise InvalidInputError(
                f"what-if needs the allocator history: {where} has no alloc entries in the trace "
                f"of device {device}; {HISTORY_HINT}"
            )
        return [device]
    if not with_history:
        n_seg = len(snap.segments)
        n_ent = sum(len(t) for t in snap.traces.values())
        raise InvalidInputError(
            f"what-if needs the allocator history: {where} has {n_seg} segments and "
            f"{n_ent} trace entr{'y' if n_ent == 1 else 'ies'} but no alloc entry on any device; "
            f"{HISTORY_HINT}"
        )
    return with_history
