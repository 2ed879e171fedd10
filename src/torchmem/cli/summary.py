"""``torchmem summary TRACE [--json]``: summarise a saved trace (no torch needed).

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
    """
    parser.add_argument("trace", help="a .tmtrace file written by 'torchmem run' or tracker.save()")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--top", type=int, default=10, help="rows per table (default 10)")
    parser.add_argument("--device", default=None, help="device to summarise (default: highest peak)")


def run(args: argparse.Namespace) -> int:
    """Load the trace, summarise and print it.

    Example:
        >>> import argparse
        >>> run(argparse.Namespace(trace="/no/such.tmtrace", json=False, top=5, device=None))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: /no/such.tmtrace: no such file; ...
    """
    from torchmem.analysis.summary import summarize_trace
    from torchmem.errors import InvalidInputError
    from torchmem.io.tmtrace import load_trace
    from torchmem.render.summary import render_summary, summary_json

    trace = load_trace(args.trace)
    if trace.metadata.get("cut_short"):
        print(f"torchmem summary: {args.trace}: {trace.metadata['cut_short']}", file=sys.stderr)
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
