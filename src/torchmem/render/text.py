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

__all__ = ["rich_table", "plain_table", "shorten_site", "signed_bytes"]


def rich_table(
    title: str,
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Collection[str] = (),
    fold: Collection[str] = (),
    show_edge: bool = True,
    pad_edge: bool = True,
    no_wrap: Collection[str] = (),
) -> Any:
    """A rich ``Table`` titled ``title`` (left-justified) with ``header`` columns and ``rows``.

    Cells are shown as they are (no rich markup or emoji codes: ``state[w]`` and
    ``f.py:1234:fwd`` stay intact). Columns named in ``right`` are right-justified (numbers);
    those in ``fold`` wrap long
    values instead of cutting them; those in ``no_wrap`` (names: call sites, modules) are never
    broken across lines (shorten them first, e.g. with :func:`shorten_site`).

    Example:
        >>> import io
        >>> from rich.console import Console
        >>> buf = io.StringIO()
        >>> Console(file=buf, width=40).print(rich_table("T", ["a", "n"], [["x", "1"]], right={"n"}))
        >>> "┃" in buf.getvalue() and "x" in buf.getvalue()
        True
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_edge=show_edge, pad_edge=pad_edge)
    for h in header:
        table.add_column(
            h, justify="right" if h in right else "left",
            overflow="fold" if h in fold else "ellipsis", no_wrap=h in no_wrap,
        )
    for r in rows:  # as plain Text: a cell's "[...]" or ":1234:" is data, not markup or emoji
        table.add_row(*(Text(c) if isinstance(c, str) else c for c in r))
    return table


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: int = 0) -> str:
    """Columns padded to their widest cell, two spaces apart, trailing spaces removed.

    The first ``right`` columns are right-justified (numbers); cells are never cut or wrapped.

    Example:
        >>> plain_table(["a", "b"], [["xyz", "1"]]).splitlines()
        ['a    b', 'xyz  1']
        >>> plain_table(["n", "name"], [["10", "x"], ["2", "y"]], right=1).splitlines()
        [' n  name', '10  x', ' 2  y']
    """
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i < right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), *map(line, rows)])


def shorten_site(site: str, width: int = 60) -> str:
    """Shorten a ``"path:line:function"`` call site to about ``width`` characters for a table.

    Leading folders are dropped first (``.../``), keeping the file's last parts, the line and the
    function; the file name, line and function are never cut, so a name is never split.
    Anything that is not ``path:line:function`` is returned as it is.

    Example:
        >>> shorten_site("/home/me/projects/big-model/src/model/layers/attention.py:212:forward", 42)
        '.../model/layers/attention.py:212:forward'
        >>> shorten_site("/a/very/long/path/to/a_file_with_a_long_name.py:7:f", 10)
        '.../a_file_with_a_long_name.py:7:f'
        >>> shorten_site("train.py:3:main", 5)
        'train.py:3:main'
    """
    if len(site) <= width:
        return site
    parts = site.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return site
    path, line, func = parts
    folders = path.replace("\\", "/").split("/")
    tail = f":{line}:{func}"
    keep = [folders[-1]]
    for folder in reversed(folders[:-1]):
        if len(".../" + folder + "/" + "/".join(keep) + tail) > width:
            break
        keep.insert(0, folder)
    short = "/".join(keep) + tail
    return short if len(keep) == len(folders) else ".../" + short


def signed_bytes(n: int) -> str:
    """A byte change with its sign: ``+3.00 GiB``, ``-512 B``, ``0 B``.

    Example:
        >>> signed_bytes(3 * 1024**3), signed_bytes(-512), signed_bytes(0)
        ('+3.00 GiB', '-512 B', '0 B')
    """
    from torchmem.units import format_bytes

    return ("+" if n > 0 else "") + format_bytes(n)
