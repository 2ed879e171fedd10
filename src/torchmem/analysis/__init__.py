"""Analyses: pure functions from a snapshot or a trace to result dataclasses (no torch, no I/O).

Snapshot analyses take a :class:`~torchmem.model.snapshot.Snapshot` (load one with
:func:`torchmem.io.load_snapshot`); :func:`summarize` takes a :class:`~torchmem.model.trace.Trace`.
Every result has ``to_dict()`` for JSON; :mod:`torchmem.render` turns them into text.
Trace entries are numbered one way everywhere: ``#N``, the 0-based index of an entry in its
device's trace, as ``torchmem trace`` prints it (``peak_index``, ``TraceSummary.peak_index``,
the viewer's ``#N``).

============  ==================================================  ============================
function      what it answers                                     0.1 name (forwarded to 0.3)
============  ==================================================  ============================
stats         allocator statistics at the end, per device/pool    ``torchmem.snapshot_stats``
peak          the peak of allocated bytes and what was live then  ``torchmem.snapshot_peak``
diff          what grew and shrank between two runs (snapshots    ``torchmem.snapshot_diff``
              or traces), at the peak, the end or a step
events        the trace with running allocated/reserved totals    ``torchmem.snapshot_trace``
flame         folded stacks for flame-graph tools                 ``torchmem.folded_stacks``
oom           out-of-memory entries explained                     ``torchmem.oom_report``
explain_oom   why an OOM happened, the fix, or the closest call   (new)
creep         reserved creeping up over iterations (late OOMs)    (new)
growth        live bytes trending up over iterations (leaks), and (new)
              the call sites and modules that keep growing
gpu_gap       nvidia-smi's used bytes split, each with its source (new)
summarize     a tracker trace's peak, top ops/modules, leaks      ``torchmem.summarize_trace``
merge_ranks   a distributed job's rank traces in one view: per-   (new)
              rank peaks, imbalance, why the heaviest rank differs
============  ==================================================  ============================

Each snapshot analysis is implemented in a private module of its own (``_stats``, ``_peak``,
``_diff``, ``_events``, ``_flame``, ``_oom``), so that the names above are the functions and
nothing else; use them from this namespace.

Everything that replays a snapshot's trace over time goes through one engine,
:mod:`torchmem.analysis.replay` (the HTML viewer's payload uses it too); stack keys and the
filter of PyTorch-internal frames live in :mod:`torchmem.analysis.frames`.

Example:
    >>> import torchmem.analysis as analysis
    >>> from torchmem.io.pytorch_snapshot import from_pytorch
    >>> snap = from_pytorch({"segments": [], "device_traces": [[
    ...     {"action": "alloc", "addr": 0, "size": 64, "stream": 0, "frames": []},
    ...     {"action": "free_completed", "addr": 0, "size": 64, "stream": 0, "frames": []}]]})
    >>> analysis.peak(snap).devices[0].peak_allocated_bytes, analysis.oom(snap)
    (64, [])
"""

from __future__ import annotations

from torchmem.analysis._creep import CreepReport, IterationMemory, creep
from torchmem.analysis._diff import (
    DiffRow,
    GroupDelta,
    IterationDelta,
    SnapshotDiff,
    TraceDiff,
    diff,
)
from torchmem.analysis._events import TraceRow, events
from torchmem.analysis._flame import flame
from torchmem.analysis._gpu_gap import GpuGap, GpuReading, gpu_gap
from torchmem.analysis._growth import GrowingGroup, GrowthReport, LeakTrend, growth, leak_trend
from torchmem.analysis._oom import OomEvent, oom
from torchmem.analysis._peak import DevicePeak, PeakReport, peak
from torchmem.analysis._ranks import (
    Attribution,
    AttributionRow,
    CollectiveRow,
    RankDifference,
    RankMerge,
    RankStats,
    merge_ranks,
    rank_stats,
)
from torchmem.analysis._stats import DeviceStats, PoolStats, SnapshotStats, stats
from torchmem.analysis._why_oom import OomExplanation, explain_oom
from torchmem.analysis.frames import StackGroup
from torchmem.analysis.summary import IterationStat, TraceSummary, summarize

__all__ = [
    "stats",
    "peak",
    "diff",
    "events",
    "flame",
    "oom",
    "explain_oom",
    "creep",
    "gpu_gap",
    "growth",
    "leak_trend",
    "summarize",
    "merge_ranks",
    "rank_stats",
    "SnapshotStats",
    "DeviceStats",
    "PoolStats",
    "PeakReport",
    "DevicePeak",
    "StackGroup",
    "SnapshotDiff",
    "DiffRow",
    "TraceDiff",
    "GroupDelta",
    "IterationDelta",
    "TraceRow",
    "OomEvent",
    "OomExplanation",
    "CreepReport",
    "IterationMemory",
    "GpuReading",
    "GpuGap",
    "TraceSummary",
    "IterationStat",
    "GrowthReport",
    "GrowingGroup",
    "LeakTrend",
    "RankMerge",
    "RankStats",
    "RankDifference",
    "Attribution",
    "AttributionRow",
    "CollectiveRow",
]
