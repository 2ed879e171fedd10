"""``torchmem peak FILE``: the peak of allocated memory and what was live then, by stack.

The peak is named by its trace entry: "at trace entry #N" (``peak_index`` N in ``--json``) is
the 0-based index of the entry in its device's trace as ``torchmem trace FILE`` prints it, the
numbering the tracker summary and the viewer's ``#N`` use too; -1 (text: "before the first
trace entry") when the state before the trace is the peak.

Example:
    >>> from torchmem.cli import main
    >>> main(["peak", "tests/data/DeComFL__memory.pickle", "--top", "3"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys

from torchmem.cli._snapshot_common import add_file_argument, add_stack_arguments, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem peak``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["s.pickle", "--device", "1"]).device
        1
    """
    add_file_argument(parser)
    add_stack_arguments(parser)
    parser.add_argument("--device", type=int, default=None, help="only this device index")


def run(args: argparse.Namespace) -> int:
    """Print the peak report (text or ``--json`` with ``peak_allocated_bytes`` per device).

    Example:
        >>> run(argparse.Namespace(file="missing.pickle", json=True, depth=5, top=20,
        ...                        all_frames=False, device=None))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: missing.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._peak import snapshot_peak
    from torchmem.render.snapshot_text import render_peak

    snap = load(args.file)
    report = snapshot_peak(
        snap,
        depth=args.depth,
        filter_internal=not args.all_frames,
        top=args.top or None,
        device=args.device,
    )
    if args.json:
        d = report.to_dict()
        d["file"] = args.file
        emit_json(d)
    else:
        sys.stdout.write(render_peak(report))
    return 0
