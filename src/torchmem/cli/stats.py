"""``torchmem stats FILE``: per-device allocator statistics of a memory snapshot (and OOM report).

Example:
    >>> from torchmem.cli import main
    >>> main(["stats", "tests/data/SketchKV2__my_snapshot.pickle"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys

from torchmem.cli._snapshot_common import add_file_argument, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem stats``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["s.pickle", "--json"]).json
        True
    """
    add_file_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Print the statistics (text or ``--json``); exit code 0.

    Example:
        >>> run(argparse.Namespace(file="missing.pickle", json=False))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: missing.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._oom import oom_report
    from torchmem.analysis._stats import snapshot_stats
    from torchmem.render.snapshot_text import render_oom, render_stats

    snap = load(args.file)
    stats = snapshot_stats(snap)
    ooms = oom_report(snap)
    if args.json:
        d = stats.to_dict()
        d["file"] = args.file
        d["oom"] = [o.to_dict() for o in ooms]
        emit_json(d)
    else:
        sys.stdout.write(render_stats(stats))
        sys.stdout.write(render_oom(ooms))
        if ooms:
            sys.stdout.write(f"  (torchmem oom {args.file}: how the cached bytes split, what the "
                             "allocator tried, the verdict and the fix)\n")
    return 0
