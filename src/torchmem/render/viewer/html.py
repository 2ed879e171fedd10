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
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.model.snapshot import Snapshot
from torchmem.model.trace import Trace
from torchmem.render.viewer.payload import ProgressFn, build_payload, encode_payload

__all__ = ["render_html", "write_viewer", "write_rank_viewer"]


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
    return _page(build_payload(source, title=title, progress=progress), progress)


def _page(payload: dict[str, Any], progress: ProgressFn | None) -> str:
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


def _write(text: str, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(
            f"could not write the viewer to {str(out)!r}: {e.strerror}; "
            "fix: pass -o with a writable path"
        ) from e
    return out


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
    return _write(render_html(source, title=title, progress=progress), path)


def write_rank_viewer(
    traces: Iterable[Trace], path: str | os.PathLike[str], *,
    detail: Collection[int] | None = None, names: list[str] | None = None,
    title: str | None = None, progress: ProgressFn | None = None,
) -> Path:
    """Write the viewer page of a distributed job's rank traces (one at a time from
    ``traces``): a rank selector, and in time mode every rank's live bytes on one time axis
    (see :func:`~torchmem.render.viewer._ranks.build_rank_payload`; ``detail``: the ranks whose
    full timeline the page holds, default all).

    Example:
        >>> import tempfile
        >>> from torchmem.model.events import EventKind as K
        >>> traces = []
        >>> for r in (0, 1):
        ...     tr = Trace({"rank": r, "world_size": 2}); traces.append(tr)
        ...     _ = tr.append(K.ALLOC, 0, "cpu", 64 * (r + 1), 1)
        >>> out = Path(tempfile.mkdtemp()) / "ranks.html"
        >>> write_rank_viewer(traces, out).stat().st_size > 1000
        True
    """
    from torchmem.render.viewer._ranks import build_rank_payload

    payload = build_rank_payload(traces, detail=detail, names=names, title=title,
                                 progress=progress)
    return _write(_page(payload, progress), path)
