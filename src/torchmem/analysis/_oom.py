"""Out-of-memory entries explained: a full device, or fragmentation of the allocator's cache.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> s = from_pytorch({"segments": [], "device_traces": [[{"action": "oom",
    ...     "device_free": 0, "size": 1024, "stream": 0, "frames": []}]]})
    >>> [o.verdict for o in oom(s)]
    ['device full']
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torchmem.analysis.replay import OOM, DeviceReplay
from torchmem.model.snapshot import Snapshot
from torchmem.units import format_bytes as _fb

__all__ = ["OomEvent", "oom", "oom_report"]


@dataclass
class OomEvent:
    """An out-of-memory entry explained.

    ``verdict`` is ``"fragmentation"`` when the device's free bytes plus the allocator's cached
    free bytes would have covered the request (memory existed but not as one contiguous block),
    else ``"device full"``. ``cached_free_bytes`` is reserved minus allocated at that moment;
    ``largest_free_block`` is known only when nothing changed between the OOM and the snapshot.

    Example:
        >>> OomEvent(0, "cuda:0", 5, None, 1024, 0, 0, 0, 0, None, "device full", "").to_dict()["verdict"]
        'device full'
    """

    device: int
    name: str
    index: int
    time_us: int | None
    requested_bytes: int
    device_free_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    cached_free_bytes: int
    largest_free_block: int | None
    verdict: str
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> "explanation" in OomEvent(0, "cuda:0", 0, None, 0, 0, 0, 0, 0, None, "", "").to_dict()
            True
        """
        return asdict(self)


def oom_report(snap: Snapshot) -> list[OomEvent]:
    """Explain every ``oom`` trace entry: requested, free, and fragmentation vs a full device.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [{"device": 0, "address": 0,
        ...     "total_size": 41943040, "stream": 0, "blocks": [
        ...       {"address": 0, "size": 10485760, "requested_size": 10485760, "state": "active_allocated"},
        ...       {"address": 10485760, "size": 10485760, "requested_size": 0, "state": "inactive"},
        ...       {"address": 20971520, "size": 10485760, "requested_size": 10485760, "state": "active_allocated"},
        ...       {"address": 31457280, "size": 10485760, "requested_size": 0, "state": "inactive"}]}],
        ...   "device_traces": [[{"action": "oom", "device_free": 1048576, "size": 20971520,
        ...                       "stream": 0, "frames": []}]]})
        >>> o = oom_report(s)[0]
        >>> o.requested_bytes, o.cached_free_bytes, o.largest_free_block, o.verdict
        (20971520, 20971520, 10485760, 'fragmentation')
    """
    out: list[OomEvent] = []
    for dev in snap.devices:
        t = snap.trace(dev)
        if not t.count("oom"):
            continue
        r = DeviceReplay(snap, dev)
        allocated, reserved = r.allocated, r.reserved
        last_change = r.last_change
        segs = [s for s in snap.segments if s.device == dev]
        end_free = sum(s.free_size for s in segs)
        end_alloc_blocks = sum(s.allocated_size for s in segs)
        largest_end = max((b.size for s in segs for b in s.blocks if b.state == "inactive"), default=0)
        for i, a in enumerate(t.actions):
            if a != OOM:
                continue
            size, free, res = t.sizes[i], t.addrs[i], reserved[i]
            if i > last_change:  # nothing changed since: the end state is the state at the OOM
                cached = end_free
                largest: int | None = largest_end
                alloc_now = end_alloc_blocks
            else:
                alloc_now = allocated[i]
                cached = max(0, res - alloc_now)
                largest = None
            if free + cached >= size:
                verdict = "fragmentation"
                why = (
                    f"{_fb(size)} was requested; the device had {_fb(free)} free and the "
                    f"allocator held {_fb(cached)} cached free, enough in total, but no single "
                    "free block or new segment could hold the request"
                )
                if largest is not None:
                    why += f" (largest cached free block: {_fb(largest)})"
                why += (
                    ". Consider PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a smaller "
                    "max_split_size_mb."
                )
            else:
                verdict = "device full"
                why = (
                    f"{_fb(size)} was requested but only {_fb(free)} was free on the device "
                    f"and {_fb(cached)} cached free in the allocator: the device is truly full; "
                    "reduce the batch size or the model's memory."
                )
            out.append(
                OomEvent(
                    device=dev,
                    name=snap.device_name(dev),
                    index=i,
                    time_us=t.times[i] if t.has_time else None,
                    requested_bytes=size,
                    device_free_bytes=free,
                    allocated_bytes=alloc_now,
                    reserved_bytes=res,
                    cached_free_bytes=cached,
                    largest_free_block=largest,
                    verdict=verdict,
                    explanation=why,
                )
            )
    return out


#: The short name, as in ``torchmem.analysis.oom(snap)``.
oom = oom_report
