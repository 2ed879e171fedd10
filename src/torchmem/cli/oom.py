"""``torchmem oom FILE``: why a snapshot ran out of memory, or how close it came.

For each ``oom`` entry (PyTorch records one at every CUDA OOM while history is recorded;
``torchmem.oom_guard`` saves such a snapshot) it prints the failed request after rounding (stream,
pool, where it was allocated), the device's free memory at that moment, reserved and allocated
bytes, how the reserved-but-unallocated bytes split (free blocks per stream and pool and the
largest one, bytes only other streams can use, pending frees), what the allocator tried, and the
verdict: ``fragmentation`` (naming the ``PYTORCH_CUDA_ALLOC_CONF`` setting that would have fit
it, from what-if replays on the allocator simulator) or ``exhaustion`` (the bytes really
missing). A snapshot without an OOM gets the same analysis at its peak ("closest to OOM").
When the trace has iteration markers, it also says whether reserved memory creeps up over the
iterations while allocated does not (a late OOM) and where fragmentation started to grow.

``--json`` prints ``{"file", "closest_to_oom", "explanations": [...], "creep": [...]}``; each
explanation starts with the keys ``device``, ``request_bytes``, ``stream``,
``device_free_bytes``, ``reserved_bytes``, ``allocated_bytes``, ``largest_free_block_bytes``,
``verdict``, ``missing_bytes``, ``fix`` and ``text`` (see
:class:`torchmem.analysis.OomExplanation`).

Example:
    >>> from torchmem.cli import main
    >>> main(["oom", "tests/data/LLM-inference__oom_snapshot_41810ba.pickle"])  # doctest: +ELLIPSIS
    No OOM recorded on cuda:0; closest to OOM: its end state ...
    0
"""

from __future__ import annotations

import argparse
import sys

from torchmem.cli._snapshot_common import add_file_argument, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem oom``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> a = p.parse_args(["s.pickle", "--json", "--device", "1"]); a.json, a.device
        (True, 1)
    """
    add_file_argument(parser)
    parser.add_argument("--device", type=int, default=None,
                        help="only this device index (default: every device with data)")


def run(args: argparse.Namespace) -> int:
    """Explain the OOMs (text or ``--json``); exit code 0.

    Example:
        >>> import contextlib, io, json
        >>> buf = io.StringIO()
        >>> with contextlib.redirect_stdout(buf):
        ...     code = run(argparse.Namespace(file="tests/data/SketchKV2__my_snapshot.pickle",
        ...                                   json=True, device=None))
        >>> code, json.loads(buf.getvalue())["closest_to_oom"]
        (0, True)
    """
    from torchmem.analysis._creep import creep
    from torchmem.analysis._why_oom import explain_oom
    from torchmem.errors import InvalidInputError

    snap = load(args.file)
    if args.device is not None and args.device not in snap.devices:
        raise InvalidInputError(
            f"{args.file}: device {args.device} has no segments or trace entries; the snapshot "
            f"has data for device(s) {snap.devices or 'none'}; pass one of them to --device"
        )
    if sys.stderr.isatty():
        n = sum(len(snap.trace(d)) for d in snap.devices)
        print(f"explaining: replaying {n} trace entries through the allocator simulator "
              "(and what-if settings) ...", file=sys.stderr, flush=True)
    explanations = explain_oom(snap, args.device)
    creeps = [c for c in creep(snap, args.device) if c.iterations]
    if args.json:
        emit_json({
            "file": args.file,
            "closest_to_oom": any(e.closest for e in explanations),
            "explanations": [e.to_dict() for e in explanations],
            "creep": [c.to_dict() for c in creeps],
        })
        return 0
    if not explanations:
        sys.stdout.write(f"{args.file}: no device has segments or trace entries: nothing to explain\n")
    for e in explanations:
        sys.stdout.write(e.text)
    for c in creeps:
        sys.stdout.write("late OOMs     " + c.text + "\n")
        for note in c.notes:
            sys.stdout.write(f"  note: {note}\n")
    return 0
