"""The public surface is pinned: the top level, every namespace's ``__all__``, the forwarded 0.1
names, ``py.typed`` and static types. Changing the surface means changing this file on purpose."""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import torchmem

ROOT = Path(__file__).resolve().parents[1]

TOP_LEVEL = [
    "DeviceError",
    "DeviceSpec",
    "FileFormatError",
    "InvalidInputError",
    "Ledger",
    "MissingFileError",
    "MemoryReport",
    "Snapshot",
    "Span",
    "ToDevice",
    "TorchmemError",
    "Trace",
    "Tracker",
    "UsagePoller",
    "__version__",
    "available_devices",
    "chunked_transfer",
    "format_bytes",
    "host_memory",
    "inspect_memory",
    "estimate",
    "estimate_hf",
    "estimate_script",
    "Estimate",
    "load_snapshot",
    "load_trace",
    "memory_aware_deepcopy",
    "memory_aware_to",
    "offload_forward",
    "oom_guard",
    "parse_bytes",
    "plan_move",
    "poll_usage",
    "record_history",
    "render_report",
    "same_storage",
    "snapshot",
    "storage_bytes",
    "storage_id",
    "tensor_span",
    "track",
    "track_lite",
    "unique_bytes",
    "why_alive",
    "write_snapshot",
    "write_viewer",
]

#: Every namespace a user imports, with its curated ``__all__``.
NAMESPACES: dict[str, list[str]] = {
    "torchmem.analysis": [
        "CreepReport", "DevicePeak", "DeviceStats", "DiffRow", "GpuGap", "GpuReading",
        "GroupDelta", "GrowingGroup", "GrowthReport", "IterationDelta", "LeakTrend", "IterationMemory", "IterationStat", "OomEvent",
        "OomExplanation", "PeakReport", "PoolStats", "SnapshotDiff", "SnapshotStats",
        "StackGroup", "TraceDiff", "TraceRow", "TraceSummary",
        "Attribution", "AttributionRow", "CollectiveRow", "RankDifference", "RankMerge", "RankStats",
        "creep", "diff", "events", "explain_oom", "flame", "gpu_gap", "growth", "leak_trend",
        "merge_ranks", "oom", "peak", "rank_stats", "stats", "summarize",
    ],
    "torchmem.capture": [
        "FastTracker", "HostSampler", "Listener", "LiteTracker", "RetentionPath", "RetentionPaths", "Span",
        "Tracker", "host_memory", "inspect_memory", "is_oom_error",
        "oom_guard", "overlaps", "record_history", "same_storage", "snapshot", "start_recording",
        "stop_recording", "storage_bytes", "storage_id", "storage_nbytes", "storage_of",
        "storage_ref", "tensor_span", "track", "track_lite", "unique_bytes", "why_alive",
    ],
    "torchmem.compat": [
        "MemLord", "MemReporter", "MemoryTracker", "cdata", "device_ordinal", "get_device",
        "tensor_memory_span",
    ],
    "torchmem.devices": [
        "DeviceUsage", "UsagePoller", "UsageSource", "available_devices",
        "measure_cuda_context", "normalize_device", "poll_all", "poll_usage", "read_gpu",
    ],
    "torchmem.errors": [
        "DeviceError", "FileFormatError", "InvalidInputError", "MissingFileError", "MoveError",
        "ObjectLoadError", "SimulatedOutOfMemoryError", "SnapshotFormatError", "TorchmemError", "TraceFormatError",
        "TransferError", "UnsafePickleError", "UnsupportedTensorError",
    ],
    "torchmem.examples": [
        "TiedLM", "build_example", "example_input", "list_examples", "train_step",
    ],
    "torchmem.fit": [
        "Adam8bitStandIn", "CONTEXT_BYTES", "Estimate", "GPU", "GPUS", "KVCache", "OOMSite",
        "ScriptEstimate", "WhatIfRow", "estimate", "estimate_hf", "estimate_script", "gpu",
    ],
    "torchmem.integrations": [],
    "torchmem.io": [
        "from_pytorch", "load_snapshot", "load_trace", "save_trace", "snapshot_from_events",
        "snapshot_from_trace", "to_pytorch_dict", "write_snapshot",
    ],
    "torchmem.ledger": [
        "DEFAULT_AUTO_GC_STRATEGY", "GcRun", "Ledger", "LedgerRecord", "MetricsServer",
        "ledger_metrics", "release_device_cache", "serve_prometheus",
    ],
    "torchmem.notebook": [
        "TorchmemMagics", "estimate_html", "load_ipython_extension", "timeline_svg",
        "trace_html", "unload_ipython_extension", "viewer_html",
    ],
    "torchmem.pytest_plugin": [
        "FitsOn", "LeakLimit", "MemoryLimit", "live_at_end", "parse_marker_limit",
        "top_live_at_peak",
    ],
    "torchmem.model": [
        "Block", "Category", "DeviceTrace", "Event", "EventKind", "Frame", "MemoryReport",
        "MovePlan", "Phase", "Segment", "Snapshot", "StorageRecord", "TensorRecord", "Trace",
        "TraceEntry",
    ],
    "torchmem.move": [
        "MovePlan", "memory_aware_deepcopy", "memory_aware_to", "move_module", "plan_move",
    ],
    "torchmem.render": [
        "merge_json", "plot_timeline", "render_diff", "render_merge", "render_oom", "render_peak",
        "render_report", "render_stats", "render_summary", "render_trace", "summary_json",
        "write_viewer",
    ],
    "torchmem.render.viewer": [
        "build_payload", "encode_payload", "render_html", "write_rank_viewer", "write_viewer",
    ],
    "torchmem.sim": [
        "AllocatorConfig", "CachingAllocator", "ReplayResult", "WhatIf", "replay", "round_size",
        "segment_size", "suggest", "whatif",
    ],
    "torchmem.transfer": [
        "Chain", "DEFAULT_CHUNK_BYTES", "DeviceSpec", "Identity", "LinearOp", "OffloadResult",
        "Operator", "PendingTransfer", "StagingBuffers", "ToDevice", "TransferResult",
        "adjoint_of", "chunked_transfer", "offload_forward", "transfer", "transfer_async",
        "transfer_module", "transfer_stream",
    ],
    "torchmem.units": [
        "GB", "GiB", "KB", "KiB", "MB", "MiB", "TB", "TiB", "format_bytes", "parse_bytes",
    ],
}


def test_top_level_is_pinned() -> None:
    assert sorted(torchmem.__all__) == sorted(TOP_LEVEL)
    assert 35 <= len(TOP_LEVEL) <= 46  # "about 40" (README); 46 with estimate_script


@pytest.mark.parametrize("name", [n for n in TOP_LEVEL if n != "__version__"])
def test_every_top_level_name_resolves_to_its_namespace_and_documents_an_example(name: str) -> None:
    value = getattr(torchmem, name)
    home = importlib.import_module(torchmem._EXPORTS[name])
    assert getattr(home, name) is value
    assert name in home.__all__, f"{name} is not in {home.__name__}.__all__"
    if inspect.isclass(value) or inspect.isfunction(value):
        assert value.__doc__ and ">>>" in value.__doc__, f"{name} has no runnable example"


@pytest.mark.parametrize("name", sorted(torchmem._MOVED))
def test_moved_names_warn_and_forward(name: str) -> None:
    where, new_name = torchmem._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"torchmem\.{name} moved to {where}\.{new_name}"):
        value = getattr(torchmem, name)
    assert value is getattr(importlib.import_module(where), new_name)
    assert name not in torchmem.__all__


def test_unknown_names_raise_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
            _ = torchmem.nonexistent  # type: ignore[attr-defined]


@pytest.mark.parametrize("module", sorted(NAMESPACES))
def test_namespace_all_is_pinned_and_documented(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__doc__ and ">>>" in mod.__doc__, f"{module} has no docstring with an example"
    assert sorted(mod.__all__) == sorted(NAMESPACES[module])
    for name in mod.__all__:
        value = getattr(mod, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__doc__ and ">>>" in value.__doc__, f"{module}.{name} has no example"


def test_type_checking_block_matches_the_lazy_map() -> None:
    """The ``if TYPE_CHECKING:`` imports give type checkers the same names as ``_EXPORTS``."""
    tree = ast.parse((ROOT / "src" / "torchmem" / "__init__.py").read_text())
    static: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                for alias in imp.names:
                    static[alias.name] = imp.module
    assert static == torchmem._EXPORTS


def test_py_typed_ships() -> None:
    assert (importlib.resources.files("torchmem") / "py.typed").is_file()


def test_type_checkers_see_real_types(tmp_path: Path) -> None:
    """mypy reads the real signatures through the top level (not ``Any``): a misuse is an error."""
    pytest.importorskip("mypy")
    snippet = tmp_path / "use.py"
    snippet.write_text(
        "import torchmem\n"
        "n: int = torchmem.format_bytes(3)\n"
        "reveal_type(torchmem.parse_bytes)\n"
    )
    # the project's own mypy settings and cache: scripts/test.sh runs mypy on the package just
    # before the tests, so torchmem's and torch's modules are read from the cache (about 3 s
    # instead of 30 s; without a cache mypy builds it); mypy re-reads any module that changed
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"),
         "--cache-dir", str(root / ".mypy_cache"), str(snippet)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    out = proc.stdout
    assert 'Incompatible types in assignment (expression has type "str", variable has type "int")' in out, out
    assert 'Revealed type is "def (text: str | int) -> int"' in out, out


def test_calling_the_transfer_namespace_forwards_the_01_function() -> None:
    import torch

    x = torch.arange(4.0)
    with pytest.warns(DeprecationWarning, match=r"torchmem\.transfer\(\.\.\.\) as a function moved"):
        y = torchmem.transfer(x, "cpu")  # type: ignore[operator]
    assert torch.equal(y, torchmem.transfer.transfer(x, "cpu"))
    assert torchmem.transfer.ToDevice is torchmem.ToDevice


def test_every_public_namespace_is_an_attribute_after_import_torchmem() -> None:
    """``import torchmem; torchmem.sim...`` works for every public subpackage and module, found
    on disk (so a new namespace cannot be forgotten in a list)."""
    import pkgutil

    names = [m.name for m in pkgutil.iter_modules(torchmem.__path__) if not m.name.startswith("_")]
    assert {"analysis", "capture", "io", "model", "render", "sim", "transfer"} <= set(names)
    for name in names:
        assert getattr(torchmem, name) is importlib.import_module(f"torchmem.{name}")
