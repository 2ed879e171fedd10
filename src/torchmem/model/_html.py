"""Small HTML tables for the rich display of torchmem's objects in Jupyter (``_repr_html_``).

Plain strings, no dependencies, every value escaped; the same few CSS rules as the viewer's
colours so the tables read in light and dark notebook themes.

Example:
    >>> print(html_table("t", ["a", "b"], [["x<y", 1]]))  # doctest: +ELLIPSIS
    <table class="torchmem"><caption>t</caption><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>x&lt;y</td><td...>1</td></tr></tbody></table>
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["html_table", "html_block", "fmt_bytes", "estimate_html"]

_STYLE = (
    "<style>.torchmem-html table.torchmem{border-collapse:collapse;margin:4px 0 10px 0;"
    "font-size:12px}.torchmem-html table.torchmem caption{text-align:left;font-weight:bold;"
    "padding:2px 0}.torchmem-html table.torchmem th,.torchmem-html table.torchmem td"
    "{padding:2px 8px;border-bottom:1px solid #8884;text-align:left}"
    ".torchmem-html table.torchmem td.num{text-align:right;font-variant-numeric:tabular-nums}"
    "</style>"
)


def fmt_bytes(n: int) -> str:
    """Binary units with two decimals, like :func:`torchmem.units.format_bytes`.

    Example:
        >>> fmt_bytes(1536), fmt_bytes(-2048)
        ('1.50 KiB', '-2.00 KiB')
    """
    from torchmem.units import format_bytes

    return format_bytes(n)


def html_table(caption: str, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """One table; ints are right-aligned (pass bytes through :func:`fmt_bytes` first if wanted).

    Example:
        >>> "<td class=\\"num\\">3</td>" in html_table("c", ["n"], [[3]])
        True
    """
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for v in row:
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            num = num or (isinstance(v, str) and _looks_numeric(v))
            cls = ' class="num"' if num else ""
            cells.append(f"<td{cls}>{html.escape(str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return (
        f'<table class="torchmem">{cap}<thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _looks_numeric(s: str) -> bool:
    head = s.split(" ")[0].lstrip("-+")
    return bool(head) and head.replace(".", "", 1).isdigit()


def html_block(title: str, *parts: str) -> str:
    """Wrap tables in one styled block with a heading.

    Example:
        >>> html_block("T", "<p>x</p>").startswith('<div class="torchmem-html">')
        True
    """
    return (
        f'<div class="torchmem-html">{_STYLE}<div style="font-weight:bold;margin:2px 0">'
        f"{html.escape(title)}</div>{''.join(parts)}</div>"
    )


def estimate_html(est: Any) -> str:
    """An :class:`~torchmem.fit.Estimate` as HTML: the verdict, the memory lines, what is live at
    the peak (by category and module), where it would run out of memory and, after
    ``estimate(..., what_if=...)``, the what-if table (each lever's peaks, verdict, headroom,
    cost and change; the levers not applied with the reason; the best combination).

    Duck-typed (this module never imports the producer that defines ``Estimate``), so that
    ``Estimate._repr_html_`` can call it without breaking the layers.

    Example:
        >>> from torchmem.fit import Estimate
        >>> e = Estimate("T4", 8, False, 100 << 20, 10 << 20, 1, 2, 200 << 20)
        >>> page = estimate_html(e)
        >>> "DOES NOT FIT" in page and "-110.00 MiB" in page
        True
    """
    colour = "#9a6700" if est.incomplete else "#1a7f37" if est.fits else "#cf222e"
    parts = [f'<div style="font-weight:bold;color:{colour}">'
             f"{html.escape(est.verdict_line())}</div>"]
    if est.searched:
        parts.append(f"<div>{html.escape(est.search_line())}</div>")
    lower = getattr(est, "peak_reserved_lower_bytes", None)
    low_row = [] if lower is None else [
        ["peak reserved, lower", fmt_bytes(lower), "the least it can be; the verdict takes the top"]]
    parts.append(html_table("memory", ["line", "bytes", "what it is"], [
        ["GPU total", fmt_bytes(est.capacity_bytes), "cudaMemGetInfo total of the card"],
        ["CUDA context", fmt_bytes(est.overhead_bytes), "outside PyTorch's allocator"],
        ["usable", fmt_bytes(est.usable_bytes), "the simulated allocator's capacity"],
        ["peak requested", fmt_bytes(est.peak_requested_bytes), "sum of live tensor storages"],
        ["peak allocated", fmt_bytes(est.peak_allocated_bytes), "allocator blocks"],
        ["peak reserved", fmt_bytes(est.peak_reserved_bytes), "cudaMalloc'd segments"],
        *low_row,
        ["fragmentation", fmt_bytes(est.fragmentation_bytes), "reserved, unallocated"],
        ["cuBLAS workspaces", fmt_bytes(est.workspace_bytes), "inside allocated"],
        ["error margin", fmt_bytes(est.margin_bytes),
         f"kept free for FITS ({est.margin_rule or 'none'})"],
    ]))
    if est.attention_kernel:
        parts.append(f"<div>attention kernel: {html.escape(est.attention_kernel)}</div>")
    parts.append(html_table("live at the peak, by category", ["category", "bytes"],
                            [[k, fmt_bytes(v)] for k, v in est.by_category.items() if v]))
    if est.by_module:
        rows = [[k, fmt_bytes(v)] for k, v in list(est.by_module.items())[:15]]
        more = len(est.by_module) - len(rows)
        if more > 0:
            rows.append([f"... and {more} more (the JSON lists all)", ""])
        parts.append(html_table("live at the peak, by module (top 15)", ["module", "bytes"],
                                rows))
    if est.oom is not None:
        o = est.oom
        stack = "".join(f"<div><code>{html.escape(s)}</code></div>" for s in o.stack[-6:])
        parts.append(
            f"<div><b>out of memory at</b> {html.escape(o.op or '?')} in module "
            f"{html.escape(o.module or '(none)')} ({html.escape(o.phase)}), requesting "
            f"{fmt_bytes(o.requested_bytes)} with {fmt_bytes(o.allocated_bytes)} allocated, "
            f"{fmt_bytes(o.reserved_bytes)} reserved</div>{stack}"
        )
    parts.extend(_what_if_html(est))
    parts.extend(f"<div>range: {html.escape(c)}</div>" for c in getattr(est, "range_causes", ()))
    parts.extend(f"<div>note: {html.escape(n)}</div>" for n in est.notes)
    return html_block("torchmem estimate", *parts)


def _what_if_html(est: Any) -> list[str]:
    """The what-if table (``estimate(..., what_if=...)``): one row per lever, the skipped ones
    with their reasons, and the recommended combination."""
    rows = getattr(est, "what_if", None) or []
    if not rows:
        return []
    done = [r for r in rows if r.skipped is None]
    out = [html_table(
        "what if (each lever alone, sorted by peak reserved)",
        ["lever", "peak reserved", "peak allocated", "fits", "headroom", "cost", "applied"],
        [[r.lever, fmt_bytes(r.peak_reserved_bytes or 0), fmt_bytes(r.peak_allocated_bytes or 0),
          "yes" if r.fits else "no", fmt_bytes(r.headroom_bytes or 0), r.cost_words(),
          r.applied] for r in done])]
    out.extend(f"<div>not applied: <b>{html.escape(r.lever)}</b>: {html.escape(r.skipped)}</div>"
               for r in rows if r.skipped is not None)
    best = getattr(est, "what_if_best", None)
    if best is None:
        line = "nothing tried fits (try a larger GPU or more GPUs)"
    elif best.lever == "as_written":
        line = "as written (it fits; no lever needed)"
    else:
        line = (f"{best.lever} (fits, headroom {fmt_bytes(best.headroom_bytes or 0)}): "
                f"{best.applied}")
    out.append(f"<div><b>best:</b> {html.escape(line)}</div>")
    return out
