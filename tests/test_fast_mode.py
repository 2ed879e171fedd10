"""torchmem's dispatch modes skip torch's dynamo guard only while no compiled code runs
(:mod:`torchmem.capture._fast_mode`): tracking a ``torch.compile``'d module must behave as with
the guard: no frame of torchmem compiled, no warning, the eager run's peak."""

from __future__ import annotations

import logging
import warnings

import torch

import torchmem
from torchmem.capture._fast_mode import FastDispatchMode
from torchmem.capture.tracker._hotpath import _Mode
from torchmem.fit.fakegpu._dispatch import _SimMode


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _tracked_peak(net: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    with torchmem.track(net) as tr:
        for _ in range(3):
            net(x).sum().backward()
    return tr.peak()


def test_a_compiled_module_is_tracked_without_compiling_torchmem(caplog) -> None:
    x = torch.randn(16, 64)
    eager = _tracked_peak(_net(), x)
    net = _net()
    net.compile(backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        compiled = _tracked_peak(net, x)
    assert compiled == eager and eager["cpu"] > 0
    # without the skip, dynamo compiles the mode's frames: "Dynamo does not know how to trace
    # the builtin ...get_eval_frame_callback", then "hit config.recompile_limit" for
    # __torch_dispatch__
    assert not [str(w.message) for w in seen if "ynamo" in str(w.message)]
    assert not [r.getMessage() for r in caplog.records if "torch._dynamo" in r.name]


def test_torchmems_modes_call_their_dispatch_directly() -> None:
    # the per-operator entry has no torch._dynamo.disable frames: the tracker's and the
    # estimator's are their own methods (which check first), the others a thin guard
    from torchmem.capture.tracker._threads import _ThreadMode

    for cls in (_Mode, _SimMode):
        entry = cls.__dict__["__torch_dispatch__"]
        assert issubclass(cls, FastDispatchMode) and cls.inline_check
        assert entry.__qualname__ == f"{cls.__name__}.__torch_dispatch__"
        assert not hasattr(entry, "__wrapped__")
        assert cls._under_disable.__wrapped__ is entry  # torch._dynamo.disable's wrapper
    entry = _ThreadMode.__dict__["__torch_dispatch__"]
    assert entry.__module__ == "torchmem.capture._fast_mode"
    assert entry.__wrapped__.__qualname__ == "_ThreadMode.__torch_dispatch__"
