"""Lightning ``MemoryCallback``: three steps of a tiny model built in code (no downloads).

Ground truth, computed another way for each step: the bytes live at the step's start from a
census of every live tensor (``inspect_memory(all_live=True)``, minus what was alive before
training other than the model: the dataset, which exists before the callback's tracker), and the step's rise from
PyTorch's profiler (every allocation and free the CPU allocator reports, summed in time order).
The profiler also sees the few-byte scalars a kernel wraps internally (``x / 2.0``) that never
surface as a tensor, so the two agree to within :data:`SLACK` bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import _step_census as sc

pl = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from torchmem.errors import InvalidInputError  # noqa: E402
from torchmem.integrations.lightning import MemoryCallback, check_version  # noqa: E402

SLACK = 128


class Census(pl.Callback):  # type: ignore[misc]
    """Runs before MemoryCallback at a step's start and before it at the step's end."""

    def __init__(self, outside: int) -> None:
        self.outside = outside
        self.starts: list[int] = []
        self.rises: list[int] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        self.starts.append(sc.census() - self.outside)
        self.prof = sc.StepProfile()

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, idx: int) -> None:
        self.rises.append(self.prof.rise())


class Recorder(pl.loggers.Logger):  # type: ignore[misc]
    """The trainer's own logger path: what log_dict sends reaches log_metrics here."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.rows.append(dict(metrics))


class Tiny(pl.LightningModule):  # type: ignore[misc]
    """Fails at batch ``fail_at`` in ``fail_in`` (forward, backward, clip or optimizer)."""

    def __init__(self, fail_at: int = -1, fail_in: str = "forward", kind: str = "torch") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.fail_at, self.fail_in, self.kind = fail_at, fail_in, kind

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        failing = idx == self.fail_at
        if failing and self.fail_in == "forward":
            sc.raise_oom(self.kind)
        x, y = batch
        out = self.net(x)
        if failing and self.fail_in == "backward":
            out = sc.fail_in_backward(out, self.kind)
        return torch.nn.functional.mse_loss(out, y)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.fail_in == "clip" and self.global_step == self.fail_at:
            sc.raise_oom(self.kind)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fail_in == "optimizer":
            return sc.FailingAdam(self.parameters(), self.fail_at + 1, self.kind)
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _trainer(tmp_path: Path, callbacks: list[Any], logger: Any = False) -> Any:
    return pl.Trainer(
        max_steps=3, callbacks=callbacks, accelerator="cpu", logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1, default_root_dir=str(tmp_path), gradient_clip_val=1.0,
    )


def test_logged_peaks_equal_an_independent_census(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 32), torch.randn(48, 1))
    model = Tiny()
    census, cb, rec = Census(sc.outside(model)), MemoryCallback(), Recorder()
    _trainer(tmp_path, [census, cb], logger=rec).fit(model, DataLoader(data, batch_size=16))
    assert len(cb.history) == 3
    for peaks, start, rise in zip(cb.history, census.starts, census.rises):
        assert abs(peaks.live_at_start["cpu"] - start) <= SLACK
        assert 0 <= rise - (peaks.peak["cpu"] - peaks.live_at_start["cpu"]) <= SLACK
        # the phases' peaks never exceed the step's, and the step's is one of them
        assert max(p["cpu"] for p in peaks.by_phase.values()) == peaks.peak["cpu"]
    # the first step allocates the gradients and Adam's state: 4 x 2177 float32 + 2 steps
    params = sum(p.numel() for p in Tiny().parameters()) * 4
    assert params == 8708
    growth = cb.history[1].live_at_start["cpu"] - cb.history[0].live_at_start["cpu"]
    assert growth >= 3 * params  # gradients + exp_avg + exp_avg_sq
    # what the trainer's logger received is what the callback measured
    logged = [r for r in rec.rows if "memory/peak_bytes" in r]
    assert [int(r["memory/peak_bytes"]) for r in logged] == [p.peak["cpu"] for p in cb.history]
    assert [int(r["memory/backward_peak_bytes"]) for r in logged] == [
        p.by_phase["backward"]["cpu"] for p in cb.history
    ]


@pytest.mark.parametrize(("part", "kind"), sc.OOM_CASES)
def test_out_of_memory_in_any_part_of_a_step_writes_a_trace(
    tmp_path: Path, part: str, kind: str
) -> None:
    """The third step fails: in its forward, backward, gradient clipping or optimizer step."""
    import torchmem

    data = TensorDataset(torch.randn(48, 32), torch.randn(48, 1))
    model = Tiny(fail_at=2, fail_in=part, kind=kind)
    cb = MemoryCallback(oom_dir=str(tmp_path / "oom"))
    error = torch.OutOfMemoryError if kind == "torch" else RuntimeError
    with pytest.raises(error, match="out of memory|can't allocate memory"):
        _trainer(tmp_path, [cb]).fit(model, DataLoader(data, batch_size=16))
    assert cb.oom_file == str(tmp_path / "oom" / "torchmem-oom-rank0-step2.tmtrace")
    trace = torchmem.load_trace(cb.oom_file)
    assert sum(1 for e in trace.events() if e.op == "step") == 2  # two steps completed
    assert len(cb.history) == 2
    # parameters, gradients and Adam's two moments are live where the error was raised
    params = sum(p.numel() for p in model.parameters()) * 4
    assert trace.live_bytes()["cpu"] >= 3 * params


def test_an_error_that_is_not_out_of_memory_writes_nothing(tmp_path: Path) -> None:
    class Buggy(Tiny):
        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            raise ValueError("a bug in the user's code")

    data = TensorDataset(torch.randn(48, 32), torch.randn(48, 1))
    cb = MemoryCallback(oom_dir=str(tmp_path / "oom"))
    with pytest.raises(ValueError, match="a bug"):
        _trainer(tmp_path, [cb]).fit(Buggy(), DataLoader(data, batch_size=16))
    assert cb.oom_file is None and not (tmp_path / "oom").exists()


def test_unsupported_version_says_which_are_supported() -> None:
    with pytest.raises(InvalidInputError, match=r"supports Lightning >=2.0; this is '1.9.5'"):
        check_version("1.9.5")
