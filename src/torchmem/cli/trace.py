"""``torchmem trace FILE``: a snapshot's event log with correct running totals.

Example:
    >>> from torchmem.cli import main
    >>> main(["trace", "tests/data/DeComFL__memory.pickle", "--tail", "5"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import deque

from torchmem.cli._snapshot_common import add_file_argument, load, non_negative_int

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem trace``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["s.pickle", "--head", "10"]).head
        10
    """
    add_file_argument(parser)
    parser.add_argument("--device", type=int, default=None, help="only this device index")
    parser.add_argument("--head", type=non_negative_int, default=None, help="only the first N entries")
    parser.add_argument("--tail", type=non_negative_int, default=None, help="only the last N entries")
    parser.add_argument("--depth", type=non_negative_int, default=1, help="frames shown per entry (default 1)")
    parser.add_argument("--all-frames", action="store_true", help="keep PyTorch-internal frames")


def run(args: argparse.Namespace) -> int:
    """Print the log; ``--json`` prints JSON lines (one object per entry), then a summary object.

    Example:
        >>> run(argparse.Namespace(file="missing.pickle", json=False, device=None, head=None,
        ...                        tail=None, depth=1, all_frames=False))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: missing.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._events import snapshot_trace
    from torchmem.render.snapshot_text import render_trace

    snap = load(args.file)
    rows = snapshot_trace(
        snap, device=args.device, depth=args.depth, filter_internal=not args.all_frames
    )
    last: dict[int, tuple[int, int, int]] = {}

    def seen(it):  # type: ignore[no-untyped-def]
        for r in it:
            last[r.device] = (r.index + 1, r.allocated_bytes, r.reserved_bytes)
            yield r

    it = seen(rows)
    if args.tail:
        it = iter(deque(it, maxlen=args.tail))
    if args.head:
        it = itertools.islice(it, args.head)
    write = sys.stdout.write
    if args.json:
        for r in it:
            write(json.dumps(r.to_dict()) + "\n")
        for _ in seen(()):
            pass
        write(json.dumps({"summary": {str(d): {"entries_shown_up_to": v[0], "allocated_bytes": v[1],
                                               "reserved_bytes": v[2]} for d, v in last.items()}})
              + "\n")
    else:
        for line in render_trace(it):
            write(line + "\n")
        from torchmem.units import format_bytes

        for d, (n, a, res) in sorted(last.items()):
            write(f"device {d}: after entry {n}: allocated {format_bytes(a)}, reserved "
                  f"{format_bytes(res)}\n")
    return 0
