"""``torchmem view FILE -o report.html``: write the self-contained offline HTML viewer.

The page holds its code, style and data inline and makes no network request, so it opens from
disk, from an e-mail attachment or on an air-gapped machine. ``FILE`` is a memory snapshot (any
PyTorch version, pickle or torchmem JSON) or a torchmem trace file.

Several rank traces of one distributed job (``torchmem view NAME.rank*.tmtrace``) give one page
with a rank selector; in time mode the timeline draws every rank's live bytes on the job's one
time axis, so the ranks compare at a glance. ``--ranks 0,3`` picks the ranks whose full timeline
the page holds (default: all of them up to 2M events in all, else the heaviest and the lightest
rank); every rank's curve is always there. Missing and cut-short ranks are named on stderr.

Example:
    >>> from torchmem.cli import main
    >>> main(["view", "missing.pickle", "-o", "out.html"])  # doctest: +SKIP
    2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``FILE``, ``-o/--output``, ``--title`` and ``--quiet``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["snap.pickle", "-o", "r.html"]).output
        'r.html'
        >>> p.parse_args(["a.rank0.tmtrace", "a.rank1.tmtrace", "--ranks", "1"]).file
        ['a.rank0.tmtrace', 'a.rank1.tmtrace']
    """
    parser.add_argument("file", metavar="FILE", nargs="+",
                        help="snapshot (.pickle/.json) or torchmem trace; several rank traces of "
                             "one job: the ranks on one page")
    parser.add_argument(
        "-o", "--output", default=None,
        help="HTML file to write (default: FILE with the suffix .html)",
    )
    parser.add_argument("--title", default=None, help="page title (default: the file name)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--ranks", default=None,
                        help="rank traces only: the ranks whose full timeline the page holds, "
                             "e.g. 0,3 (default: all up to 2M events in all, else the heaviest "
                             "and the lightest)")


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

    files = args.file if isinstance(args.file, list) else [args.file]
    t0 = time.perf_counter()
    show = not args.quiet

    def progress(msg: str) -> None:
        if show:
            print(f"torchmem view: {msg} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    if len(files) > 1 or any(c in files[0] for c in "*?[") or getattr(args, "ranks", None):
        return _ranks(args, files, progress)
    src = Path(files[0])
    out = Path(args.output) if args.output else src.with_suffix(".html")

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


#: Up to this many events in all, a page of rank traces holds every rank's full timeline.
DETAIL_EVENTS = 2_000_000


def _ranks(args: argparse.Namespace, paths: list[str], progress: Callable[[str], None]) -> int:
    """Several rank traces: check them as one job (the merge), then write the ranks' page."""
    import re  # noqa: PLC0415

    from torchmem.cli.merge import expand_paths, merge_files  # noqa: PLC0415
    from torchmem.errors import InvalidInputError  # noqa: PLC0415
    from torchmem.io.tmtrace import load_trace  # noqa: PLC0415
    from torchmem.render.viewer.html import write_rank_viewer  # noqa: PLC0415
    from torchmem.units import format_bytes  # noqa: PLC0415

    files = expand_paths(paths)
    merged = merge_files(files, progress=progress)  # one job? which ranks? (one trace at a time)
    if merged.missing:
        print(f"torchmem view: MISSING rank(s) {', '.join(map(str, merged.missing))} of world "
              f"size {merged.world_size}: the page shows the ranks present only", file=sys.stderr)
    for r in merged.ranks:
        if r.cut_short:
            print(f"torchmem view: rank {r.rank} ({r.name}) was cut short: {r.cut_short}",
                  file=sys.stderr)
    present = [r.rank for r in merged.ranks]
    if args.ranks:
        try:
            detail = sorted({int(x) for x in str(args.ranks).split(",") if x.strip()})
        except ValueError:
            raise InvalidInputError(
                f"--ranks expects rank numbers separated by commas (e.g. 0,3), got {args.ranks!r}"
            ) from None
        absent = [r for r in detail if r not in present]
        if absent or not detail:
            raise InvalidInputError(
                f"--ranks {args.ranks}: rank(s) {absent or detail} not among the traces given "
                f"(ranks {', '.join(map(str, present))}); pick from those"
            )
    elif sum(r.events for r in merged.ranks) <= DETAIL_EVENTS:
        detail = present
    else:
        detail = sorted({merged.heaviest, merged.lightest} - {None})  # type: ignore[arg-type]
        progress(f"full timelines for ranks {detail} only (pass --ranks to pick others)")
    first = Path(files[0])
    out = Path(args.output) if args.output else first.with_name(
        re.sub(r"\.rank\d+\.tmtrace$", "", first.name) + ".ranks.html")
    title = args.title or f"{merged.job_id or first.name}: {len(present)} rank(s)"
    write_rank_viewer((load_trace(p) for p in files), out, detail=detail, names=files,
                      title=title, progress=progress)
    print(f"wrote {out} ({format_bytes(out.stat().st_size)}, ranks {', '.join(map(str, present))}; "
          f"full timelines: {', '.join(map(str, detail))}); open it in any browser, no network "
          "needed")
    return 0
