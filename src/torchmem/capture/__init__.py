"""Producers that watch torch: storage identity, the census, the trackers and allocator recording.

- :mod:`~torchmem.capture.storage`: storage identity, spans, overlap and deduplicated bytes.
- :mod:`~torchmem.capture.census`: :func:`inspect_memory`, the census of modules, optimizers and
  live tensors.
- :mod:`~torchmem.capture.tracker` (a package): :func:`track`, the dispatch-mode tracker (ops,
  modules, phases, categories, call sites); its docstring is the contract the rest of torchmem
  codes against, and it says which private module holds which part.
- :mod:`~torchmem.capture.retention`: :func:`why_alive`, the chains of references that keep a
  tensor's memory alive.
- :mod:`~torchmem.capture.host`: :func:`host_memory` and :class:`HostSampler`, RSS/USS/PSS of
  the process tree (DataLoader workers included).
- :mod:`~torchmem.capture.lite`: :func:`track_lite`, the profiler-based cheap tracker.
- :mod:`~torchmem.capture.fast`: :class:`FastTracker`, ``track(..., mode="fast")``: allocator-level
  capture in C++ with the dispatch tracker's attribution.
- :mod:`~torchmem.capture.recording`: :func:`record_history`, :func:`snapshot`, :func:`oom_guard`
  (PyTorch's CUDA allocator history; the tracker on other devices); :func:`start_recording` and
  :func:`stop_recording` are aliases of ``record_history(...).start()`` and ``.stop()``.

Everything here imports torch; the data it produces lives in :mod:`torchmem.model`, and it is
written to files by :mod:`torchmem.io`. Nothing here prints reports: :mod:`torchmem.render` and
the CLI do.

Example:
    >>> import torch
    >>> from torchmem.capture import track
    >>> with track() as tr:
    ...     _ = torch.ones(4)
    >>> tr.peak()
    {'cpu': 16}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchmem._lazy import MISSING, load_export

if TYPE_CHECKING:  # the same names, statically, for type checkers
    from torchmem.capture.census import inspect_memory
    from torchmem.capture.fast import FastTracker
    from torchmem.capture.host import HostSampler, host_memory
    from torchmem.capture.lite import LiteTracker, track_lite
    from torchmem.capture.recording import (
        is_oom_error,
        oom_guard,
        record_history,
        snapshot,
        start_recording,
        stop_recording,
    )
    from torchmem.capture.retention import RetentionPath, RetentionPaths, why_alive
    from torchmem.capture.storage import (
        Span,
        overlaps,
        same_storage,
        storage_bytes,
        storage_id,
        storage_nbytes,
        storage_of,
        storage_ref,
        tensor_span,
        unique_bytes,
    )
    from torchmem.capture.tracker import Listener, Tracker, track

# name -> the module that defines it; imported on first use, so that importing one module of
# this package (capture.storage, which the ledger, move and transfer use) loads nothing else.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["inspect_memory"], "torchmem.capture.census"),
    **dict.fromkeys(["LiteTracker", "track_lite"], "torchmem.capture.lite"),
    **dict.fromkeys(["FastTracker"], "torchmem.capture.fast"),
    **dict.fromkeys(["HostSampler", "host_memory"], "torchmem.capture.host"),
    **dict.fromkeys(
        ["is_oom_error", "oom_guard", "record_history", "snapshot", "start_recording",
         "stop_recording"],
        "torchmem.capture.recording",
    ),
    **dict.fromkeys(
        ["Span", "overlaps", "same_storage", "storage_bytes", "storage_id", "storage_nbytes",
         "storage_of", "storage_ref", "tensor_span", "unique_bytes"],
        "torchmem.capture.storage",
    ),
    **dict.fromkeys(["Listener", "Tracker", "track"], "torchmem.capture.tracker"),
    **dict.fromkeys(["RetentionPath", "RetentionPaths", "why_alive"],
                    "torchmem.capture.retention"),
}

__all__ = [
    "FastTracker",
    "HostSampler",
    "LiteTracker",
    "Listener",
    "RetentionPath",
    "RetentionPaths",
    "Span",
    "Tracker",
    "host_memory",
    "inspect_memory",
    "is_oom_error",
    "oom_guard",
    "overlaps",
    "record_history",
    "same_storage",
    "snapshot",
    "start_recording",
    "stop_recording",
    "storage_bytes",
    "storage_id",
    "storage_nbytes",
    "storage_of",
    "storage_ref",
    "tensor_span",
    "track",
    "track_lite",
    "unique_bytes",
    "why_alive",
]


def __getattr__(name: str) -> Any:
    value = load_export(globals(), _EXPORTS, name)
    if value is MISSING:
        raise AttributeError(f"module 'torchmem.capture' has no attribute {name!r}")
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
