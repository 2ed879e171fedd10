"""``torchmem diff A B``: what grew and shrank between two runs (traces or snapshots).

Two torchmem traces (``.tmtrace``, from ``torchmem run`` or ``tracker.save()``) are compared at
one point of each run, ``--at peak`` by default (when each run's live bytes first reach their
maximum), ``--at end`` or ``--at step N`` (the peak of iteration N, numbered as the summary's
Iterations table), by category, module, operator and call site, plus iteration by iteration.
Two snapshots (PyTorch pickles, torchmem JSON; or a snapshot and a trace, converted) are
compared by stack, at the peak by default or at the end (``--at end``: the allocated blocks of
the end states, with reserved memory and segments). Changes are signed (``+3.00 GiB``: after
minus before) and sorted by size, largest first.

``--json`` prints one document. For traces: ``kind`` ("trace"), ``at``, ``before``/``after``
(the paths), ``device_before``/``device_after``, ``live_bytes_before``/``_after``/``_delta``
(live at the compared point), ``entry_before``/``entry_after`` (the point's trace entry ``#N``,
as ``torchmem trace`` numbers it), ``peak_bytes_before``/``_after``/``_delta`` (each run's
peak), ``groups`` (``category``, ``module``, ``operator``, ``call_site``, ``phase``: rows of
``name``, ``before_bytes``, ``after_bytes``, ``delta_bytes``, ``before_count``,
``after_count``) and ``iterations`` (rows of ``step``, ``complete`` and ``peak_bytes``,
``end_bytes``, ``retained_growth``, ``allocated_bytes`` each as ``_before``/``_after``/
``_delta``). For snapshots: ``kind`` ("snapshot"), ``at``, ``before``/``after``, ``totals``
per device and ``rows`` (``device``, ``stack``, ``before_bytes``, ``after_bytes``,
``delta_bytes``, ``before_count``, ``after_count``). ``--top`` limits every list of rows.

Example:
    >>> from torchmem.cli import main
    >>> main(["diff", "small.tmtrace", "large.tmtrace", "--at", "step", "2"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchmem.cli._snapshot_common import add_stack_arguments, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem diff``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> ns = p.parse_args(["a.tmtrace", "b.tmtrace", "--at", "step", "3"])
        >>> ns.after, ns.at
        ('b.tmtrace', ['step', '3'])
    """
    parser.add_argument("before", nargs="?",
                        help="the earlier (or reference) run: a .tmtrace or a snapshot")
    parser.add_argument("after", nargs="?",
                        help="the later (or new) run: a .tmtrace or a snapshot")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--at", nargs="+", default=["peak"], metavar="POINT",
        help="where to compare: peak (default), end, or 'step N' (traces only: the peak of "
             "iteration N)",
    )
    parser.add_argument("--device", default=None,
                        help="traces: the device to compare (default: each run's highest peak); "
                             "snapshots: a device index")
    add_stack_arguments(parser)


def _load_traces(args: argparse.Namespace) -> tuple[Any, Any] | None:
    from torchmem.io.tmtrace import is_tmtrace, load_trace

    if is_tmtrace(args.before) and is_tmtrace(args.after):
        return load_trace(args.before), load_trace(args.after)
    return None


def _cut(rows: list[Any], top: int) -> list[Any]:
    return rows[:top] if top else rows


def run(args: argparse.Namespace) -> int:
    """Print the differences (text or ``--json``).

    Example:
        >>> run(argparse.Namespace(before="nope.pickle", after="x", json=False, depth=5, top=20,
        ...                        all_frames=False, at=["peak"], device=None))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: nope.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis._diff import parse_at, snapshot_diff, trace_diff
    from torchmem.errors import InvalidInputError
    from torchmem.render.snapshot_text import render_diff

    at = list(getattr(args, "at", ["peak"]))
    # "--at end a b": argparse gives --at the files that follow it; they are the files
    words = 2 if at[:1] == ["step"] else 1
    files = [f for f in (args.before, args.after) if f] + at[words:]
    at = at[:words]
    if len(files) != 2:
        raise InvalidInputError(
            f"expected two files to compare (before and after), got {len(files)}: "
            f"{' '.join(files) or 'none'}; e.g. 'torchmem diff small.tmtrace big.tmtrace --at peak'"
        )
    args.before, args.after = files
    kind, step = parse_at(at)
    device = getattr(args, "device", None)
    traces = _load_traces(args)
    out: dict[str, Any]
    if traces is not None:
        d: Any = trace_diff(traces[0], traces[1], at=" ".join(at), device=device)
        out = d.to_dict()
        for rows in out["groups"].values():
            rows[:] = _cut(rows, args.top)
    else:
        if kind == "step":
            raise InvalidInputError(
                "--at step N compares two torchmem traces (.tmtrace), whose events carry the "
                "iteration; for snapshots use --at peak or --at end"
            )
        a, b = load(args.before), load(args.after)
        if device is not None:
            a, b = (_one_device(s, device) for s in (a, b))
        d = snapshot_diff(a, b, depth=args.depth, filter_internal=not args.all_frames, at=kind)
        out = {"kind": "snapshot", **d.to_dict()}
        out["rows"] = _cut(out["rows"], args.top)
    if args.json:
        out["before"], out["after"] = args.before, args.after
        emit_json(out)
    else:
        sys.stdout.write(render_diff(d, top=args.top or None))
    return 0


def _one_device(snap: Any, device: str) -> Any:
    from torchmem.analysis.replay import select_devices
    from torchmem.errors import InvalidInputError

    try:
        index = int(device)
    except ValueError:
        raise InvalidInputError(
            f"--device for snapshots is a device index (0, 1, ...), got {device!r}"
        ) from None
    select_devices(snap, index)  # raises a clear error naming the devices there are
    snap.segments = [s for s in snap.segments if s.device == index]
    snap.traces = {k: v for k, v in snap.traces.items() if k == index}
    return snap
