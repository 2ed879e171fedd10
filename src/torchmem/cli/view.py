"""``torchmem view FILE -o report.html``: write the self-contained offline HTML viewer.

The page holds its code, style and data inline and makes no network request, so it opens from
disk, from an e-mail attachment or on an air-gapped machine. ``FILE`` is a memory snapshot (any
PyTorch version, pickle or torchmem JSON) or a torchmem trace file.

Example:
    >>> from torchmem.cli import main
    >>> main(["view", "missing.pickle", "-o", "out.html"])  # doctest: +SKIP
    2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``FILE``, ``-o/--output``, ``--title`` and ``--quiet``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["snap.pickle", "-o", "r.html"]).output
        'r.html'
    """
    parser.add_argument("file", metavar="FILE", help="snapshot (.pickle/.json) or torchmem trace")
    parser.add_argument(
        "-o", "--output", default=None,
        help="HTML file to write (default: FILE with the suffix .html)",
    )
    parser.add_argument("--title", default=None, help="page title (default: the file name)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    """Write the viewer and print the output path (progress goes to stderr).

    Example:
        >>> import tempfile, pickle, os
        >>> d = tempfile.mkdtemp(); src = os.path.join(d, "s.pickle")
        >>> with open(src, "wb") as f:
        ...     pickle.dump({"segments": [], "device_traces": []}, f, protocol=4)
        >>> ns = argparse.Namespace(file=src, output=os.path.join(d, "r.html"), title=None,
        ...                         quiet=True)
        >>> run(ns)  # doctest: +ELLIPSIS
        wrote .../r.html ...
        0
    """
    from torchmem.io import load_snapshot  # noqa: PLC0415
    from torchmem.render.viewer.html import write_viewer  # noqa: PLC0415
    from torchmem.units import format_bytes  # noqa: PLC0415

    src = Path(args.file)
    out = Path(args.output) if args.output else src.with_suffix(".html")
    t0 = time.perf_counter()
    show = not args.quiet

    def progress(msg: str) -> None:
        if show:
            print(f"torchmem view: {msg} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    progress(f"reading {src}")
    from torchmem.io.tmtrace import is_cut_short  # noqa: PLC0415

    if is_cut_short(src):
        print(f"torchmem view: {src} was cut short: the run ended abruptly (killed) and this is "
              "the trace it streamed to disk, without about its last second", file=sys.stderr)
    snap = load_snapshot(src)
    write_viewer(snap, out, title=args.title or src.name, progress=progress)
    size = out.stat().st_size
    ratio = f", {size / src.stat().st_size:.2f}x the input" if src.stat().st_size else ""
    print(f"wrote {out} ({format_bytes(size)}{ratio}); open it in any browser, no network needed")
    return 0
