"""Consumers that show results: text and rich tables, timeline plots and the HTML viewer.

Renderers take :mod:`torchmem.model` and :mod:`torchmem.analysis` objects; they never open input
files and never import torch.

Example:
    >>> import io
    >>> from torchmem.model.census import MemoryReport
    >>> from torchmem.render import render_report
    >>> buf = io.StringIO(); render_report(MemoryReport(), buf, fmt="json")
    >>> buf.getvalue().startswith("{")
    True
"""

from __future__ import annotations

from torchmem.render.plot import plot_timeline
from torchmem.render.summary import render_summary, summary_json
from torchmem.render.table import render_report
from torchmem.render.viewer import write_viewer

__all__ = ["plot_timeline", "render_report", "render_summary", "summary_json", "write_viewer"]
