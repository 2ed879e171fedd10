"""PyTorch's memory snapshot format, both directions, without torch.

:func:`from_pytorch` normalises any unpickled PyTorch snapshot object (the modern dict with
``device_traces``, the bare list of segments, 2.0-era blocks with ``history``, torchmem's JSON
dict) into a :class:`~torchmem.model.snapshot.Snapshot`; :func:`to_pytorch_dict` gives the modern
dict back, which ``torch.cuda._memory_viz`` and PyTorch's viewer read. Files are
:mod:`torchmem.io.snapshot_file`.

Reading is fast (the trace entries, a snapshot's bulk, are read column-wise by the private
``torchmem.io._pytorch_traces``) and strict where a wrong value would mislead: sizes and
addresses of segments and blocks must fit in 64 bits unsigned, and device indexes must be below
:data:`DEVICE_INDEX_LIMIT`.

Example:
    >>> snap = from_pytorch({"segments": [], "device_traces": [[]]}, path="x.pickle")
    >>> snap.num_trace_devices, to_pytorch_dict(snap)["device_traces"]
    (1, [[]])
"""

from __future__ import annotations

from typing import Any

from torchmem.errors import SnapshotFormatError
from torchmem.io._pytorch_traces import Interner, describe, origin_of, read_device_trace
from torchmem.model.events import Category, Phase
from torchmem.model.snapshot import (
    Block,
    Frame,
    Segment,
    Snapshot,
    SourceInfo,
)

__all__ = [
    "from_pytorch",
    "to_pytorch_dict",
    "normalise",
    "JSON_FORMAT_NAME",
    "DEVICE_INDEX_LIMIT",
]

#: The ``format`` field of torchmem's JSON snapshot document.
JSON_FORMAT_NAME = "torchmem-snapshot"

#: Device indexes must be below this. PyTorch's ``c10::DeviceIndex`` is 8 bits and torchmem's
#: ``.tmtrace`` device column 16 bits, so an index of 2**16 or more can only be corruption (a
#: size or an address read as a device).
DEVICE_INDEX_LIMIT = 2**16
_U64_MAX = 2**64 - 1
_FIX = (
    "the file is corrupt or was not written by PyTorch; re-create it with "
    "torch.cuda.memory._dump_snapshot or torchmem.write_snapshot"
)

_CATEGORY_LABELS = tuple(c.label for c in Category)
_PHASE_LABELS = tuple(p.label for p in Phase)


def _u64(where: str, what: str, field: str, value: int) -> int:
    if not 0 <= value <= _U64_MAX:
        raise SnapshotFormatError(
            f"{where}: {what}: {field} is {value}; expected a byte count or address from 0 to "
            f"2**64-1; {_FIX}"
        )
    return value


def _device(where: str, what: str, value: int) -> int:
    if not 0 <= value < DEVICE_INDEX_LIMIT:
        raise SnapshotFormatError(
            f"{where}: {what}: device is {value}; expected a device index from 0 to "
            f"{DEVICE_INDEX_LIMIT - 1}; {_FIX}"
        )
    return value


def _state_of(b: dict[str, Any]) -> str:
    state = b.get("state")
    if state is not None:
        return str(state)
    # very old snapshots: booleans instead of a state string
    if b.get("allocated"):
        return "active_allocated"
    if b.get("active"):
        return "active_pending_free"
    return "inactive"


def _segments(ctx: Interner, raw: Any, features: set[str]) -> list[Segment]:
    where = ctx.where
    if not isinstance(raw, list):
        raise SnapshotFormatError(f"{where}: 'segments' should be a list, got {describe(raw)}")
    out: list[Segment] = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise SnapshotFormatError(f"{where}: segment {i} should be a dict, got {describe(s)}")
        try:
            addr = int(s["address"])
            total = int(s["total_size"])
            raw_blocks = s["blocks"]
            device = int(s.get("device", 0) or 0)
        except KeyError as e:
            raise SnapshotFormatError(
                f"{where}: segment {i} has no {e.args[0]!r} key (keys: {sorted(s)}); "
                "expected a PyTorch memory snapshot segment"
            ) from None
        except (TypeError, ValueError):
            raise SnapshotFormatError(
                f"{where}: segment {i}: address and total_size should be integers, got "
                f"{s.get('address')!r} and {s.get('total_size')!r}"
            ) from None
        _u64(where, f"segment {i}", "address", addr)
        _u64(where, f"segment {i}", "total_size", total)
        _device(where, f"segment {i}", device)
        blocks: list[Block] = []
        cur = addr
        try:
            for j, b in enumerate(raw_blocks):
                baddr = b.get("address")
                if baddr is None:
                    baddr = cur
                else:
                    features.add("block_address")
                size = int(b["size"])
                req = b.get("requested_size")
                if "frames" in b:
                    fr = b["frames"]
                elif b.get("history"):
                    features.add("history")
                    h0 = b["history"][0]
                    fr = h0.get("frames") or ()
                    if req is None:
                        req = h0.get("real_size")
                else:
                    fr = ()
                if req is None:
                    req = size
                what = f"segment {i} block {j}"
                baddr = _u64(where, what, "address", int(baddr))
                _u64(where, what, "size", size)
                req = _u64(where, what, "requested_size", int(req))
                cur = baddr + size
                block = Block(baddr, size, req, _state_of(b), ctx.snap.stacks[ctx.stack(fr)])
                if "category" in b or "phase" in b or "module" in b:
                    block.category, block.phase, block.module = origin_of(b)
                    features.update(("category", "phase", "module"))
                blocks.append(block)
        except SnapshotFormatError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
            raise SnapshotFormatError(
                f"{where}: segment {i} has a malformed block ({type(e).__name__}: {e}); "
                "expected blocks with size, state and address/frames or history"
            ) from None
        pool = s.get("segment_pool_id", (0, 0))
        out.append(
            Segment(
                device,
                addr,
                total,
                stream=int(s.get("stream", 0) or 0),
                segment_type=str(s.get("segment_type", "large")),
                segment_pool_id=tuple(pool) if isinstance(pool, (list, tuple)) else (0, 0),  # type: ignore[arg-type]
                is_expandable=bool(s.get("is_expandable", False)),
                frames=ctx.snap.stacks[ctx.stack(s.get("frames"))],
                blocks=blocks,
            )
        )
        bsum = cur - addr if blocks else 0
        if blocks and bsum != total:
            ctx.snap.notes.append(
                f"segment {i} at {addr:#x}: blocks cover {bsum} bytes but total_size is {total}"
            )
    out.sort(key=lambda s: (s.device, s.address))
    return out


def normalise(obj: Any, path: str | None = None, pickle_protocol: int | None = None) -> Snapshot:
    """Normalise a raw snapshot object; errors name ``path`` and what was wrong.

    Example:
        >>> normalise([{"device": 0, "address": 0, "total_size": 512, "stream": 0,
        ...             "blocks": [{"size": 512, "state": "inactive"}]}]).segments[0].blocks[0].address
        0
        >>> normalise(42, "x.pickle")
        Traceback (most recent call last):
        ...
        torchmem.errors.SnapshotFormatError: x.pickle: expected a PyTorch memory snapshot (a dict with 'segments' and 'device_traces', or a list of segments), got a int
    """
    try:
        return _normalise(obj, path, pickle_protocol)
    except SnapshotFormatError as e:
        if e.path is None:
            e.path = path
        raise


def _normalise(obj: Any, path: str | None, pickle_protocol: int | None) -> Snapshot:
    where = path or "<snapshot>"
    snap = Snapshot()
    ctx = Interner(snap, where)
    features: set[str] = set()
    fmt = "dict"
    meta: dict[str, Any] = {}
    if isinstance(obj, dict) and obj.get("format") == JSON_FORMAT_NAME:
        fmt = "torchmem-json"
        version = obj.get("version")
        if version != 1:
            raise SnapshotFormatError(
                f"{where}: torchmem JSON snapshot version {version!r} is not supported; "
                "expected version 1 (upgrade torchmem)"
            )
        obj = obj.get("snapshot")
    if isinstance(obj, list):
        fmt = "list"
        raw_segments: Any = obj
        raw_traces: Any = []
    elif isinstance(obj, dict) and "segments" in obj:
        raw_segments = obj["segments"]
        raw_traces = obj.get("device_traces", [])
        if raw_traces is None:
            raw_traces = []
        meta = obj.get("torchmem") or {}
    else:
        raise SnapshotFormatError(
            f"{where}: expected a PyTorch memory snapshot (a dict with 'segments' and "
            f"'device_traces', or a list of segments), got {describe(obj)}"
        )
    snap.segments = _segments(ctx, raw_segments, features)
    if not isinstance(raw_traces, list):
        raise SnapshotFormatError(
            f"{where}: 'device_traces' should be a list (one list per device), got {describe(raw_traces)}"
        )
    for dev, entries in enumerate(raw_traces):
        read_device_trace(ctx, dev, entries, features)
    snap.num_trace_devices = max(snap.num_trace_devices, len(raw_traces))
    if isinstance(obj, dict):
        settings = obj.get("allocator_settings")
        if isinstance(settings, dict):
            snap.allocator_settings = settings
            features.add("allocator_settings")
        ann = obj.get("external_annotations")
        if isinstance(ann, list):
            snap.external_annotations = ann
            features.add("external_annotations")
    if "history" in features and fmt == "dict":
        fmt = "legacy-history"
    if isinstance(meta, dict):
        names = meta.get("device_names") or {}
        if isinstance(names, dict):
            for k, v in names.items():
                try:
                    snap.device_names[int(k)] = str(v)
                except (TypeError, ValueError):
                    pass
        notes = meta.get("notes") or []
        if isinstance(notes, list):
            snap.notes[:0] = [str(n) for n in notes]
    snap.source = SourceInfo(
        path=path, format=fmt, pickle_protocol=pickle_protocol, features=tuple(sorted(features))
    )
    return snap


def from_pytorch(obj: Any, *, path: str | None = None) -> Snapshot:
    """Normalise an unpickled PyTorch snapshot (dict or list of segments) or our JSON dict.

    Raises :class:`~torchmem.errors.SnapshotFormatError` naming ``path`` and what was wrong.

    Example:
        >>> from_pytorch([]).source.format
        'list'
        >>> from_pytorch([{"device": 0, "address": 0, "total_size": -5, "blocks": []}],
        ...              path="bad.pickle")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.SnapshotFormatError: bad.pickle: segment 0: total_size is -5; expected ...
    """
    return normalise(obj, path)


def to_pytorch_dict(snapshot: Snapshot) -> dict[str, Any]:
    """PyTorch's modern snapshot format (what ``torch.cuda.memory._snapshot()`` returns).

    Keys: ``segments`` (with ``blocks`` carrying ``address`` and ``frames``),
    ``device_traces`` (one list per device index, entries with ``action``, ``addr`` /
    ``device_free``, ``size``, ``stream``, ``frames`` and ``time_us`` when known), plus
    ``allocator_settings`` / ``external_annotations`` when known. Frames and stacks are shared
    objects (as in PyTorch's output), so do not mutate them in place. A ``torchmem`` key holds
    device names and notes; PyTorch's tools ignore it.

    Entries and blocks that know where their allocation came from also carry ``category``,
    ``phase`` (labels) and ``module``: extra keys that PyTorch's tools ignore and
    :func:`from_pytorch` reads back.

    Example:
        >>> d = to_pytorch_dict(Snapshot())
        >>> sorted(d)
        ['device_traces', 'segments', 'torchmem']
        >>> snap = from_pytorch({"segments": [{"device": 0, "address": 0, "total_size": 512,
        ...     "blocks": [{"size": 512, "state": "active_allocated", "category": "gradient"}]}]})
        >>> to_pytorch_dict(snap)["segments"][0]["blocks"][0]["category"]
        'gradient'
    """
    frame_dicts: dict[Frame, dict[str, Any]] = {}

    def fd(f: Frame) -> dict[str, Any]:
        d = frame_dicts.get(f)
        if d is None:
            d = frame_dicts[f] = {"filename": f.filename, "line": f.line, "name": f.name}
        return d

    stack_lists: list[list[dict[str, Any]] | None] = [None] * len(snapshot.stacks)

    def sl(idx: int) -> list[dict[str, Any]]:
        if idx >= len(stack_lists):  # a block's stack interned just now (not in any trace)
            stack_lists.extend([None] * (len(snapshot.stacks) - len(stack_lists)))
        lst = stack_lists[idx]
        if lst is None:
            lst = stack_lists[idx] = [fd(f) for f in snapshot.stacks[idx]]
        return lst

    segs = []
    for s in snapshot.segments:
        blocks = [
            {
                "address": b.address,
                "size": b.size,
                "requested_size": b.requested_size,
                "state": b.state,
                "frames": sl(snapshot.intern_stack(b.frames)),
                **b.origin(),
            }
            for b in s.blocks
        ]
        segs.append(
            {
                "device": s.device,
                "address": s.address,
                "total_size": s.total_size,
                "allocated_size": s.allocated_size,
                "active_size": s.active_size,
                "requested_size": s.requested_size,
                "stream": s.stream,
                "segment_type": s.segment_type,
                "segment_pool_id": tuple(s.segment_pool_id),
                "is_expandable": s.is_expandable,
                "frames": sl(snapshot.intern_stack(s.frames)),
                "blocks": blocks,
            }
        )
    traces: list[list[dict[str, Any]]] = []
    for dev in range(snapshot.num_trace_devices):
        t = snapshot.traces.get(dev)
        entries: list[dict[str, Any]] = []
        traces.append(entries)
        if t is None:
            continue
        names = t.action_names
        oom = names.index("oom")
        has_time = t.has_time
        ccs = t.compile_contexts
        ums = t.user_metadata
        cats, phases, mods = t.categories, t.phases, t.modules
        texts = t.texts
        for i, (a, addr, size, stream, tm, sid) in enumerate(
            zip(t.actions, t.addrs, t.sizes, t.streams, t.times, t.stack_ids)
        ):
            e: dict[str, Any] = {"action": names[a]}
            if a == oom:
                e["device_free"] = addr
            else:
                e["addr"] = addr
            e["size"] = size
            e["stream"] = stream
            if has_time:
                e["time_us"] = tm
            if ccs is not None:
                e["compile_context"] = texts[ccs[i]]
            if ums is not None:
                e["user_metadata"] = texts[ums[i]]
            if cats is not None and phases is not None and mods is not None:
                if cats[i] >= 0:
                    e["category"] = _CATEGORY_LABELS[cats[i]]
                if phases[i] >= 0:
                    e["phase"] = _PHASE_LABELS[phases[i]]
                if mods[i] >= 0:
                    e["module"] = texts[mods[i]]
            e["frames"] = sl(sid)
            entries.append(e)
    out: dict[str, Any] = {"segments": segs, "device_traces": traces}
    if snapshot.allocator_settings is not None:
        out["allocator_settings"] = snapshot.allocator_settings
    if snapshot.external_annotations is not None:
        out["external_annotations"] = snapshot.external_annotations
    out["torchmem"] = {
        "device_names": {str(k): v for k, v in sorted(snapshot.device_names.items())},
        "notes": list(snapshot.notes),
        "source_format": snapshot.source.format,
    }
    return out
