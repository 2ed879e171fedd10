"""Analyses: pure functions from a snapshot or a trace to result dataclasses (no torch, no I/O).

Snapshot analyses take a :class:`~torchmem.model.snapshot.Snapshot` (load one with
:func:`torchmem.io.load_snapshot`); :func:`summarize` takes a :class:`~torchmem.model.trace.Trace`.
Every result has ``to_dict()`` for JSON; :mod:`torchmem.render` turns them into text.

============  ==================================================  ===========================
function      what it answers                                     module (long name)
============  ==================================================  ===========================
stats         allocator statistics at the end, per device/pool    stats (``snapshot_stats``)
peak          the peak of allocated bytes and what was live then  peak (``snapshot_peak``)
diff          what grew and shrank between two snapshots          diff (``snapshot_diff``)
events        the trace with running allocated/reserved totals    events (``snapshot_trace``)
flame         folded stacks for flame-graph tools                 flame (``folded_stacks``)
oom           out-of-memory entries explained                     oom (``oom_report``)
summarize     a tracker trace's peak, top ops/modules, leaks      summary (``summarize_trace``)
============  ==================================================  ===========================

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

from torchmem.analysis.diff import DiffRow, SnapshotDiff, diff
from torchmem.analysis.events import TraceRow, events
from torchmem.analysis.flame import flame
from torchmem.analysis.frames import StackGroup
from torchmem.analysis.oom import OomEvent, oom
from torchmem.analysis.peak import DevicePeak, PeakReport, peak
from torchmem.analysis.stats import DeviceStats, PoolStats, SnapshotStats, stats
from torchmem.analysis.summary import IterationStat, TraceSummary, summarize

__all__ = [
    "stats",
    "peak",
    "diff",
    "events",
    "flame",
    "oom",
    "summarize",
    "SnapshotStats",
    "DeviceStats",
    "PoolStats",
    "PeakReport",
    "DevicePeak",
    "StackGroup",
    "SnapshotDiff",
    "DiffRow",
    "TraceRow",
    "OomEvent",
    "TraceSummary",
    "IterationStat",
]
