"""The one way torchmem draws a text table: a rich ``Table`` or plain aligned columns.

Every table renderer (:mod:`~torchmem.render.table`, :mod:`~torchmem.render.summary`) builds its
rows as strings and hands them to :func:`rich_table` or :func:`plain_table`.

Example:
    >>> print(plain_table(["name", "bytes"], [["w", "64 B"], ["bias", "8 B"]]))
    name  bytes
    w     64 B
    bias  8 B
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

__all__ = ["rich_table", "plain_table"]


def rich_table(
    title: str,
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Collection[str] = (),
    fold: Collection[str] = (),
    show_edge: bool = True,
    pad_edge: bool = True,
) -> Any:
    """A rich ``Table`` titled ``title`` (left-justified) with ``header`` columns and ``rows``.

    Columns named in ``right`` are right-justified (numbers); those in ``fold`` wrap long
    values instead of cutting them.

    Example:
        >>> import io
        >>> from rich.console import Console
        >>> buf = io.StringIO()
        >>> Console(file=buf, width=40).print(rich_table("T", ["a", "n"], [["x", "1"]], right={"n"}))
        >>> "┃" in buf.getvalue() and "x" in buf.getvalue()
        True
    """
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=show_edge, pad_edge=pad_edge)
    for h in header:
        table.add_column(
            h, justify="right" if h in right else "left", overflow="fold" if h in fold else "ellipsis"
        )
    for r in rows:
        table.add_row(*r)
    return table


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, trailing spaces removed.

    Example:
        >>> plain_table(["a", "b"], [["xyz", "1"]]).splitlines()
        ['a    b', 'xyz  1']
    """
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
