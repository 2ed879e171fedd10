"""transformers ``MemoryCallback``: three steps of a tiny model built in code (no downloads).

Ground truth per step, as in ``test_integrations_lightning``: the bytes live at the step's
start from a census of every live tensor (minus those alive before training other than the
model's parameters), and
the step's rise from PyTorch's profiler (every CPU allocation and free, summed in time order;
it also sees the few-byte scalars kernels wrap internally, hence :data:`SLACK`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import _step_census as sc

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torchmem.errors import InvalidInputError  # noqa: E402
from torchmem.integrations.transformers import MemoryCallback, check_version  # noqa: E402

SLACK = 128


class Census(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, outside: int) -> None:
        self.outside = outside
        self.starts: list[int] = []
        self.rises: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.starts.append(sc.census() - self.outside)
        self.prof = sc.StepProfile()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.rises.append(self.prof.rise())


class Tiny(torch.nn.Module):
    def __init__(self, fail_at_call: int = -1, fail_in: str = "forward", kind: str = "torch") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.calls = 0
        self.fail_at_call, self.fail_in, self.kind = fail_at_call, fail_in, kind

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        failing = self.calls == self.fail_at_call
        if failing and self.fail_in == "forward":
            sc.raise_oom(self.kind)
        out = self.net(x)
        if failing and self.fail_in == "backward":
            out = sc.fail_in_backward(out, self.kind)
        return {"loss": torch.nn.functional.mse_loss(out, labels)}


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(32, generator=g), "labels": torch.randn(1, generator=g)}
            for _ in range(48)]


def _trainer(tmp_path: Path, model: torch.nn.Module, data: Any, callbacks: list[Any],
             optimizer: Any = None) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=16,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=1e-3,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks,
                                optimizers=(optimizer, None))


def test_logged_peaks_equal_an_independent_census(tmp_path: Path) -> None:
    data = _data()
    model = Tiny()
    census, cb = Census(sc.outside(model)), MemoryCallback()
    trainer = _trainer(tmp_path, model, data, [census, cb])
    trainer.train()
    assert len(cb.history) == 3
    for peaks, start, rise in zip(cb.history, census.starts, census.rises):
        assert abs(peaks.live_at_start["cpu"] - start) <= SLACK, (peaks, start)
        assert 0 <= rise - (peaks.peak["cpu"] - peaks.live_at_start["cpu"]) <= SLACK, (peaks, rise)
        assert max(p["cpu"] for p in peaks.by_phase.values()) == peaks.peak["cpu"]
    # the trainer's own log history carries what the callback measured, step by step
    logged = [row for row in trainer.state.log_history if "memory/peak_bytes" in row]
    assert [row["memory/peak_bytes"] for row in logged] == [p.peak["cpu"] for p in cb.history]
    assert [row["memory/backward_peak_bytes"] for row in logged] == [
        p.by_phase["backward"]["cpu"] for p in cb.history
    ]
    # the first step leaves AdamW's two moments (2 x 2177 float32) and its step counters; the
    # trainer sets the gradients to None after each step
    growth = cb.history[1].live_at_start["cpu"] - cb.history[0].live_at_start["cpu"]
    assert 2 * 2177 * 4 <= growth <= 2 * 2177 * 4 + SLACK
    # it put itself first, before the reporting callbacks
    assert trainer.callback_handler.callbacks[0] is cb


@pytest.mark.parametrize(("part", "kind"), sc.OOM_CASES)
def test_out_of_memory_in_any_part_of_a_step_writes_a_trace(
    tmp_path: Path, part: str, kind: str
) -> None:
    """The third step fails: in its forward, backward, gradient clipping or optimizer step."""
    import torchmem

    model = Tiny(fail_at_call=3 if part in ("forward", "backward") else -1, fail_in=part, kind=kind)
    optimizer = sc.FailingAdam(model.parameters(), 3, kind) if part == "optimizer" else None
    cb = MemoryCallback(oom_dir=str(tmp_path / "oom"))
    trainer = _trainer(tmp_path, model, _data(), [cb], optimizer)
    if part == "clip":
        clip, calls = trainer.accelerator.clip_grad_norm_, []

        def failing_clip(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:
                sc.raise_oom(kind)
            return clip(*args, **kwargs)

        trainer.accelerator.clip_grad_norm_ = failing_clip
    error = torch.OutOfMemoryError if kind == "torch" else RuntimeError
    with pytest.raises(error, match="out of memory|can't allocate memory"):
        trainer.train()
    assert cb.oom_file == str(tmp_path / "oom" / "torchmem-oom-rank0-step2.tmtrace")
    trace = torchmem.load_trace(cb.oom_file)
    assert sum(1 for e in trace.events() if e.op == "step") == 2
    assert len(cb.history) == 2
    # the trace ends where the error was raised: the failing step's parameters and the
    # optimizer state of the two steps before are still live in it
    params = sum(p.numel() for p in model.parameters()) * 4
    assert trace.live_bytes()["cpu"] >= 3 * params


def test_an_error_that_is_not_out_of_memory_writes_nothing(tmp_path: Path) -> None:
    model = Tiny()
    cb = MemoryCallback(oom_dir=str(tmp_path / "oom"))
    trainer = _trainer(tmp_path, model, _data(), [cb])
    def bad(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a bug in the user's code")

    trainer.accelerator.clip_grad_norm_ = bad
    with pytest.raises(ValueError, match="a bug"):
        trainer.train()
    assert cb.oom_file is None and not (tmp_path / "oom").exists()


def test_unsupported_version_says_which_are_supported() -> None:
    with pytest.raises(InvalidInputError, match=r"supports transformers >=4.40; this is '4.30.2'"):
        check_version("4.30.2")
