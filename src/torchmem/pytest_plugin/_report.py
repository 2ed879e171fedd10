"""What a tracked test body left: the allocations live at a device's peak, and the storages
still alive at the end (for the plugin's failure messages).

Example:
    >>> import torch, torchmem
    >>> with torchmem.track() as tr:
    ...     a = torch.zeros(10)
    >>> [e.nbytes for e in live_at_end(tr.events())]
    [40]
"""

from __future__ import annotations

import os
from typing import Any, Optional

from torchmem.units import format_bytes

__all__ = ["live_at_end", "rows_text", "site_of", "top_live_at_peak"]

_TOP_ROWS = 5


def site_of(ev: Any) -> str:
    """``file.py:line:function`` of an event's innermost recorded frame, or ``"?"``.

    Example:
        >>> from types import SimpleNamespace as E
        >>> site_of(E(stack=("/a/b/test_x.py:12:test_y",))), site_of(E(stack=None))
        ('test_x.py:12:test_y', '?')
    """
    if not ev.stack:
        return "?"
    frame = ev.stack[-1]
    path, _, rest = frame.partition(":")
    return f"{os.path.basename(path)}:{rest}"


def top_live_at_peak(events: Any, device: str, top: int = _TOP_ROWS) -> list[tuple[str, str, str, int, int]]:
    """The largest groups of storages live at ``device``'s peak: ``(op, module, site, bytes,
    count)``, largest first (grouped by operator, module and innermost call site).

    Example:
        >>> import torch, torchmem
        >>> with torchmem.track(stacks=True) as tr:
        ...     a = torch.zeros(1024); b = torch.ones(256); del a; c = torch.zeros(64)
        >>> [(op, n, k) for op, _, _, n, k in top_live_at_peak(tr.events(), "cpu")]
        [('aten::zeros', 4096, 1), ('aten::ones', 1024, 1)]
    """
    from torchmem.model.events import EventKind

    evs = [e for e in events if e.device == device and e.kind is not EventKind.MARK]
    live = 0
    peak, peak_i = -1, -1
    for i, e in enumerate(evs):
        live += e.signed_bytes
        if live > peak:
            peak, peak_i = live, i
    alive: dict[int, Any] = {}
    for e in evs[: peak_i + 1]:
        if e.kind is EventKind.ALLOC:
            alive[e.storage] = e
        else:
            alive.pop(e.storage, None)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for e in alive.values():
        key = (e.op or "?", e.module or "-", site_of(e))
        g = groups.setdefault(key, [0, 0])
        g[0] += e.nbytes
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
    return [(k[0], k[1], k[2], v[0], v[1]) for k, v in rows]


def live_at_end(events: Any, device: Optional[str] = None) -> list[Any]:
    """ALLOC events (on ``device``, or any) whose storage was never freed, largest first.

    Example:
        >>> import torch, torchmem
        >>> keep = []
        >>> with torchmem.track() as tr:
        ...     keep.append(torch.zeros(100)); tmp = torch.ones(5); del tmp
        >>> [(e.op, e.nbytes) for e in live_at_end(tr.events())]
        [('aten::zeros', 400)]
    """
    from torchmem.model.events import EventKind

    alive: dict[int, Any] = {}
    for e in events:
        if device is not None and not _on(e.device, device):
            continue
        if e.kind is EventKind.ALLOC:
            alive[e.storage] = e
        elif e.kind is EventKind.FREE:
            alive.pop(e.storage, None)
    return sorted(alive.values(), key=lambda e: (-e.nbytes, e.seq))


def _on(name: str, selector: str) -> bool:
    return name == selector or (":" not in selector and name.split(":")[0] == selector)


def rows_text(rows: list[tuple[str, str, str, int, int]]) -> list[str]:
    """The failure message's table of :func:`top_live_at_peak` rows.

    Example:
        >>> rows_text([("aten::zeros", "-", "t.py:3:f", 4096, 1)])[1].split()
        ['4.00', 'KiB', '1', 'aten::zeros', '/', '-', '/', 't.py:3:f']
    """
    lines = [f"    {'bytes':>12}  {'count':>5}  operator / module / call site"]
    for op, module, site, nbytes, count in rows:
        lines.append(f"    {format_bytes(nbytes):>12}  {count:>5}  {op} / {module} / {site}")
    return lines
