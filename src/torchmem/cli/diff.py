"""``torchmem diff A B``: what grew and shrank between two snapshots, grouped by stack.

Example:
    >>> from torchmem.cli import main
    >>> main(["diff", "before.pickle", "after.pickle"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys

from torchmem.cli._snapshot_common import add_stack_arguments, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem diff``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["a.pickle", "b.pickle"]).after
        'b.pickle'
    """
    parser.add_argument("before", help="the earlier snapshot")
    parser.add_argument("after", help="the later snapshot")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_stack_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Print the differences (text or ``--json``).

    Example:
        >>> run(argparse.Namespace(before="nope.pickle", after="x", json=False, depth=5, top=20,
        ...                        all_frames=False))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: nope.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._diff import snapshot_diff
    from torchmem.render.snapshot_text import render_diff

    a = load(args.before)
    b = load(args.after)
    d = snapshot_diff(a, b, depth=args.depth, filter_internal=not args.all_frames)
    if args.json:
        out = d.to_dict()
        if args.top:
            out["rows"] = out["rows"][: args.top]
        out["before"], out["after"] = args.before, args.after
        emit_json(out)
    else:
        sys.stdout.write(render_diff(d, top=args.top or None))
    return 0
