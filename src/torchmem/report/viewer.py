"""The offline HTML viewer: one self-contained file, no network request, scales to 1M events.

:func:`build_payload` turns a snapshot in PyTorch's format (the dict that
``torch.cuda.memory._snapshot()`` returns: ``segments`` with ``blocks`` and ``device_traces``)
into a compact columnar payload: every allocation and event becomes a row of typed arrays, frames
and stacks are interned in tables, and the whole payload is deflated and base64-encoded. The
page's own JavaScript (``viewer_assets/``, inlined into the HTML) decodes it with the browser's
built-in ``DecompressionStream`` and draws on canvas with level of detail: each pixel column of
the timeline shows the stack of live allocations at the busiest instant of that column, so a
million events draw as fast as a thousand.

:func:`render_html` returns the page as a string, :func:`write_viewer` writes it. Both accept a
snapshot dict (modern, legacy 2.0 ``history`` blocks, or the bare list of segments), an object
with ``to_pytorch_dict()``, or a path to a snapshot / torchmem trace file.

This module does not import torch.

Example:
    >>> snap = {"segments": [{"device": 0, "address": 4096, "total_size": 2048, "stream": 0,
    ...          "segment_type": "small", "blocks": [
    ...             {"address": 4096, "size": 512, "requested_size": 500,
    ...              "state": "active_allocated", "frames": []},
    ...             {"address": 4608, "size": 1536, "requested_size": 0,
    ...              "state": "inactive", "frames": []}]}],
    ...         "device_traces": [[
    ...             {"action": "alloc", "addr": 4096, "size": 512, "stream": 0,
    ...              "frames": [{"name": "f", "filename": "a.py", "line": 3}]}]]}
    >>> payload = build_payload(snap)
    >>> dev = payload["devices"][0]
    >>> dev["n_events"], dev["n_allocs"], dev["stats"]["allocated_bytes"]
    (1, 1, 512)
    >>> html = render_html(snap, title="demo")
    >>> html.startswith("<!DOCTYPE html>") and "http://" not in html and "https://" not in html
    True
"""

from __future__ import annotations

import base64
import html as _html
import importlib.resources
import json
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable

from torchmem.errors import InvalidInputError

__all__ = ["build_payload", "encode_payload", "render_html", "write_viewer", "raw_stats"]

PAYLOAD_VERSION = 1

# Event kinds as stored in the payload (``ev_kind``), shared with viewer.js.
K_ALLOC = 0
K_FREE_REQUESTED = 1
K_FREE_COMPLETED = 2
K_SEGMENT_ALLOC = 3
K_SEGMENT_FREE = 4
K_SEGMENT_MAP = 5
K_SEGMENT_UNMAP = 6
K_OOM = 7
K_SNAPSHOT = 8
K_OTHER = 9
_KINDS = {
    "alloc": K_ALLOC,
    "free_requested": K_FREE_REQUESTED,
    "free": K_FREE_COMPLETED,  # an older name; PyTorch's viewer also ends the allocation there
    "free_completed": K_FREE_COMPLETED,
    "segment_alloc": K_SEGMENT_ALLOC,
    "segment_free": K_SEGMENT_FREE,
    "segment_map": K_SEGMENT_MAP,
    "segment_unmap": K_SEGMENT_UNMAP,
    "oom": K_OOM,
    "snapshot": K_SNAPSHOT,
}
KIND_NAMES = [
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot", "other",
]
_STATES = {"inactive": 0, "active_allocated": 1, "active_pending_free": 2}

ProgressFn = Callable[[str], None]


# --------------------------------------------------------------------------- input normalisation


def _as_snapshot_dict(source: Any) -> dict[str, Any]:
    """Accept a dict, a bare list of segments, or an object with ``to_pytorch_dict()``."""
    if hasattr(source, "to_pytorch_dict"):
        source = source.to_pytorch_dict()
    if isinstance(source, list):
        return {"segments": source, "device_traces": []}
    if isinstance(source, Mapping) and "segments" in source:
        return dict(source)
    got = type(source).__name__
    if isinstance(source, Mapping):
        got = f"a dict with keys {sorted(map(str, source))[:8]}"
    raise InvalidInputError(
        "the viewer expected a memory snapshot (a dict with 'segments' and 'device_traces', a "
        f"list of segments, a Snapshot, or a path to a snapshot/trace file), got {got}; "
        "fix: pass torch.cuda.memory._snapshot() or a file written by torchmem.dump_snapshot"
    )


def _legacy_block_info(seg_addr: int, offset: int, b: Mapping[str, Any]) -> tuple[int, list[Any]]:
    """Address and frames of a block; 2.0-era blocks keep them in ``history`` instead."""
    addr = b.get("address")
    frames = b.get("frames")
    hist = b.get("history")
    if addr is None:
        addr = seg_addr + offset
    if frames is None:
        frames = []
        if hist:
            entry = next((h for h in hist if h.get("addr") == addr), hist[-1])
            frames = entry.get("frames") or []
    return int(addr), list(frames)


class _Interner:
    """Frames and stacks interned in tables: a stack is stored once, as a list of frame ids."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []
        self.stacks: list[list[int]] = [[]]
        self._frame_ids: dict[tuple[str, str, int], int] = {}
        self._stack_ids: dict[tuple[int, ...], int] = {(): 0}
        self._by_obj: dict[int, tuple[Any, int]] = {}
        self.texts: list[str] = []
        self._text_ids: dict[str, int] = {}

    def text(self, value: Any) -> int:
        """Index of a non-empty annotation string (user_metadata), -1 for none."""
        if not value or not isinstance(value, str) or value == "N/A":
            return -1
        i = self._text_ids.get(value)
        if i is None:
            i = self._text_ids[value] = len(self.texts)
            self.texts.append(value)
        return i

    def stack(self, frames: Any) -> int:
        if not frames:
            return 0
        # Snapshots built by PyTorch often share one frames list between a block and its trace
        # entry; remember by object (keeping the object alive) to skip re-hashing.
        hit = self._by_obj.get(id(frames))
        if hit is not None and hit[0] is frames:
            return hit[1]
        ids = []
        for f in frames:
            if isinstance(f, Mapping):
                key = (str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
            else:  # a "file:line:function" string (torchmem tracker style)
                key = (str(f), "", 0)
            fid = self._frame_ids.get(key)
            if fid is None:
                fid = len(self.frames)
                self._frame_ids[key] = fid
                self.frames.append([key[0], key[1], key[2]])
            ids.append(fid)
        t = tuple(ids)
        sid = self._stack_ids.get(t)
        if sid is None:
            sid = len(self.stacks)
            self._stack_ids[t] = sid
            self.stacks.append(ids)
        self._by_obj[id(frames)] = (frames, sid)
        return sid


# --------------------------------------------------------------------------- stats


def raw_stats(snapshot: Any) -> list[dict[str, Any]]:
    """Per-device allocator statistics of a snapshot's end state (all bytes are ints).

    A small stand-alone version of :func:`torchmem.analysis.snapshot.snapshot_stats` that works
    on PyTorch's raw dict; the viewer uses it only when the analysis cannot run. Figures, from
    the segments and blocks: ``reserved_bytes`` (sum of segment sizes),
    ``allocated_bytes`` (blocks in state ``active_allocated``), ``active_bytes`` (allocated plus
    ``active_pending_free``), ``requested_bytes`` (requested sizes of active blocks),
    ``segments``, ``blocks``, ``free_bytes`` (inactive bytes inside segments),
    ``largest_free_block`` and ``fragmentation`` (1 - largest free block / free bytes).

    Example:
        >>> s = {"segments": [{"device": 0, "address": 0, "total_size": 4096, "stream": 0,
        ...       "segment_type": "small", "blocks": [
        ...         {"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
        ...         {"address": 1024, "size": 3072, "requested_size": 0, "state": "inactive"}]}],
        ...      "device_traces": []}
        >>> st = raw_stats(s)[0]
        >>> st["reserved_bytes"], st["allocated_bytes"], st["free_bytes"], st["fragmentation"]
        (4096, 1024, 3072, 0.0)
    """
    snap = _as_snapshot_dict(snapshot)
    per: dict[int, dict[str, Any]] = {}
    for seg in snap.get("segments") or []:
        dev = int(seg.get("device", 0) or 0)
        d = per.setdefault(dev, {
            "device": dev, "reserved_bytes": 0, "allocated_bytes": 0, "active_bytes": 0,
            "requested_bytes": 0, "segments": 0, "blocks": 0, "active_blocks": 0,
            "inactive_blocks": 0, "free_bytes": 0, "largest_free_block": 0,
            "pools": {}, "streams": {}, "expandable_segments": 0,
        })
        size = int(seg.get("total_size", 0) or 0)
        d["reserved_bytes"] += size
        d["segments"] += 1
        if seg.get("is_expandable"):
            d["expandable_segments"] += 1
        pool = str(seg.get("segment_type", "large"))
        p = d["pools"].setdefault(pool, {"segments": 0, "reserved_bytes": 0, "allocated_bytes": 0})
        p["segments"] += 1
        p["reserved_bytes"] += size
        st = d["streams"].setdefault(str(seg.get("stream", 0)), {"segments": 0, "reserved_bytes": 0})
        st["segments"] += 1
        st["reserved_bytes"] += size
        for b in seg.get("blocks") or []:
            bsize = int(b.get("size", 0) or 0)
            state = b.get("state", "inactive")
            d["blocks"] += 1
            if state == "active_allocated":
                d["allocated_bytes"] += bsize
                p["allocated_bytes"] += bsize
            if state in ("active_allocated", "active_pending_free"):
                d["active_bytes"] += bsize
                d["active_blocks"] += 1
                d["requested_bytes"] += int(b.get("requested_size", 0) or 0)
            else:
                d["inactive_blocks"] += 1
                d["free_bytes"] += bsize
                d["largest_free_block"] = max(d["largest_free_block"], bsize)
    out = []
    for dev in sorted(per):
        d = per[dev]
        d["fragmentation"] = (
            round(1.0 - d["largest_free_block"] / d["free_bytes"], 4) if d["free_bytes"] else 0.0
        )
        d["rounding_slack_bytes"] = d["active_bytes"] - d["requested_bytes"]
        out.append(d)
    return out


def _analysis(source: Any, snap: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
    """Per-device figures from torchmem's snapshot analysis (stats, peak, OOM verdicts), or
    None when the source cannot be normalised (then :func:`raw_stats` is used)."""
    try:
        from torchmem.analysis.snapshot import oom_report, snapshot_peak  # noqa: PLC0415
        from torchmem.analysis.snapshot import snapshot_stats as analysis_stats  # noqa: PLC0415
        from torchmem.model.snapshot import Snapshot  # noqa: PLC0415

        model = source if isinstance(source, Snapshot) else Snapshot.from_pytorch(snap)
        stats = analysis_stats(model).to_dict()["devices"]
        peaks = {p.device: p.to_dict() for p in snapshot_peak(model, top=8).devices}
        ooms = [o.to_dict() for o in oom_report(model)]
    except Exception:  # noqa: BLE001 - the viewer still works with its own figures
        return None
    out: dict[int, dict[str, Any]] = {}
    for d in stats:
        dev = int(d["device"])
        d = dict(d)
        pk = peaks.get(dev) or {}
        for k in ("peak_allocated_bytes", "peak_index", "peak_time_us", "initial_allocated_bytes",
                  "end_allocated_bytes", "consistent"):
            if k in pk:
                d[k] = pk[k]
        d["at_peak"] = pk.get("at_peak", [])
        d["oom_reports"] = [o for o in ooms if int(o.get("device", -1)) == dev]
        out[dev] = d
    return out


# --------------------------------------------------------------------------- payload


def _b64(arr: array) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - typed arrays in JS are little-endian here
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _device_payload(
    dev: int,
    trace: list[Any],
    segments: list[Mapping[str, Any]],
    interner: _Interner,
    stats: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, array]]:
    """Columns for one device. Allocation ids are in stacking order: first every allocation that
    was live before the trace began (found as end-state blocks or frees with no alloc), then the
    trace's allocations in order."""
    n = len(trace)
    stack = interner.stack

    # Pass 1: match frees to allocations by address to find allocations that predate the trace
    # (the first free of an address with no live alloc introduces one).
    live: dict[Any, int] = {}  # addr -> event index of its alloc (or of its first free)
    pre_from_free: list[int] = []  # event indices of frees whose alloc is not in the trace
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            live[e.get("addr", 0)] = i
        elif a == "free_completed" or a == "free_requested" or a == "free":
            addr = e.get("addr", 0)
            if addr not in live:
                pre_from_free.append(i)
                live[addr] = i
            if a != "free_requested":
                del live[addr]
    end_live_addrs = set(live)

    # End-state blocks (address order) and the allocations they stand for.
    seg_rows: list[tuple[int, int, int, int, int]] = []  # addr, size, stream, pool, first block
    blk_addr = array("d")
    blk_size = array("d")
    blk_req: list[int] = []
    blk_stream: list[int] = []
    blk_state = array("B")
    blk_alloc = array("i")
    blk_stack = array("i")
    pre_blocks: list[int] = []  # block indices of active blocks not allocated in the trace
    streams: dict[Any, int] = {}

    def stream_id(s: Any) -> int:
        k = streams.get(s)
        if k is None:
            k = streams[s] = len(streams)
        return k

    for seg in sorted(segments, key=lambda s: int(s.get("address", 0) or 0)):
        saddr = int(seg.get("address", 0) or 0)
        sstream = stream_id(seg.get("stream", 0))
        first = len(blk_addr)
        offset = 0
        for b in seg.get("blocks") or []:
            addr, frames = _legacy_block_info(saddr, offset, b)
            size = int(b.get("size", 0) or 0)
            offset += size
            state = _STATES.get(b.get("state", "inactive"), 0)
            blk_addr.append(addr)
            blk_size.append(size)
            blk_req.append(int(b.get("requested_size", 0) or 0))
            blk_stream.append(sstream)
            blk_state.append(state)
            blk_alloc.append(-1)
            blk_stack.append(stack(frames))
            if state and addr not in end_live_addrs:
                pre_blocks.append(len(blk_addr) - 1)
        seg_rows.append((
            saddr,
            int(seg.get("total_size", 0) or 0),
            sstream,
            1 if seg.get("segment_type") == "small" else 0,
            first,
        ))

    # Allocation table.
    al_addr = array("d")
    al_size = array("d")
    al_stack = array("i")
    al_stream = array("i")
    al_start = array("i")  # event index of the alloc, -1 if before the trace
    al_end = array("i")  # event index of free_completed, n if still live at the end
    al_req = array("i")  # event index of free_requested, -1 if none

    al_meta = array("i")  # index into the payload's text table (user_metadata), -1 if none

    def new_alloc(
        addr: int, size: int, st: int, stream: int, start: int, meta: Any = None
    ) -> int:
        al_meta.append(interner.text(meta))
        al_addr.append(addr)
        al_size.append(size)
        al_stack.append(st)
        al_stream.append(stream)
        al_start.append(start)
        al_end.append(n)
        al_req.append(-1)
        return len(al_addr) - 1

    blk_index_by_addr = {int(blk_addr[i]): i for i in range(len(blk_addr)) if blk_state[i]}
    for bi in pre_blocks:  # live the whole trace: the bottom of the stack
        # Trace entries carry the requested size; use the block's requested size to match.
        aid = new_alloc(int(blk_addr[bi]), int(blk_req[bi] or blk_size[bi]), blk_stack[bi],
                        blk_stream[bi], -1)
        blk_alloc[bi] = aid
    pre_free_alloc: dict[int, int] = {}
    for i in pre_from_free:
        e = trace[i]
        aid = new_alloc(int(e.get("addr", 0)), int(e.get("size", 0)), stack(e.get("frames")),
                        stream_id(e.get("stream", 0)), -1)
        pre_free_alloc[i] = aid

    ev_kind = array("B", bytes(n))
    ev_ref = array("i", [-1]) * n
    has_time = any("time_us" in e for e in trace[:1000]) if trace else False
    ev_time = array("d", bytes(8 * n)) if has_time else array("d")
    t0 = 0
    if has_time:
        t0 = min((int(e["time_us"]) for e in trace if e.get("time_us") is not None), default=0)
    se_addr = array("d")
    se_size = array("d")
    se_stream = array("i")
    ooms: list[dict[str, Any]] = []
    by_addr: dict[Any, int] = {}  # addr -> live alloc id
    for aid in range(len(pre_blocks)):  # the end-state blocks that predate the trace
        by_addr[int(al_addr[aid])] = aid
    kinds = _KINDS
    for i, e in enumerate(trace):
        a = e.get("action")
        k = kinds.get(a, K_OTHER)
        ev_kind[i] = k
        if has_time:
            tu = e.get("time_us")
            ev_time[i] = (int(tu) - t0) if tu is not None else (ev_time[i - 1] if i else 0)
        if k == K_ALLOC:
            addr = e.get("addr", 0)
            old = by_addr.get(addr)
            if old is not None and al_end[old] == n:  # missing free_completed: close it here
                al_end[old] = i
            aid = new_alloc(int(addr), int(e.get("size", 0)), stack(e.get("frames")),
                            stream_id(e.get("stream", 0)), i, e.get("user_metadata"))
            by_addr[addr] = aid
            ev_ref[i] = aid
        elif k == K_FREE_REQUESTED or k == K_FREE_COMPLETED:
            pre = pre_free_alloc.get(i)
            if pre is not None:
                by_addr[e.get("addr", 0)] = pre
            aid = by_addr.get(e.get("addr", 0), -1)
            ev_ref[i] = aid
            if aid >= 0:
                if k == K_FREE_REQUESTED:
                    if al_req[aid] == -1:
                        al_req[aid] = i
                else:
                    al_end[aid] = i
                    del by_addr[e.get("addr", 0)]
        elif k in (K_SEGMENT_ALLOC, K_SEGMENT_FREE, K_SEGMENT_MAP, K_SEGMENT_UNMAP):
            ev_ref[i] = len(se_addr)
            se_addr.append(int(e.get("addr", 0)))
            se_size.append(int(e.get("size", 0)))
            se_stream.append(stream_id(e.get("stream", 0)))
        elif k == K_OOM:
            ev_ref[i] = len(ooms)
            ooms.append({
                "event": i, "size": int(e.get("size", 0) or 0),
                "device_free": int(e.get("device_free", 0) or 0),
                "stack": stack(e.get("frames")),
            })

    # Link end-state active blocks to the allocations still live at the end.
    for addr, aid in by_addr.items():
        bj = blk_index_by_addr.get(int(addr))
        if bj is not None and blk_alloc[bj] == -1:
            blk_alloc[bj] = aid
            if not al_stack[aid] and blk_stack[bj]:
                al_stack[aid] = blk_stack[bj]

    seg_addr = array("d", (r[0] for r in seg_rows))
    seg_size = array("d", (r[1] for r in seg_rows))
    seg_stream = array("i", (r[2] for r in seg_rows))
    seg_pool = array("B", (r[3] for r in seg_rows))
    seg_first = array("i", (r[4] for r in seg_rows))
    meta: dict[str, Any] = {
        "device": dev,
        "n_events": n,
        "n_allocs": len(al_addr),
        "n_pre": len(pre_blocks) + len(pre_from_free),
        "n_segments": len(seg_rows),
        "n_blocks": len(blk_addr),
        "n_seg_events": len(se_addr),
        "has_time": has_time,
        "t0_us": t0,
        "streams": [str(s) for s in streams],
        "ooms": ooms,
        "stats": stats,
    }
    cols: dict[str, array] = {
        "ev_kind": ev_kind, "ev_ref": ev_ref, "ev_time": ev_time,
        "al_addr": al_addr, "al_size": al_size, "al_stack": al_stack, "al_stream": al_stream,
        "al_start": al_start, "al_end": al_end, "al_req": al_req, "al_meta": al_meta,
        "seg_addr": seg_addr, "seg_size": seg_size, "seg_stream": seg_stream,
        "seg_pool": seg_pool, "seg_first": seg_first,
        "blk_addr": blk_addr, "blk_size": blk_size, "blk_state": blk_state,
        "blk_alloc": blk_alloc, "blk_stack": blk_stack,
        "se_addr": se_addr, "se_size": se_size, "se_stream": se_stream,
    }
    return meta, cols


def build_payload(
    source: Any, *, title: str | None = None, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Build the viewer's payload (plain data; typed columns as :class:`array.array`).

    The result has ``frames`` (``[name, filename, line]`` rows), ``stacks`` (lists of frame ids,
    innermost first; stack 0 is empty), ``devices`` (one entry per device with a trace or a
    segment: counts, ``stats`` and typed columns under ``columns``) and ``allocator_settings``.

    Example:
        >>> p = build_payload([])          # a bare list of segments, here empty
        >>> p["devices"], p["stacks"]
        ([], [[]])
    """
    say = progress or (lambda _msg: None)
    snap = _as_snapshot_dict(source)
    interner = _Interner()
    traces = snap.get("device_traces") or []
    segments = snap.get("segments") or []
    by_dev: dict[int, list[Mapping[str, Any]]] = {}
    for seg in segments:
        by_dev.setdefault(int(seg.get("device", 0) or 0), []).append(seg)
    devs = sorted(set(by_dev) | {i for i, t in enumerate(traces) if t})
    say("analysing")
    stats = _analysis(source, snap) or {s["device"]: s for s in raw_stats(snap)}
    names = (snap.get("torchmem") or {}).get("device_names") or {}
    devices = []
    for dev in devs:
        trace = list(traces[dev]) if dev < len(traces) and traces[dev] else []
        say(f"device {dev}: {len(trace)} events, {len(by_dev.get(dev, []))} segments")
        base = stats.get(dev) or {"device": dev}
        meta, cols = _device_payload(dev, trace, by_dev.get(dev, []), interner, dict(base))
        meta["stats"]["timeline_peak_bytes"] = _timeline_peak(cols, meta["n_events"])
        meta["name"] = str(names.get(str(dev)) or base.get("name") or f"device {dev}")
        meta["columns"] = cols
        devices.append(meta)
    settings = snap.get("allocator_settings")
    return {
        "version": PAYLOAD_VERSION,
        "title": title or "memory snapshot",
        "frames": interner.frames,
        "stacks": interner.stacks,
        "texts": interner.texts,
        "notes": [str(x) for x in (snap.get("torchmem") or {}).get("notes") or []],
        "devices": devices,
        "allocator_settings": _jsonable(settings) if settings else None,
        "kind_names": KIND_NAMES,
    }


def _timeline_peak(cols: Mapping[str, array], n: int) -> int:
    """Peak of the timeline's live bytes (trace sizes, from alloc to free_completed), replayed
    from the columns; allocations that predate the trace count from the start."""
    size = cols["al_size"]
    start = cols["al_start"]
    total = sum(int(size[a]) for a in range(len(size)) if start[a] == -1)
    peak = total
    kind = cols["ev_kind"]
    ref = cols["ev_ref"]
    for i in range(n):
        k = kind[i]
        if k == K_ALLOC:
            total += int(size[ref[i]])
            if total > peak:
                peak = total
        elif k == K_FREE_COMPLETED and ref[i] >= 0:
            total -= int(size[ref[i]])
    return peak


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def encode_payload(payload: Mapping[str, Any]) -> str:
    """Pack a payload into one base64 string: deflate(header length, JSON header, columns).

    Each column is 8-byte aligned in the buffer; the JSON header records its type, offset and
    length. The browser inflates it with its built-in ``DecompressionStream('deflate')``.

    Example:
        >>> s = encode_payload(build_payload([]))
        >>> raw = zlib.decompress(base64.b64decode(s))
        >>> n = struct.unpack("<I", raw[:4])[0]
        >>> json.loads(raw[4:4 + n])["version"]
        1
    """
    blobs: list[bytes] = []
    pos = 0
    devices = []
    for dev in payload["devices"]:
        d = {k: v for k, v in dev.items() if k != "columns"}
        index = {}
        for name, arr in dev["columns"].items():
            data = _b64(arr)
            index[name] = [arr.typecode, pos, len(arr)]
            blobs.append(data)
            pos += len(data)
            pad = (-pos) % 8
            if pad:
                blobs.append(b"\0" * pad)
                pos += pad
        d["columns"] = index
        devices.append(d)
    header = dict(payload)
    header["devices"] = devices
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hpad = (-(4 + len(hbytes))) % 8
    raw = b"".join([struct.pack("<I", len(hbytes) + hpad), hbytes, b" " * hpad, *blobs])
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")  # level 1: 5x faster, ~6% larger


# --------------------------------------------------------------------------- HTML


def _asset(name: str) -> str:
    return (importlib.resources.files("torchmem.report") / "viewer_assets" / name).read_text("utf-8")


def render_html(
    source: Any, *, title: str | None = None, progress: ProgressFn | None = None
) -> str:
    """The viewer page for ``source`` as one HTML string (all code, style and data inline).

    ``source`` is a snapshot dict or list, an object with ``to_pytorch_dict()``, or a path to a
    snapshot or torchmem trace file (read with torchmem's safe loaders).

    Example:
        >>> page = render_html({"segments": [], "device_traces": []}, title="empty")
        >>> "<title>empty" in page and "<script src" not in page
        True
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        title = title or path.name
        source = load_any(path)
    payload = build_payload(source, title=title, progress=progress)
    if progress:
        progress("encoding payload")
    data = encode_payload(payload)
    page = _asset("viewer.html")
    t = _html.escape(payload["title"])
    # Only the template's own placeholders are replaced; the data is base64 (no '<' possible).
    return (
        page.replace("/*__CSS__*/", _asset("viewer.css"))
        .replace("/*__JS__*/", _asset("viewer.js"))
        .replace("__PAYLOAD__", data)
        .replace("__TITLE__", t)
    )


def write_viewer(
    source: Any, path: str | os.PathLike[str], *, title: str | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """Write the self-contained viewer page for ``source`` to ``path`` and return the path.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "report.html"
        >>> write_viewer([], out).stat().st_size > 1000
        True
    """
    text = render_html(source, title=title, progress=progress)
    out = Path(path)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(
            f"could not write the viewer to {str(out)!r}: {e.strerror}; "
            "fix: pass -o with a writable path"
        ) from e
    return out


# --------------------------------------------------------------------------- loading files


def load_any(path: str | os.PathLike[str]) -> Any:
    """Read a snapshot (any PyTorch version, pickle or torchmem JSON) or a torchmem trace file
    (``.tmtrace``, converted to a snapshot) and return something :func:`build_payload` accepts.
    Uses torchmem's safe snapshot reader, so a pickle that tries to import or call anything is
    refused before anything runs.

    Example:
        >>> load_any("no/such/file.pickle")
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: no/such/file.pickle: no such file; fix: pass the path of a snapshot (.pickle/.json) or a torchmem trace
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(
            f"{path}: no such file; fix: pass the path of a snapshot (.pickle/.json) or a "
            "torchmem trace"
        )
    from torchmem.snapshot.reader import load_snapshot  # noqa: PLC0415

    return load_snapshot(p)


def iter_frames(payload: Mapping[str, Any], stack_id: int) -> Iterable[list[Any]]:
    """Frames ``[name, filename, line]`` of one interned stack, innermost first.

    Example:
        >>> p = build_payload({"segments": [], "device_traces": [[{"action": "alloc",
        ...     "addr": 0, "size": 8, "stream": 0,
        ...     "frames": [{"name": "f", "filename": "a.py", "line": 1}]}]]})
        >>> list(iter_frames(p, 1))
        [['f', 'a.py', 1]]
    """
    for fid in payload["stacks"][stack_id]:
        yield payload["frames"][fid]
