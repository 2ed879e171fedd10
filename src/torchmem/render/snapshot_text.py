"""Plain-text renderers for snapshot analyses (no torch): stats, peak, diff, trace, OOM.

Every function returns a ``str`` (or yields lines); bytes are formatted here, at the edge, with
:func:`torchmem.units.format_bytes`.

Example:
    >>> from torchmem.analysis._stats import SnapshotStats, DeviceStats
    >>> print(render_stats(SnapshotStats([DeviceStats(0, "cuda:0", reserved_bytes=2097152)])).splitlines()[0])
    cuda:0  (device 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torchmem.render.text import plain_table, shorten_site, signed_bytes
from torchmem.units import format_bytes

__all__ = ["render_stats", "render_peak", "render_diff", "render_trace", "render_oom"]


def _b(n: int) -> str:
    return format_bytes(n)


def render_stats(stats: Any) -> str:
    """Render :class:`~torchmem.analysis._stats.SnapshotStats`.

    Example:
        >>> from torchmem.analysis._stats import SnapshotStats
        >>> render_stats(SnapshotStats([]))
        'no devices in this snapshot (no segments and no trace entries)\\n'
    """
    out: list[str] = []
    if not stats.devices:
        out.append("no devices in this snapshot (no segments and no trace entries)")
    for d in stats.devices:
        out.append(f"{d.name}  (device {d.device})")
        rows = [
            ("reserved", _b(d.reserved_bytes), f"{d.segments} segments"),
            ("allocated", _b(d.allocated_bytes), f"{d.blocks - d.inactive_blocks} active blocks"),
            ("active", _b(d.active_bytes), f"pending free {_b(d.pending_free_bytes)}"),
            ("requested", _b(d.requested_bytes), f"rounding slack {_b(d.rounding_slack_bytes)}"),
            ("free in segments", _b(d.free_bytes), f"{d.inactive_blocks} inactive blocks"),
            ("largest free block", _b(d.largest_free_block),
             f"fragmentation {d.fragmentation * 100:.1f}%"),
            ("expandable segments", "yes" if d.expandable_segments else "no", ""),
        ]
        for name, val, extra in rows:
            out.append(f"  {name:<20} {val:>12}  {extra}".rstrip())
        if d.pools:
            out.append("  pools:")
            for name, p in sorted(d.pools.items()):
                out.append(
                    f"    {name:<18} reserved {_b(p.reserved_bytes):>11}  allocated "
                    f"{_b(p.allocated_bytes):>11}  free {_b(p.free_bytes):>11}  "
                    f"{p.segments} segments, {p.blocks} blocks"
                )
        if len(d.streams) > 1 or (d.streams and 0 not in d.streams):
            out.append("  streams:")
            for s, p in sorted(d.streams.items()):
                out.append(
                    f"    stream {s:<11} reserved {_b(p.reserved_bytes):>11}  allocated "
                    f"{_b(p.allocated_bytes):>11}  free {_b(p.free_bytes):>11}"
                )
        if d.trace_entries:
            acts = ", ".join(f"{k} {v}" for k, v in d.trace_actions.items())
            out.append(f"  trace: {d.trace_entries} entries ({acts})")
    if stats.allocator_settings:
        s = dict(stats.allocator_settings)
        ms = s.get("max_split_size")
        if ms == -1:
            s["max_split_size"] = "unlimited (-1)"
        r = s.pop("roundup_power2_divisions", None)
        out.append("allocator settings:")
        for k, v in s.items():
            out.append(f"  {k} = {v!r}")
        if isinstance(r, dict):
            on = {k: v for k, v in r.items() if v}
            out.append(f"  roundup_power2_divisions = {on if on else 'off'}")
    for n in stats.notes:
        out.append(f"note: {n}")
    return "\n".join(out) + "\n"


def _groups(title: str, groups: Iterable[Any], total: int) -> list[str]:
    lines = [f"  {title}"]
    any_ = False
    for g in groups:
        any_ = True
        pct = 100.0 * g.bytes / total if total else 0.0
        lines.append(f"    {_b(g.bytes):>11} {pct:5.1f}%  {g.count:>6} allocs  {g.stack[0]}")
        for fr in g.stack[1:]:
            lines.append(f"    {'':>11} {'':>6}  {'':>6}         {fr}")
    if not any_:
        lines.append("    (nothing live)")
    return lines


def render_peak(report: Any) -> str:
    """Render :class:`~torchmem.analysis._peak.PeakReport`.

    Example:
        >>> from torchmem.analysis._peak import PeakReport, DevicePeak
        >>> print(render_peak(PeakReport([DevicePeak(0, "cuda:0", 1024, 2, None, 0, 512, 4)])).splitlines()[0])
        cuda:0: peak allocated 1.00 KiB at trace entry #2 (entries #0-#3; start 0 B, end 512 B)
    """
    out: list[str] = []
    for d in report.devices:
        where = (f"at trace entry #{d.peak_index}" if d.peak_index >= 0
                 else "before the first trace entry")
        out.append(
            f"{d.name}: peak allocated {_b(d.peak_allocated_bytes)} {where} "
            f"(entries #0-#{d.trace_entries - 1}; start {_b(d.initial_allocated_bytes)}, "
            f"end {_b(d.end_allocated_bytes)})"
        )
        if not d.consistent:
            out.append(
                "  warning: the trace does not agree with the end state (allocations at live "
                "addresses or a negative start); figures are approximate"
            )
        out += _groups("live at the peak, by stack:", d.at_peak, d.peak_allocated_bytes)
        out += _groups("live at the end, by stack:", d.at_end, d.end_allocated_bytes)
    if not report.devices:
        out.append("no devices in this snapshot")
    return "\n".join(out) + "\n"


def render_diff(diff: Any, top: int | None = 20) -> str:
    """Render :class:`~torchmem.analysis._diff.SnapshotDiff` or
    :class:`~torchmem.analysis._diff.TraceDiff`: signed changes (``+3.00 GiB``), largest first.

    ``top`` limits the rows of each table (``None`` or 0: all).

    Example:
        >>> from torchmem.analysis._diff import SnapshotDiff
        >>> render_diff(SnapshotDiff([], {}))
        'no differences in allocated blocks\\n'
    """
    from torchmem.analysis._diff import TraceDiff

    if isinstance(diff, TraceDiff):
        return _render_trace_diff(diff, top)
    out: list[str] = []
    for dev, t in diff.totals.items():
        if diff.at == "peak":
            out.append(
                f"device {dev}: peak allocated {_b(t['peak_bytes_before'])} -> "
                f"{_b(t['peak_bytes_after'])} ({signed_bytes(t['peak_bytes_delta'])}); at trace "
                f"entry {_entry(t['peak_index_before'])} -> {_entry(t['peak_index_after'])}"
            )
            continue
        out.append(
            f"device {dev}: reserved {_b(t['reserved_bytes_before'])} -> "
            f"{_b(t['reserved_bytes_after'])} ({signed_bytes(t['reserved_bytes_delta'])}), "
            f"allocated {_b(t['allocated_bytes_before'])} -> {_b(t['allocated_bytes_after'])} "
            f"({signed_bytes(t['allocated_bytes_delta'])}); segments only before "
            f"{t['segments_only_before']}, only after {t['segments_only_after']}"
        )
    rows = diff.rows[:top] if top else diff.rows
    if not rows:
        out.append("no differences in allocated blocks"
                   + (" live at the peak" if diff.at == "peak" else ""))
    else:
        out.append(f"live at the {diff.at}, by stack (after - before, largest change first):")
    for r in rows:
        out.append(
            f"  {signed_bytes(r.delta_bytes):>12}  ({_b(r.before_bytes)} -> {_b(r.after_bytes)}, "
            f"{r.before_count} -> {r.after_count} blocks)  dev {r.device}  {r.stack[0]}"
        )
        for fr in r.stack[1:]:
            out.append(f"  {'':>13}  {fr}")
    if top and len(diff.rows) > top:
        out.append(f"  ... {len(diff.rows) - top} more stacks (use --top 0 for all)")
    return "\n".join(out) + "\n"


def _entry(index: int) -> str:
    return f"#{index}" if index >= 0 else "(none)"


_GROUP_TITLES = {"category": "category", "module": "module", "operator": "operator",
                 "call_site": "call site", "phase": "phase"}


def _render_trace_diff(d: Any, top: int | None) -> str:
    from torchmem.render.summary import short_site

    point = {"peak": "the peak", "end": "the end"}.get(d.at, f"the peak of iteration {d.at[5:]}")
    dev = d.device_before if d.device_before == d.device_after else (
        f"{d.device_before} -> {d.device_after}")
    out = [
        f"live at {point} on {dev}: {_b(d.before_bytes)} -> {_b(d.after_bytes)} "
        f"({signed_bytes(d.delta_bytes)}); trace entry {_entry(d.before_index)} -> "
        f"{_entry(d.after_index)}",
        f"run peaks: {_b(d.peak_before)} -> {_b(d.peak_after)} "
        f"({signed_bytes(d.peak_after - d.peak_before)})",
    ]
    for name, rows in d.groups.items():
        changed = [g for g in rows if g.delta_bytes or g.before_count != g.after_count]
        if name == "phase" or not changed:
            continue
        shown = changed[:top] if top else changed
        cells = [[signed_bytes(g.delta_bytes), _b(g.before_bytes), _b(g.after_bytes),
                  f"{g.before_count} -> {g.after_count}",
                  shorten_site(short_site(g.name)) if name == "call_site" else g.name]
                 for g in shown]
        out.append("")
        out.append(f"by {_GROUP_TITLES[name]} (after - before, largest change first):")
        table = plain_table(["change", "before", "after", "storages", _GROUP_TITLES[name]],
                            cells, right=3)
        out += ["  " + line for line in table.splitlines()]
        if len(changed) > len(shown):
            out.append(f"  ... {len(changed) - len(shown)} more (use --top 0 for all)")
    if all(not g.delta_bytes and g.before_count == g.after_count
           for rows in d.groups.values() for g in rows):
        out.append(f"no differences in what was live at {point}")
    if d.iterations:
        cells = []
        for it in d.iterations:
            x = it.to_dict()
            step = str(it.step) if x["complete"] else f"{it.step} (after last step)"
            cells.append([
                step,
                _b(x["peak_bytes_before"]) if it.before else "-",
                _b(x["peak_bytes_after"]) if it.after else "-",
                signed_bytes(x["peak_bytes_delta"]),
                signed_bytes(x["retained_growth_before"]) if it.before else "-",
                signed_bytes(x["retained_growth_after"]) if it.after else "-",
            ])
        out.append("")
        out.append("per iteration (peak of each iteration; retained growth = live at its end "
                   "minus live at its start):")
        table = plain_table(["step", "peak before", "peak after", "change", "growth before",
                             "growth after"], cells, right=6)
        out += ["  " + line for line in table.splitlines()]
    return "\n".join(out) + "\n"


def render_trace(rows: Iterable[Any]) -> Iterator[str]:
    """Yield one line per :class:`~torchmem.analysis._events.TraceRow`.

    Example:
        >>> from torchmem.analysis._events import TraceRow
        >>> next(render_trace([TraceRow(0, 0, 5, "alloc", 4096, 512, 0, 512, 2097152, "m.py:1:f")]))
        '      0  dev 0  t=5             alloc          addr=0x1000         512 B  alloc 512 B  reserved 2.00 MiB  m.py:1:f'
    """
    for r in rows:
        t = f"t={r.time_us}" if r.time_us is not None else ""
        addr = f"free={_b(r.addr)}" if r.action == "oom" else f"addr={r.addr:#x}"
        yield (
            f"{r.index:>7}  dev {r.device}  {t:<15} {r.action:<14} {addr:<16} {_b(r.size):>8}  "
            f"alloc {_b(r.allocated_bytes)}  reserved {_b(r.reserved_bytes)}  {r.frame}"
        ).rstrip()


def render_oom(events: Iterable[Any]) -> str:
    """Render :func:`~torchmem.analysis._oom.oom_report` results.

    Example:
        >>> render_oom([])
        ''
    """
    out: list[str] = []
    for e in events:
        out.append(
            f"OOM on {e.name} at trace entry {e.index}: requested {_b(e.requested_bytes)}, "
            f"device free {_b(e.device_free_bytes)}, cached free {_b(e.cached_free_bytes)}, "
            f"reserved {_b(e.reserved_bytes)}, allocated {_b(e.allocated_bytes)} -> {e.verdict}"
        )
        out.append(f"  {e.explanation}")
    return "\n".join(out) + ("\n" if out else "")
