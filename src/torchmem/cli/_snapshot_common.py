"""Shared helpers of the snapshot subcommands (stats, peak, diff, trace, flame). No torch.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_file_argument(p)
    >>> p.parse_args(["x.pickle", "--json"]).json
    True
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torchmem.model.snapshot import Snapshot

__all__ = ["add_file_argument", "load", "emit_json", "add_stack_arguments", "non_negative_int"]


def add_file_argument(parser: argparse.ArgumentParser, name: str = "file") -> None:
    """Add the snapshot path argument and ``--json``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_file_argument(p)
        >>> p.parse_args(["a.pickle"]).file
        'a.pickle'
    """
    parser.add_argument(
        name,
        help="memory snapshot: PyTorch pickle (any version), torchmem JSON, or a .tmtrace file",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for counts (``--top``, ``--depth``, ``--head``, ``--tail``): an int >= 0.

    A negative count would otherwise slice from the end (``--top -1`` silently dropping the
    last group) or fail deep inside the command.

    Example:
        >>> non_negative_int("3")
        3
        >>> non_negative_int("-1")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected a count >= 0, got -1
    """
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {n}")
    return n


def add_stack_arguments(parser: argparse.ArgumentParser, depth: int = 5) -> None:
    """Add ``--depth``, ``--top`` and ``--all-frames``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_stack_arguments(p)
        >>> p.parse_args(["--depth", "2"]).depth
        2
    """
    parser.add_argument("--depth", type=non_negative_int, default=depth,
                        help=f"frames per stack group, innermost first (default {depth}; 0 = all)")
    parser.add_argument("--top", type=non_negative_int, default=20,
                        help="stack groups to list (0 = all)")
    parser.add_argument("--all-frames", action="store_true",
                        help="keep PyTorch-internal and C++ frames (filtered by default)")


def load(path: str) -> Snapshot:
    """Load a snapshot, saying so on stderr when it is a terminal (loading can take seconds).

    Example:
        >>> load("no/such/file.pickle")
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: no/such/file.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.io import load_snapshot

    tty = sys.stderr.isatty()
    if tty:
        print(f"loading {path} ...", end="", file=sys.stderr, flush=True)
    snap = load_snapshot(path)
    if tty:
        n = sum(len(t) for t in snap.traces.values())
        print(f"\rloaded {path}: {len(snap.segments)} segments, {n} trace entries", file=sys.stderr)
    return snap


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout.

    Example:
        >>> emit_json({"a": 1})
        {
          "a": 1
        }
    """
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
