"""torchmem: make PyTorch memory visible and manageable.

The public surface is listed in ``__all__`` and loaded lazily, so ``import torchmem`` stays cheap
and does not import optional pieces (plots, the HTML viewer) until they are used.

Example:
    >>> import torch, torchmem
    >>> w = torch.zeros(256, 256)
    >>> torchmem.unique_bytes([w, w.t()])           # shared storage counted once
    {'cpu': 262144}
    >>> torchmem.format_bytes(262144)
    '256.00 KiB'
"""

from __future__ import annotations

import importlib
from typing import Any

from torchmem._version import __version__

# name -> module that defines it. Each area keeps its own block.
_EXPORTS: dict[str, str] = {
    # errors and units
    "TorchmemError": "torchmem.errors",
    "InvalidInputError": "torchmem.errors",
    "UnsupportedTensorError": "torchmem.errors",
    "DeviceError": "torchmem.errors",
    "FileFormatError": "torchmem.errors",
    "TraceFormatError": "torchmem.errors",
    "SnapshotFormatError": "torchmem.errors",
    "UnsafePickleError": "torchmem.errors",
    "MoveError": "torchmem.errors",
    "TransferError": "torchmem.errors",
    "ObjectLoadError": "torchmem.errors",
    "format_bytes": "torchmem.units",
    "parse_bytes": "torchmem.units",
    # storage model (issue 2)
    "Span": "torchmem.storage",
    "storage_of": "torchmem.storage",
    "storage_id": "torchmem.storage",
    "storage_ref": "torchmem.storage",
    "storage_nbytes": "torchmem.storage",
    "tensor_span": "torchmem.storage",
    "same_storage": "torchmem.storage",
    "overlaps": "torchmem.storage",
    "unique_bytes": "torchmem.storage",
    "storage_bytes": "torchmem.storage",
    # BEGIN issue-2 exports (inspect, move, torchlinops compat)
    "inspect_memory": "torchmem.inspect",
    "MemoryReport": "torchmem.model.report",
    "TensorRecord": "torchmem.model.report",
    "StorageRecord": "torchmem.model.report",
    "MovePlan": "torchmem.model.report",
    "render_report": "torchmem.report.table",
    "memory_aware_to": "torchmem.move",
    "memory_aware_deepcopy": "torchmem.move",
    "plan_move": "torchmem.move",
    "MemReporter": "torchmem.compat",
    "get_device": "torchmem.compat",
    "device_ordinal": "torchmem.compat",
    "cdata": "torchmem.compat",
    "tensor_memory_span": "torchmem.compat",
    "build_example": "torchmem.examples",
    "list_examples": "torchmem.examples",
    # END issue-2 exports
    # BEGIN issue-3 exports (tracking)
    "track": "torchmem.tracking.tracker",
    "Tracker": "torchmem.tracking.tracker",
    "Trace": "torchmem.model.trace",
    "load_trace": "torchmem.model.trace",
    "MemoryTracker": "torchmem.tracking.compat",
    "summarize_trace": "torchmem.analysis.tracking",
    "TraceSummary": "torchmem.analysis.tracking",
    "track_lite": "torchmem.tracking.lite",
    "LiteTracker": "torchmem.tracking.lite",
    # END issue-3 exports
    # BEGIN issue-4 exports (ledger, devices)
    "Ledger": "torchmem.ledger",
    "LedgerRecord": "torchmem.ledger",
    "GcRun": "torchmem.ledger",
    "DEFAULT_AUTO_GC_STRATEGY": "torchmem.ledger",
    "release_device_cache": "torchmem.ledger",
    "DeviceUsage": "torchmem.devices",
    "UsageSource": "torchmem.devices",
    "UsagePoller": "torchmem.devices",
    "available_devices": "torchmem.devices",
    "poll_usage": "torchmem.devices",
    "poll_all": "torchmem.devices",
    "ledger_metrics": "torchmem.metrics",
    "serve_prometheus": "torchmem.metrics",
    "MetricsServer": "torchmem.metrics",
    # END issue-4 exports
    # BEGIN issue-5 exports (snapshots, viewer)
    "Snapshot": "torchmem.model.snapshot",
    "snapshot_from_events": "torchmem.model.snapshot",
    "load_snapshot": "torchmem.snapshots.reader",
    "write_snapshot": "torchmem.snapshots.writer",
    "dump_snapshot": "torchmem.snapshots.writer",
    "record_history": "torchmem.snapshots.record",
    "start_recording": "torchmem.snapshots.record",
    "stop_recording": "torchmem.snapshots.record",
    "snapshot": "torchmem.snapshots.record",
    "oom_guard": "torchmem.snapshots.record",
    "snapshot_stats": "torchmem.analysis.snapshot",
    "snapshot_peak": "torchmem.analysis.snapshot",
    "snapshot_diff": "torchmem.analysis.snapshot",
    "snapshot_trace": "torchmem.analysis.snapshot",
    "folded_stacks": "torchmem.analysis.snapshot",
    "oom_report": "torchmem.analysis.snapshot",
    # END issue-5 exports
    # BEGIN issue-6 exports (transfer)
    "ToDevice": "torchmem.transfer",
    "DeviceSpec": "torchmem.transfer",
    "Chain": "torchmem.transfer",
    "Identity": "torchmem.transfer",
    "LinearOp": "torchmem.transfer",
    "Operator": "torchmem.transfer",
    "adjoint_of": "torchmem.transfer",
    "StagingBuffers": "torchmem.transfer",
    "TransferResult": "torchmem.transfer",
    "PendingTransfer": "torchmem.transfer",
    "OffloadResult": "torchmem.transfer",
    "transfer": "torchmem.transfer",
    "transfer_async": "torchmem.transfer",
    "chunked_transfer": "torchmem.transfer",
    "transfer_module": "torchmem.transfer",
    "offload_forward": "torchmem.transfer",
    "transfer_stream": "torchmem.transfer",
    # END issue-6 exports
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
