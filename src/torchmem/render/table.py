"""Render a :class:`~torchmem.model.census.MemoryReport` as a rich table, plain text or JSON.

A consumer: reads the plain report, never torch. Sections: per-device totals (unique bytes,
storage bytes, the naive sum that ignores sharing), bytes per category, the tensors (largest
first, ``top`` of them), and the storages shared between names.

Example:
    >>> import io
    >>> from torchmem.model.census import MemoryReport, StorageRecord, TensorRecord
    >>> t = TensorRecord("w", "parameter", "cpu", "float32", (4, 4), (4, 1), 0, 4, 0, 64, 0,
    ...                  aliases=["head.w"])
    >>> r = MemoryReport([t], [StorageRecord(0, "cpu", 64, 64, ["w", "head.w"], ["parameter"])])
    >>> buf = io.StringIO(); render(r, buf, fmt="plain")
    >>> print(buf.getvalue().splitlines()[2])
    cpu     64 B    64 B           64 B       1         1
"""

from __future__ import annotations

import sys
from typing import IO, Any

from torchmem.errors import InvalidInputError
from torchmem.model.census import MemoryReport
from torchmem.render.text import plain_table, rich_table
from torchmem.units import format_bytes

__all__ = ["render", "render_report", "FORMATS"]

FORMATS = ("rich", "plain", "json")
_NUMERIC = ("unique", "storage bytes", "naive sum", "bytes", "size", "used", "#tensors", "#storages")


def _fmt(n: int, decimal: bool) -> str:
    return format_bytes(n, decimal=decimal)


def _sections(report: MemoryReport, top: int | None, decimal: bool) -> list[tuple[str, list[str], list[list[str]]]]:
    out: list[tuple[str, list[str], list[list[str]]]] = []
    ub, sb, nb = report.unique_bytes, report.storage_bytes, report.naive_bytes
    n_t: dict[str, int] = {}
    n_s: dict[str, int] = {}
    for t in report.tensors:
        n_t[t.device] = n_t.get(t.device, 0) + 1
    for s in report.storages:
        n_s[s.device] = n_s.get(s.device, 0) + 1
    rows = [
        [d, _fmt(ub.get(d, 0), decimal), _fmt(sb.get(d, 0), decimal), _fmt(nb.get(d, 0), decimal),
         str(n_t.get(d, 0)), str(n_s.get(d, 0))]
        for d in report.devices
    ]
    out.append(("Devices", ["device", "unique", "storage bytes", "naive sum", "#tensors", "#storages"], rows))
    rows = []
    for dev, cats in report.by_category.items():
        for cat, n in cats.items():
            rows.append([dev, cat, _fmt(n, decimal)])
    out.append(("By category (shared storage counted once)", ["device", "category", "unique"], rows))
    tensors = sorted(report.tensors, key=lambda t: (-t.nbytes, t.name))
    shown = tensors if top is None else tensors[:top]
    shared_storages = {s.index for s in report.storages if s.shared}
    rows = [
        [t.name + (f" (= {', '.join(t.aliases)})" if t.aliases else ""), t.category, t.device,
         t.dtype, "x".join(map(str, t.shape)) or "()", _fmt(t.nbytes, decimal),
         f"#{t.storage}" + (" shared" if t.storage in shared_storages else "")]
        for t in shown
    ]
    title = "Tensors" if len(shown) == len(tensors) else f"Tensors (largest {len(shown)} of {len(tensors)})"
    out.append((title, ["name", "category", "device", "dtype", "shape", "bytes", "storage"], rows))
    rows = [
        [f"#{s.index}", s.device, _fmt(s.nbytes, decimal), _fmt(s.used_bytes, decimal), ", ".join(s.names)]
        for s in report.storages if s.shared
    ]
    out.append(("Shared storages", ["storage", "device", "size", "used", "names"], rows))
    return out


def _plain(sections: list[tuple[str, list[str], list[list[str]]]], report: MemoryReport, file: IO[str]) -> None:
    for title, header, rows in sections:
        print(f"== {title}", file=file)
        if not rows:
            print("(none)", file=file)
            print(file=file)
            continue
        print(plain_table(header, rows), file=file)
        print(file=file)
    if report.skipped:
        kinds = ", ".join(f"{k}: {v}" for k, v in report.skipped_kinds.items())
        print(f"skipped {report.skipped} unmeasurable tensor(s) ({kinds})", file=file)


def _rich(sections: list[tuple[str, list[str], list[list[str]]]], report: MemoryReport, file: IO[str]) -> None:
    from rich.console import Console

    console = Console(file=file, width=120 if not getattr(file, "isatty", lambda: False)() else None)
    for title, header, rows in sections:
        if rows:
            console.print(rich_table(title, header, rows, right=_NUMERIC, fold=header))
    if report.skipped:
        kinds = ", ".join(f"{k}: {v}" for k, v in report.skipped_kinds.items())
        console.print(f"skipped {report.skipped} unmeasurable tensor(s) ({kinds})")


def render(
    report: MemoryReport,
    file: IO[str] | None = None,
    fmt: str = "rich",
    *,
    top: int | None = 50,
    decimal: bool = False,
) -> None:
    """Write ``report`` to ``file`` (default stdout) as ``"rich"``, ``"plain"`` or ``"json"``.

    ``top`` limits the tensor rows (largest first; ``None`` shows all); ``decimal=True`` prints
    kB/MB/GB (base 1000) instead of KiB/MiB/GiB (base 1024).

    Example:
        >>> import io
        >>> from torchmem.model.census import MemoryReport
        >>> buf = io.StringIO(); render(MemoryReport(), buf, fmt="json")
        >>> buf.getvalue().startswith('{')
        True
    """
    if fmt not in FORMATS:
        raise InvalidInputError(f"fmt should be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not isinstance(report, MemoryReport):
        raise InvalidInputError(f"expected a MemoryReport, got {type(report).__name__}")
    out: Any = sys.stdout if file is None else file
    if fmt == "json":
        out.write(report.to_json() + "\n")
        return
    sections = _sections(report, top, decimal)
    if fmt == "plain":
        _plain(sections, report, out)
    else:
        _rich(sections, report, out)


#: Alias exported as ``torchmem.render_report``.
render_report = render
