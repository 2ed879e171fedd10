"""Recording on CPU through the tracker, snapshots from events, PyTorch's tools on our files,
oom_guard; the CUDA path is marked ``cuda`` (skipped without a GPU)."""

from __future__ import annotations

import io
import pickle
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from torch.cuda import _memory_viz

import torchmem
from torchmem.capture.recording import is_oom_error, oom_guard, record_history
from torchmem.errors import InvalidInputError
from torchmem.io.convert import CPU_NOTE, snapshot_from_events
from torchmem.io.snapshot_file import load_snapshot
from torchmem.model.events import Category, Event, EventKind, Phase


def _storage_bytes(*ts: torch.Tensor) -> list[int]:
    return [t.untyped_storage().nbytes() for t in ts]


def test_cpu_recording_matches_storage_sizes() -> None:
    with record_history(device="cpu") as rec:
        a = torch.zeros(1000)
        b = torch.ones(37, dtype=torch.float64)
        c = torch.empty(3, 5)
        del c
    snap = rec.snapshot()
    live = sorted(blk.size for s in snap.segments for blk in s.blocks)
    assert live == sorted(_storage_bytes(a, b))
    allocs = [e for e in snap.trace(0) if e.action == "alloc"]
    frees = [e for e in snap.trace(0) if e.action == "free_completed"]
    assert sorted(e.size for e in allocs) == sorted([4000, 296, 60])
    assert [e.size for e in frees] == [60]
    assert CPU_NOTE in snap.notes and snap.device_names == {0: "cpu"}
    # synthetic addresses never overlap
    spans = sorted((e.addr, e.addr + e.size) for e in allocs)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    # stacks recorded: the innermost user frame is this test
    assert any("test_snapshot_record.py" in f.filename for e in allocs for f in e.frames)


def test_cpu_snapshot_opens_in_memory_viz_functions(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with record_history(net, device="cpu"):
        net(torch.randn(16, 32)).sum().backward()
        path = tmp_path / "cpu.pickle"
        torchmem.write_snapshot(path, torchmem.snapshot())
    with open(path, "rb") as f:
        data = pickle.load(f)
    seg_text = _memory_viz.segsum(data)
    expected_total = sum(s["total_size"] for s in data["segments"])
    assert f"total_reserved: {_memory_viz.Bytes(expected_total)}" in seg_text
    param_bytes = sum(p.untyped_storage().nbytes() for p in net.parameters())
    assert expected_total >= 2 * param_bytes  # parameters and their gradients are alive
    with redirect_stdout(io.StringIO()):
        tr = _memory_viz.trace(data)
    n = len(data["device_traces"][0])
    assert tr.startswith("Device 0 ----------------\n") and f"{n} entries" in tr
    assert tr.count("cudaMalloc(") == sum(1 for e in data["device_traces"][0] if e["action"] == "segment_alloc")
    html = _memory_viz.trace_plot(data)
    assert "Active Memory Timeline" in html and len(html) > 1000
    ours = load_snapshot(path)
    from torchmem.analysis._peak import snapshot_peak

    assert snapshot_peak(ours).devices[0].end_allocated_bytes == expected_total


def test_snapshot_from_events_two_devices_and_markers() -> None:
    ev = [
        Event(0, EventKind.ALLOC, 1_000, "cpu", 4096, 1, op="aten::mm", module="enc",
              phase=Phase.FORWARD, category=Category.ACTIVATION, stack=("train.py:3:main", "m.py:9:fwd")),
        Event(1, EventKind.ALLOC, 2_000, "meta", 100, 2, op="aten::empty"),
        Event(2, EventKind.MARK, 2_500, "cpu", 0, 0, op="step"),
        Event(3, EventKind.FREE, 3_000, "cpu", 4096, 1, op="aten::mm"),
        Event(4, EventKind.ALLOC, 4_000, "cpu", 10, 3),
        Event(5, EventKind.FREE, 5_000, "cpu", 64, 99),  # allocated before recording started
    ]
    snap = snapshot_from_events(ev)
    assert snap.device_names == {0: "cpu", 1: "meta"}
    acts = [(e.action, e.size, e.time_us) for e in snap.trace(0)]
    assert acts[:2] == [("segment_alloc", 4096, 1), ("alloc", 4096, 1)]
    assert [a for a, _, _ in acts[2:5]] == ["free_requested", "free_completed", "segment_free"]
    first = snap.trace(0)[1]
    assert [f.label() for f in first.frames] == ["<op>:0:aten::mm", "<module>:0:enc", "m.py:9:fwd", "train.py:3:main"]
    assert first.user_metadata == "category=activation phase=forward storage=1"
    assert snap.external_annotations == [{"stage": "MARK", "name": "step", "device": 0, "time_us": 2}]
    assert [(s.device, s.total_size) for s in snap.segments] == [(0, 10), (1, 100)]
    assert any(n.startswith("1 frees of storages allocated before") for n in snap.notes)
    assert len(snap.trace(0)) == 7  # the unknown free adds no entry
    with pytest.raises(InvalidInputError, match="Event records"):
        snapshot_from_events([{"action": "alloc"}])  # type: ignore[list-item]


def test_oom_guard_writes_on_oom_and_reraises(tmp_path: Path) -> None:
    p = tmp_path / "oom.pickle"
    with pytest.raises(RuntimeError, match="out of memory"):
        with oom_guard(p, device="cpu"):
            keep = torch.empty(2048)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    snap = load_snapshot(p)
    assert [b.size for s in snap.segments for b in s.blocks] == _storage_bytes(keep)
    q = tmp_path / "mem.pickle"
    with pytest.raises(MemoryError):
        with oom_guard(q, device="cpu"):
            raise MemoryError()
    t = load_snapshot(q).trace(0)
    assert t[len(t) - 1].action == "oom" and t[len(t) - 1].device_free > 0
    assert t[len(t) - 1].user_metadata.startswith("MemoryError")
    r = tmp_path / "never.pickle"
    with pytest.raises(ValueError):
        with oom_guard(r, device="cpu"):
            raise ValueError("not memory")
    assert not r.exists()
    with oom_guard(r, device="cpu"):
        pass
    assert not r.exists()


def test_is_oom_error_kinds() -> None:
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(MemoryError())
    assert is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory"))
    assert not is_oom_error(RuntimeError("shape mismatch"))


def test_record_history_is_reentrant_and_restores() -> None:
    rec = record_history(device="cpu")
    with rec:
        with rec:
            x = torch.empty(100)
        assert rec.active  # inner exit keeps the outer recording running
        y = torch.empty(50)
    assert not rec.active
    sizes = sorted(b.size for s in rec.snapshot().segments for b in s.blocks)
    assert sizes == sorted(_storage_bytes(x, y))
    with pytest.raises(InvalidInputError):
        torchmem.capture.stop_recording()


def test_failed_start_leaves_the_recorder_stopped_and_usable() -> None:
    # Regression: a start() that failed (bad track() argument) still counted as running, so
    # .active was True and stop() crashed with AttributeError on the missing tracker.
    rec = record_history("not a module", device="cpu")
    with pytest.raises(InvalidInputError, match="must be a torch.nn.Module"):
        rec.start()
    assert not rec.active
    with pytest.raises(InvalidInputError, match="never started"):
        rec.stop()
    # the same recorder starts fine once its arguments are right
    rec.track_args = ()
    with rec:
        z = torch.empty(25)
    assert [b.size for s in rec.snapshot().segments for b in s.blocks] == _storage_bytes(z)


def test_snapshot_without_recording_on_cpu_raises_clearly() -> None:
    from torchmem.capture import recording as rmod

    saved = list(rmod._LAST)
    rmod._LAST.clear()
    try:
        with pytest.raises(InvalidInputError, match="record_history"):
            torchmem.snapshot(device="cpu")
    finally:
        rmod._LAST[:] = saved


def test_cuda_device_without_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from torchmem.errors import DeviceError

    with pytest.raises(DeviceError, match="CUDA is not available"):
        record_history(device="cuda")


@pytest.mark.cuda
def test_cuda_record_history_real_gpu(tmp_path: Path) -> None:
    with record_history(device="cuda", max_entries=1000) as rec:
        x = torch.empty(1024 * 1024, device="cuda")
        del x
    snap = rec.snapshot()
    acts = [e.action for e in snap.trace(torch.cuda.current_device())]
    assert "alloc" in acts and "free_completed" in acts
    torchmem.write_snapshot(tmp_path / "cuda.pickle", snap)
    assert pickle.loads((tmp_path / "cuda.pickle").read_bytes())["segments"] is not None


def test_oom_guard_never_hides_the_oom_when_writing_fails(tmp_path) -> None:
    import torch

    target = tmp_path / "no-such-dir" / "oom.pickle"  # parent missing: the write must fail
    with pytest.warns(RuntimeWarning, match="could not write the snapshot"):
        with pytest.raises(MemoryError, match="host ran out") as info:
            with oom_guard(target, device="cpu"):
                keep = torch.empty(10)
                raise MemoryError("host ran out")
    assert keep.numel() == 10
    assert not target.exists()
    assert any("could not write the snapshot" in n for n in getattr(info.value, "__notes__", []))


def test_cuda_keeps_its_index_when_a_cpu_tensor_comes_first(tmp_path) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torchmem
    from torchmem.io.convert import snapshot_from_trace

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torchmem.track() as tr:
        host = torch.zeros(8)  # a CPU storage first: 32 bytes
        with fake:
            dev = torch.empty(16, device="cuda:0")  # a fake CUDA storage: 64 bytes
    snap = snapshot_from_trace(tr)
    assert snap.device_names[0] == "cuda:0" and snap.device_names[1] == "cpu"
    assert sum(s.total_size for s in snap.segments if s.device == 0) == dev.numel() * 4
    assert sum(s.total_size for s in snap.segments if s.device == 1) == host.numel() * 4
    p = tmp_path / "mixed.tmtrace"
    tr.save(p)
    loaded = torchmem.load_snapshot(p)
    assert loaded.device_names[0] == "cuda:0" and loaded.device_names[1] == "cpu"
