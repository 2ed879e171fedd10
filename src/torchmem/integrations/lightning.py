"""``MemoryCallback`` for Lightning: per-step memory peaks through ``LightningModule.log_dict``.

Install with ``pip install torchmem[lightning]``. Works with ``lightning`` (``lightning.pytorch``)
and ``pytorch_lightning``, versions :data:`SUPPORTED` (2.0 and later).

Per training step (``on_train_batch_start`` to ``on_train_batch_end``) it logs
``memory/peak_bytes`` (the peak of live tensor memory on the model's device during the step,
from torchmem's tracker), ``memory/live_at_start_bytes`` and ``memory/<phase>_peak_bytes`` for
each phase the step went through; on CUDA also ``memory/allocator_peak_bytes`` (the caching
allocator's peak during the step, followed without resetting PyTorch's counters),
``memory/allocator_unseen_bytes`` (what the allocator holds that no tensor showed) and
``memory/allocator_peak_so_far_bytes`` (its running peak): see
:mod:`torchmem.integrations._meter`. Under DDP each
figure is the maximum across ranks. When training raises an out-of-memory error anywhere in a
step (``training_step``, backward, gradient clipping, the optimizer step: Lightning hands every
error escaping ``fit`` to ``on_exception``), the trace of the run is written per rank to ``oom_dir`` (default: the trainer's ``default_root_dir``) as
``torchmem-oom-rank<r>-step<s>.tmtrace`` before the error goes on. ``callback.history`` keeps
each step's :class:`~torchmem.integrations._meter.StepPeaks`.

Example:
    >>> from torchmem.integrations.lightning import MemoryCallback
    >>> MemoryCallback().history
    []
"""

from __future__ import annotations

from typing import Any, Optional

from torchmem.integrations._meter import StepMeter, StepPeaks, check_min_version

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError(
            "torchmem.integrations.lightning needs Lightning; install it with "
            "'pip install torchmem[lightning]' (or 'pip install lightning')"
        ) from None

__all__ = ["SUPPORTED", "MemoryCallback", "check_version"]

#: The Lightning versions this callback supports.
SUPPORTED = ">=2.0"


def check_version(version: str) -> None:
    """Raise a clear error for a Lightning version this callback does not support.

    Example:
        >>> check_version("2.6.6")
        >>> check_version("1.9.5")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: torchmem's Lightning MemoryCallback supports Lightning >=2.0; ...
    """
    check_min_version("Lightning", "lightning", version, (2,), SUPPORTED)


class MemoryCallback(pl.Callback):  # type: ignore[misc,name-defined]
    """Logs each training step's memory peaks through the LightningModule's ``log_dict``.

    Example:
        >>> import lightning.pytorch as pl
        >>> isinstance(MemoryCallback(), pl.Callback)
        True
    """

    def __init__(self, oom_dir: Optional[str] = None, prefix: str = "memory/") -> None:
        check_version(pl.__version__)
        super().__init__()
        self.oom_dir = oom_dir
        self.prefix = prefix
        self.history: list[StepPeaks] = []
        self.oom_file: Optional[str] = None
        self._meter: Optional[StepMeter] = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._meter = StepMeter(pl_module, *trainer.optimizers).start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._meter is not None:
            self._meter.begin_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._meter is None:
            return
        peaks = self._meter.end_step()
        self.history.append(peaks)
        metrics = {k: float(v) for k, v in peaks.metrics(self.prefix).items()}
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._meter is not None:
            self._meter.stop()
            self._meter = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        meter, self._meter = self._meter, None
        if meter is not None:
            folder = self.oom_dir or getattr(trainer, "default_root_dir", None)
            step = int(getattr(trainer, "global_step", meter.steps))
            self.oom_file = meter.fail(exception, folder, step) or self.oom_file
