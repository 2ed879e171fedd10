"""Text and JSON renderings of a :class:`~torchmem.analysis.summary.TraceSummary` (no torch).

Example:
    >>> import io
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K, Category as C
    >>> from torchmem.analysis.summary import summarize_trace
    >>> tr = Trace()
    >>> _ = tr.append(K.ALLOC, 0, "cpu", 2048, 1, op="aten::mm", module="Net.fc",
    ...               category=C.ACTIVATION)
    >>> out = io.StringIO(); render_summary(summarize_trace(tr), out)
    >>> "aten::mm" in out.getvalue() and "2.00 KiB" in out.getvalue()
    True
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from torchmem.analysis.summary import TraceSummary
from torchmem.render.text import rich_table, shorten_site, signed_bytes
from torchmem.units import format_bytes

__all__ = ["render_summary", "summary_json"]

_NUMBERS = ("bytes", "%", "storages")


def summary_json(summary: TraceSummary, indent: int | None = 2) -> str:
    """The summary as JSON text (bytes as integers).

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.analysis.summary import summarize_trace
        >>> import json; json.loads(summary_json(summarize_trace(Trace())))["steps"]
        0
    """
    return json.dumps(summary.to_dict(), indent=indent, sort_keys=False)


def render_summary(
    summary: TraceSummary,
    file: IO[str] | None = None,
    *,
    max_iterations: int = 12,
    color: bool | None = None,
) -> None:
    """Write a human-readable summary (rich tables; plain text when not a terminal).

    Example:
        >>> import io
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.analysis.summary import summarize_trace
        >>> buf = io.StringIO(); render_summary(summarize_trace(Trace()), buf)
        >>> "no allocations" in buf.getvalue()
        True
    """
    from rich.console import Console

    out = file if file is not None else sys.stdout
    is_tty = bool(getattr(out, "isatty", lambda: False)())
    console = Console(
        file=out,
        force_terminal=color if color is not None else None,
        no_color=not (color if color is not None else is_tty),
        width=None if is_tty else 100,
        highlight=False,
        soft_wrap=False,
    )
    s = summary
    if not s.device or s.events == 0:
        console.print("torchmem: no allocations were recorded.")
        return
    peak = s.peak.get(s.device, 0)
    others = ", ".join(f"{d} {format_bytes(b)}" for d, b in s.peak.items() if d != s.device)
    console.print(
        f"[bold]Peak {format_bytes(peak)} on {s.device}[/bold] at trace entry #{s.peak_index} "
        f"({s.peak_time_ns / 1e6:.1f} ms); {s.events} events, {s.steps} step marker(s)"
        + (f"; other devices: {others}" if others else "")
    )
    if s.aggregated:
        console.print(s.aggregated["detail"], soft_wrap=True)

    def table(title: str, rows: list[tuple[str, int, int]], first: str, total: int) -> None:
        if not rows:
            return
        cells = [
            (name, format_bytes(b), f"{100.0 * b / total:.1f}" if total else "-", str(c))
            for name, b, c in rows
        ]
        console.print(rich_table(title, [first, "bytes", "%", "storages"], cells,
                                 right=_NUMBERS, no_wrap=(first,), show_edge=False, pad_edge=False))

    if s.categories_at_peak:
        cells = [(cat, format_bytes(b), f"{100.0 * b / peak:.1f}" if peak else "-")
                 for cat, b in s.categories_at_peak.items()]
        console.print(rich_table("Live at the peak, by category", ["category", "bytes", "%"],
                                 cells, right=_NUMBERS, show_edge=False))
    table("Live at the peak, by module", s.top_modules_at_peak, "module", peak)
    table("Live at the peak, by operator", s.top_ops_at_peak, "operator", peak)
    if s.top_stacks_at_peak:
        # the bytes, % and storages columns take about 35 characters; the site gets the rest
        budget = max(30, console.width - 36)
        sites = [(shorten_site(short_site(name), budget), b, c)
                 for name, b, c in s.top_stacks_at_peak]
        table("Live at the peak, by call site", sites, "call site", peak)
    total_alloc = sum(b for _, b, _ in s.top_ops_allocated)
    table("Allocated over the run, by operator", s.top_ops_allocated, "operator", total_alloc)
    table("Allocated over the run, by module", s.top_modules_allocated, "module", total_alloc)
    table("Allocated over the run, by thread", s.top_threads_allocated, "thread", total_alloc)
    if s.iterations:
        header = ["step", "peak", "live at end", "retained growth", "allocated"]
        its = s.iterations
        shown: list[Any] = list(its)
        if len(its) > max_iterations:
            half = max_iterations // 2
            shown = [*its[:half], None, *its[-half:]]
        it_rows = [
            ("...", "", "", "", "") if it is None else (
                str(it.step) if it.complete else f"{it.step} (after last step)",
                format_bytes(it.peak_bytes),
                format_bytes(it.end_bytes),
                signed_bytes(it.retained_growth),
                format_bytes(it.allocated_bytes),
            )
            for it in shown
        ]
        console.print(rich_table("Iterations", header, it_rows, right=header, show_edge=False))
    g = s.growth
    if g is not None and g.growing:
        budget = max(30, console.width - 60)
        rows = [
            ("call site" if gg.grouping == "call_site" else "module",
             shorten_site(short_site(gg.name), budget) if gg.grouping == "call_site" else gg.name,
             signed_bytes(gg.bytes_per_iteration), str(gg.start_step),
             signed_bytes(gg.growth_bytes), format_bytes(gg.end_bytes[-1]))
            for gg in g.growing
        ]
        console.print(rich_table(
            "Growing over iterations (live bytes at iteration ends trend up)",
            ["by", "name", "per iteration", "from step", "growth", "live at end"], rows,
            right=("per iteration", "from step", "growth", "live at end"), no_wrap=("name",),
            show_edge=False, pad_edge=False))
    if s.leak_suspect and g is not None:
        n_judged = len(g.end_bytes) - g.warmup
        # name a call site (where to look) before a module when one grows
        top = next((x for x in g.growing if x.grouping == "call_site"),
                   g.growing[0] if g.growing else None)
        console.print(
            f"[bold red]Possible leak:[/bold red] live memory grows by "
            f"{format_bytes(g.bytes_per_iteration)} per iteration from step {g.start_step} on "
            f"({signed_bytes(g.growth_bytes)} in all; trend over the {n_judged} iterations after "
            f"{g.warmup} warm-up)"
            + (f"; growing at {short_site(top.name) if top.grouping == 'call_site' else top.name}"
               f" ({signed_bytes(top.bytes_per_iteration)} per iteration from step {top.start_step})"
               if top else "")
            + ". Look for tensors kept across iterations (e.g. appending losses without .item()).",
            soft_wrap=True,  # one line: the terminal wraps it, no line of its own starts mid-way
        )


def short_site(site: str, cwd: str | None = None) -> str:
    """Shorten a ``"file:line:function"`` call site for a table (JSON keeps the full path).

    Paths under the working directory become relative; paths inside an installed package keep
    only what follows ``site-packages/``. Tables then fit what is left to their width with
    :func:`~torchmem.render.text.shorten_site` (the file's last parts, the line, the function;
    never split).

    Example:
        >>> short_site("/venv/lib/python3.11/site-packages/pkg/train.py:56:main")
        'pkg/train.py:56:main'
        >>> short_site("/home/me/proj/train.py:9:step", cwd="/home/me/proj")
        'train.py:9:step'
    """
    import os

    marker = "site-packages" + os.sep
    i = site.rfind(marker)
    if i >= 0:
        return site[i + len(marker):]
    base = (cwd if cwd is not None else os.getcwd()).rstrip(os.sep) + os.sep
    if site.startswith(base):
        return site[len(base):]
    return site

