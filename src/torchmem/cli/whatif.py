"""``torchmem whatif SNAPSHOT``: what would other allocator settings have done with the same requests?

Replays the requests recorded in a memory snapshot (or a ``.tmtrace`` file) through the allocator
simulator under ``--alloc-conf`` (the whole ``PYTORCH_CUDA_ALLOC_CONF``; default: the recorded
settings, and then the what-if equals the recorded run exactly, which the output says) and, with
``--gpu NAME|SIZE``, on a device of that size (a catalog GPU from ``torchmem estimate
--list-gpus``, its usable bytes; or a size such as ``24GiB``, less a CUDA context, as ``torchmem
estimate --gpu`` reads it). Prints per device the recorded run and the what-if side by side: peak
reserved and allocated bytes, fragmentation at the peak, cudaMalloc/cudaFree calls, allocation
retries and out-of-memory errors. ``--suggest`` tries the documented set of settings
(:data:`torchmem.sim.whatif.SUGGESTED_CONFIGS`), ranks them (OOM avoided, then peak reserved,
then cudaMalloc calls) and prints the best ``PYTORCH_CUDA_ALLOC_CONF=...`` line with the bytes
it saves and what it costs. ``--json`` prints ``{"devices": [{"device", "recorded", "whatif",
...}], "limit"}`` (with ``--suggest`` each device also has ``"suggestions"`` and ``"best"``).

The limit: a what-if keeps the program's requests fixed; it does not know what the program would
have done differently.

Example:
    >>> from torchmem.cli import main
    >>> main(["whatif", "tests/data/DeComFL__memory.pickle", "--suggest"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchmem.cli._snapshot_common import add_file_argument, emit_json, load
from torchmem.units import format_bytes

__all__ = ["add_arguments", "render", "run", "suggest_estimate"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem whatif``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> a = p.parse_args(["s.pickle", "--alloc-conf", "expandable_segments:True", "--suggest"])
        >>> a.alloc_conf, a.gpu, a.suggest, a.json
        ('expandable_segments:True', None, True, False)
    """
    add_file_argument(parser)
    parser.add_argument("--alloc-conf", default=None, metavar="CONF",
                        help="the PYTORCH_CUDA_ALLOC_CONF to try, e.g. 'expandable_segments:True' "
                             "(default: the recorded settings)")
    parser.add_argument("--gpu", default=None, metavar="NAME|SIZE",
                        help="replay on this device: a GPU of the catalog (torchmem estimate "
                             "--list-gpus) or a size such as '24GiB' (default: the device of the "
                             "recorded OOM, else unlimited)")
    parser.add_argument("--suggest", action="store_true",
                        help="try the documented settings, rank them and print the best")
    parser.add_argument("--device", type=int, default=None,
                        help="only this device index (default: every device with a trace)")


def _b(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _delta(a: int, b: int, as_bytes: bool = True) -> str:
    if a == b:
        return "same"
    d = b - a
    return ("+" if d > 0 else "-") + (format_bytes(abs(d)) if as_bytes else str(abs(d)))


def _oom(o: dict[str, Any] | None) -> str:
    if o is None:
        return "none"
    where = f" at {o['where']}" if o.get("where") else ""
    return f"{format_bytes(o['request_bytes'])} at entry {o['entry']}{where}"


def _device_lines(d: dict[str, Any]) -> list[str]:
    rec, wi = d["recorded"], d["whatif"]
    conf = wi["alloc_conf"] or "(default settings)"
    head = "recorded" if d["source"] != "trace" else "default (simulated)"
    if wi["alloc_conf"] == rec["alloc_conf"]:
        out = [f"{d['name']}: the recorded settings replayed: PYTORCH_CUDA_ALLOC_CONF={conf}"]
    else:
        was = "recorded" if d["source"] != "trace" else "simulated beside it"
        out = [f"{d['name']}: what if PYTORCH_CUDA_ALLOC_CONF={conf} "
               f"({was}: {rec['alloc_conf'] or '(default settings)'})"]
    cap = "unlimited" if d["capacity_bytes"] is None else (
        f"{format_bytes(d['capacity_bytes'])} ({d['capacity_source']})")
    out.append(f"  capacity                 {cap}")
    out.append(f"  {'':<24} {head:>20} {'what-if':>14} {'change':>14}")
    rows: list[tuple[str, Any, Any, bool]] = [
        ("peak reserved", rec["peak_reserved_bytes"], wi["peak_reserved_bytes"], True),
        ("peak allocated", rec["peak_allocated_bytes"], wi["peak_allocated_bytes"], True),
        ("fragmentation at peak", rec["fragmentation_bytes"], wi["fragmentation_bytes"], True),
        ("largest free (large)", rec["largest_free_block_bytes"]["large"],
         wi["largest_free_block_bytes"]["large"], True),
        ("largest free (small)", rec["largest_free_block_bytes"]["small"],
         wi["largest_free_block_bytes"]["small"], True),
        ("inactive split", rec["inactive_split_bytes"], wi["inactive_split_bytes"], True),
        ("cudaMalloc calls", rec["segment_allocs"], wi["segment_allocs"], False),
        ("cudaFree calls", rec["segment_frees"], wi["segment_frees"], False),
        ("allocation retries", rec["alloc_retries"], wi["alloc_retries"], False),
    ]
    for label, a, b, is_bytes in rows:
        if a is None or b is None:
            continue
        sa, sb = (format_bytes(a), format_bytes(b)) if is_bytes else (str(a), str(b))
        out.append(f"  {label:<24} {sa:>20} {sb:>14} {_delta(a, b, is_bytes):>14}")
    out.append(f"  {'out of memory':<24} recorded: {_oom(rec['oom'])}")
    out.append(f"  {'':<24} what-if:  {_oom(wi['oom'])}")
    avoided = d["recorded_oom_avoided"]
    if avoided is not None:
        out.append("  the recorded OOM " + ("is AVOIDED" if avoided else "still happens"))
    if wi["oom"] is not None and not wi["oom"]["recorded"]:
        out.append(f"  the what-if runs out of memory at trace entry {wi['oom']['entry']}: its "
                   "figures cover the run up to there")
    for note in d["notes"]:
        out.append(f"  note: {note}")
    if "suggestions" in d:
        out.extend(_suggestion_lines(d))
    return out


def _suggestion_lines(d: dict[str, Any]) -> list[str]:
    base = d["baseline"]
    out = ["  suggestions (ranked: OOM avoided, then peak reserved, then cudaMalloc calls; each "
           "on top of the recorded settings):"]
    out.append(f"    {'recorded settings':<66} {format_bytes(base['peak_reserved_bytes']):>11} "
               f"{base['segment_allocs']:>6} cudaMalloc  OOM: {_oom(base['oom'])}")
    for k, s in enumerate(d["suggestions"], 1):
        conf = s["alloc_conf"] or "(default settings)"
        if s.get("figures"):
            f = s["figures"]
            out.append(f"  {k:>2}. {conf:<66} {format_bytes(f['peak_reserved_bytes']):>11} "
                       f"{f['segment_allocs']:>6} cudaMalloc  OOM: {_oom(f['oom'])}")
        else:
            out.append(f"  {k:>2}. {conf:<66} skipped: {s['skipped']}")
    best = d["best"]
    if best is None:
        out.append("  best: none of them beats the recorded settings (same OOMs, no less peak "
                   "reserved, no fewer cudaMalloc calls)")
        return out
    f = best["figures"]
    gain = ("avoids the OOM; " if best["avoids_oom"] else "")
    out.append(f"  best: PYTORCH_CUDA_ALLOC_CONF={best['alloc_conf']}")
    out.append(f"        {gain}saves {format_bytes(best['saved_bytes'])} of peak reserved "
               f"({format_bytes(base['peak_reserved_bytes'])} -> "
               f"{format_bytes(f['peak_reserved_bytes'])})" if best["saved_bytes"] >= 0 else
               f"        {gain}costs {format_bytes(-best['saved_bytes'])} more peak reserved")
    out.append(f"        costs: {best['cost']}")
    return out


def render(result: Any) -> str:
    """The text report of a :class:`~torchmem.sim.WhatIf` (one paragraph per device, then the
    limit).

    Example:
        >>> from torchmem.sim import CachingAllocator, whatif
        >>> a = CachingAllocator(); a.free(a.malloc(12 << 20)); _ = a.malloc(14 << 20)
        >>> print(render(whatif(a.snapshot(), "expandable_segments:True")))  # doctest: +ELLIPSIS
        cuda:0: what if PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (recorded: (default settings))
          capacity                 unlimited
                                               recorded        what-if         change
          peak reserved                       26.00 MiB      20.00 MiB      -6.00 MiB
        ...
    """
    d = result.to_dict()
    out: list[str] = []
    for dev in d["devices"]:
        out.extend(_device_lines(dev))
    out.append(f"limit: {d['limit']}")
    return "\n".join(out) + "\n"


def _progress() -> Any:
    if not sys.stderr.isatty():
        return None
    return lambda msg: print(f"torchmem whatif: {msg}", file=sys.stderr, flush=True)


def _gpu_capacity(text: str) -> tuple[int, str]:
    from torchmem.fit import gpu  # imports torch: only when --gpu is given

    card = gpu(text)
    return card.usable_bytes, (f"{card.name}: {format_bytes(card.total_bytes)} less the CUDA "
                               f"context {format_bytes(card.context_bytes)}")


def suggest_estimate(est: Any) -> Any:
    """``torchmem estimate --suggest``: :func:`torchmem.sim.suggest` on an estimate's simulated
    run (made with ``keep_snapshot=True``), on its GPU; returns the :class:`~torchmem.sim.WhatIf`.

    Example:
        >>> from torchmem.fit import Estimate
        >>> suggest_estimate(Estimate("T4", 1, True, 100, 10, 0, 0, 0))
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: the estimate holds no simulated run; make it with torchmem.estimate(..., keep_snapshot=True) and pass that estimate
    """
    from torchmem.sim import suggest

    return suggest(est, progress=_progress())


def run(args: argparse.Namespace) -> int:
    """Replay under the settings asked for and print the comparison (text or ``--json``).

    Options are checked before any replay (``main`` turns the error into one line, exit 2).
    Exit code 0.

    Example:
        >>> ns = argparse.Namespace(file="tests/data/DeComFL__memory.pickle", alloc_conf="bogus:1",
        ...                         gpu=None, suggest=False, device=None, json=True)
        >>> run(ns)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: unrecognized allocator option 'bogus' in 'bogus:1'; known options: ...
    """
    from torchmem.sim import suggest, whatif

    snap = load(args.file)
    capacity, where = (None, "")
    if args.gpu is not None:
        capacity, where = _gpu_capacity(args.gpu)
    say = _progress()
    if say is not None:
        say(f"replaying {args.file} under {args.alloc_conf or 'the recorded settings'} ...")
    if args.suggest:
        result = suggest(snap, capacity, device=args.device, alloc_conf=args.alloc_conf,
                         progress=say)
    else:
        result = whatif(snap, args.alloc_conf, capacity, device=args.device)
    if where:
        from dataclasses import replace

        result = replace(result, devices=tuple(replace(d, capacity_source=f"--gpu {where}")
                                               for d in result.devices))
    if args.json:
        emit_json(result.to_dict())
    else:
        sys.stdout.write(render(result))
    return 0
