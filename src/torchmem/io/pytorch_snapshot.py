"""Normalise any unpickled PyTorch snapshot object into a :class:`~torchmem.model.snapshot.Snapshot`.

Private: use :meth:`Snapshot.from_pytorch` or :func:`torchmem.load_snapshot`. Fast path for the
trace entries (one ``itemgetter`` call per entry, stacks cached by the identity of the shared
frame lists/dicts that PyTorch's pickles carry, which stay alive while the raw object is held).

Example:
    >>> normalise({"segments": [], "device_traces": [[]]}, "x.pickle").num_trace_devices
    1
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Any

from torchmem.errors import SnapshotFormatError
from torchmem.model.snapshot import (
    ACTIONS,
    Block,
    DeviceTrace,
    Frame,
    Segment,
    Snapshot,
    SourceInfo,
)

__all__ = ["normalise", "JSON_FORMAT_NAME"]

JSON_FORMAT_NAME = "torchmem-snapshot"

_FULL = itemgetter("action", "addr", "size", "stream", "time_us", "frames")


def _what(obj: Any) -> str:
    if isinstance(obj, dict):
        keys = sorted(map(str, obj))[:8]
        return f"a dict with keys {keys}"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__name__}"


class _Ctx:
    """Interning caches tied to one normalisation (raw object kept alive by the caller)."""

    def __init__(self, snap: Snapshot, where: str) -> None:
        self.snap = snap
        self.where = where
        self.frame_by_id: dict[int, Frame] = {}
        self.stack_by_id: dict[int, int] = {}

    def frame(self, f: Any) -> Frame:
        fr = self.frame_by_id.get(id(f))
        if fr is None:
            try:
                fr = self.snap.intern_frame(
                    str(f.get("filename", "??")), int(f.get("line", 0) or 0), str(f.get("name", "??"))
                )
            except (AttributeError, TypeError, ValueError):
                raise SnapshotFormatError(
                    f"{self.where}: a frame should be a dict with filename, line and name, got "
                    f"{_what(f)}"
                ) from None
            self.frame_by_id[id(f)] = fr
        return fr

    def stack(self, frames: Any) -> int:
        if not frames:
            return 0
        sid = self.stack_by_id.get(id(frames))
        if sid is None:
            if not isinstance(frames, (list, tuple)):
                raise SnapshotFormatError(
                    f"{self.where}: 'frames' should be a list of frame dicts, got {_what(frames)}"
                )
            frame = self.frame
            sid = self.snap.intern_stack([frame(f) for f in frames])
            self.stack_by_id[id(frames)] = sid
        return sid


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


def _segments(ctx: _Ctx, raw: Any, features: set[str]) -> list[Segment]:
    where = ctx.where
    if not isinstance(raw, list):
        raise SnapshotFormatError(f"{where}: 'segments' should be a list, got {_what(raw)}")
    out: list[Segment] = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise SnapshotFormatError(f"{where}: segment {i} should be a dict, got {_what(s)}")
        try:
            addr = int(s["address"])
            total = int(s["total_size"])
            raw_blocks = s["blocks"]
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
        blocks: list[Block] = []
        cur = addr
        try:
            for b in raw_blocks:
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
                cur = baddr + size
                blocks.append(
                    Block(int(baddr), size, int(req), _state_of(b), ctx.snap.stacks[ctx.stack(fr)])
                )
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
                int(s.get("device", 0) or 0),
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


def _fast_columns(
    ctx: _Ctx,
    t: DeviceTrace,
    entries: list[Any],
    codes: dict[str, int],
    has_cc: bool,
    has_um: bool,
    features: set[str],
) -> bool:
    """Column-at-a-time normalisation (C-speed ``map`` over ``itemgetter``) for the common case.

    Returns False (and changes nothing) when an entry lacks a key or has an unknown action, in
    which case the caller falls back to the entry-at-a-time loop.
    """
    try:
        acts = array("B", map(codes.__getitem__, map(itemgetter("action"), entries)))
        if codes["oom"] in acts:
            return False
        addrs = array("Q", map(itemgetter("addr"), entries))
        sizes = array("Q", map(itemgetter("size"), entries))
        streams = array("q", map(itemgetter("stream"), entries))
        times = array("q", map(itemgetter("time_us"), entries))
        frame_lists = list(map(itemgetter("frames"), entries))
        cc = list(map(itemgetter("compile_context"), entries)) if has_cc else None
        um = list(map(itemgetter("user_metadata"), entries)) if has_um else None
    except (KeyError, TypeError, OverflowError):
        return False
    cache = ctx.stack_by_id
    stack = ctx.stack
    for k, fl in dict(zip(map(id, frame_lists), frame_lists)).items():
        if k not in cache:
            cache[k] = stack(fl)
    t.actions = acts
    t.addrs = addrs
    t.sizes = sizes
    t.streams = streams
    t.times = times
    t.stack_ids = array("I", map(cache.__getitem__, map(id, frame_lists)))
    del frame_lists
    texts: dict[Any, int] = {}
    for col, name in ((cc, "compile_contexts"), (um, "user_metadata")):
        if col is None:
            continue
        for v in dict.fromkeys(col):
            if v not in texts:
                texts[v] = len(texts)
        setattr(t, name, array("I", map(texts.__getitem__, col)))
    t.texts = [str(x) for x in texts]
    t.has_time = True
    features.add("time_us")
    if has_cc:
        features.add("compile_context")
    if has_um:
        features.add("user_metadata")
    return True


def _trace(ctx: _Ctx, dev: int, entries: Any, features: set[str]) -> DeviceTrace:
    where = ctx.where
    if not isinstance(entries, list):
        raise SnapshotFormatError(
            f"{where}: device_traces[{dev}] should be a list of trace entries, got {_what(entries)}"
        )
    t = ctx.snap.new_trace(dev)
    if not entries:
        return t
    first = entries[0]
    if not isinstance(first, dict):
        raise SnapshotFormatError(
            f"{where}: device_traces[{dev}][0] should be a dict, got {_what(first)}"
        )
    has_cc = "compile_context" in first
    has_um = "user_metadata" in first
    texts: dict[str, int] = {}
    cc_col = array("I") if has_cc else None
    um_col = array("I") if has_um else None
    codes = {name: i for i, name in enumerate(ACTIONS)}
    if _fast_columns(ctx, t, entries, codes, has_cc, has_um, features):
        return t
    oom = codes["oom"]
    acts: list[int] = []
    addrs: list[int] = []
    sizes: list[int] = []
    streams: list[int] = []
    times: list[int] = []
    sids: list[int] = []
    a_app, ad_app, s_app, st_app, t_app, sid_app = (
        acts.append,
        addrs.append,
        sizes.append,
        streams.append,
        times.append,
        sids.append,
    )
    stack_by_id = ctx.stack_by_id
    stack = ctx.stack
    full = _FULL
    has_time = True
    i = 0
    try:
        for i, e in enumerate(entries):  # noqa: B007 - i is reported on error
            try:
                a, addr, size, stream, tm, fr = full(e)
            except KeyError:
                a = e["action"]
                addr = e.get("addr")
                if addr is None:
                    addr = e.get("device_free", 0)
                size = e["size"]
                stream = e.get("stream", 0)
                tm = e.get("time_us")
                if tm is None:
                    has_time = False
                    tm = -1
                fr = e.get("frames")
            code = codes.get(a)
            if code is None:
                code = t.action_code(str(a))
                codes[a] = code
            if code == oom and "device_free" in e:
                addr = e["device_free"]
            a_app(code)
            ad_app(addr)
            s_app(size)
            st_app(stream)
            t_app(tm)
            if fr:
                sid = stack_by_id.get(id(fr))
                if sid is None:
                    sid = stack(fr)
                sid_app(sid)
            else:
                sid_app(0)
            if cc_col is not None:
                c = e.get("compile_context", "")
                k = texts.get(c)
                if k is None:
                    k = texts[c] = len(texts)
                cc_col.append(k)
            if um_col is not None:
                c = e.get("user_metadata", "")
                k = texts.get(c)
                if k is None:
                    k = texts[c] = len(texts)
                um_col.append(k)
    except SnapshotFormatError:
        raise
    except (KeyError, TypeError, AttributeError) as e:
        raise SnapshotFormatError(
            f"{where}: device_traces[{dev}][{i}] is malformed ({type(e).__name__}: {e}); "
            "expected a dict with action, addr (or device_free), size, stream and frames"
        ) from None
    try:
        t.actions = array("B", acts)
        t.addrs = array("Q", addrs)
        t.sizes = array("Q", sizes)
        t.streams = array("q", streams)
        t.times = array("q", times)
        t.stack_ids = array("I", sids)
    except (OverflowError, TypeError) as e:
        raise SnapshotFormatError(
            f"{where}: device_traces[{dev}] has a value that is not a 64-bit integer ({e}); "
            "expected integer addr/size/stream/time_us"
        ) from None
    t.has_time = has_time
    t.compile_contexts = cc_col
    t.user_metadata = um_col
    t.texts = list(texts)
    if has_time:
        features.add("time_us")
    if has_cc:
        features.add("compile_context")
    if has_um:
        features.add("user_metadata")
    return t


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
    where = path or "<snapshot>"
    snap = Snapshot()
    ctx = _Ctx(snap, where)
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
            f"'device_traces', or a list of segments), got {_what(obj)}"
        )
    snap.segments = _segments(ctx, raw_segments, features)
    if not isinstance(raw_traces, list):
        raise SnapshotFormatError(
            f"{where}: 'device_traces' should be a list (one list per device), got {_what(raw_traces)}"
        )
    for dev, entries in enumerate(raw_traces):
        _trace(ctx, dev, entries, features)
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
