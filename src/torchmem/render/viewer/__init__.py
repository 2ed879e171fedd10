"""The offline HTML viewer: one self-contained page for a snapshot or a trace.

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

from torchmem.render.viewer.payload import build_payload, render_html, write_viewer

__all__ = ["build_payload", "render_html", "write_viewer"]
