"""torchmem.compat.MemoryTracker against PyTorch's torch.distributed._tools MemoryTracker.

Ground truth: PyTorch's own class run with a stand-in device module (it reads
``torch.cuda.memory_allocated``, absent on CPU) for operator names, counters and markers; its
``load`` for the stats files; and bytes computed by hand from the tensors known to be alive.
"""

from __future__ import annotations

import io
import os
import pickle
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import torchmem
from torchmem.compat import MemoryTracker
from torchmem.errors import FileFormatError, InvalidInputError, MissingFileError

MiB = 1024 * 1024


def _conv_net() -> nn.Module:
    """The model of PyTorch's own test (a hierarchy of modules)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=(3, 3), padding=(1, 1), bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=False),
            nn.AdaptiveAvgPool2d(output_size=(1, 1)),
        ),
        nn.Flatten(start_dim=1),
        nn.Sequential(nn.Linear(8, 2), nn.ReLU(inplace=True)),
    )


def _step(model: nn.Module) -> None:
    torch.manual_seed(1)
    x = torch.randn(size=(2, 3, 16, 16))
    target = torch.LongTensor([0, 1])
    nn.CrossEntropyLoss()(model(x), target).backward()


def _pytorchs() -> Any:
    """PyTorch's MemoryTracker class (the ground truth); skips where torch has no distributed."""
    mod = pytest.importorskip("torch.distributed._tools.memory_tracker")
    return mod.MemoryTracker


def _stub_device_module() -> Any:
    return SimpleNamespace(empty_cache=lambda: None, memory_allocated=lambda: 0,
                           memory_reserved=lambda: 0, memory_stats=lambda: {})


def _pytorch_run(model: nn.Module) -> Any:
    pt = _pytorchs()()
    pt._device_module = _stub_device_module()  # its CUDA reads, absent on CPU
    pt.start_monitor(model)
    _step(model)
    pt.stop()
    return pt


def _names(series: dict[int, tuple[str, float]]) -> list[str]:
    return [series[i][0] for i in range(len(series))]


def _bytes(series: dict[int, tuple[str, float]]) -> list[int]:
    out = []
    for i in range(len(series)):
        b = series[i][1] * MiB
        assert b == int(b)
        out.append(int(b))
    return out


def test_what_pytorchs_test_checks_on_cpu(tmp_path: Path) -> None:
    model = _conv_net()
    mt = MemoryTracker()
    mt.start_monitor(model)
    _step(model)
    assert len(mt._hooks) == 2 * len(list(model.modules()))  # a pre and a post hook each
    mt.stop()
    assert mt._hooks == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    path = tmp_path / "memory.trace"
    mt.save_stats(path)
    before = io.StringIO()
    mt.summary(file=before)
    mt.load(path)
    after = io.StringIO()
    with redirect_stdout(after):
        mt.summary()
    assert after.getvalue() == before.getvalue()
    assert mt._op_index > 0 and len(mt._operator_names) > 0
    for series in (mt.memories_allocated, mt.memories_active, mt.memories_reserved):
        assert len(series) == mt._op_index
    assert set(mt._markers) == {"fw_start", "fw_bw_boundary"}
    assert mt._cur_module_name == "2.1.forward"  # the last module whose forward started
    assert mt._num_alloc_retries == 0


def test_operator_names_counters_and_markers_are_pytorchs() -> None:
    pt = _pytorch_run(_conv_net())
    mt = MemoryTracker()
    model = _conv_net()
    mt.start_monitor(model)
    _step(model)
    mt.stop()
    assert _names(mt.memories_allocated) == _names(pt.memories_allocated)
    assert len(mt.memories_allocated) == mt._op_index == pt._op_index
    assert dict(mt._operator_names) == dict(pt._operator_names)
    assert dict(mt._markers) == dict(pt._markers)
    assert mt._cur_module_name == pt._cur_module_name
    # PyTorch's _memory_tracker_is_root flags, set on the modules
    assert model._memory_tracker_is_root is True
    others = list(model.modules())[1:]
    assert len(others) == 9 and [m._memory_tracker_is_root for m in others] == [False] * 9


def test_markers_sit_at_the_forward_and_backward_boundary() -> None:
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    mt = MemoryTracker()
    mt.start_monitor(net)
    x = torch.randn(4, 8)  # operator 0, before the forward
    out = net(x)  # t, addmm, relu: operators 1 to 3
    out.sum().backward()
    mt.stop()
    names = _names(mt.memories_allocated)
    assert mt._markers["fw_start"] == 1
    assert mt._markers["fw_bw_boundary"] == 4
    assert names[:4] == [".randn.default_0", "0.forward.t.default_0",
                         "0.forward.addmm.default_0", "1.forward.relu.default_0"]
    # backward operators keep the last forward module's name, as PyTorch's do
    assert names[4] == "1.forward.sum.default_0"
    assert "1.forward.threshold_backward.default_0" in names[5:]
    assert "1.forward.mm.default_0" in names[5:]


def test_allocated_is_the_exact_live_bytes_of_the_models_device() -> None:
    net = nn.Linear(8, 16)
    params = (8 * 16 + 16) * 4
    mt = MemoryTracker()
    mt.start_monitor(net)
    a = torch.ones(1000)  # 4000 bytes
    b = torch.zeros(500)  # 2000 bytes
    del a
    c = b * 2  # 2000 bytes
    mt.stop()
    del b, c
    assert _names(mt.memories_allocated) == [".ones.default_0", ".zeros.default_0",
                                             ".mul.Tensor_0"]
    expect = [params + 4000, params + 6000, params + 2000 + 2000]
    assert _bytes(mt.memories_allocated) == expect
    assert _bytes(mt.memories_active) == expect  # no caching allocator: all three agree
    assert _bytes(mt.memories_reserved) == expect


def test_the_series_peak_is_the_bytes_alive_at_the_peak_of_a_training_step() -> None:
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    params = (32 * 64 + 64 + 64 * 8 + 8) * 4
    mt = MemoryTracker()
    mt.start_monitor(net)
    x = torch.randn(16, 32)
    net(x).sum().backward()
    mt.stop()
    series = _bytes(mt.memories_allocated)
    assert series[0] == params + 16 * 32 * 4  # the parameters and x
    # the peak: at the end of backward, when fc1's bias gradient is made. Alive: the
    # parameters, x, the loss and backward's seed gradient (a float each), the four parameter
    # gradients and the gradient flowing into fc1's output (16 x 64). Gone by then: fc1's output
    # (ReLU saves its result, not its input), ReLU's output and the gradient into it (freed
    # once ReLU's backward ran).
    grads = (64 * 8 + 8 + 32 * 64 + 64) * 4
    flowing = 16 * 64 * 4
    peak = params + 16 * 32 * 4 + 4 + 4 + grads + flowing
    assert max(series) == peak
    assert mt.memories_allocated[series.index(peak)][0] == "2.forward.sum.dim_IntList_1"
    assert max(series) == mt.peak()["cpu"]  # the trace's peak, computed another way


def test_a_model_on_meta_is_measured_too() -> None:
    net = nn.Linear(1024, 1024, device="meta")
    params = (1024 * 1024 + 1024) * 4
    mt = MemoryTracker()
    mt.start_monitor(net)
    y = net(torch.empty(8, 1024, device="meta"))
    mt.stop()
    assert _bytes(mt.memories_allocated)[-1] == params + 8 * 1024 * 4 * 2
    assert y.shape == (8, 1024)
    assert mt.peak() == {"meta": params + 8 * 1024 * 4 * 2}


def test_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        net = nn.Linear(256, 256)
        mt = MemoryTracker()
        mt.start_monitor(net)
        net(torch.empty(4, 256)).sum().backward()
        mt.stop()
    params = (256 * 256 + 256) * 4
    assert _bytes(mt.memories_allocated)[0] == params + 4 * 256 * 4
    assert max(_bytes(mt.memories_allocated)) >= 2 * params  # the gradients


def test_save_stats_is_read_by_pytorchs_load_and_pytorchs_files_by_ours(tmp_path: Path) -> None:
    model = _conv_net()
    mt = MemoryTracker()
    mt.start_monitor(model)
    _step(model)
    mt.stop()
    ours = tmp_path / "ours.trace"
    mt.save_stats(ours)
    pt = _pytorchs()()
    pt.load(str(ours))
    assert dict(pt.memories_allocated) == dict(mt.memories_allocated)
    assert dict(pt.memories_reserved) == dict(mt.memories_reserved)
    assert dict(pt._markers) == dict(mt._markers)
    pt._op_index = len(pt.memories_allocated)  # torch < 2.14's load leaves it at 0
    want, got = io.StringIO(), io.StringIO()
    with redirect_stdout(want):
        pt.summary(top=5)
    mt.summary(top=5, file=got)
    assert got.getvalue() == want.getvalue()
    assert "0.0.forward.convolution.default_0" in got.getvalue()
    # a file PyTorch's save_stats wrote (defaultdicts inside) loads here
    theirs = tmp_path / "theirs.trace"
    pt._num_alloc_retries = 3
    pt.save_stats(str(theirs))
    loaded = MemoryTracker()
    loaded.load(theirs)
    assert dict(loaded.memories_allocated) == dict(mt.memories_allocated)
    assert loaded._op_index == mt._op_index and loaded._num_alloc_retries == 3
    assert loaded.trace is None  # PyTorch's file has no torchmem trace


def test_load_restores_summary_and_trace(tmp_path: Path) -> None:
    mt = MemoryTracker()
    for index, name in enumerate(["aten::conv2d", "aten::relu", "aten::linear"]):
        for series in (mt.memories_allocated, mt.memories_active, mt.memories_reserved):
            series[index] = (name, float(index))
        mt._op_index += 1
    mt._num_alloc_retries = 2
    path = tmp_path / "stats"
    mt.save_stats(path)
    loaded = MemoryTracker()
    loaded.load(str(path))
    assert loaded._op_index == 3 and loaded._num_alloc_retries == 2
    out = io.StringIO()
    loaded.summary(file=out)
    assert out.getvalue().splitlines() == [
        "------------------------------------------------",
        "The number of alloc retries are: 2",
        "Top 20 ops that generates memory are:",
        "aten::relu: 1.0MB",
        "aten::linear: 1.0MB",
        "------------------------------------------------",
    ]
    # with a recorded run the torchmem trace travels in the same file
    net = nn.Linear(4, 4)
    mt2 = MemoryTracker()
    mt2.start_monitor(net)
    net(torch.randn(2, 4))
    mt2.stop()
    mt2.save_stats(path)
    back = MemoryTracker()
    back.load(path)
    assert back.trace is not None and mt2.trace is not None
    assert back.peak() == mt2.peak() == {"cpu": 80 + 32 + 32}
    assert len(back.trace) == len(mt2.trace)


def test_summary_ranks_operators_by_the_memory_they_add() -> None:
    mt = MemoryTracker()
    mt.start_monitor(nn.Linear(2, 2))
    big = torch.ones(1024 * 256)  # 1 MiB
    small = torch.ones(1024 * 64)  # 0.25 MiB
    freed = big * 1  # +1 MiB
    del big
    mt.stop()
    out = io.StringIO()
    mt.summary(top=2, file=out)
    lines = out.getvalue().splitlines()
    assert lines[3:5] == [".mul.Tensor_0: 1.0MB", ".ones.default_1: 0.25MB"]
    del small, freed


def test_a_tmtrace_file_loads_as_one_point_per_allocation_or_free(tmp_path: Path) -> None:
    mt = MemoryTracker()
    mt.start_monitor(nn.ReLU())
    a = torch.ones(100)
    b = torch.ones(50)
    del a
    mt.stop()
    p = tmp_path / "run.tmtrace"
    mt.save_trace(p)
    loaded = MemoryTracker()
    loaded.load(p)
    assert _names(loaded.memories_allocated) == [".aten::ones_0", ".aten::ones_1", ".free_0"]
    assert _bytes(loaded.memories_allocated) == [400, 600, 200]
    assert loaded._op_index == 3 and loaded.peak() == {"cpu": 600}
    assert torchmem.load_trace(p).peak() == {"cpu": 600}
    del b


def test_show_traces_draws_pytorchs_four_figures(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    mt = MemoryTracker()
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    mt.start_monitor(net)
    net(torch.randn(2, 4)).sum().backward()
    mt.stop()
    before = set(plt.get_fignums())
    assert mt.show_traces() is None
    new = sorted(set(plt.get_fignums()) - before)
    try:
        assert len(new) == 4
        first = plt.figure(new[0])
        labels = [ln.get_label() for ln in first.axes[0].lines]
        assert labels == ["allocated_memory", "active_memory", "reserved_memory", "fw_start",
                          "fw_bw_boundary"]
        assert list(first.axes[0].lines[0].get_ydata()) == [
            v for _, v in mt.memories_allocated.values()]
    finally:
        for n in new:
            plt.close(n)
    stats = tmp_path / "s.trace"
    mt.save_stats(stats)
    png = MemoryTracker().show_traces(str(stats), output=tmp_path / "t.png")
    assert png == str(tmp_path / "t.png")
    assert open(png, "rb").read(4) == b"\x89PNG"
    assert set(plt.get_fignums()) == before


def test_stop_restores_everything_and_start_again_clears() -> None:
    before = (len(_get_current_dispatch_mode_stack()), len(nn_module._global_forward_hooks))
    net = nn.Linear(2, 2)
    mt = MemoryTracker()
    mt.stop()  # before any start: nothing to do
    mt.start_monitor(net)
    assert len(_get_current_dispatch_mode_stack()) == before[0] + 2  # torchmem's and ours
    torch.ones(3)
    mt.stop()
    mt.stop()
    assert (len(_get_current_dispatch_mode_stack()), len(nn_module._global_forward_hooks)) == before
    assert mt.profile_mode is None
    mt.start_monitor(net)
    torch.zeros(1)
    mt.stop()
    assert _names(mt.memories_allocated) == [".zeros.default_0"]
    assert mt._op_index == 1 and dict(mt._operator_names) == {"zeros.default": 1}


def test_allocator_counters_are_read_where_the_device_has_them() -> None:
    reads = {"allocated": 3 * MiB, "reserved": 8 * MiB, "active": 4 * MiB, "retries": 5}
    stub = SimpleNamespace(
        empty_cache=lambda: None,
        memory_allocated=lambda: reads["allocated"],
        memory_reserved=lambda: reads["reserved"],
        memory_stats=lambda: {"active_bytes.all.current": reads["active"],
                              "num_alloc_retries": reads["retries"]},
    )
    mt = MemoryTracker()
    mt.start_monitor(nn.Linear(2, 2))
    mt._device_module, mt._allocator = stub, True  # what start_monitor picks on CUDA
    torch.ones(1)
    mt.stop()
    assert mt.memories_allocated[0] == (".ones.default_0", 3.0)
    assert mt.memories_reserved[0] == (".ones.default_0", 8.0)
    assert mt.memories_active[0] == (".ones.default_0", 4.0)
    assert mt._num_alloc_retries == 5


def test_bad_input_is_explained(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="source='gpu'; expected 'auto'"):
        MemoryTracker(source="gpu")
    with pytest.raises(InvalidInputError, match="model has on cpu|on cpu"):
        MemoryTracker(source="allocator").start_monitor(nn.Linear(2, 2))
    mt = MemoryTracker()
    with pytest.raises(InvalidInputError, match="expects a torch.nn.Module.*got str"):
        mt.start_monitor("model")
    mt.start_monitor(nn.ReLU())
    try:
        with pytest.raises(InvalidInputError, match="call stop\\(\\) first"):
            mt.start_monitor(nn.ReLU())
    finally:
        mt.stop()
    with pytest.raises(InvalidInputError, match="nothing recorded yet"):
        MemoryTracker().summary()
    with pytest.raises(InvalidInputError, match="nothing recorded yet"):
        MemoryTracker().show_traces()
    with pytest.raises(InvalidInputError, match="non-negative int.*got -1"):
        mt.summary(top=-1)
    with pytest.raises(InvalidInputError, match="expects a file path.*got 3"):
        mt.save_stats(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="no torchmem trace"):
        MemoryTracker().peak()
    with pytest.raises(MissingFileError, match="no such file; expected a stats file"):
        mt.load(tmp_path / "missing")
    junk = tmp_path / "junk"
    junk.write_text("hello")
    with pytest.raises(FileFormatError, match="not a MemoryTracker stats file"):
        mt.load(junk)
    wrong = tmp_path / "wrong"
    wrong.write_bytes(pickle.dumps({"memories_allocated": {0: "x"}}))
    with pytest.raises(FileFormatError, match=r"'memories_allocated'\[0\] should be \(name, MiB\)"):
        mt.load(wrong)


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    flag = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {flag}",))

    path = tmp_path / "evil"
    path.write_bytes(pickle.dumps({"memories_allocated": Evil()}))
    with pytest.raises(FileFormatError, match="refused to load.*nothing was executed"):
        MemoryTracker().load(path)
    assert not flag.exists()


def test_a_failed_start_leaves_no_hook_and_no_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchmem.capture.tracker as tracker_pkg

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracker failed")

    before = len(_get_current_dispatch_mode_stack())
    monkeypatch.setattr(tracker_pkg, "track", broken)
    net = nn.Sequential(nn.Linear(2, 2))
    mt = MemoryTracker()
    with pytest.raises(RuntimeError, match="tracker failed"):
        mt.start_monitor(net)
    assert mt._hooks == [] and mt.profile_mode is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    assert len(_get_current_dispatch_mode_stack()) == before


def test_loading_a_tmtrace_after_a_cuda_run_reads_the_file_not_the_device(tmp_path: Path) -> None:
    mt = MemoryTracker()
    mt.start_monitor(nn.ReLU())
    x = torch.ones(8)
    mt.stop()
    p = tmp_path / "run.tmtrace"
    mt.save_trace(p)
    mt._allocator = True  # as after a run on CUDA: loading a file must not read the device
    mt._device_module = None
    mt.load(p)
    assert _bytes(mt.memories_allocated) == [32]
    del x
