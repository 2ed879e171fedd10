"""``torchmem trace FILE``: a snapshot's event log with correct running totals.

Each line is one trace entry, numbered ``#N`` from 0 in its device's trace: the one numbering
torchmem uses everywhere (``torchmem peak`` says "at trace entry #N" and its JSON
``peak_index`` is N, the tracker summary's peak and the viewer's ``#N`` are the same entry).

Output: text lines (default); ``--json``: one JSON document ``{"file", "entries": [...],
"devices": {...}}``; ``--jsonl``: JSON lines, one object per entry, then one
``{"summary": ...}`` line (for streaming very long traces). ``--head N`` / ``--tail N`` keep
the first / last N entries (0 keeps none). A snapshot recorded without a trace (no
``_record_memory_history``) has no entries: that is an error (exit 2) saying so, not empty
output.

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
from collections.abc import Iterable, Iterator
from typing import Any

from torchmem.cli._snapshot_common import add_file_argument, load, non_negative_int
from torchmem.errors import InvalidInputError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem trace``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["s.pickle", "--head", "10"]).head
        10
    """
    add_file_argument(parser)
    parser.add_argument("--jsonl", action="store_true",
                        help="print JSON lines: one object per entry, then a summary line")
    parser.add_argument("--device", type=int, default=None, help="only this device index")
    parser.add_argument("--head", type=non_negative_int, default=None, help="only the first N entries")
    parser.add_argument("--tail", type=non_negative_int, default=None, help="only the last N entries")
    parser.add_argument("--depth", type=non_negative_int, default=1, help="frames shown per entry (default 1)")
    parser.add_argument("--all-frames", action="store_true", help="keep PyTorch-internal frames")


def _no_trace_error(path: str) -> InvalidInputError:
    return InvalidInputError(
        f"{path} has no trace entries (the snapshot holds the end state only), so there is no "
        "event log to print; record one with torch.cuda.memory._record_memory_history() (or "
        "torchmem.record_history()) before taking the snapshot, or use 'torchmem stats' / "
        "'torchmem peak' for the end state"
    )


def run(args: argparse.Namespace) -> int:
    """Print the log (text, ``--json`` one document, or ``--jsonl`` lines).

    Example:
        >>> run(argparse.Namespace(file="missing.pickle", json=False, device=None, head=None,
        ...                        tail=None, depth=1, all_frames=False))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: missing.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._events import TraceRow, snapshot_trace
    from torchmem.render.snapshot_text import render_trace

    jsonl = getattr(args, "jsonl", False)
    if args.json and jsonl:
        raise InvalidInputError("--json and --jsonl are two formats: pass one of them")
    snap = load(args.file)
    if args.device is None and not any(len(t) for t in snap.traces.values()):
        raise _no_trace_error(args.file)
    rows = snapshot_trace(
        snap, device=args.device, depth=args.depth, filter_internal=not args.all_frames
    )
    last: dict[int, tuple[int, int, int]] = {}  # device -> (last entry #, allocated, reserved)

    def seen(it: Iterable[TraceRow]) -> Iterator[TraceRow]:
        for r in it:
            last[r.device] = (r.index, r.allocated_bytes, r.reserved_bytes)
            yield r

    it: Iterator[TraceRow] = seen(rows)
    if args.tail is not None:
        it = iter(deque(it, maxlen=args.tail))
    if args.head is not None:
        it = itertools.islice(it, args.head)
    devices: dict[str, Any] = {}

    def device_summary() -> dict[str, Any]:
        for _ in seen(rows):  # the rest of the log, for the totals at its end
            pass
        if not last:
            raise _no_trace_error(args.file)
        return {str(d): {"last_entry": n, "entries": n + 1, "allocated_bytes": a,
                         "reserved_bytes": res} for d, (n, a, res) in sorted(last.items())}

    write = sys.stdout.write
    if args.json:
        entries = [r.to_dict() for r in it]
        devices = device_summary()
        write(json.dumps({"file": args.file, "entries": entries, "devices": devices}, indent=1)
              + "\n")
    elif jsonl:
        for r in it:
            write(json.dumps(r.to_dict()) + "\n")
        write(json.dumps({"summary": device_summary()}) + "\n")
    else:
        for line in render_trace(it):
            write(line + "\n")
        from torchmem.units import format_bytes

        for d, v in device_summary().items():
            write(f"device {d}: after entry #{v['last_entry']} (the last of {v['entries']}): "
                  f"allocated {format_bytes(v['allocated_bytes'])}, reserved "
                  f"{format_bytes(v['reserved_bytes'])}\n")
    return 0
