"""The live panel of ``torchmem run --live``, drawn from plain data (no torch).

The producer (``torchmem.cli._live``: a tracker listener and the host-memory sampler) fills a
:class:`LiveState`; :func:`live_panel` turns it into a rich renderable, which a rich ``Live``
redraws at most twice a second; :func:`live_text` draws it to a string (tests, logs).

Per device: live and peak bytes, by category (live now, and live at the peak), the iteration
count (step markers), the growth of the last iterations and a leak warning when the live bytes
at iteration ends trend upwards (the rule of :func:`torchmem.analysis.leak_trend`, which
:func:`torchmem.analysis.summarize` applies too: warm-up excluded, a robust slope above the
loop's own noise); then host memory per process (the script and its
DataLoader workers); on a CUDA device also the caching allocator's allocated and reserved
bytes (what ``nvidia-smi`` counts, less the CUDA context). While the run goes, categories are the tracker's provisional ones (by phase:
forward -> activation, backward and optimizer -> temporary); the final panel has the final ones.

Example:
    >>> dev = DeviceLive("cpu", live=3072, peak=4096, live_by_category={"parameter": 3072},
    ...                  peak_by_category={"parameter": 3072, "activation": 1024},
    ...                  iterations=2, growth=[1024, 0])
    >>> text = live_text(LiveState("train.py", 1.5, [dev]), width=80)
    >>> "peak 4.00 KiB" in text and "iterations 2" in text
    True
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional

from torchmem.analysis._growth import LeakTrend, leak_trend
from torchmem.render.text import signed_bytes
from torchmem.units import format_bytes

__all__ = ["DeviceLive", "HostRow", "LiveState", "leak_suspected", "live_panel", "live_text"]

#: How many of the latest iterations' growths the panel lists.
GROWTH_SHOWN = 5


def _trend(growth: list[int]) -> LeakTrend:
    ends = list(accumulate(growth))  # the rule reads differences: any starting level will do
    return leak_trend(ends)


def leak_suspected(growth: list[int]) -> bool:
    """The summary's rule (:func:`torchmem.analysis.leak_trend`) on the complete iterations'
    retained growths: the live bytes at iteration ends trend upwards after the warm-up.

    Example:
        >>> leak_suspected([4096, 8, 8]), leak_suspected([4096, 8, 0]), leak_suspected([4096, 8])
        (True, False, False)
    """
    return _trend(growth).leak


@dataclass
class DeviceLive:
    """One device's figures now (bytes); ``growth`` is each complete iteration's retained growth.

    Example:
        >>> DeviceLive("cuda:0", 10, 20, {}, {}, 3, [5, 5, 5]).leak
        True
    """

    device: str
    live: int
    peak: int
    live_by_category: dict[str, int]
    peak_by_category: dict[str, int]
    iterations: int
    growth: list[int] = field(default_factory=list)
    allocator: Optional[tuple[int, int]] = None  # CUDA: the allocator's (allocated, reserved)

    @property
    def leak(self) -> bool:
        """Whether :func:`leak_suspected` says so for ``growth``.

        Example:
            >>> DeviceLive("cpu", 0, 0, {}, {}, 0).leak
            False
        """
        return leak_suspected(self.growth)


@dataclass(frozen=True)
class HostRow:
    """One process of the tree: pid, role (main, worker, other), RSS, USS and USS growth.

    Example:
        >>> HostRow(7, "worker", 300, 200, 150).uss_growth
        150
    """

    pid: int
    role: str
    rss: int
    uss: int
    uss_growth: int


@dataclass
class LiveState:
    """What the panel shows: the run's label, seconds elapsed, devices, host processes.

    Example:
        >>> LiveState("train.py", 0.0, []).final
        False
    """

    label: str
    elapsed_s: float
    devices: list[DeviceLive]
    host: list[HostRow] = field(default_factory=list)
    final: bool = False


def live_panel(state: LiveState) -> Any:
    """The panel as a rich renderable.

    Example:
        >>> from rich.panel import Panel
        >>> isinstance(live_panel(LiveState("x.py", 0.0, [])), Panel)
        True
    """
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    if not state.devices:
        parts.append(Text("no tensor allocated yet"))
    for dev in state.devices:
        head = (f"{dev.device}: live {format_bytes(dev.live)}   peak {format_bytes(dev.peak)}   "
                f"iterations {dev.iterations}")
        parts.append(Text(head, style="bold"))
        if dev.allocator is not None:
            allocated, reserved = dev.allocator
            parts.append(Text(f"allocator: allocated {format_bytes(allocated)}, reserved "
                              f"{format_bytes(reserved)} (tensors, workspaces and cache)"))
        if dev.growth:
            shown = ", ".join(signed_bytes(g) for g in dev.growth[-GROWTH_SHOWN:])
            parts.append(Text(f"growth per iteration (latest last): {shown}"))
        table = Table(show_edge=False, pad_edge=False, box=None)
        for name in ("category", "live", "at peak"):
            table.add_column(name, justify="left" if name == "category" else "right")
        names = sorted(set(dev.live_by_category) | set(dev.peak_by_category),
                       key=lambda c: -dev.peak_by_category.get(c, 0))
        for cat in names:
            live, at_peak = dev.live_by_category.get(cat, 0), dev.peak_by_category.get(cat, 0)
            if live or at_peak:
                table.add_row(cat, format_bytes(live), format_bytes(at_peak))
        parts.append(table)
        if dev.leak:
            trend = _trend(dev.growth)
            parts.append(Text(
                f"leak suspected on {dev.device}: +{format_bytes(trend.bytes_per_iteration)} per "
                f"iteration since iteration {trend.start} ({signed_bytes(dev.growth[-1])} latest)",
                style="bold red"))
    if state.host:
        host = Table(title="host memory", title_justify="left", show_edge=False,
                     pad_edge=False, box=None)
        for name in ("pid", "role", "RSS", "USS", "USS growth"):
            host.add_column(name, justify="left" if name in ("pid", "role") else "right")
        for row in state.host:
            host.add_row(str(row.pid), row.role, format_bytes(row.rss), format_bytes(row.uss),
                         signed_bytes(row.uss_growth))
        parts += [Text(""), host]
    title = f"torchmem run --live: {state.label}  ({state.elapsed_s:.1f} s)"
    if state.final:
        title += "  final"
    return Panel(Group(*parts), title=title, title_align="left")


def live_text(state: LiveState, width: int = 100) -> str:
    """The panel drawn as plain text ``width`` columns wide.

    Example:
        >>> print(live_text(LiveState("x.py", 2.0, [], [HostRow(1, "main", 2048, 1024, 0)]), 50))
        ╭─ torchmem run --live: x.py  (2.0 s) ───────────╮
        │ no tensor allocated yet                        │
        │                                                │
        │ host memory                                    │
        │ pid  role       RSS       USS  USS growth      │
        │ 1    main  2.00 KiB  1.00 KiB         0 B      │
        ╰────────────────────────────────────────────────╯
    """
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(
        live_panel(state))
    return buf.getvalue().rstrip("\n")
