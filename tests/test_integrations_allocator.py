"""The CUDA allocator's per-step peak, followed without resetting PyTorch's counters.

On CPU the "GPU" is torchmem's simulator of PyTorch's caching allocator (``sim.CachingAllocator``,
checked against real snapshots elsewhere): every storage of a real recorded training run goes
through it, the meter reads its ``allocated_bytes`` where it would read
``torch.cuda.memory_allocated``, and the ground truth is the simulator's own allocated bytes after
every allocation (its block sizes, slack included), which the meter never sees. The real GPU test
compares with ``max_memory_allocated`` after a reset (allowed in a test, never in the meter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchmem
from torchmem.integrations._allocator import AllocatorFollower
from torchmem.integrations._meter import StepMeter, StepPeaks
from torchmem.model.events import Event, EventKind
from torchmem.sim import AllocatorConfig, CachingAllocator, round_size
from torchmem.units import KiB, MiB


def _recorded_run(steps: int = 3) -> list[Event]:
    """The events of a real CPU training run: an MLP with Adam, ``steps`` steps."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with torchmem.track(net, opt) as tr:
        for _ in range(steps):
            loss = net(torch.randn(32, 64)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss
    return list(tr.events())


class SimGPU:
    """The simulated allocator and the meter fed the same storages, as on a GPU."""

    def __init__(self, config: str = "") -> None:
        self.sim = CachingAllocator(config=config)
        self.addr: dict[int, int] = {}
        self.true_peak = 0
        self.meter = StepMeter(follower=AllocatorFollower(
            read=lambda dev: self.sim.allocated_bytes, config=AllocatorConfig.parse(config)))

    def event(self, e: Event, seen: bool = True) -> None:
        """Apply ``e`` on "cuda:0"; ``seen=False`` is an allocation no tensor shows (a workspace)."""
        if e.kind is EventKind.ALLOC:
            self.addr[e.storage] = self.sim.malloc(e.nbytes)
            self.true_peak = max(self.true_peak, self.sim.allocated_bytes)
        elif e.kind is EventKind.FREE:
            self.sim.free(self.addr.pop(e.storage))
        if seen:
            self.meter.on_event(Event(e.seq, e.kind, e.time_ns, "cuda:0", e.nbytes, e.storage,
                                      phase=e.phase))

    def begin(self) -> None:
        self.meter.begin_step()
        self.true_peak = self.sim.allocated_bytes

    def replay_steps(self, events: list[Event]) -> list[tuple[StepPeaks, int]]:
        out = []
        n = 0  # the state at the tracker's start (parameters) comes before the first step
        while events[n].kind is EventKind.ALLOC and events[n].op is None:
            self.event(events[n])
            n += 1
        self.begin()
        for e in events[n:]:
            if e.kind is EventKind.MARK:
                if e.op == "step":
                    out.append((self.meter.end_step(), self.true_peak))
                    self.begin()
                continue
            self.event(e)
        return out


def test_followed_peak_equals_the_allocators_on_a_recorded_run() -> None:
    events = _recorded_run()
    gpu = SimGPU()
    steps = gpu.replay_steps(events)
    assert len(steps) == 3
    for peaks, truth in steps:
        # small tensors: the allocator rounds each to 512 B and splits blocks exactly
        assert peaks.allocator_step_peak["cuda:0"] == truth
        assert peaks.allocator_unseen["cuda:0"] == 0
        m = peaks.metrics()
        assert m["memory/allocator_peak_bytes"] == truth
        # the tensor peak counts bytes, the allocator 512-byte blocks: never more
        assert peaks.peak["cuda:0"] <= truth
    # a figure computed by hand from the rules: the first step's start is the parameters,
    # each storage rounded to 512 B (64x128 floats = 32 KiB, 128 floats = 512 B, ...)
    params = [64 * 128 * 4, 128 * 4, 128 * 8 * 4, 8 * 4]
    first_start = steps[0][0].live_at_start  # the tracker's bytes, unrounded
    assert first_start["cuda:0"] == sum(params)
    assert sum(round_size(p) for p in params) == 32768 + 512 + 4096 + 512
    # the allocator's peak never went below the bytes of the parameters
    assert min(p.allocator_step_peak["cuda:0"] for p, _ in steps) >= 32768 + 512 + 4096 + 512


def test_power2_rounding_is_followed_from_the_allocator_config() -> None:
    events = _recorded_run(2)
    gpu = SimGPU("roundup_power2_divisions:4")
    for peaks, truth in gpu.replay_steps(events):
        assert peaks.allocator_step_peak["cuda:0"] == truth
        assert peaks.allocator_unseen["cuda:0"] == 0


def _alloc(seq: int, nbytes: int) -> Event:
    return Event(seq, EventKind.ALLOC, seq, "cuda:0", nbytes, seq + 1)


def _free(seq: int, of: Event) -> Event:
    return Event(seq, EventKind.FREE, seq, "cuda:0", of.nbytes, of.storage)


def test_a_workspace_no_tensor_shows_is_reported_as_unseen() -> None:
    gpu = SimGPU()
    gpu.begin()
    x = _alloc(0, 4 * MiB)
    gpu.event(x)
    workspace = _alloc(1, 3 * MiB + 100)   # a library's buffer, kept (cuBLAS-like)
    gpu.event(workspace, seen=False)
    gpu.event(_free(2, x))
    peaks = gpu.meter.end_step()
    assert peaks.allocator_unseen["cuda:0"] == round_size(3 * MiB + 100) == 3 * MiB + 512
    # the step's peak: both alive at once; the followed peak alone (4 MiB) is below the end
    # reading (3 MiB + 512) here, and the end reading is what max() adds
    assert gpu.true_peak == 7 * MiB + 512
    assert peaks.allocator_step_peak["cuda:0"] == 4 * MiB


def test_the_slack_of_a_reused_unsplit_block_is_unseen() -> None:
    """12 MiB freed, then 11.5 MiB asked for: the cached 12 MiB block is handed out whole (the
    0.5 MiB left is under the 1 MiB split threshold), so the allocator counts 12 MiB."""
    gpu = SimGPU()
    a = _alloc(0, 12 * MiB)
    gpu.event(a)
    gpu.event(_free(1, a))
    gpu.begin()
    b = _alloc(2, 12 * MiB - 512 * KiB)
    gpu.event(b)
    peaks = gpu.meter.end_step()
    assert gpu.sim.allocated_bytes == 12 * MiB
    assert peaks.allocator_unseen["cuda:0"] == 512 * KiB
    assert peaks.allocator_step_peak["cuda:0"] == gpu.true_peak == 12 * MiB


def test_the_meter_never_resets_pytorchs_peak(monkeypatch: Any) -> None:
    called = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: called.append(a))
    monkeypatch.setattr(torch.cuda, "reset_max_memory_allocated", lambda *a: called.append(a))
    gpu = SimGPU()
    gpu.replay_steps(_recorded_run(2))
    assert called == []


@pytest.mark.cuda
def test_followed_peak_on_a_real_gpu() -> None:
    """Ground truth: the allocator's own peak, reset at each step start (the test may reset it;
    the meter never does). An MLP's tensors are small-pool blocks, so from the second step (the
    cuBLAS workspace exists by then) the followed peak is the allocator's exactly."""
    dev = torch.device("cuda:0")
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    net = net.to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    meter = StepMeter(net, opt).start()
    try:
        for step in range(3):
            x = torch.randn(64, 256, device=dev)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            meter.begin_step()
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            peaks = meter.end_step()
            truth = torch.cuda.max_memory_allocated(dev)
            followed = peaks.allocator_step_peak["cuda:0"]
            assert followed <= truth
            if step >= 1:
                assert followed == truth, (step, followed, truth, peaks.allocator_unseen)
    finally:
        meter.stop()
