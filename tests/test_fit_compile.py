"""``torch.compile`` under an estimate (issue 44, first part): the compiled code runs eagerly,
so the figures are the eager step's, and the report says so, naming each call."""

from __future__ import annotations

import torch

import torchmem
from torchmem.fit.fakegpu._compile import compile_calls, compile_note

HERE = __file__


def _build(how: str):
    def build(batch: int):
        net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                  torch.nn.Linear(1024, 256)).cuda()
        if how == "function":
            net = torch.compile(net)  # the line the note names
        elif how == "method":
            net.compile(mode="reduce-overhead")
        opt = torch.optim.AdamW(net.parameters())
        x = torch.randn(batch, 256, device="cuda")

        def step():
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return step
    return build


def _line(text: str) -> int:
    return next(i for i, ln in enumerate(open(HERE).read().splitlines(), 1) if text in ln)


def test_a_compiled_model_is_estimated_as_its_eager_step_and_the_report_says_so():
    original = torch.compile
    eager = torchmem.estimate(_build("eager"), gpu="H100-80GB", batch_size=512)
    compiled = torchmem.estimate(_build("function"), gpu="H100-80GB", batch_size=512)
    assert torch.compile is original  # put back after the run
    # the same operators ran: the same figures to the byte (what the note says)
    assert (compiled.peak_requested_bytes, compiled.peak_allocated_bytes,
            compiled.peak_reserved_bytes) == (eager.peak_requested_bytes,
                                              eager.peak_allocated_bytes,
                                              eager.peak_reserved_bytes)
    assert not any(n.startswith("torch.compile") for n in eager.notes)
    [note] = [n for n in compiled.notes if n.startswith("torch.compile")]
    assert f"Sequential at {HERE}:{_line('the line the note names')}, mode default" in note
    assert "eager step's peaks" in note and "CUDA graphs" not in note
    assert note in compiled.to_dict()["notes"]


def test_module_compile_with_reduce_overhead_names_cuda_graph_pools():
    e = torchmem.estimate(_build("method"), gpu="H100-80GB", batch_size=512)
    [note] = [n for n in e.notes if n.startswith("torch.compile")]
    assert "(Sequential at " in note and "mode reduce-overhead" in note
    assert "CUDA graphs (this mode records them) keep their private pools reserved" in note


def test_calls_are_recorded_with_their_options_and_counted():
    with compile_calls() as calls:
        for _ in range(4):
            torch.compile(torch.nn.Linear(2, 2), fullgraph=True, dynamic=False)
        @torch.compile(mode="max-autotune")  # a decorator: recorded once, when applied
        def double(x):
            return 2 * x
    assert [(c.target, c.mode, c.fullgraph, c.dynamic) for c in calls] == (
        [("Linear", "default", True, False)] * 4 + [(
            "test_calls_are_recorded_with_their_options_and_counted.<locals>.double",
            "max-autotune", False, None)])
    assert all(c.where.startswith(f"{HERE}:") for c in calls)
    note = compile_note(calls)
    assert note.startswith("torch.compile: 5 calls (Linear at ") and " and 2 more)" in note
    assert compile_note([]) == ""
