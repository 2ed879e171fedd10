"""``torchmem summary TRACE [--json]``: summarise a saved trace (no torch needed).

Several rank traces of one distributed job (``torchmem summary NAME.rank*.tmtrace``) give the
merged view of ``torchmem merge`` (per-rank peaks, imbalance, why the heaviest rank differs).

The peak is named by its trace entry ``#N`` (``peak_index`` in ``--json``), numbered as
``torchmem trace TRACE`` prints the device's entries, like ``torchmem peak`` and the viewer;
``peak_seq`` in ``--json`` is the row of the tracker's event table (``Event.seq``).

Example:
    >>> from torchmem.cli import main
    >>> main(["summary", "/no/such.tmtrace"])
    2
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``torchmem summary``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p); p.parse_args(["t", "--json"]).json
        True
        >>> p.parse_args(["a.rank0.tmtrace", "a.rank1.tmtrace"]).traces
        ['a.rank0.tmtrace', 'a.rank1.tmtrace']
    """
    parser.add_argument("traces", nargs="+", metavar="trace",
                        help="a .tmtrace file written by 'torchmem run' or tracker.save(); several "
                             "rank traces of one job give their merged view")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--top", type=int, default=10, help="rows per table (default 10)")
    parser.add_argument("--device", default=None, help="device to summarise (default: highest peak)")


def run(args: argparse.Namespace) -> int:
    """Load the trace, summarise and print it.

    Example:
        >>> import argparse
        >>> run(argparse.Namespace(traces=["/no/such.tmtrace"], json=False, top=5, device=None))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: /no/such.tmtrace: no such file; ...
    """
    from torchmem.analysis.summary import summarize_trace
    from torchmem.errors import InvalidInputError
    from torchmem.io.tmtrace import load_trace
    from torchmem.render.summary import render_summary, summary_json

    if len(args.traces) > 1 or any(c in args.traces[0] for c in "*?["):
        return _merged(args)
    path = args.traces[0]
    trace = load_trace(path)
    if trace.metadata.get("cut_short"):
        print(f"torchmem summary: {path}: {trace.metadata['cut_short']}", file=sys.stderr)
    if args.device is not None and args.device not in trace.devices:
        raise InvalidInputError(
            f"device {args.device!r} is not in this trace; it has: {', '.join(trace.devices) or 'none'}"
        )
    summary = summarize_trace(trace, top=args.top, device=args.device)
    if args.json:
        print(summary_json(summary))
    else:
        render_summary(summary)
    return 0


def _merged(args: argparse.Namespace) -> int:
    """Several rank traces: the merged view (``torchmem merge`` without ``-o``)."""
    from torchmem.cli.merge import merge_files, show
    from torchmem.errors import InvalidInputError

    if args.device is not None:
        raise InvalidInputError(
            "--device picks the device of one trace; with several rank traces each rank is "
            "summarised on its own device (the one with the highest peak). Leave --device out, "
            "or summarise one rank's trace"
        )
    show(merge_files(args.traces, top=args.top), as_json=args.json, prog="torchmem summary")
    return 0
