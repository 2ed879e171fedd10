"""Reading PyTorch's ``device_traces`` into :class:`~torchmem.model.snapshot.DeviceTrace` columns.

The hot path of :mod:`torchmem.io.pytorch_snapshot` (trace entries are most of a snapshot):
columns are built a whole list at a time with ``map`` over ``itemgetter``, and stacks are cached
by the identity of the frame lists that PyTorch's pickles share between entries. Private: use
:func:`torchmem.io.pytorch_snapshot.from_pytorch` or :func:`torchmem.io.load_snapshot`.

Example:
    >>> from torchmem.model.snapshot import Snapshot
    >>> snap = Snapshot()
    >>> entries = [{"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 1,
    ...             "frames": []}]
    >>> t = read_device_trace(Interner(snap, "x.pickle"), 0, entries, set())
    >>> len(t), t[0].action
    (1, 'alloc')
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Any

from torchmem.errors import SnapshotFormatError
from torchmem.model.events import Category, Phase
from torchmem.model.snapshot import ACTIONS, DeviceTrace, Frame, Snapshot

__all__ = ["Interner", "describe", "origin_of", "read_device_trace"]

_CATEGORY_CODES = {c.label: int(c) for c in Category}
_PHASE_CODES = {p.label: int(p) for p in Phase}
_FULL = itemgetter("action", "addr", "size", "stream", "time_us", "frames")


def describe(obj: Any) -> str:
    """A short description of ``obj`` for error messages.

    Example:
        >>> describe({"b": 1, "a": 2}), describe([1, 2])
        ("a dict with keys ['a', 'b']", 'a list of 2 items')
    """
    if isinstance(obj, dict):
        keys = sorted(map(str, obj))[:8]
        return f"a dict with keys {keys}"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__name__}"


class Interner:
    """Frame and stack interning for one normalisation, cached by the identity of the raw frame
    dicts and lists (the caller keeps the raw object alive while this is used).

    Example:
        >>> from torchmem.model.snapshot import Snapshot
        >>> frames = [{"filename": "a.py", "line": 1, "name": "f"}]
        >>> ctx = Interner(Snapshot(), "x.pickle"); ctx.stack(frames), ctx.stack(frames)
        (1, 1)
    """

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
                    f"{describe(f)}"
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
                    f"{self.where}: 'frames' should be a list of frame dicts, got {describe(frames)}"
                )
            frame = self.frame
            sid = self.snap.intern_stack([frame(f) for f in frames])
            self.stack_by_id[id(frames)] = sid
        return sid


def origin_of(raw: dict[str, Any]) -> tuple[Category | None, Phase | None, str | None]:
    """Category, phase and module of one block or trace entry dict (``None`` when absent).

    Example:
        >>> origin_of({"category": "gradient", "module": "fc"})
        (<Category.GRADIENT: 3>, None, 'fc')
    """
    c = _CATEGORY_CODES.get(raw.get("category"))  # type: ignore[arg-type]
    p = _PHASE_CODES.get(raw.get("phase"))  # type: ignore[arg-type]
    m = raw.get("module")
    return (
        None if c is None else Category(c),
        None if p is None else Phase(p),
        str(m) if m else None,
    )


def _trace_origin(t: DeviceTrace, entries: list[Any], features: set[str]) -> None:
    """Fill the category/phase/module columns of ``t`` from entries that carry those keys."""
    cats, phases, mods = array("b"), array("b"), array("i")
    cat_code, phase_code, intern = _CATEGORY_CODES.get, _PHASE_CODES.get, t.intern_text
    for e in entries:
        c = cat_code(e.get("category"), -1)
        p = phase_code(e.get("phase"), -1)
        m = e.get("module")
        cats.append(c)
        phases.append(p)
        mods.append(intern(str(m)) if m else -1)
    t.categories, t.phases, t.modules = cats, phases, mods
    features.update(("category", "phase", "module"))


def _fast_columns(
    ctx: Interner,
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


def read_device_trace(ctx: Interner, dev: int, entries: Any, features: set[str]) -> DeviceTrace:
    where = ctx.where
    if not isinstance(entries, list):
        raise SnapshotFormatError(
            f"{where}: device_traces[{dev}] should be a list of trace entries, got {describe(entries)}"
        )
    t = ctx.snap.new_trace(dev)
    if not entries:
        return t
    first = entries[0]
    if not isinstance(first, dict):
        raise SnapshotFormatError(
            f"{where}: device_traces[{dev}][0] should be a dict, got {describe(first)}"
        )
    has_cc = "compile_context" in first
    has_um = "user_metadata" in first
    texts: dict[str, int] = {}
    cc_col = array("I") if has_cc else None
    um_col = array("I") if has_um else None
    codes = {name: i for i, name in enumerate(ACTIONS)}
    has_origin = "category" in first or "phase" in first or "module" in first
    if _fast_columns(ctx, t, entries, codes, has_cc, has_um, features):
        if has_origin:
            _trace_origin(t, entries, features)
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
    text_cols = [
        (key, col)
        for key, col in (("compile_context", cc_col), ("user_metadata", um_col))
        if col is not None
    ]
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
            for key, col in text_cols:
                c = e.get(key, "")
                k = texts.get(c)
                if k is None:
                    k = texts[c] = len(texts)
                col.append(k)
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
    if has_origin:
        _trace_origin(t, entries, features)
    return t
