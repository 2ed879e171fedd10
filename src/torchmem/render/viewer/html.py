"""The viewer's page: one self-contained HTML file, no network request, scales to 1M events.

:func:`render_html` inlines the page's own CSS and JavaScript (``assets/``) and the encoded
payload (:mod:`torchmem.render.viewer.payload`) into ``assets/viewer.html``; :func:`write_viewer`
writes it. The JavaScript decodes the payload with the browser's built-in
``DecompressionStream`` and draws on canvas with level of detail: each pixel column of the
timeline shows the stack of live allocations at the busiest instant of that column, so a million
events draw as fast as a thousand.

Both take a :class:`~torchmem.model.snapshot.Snapshot` or a :class:`~torchmem.model.trace.Trace`;
they never open input files (``torchmem view`` loads them with :func:`torchmem.io.load_snapshot`).

Example:
    >>> from torchmem.model.snapshot import Snapshot
    >>> html = render_html(Snapshot(), title="demo")
    >>> html.startswith("<!DOCTYPE html>") and "http://" not in html and "https://" not in html
    True
"""

from __future__ import annotations

import html as _html
import importlib.resources
import os
from pathlib import Path

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Snapshot
from torchmem.model.trace import Trace
from torchmem.render.viewer.payload import ProgressFn, build_payload, encode_payload

__all__ = ["render_html", "write_viewer"]


#: The page's script, in order: one IIFE split by concern (decoding and shared state, the
#: timeline, the allocator state history with the segments and stats tabs, the wiring). The
#: parts are concatenated as they are, so the page carries one script.
_SCRIPTS = ("viewer-core.js", "viewer-timeline.js", "viewer-state.js", "viewer-wiring.js")


def _asset(name: str) -> str:
    return (importlib.resources.files("torchmem.render.viewer") / "assets" / name).read_text("utf-8")


def _compact(code: str) -> str:
    r"""The page's script or style without indentation, blank lines and whole-line ``//``
    comments (the assets are written readable; the page need not carry that).

    Example:
        >>> _compact("  // a note\n  if (a) {\n\n    b();  // kept\n  }\n")
        'if (a) {\nb();  // kept\n}'
    """
    lines = (line.strip() for line in code.splitlines())
    return "\n".join(x for x in lines if x and not x.startswith("//"))


def render_html(
    source: Snapshot | Trace, *, title: str | None = None, progress: ProgressFn | None = None
) -> str:
    """The viewer page for ``source`` as one HTML string (all code, style and data inline).

    Example:
        >>> from torchmem.model.snapshot import Snapshot
        >>> page = render_html(Snapshot(), title="empty")
        >>> "<title>empty" in page and "<script src" not in page
        True
    """
    payload = build_payload(source, title=title, progress=progress)
    if progress:
        progress("encoding payload")
    data = encode_payload(payload)
    page = _asset("viewer.html")
    t = _html.escape(payload["title"])
    # Only the template's own placeholders are replaced; the data is base64 (no '<' possible).
    return (
        page.replace("/*__CSS__*/", _compact(_asset("viewer.css")))
        .replace("/*__JS__*/", _compact("\n".join(_asset(name) for name in _SCRIPTS)))
        .replace("__PAYLOAD__", data)
        .replace("__TITLE__", t)
    )


def write_viewer(
    source: Snapshot | Trace, path: str | os.PathLike[str], *, title: str | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """Write the self-contained viewer page for ``source`` to ``path`` and return the path.

    Example:
        >>> import tempfile
        >>> from torchmem.model.snapshot import Snapshot
        >>> out = Path(tempfile.mkdtemp()) / "report.html"
        >>> write_viewer(Snapshot(), out).stat().st_size > 1000
        True
    """
    text = render_html(source, title=title, progress=progress)
    out = Path(path)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(
            f"could not write the viewer to {str(out)!r}: {e.strerror}; "
            "fix: pass -o with a writable path"
        ) from e
    return out
