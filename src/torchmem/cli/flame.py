"""``torchmem flame FILE``: folded stacks (``root;...;leaf bytes``) for flame-graph tools.

The output opens in speedscope (drop the file on it), ``flamegraph.pl`` and ``inferno``; nothing
is downloaded.

Example:
    >>> from torchmem.cli import main
    >>> main(["flame", "tests/data/DeComFL__memory.pickle", "-o", "mem.folded"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys

from torchmem.cli._snapshot_common import add_file_argument, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem flame``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["s.pickle", "--at", "peak"]).at
        'peak'
    """
    add_file_argument(parser)
    parser.add_argument("--at", choices=("end", "peak"), default="end",
                        help="blocks live at the snapshot's end (default) or at the peak")
    parser.add_argument("--device", type=int, default=None, help="only this device index")
    parser.add_argument("--state", action="store_true", help="add the block state as a frame")
    parser.add_argument("--all-frames", action="store_true", help="keep PyTorch-internal frames")
    parser.add_argument("-o", "--output", default=None, help="write to this file (default stdout)")


def run(args: argparse.Namespace) -> int:
    """Write the folded stacks (``--json``: a list of ``{stack, bytes}``).

    Example:
        >>> run(argparse.Namespace(file="missing.pickle", json=False, at="end", device=None,
        ...                        state=False, all_frames=False, output=None))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: missing.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._flame import folded_stacks
    from torchmem.errors import InvalidInputError

    snap = load(args.file)
    lines = folded_stacks(snap, at=args.at, device=args.device,
                          filter_internal=not args.all_frames, include_state=args.state)
    if args.json:
        rows = []
        for ln in lines:
            stack, _, n = ln.rpartition(" ")
            rows.append({"stack": stack.split(";"), "bytes": int(n)})
        emit_json({"file": args.file, "at": args.at, "stacks": rows})
        return 0
    text = "".join(ln + "\n" for ln in lines)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise InvalidInputError(
                f"could not write the folded stacks to {args.output!r}: {e.strerror or e}; fix: "
                "pass -o with a writable path (or omit it to print to stdout)"
            ) from None
        print(f"wrote {len(lines)} folded stacks to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
