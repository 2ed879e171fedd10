"""The published bert-large-uncased ``Trainer`` runs (``shared/data/public-gpu-truth.md``: a V100
16 GB, the transformers documentation of January 2022) estimated through the ``Trainer`` as the
page runs them (``tests/public_truth_cases.py``), and the estimator rules they exercise.

The ten estimates take about six minutes on our two cores: three of them (one per rule) run here;
the other seven and the order check are the sweep of ``python benchmarks/bench_public_truth.py``
(BENCHMARKS.md), which exits 1 when one is missed.
The rules themselves are tested on small models.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import pytest
import torch

import torchmem
from torchmem.fit import Adam8bitStandIn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import public_truth_cases as cases  # noqa: E402

# one worker runs this file (bash scripts/test.sh: pytest -n auto --dist loadgroup): its module
# fixtures and caches are built once, not once per worker
pytestmark = pytest.mark.xdist_group("public_gpu_truth")

MiB = 1 << 20


# -- the rules, on small models -------------------------------------------------------------------


def _linear_build(optimizer: str, n_out: int = 512, n_in: int = 1024):
    def build(batch: int):
        net = torch.nn.Linear(n_in, n_out).to("cuda")
        opt = Adam8bitStandIn(net.parameters(), blocksize=256) if optimizer == "8bit" else \
            torch.optim.AdamW(net.parameters(), foreach=False)
        x = torch.randn(batch, n_in, device="cuda")

        def step():
            net(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return build


def test_adam8bit_stand_in_allocates_what_bitsandbytes_does():
    """One byte per element and state, float32 absmax per 256-element block, the two
    256-entry quantization maps; 32-bit state for a parameter under 4096 elements."""
    e = torchmem.estimate(_linear_build("8bit"), gpu="V100-16GB", batch_size=8, margin=0)
    weight, bias = 512 * 1024, 512
    expected = (2 * weight + 2 * 4 * (weight // 256)) + 2 * 4 * bias + 2 * 256 * 4
    assert e.by_category["optimizer_state"] == expected
    adam = torchmem.estimate(_linear_build("adamw"), gpu="V100-16GB", batch_size=8, margin=0)
    assert adam.by_category["optimizer_state"] >= 8 * (weight + bias)
    # blocksize and min_8bit_size as bitsandbytes reads them
    assert Adam8bitStandIn.state_bytes(4095) == 8 * 4095
    assert Adam8bitStandIn.state_bytes(4096, blocksize=2048) == 2 * 4096 + 2 * 4 * 2
    assert Adam8bitStandIn.state_bytes(5000, min_8bit_size=8192) == 8 * 5000


def test_adam8bit_stand_in_takes_bitsandbytes_arguments():
    p = torch.nn.Parameter(torch.zeros(8192))
    p.grad = torch.zeros_like(p)
    opt = Adam8bitStandIn([{"params": [p], "weight_decay": 0.01}], lr=1e-4, betas=(0.9, 0.99),
                          eps=1e-6, percentile_clipping=95, block_wise=False)
    opt.step()
    assert sorted(opt.state[p]) == ["gnorm_vec", "max1", "max2", "new_max1", "new_max2",
                                    "qmap1", "qmap2", "state1", "state2", "step"]
    assert opt.state[p]["step"] == 1
    with pytest.raises(ValueError, match="amsgrad"):
        Adam8bitStandIn([p], amsgrad=True)


def test_accelerate_fp16_runs_in_half_precision_under_an_estimate():
    """accelerate's ``mixed_precision="fp16"`` (and so the Trainer's ``fp16=True``) autocasts
    with a gradient scaler under an estimate, as on the GPU; accelerate's per-process state is
    the estimate's own and is given back afterwards."""
    from accelerate import Accelerator
    from accelerate.state import PartialState

    seen = {}

    def build(batch: int, mixed: str = "fp16"):
        acc = Accelerator(mixed_precision=mixed)
        net = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                  torch.nn.Linear(2048, 2048))
        net[0].register_forward_hook(lambda m, i, o: seen.update(inner=o.dtype))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net, opt = acc.prepare(net, opt)
        x = torch.randn(batch, 2048, device=acc.device)
        seen.update(device=acc.device.type, amp=acc.native_amp, scaler=acc.scaler is not None)

        def step():
            out = net(x)
            seen["dtype"] = out.dtype
            acc.backward(out.float().square().mean())
            opt.step()
            opt.zero_grad()
        return step

    before = dict(PartialState._shared_state)
    half = torchmem.estimate(build, gpu="V100-16GB", batch_size=4096, margin=0)
    # the layers run in float16; accelerate gives the outputs back in float32
    assert seen == {"device": "cuda", "amp": True, "scaler": True, "dtype": torch.float32,
                    "inner": torch.float16}
    assert dict(PartialState._shared_state) == before
    full = torchmem.estimate(build, gpu="V100-16GB", batch_size=4096, params={"mixed": "no"},
                             margin=0)
    assert (seen["amp"], seen["inner"]) == (False, torch.float32)
    # the float16 copies of the weights (autocast's cast cache) live through the forward
    assert half.peak_allocated_bytes != full.peak_allocated_bytes


def test_2022_softmax_keeps_its_input():
    """The cases' torch 1.10 softmax keeps its input for backward besides its output: one
    more score-sized tensor live between forward and backward (read from the simulated GPU)."""
    after_forward = {}

    def build(batch: int, old: bool = False):
        x = torch.randn(batch, 16, 512, 512, device="cuda", requires_grad=True)

        def step():
            with cases._torch_2022() if old else contextlib.nullcontext():
                y = torch.nn.functional.softmax(x * 2, dim=-1)
            after_forward[old] = torch.cuda.memory_allocated()
            y.sum().backward()
            x.grad = None
        return step

    for old in (False, True):
        torchmem.estimate(build, gpu="V100-16GB", batch_size=2, params={"old": old}, steps=1,
                          margin=0)
    assert after_forward[True] - after_forward[False] == 2 * 16 * 512 * 512 * 4


def test_order_check():
    from bench_public_truth import same_order

    assert same_order({"vanilla": 3.0, "fp16": 2.0, "accum": 1.0}) == (True, [])
    assert same_order({"vanilla": 1.0, "fp16": 2.0})[1] == [("vanilla", "fp16")]
    # the two published 5363s may come out either way round
    assert same_order({"accum_ckpt_fp16_8bit": 1.0, "accelerate_8bit": 2.0})[0]


# -- the ten published runs -----------------------------------------------------------------------

#: One variant per rule, run in every test session (about a minute): the page's baseline (torch
#: 1.10's softmax and zero_grad), fp16 through accelerate, the 8-bit Adam stand-in. The other
#: seven (the accumulation runs make eight micro-steps each) and the order: the benchmark's sweep.
QUICK = ("vanilla", "fp16", "adam8bit")


@functools.cache
def _estimate(name: str) -> torchmem.Estimate:
    """A variant's estimate (no margin), once a session."""
    return cases.estimate(name)


def _figure(name: str) -> float:
    """A variant's estimate as the page's figure (MiB, with the page's context)."""
    return cases.estimated_mib(_estimate(name))


def _check(name: str) -> None:
    published = cases.VARIANTS[name].published_mib
    got = _figure(name)
    assert abs(got - published) / published <= 0.05, (name, round(got), published)


@pytest.mark.parametrize("name", QUICK)
def test_published_figure_within_5_percent(name: str):
    _check(name)


_FP16_GAP = ("issue 43, open: the fp16 run's published figure is 440 MiB above the estimate "
              "(-3.16%), more than the default margin (377 MiB: 1% of the peak + 256 MiB); the "
              "gap is not explained (2022's torch 1.10 autocast and cuBLAS against 2.13's)")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_FP16_GAP))
                                  if n == "fp16" else n for n in QUICK])
def test_published_run_gets_no_false_fits(name: str):
    """Issue 43's rule on the published runs: the verdict on the V100 16 GB with the default
    margin says "fits" (they ran), and the estimate's peak reserved is not below the published
    figure (less the page's measured CUDA context) by more than that margin."""
    import gpu_cases

    e = _estimate(name)
    real = (cases.VARIANTS[name].published_mib - cases.CONTEXT_MIB) << 20
    problem = gpu_cases.false_fits(e, torchmem.fit.gpu(cases.GPU), real, real_oom=False)
    assert problem is None, problem


def test_the_sweeps_verdict_fails_on_a_missed_goal():
    """The other seven variants and the published order are the benchmark's sweep
    (``python benchmarks/bench_public_truth.py``, BENCHMARKS.md), which exits 1 when a goal is
    missed: its verdict, on figures made by hand."""
    from bench_public_truth import verdict

    good = {"vanilla": (14895.0, 14949, -0.36, 1.0), "accum": (8559.0, 8681, -1.41, 1.0)}
    assert verdict(good) == (True, "2 of 2 within 5% (largest difference 1.41%); order the "
                                   "same as published")
    assert not verdict({**good, "accum": (8000.0, 8681, -7.84, 1.0)})[0]  # off by 7.84%
    assert not verdict({**good, "accum": (15000.0, 8681, 0.0, 1.0)})[0]  # out of order


def test_what_if_from_the_vanilla_run_reproduces_a_published_variant():
    """Issue 25: from the vanilla run alone, ``--what-if`` reproduces the page's variants (its
    levers and combinations applied by torchmem) within the same 5%. One variant here, the 8-bit
    Adam lever, checked against the page and against the direct estimate of the same variant
    (same rules, other route); all eight, each lever kind (accumulation, checkpointing, fp16,
    Adafactor, 8-bit Adam) and their combinations: ``python benchmarks/bench_whatif_public.py``
    (BENCHMARKS.md), which exits 1 when one is off by more than 5%."""
    e = cases.what_if(["adam8bit"])
    got = cases.what_if_mib(e, "adam8bit")
    published = cases.VARIANTS["adam8bit"].published_mib
    assert abs(got - published) / published <= 0.05, (round(got), published)
    assert abs(got - _figure("adam8bit")) / _figure("adam8bit") < 0.02
