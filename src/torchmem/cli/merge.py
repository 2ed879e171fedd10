"""``torchmem merge NAME.rank*.tmtrace [-o merged.json]``: one view of a distributed job's ranks.

Each rank's trace (written by ``torchmem run --nproc-per-node`` or by ``torchmem.track`` with
``rank``/``world_size``/``job_id`` metadata) is loaded, reduced and dropped in turn, so many
large traces merge in little memory. The merged view (per-rank peak, live at the end, retained
growth per iteration, imbalance, bytes per category and module at each rank's peak, collective
operations, why the heaviest rank differs from the lightest) is printed, and written as JSON with
``-o``. A rank of the world with no trace is reported as MISSING and a rank whose run was killed
as CUT SHORT (stderr too): such a merge is never shown as complete.

:func:`merge_files` is the same merge for code (``torchmem run`` calls it when a job ends).

Example:
    >>> from torchmem.cli import main
    >>> main(["merge", "/no/such.rank0.tmtrace"])
    2
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from torchmem.analysis import RankMerge, RankStats
    from torchmem.model.trace import Trace

__all__ = ["add_arguments", "run", "merge_files", "expand_paths", "show"]

PathLike = Union[str, "os.PathLike[str]"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``torchmem merge``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["a.rank0.tmtrace", "a.rank1.tmtrace", "-o", "m.json"]).output
        'm.json'
    """
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="the rank traces of one job (NAME.rank*.tmtrace; a quoted pattern "
                             "is expanded too)")
    parser.add_argument("-o", "--output", default=None,
                        help="write the merged view as JSON to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--top", type=int, default=10, help="rows per table (default 10)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("-j", "--jobs", type=int, default=1,
                        help="processes reading the traces side by side (default 1; each holds "
                             "one trace at a time)")


def _natural(path: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def expand_paths(paths: Sequence[PathLike]) -> list[str]:
    """The files named by ``paths``: a path that does not exist but holds ``*``, ``?`` or ``[``
    is expanded as a pattern (a shell that did not expand it: quoted, or Windows); the result
    is in natural order (``rank2`` before ``rank10``), each file once.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> for r in (10, 2): open(os.path.join(d, f"j.rank{r}.tmtrace"), "w").close()
        >>> [os.path.basename(p) for p in expand_paths([os.path.join(d, "j.rank*.tmtrace")])]
        ['j.rank2.tmtrace', 'j.rank10.tmtrace']
    """
    out: list[str] = []
    for p in [os.fspath(x) for x in paths]:
        if not os.path.exists(p) and any(c in p for c in "*?["):
            out.extend(glob.glob(p))
        else:
            out.append(p)
    return sorted(dict.fromkeys(out), key=_natural)


def merge_files(
    paths: Sequence[PathLike],
    out: PathLike | None = None,
    *,
    top: int = 10,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> RankMerge:
    """Merge the rank trace files ``paths`` (see :func:`expand_paths`) one at a time and, with
    ``out``, write the merged view there as JSON. ``progress`` receives a line per file;
    ``jobs`` > 1 reads and reduces the files in that many worker processes (one trace in memory
    per process).

    Raises :class:`~torchmem.errors.MissingFileError` / :class:`~torchmem.errors.TraceFormatError`
    for a file that is not there or not a trace, and
    :class:`~torchmem.errors.InvalidInputError` for files of different jobs, a rank given twice
    or a trace without rank metadata. Missing and cut-short ranks are in the result
    (``missing``, ``cut_short``; ``complete`` is False).

    Example:
        >>> import tempfile, os, json
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> from torchmem.io.tmtrace import save_trace
        >>> d = tempfile.mkdtemp()
        >>> for r in (0, 1):
        ...     tr = Trace({"rank": r, "world_size": 3, "job_id": "j"})
        ...     _ = tr.append(K.ALLOC, 0, "cpu", 1024 * (r + 1), 1)
        ...     save_trace(tr, os.path.join(d, f"j.rank{r}.tmtrace"))
        >>> m = merge_files([os.path.join(d, "j.rank*.tmtrace")], os.path.join(d, "m.json"))
        >>> [r.peak for r in m.ranks], m.missing, json.load(open(os.path.join(d, "m.json")))["complete"]
        ([1024, 2048], [2], False)
    """
    from torchmem.analysis import merge_ranks
    from torchmem.errors import InvalidInputError
    from torchmem.io.tmtrace import load_trace
    from torchmem.render.ranks import merge_json

    files = expand_paths(paths)
    if not files:
        raise InvalidInputError(
            f"no rank trace matches {', '.join(os.fspath(x) for x in paths) or 'nothing'}; expected "
            "files such as NAME.rank0.tmtrace written by 'torchmem run --nproc-per-node'"
        )
    if not isinstance(jobs, int) or jobs < 1:
        raise InvalidInputError(f"jobs must be an int >= 1, got {jobs!r}")
    t0 = time.perf_counter()

    def say(i: int, path: str, verb: str) -> None:
        if progress is not None:
            progress(f"{verb} {path} ({i + 1}/{len(files)}, {time.perf_counter() - t0:.1f} s)")

    def traces() -> Iterator[Trace]:
        for i, path in enumerate(files):
            say(i, path, "reading")
            yield load_trace(path)

    if jobs > 1 and len(files) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(jobs, len(files))) as pool:
            def reduced() -> Iterator[RankStats]:
                for i, (path, s) in enumerate(zip(files, pool.map(_reduce, files))):
                    say(i, path, "read")
                    yield s

            merged = merge_ranks(reduced(), names=files, top=top)
    else:
        merged = merge_ranks(traces(), names=files, top=top)
    if out is not None:
        tmp = f"{os.fspath(out)}.part"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(merge_json(merged))
            f.write("\n")
        os.replace(tmp, out)
    return merged


def _reduce(path: str) -> RankStats:
    """One file's figures, in a worker process."""
    from torchmem.analysis import rank_stats
    from torchmem.io.tmtrace import load_trace

    return rank_stats(load_trace(path), name=path)


def run(args: argparse.Namespace) -> int:
    """Merge, print the merged view (or JSON) and write ``-o``; missing or cut-short ranks are
    also named on stderr.

    Example:
        >>> ns = argparse.Namespace(traces=["/no/such.rank0.tmtrace"], output=None, json=False,
        ...                         top=10, quiet=True, jobs=1)
        >>> run(ns)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: /no/such.rank0.tmtrace: no such file; ...
    """
    from torchmem.errors import InvalidInputError

    if args.top < 1:
        raise InvalidInputError(f"--top must be at least 1, got {args.top}")

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"torchmem merge: {msg}", file=sys.stderr)

    merged = merge_files(args.traces, args.output, top=args.top, progress=progress,
                         jobs=args.jobs)
    show(merged, as_json=args.json, prog="torchmem merge")
    if args.output:
        progress(f"wrote {args.output}")
    return 0


def show(merged: RankMerge, *, as_json: bool = False, prog: str = "torchmem merge") -> None:
    """Print the merged view (or its JSON) to stdout, and name missing and cut-short ranks on
    stderr, so that an incomplete merge is never read as complete.

    Example:
        >>> import contextlib, io
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.analysis import merge_ranks
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        ...     show(merge_ranks([Trace({"rank": 0, "world_size": 2})]))
        >>> err.getvalue().strip()
        'torchmem merge: MISSING rank(s) 1 of world size 2: the merge is incomplete'
    """
    from torchmem.render.ranks import merge_json, render_merge

    if merged.missing:
        print(f"{prog}: MISSING rank(s) {', '.join(map(str, merged.missing))} of world size "
              f"{merged.world_size}: the merge is incomplete", file=sys.stderr)
    for r in merged.ranks:
        if r.cut_short:
            print(f"{prog}: rank {r.rank} ({r.name}) was cut short: {r.cut_short}",
                  file=sys.stderr)
    if as_json:
        print(merge_json(merged))
    else:
        render_merge(merged)
