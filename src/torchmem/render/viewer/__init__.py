"""The offline HTML viewer: one self-contained page for a snapshot or a trace.

:mod:`~torchmem.render.viewer.payload` builds the data (from the replay engine and the
analyses), :mod:`~torchmem.render.viewer.html` assembles the page from ``assets/``;
:func:`write_rank_viewer` writes one page for the rank traces of a distributed job
(:mod:`~torchmem.render.viewer._ranks`). They take model objects and never open input files.

Example:
    >>> import os, tempfile
    >>> from torchmem.model.snapshot import Snapshot
    >>> from torchmem.render.viewer import write_viewer
    >>> out = os.path.join(tempfile.mkdtemp(), "v.html")
    >>> _ = write_viewer(Snapshot(), out)
    >>> os.path.getsize(out) > 1000
    True
"""

from __future__ import annotations

from torchmem.render.viewer.html import render_html, write_rank_viewer, write_viewer
from torchmem.render.viewer.payload import build_payload, encode_payload

__all__ = ["build_payload", "encode_payload", "render_html", "write_viewer", "write_rank_viewer"]
