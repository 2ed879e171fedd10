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

from torchmem.model._html import estimate_html, fmt_bytes

__all__ = ["estimate_html", "trace_html", "timeline_svg", "viewer_html"]


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
