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
    "Span": "torchmem.capture.storage",
    "storage_of": "torchmem.capture.storage",
    "storage_id": "torchmem.capture.storage",
    "storage_ref": "torchmem.capture.storage",
    "storage_nbytes": "torchmem.capture.storage",
    "tensor_span": "torchmem.capture.storage",
    "same_storage": "torchmem.capture.storage",
    "overlaps": "torchmem.capture.storage",
    "unique_bytes": "torchmem.capture.storage",
    "storage_bytes": "torchmem.capture.storage",
    # BEGIN issue-2 exports (inspect, move, torchlinops compat)
    "inspect_memory": "torchmem.capture.census",
    "MemoryReport": "torchmem.model.census",
    "TensorRecord": "torchmem.model.census",
    "StorageRecord": "torchmem.model.census",
    "MovePlan": "torchmem.model.census",
    "render_report": "torchmem.render.table",
    "memory_aware_to": "torchmem.move",
    "memory_aware_deepcopy": "torchmem.move",
    "plan_move": "torchmem.move",
    "MemReporter": "torchmem.compat.torchlinops",
    "get_device": "torchmem.compat.torchlinops",
    "device_ordinal": "torchmem.compat.torchlinops",
    "cdata": "torchmem.compat.torchlinops",
    "tensor_memory_span": "torchmem.compat.torchlinops",
    "build_example": "torchmem.examples",
    "list_examples": "torchmem.examples",
    # END issue-2 exports
    # BEGIN issue-3 exports (tracking)
    "track": "torchmem.capture.tracker",
    "Tracker": "torchmem.capture.tracker",
    "Trace": "torchmem.model.trace",
    "load_trace": "torchmem.model.trace",
    "MemoryTracker": "torchmem.compat.memtracker",
    "summarize_trace": "torchmem.analysis.tracking",
    "TraceSummary": "torchmem.analysis.tracking",
    "track_lite": "torchmem.capture.lite",
    "LiteTracker": "torchmem.capture.lite",
    # END issue-3 exports
    # BEGIN issue-4 exports (ledger, devices)
    "Ledger": "torchmem.ledger.accounting",
    "LedgerRecord": "torchmem.ledger.records",
    "GcRun": "torchmem.ledger.autogc",
    "DEFAULT_AUTO_GC_STRATEGY": "torchmem.ledger.autogc",
    "release_device_cache": "torchmem.ledger.release",
    "DeviceUsage": "torchmem.devices",
    "UsageSource": "torchmem.devices",
    "UsagePoller": "torchmem.devices",
    "available_devices": "torchmem.devices",
    "poll_usage": "torchmem.devices",
    "poll_all": "torchmem.devices",
    "ledger_metrics": "torchmem.ledger.metrics",
    "serve_prometheus": "torchmem.ledger.metrics",
    "MetricsServer": "torchmem.ledger.metrics",
    # END issue-4 exports
    # BEGIN issue-5 exports (snapshots, viewer)
    "Snapshot": "torchmem.model.snapshot",
    "snapshot_from_events": "torchmem.model.snapshot",
    "load_snapshot": "torchmem.io.snapshot_file",
    "write_snapshot": "torchmem.io.snapshot_file",
    "dump_snapshot": "torchmem.capture.recording",
    "record_history": "torchmem.capture.recording",
    "start_recording": "torchmem.capture.recording",
    "stop_recording": "torchmem.capture.recording",
    "snapshot": "torchmem.capture.recording",
    "oom_guard": "torchmem.capture.recording",
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
