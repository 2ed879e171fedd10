"""``torchmem estimate --world-size N --rank all``: every rank of the job, one estimate each.

Each rank runs as ``--rank R`` does (its own local shapes where a plan splits unevenly); the
report is a table of the ranks' peaks and verdicts, the worst rank (the largest peak reserved;
the lowest rank among equals) named, and that rank's full report. The time is N estimates:
each rank is its own run, and the progress says which rank runs.

Example:
    >>> from torchmem.fit import Estimate
    >>> e0 = Estimate("T4", 8, True, 100 << 20, 10 << 20, 1 << 20, 2 << 20, 4 << 20)
    >>> e1 = Estimate("T4", 8, True, 100 << 20, 10 << 20, 1 << 20, 2 << 20, 6 << 20)
    >>> worst_rank([e0, e1])  # the larger peak reserved (the last figure)
    1
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.units import format_bytes

__all__ = ["check_all_ranks", "rank_lines", "worst_rank"]


def check_all_ranks(world_size: int | None, refused: dict[str, bool]) -> int:
    """The world size of ``--rank all`` (it needs one); options that ask for one answer per
    run (a search, the levers, a snapshot file) are refused by name.

    Example:
        >>> check_all_ranks(4, {"--what-if": False})
        4
    """
    if world_size is None:
        raise InvalidInputError(
            "--rank all estimates every rank of a job, but no --world-size was given; fix: add "
            "--world-size N (the job's number of ranks)"
        )
    given = [name for name, on in refused.items() if on]
    if given:
        raise InvalidInputError(
            f"--rank all with {', '.join(given)}: those give one answer per run; fix: run them "
            "for one rank (--rank R), or drop them"
        )
    return world_size


def worst_rank(estimates: Sequence[Any]) -> int:
    """The rank with the largest peak reserved (the lowest such rank)."""
    return max(range(len(estimates)), key=lambda r: (estimates[r].peak_reserved_bytes, -r))


def rank_lines(estimates: Sequence[Any]) -> list[str]:
    """The table of every rank's peaks and verdict, and the worst rank's line.

    Example:
        >>> from torchmem.fit import Estimate
        >>> e = Estimate("T4", 8, True, 100 << 20, 10 << 20, 1 << 20, 2 << 20, 4 << 20)
        >>> rank_lines([e, e])[-1]
        'worst rank: 0 (peak reserved 4.00 MiB; ranks with the same peak: 0, 1)'
    """
    lines = [f"{'rank':>6}  {'peak requested':>15}  {'peak allocated':>15}  "
             f"{'peak reserved':>14}  verdict"]
    for r, e in enumerate(estimates):
        verdict = "INCOMPLETE" if getattr(e, "incomplete", False) else (
            "FITS" if e.fits else "DOES NOT FIT")
        lines.append(f"{r:>6}  {format_bytes(e.peak_requested_bytes):>15}  "
                     f"{format_bytes(e.peak_allocated_bytes):>15}  "
                     f"{format_bytes(e.peak_reserved_bytes):>14}  {verdict}")
    w = worst_rank(estimates)
    peak = estimates[w].peak_reserved_bytes
    same = [r for r, e in enumerate(estimates) if e.peak_reserved_bytes == peak]
    tie = f"; ranks with the same peak: {', '.join(map(str, same))}" if len(same) > 1 else ""
    lines.append(f"worst rank: {w} (peak reserved {format_bytes(peak)}{tie})")
    return lines


def run_all_ranks(world_size: int, one: Callable[[int], Any], say: Callable[[str], None],
                  as_json: bool, render: Callable[[Any], None]) -> int:
    """Estimate ranks ``0 .. world_size - 1`` with ``one(rank)``, print the table (or the
    JSON document) and return the exit code: 0 when every rank fits, 3 when one does not,
    4 when one has no verdict."""
    estimates = []
    for r in range(world_size):
        say(f"rank {r} of {world_size} ...")
        estimates.append(one(r))
    w = worst_rank(estimates)
    if as_json:
        print(json.dumps({"worst_rank": w, "ranks": [e.to_dict() for e in estimates]},
                         indent=2))
    else:
        print("\n".join(rank_lines(estimates)))
        print(f"\nthe worst rank's report (rank {w}):")
        render(estimates[w])
    if any(getattr(e, "incomplete", False) for e in estimates):
        return 4
    return 0 if all(e.fits for e in estimates) else 3
