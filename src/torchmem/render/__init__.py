"""Consumers that show results: text and rich tables, timeline plots and the HTML viewer.

Renderers take :mod:`torchmem.model` and :mod:`torchmem.analysis` objects; they never open input
files and never import torch nor any producer.

- :mod:`~torchmem.render.table`: a :class:`~torchmem.model.census.MemoryReport` as a rich
  table, plain text or JSON (:func:`render_report`).
- :mod:`~torchmem.render.summary`: a trace summary (:func:`render_summary`, :func:`summary_json`).
- :mod:`~torchmem.render.ranks`: the merged view of a job's ranks (:func:`render_merge`,
  :func:`merge_json`).
- :mod:`~torchmem.render.snapshot_text`: the snapshot analyses as text (:func:`render_stats`,
  :func:`render_peak`, :func:`render_diff`, :func:`render_trace`, :func:`render_oom`).
- :mod:`~torchmem.render.plot`: a trace's memory timeline as a PNG (:func:`plot_timeline`,
  needs matplotlib).
- :mod:`~torchmem.render.viewer`: the self-contained offline HTML viewer (:func:`write_viewer`).
- :mod:`~torchmem.render.text`: the one table helper the text renderers share (rich or plain).

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
from torchmem.render.ranks import merge_json, render_merge
from torchmem.render.snapshot_text import (
    render_diff,
    render_oom,
    render_peak,
    render_stats,
    render_trace,
)
from torchmem.render.summary import render_summary, summary_json
from torchmem.render.table import render_report
from torchmem.render.viewer import write_viewer

__all__ = [
    "render_report",
    "render_summary",
    "summary_json",
    "render_merge",
    "merge_json",
    "render_stats",
    "render_peak",
    "render_diff",
    "render_trace",
    "render_oom",
    "plot_timeline",
    "write_viewer",
]
