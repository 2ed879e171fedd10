"""``torchmem replay FILE``: replay a snapshot's trace through the allocator simulator and compare.

For each device, the allocator's state at the start of the trace is rebuilt from the snapshot's
end state (a trace complete from empty starts empty), the trace's requests are fed to
:class:`torchmem.sim.CachingAllocator` configured from the snapshot's ``allocator_settings``, and
its decisions are compared with the real ones: every ``segment_alloc`` (size, stream), the
address of every ``alloc``, and the final layout. ``--json`` prints ``{"devices": [{"device",
"segment_allocs_expected", "segment_allocs_matched", "final_layout_equal", "first_divergence",
...}]}``.

Example:
    >>> from torchmem.cli import main
    >>> main(["replay", "tests/data/DeComFL__memory.pickle", "--json"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchmem.cli._snapshot_common import add_file_argument, emit_json, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem replay``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> a = p.parse_args(["s.pickle", "--device", "1", "--json"]); a.device, a.json
        (1, True)
    """
    add_file_argument(parser)
    parser.add_argument("--device", type=int, default=None,
                        help="only this device index (default: every device with data)")


def _render(results: list[dict[str, Any]]) -> str:
    """The text report of :func:`run`: one paragraph per device (``ReplayResult.to_dict()``).

    Example:
        >>> from torchmem.sim import ReplayResult
        >>> print(_render([ReplayResult(0, 2, 2, None, True).to_dict()]), end="")
        cuda:0: the simulator reproduced the trace
          segment_allocs matched   2 of 2 (same size, stream and pool, in order)
          allocs at real address   0 of 0
          final layout equal       yes (same segments, blocks, sizes and states as the snapshot)
          peaks (simulated)        allocated 0 B (0 B), requested 0 B (0 B), reserved 0 B (0 B)
    """
    from torchmem.units import format_bytes

    out: list[str] = []
    for r in results:
        div = r["first_divergence"]
        ok = (div is None and r["final_layout_equal"]
              and r.get("segment_maps_matched", 0) == r.get("segment_maps_expected", 0))
        head = "the simulator reproduced the trace" if ok else "the simulator diverged"
        if not r.get("allocs_expected") and not r["segment_allocs_expected"]:
            head = "nothing to check (no alloc or segment_alloc in the trace)"
        elif r.get("start") == "rebuilt":
            head += " (from a rebuilt start state)"
        out.append(f"{r.get('name') or 'cuda:' + str(r['device'])}: {head}")
        out.append(
            f"  segment_allocs matched   {r['segment_allocs_matched']} of "
            f"{r['segment_allocs_expected']} (same size, stream and pool, in order)"
        )
        out.append(f"  allocs at real address   {r.get('allocs_matched', 0)} of {r.get('allocs_expected', 0)}")
        if r.get("segment_maps_expected"):
            out.append(
                f"  segment_maps matched     {r.get('segment_maps_matched', 0)} of "
                f"{r['segment_maps_expected']} (expandable pages: same address and size, in order)"
            )
        out.append(
            "  final layout equal       "
            + ("yes (same segments, blocks, sizes and states as the snapshot)" if r["final_layout_equal"]
               else "NO (the simulator's segments or blocks differ from the snapshot's)")
        )
        peaks = ", ".join(
            f"{k} {format_bytes(r.get(f'peak_{k}_bytes', 0))} ({r.get(f'peak_{k}_bytes', 0)} B)"
            for k in ("allocated", "requested", "reserved")
        )
        out.append(f"  peaks (simulated)        {peaks}")
        if div is not None:
            out.append(f"  first divergence         at trace entry {div['entry']}: {div['explanation']}")
        for note in r.get("notes", ()):
            out.append(f"  note: {note}")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    """Replay and print the comparison (text or ``--json``); exit code 0.

    Example:
        >>> run(argparse.Namespace(file="missing.pickle", json=False, device=None))
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: missing.pickle: no such file; expected the path of a memory snapshot (from torch.cuda.memory._dump_snapshot or torchmem.write_snapshot)
    """
    from torchmem.analysis.replay import select_devices
    from torchmem.sim import replay

    snap = load(args.file)
    tty = sys.stderr.isatty()
    results = []
    for dev in select_devices(snap, args.device):
        if tty:
            n = len(snap.trace(dev))
            print(f"replaying device {dev}: {n} trace entries ...", file=sys.stderr, flush=True)
        d = replay(snap, dev).to_dict()
        name = snap.device_name(dev)
        if not name.startswith("cuda"):
            d["notes"].append(
                f"{name} is not a CUDA device: its trace does not come from PyTorch's CUDA caching "
                "allocator (a CPU run recorded by torchmem's tracker has one segment per "
                "storage), so the simulator is not expected to reproduce it"
            )
        d["name"] = name
        results.append(d)
    if args.json:
        emit_json({"devices": results})
    else:
        if not results:
            sys.stdout.write(f"{args.file}: no device has segments or trace entries: nothing to replay\n")
        else:
            sys.stdout.write(_render(results))
    return 0
