"""``torchmem plot TRACE -o timeline.png``: draw a trace's memory timeline (no torch needed).

Example:
    >>> from torchmem.cli import main
    >>> main(["plot", "/no/such.tmtrace"])
    2
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``torchmem plot``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p); p.parse_args(["t"]).output
        'timeline.png'
    """
    parser.add_argument("trace", help="a .tmtrace file written by 'torchmem run' or tracker.save()")
    parser.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    parser.add_argument("--device", default=None, help="device to plot (default: highest peak)")
    parser.add_argument("--title", default=None, help="plot title")
    parser.add_argument(
        "--x", choices=("event", "time"), default="event",
        help="x axis: event number (default) or wall time in ms",
    )


def run(args: argparse.Namespace) -> int:
    """Load the trace and write the PNG.

    Example:
        >>> import argparse
        >>> run(argparse.Namespace(trace="/no/such.tmtrace", output="x.png", device=None, title=None, x="event"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: /no/such.tmtrace: no such file; ...
    """
    from torchmem.errors import InvalidInputError
    from torchmem.io.tmtrace import load_trace
    from torchmem.render.plot import plot_timeline

    trace = load_trace(args.trace)
    if args.device is not None and args.device not in trace.devices:
        raise InvalidInputError(
            f"device {args.device!r} is not in this trace; it has: {', '.join(trace.devices) or 'none'}"
        )
    path = plot_timeline(trace, args.output, device=args.device, title=args.title, x=args.x)
    print(f"timeline plot written to {os.path.abspath(path)}", file=sys.stderr)
    return 0
