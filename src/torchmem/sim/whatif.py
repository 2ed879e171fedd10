"""What if the allocator had been configured differently? Replay the recorded requests and see.

:func:`whatif` replays the requests recorded in a snapshot's trace (``alloc``, the frees, the
program's ``empty_cache()`` calls) through :class:`~torchmem.sim.replay.TraceReplay` (the one
allocator model, :class:`~torchmem.sim.CachingAllocator`) under another
``PYTORCH_CUDA_ALLOC_CONF`` and, optionally, another capacity, and reports per device, side by
side with the recorded run: peak reserved and allocated bytes, fragmentation at the peak of
allocated bytes (reserved minus allocated, the largest free block per pool, inactive split
bytes), segment allocations and frees (cudaMalloc/cudaFree calls; expandable segments' page
maps and unmaps count too), allocation retries and out-of-memory errors.

- **The recorded run.** Segment counts, the peak of reserved bytes and the OOMs are read from
  the trace itself (``segment_*`` and ``oom`` entries); block sizes (allocated bytes) and the
  free blocks at the peak come from the replay with the recorded settings at the real
  addresses, which reproduces the allocator's decisions (``torchmem replay`` checks that).
  Retries: one per ``oom`` entry (PyTorch counts the last retry before each OOM); a retry that
  succeeded looks like a program's ``empty_cache()`` in a trace and is replayed as one.
- **Without** ``alloc_conf`` the recorded settings are used and, when the replay is exact, the
  what-if equals the recorded run figure for figure (:attr:`DeviceWhatIf.identical`): the
  replay proof.
- **Capacity.** ``capacity`` (bytes, or a size such as ``"24 GiB"``) limits what cudaMalloc may
  reserve; without it a trace with a recorded OOM is replayed on the device it ran on (reserved
  plus the device's free bytes at the first OOM), an estimate on its GPU, anything else on an
  unlimited device. At each recorded ``oom`` entry the failed request is tried again: the
  recorded OOM either happens again or is avoided (then the block is freed at once: the
  recorded program never held it). Any other OOM stops the what-if there (the program would
  have crashed); its figures then cover the run up to it.
- **Mid-run traces** (the ring buffer dropped older entries, or recording began late) start
  from the state rebuilt from the snapshot's end state, which the recorded settings made; the
  figures cover the recorded window only, and this is said in the notes. A trace cut short so
  that it frees memory the snapshot cannot account for is an error, never replayed as complete.
- **Inputs.** A PyTorch snapshot, a torchmem trace (a :class:`~torchmem.model.Trace` or a
  snapshot loaded from a ``.tmtrace``: its storage allocations and frees become the requests,
  all on stream 0, and the "recorded" column is the default settings, simulated, since no
  caching allocator was recorded), or an :class:`~torchmem.fit.Estimate` made with
  ``keep_snapshot=True`` (its simulated run, on its GPU).

The limit, stated in every result (:data:`LIMIT`): a what-if keeps the program's requests fixed.

:func:`suggest` tries :data:`SUGGESTED_CONFIGS` on top of the recorded settings and ranks them by
OOM avoided, then peak reserved bytes, then cudaMalloc calls. To explain an OOM: a setting that
would have fit the failed request is ``suggest(snap).devices[k].best`` when its ``avoids_oom``
is true (every :class:`Suggestion` says ``avoids_oom``); ``whatif(snap, conf)`` answers for one
setting (:attr:`DeviceWhatIf.recorded_oom_avoided`).

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> a = CachingAllocator()
    >>> a.free(a.malloc(12 << 20)); z = a.malloc(14 << 20)   # a 12 MiB segment, then 14 MiB
    >>> w = whatif(a.snapshot(), "expandable_segments:True").devices[0]
    >>> w.recorded.peak_reserved_bytes >> 20, w.whatif.peak_reserved_bytes >> 20
    (26, 20)
    >>> whatif(a.snapshot()).devices[0].identical
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError, TorchmemError
from torchmem.model.snapshot import Snapshot
from torchmem.sim._start import StartSegment
from torchmem.sim._whatif_inputs import (
    HISTORY_HINT,
    Input,
    parse_capacity,
    replay_devices,
    what_to_replay,
)
from torchmem.sim._whatif_model import LIMIT, DeviceWhatIf, RunFigures, Suggestion, WhatIf
from torchmem.sim.allocator import CachingAllocator
from torchmem.sim.config import _BOOL_KEYS, _FLOAT_KEYS, _INT_KEYS, AllocatorConfig
from torchmem.sim.replay import TraceReplay
from torchmem.units import format_bytes

__all__ = [
    "LIMIT",
    "SUGGESTED_CONFIGS",
    "DeviceWhatIf",
    "RunFigures",
    "Suggestion",
    "WhatIf",
    "conf_string",
    "suggest",
    "whatif",
]

#: What :func:`suggest` tries, each on top of the recorded settings. Garbage collection acts
#: only under a per-process memory fraction, so it is tried with ``per_process_memory_fraction``
#: 1.0 (the whole device), and only when the capacity is known.
SUGGESTED_CONFIGS: tuple[str, ...] = (
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:8",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:1.0",
    "garbage_collection_threshold:0.8,per_process_memory_fraction:1.0",
)

_SEG_UP = ("segment_alloc", "segment_map")
_SEG_DOWN = ("segment_free", "segment_unmap")
# -- configurations as strings ----------------------------------------------------------------


def conf_string(config: AllocatorConfig) -> str:
    """``config`` as a ``PYTORCH_CUDA_ALLOC_CONF`` string of its non-default options
    (``""`` for the defaults); :meth:`AllocatorConfig.parse` reads it back to an equal config.

    Example:
        >>> conf_string(AllocatorConfig.parse("max_split_size_mb:128, expandable_segments:True"))
        'max_split_size_mb:128,expandable_segments:True'
        >>> c = AllocatorConfig.parse("roundup_power2_divisions:[256:1,>:4]")
        >>> AllocatorConfig.parse(conf_string(c)) == c, conf_string(AllocatorConfig())
        (True, '')
    """
    default = AllocatorConfig()
    parts: list[str] = []
    for name in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                 "garbage_collection_threshold", "per_process_memory_fraction",
                 "expandable_segments", "release_lock_on_cudamalloc",
                 "graph_capture_record_stream_reuse", "pinned_use_cuda_host_register",
                 "pinned_num_register_threads"):
        v = getattr(config, name)
        if v != getattr(default, name):
            parts.append(f"{name}:{v}")
    div = config.roundup_power2_divisions
    if div != default.roundup_power2_divisions:
        if len(set(div)) == 1:
            parts.append(f"roundup_power2_divisions:{div[0]}")
        else:
            table = ",".join(f"{1 << k}:{d}" for k, d in enumerate(div))
            parts.append(f"roundup_power2_divisions:[{table}]")
    parts.extend(f"{k}:{v}" for k, v in config.host_options)
    return ",".join(parts)


def _parse_conf(alloc_conf: AllocatorConfig | str) -> AllocatorConfig:
    """Parse ``alloc_conf``; every error names the option and lists the valid ones."""
    if isinstance(alloc_conf, AllocatorConfig):
        return alloc_conf
    if not isinstance(alloc_conf, str):
        raise InvalidInputError(
            f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string such as "
            f"'expandable_segments:True' or an AllocatorConfig, got {type(alloc_conf).__name__}"
        )
    try:
        return AllocatorConfig.parse(alloc_conf)
    except InvalidInputError as e:
        if "known options" in str(e):
            raise
        known = sorted({*_BOOL_KEYS, *_INT_KEYS, *_FLOAT_KEYS, "backend", "roundup_power2_divisions"})
        raise InvalidInputError(f"{e}; valid options: {', '.join(known)}") from None


# -- the replays ------------------------------------------------------------------------------


@dataclass
class _Run:
    """A stepped what-if replay: the figures as it goes."""

    tr: TraceReplay
    peak_reserved: int = 0
    peak_allocated: int = 0
    peak_entry: int = -1
    peak_at_attempt: bool = False
    oom: dict[str, Any] | None = None
    first_recorded_avoided: bool | None = None
    held: int = 0


def _oom_dict(snap: Snapshot, dev: int, i: int, sim: CachingAllocator, allocated: int,
              recorded: bool) -> dict[str, Any]:
    t = snap.trace(dev)
    frames = snap.stacks[t.stack_ids[i]] if t.stack_ids[i] < len(snap.stacks) else ()
    real = [f for f in frames if not f.filename.startswith("<") and f.filename != "??"]
    mine = [f for f in real if "torch" not in f.filename.replace("\\", "/").split("/")]
    pick = mine or real  # the innermost frame outside torch, else the innermost
    where = f"{pick[0].filename}:{pick[0].line} {pick[0].name}" if pick else None
    return {"entry": i, "request_bytes": int(t.sizes[i]), "stream": int(t.streams[i]),
            "recorded": recorded, "reserved_bytes": sim.reserved_bytes,
            "allocated_bytes": allocated, "where": where}


def _walk(snap: Snapshot, dev: int, cfg: AllocatorConfig, capacity: int | None,
          start: list[StartSegment], stop: tuple[int, bool] | None = None,
          real: bool = False) -> _Run:
    """Replay under ``cfg``: the trace's entries, and each recorded OOM's request tried again.

    ``stop`` ``(entry, at_retried_oom)`` ends the walk right after that entry (or after the
    retried request of the recorded OOM at that entry) with the state there: the second pass,
    which reads the state at the peak of allocated bytes. ``real``: new segments take the
    trace's addresses in order (only for the recorded settings on the recorded device: best fit
    breaks ties between equal free blocks by address); otherwise simulated ones, as cudaMalloc's
    are unknowable. A start state in expandable segments is seeded as plain segments of the
    mapped sizes when ``cfg`` has none."""
    fraction = cfg.per_process_memory_fraction
    if fraction is not None and capacity is None:
        raise InvalidInputError(
            f"the settings {conf_string(cfg)!r} set per_process_memory_fraction, which needs the "
            "device's capacity: pass capacity=... (torchmem whatif --gpu NAME|SIZE)"
        )
    if not cfg.expandable_segments and any(seg.expandable for seg in start):
        start = [replace(seg, expandable=False) for seg in start]
    tr = TraceReplay(snap, dev, config=cfg, capacity=capacity, start=start, real_addresses=real)
    run = _Run(tr, tr.peak_reserved_bytes, tr.peak_allocated_bytes)
    t = snap.trace(dev)
    end = len(t) if stop is None else stop[0] + 1
    code = t.action_names.index("oom") if "oom" in t.action_names else -1
    points = [i for i in range(end) if t.actions[i] == code] if code >= 0 else []
    sim = tr.allocator
    names = t.action_names
    for i in [*points, end]:
        first = i  # a recorded OOM: the allocator's own release just before it is not replayed
        while i < end and first > 0 and names[t.actions[first - 1]] in _SEG_DOWN:
            first -= 1
        try:
            tr.run(max(first, tr.position))
            tr.skip(i)
        except SimulatedOutOfMemoryError:
            run.oom = _oom_dict(snap, dev, tr.position, sim, tr.allocated_bytes, False)
            break
        finally:
            if tr.peak_allocated_bytes > run.peak_allocated:
                run.peak_allocated, run.peak_entry = tr.peak_allocated_bytes, tr.peak_allocated_entry
                run.peak_at_attempt = False
            run.peak_reserved = max(run.peak_reserved, tr.peak_reserved_bytes)
        if i == end:
            break
        before = sim.allocated_bytes
        try:  # the recorded OOM's request, tried again
            addr = sim.malloc(int(t.sizes[i]), int(t.streams[i]))
        except SimulatedOutOfMemoryError:
            if run.first_recorded_avoided is None:
                run.first_recorded_avoided = False
            if run.oom is None:
                run.oom = _oom_dict(snap, dev, i, sim, tr.allocated_bytes, True)
            continue
        if run.first_recorded_avoided is None:
            run.first_recorded_avoided = True
        held = sim.allocated_bytes - before
        run.peak_reserved = max(run.peak_reserved, sim.reserved_bytes)
        if tr.allocated_bytes + held > run.peak_allocated:
            run.peak_allocated, run.peak_entry = tr.allocated_bytes + held, i
            run.peak_at_attempt = True
        if stop == (i, True):
            run.held = held  # the state at the peak holds the block
            break
        sim.free(addr)
    return run


def _state(run: _Run) -> tuple[int, dict[str, int], int]:
    """Reserved minus allocated, the largest free block per pool and the inactive split bytes."""
    sim = run.tr.allocator
    largest = {"large": 0, "small": 0}
    split = 0
    for seg in sim.layout():
        free = [size for _off, size, used in seg[3] if not used]
        if free:
            pool = "small" if seg.small else "large"  # type: ignore[attr-defined]
            largest[pool] = max(largest[pool], max(free))
            if len(seg[3]) > 1 and not seg.is_expandable:  # type: ignore[attr-defined]
                split += sum(free)
    return sim.reserved_bytes - run.tr.allocated_bytes - run.held, largest, split


def _figures(snap: Snapshot, dev: int, cfg: AllocatorConfig, capacity: int | None,
             start: list[StartSegment], state: bool = True, real: bool = False,
             ) -> tuple[RunFigures, _Run]:
    """Run the what-if, then (``state``) again up to its peak of allocated bytes for the state
    there."""
    run = _walk(snap, dev, cfg, capacity, start, real=real)
    sim = run.tr.allocator
    ups = sum(1 for e in sim.events if e[0] in _SEG_UP)
    downs = sum(1 for e in sim.events if e[0] in _SEG_DOWN)
    retries = sim.num_alloc_retries
    frag: int | None = None
    largest: dict[str, int] | None = None
    split: int | None = None
    if state:
        at = _walk(snap, dev, cfg, capacity, start, stop=(run.peak_entry, run.peak_at_attempt),
                   real=real)
        frag, largest, split = _state(at)
    figs = RunFigures(
        conf_string(cfg), run.peak_reserved, run.peak_allocated, frag, largest, split, ups, downs,
        retries, run.oom, run.peak_entry, complete=run.oom is None or run.oom["recorded"],
    )
    return figs, run


def _recorded(snap: Snapshot, dev: int, cfg: AllocatorConfig) -> tuple[RunFigures, TraceReplay]:
    """The recorded run: segments and OOMs from the trace, block sizes from the exact replay."""
    try:
        tr = TraceReplay(snap, dev, config=cfg)
        tr.run()
    except InvalidInputError as e:
        raise InvalidInputError(
            f"device {dev}: the trace is cut short (entries were dropped) and cannot be replayed "
            f"from any state the snapshot records, so a what-if would not be complete: {e}. Fix: "
            f"{HISTORY_HINT}, with max_entries large enough for the whole run"
        ) from None
    t = snap.trace(dev)
    names = t.action_names
    reserved = sum(s.size for s in tr.start_segments)
    peak_r = reserved
    ups = downs = retries = 0
    oom: dict[str, Any] | None = None
    for i in range(len(t)):
        a = names[t.actions[i]]
        if a in _SEG_UP:
            ups += 1
            reserved += t.sizes[i]
            peak_r = max(peak_r, reserved)
        elif a in _SEG_DOWN:
            downs += 1
            reserved -= t.sizes[i]
        elif a == "oom":
            retries += 1
            if oom is None:
                oom = {"entry": i, "request_bytes": int(t.sizes[i]), "stream": int(t.streams[i]),
                       "recorded": True, "reserved_bytes": reserved,
                       "device_free_bytes": int(t.addrs[i])}
    at = TraceReplay(snap, dev, config=cfg, start=tr.start_segments)
    at.run(tr.peak_allocated_entry + 1)
    frag, largest, split = _state(_Run(at))
    figs = RunFigures(conf_string(cfg), peak_r, tr.peak_allocated_bytes, frag, largest, split,
                      ups, downs, retries, oom, tr.peak_allocated_entry)
    return figs, tr


# -- the API ----------------------------------------------------------------------------------


@dataclass
class _Device:
    """What every what-if on one device shares: the recorded run and the start state."""

    snap: Snapshot
    dev: int
    source: str
    cfg: AllocatorConfig
    start: list[StartSegment]
    recorded: RunFigures
    replay_exact: bool | None
    capacity: int | None
    capacity_source: str | None
    notes: list[str]


def _prepare(inp: Input, dev: int, capacity: int | None) -> _Device:
    snap = inp.snapshot
    notes = list(inp.notes)
    cap, cap_source = capacity, "given" if capacity is not None else None
    start: list[StartSegment] = []
    exact: bool | None = None
    if inp.source == "trace":  # no allocator recorded: the default settings, simulated
        cfg = AllocatorConfig()
        recorded, _ = _figures(snap, dev, cfg, cap, start)
    else:
        cfg = AllocatorConfig.from_settings(snap.allocator_settings)
        # the notes on older torch versions (not the one that 2.13's own settings omit options)
        notes.extend(n for n in cfg.notes if not n.startswith("the snapshot's settings do not"))
        recorded, tr = _recorded(snap, dev, cfg)
        res = tr.result()
        start = tr.start_segments
        exact = res.first_divergence is None and res.final_layout_equal
        if not exact:
            why = res.first_divergence["explanation"] if res.first_divergence else (
                "the final layout differs from the snapshot's")
            notes.append(
                "the replay with the recorded settings does not reproduce every decision of the "
                f"real allocator ({why}); block sizes and the what-if are approximate"
            )
        if res.start == "rebuilt":
            notes.append(
                f"the trace starts mid-run (older entries were dropped by the ring buffer, or "
                f"recording began late): the state at its start ({res.start_segments} segments, "
                f"{res.start_live_blocks} live blocks) was rebuilt from the end state; it was made "
                "by the recorded settings and every what-if starts from it; the figures cover the "
                "recorded window only"
            )
    if cap is None and inp.capacity is not None:
        cap, cap_source = inp.capacity, "the estimate's GPU (usable bytes)"
    if cap is None and recorded.oom is not None:
        o = recorded.oom
        cap = o["reserved_bytes"] + o["device_free_bytes"]
        cap_source = (f"the recorded OOM at trace entry {o['entry']}: reserved "
                      f"{format_bytes(o['reserved_bytes'])} + device free "
                      f"{format_bytes(o['device_free_bytes'])}")
    return _Device(snap, dev, inp.source, cfg, start, recorded, exact, cap, cap_source, notes)


def _device_whatif(d: _Device, cfg: AllocatorConfig | None, with_baseline: bool) -> DeviceWhatIf:
    """The what-if under ``cfg`` (``None``: the recorded settings) and, when asked for or the
    same, the recorded settings replayed on the same device (the baseline of suggestions)."""
    baseline: RunFigures | None = None
    real = d.capacity_source != "given"  # the recorded settings on the recorded device
    if cfg is None or cfg == d.cfg:
        figs, run = _figures(d.snap, d.dev, d.cfg, d.capacity, d.start, real=real)
        baseline = figs
    else:
        figs, run = _figures(d.snap, d.dev, cfg, d.capacity, d.start)
        if with_baseline:
            baseline, _ = _figures(d.snap, d.dev, d.cfg, d.capacity, d.start, state=False,
                                   real=real)
    identical = figs.same_as(d.recorded)
    notes = list(d.notes)
    if cfg is not None and cfg != d.cfg:
        notes.append(
            "under other settings new segments get simulated addresses (cudaMalloc's cannot be "
            "known), so where two free blocks are equally good the choice may differ from the "
            "real allocator's"
        )
        if not cfg.expandable_segments and any(seg.expandable for seg in d.start):
            notes.append(
                "the state at the trace's start is in expandable segments; without them it is "
                "seeded as plain segments of the mapped sizes"
            )
    if (cfg is None or cfg == d.cfg) and d.source != "trace":
        if identical and d.replay_exact:
            notes.append("the what-if equals the recorded run exactly (same settings, same "
                         "requests): the replay proof")
        elif identical:
            notes.append("the what-if's figures equal the recorded run's, but the replay does "
                         "not reproduce every decision (see above): no proof")
        elif d.capacity_source == "given":
            notes.append("the recorded settings on the device given: the figures differ from the "
                         "recorded run's because the device does (no identity is claimed)")
        else:
            notes.append("the what-if with the recorded settings differs from the recorded run: "
                         "the simulator does not reproduce this trace exactly (see torchmem "
                         "replay), so read the what-if figures as approximate")
    return DeviceWhatIf(
        device=d.dev, name=d.snap.device_name(d.dev), source=d.source, recorded=d.recorded,
        whatif=figs, baseline=baseline, identical=identical, replay_exact=d.replay_exact,
        capacity=d.capacity, capacity_source=d.capacity_source,
        start="rebuilt" if d.start else "empty",
        recorded_oom_avoided=run.first_recorded_avoided,
        notes=tuple(notes),
    )


def whatif(
    snapshot: Any,
    alloc_conf: AllocatorConfig | str | None = None,
    capacity: int | str | None = None,
    *,
    device: int | None = None,
) -> WhatIf:
    """Replay ``snapshot``'s recorded requests under ``alloc_conf`` (and ``capacity``) and
    report each device side by side with the recorded run (see the module's docstring).

    ``snapshot`` is a :class:`~torchmem.model.Snapshot` with an allocator trace, a torchmem
    :class:`~torchmem.model.Trace` (or its snapshot), or an :class:`~torchmem.fit.Estimate`
    made with ``keep_snapshot=True``. ``alloc_conf`` is the whole ``PYTORCH_CUDA_ALLOC_CONF``
    to try (``None``: the recorded settings); ``capacity`` bytes, or a size such as
    ``"24 GiB"``, that cudaMalloc may reserve. Unknown options raise
    :class:`~torchmem.errors.InvalidInputError` naming the option and listing the valid ones;
    so does a snapshot without allocator history.

    Example:
        >>> a = CachingAllocator()
        >>> a.free(a.malloc(12 << 20)); z = a.malloc(14 << 20)
        >>> d = whatif(a.snapshot(), "expandable_segments:True").devices[0]
        >>> d.recorded.segment_allocs, d.whatif.segment_allocs, d.whatif.peak_reserved_bytes >> 20
        (2, 1, 20)
        >>> whatif(a.snapshot(), capacity="13 MiB").devices[0].whatif.oom["entry"]
        5
        >>> whatif(a.snapshot(), "expandable_segment:True")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: unrecognized allocator option 'expandable_segment' in 'expandable_segment:True'; known options: ...
    """
    cfg = None if alloc_conf is None else _parse_conf(alloc_conf)
    cap = parse_capacity(capacity)
    inp = what_to_replay(snapshot)
    out = []
    for dev in replay_devices(inp.snapshot, device):
        out.append(_device_whatif(_prepare(inp, dev, cap), cfg, with_baseline=False))
    return WhatIf(tuple(out))


def _cost(base: RunFigures, f: RunFigures) -> str:
    """What ``f`` costs against ``base`` (more calls, retries, allocated bytes), and what else
    it saves."""
    worse: list[str] = []
    better: list[str] = []
    for label, a, b in (("cudaMalloc calls", base.segment_allocs, f.segment_allocs),
                        ("cudaFree calls", base.segment_frees, f.segment_frees),
                        ("allocation retries (each synchronizes the device)", base.alloc_retries,
                         f.alloc_retries)):
        if b > a:
            worse.append(f"{b - a} more {label} ({a} -> {b})")
        elif b < a:
            better.append(f"{a - b} fewer {label} ({a} -> {b})")
    a, b = base.peak_allocated_bytes, f.peak_allocated_bytes
    if b > a:
        worse.append(f"{format_bytes(b - a)} more peak allocated (coarser rounding or unsplit blocks)")
    cost = "; ".join(worse) or "nothing more (no more cudaMalloc/cudaFree calls, retries or allocated bytes)"
    return cost + (f"; also {'; '.join(better)}" if better else "")


def _suggestions(d: _Device, baseline: RunFigures, configs: Sequence[str],
                 progress: Callable[[str], None] | None) -> tuple[Suggestion, ...]:
    tried: list[Suggestion] = []
    seen = {d.cfg}
    for k, change in enumerate(configs):
        if progress is not None:
            progress(f"device {d.dev}: trying {k + 1}/{len(configs)}: {change}")
        try:
            delta = AllocatorConfig.parse(change)
            touched = {p.split(":", 1)[0].strip() for p in change.split(",") if ":" in p}
            cfg = replace(d.cfg, **{name: getattr(delta, name) for name in touched},
                          settings="")
        except (TorchmemError, TypeError, AttributeError) as e:
            tried.append(Suggestion(change, change, None, False, 0, "", f"not valid here: {e}"))
            continue
        conf = conf_string(cfg)
        if cfg in seen:
            continue
        seen.add(cfg)
        if cfg.per_process_memory_fraction is not None and d.capacity is None:
            tried.append(Suggestion(conf, change, None, False, 0, "",
                                    "needs the device's capacity (pass capacity= / --gpu)"))
            continue
        try:
            f, _ = _figures(d.snap, d.dev, cfg, d.capacity, d.start, state=False)
        except TorchmemError as e:
            tried.append(Suggestion(conf, change, None, False, 0, "", f"not simulated: {e}"))
            continue
        tried.append(Suggestion(conf, change, f, baseline.oom is not None and f.oom is None,
                                baseline.peak_reserved_bytes - f.peak_reserved_bytes,
                                _cost(baseline, f)))
    ran = sorted((s for s in tried if s.figures is not None),
                 key=lambda s: s.figures.key() if s.figures else (True, 0, 0))
    return (*ran, *(s for s in tried if s.figures is None))


def suggest(
    snapshot: Any,
    capacity: int | str | None = None,
    *,
    device: int | None = None,
    alloc_conf: AllocatorConfig | str | None = None,
    configs: Sequence[str] = SUGGESTED_CONFIGS,
    progress: Callable[[str], None] | None = None,
) -> WhatIf:
    """:func:`whatif`, plus each of ``configs`` tried on top of the recorded settings, ranked.

    Ranked by OOM avoided, then peak reserved bytes, then cudaMalloc calls
    (:attr:`DeviceWhatIf.suggestions`; those that could not be simulated come last, with the
    reason). :attr:`DeviceWhatIf.best` is the first one when it beats the recorded settings
    replayed on the same device (``baseline``), else ``None``. ``progress`` gets a line per
    configuration tried.

    Example:
        >>> a = CachingAllocator()
        >>> a.free(a.malloc(12 << 20)); z = a.malloc(14 << 20)
        >>> d = suggest(a.snapshot()).devices[0]
        >>> d.best.line, d.best.saved_bytes >> 20
        ('PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True', 6)
    """
    if isinstance(configs, str) or not all(isinstance(c, str) for c in configs):
        raise InvalidInputError(
            "configs must be a sequence of PYTORCH_CUDA_ALLOC_CONF strings, e.g. "
            "['expandable_segments:True']"
        )
    cfg = None if alloc_conf is None else _parse_conf(alloc_conf)
    cap = parse_capacity(capacity)
    inp = what_to_replay(snapshot)
    out = []
    for dev in replay_devices(inp.snapshot, device):
        d = _prepare(inp, dev, cap)
        w = _device_whatif(d, cfg, with_baseline=True)
        base = w.baseline
        assert base is not None
        ranked = _suggestions(d, base, configs, progress)
        top = ranked[0].figures if ranked else None
        best = ranked[0] if top is not None and top.key() < base.key() else None
        out.append(replace(w, suggestions=ranked, best=best))
    return WhatIf(tuple(out))
