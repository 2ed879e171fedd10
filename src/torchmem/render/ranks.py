"""Text and JSON renderings of a :class:`~torchmem.analysis.RankMerge` (no torch).

The text view: the job and whether every rank is here, one row per rank (peak, live at the end,
retained growth per iteration), the imbalance, bytes per category and module at each rank's
peak (one column per rank up to :data:`WIDE` ranks, else the lowest, highest and mean), the
collective operations, and why the heaviest rank differs from the lightest.

Example:
    >>> import io
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K, Category as C
    >>> from torchmem.analysis import merge_ranks
    >>> def rank(r, n):
    ...     tr = Trace({"rank": r, "world_size": 2, "job_id": "j"})
    ...     _ = tr.append(K.ALLOC, 0, "cpu", n, 1, op="c10d::allreduce_", category=C.COMMUNICATION)
    ...     return tr
    >>> out = io.StringIO(); render_merge(merge_ranks([rank(0, 4096), rank(1, 1024)]), out)
    >>> "imbalance 4.00x" in out.getvalue() and "+3.00 KiB" in out.getvalue()
    True
"""

from __future__ import annotations

import json
import sys
from typing import IO, TYPE_CHECKING

from torchmem.analysis import RankMerge
from torchmem.analysis._ranks import SEP
from torchmem.render.summary import short_site
from torchmem.render.text import rich_table, shorten_site, signed_bytes
from torchmem.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["render_merge", "merge_json", "WIDE"]

#: Up to this many ranks, per-name tables have one column per rank.
WIDE = 8


def merge_json(merge: RankMerge, indent: int | None = 2) -> str:
    """The merged view as JSON text (bytes as integers).

    Example:
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.analysis import merge_ranks
        >>> json.loads(merge_json(merge_ranks([Trace({"rank": 0, "world_size": 2})])))["missing"]
        [1]
    """
    return json.dumps(merge.to_dict(), indent=indent)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.1f}%"


def render_merge(merge: RankMerge, file: IO[str] | None = None, *, color: bool | None = None) -> None:
    """Write the merged view of a job's ranks (rich tables; plain text when not a terminal).

    Example:
        >>> import io
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.analysis import merge_ranks
        >>> buf = io.StringIO(); render_merge(merge_ranks([Trace({"rank": 1, "world_size": 2})]), buf)
        >>> "MISSING: rank 0" in buf.getvalue()
        True
    """
    from rich.console import Console

    out = file if file is not None else sys.stdout
    is_tty = bool(getattr(out, "isatty", lambda: False)())
    console = Console(file=out, force_terminal=color if color is not None else None,
                      no_color=not (color if color is not None else is_tty),
                      width=None if is_tty else 110, highlight=False, soft_wrap=False)
    m = merge
    have = len(m.ranks)
    state = "complete" if m.complete else "INCOMPLETE"
    console.print(f"[bold]Job {m.job_id or '(no job_id)'}: {have} of {m.world_size} rank(s), "
                  f"{state}[/bold]")
    if m.missing:
        console.print(f"[bold red]MISSING: rank {', '.join(map(str, m.missing))}[/bold red] "
                      "(no trace given: crashed, or not passed); the figures below are for the "
                      "ranks present only", soft_wrap=True)
    for r in m.ranks:
        if r.cut_short:
            console.print(f"[bold red]CUT SHORT: rank {r.rank}[/bold red] ({r.name or 'trace'}): "
                          f"{r.cut_short}", soft_wrap=True)
    rows = [
        (str(r.rank), r.device or "-", format_bytes(r.peak), format_bytes(r.final_live),
         signed_bytes(r.growth_per_iteration), str(r.steps), "yes" if r.leak else "no",
         str(r.events), r.peak_at, ", ".join(x for x in (
             "heaviest" if r.rank == m.heaviest and have > 1 else "",
             "lightest" if r.rank == m.lightest and have > 1 else "",
             "cut short" if r.cut_short else "") if x))
        for r in m.ranks
    ]
    header = ["rank", "device", "peak", "live at end", "growth/iteration", "steps", "leak",
              "events", "peak at", "note"]
    console.print(rich_table("Ranks", header, rows, show_edge=False,
                             right=("rank", "peak", "live at end", "growth/iteration", "steps",
                                    "events")))
    if have > 1 and m.heaviest is not None and m.lightest is not None:
        peaks = {r.rank: r.peak for r in m.ranks}
        ratio = f"imbalance {m.imbalance:.2f}x" if m.imbalance is not None else "imbalance n/a"
        console.print(f"Peaks: rank {m.heaviest} highest ({format_bytes(peaks[m.heaviest])}), "
                      f"rank {m.lightest} lowest ({format_bytes(peaks[m.lightest])}): {ratio}")
    for grouping, title in (("category", "category"), ("module", "module")):
        _per_rank_table(console, m, grouping, title)
    _collectives(console, m)
    _difference(console, m)


def _per_rank_table(console: Console, m: RankMerge, grouping: str, title: str) -> None:
    table = m.per_rank(grouping)
    if not table:
        return
    if len(m.ranks) <= WIDE:
        header = [title, *(f"rank {r.rank}" for r in m.ranks)]
        rows = [[name, *(format_bytes(v[r.rank]) for r in m.ranks)] for name, v in table.items()]
    else:
        header = [title, "lowest", "rank", "highest", "rank", "mean"]
        rows = []
        for name, v in table.items():
            lo = min(v, key=lambda k: (v[k], k))
            hi = max(v, key=lambda k: (v[k], -k))
            rows.append([name, format_bytes(v[lo]), str(lo), format_bytes(v[hi]), str(hi),
                         format_bytes(sum(v.values()) // len(v))])
    console.print(f"Live at each rank's peak, by {title}")
    console.print(rich_table("", header, rows, right=header[1:], no_wrap=(title,),
                             show_edge=False))


def _collectives(console: Console, m: RankMerge) -> None:
    if len(m.ranks) <= WIDE:
        header = ["rank", "operator", "category", "allocated", "storages", "live at peak"]
        rows = [[str(r.rank), c.operator, c.category, format_bytes(c.allocated), str(c.count),
                 format_bytes(c.live_at_peak)] for r in m.ranks for c in r.collectives[: m.top]]
    else:  # one row per operator over the ranks
        per: dict[str, dict[int, tuple[str, int, int]]] = {}
        for r in m.ranks:
            for c in r.collectives:
                per.setdefault(c.operator, {})[r.rank] = (c.category, c.allocated, c.live_at_peak)
        header = ["operator", "category", "ranks", "allocated/rank", "live at peak: lowest",
                  "rank", "highest", "rank"]
        rows = []
        for op, v in sorted(per.items(), key=lambda kv: -max(x[1] for x in kv[1].values())):
            lo = min(v, key=lambda k: (v[k][2], k))
            hi = max(v, key=lambda k: (v[k][2], -k))
            rows.append([op, v[hi][0], str(len(v)),
                         format_bytes(sum(x[1] for x in v.values()) // len(v)),
                         format_bytes(v[lo][2]), str(lo), format_bytes(v[hi][2]), str(hi)])
        rows = rows[: m.top]
    if not rows:
        return
    console.print(rich_table("Collective operations (communication buffers)", header, rows,
                             right=[h for h in header if h not in ("operator", "category")],
                             no_wrap=("operator",), show_edge=False))


def _name(grouping: str, name: str) -> str:
    if grouping == "call_site":
        return shorten_site(short_site(name), 60)
    if grouping == "combined":
        cat, mod, site = name.split(SEP, 2)
        return SEP.join((cat, mod, shorten_site(short_site(site), 40)))
    return name


def _difference(console: Console, m: RankMerge) -> None:
    d = m.difference
    if d is None:
        return
    p = console.print
    if d.bytes == 0:
        p(f"Ranks {d.heavy_rank} and {d.light_rank} peak at the same bytes: nothing to explain.")
        return
    shares = ", ".join(f"{g.replace('_', ' ')} {_pct(a.named_share)}"
                       for g, a in d.groupings.items() if g in ("category", "module", "call_site"))
    p(f"[bold]Why rank {d.heavy_rank} uses more than rank {d.light_rank}:[/bold] "
      f"{signed_bytes(d.bytes)} at their peaks ({format_bytes(d.heavy_peak)} against "
      f"{format_bytes(d.light_peak)}); {_pct(d.named_share)} of it named by category, module or "
      f"call site (by {shares} alone)", soft_wrap=True)
    if d.different_moments:
        p(f"Note: the two peaks are at different moments (rank {d.heavy_rank}: {d.heavy_at}; "
          f"rank {d.light_rank}: {d.light_at}): each side of the split is what that rank held "
          "at its own peak, so a category can rise on one rank and fall on the other for that "
          "reason alone", soft_wrap=True)
    order = ["combined", *(g for g in d.groupings if g != "combined")]
    for g in order:
        a = d.groupings[g]
        names = [_name(g, r.name) for r in a.rows]
        rows = [[name, format_bytes(r.heavy), format_bytes(r.light), signed_bytes(r.delta),
                 _pct(r.share)] for name, r in zip(names, a.rows) if r.delta]
        if a.rest:
            rows.append(["(the rest)", "", "", signed_bytes(a.rest), _pct(a.rest / d.bytes)])
        if not rows:
            continue
        first = "category | module | call site" if g == "combined" else g.replace("_", " ")
        header = [first, f"rank {d.heavy_rank}", f"rank {d.light_rank}", "difference", "share"]
        p(rich_table(f"Difference at the peaks, by {first}", header, rows, right=header[1:],
                     no_wrap=(first,), show_edge=False))
