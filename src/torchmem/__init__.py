"""torchmem: make PyTorch memory visible and manageable.

The top level holds the names most users need; everything else lives in a namespace named for
what it is (see ``ARCHITECTURE.md``):

==========================  ================================================================
``torchmem.capture``        storage identity, the census, trackers, allocator recording
``torchmem.model``          plain data: events, traces, snapshots, census reports
``torchmem.io``             file formats: snapshots (every PyTorch version) and ``.tmtrace``
``torchmem.analysis``       pure functions over traces and snapshots (peak, diff, oom, ...)
``torchmem.render``         text tables, timeline plots, the offline HTML viewer
``torchmem.sim``            PyTorch's CUDA caching allocator, simulated (no torch, no GPU)
``torchmem.fit``            will it fit? ``estimate`` a step, ``estimate_hf`` a model config
``torchmem.ledger``         allocate/free accounting, auto-GC policy, monitoring figures
``torchmem.devices``        device capacity and usage polling
``torchmem.transfer``       ``ToDevice`` and pipelined transfers between devices
``torchmem.compat``         drop-in names for torchlinops and PyTorch's ``MemoryTracker``
``torchmem.errors``         the exception tree; ``torchmem.units``: byte formatting
==========================  ================================================================

Names are loaded lazily, so ``import torchmem`` stays cheap. Names of torchmem 0.1 that moved into
a namespace still resolve here for one release, with a :class:`DeprecationWarning` that names the
new place.

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
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

from torchmem._lazy import MISSING, load_export
from torchmem._version import __version__

if TYPE_CHECKING:  # the same names, statically, so that type checkers see real types
    from torchmem.capture import (
        Span,
        Tracker,
        host_memory,
        inspect_memory,
        oom_guard,
        record_history,
        same_storage,
        snapshot,
        storage_bytes,
        storage_id,
        tensor_span,
        track,
        track_lite,
        unique_bytes,
        why_alive,
    )
    from torchmem.devices import UsagePoller, available_devices, poll_usage
    from torchmem.errors import (
        DeviceError,
        FileFormatError,
        InvalidInputError,
        MissingFileError,
        TorchmemError,
    )
    from torchmem.fit import Estimate, estimate, estimate_hf, estimate_script
    from torchmem.io import load_snapshot, load_trace, write_snapshot
    from torchmem.ledger import Ledger
    from torchmem.model import MemoryReport, Snapshot, Trace
    from torchmem.move import memory_aware_deepcopy, memory_aware_to, plan_move
    from torchmem.render import render_report, write_viewer
    from torchmem.transfer import DeviceSpec, ToDevice, chunked_transfer, offload_forward
    from torchmem.units import format_bytes, parse_bytes

# name -> the namespace that defines it (the public home of each name).
_EXPORTS: dict[str, str] = {
    # errors and units
    "TorchmemError": "torchmem.errors",
    "InvalidInputError": "torchmem.errors",
    "DeviceError": "torchmem.errors",
    "FileFormatError": "torchmem.errors",
    "MissingFileError": "torchmem.errors",
    "format_bytes": "torchmem.units",
    "parse_bytes": "torchmem.units",
    # storage identity and the census
    "Span": "torchmem.capture",
    "storage_id": "torchmem.capture",
    "tensor_span": "torchmem.capture",
    "same_storage": "torchmem.capture",
    "unique_bytes": "torchmem.capture",
    "storage_bytes": "torchmem.capture",
    "inspect_memory": "torchmem.capture",
    "MemoryReport": "torchmem.model",
    "render_report": "torchmem.render",
    # moving modules
    "memory_aware_to": "torchmem.move",
    "memory_aware_deepcopy": "torchmem.move",
    "plan_move": "torchmem.move",
    # tracking
    "track": "torchmem.capture",
    "Tracker": "torchmem.capture",
    "track_lite": "torchmem.capture",
    "Trace": "torchmem.model",
    "load_trace": "torchmem.io",
    # allocator snapshots and the viewer
    "Snapshot": "torchmem.model",
    "snapshot": "torchmem.capture",
    "record_history": "torchmem.capture",
    "oom_guard": "torchmem.capture",
    # who holds it
    "why_alive": "torchmem.capture",
    "host_memory": "torchmem.capture",
    "load_snapshot": "torchmem.io",
    "write_snapshot": "torchmem.io",
    "write_viewer": "torchmem.render",
    # will it fit?
    "estimate": "torchmem.fit",
    "estimate_hf": "torchmem.fit",
    "estimate_script": "torchmem.fit",
    "Estimate": "torchmem.fit",
    # the ledger and devices
    "Ledger": "torchmem.ledger",
    "available_devices": "torchmem.devices",
    "poll_usage": "torchmem.devices",
    "UsagePoller": "torchmem.devices",
    # transfers
    "ToDevice": "torchmem.transfer",
    "DeviceSpec": "torchmem.transfer",
    "chunked_transfer": "torchmem.transfer",
    "offload_forward": "torchmem.transfer",
}

# torchmem 0.1 top-level name -> (namespace, name there). Forwarded with a DeprecationWarning
# until torchmem 0.3.
_MOVED: dict[str, tuple[str, str]] = {
    "UnsupportedTensorError": ("torchmem.errors", "UnsupportedTensorError"),
    "TraceFormatError": ("torchmem.errors", "TraceFormatError"),
    "SnapshotFormatError": ("torchmem.errors", "SnapshotFormatError"),
    "UnsafePickleError": ("torchmem.errors", "UnsafePickleError"),
    "MoveError": ("torchmem.errors", "MoveError"),
    "TransferError": ("torchmem.errors", "TransferError"),
    "ObjectLoadError": ("torchmem.errors", "ObjectLoadError"),
    "storage_of": ("torchmem.capture", "storage_of"),
    "storage_ref": ("torchmem.capture", "storage_ref"),
    "storage_nbytes": ("torchmem.capture", "storage_nbytes"),
    "overlaps": ("torchmem.capture", "overlaps"),
    "LiteTracker": ("torchmem.capture", "LiteTracker"),
    "start_recording": ("torchmem.capture", "start_recording"),
    "stop_recording": ("torchmem.capture", "stop_recording"),
    "dump_snapshot": ("torchmem.capture.recording", "dump_snapshot"),
    "TensorRecord": ("torchmem.model", "TensorRecord"),
    "StorageRecord": ("torchmem.model", "StorageRecord"),
    "MovePlan": ("torchmem.model", "MovePlan"),
    "snapshot_from_events": ("torchmem.io", "snapshot_from_events"),
    "TraceSummary": ("torchmem.analysis", "TraceSummary"),
    "summarize_trace": ("torchmem.analysis", "summarize"),
    "snapshot_stats": ("torchmem.analysis", "stats"),
    "snapshot_peak": ("torchmem.analysis", "peak"),
    "snapshot_diff": ("torchmem.analysis", "diff"),
    "snapshot_trace": ("torchmem.analysis", "events"),
    "folded_stacks": ("torchmem.analysis", "flame"),
    "oom_report": ("torchmem.analysis", "oom"),
    "MemReporter": ("torchmem.compat", "MemReporter"),
    "get_device": ("torchmem.compat", "get_device"),
    "device_ordinal": ("torchmem.compat", "device_ordinal"),
    "cdata": ("torchmem.compat", "cdata"),
    "tensor_memory_span": ("torchmem.compat", "tensor_memory_span"),
    "MemoryTracker": ("torchmem.compat", "MemoryTracker"),
    "build_example": ("torchmem.examples", "build_example"),
    "list_examples": ("torchmem.examples", "list_examples"),
    "LedgerRecord": ("torchmem.ledger", "LedgerRecord"),
    "GcRun": ("torchmem.ledger", "GcRun"),
    "DEFAULT_AUTO_GC_STRATEGY": ("torchmem.ledger", "DEFAULT_AUTO_GC_STRATEGY"),
    "release_device_cache": ("torchmem.ledger", "release_device_cache"),
    "ledger_metrics": ("torchmem.ledger", "ledger_metrics"),
    "serve_prometheus": ("torchmem.ledger", "serve_prometheus"),
    "MetricsServer": ("torchmem.ledger", "MetricsServer"),
    "DeviceUsage": ("torchmem.devices", "DeviceUsage"),
    "UsageSource": ("torchmem.devices", "UsageSource"),
    "poll_all": ("torchmem.devices", "poll_all"),
    "Chain": ("torchmem.transfer", "Chain"),
    "Identity": ("torchmem.transfer", "Identity"),
    "LinearOp": ("torchmem.transfer", "LinearOp"),
    "Operator": ("torchmem.transfer", "Operator"),
    "adjoint_of": ("torchmem.transfer", "adjoint_of"),
    "StagingBuffers": ("torchmem.transfer", "StagingBuffers"),
    "TransferResult": ("torchmem.transfer", "TransferResult"),
    "PendingTransfer": ("torchmem.transfer", "PendingTransfer"),
    "OffloadResult": ("torchmem.transfer", "OffloadResult"),
    "transfer_async": ("torchmem.transfer", "transfer_async"),
    "transfer_module": ("torchmem.transfer", "transfer_module"),
    "transfer_stream": ("torchmem.transfer", "transfer_stream"),
}

#: The release that drops the forwarded 0.1 names.
REMOVAL_RELEASE = "0.3"

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    value = load_export(globals(), _EXPORTS, name)
    if value is not MISSING:
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"torchmem.{name}") is not None:
        return importlib.import_module(f"torchmem.{name}")  # a namespace, imported on first use
    moved = _MOVED.get(name)
    if moved is not None:
        where, new_name = moved
        warnings.warn(
            f"torchmem.{name} moved to {where}.{new_name}; the top-level name is forwarded until "
            f"torchmem {REMOVAL_RELEASE}. Fix: use {where}.{new_name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), new_name)
    raise AttributeError(f"module 'torchmem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext torchmem`` in IPython/Jupyter: see :mod:`torchmem.notebook` (loaded only here).

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> load_ipython_extension(InteractiveShell.instance())
        >>> "torchmem" in InteractiveShell.instance().magics_manager.magics["cell"]
        True
    """
    from torchmem.notebook import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext torchmem``: see :mod:`torchmem.notebook`.

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> unload_ipython_extension(InteractiveShell.instance())
    """
    from torchmem.notebook import unload_ipython_extension as unload

    unload(ipython)
