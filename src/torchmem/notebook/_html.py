"""HTML for notebooks: an estimate's report, a tracked cell's tables and timeline, the viewer.

Everything is one self-contained HTML string (no network: styles, scripts and data inline).

Example:
    >>> from torchmem.fit import Estimate
    >>> "FITS" in estimate_html(Estimate("T4", 8, True, 100 << 20, 10 << 20, 1, 2, 3))
    True
"""

from __future__ import annotations

import html
from typing import Any, Optional

from torchmem.model._html import fmt_bytes, html_block, html_table

__all__ = ["estimate_html", "trace_html", "timeline_svg", "viewer_html"]


def estimate_html(est: Any) -> str:
    """An :class:`~torchmem.fit.Estimate` as HTML: the verdict, the memory lines, what is live at
    the peak (by category and module) and where it would run out of memory.

    Example:
        >>> from torchmem.fit import Estimate
        >>> e = Estimate("T4", 8, False, 100 << 20, 10 << 20, 1, 2, 200 << 20)
        >>> page = estimate_html(e)
        >>> "DOES NOT FIT" in page and "-110.00 MiB" in page
        True
    """
    verdict = "FITS" if est.fits else "DOES NOT FIT"
    colour = "#1a7f37" if est.fits else "#cf222e"
    batch = f", batch {est.batch_size}" if est.batch_size is not None else ""
    head = (
        f'<div style="font-weight:bold;color:{colour}">{html.escape(str(est.gpu))}{batch}: '
        f"{verdict} (headroom {fmt_bytes(est.headroom_bytes)} of "
        f"{fmt_bytes(est.usable_bytes)} usable)</div>"
    )
    parts = [head]
    if est.searched:
        probes = ", ".join(f"{b}{'+' if f else '-'}" for b, f in est.probes)
        parts.append(f"<div>largest batch that fits: {est.max_batch_size} (probes: "
                     f"{html.escape(probes)})</div>")
    parts.append(html_table("memory", ["line", "bytes", "what it is"], [
        ["GPU total", fmt_bytes(est.capacity_bytes), "cudaMemGetInfo total of the card"],
        ["CUDA context", fmt_bytes(est.overhead_bytes), "outside PyTorch's allocator"],
        ["usable", fmt_bytes(est.usable_bytes), "the simulated allocator's capacity"],
        ["peak requested", fmt_bytes(est.peak_requested_bytes), "sum of live tensor storages"],
        ["peak allocated", fmt_bytes(est.peak_allocated_bytes), "allocator blocks"],
        ["peak reserved", fmt_bytes(est.peak_reserved_bytes), "cudaMalloc'd segments"],
        ["fragmentation", fmt_bytes(est.fragmentation_bytes), "reserved, unallocated"],
        ["cuBLAS workspaces", fmt_bytes(est.workspace_bytes), "inside allocated"],
    ]))
    parts.append(html_table("live at the peak, by category", ["category", "bytes"],
                            [[k, fmt_bytes(v)] for k, v in est.by_category.items() if v]))
    if est.by_module:
        parts.append(html_table("live at the peak, by module", ["module", "bytes"],
                                [[k, fmt_bytes(v)] for k, v in est.by_module.items()]))
    if est.oom is not None:
        o = est.oom
        stack = "".join(f"<div><code>{html.escape(s)}</code></div>" for s in o.stack[-6:])
        parts.append(
            f"<div><b>out of memory at</b> {html.escape(o.op or '?')} in module "
            f"{html.escape(o.module or '(none)')} ({html.escape(o.phase)}), requesting "
            f"{fmt_bytes(o.requested_bytes)} with {fmt_bytes(o.allocated_bytes)} allocated, "
            f"{fmt_bytes(o.reserved_bytes)} reserved</div>{stack}"
        )
    parts.extend(f"<div>note: {html.escape(n)}</div>" for n in est.notes)
    return html_block("torchmem estimate", *parts)


def timeline_svg(trace: Any, device: Optional[str] = None, width: int = 640,
                 height: int = 160) -> str:
    """Live tensor bytes over time on one device (the trace's main device by default) as an
    inline SVG line, with the peak marked. Empty string for a trace with no allocation.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace(); _ = tr.append(K.ALLOC, 0, "cpu", 1024, 1)
        >>> _ = tr.append(K.FREE, 10, "cpu", 1024, 1)
        >>> svg = timeline_svg(tr); svg.startswith("<svg") and "peak 1.00 KiB" in svg
        True
    """
    from torchmem.analysis.series import category_series

    seqs, _, series, _ = category_series(trace, device=device, max_points=2000)
    if not seqs:
        return ""
    totals = [sum(col) for col in zip(*series.values())] if series else [0] * len(seqs)
    top = max(totals) or 1
    n = len(totals)
    pad = 18
    xs = [pad + (width - 2 * pad) * (i / max(n - 1, 1)) for i in range(n)]
    ys = [height - pad - (height - 2 * pad) * (v / top) for v in totals]
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    k = totals.index(max(totals))
    label = f"peak {fmt_bytes(max(totals))}"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="torchmem-timeline" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="live tensor memory over time, {label}">'
        f'<polyline fill="none" stroke="#0969da" stroke-width="1.5" points="{pts}"/>'
        f'<circle cx="{xs[k]:.1f}" cy="{ys[k]:.1f}" r="3" fill="#cf222e"/>'
        f'<text x="{pad}" y="12" font-size="11" fill="currentColor">{label} '
        f"(live tensor memory, events 1..{n} sampled)</text></svg>"
    )


def trace_html(trace: Any, top: int = 8) -> str:
    """A tracked run's summary tables (:meth:`TraceSummary._repr_html_`) and its timeline.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> tr = Trace(); _ = tr.append(K.ALLOC, 0, "cpu", 4096, 1, op="aten::ones")
        >>> page = trace_html(tr); "<svg" in page and "aten::ones" in page
        True
    """
    from torchmem.analysis.summary import summarize_trace

    summary = summarize_trace(trace, top=top)
    svg = timeline_svg(trace, device=summary.device)
    return summary._repr_html_() + (f'<div class="torchmem-html">{svg}</div>' if svg else "")


def viewer_html(source: Any, height: int = 640, title: Optional[str] = None) -> str:
    """torchmem's interactive viewer for a Snapshot or Trace, embedded as an ``<iframe>``
    (``srcdoc``: the whole page inline, no network access, its scripts isolated from the
    notebook's).

    Example:
        >>> from torchmem.model.snapshot import Snapshot
        >>> page = viewer_html(Snapshot(), title="empty")
        >>> page.startswith("<iframe") and "src=" not in page.replace("srcdoc=", "")
        True
    """
    from torchmem.render.viewer.html import render_html

    page = render_html(source, title=title)
    return (
        f'<iframe class="torchmem-viewer" title="torchmem viewer" '
        f'style="width:100%;height:{int(height)}px;border:1px solid #8884" '
        f'srcdoc="{html.escape(page, quote=True)}"></iframe>'
    )
