"""The viewer's data: a snapshot as a compact columnar payload (no torch, no file I/O).

:func:`build_payload` turns a :class:`~torchmem.model.snapshot.Snapshot` (or a
:class:`~torchmem.model.trace.Trace`, converted first) into a compact columnar payload: every
allocation and event becomes a row of typed arrays, frames and stacks are interned in tables.
Allocations and their lifetimes come from the replay engine,
:meth:`torchmem.analysis.replay.DeviceReplay.lifetimes`; the figures shown beside the timeline
from :mod:`torchmem.analysis`. :func:`encode_payload` deflates and base64-encodes it for the
page (:mod:`torchmem.render.viewer.html`), whose JavaScript decodes it with the browser's
built-in ``DecompressionStream``.

Example:
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> snap = from_pytorch({"segments": [{"device": 0, "address": 4096,
    ...          "total_size": 2048, "stream": 0, "segment_type": "small", "blocks": [
    ...             {"address": 4096, "size": 512, "requested_size": 500,
    ...              "state": "active_allocated", "frames": []},
    ...             {"address": 4608, "size": 1536, "requested_size": 0,
    ...              "state": "inactive", "frames": []}]}],
    ...         "device_traces": [[
    ...             {"action": "alloc", "addr": 4096, "size": 512, "stream": 0,
    ...              "frames": [{"name": "f", "filename": "a.py", "line": 3}]}]]})
    >>> payload = build_payload(snap)
    >>> dev = payload["devices"][0]
    >>> dev["n_events"], dev["n_allocs"], dev["stats"]["allocated_bytes"]
    (1, 1, 512)
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Mapping
from itertools import compress
from typing import Any, Callable

from torchmem.analysis._oom import oom_report
from torchmem.analysis._peak import snapshot_peak
from torchmem.analysis._stats import snapshot_stats
from torchmem.analysis.replay import DeviceReplay, Lifetimes
from torchmem.errors import InvalidInputError, TorchmemError
from torchmem.io.convert import CPU_NOTE, snapshot_from_trace
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.model.snapshot import Snapshot
from torchmem.model.trace import Trace
from torchmem.render.viewer._origin import (
    CATEGORY_NAMES,
    PHASE_NAMES,
    origin_columns,
    peak_position,
    tracked_figures,
)
from torchmem.sim.replay import TraceReplay

__all__ = ["as_snapshot", "build_payload", "encode_payload", "iter_frames"]

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
#: Names of the payload's event kinds, indexed by ``ev_kind``.
KIND_NAMES = [
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot", "other",
]
_STATES = {"inactive": 0, "active_allocated": 1, "active_pending_free": 2}
_STREAM_KINDS = (True, False, False, True, True, True, True, False, False, False)  # stream ids
_SEGMENT_OR_OOM = (False,) * 3 + (True,) * 5 + (False,) * 2

ProgressFn = Callable[[str], None]


def as_snapshot(source: Any) -> Snapshot:
    """The :class:`~torchmem.model.snapshot.Snapshot` the viewer shows for ``source``.

    ``source`` is a Snapshot, a :class:`~torchmem.model.trace.Trace` (converted with
    :func:`torchmem.io.convert.snapshot_from_trace`) or PyTorch's own snapshot dict
    (``torch.cuda.memory._snapshot()``); the viewer never opens files: load one with
    :func:`torchmem.io.load_snapshot`.

    Example:
        >>> as_snapshot(Trace()).segments
        []
        >>> as_snapshot("snap.pickle")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: the viewer expected a memory snapshot ...
    """
    if isinstance(source, Snapshot):
        return source
    if isinstance(source, Trace):
        return snapshot_from_trace(source)
    if isinstance(source, list) or (isinstance(source, Mapping) and "segments" in source):
        return from_pytorch(source)
    got = type(source).__name__
    if isinstance(source, Mapping):
        got = f"a dict with keys {sorted(map(str, source))[:8]}"
    raise InvalidInputError(
        "the viewer expected a memory snapshot (a torchmem Snapshot or Trace, or PyTorch's "
        f"torch.cuda.memory._snapshot() dict), got {got}; fix: load a file with "
        "torchmem.io.load_snapshot(path)"
    )


class _Interner:
    """Frames, stacks and annotation texts interned in tables; a stack is a list of frame ids."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []
        self.stacks: list[list[int]] = [[]]
        self.texts: list[str] = []
        self._frame_ids: dict[Any, int] = {}
        self._stack_ids: dict[tuple[int, ...], int] = {(): 0}
        self._by_obj: dict[int, tuple[Any, int]] = {}
        self._text_ids: dict[str, int] = {}

    def stack(self, frames: Any) -> int:
        """Id of a stack (a sequence of :class:`~torchmem.model.snapshot.Frame`)."""
        if not frames:
            return 0
        # The model interns stacks, so most lookups hit by object (kept alive in the cache).
        hit = self._by_obj.get(id(frames))
        if hit is not None and hit[0] is frames:
            return hit[1]
        ids = []
        for f in frames:
            fid = self._frame_ids.get(f)
            if fid is None:
                fid = self._frame_ids[f] = len(self.frames)
                self.frames.append([f.name, f.filename, f.line])
            ids.append(fid)
        key = tuple(ids)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._stack_ids[key] = len(self.stacks)
            self.stacks.append(ids)
        self._by_obj[id(frames)] = (frames, sid)
        return sid

    def text(self, value: Any) -> int:
        """Index of a non-empty annotation string (``user_metadata``), -1 for none."""
        if not value or not isinstance(value, str) or value == "N/A":
            return -1
        i = self._text_ids.get(value)
        if i is None:
            i = self._text_ids[value] = len(self.texts)
            self.texts.append(value)
        return i


# --------------------------------------------------------------------------- stats


def _device_figures(model: Snapshot) -> dict[int, dict[str, Any]]:
    """Per-device figures from torchmem's snapshot analysis: end-state stats, the peak (and
    what was live there, by stack) and OOM verdicts."""
    stats = snapshot_stats(model).to_dict()["devices"]
    peaks = {p.device: p.to_dict() for p in snapshot_peak(model, top=8).devices}
    ooms = [o.to_dict() for o in oom_report(model)]
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


def _le_bytes(arr: array) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - typed arrays in JS are little-endian here
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _block_sizes(model: Snapshot, dev: int, lt: Lifetimes) -> tuple[array, str]:
    """Each allocation's block size as the allocator simulator replays the trace.

    With these the Allocator State History is exact: a block's extent is its real address plus
    its simulated size (slack included), and free memory is what the blocks leave of each
    segment (the allocator merges free neighbours). Returns an empty column and the reason when
    the simulator cannot reproduce the trace; the page then rounds requests to 512 B.
    """
    try:
        tr = TraceReplay(model, dev, stop_at_divergence=True)
        tr.run()
        result = tr.result()
    except TorchmemError as e:
        return array("d"), f"approximate (request rounded to 512 B): the trace cannot be replayed: {e}"
    if result.first_divergence is not None or not result.final_layout_equal:
        why = (result.first_divergence or {}).get("explanation", "the final layout differs")
        return array("d"), f"approximate (request rounded to 512 B): the simulator diverged: {why}"
    pre = {b[0]: b[1] for seg in tr.start_segments for b in seg.blocks}
    sizes = tr.block_sizes
    out = array("d", bytes(8 * len(lt.addr)))
    for aid in range(len(lt.addr)):
        start = lt.start[aid]
        if start >= 0:
            out[aid] = sizes[start]
        else:
            out[aid] = pre.get(lt.addr[aid], 0)
    return out, (
        f"simulated: every alloc replayed at its real address ({result.allocs_matched} allocs, "
        f"{result.segment_allocs_matched} segment_allocs, final layout equal)"
    )


def _is_tracked(model: Snapshot) -> bool:
    """Whether ``model`` is a torchmem tracked run (no caching allocator: one storage per segment).

    Example:
        >>> from torchmem.io.convert import snapshot_from_events
        >>> _is_tracked(snapshot_from_events([])), _is_tracked(Snapshot())
        (True, False)
    """
    return model.source.format == "torchmem-events" or CPU_NOTE in model.notes


def _device_payload(
    model: Snapshot, dev: int, interner: _Interner, stats: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, array]]:
    """Columns for one device. Allocation ids are the replay engine's, in stacking order (see
    :class:`~torchmem.analysis.replay.Lifetimes`)."""
    tracked = _is_tracked(model)
    t = model.trace(dev)
    n = len(t)
    lt = DeviceReplay(model, dev).lifetimes()
    kmap = [_KINDS.get(name, K_OTHER) for name in t.action_names]
    ev_kind = array("B", map(kmap.__getitem__, t.actions))
    addrs, sizes, tstreams = t.addrs, t.sizes, t.streams
    stack_of = [interner.stack(s) for s in model.stacks]  # model stack id -> payload stack id
    metas = t.user_metadata
    meta_of = [interner.text(x) for x in t.texts]
    streams: dict[int, int] = {}

    def stream_id(s: int) -> int:
        k = streams.get(s)
        if k is None:
            k = streams[s] = len(streams)
        return k

    # End-state segments and blocks, in address order.
    segs = sorted(model.segments_of(dev), key=lambda s: s.address)
    seg_addr, seg_size, seg_stream = array("d"), array("d"), array("i")
    seg_pool, seg_first = array("B"), array("i")
    blk_addr, blk_size, blk_state = array("d"), array("d"), array("B")
    blk_alloc, blk_stack = array("i"), array("i")
    for seg in segs:
        seg_addr.append(seg.address)
        seg_size.append(seg.total_size)
        seg_stream.append(stream_id(seg.stream))
        seg_pool.append(1 if seg.segment_type == "small" else 0)
        seg_first.append(len(blk_addr))
        for b in seg.blocks:
            blk_addr.append(b.address)
            blk_size.append(b.size)
            blk_state.append(_STATES.get(b.state, 0))
            blk_alloc.append(-1)
            blk_stack.append(interner.stack(b.frames))

    # Stream ids in order of first use: segments, allocations from before the trace, then the
    # trace's allocations and segment entries.
    for s in lt.stream[: lt.n_pre]:
        stream_id(s)
    for s in dict.fromkeys(compress(tstreams, map(_STREAM_KINDS.__getitem__, ev_kind))):
        stream_id(s)
    al_addr, al_size = array("d", lt.addr), array("d", lt.size)
    al_stack = array("i", map(stack_of.__getitem__, lt.stack))
    al_stream = array("i", map(streams.__getitem__, lt.stream))
    if metas is None:
        al_meta = array("i", [-1]) * len(lt.entry)
    else:
        al_meta = array("i", [meta_of[metas[i]] if i >= 0 else -1 for i in lt.entry])

    # Event references: the allocation of an alloc/free, else the segment entry or the OOM.
    ev_ref = array("i", lt.event_alloc)
    se_addr, se_size, se_stream = array("d"), array("d"), array("i")
    ooms: list[dict[str, Any]] = []
    for i in compress(range(n), map(_SEGMENT_OR_OOM.__getitem__, ev_kind)):
        if ev_kind[i] == K_OOM:
            ev_ref[i] = len(ooms)
            ooms.append({"event": i, "size": sizes[i], "device_free": addrs[i],
                         "stack": stack_of[t.stack_ids[i]]})
        else:
            ev_ref[i] = len(se_addr)
            se_addr.append(addrs[i])
            se_size.append(sizes[i])
            se_stream.append(streams[tstreams[i]])

    if tracked:  # no caching allocator: each block is its storage, exactly
        al_bsize = array("d", lt.size)
        state_model = "exact: one segment per storage, no caching allocator (a torchmem tracked run)"
    else:
        al_bsize, state_model = _block_sizes(model, dev, lt)
    stats["allocator_state"] = state_model
    al_cat, al_phase, al_mod = origin_columns(t, lt, meta_of)

    # Link the end state's active blocks to the allocations still live at the end.
    blk_of = {int(blk_addr[b]): b for b in range(len(blk_addr)) if blk_state[b]}
    for addr, aid in lt.live_at_end.items():
        bj = blk_of.get(addr)
        if bj is not None and blk_alloc[bj] == -1:
            blk_alloc[bj] = aid
            if not al_stack[aid] and blk_stack[bj]:
                al_stack[aid] = blk_stack[bj]

    ev_time = array("d")
    has_time = bool(n) and t.has_time
    t0 = 0
    if has_time:
        times = t.times
        t0 = min(times)
        if t0 >= 0:  # every entry has a time: one C-speed pass
            ev_time = array("d", map(t0.__rsub__, times))
        else:  # entries without a time (-1) keep the time of the entry before them
            t0 = min((x for x in times if x >= 0), default=0)
            last = 0.0
            for x in times:
                if x >= 0:
                    last = float(x - t0)
                ev_time.append(last)
    stats["timeline_peak_bytes"] = lt.peak_bytes
    # The peak as the 0-based trace entry after which it is reached (as `torchmem trace` numbers
    # entries) and its time in seconds from the start of the run.
    peak_pos = peak_position(lt.live_bytes()) if n else 0
    stats["peak_event"] = peak_pos - 1 if peak_pos > 0 else None
    stats["peak_time_s"] = ev_time[peak_pos - 1] / 1e6 if has_time and peak_pos > 0 else None
    if tracked:
        stats["tracked"] = tracked_figures(lt, al_cat, al_phase, al_mod, interner.texts, ev_time)
    meta: dict[str, Any] = {
        "device": dev,
        "n_events": n,
        "n_allocs": len(al_addr),
        "n_pre": lt.n_pre,
        "n_segments": len(seg_addr),
        "n_blocks": len(blk_addr),
        "n_seg_events": len(se_addr),
        "has_time": has_time,
        "t0_us": t0,
        "tracked": tracked,
        "streams": [str(s) for s in streams],
        "ooms": ooms,
        "stats": stats,
    }
    cols: dict[str, array] = {
        "ev_kind": ev_kind, "ev_ref": ev_ref, "ev_time": ev_time,
        "al_addr": al_addr, "al_size": al_size, "al_stack": al_stack, "al_stream": al_stream,
        "al_start": lt.start, "al_end": lt.end, "al_req": lt.requested, "al_meta": al_meta,
        "al_bsize": al_bsize, "al_cat": al_cat, "al_phase": al_phase, "al_module": al_mod,
        "seg_addr": seg_addr, "seg_size": seg_size, "seg_stream": seg_stream,
        "seg_pool": seg_pool, "seg_first": seg_first,
        "blk_addr": blk_addr, "blk_size": blk_size, "blk_state": blk_state,
        "blk_alloc": blk_alloc, "blk_stack": blk_stack,
        "se_addr": se_addr, "se_size": se_size, "se_stream": se_stream,
    }
    return meta, cols


def build_payload(
    source: Snapshot | Trace, *, title: str | None = None, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Build the viewer's payload (plain data; typed columns as :class:`array.array`).

    ``source`` is a :class:`~torchmem.model.snapshot.Snapshot` or a
    :class:`~torchmem.model.trace.Trace` (see :func:`as_snapshot`). The result has ``frames``
    (``[name, filename, line]`` rows), ``stacks`` (lists of frame ids, innermost first; stack 0
    is empty), ``texts`` (annotations and module names), ``devices`` (per device: counts,
    ``stats`` from :mod:`torchmem.analysis` with the peak as a 0-based trace entry
    ``peak_event`` and ``peak_time_s`` from the start of the run, ``tracked`` for a run with no
    caching allocator and then ``stats["tracked"]``, and typed ``columns``, among them each
    allocation's ``al_cat``/``al_phase``/``al_module`` for torchmem's traces),
    ``category_names``, ``phase_names``, ``allocator_settings`` and ``notes``.

    Example:
        >>> p = build_payload(Snapshot())
        >>> p["devices"], p["stacks"]
        ([], [[]])
    """
    say = progress or (lambda _msg: None)
    model = as_snapshot(source)
    say("analysing")
    figures = _device_figures(model)
    interner = _Interner()
    devices = []
    for dev in model.devices:
        say(f"device {dev}: {len(model.trace(dev))} events, {len(model.segments_of(dev))} segments")
        stats = dict(figures.get(dev) or {"device": dev})
        meta, cols = _device_payload(model, dev, interner, stats)
        meta["name"] = model.device_name(dev)
        meta["columns"] = cols
        devices.append(meta)
    settings = model.allocator_settings
    return {
        "version": PAYLOAD_VERSION,
        "title": title or "memory snapshot",
        "frames": interner.frames,
        "stacks": interner.stacks,
        "texts": interner.texts,
        "notes": [str(x) for x in model.notes],
        "devices": devices,
        "allocator_settings": _jsonable(settings) if settings else None,
        "kind_names": KIND_NAMES,
        "category_names": CATEGORY_NAMES,
        "phase_names": PHASE_NAMES,
    }


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
        >>> s = encode_payload(build_payload(Snapshot()))
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
            data = _le_bytes(arr)
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


def iter_frames(payload: Mapping[str, Any], stack_id: int) -> Iterable[list[Any]]:
    """Frames ``[name, filename, line]`` of one interned stack, innermost first.

    Example:
        >>> p = build_payload(from_pytorch({"segments": [], "device_traces": [[
        ...     {"action": "alloc", "addr": 0, "size": 8, "stream": 0,
        ...      "frames": [{"name": "f", "filename": "a.py", "line": 1}]}]]}))
        >>> list(iter_frames(p, 1))
        [['f', 'a.py', 1]]
    """
    for fid in payload["stacks"][stack_id]:
        yield payload["frames"][fid]
