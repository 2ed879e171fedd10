"""Timeline PNG of a trace: live bytes stacked by category, with phase bands and step lines.

matplotlib is an optional extra (``pip install 'torchmem[plot]'``); it is imported only when a
plot is drawn, with the Agg backend (no display needed). No torch import here.

Example:
    >>> import os, tempfile
    >>> from torchmem.model.trace import Trace
    >>> from torchmem.model.events import EventKind as K, Category as C, Phase as P
    >>> tr = Trace()
    >>> _ = tr.append(K.ALLOC, 0, "cpu", 4096, 1, category=C.PARAMETER)
    >>> _ = tr.append(K.ALLOC, 1_000_000, "cpu", 8192, 2, phase=P.FORWARD, category=C.ACTIVATION)
    >>> _ = tr.append(K.FREE, 2_000_000, "cpu", 8192, 2, phase=P.BACKWARD)
    >>> _ = tr.append(K.MARK, 3_000_000, "cpu", 0, 0, op="step")
    >>> path = os.path.join(tempfile.mkdtemp(), "t.png")
    >>> plot_timeline(tr, path) == path and open(path, "rb").read(4) == b"\\x89PNG"
    True
"""

from __future__ import annotations

import os
from typing import Any

from torchmem.analysis.series import category_series
from torchmem.errors import InvalidInputError
from torchmem.model.events import Category, EventKind, Phase
from torchmem.model.trace import Trace
from torchmem.units import format_bytes

__all__ = ["plot_timeline", "MissingPlotDependency"]

_COLORS = {
    "parameter": "#4c72b0",
    "buffer": "#64b5cd",
    "gradient": "#dd8452",
    "optimizer_state": "#8172b3",
    "activation": "#55a868",
    "input": "#937860",
    "temporary": "#c44e52",
    "communication": "#da8bc3",
    "other": "#8c8c8c",
}
_ORDER = [
    "parameter",
    "buffer",
    "optimizer_state",
    "gradient",
    "input",
    "activation",
    "temporary",
    "communication",
    "other",
]
_PHASE_COLORS = {
    int(Phase.FORWARD): "#17becf",
    int(Phase.BACKWARD): "#e377c2",
    int(Phase.OPTIMIZER): "#bcbd22",
}


class MissingPlotDependency(InvalidInputError):
    """matplotlib is not installed.

    Example:
        >>> issubclass(MissingPlotDependency, InvalidInputError)
        True
    """


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MissingPlotDependency(
            "plotting needs matplotlib, which is not installed; install the optional extra: "
            "pip install 'torchmem[plot]'"
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(
    trace: Trace,
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    title: str | None = None,
    max_points: int = 4000,
    x: str = "event",
) -> str:
    """Draw live bytes over time stacked by category and write a PNG to ``path``.

    Forward, backward and optimizer phases are shaded bands along the bottom; step markers are
    dashed vertical lines; the peak is annotated. ``x="event"`` (default) spaces events evenly
    (iterations look alike even when the first one is slow); ``x="time"`` uses wall time in ms.
    Returns the path written.

    Example:
        >>> from torchmem.model.trace import Trace
        >>> plot_timeline(Trace(), "/tmp/x.png")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: the trace has no allocations to plot...
    """
    if not any(k == int(EventKind.ALLOC) for k in trace.kind):
        raise InvalidInputError(
            "the trace has no allocations to plot; record a run with torchmem.track() or "
            "'torchmem run' first"
        )
    if x not in ("event", "time"):
        raise InvalidInputError(f"x must be 'event' or 'time', got {x!r}")
    plt = _pyplot()
    seqs, times, series, phases = category_series(trace, device, max_points=max_points)
    by_time = x == "time"
    xs = [t / 1e6 for t in times] if by_time else [float(q) for q in seqs]
    totals = [sum(v[i] for v in series.values()) for i in range(len(xs))]
    peak = max(totals) if totals else 0
    scale, unit = _unit(peak)
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    try:
        labels = [c for c in _ORDER if any(series.get(c, []))]
        ys = [[b / scale for b in series[c]] for c in labels]
        if labels:
            ax.stackplot(
                xs,
                *ys,
                labels=[c.replace("_", " ") for c in labels],
                colors=[_COLORS[c] for c in labels],
                step="post",
                alpha=0.9,
            )
        top = peak / scale if peak else 1.0
        # phase bands along the bottom
        band = top * 0.03
        start = 0
        for i in range(1, len(xs) + 1):
            if i == len(xs) or phases[i] != phases[start]:
                col = _PHASE_COLORS.get(phases[start])
                if col is not None:
                    x1 = xs[i] if i < len(xs) else xs[-1]
                    ax.axvspan(xs[start], x1, ymin=0, ymax=0.025, color=col, lw=0)
                start = i
        # step markers
        steps = [
            (trace.time_ns[i] / 1e6 if by_time else float(i))
            for i in range(len(trace))
            if trace.kind[i] == int(EventKind.MARK) and trace.strings[trace.op[i]] == "step"
        ]
        for j, sx in enumerate(steps):
            ax.axvline(sx, color="black", ls="--", lw=0.8, alpha=0.6,
                       label="step" if j == 0 else None)
        if totals:
            ipk = max(range(len(totals)), key=totals.__getitem__)
            ax.annotate(
                f"peak {format_bytes(peak)}",
                (xs[ipk], totals[ipk] / scale),
                xytext=(10, 8),
                textcoords="offset points",
                fontsize=9,
            )
        for code, col in _PHASE_COLORS.items():
            ax.plot([], [], color=col, lw=6, label=f"{Phase(code).label} phase")
        dev = device or _dev(trace)
        ax.set_title(title or f"torchmem: live tensor memory on {dev} by category")
        ax.set_xlabel("time (ms)" if by_time else "event number")
        ax.set_ylabel(f"live bytes ({unit})")
        ax.set_ylim(-band, top * 1.12)
        if xs:
            x0 = next((x for x, tot in zip(xs, totals) if tot > 0 or x > 0), xs[0])
            x1 = max(xs[-1], steps[-1] if steps else xs[-1])
            pad = (x1 - x0) * 0.01 or 1.0
            ax.set_xlim(x0 - pad, x1 + pad)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.85)
        ax.grid(alpha=0.25)
        fig.tight_layout()
        out = os.fspath(path)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def _dev(trace: Trace) -> str:
    peaks = trace.peak()
    return max(peaks, key=peaks.__getitem__) if peaks else "cpu"


def _unit(peak: int) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if peak >= scale:
            return float(scale), unit
    return 1.0, "B"


assert set(_COLORS) == {c.label for c in Category}
