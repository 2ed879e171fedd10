"""``MemoryCallback`` for transformers' ``Trainer``: per-step memory peaks in the trainer's logs.

Install with ``pip install torchmem[transformers]``; transformers versions :data:`SUPPORTED`.

Per optimizer step (``on_step_begin`` to ``on_step_end``) it measures the peak of live tensor
memory and the peak of each phase (forward, backward, optimizer, other) with torchmem's
tracker, on CUDA the caching allocator's peak of the step (``memory/allocator_peak_bytes``), and
the maximum across ranks under DDP (see :mod:`torchmem.integrations._meter`, which also says how
peaks are followed without resetting PyTorch's counters). ``on_log`` adds the figures
to the ``logs`` the trainer hands its reporters (``memory/peak_bytes``, ...; the maximum over
the steps since the previous log) and to ``state.log_history``; the callback moves itself in
front of the reporting callbacks at ``on_train_begin`` so that they see them. ``history`` keeps
every step's :class:`~torchmem.integrations._meter.StepPeaks`.

Out of memory: ``Trainer`` has no exception hook for callbacks, so at ``on_train_begin`` the
callback finds the running ``Trainer`` (the caller of the callback handler) and wraps its
``training_step``: an out-of-memory error there writes the run's trace, per rank, to
``oom_dir`` (default ``args.output_dir``) as ``torchmem-oom-rank<r>-step<s>.tmtrace``, then
goes on. Use :meth:`MemoryCallback.attach` to do this explicitly.

Example:
    >>> from torchmem.integrations.transformers import MemoryCallback
    >>> MemoryCallback().history
    []
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from torchmem.errors import InvalidInputError
from torchmem.integrations._meter import StepMeter, StepPeaks, check_min_version, oom_path

try:
    import transformers
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "torchmem.integrations.transformers needs transformers; install it with "
        "'pip install torchmem[transformers]'"
    ) from None

__all__ = ["SUPPORTED", "MemoryCallback", "check_version"]

#: The transformers versions this callback supports.
SUPPORTED = ">=4.40"


def check_version(version: str) -> None:
    """Raise a clear error for a transformers version this callback does not support.

    Example:
        >>> check_version("4.46.0")
        >>> check_version("4.30.2")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: torchmem's transformers MemoryCallback supports transformers >=4.40; ...
    """
    check_min_version("transformers", "transformers", version, (4, 40), SUPPORTED)


def _running_trainer() -> Any:
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, transformers.Trainer):
            return obj
        f = f.f_back  # type: ignore[assignment]
    return None


class MemoryCallback(TrainerCallback):  # type: ignore[misc]
    """Adds each step's memory peaks to the ``Trainer``'s logs (see the module docstring).

    Example:
        >>> from transformers import TrainerCallback
        >>> isinstance(MemoryCallback(), TrainerCallback)
        True
    """

    def __init__(self, oom_dir: Optional[str] = None, prefix: str = "memory/") -> None:
        check_version(transformers.__version__)
        self.oom_dir = oom_dir
        self.prefix = prefix
        self.history: list[StepPeaks] = []
        self.oom_file: Optional[str] = None
        self._meter: Optional[StepMeter] = None
        self._unlogged: list[StepPeaks] = []
        self._attached: Any = None

    def attach(self, trainer: Any) -> MemoryCallback:
        """Put this callback first among ``trainer``'s callbacks and guard its
        ``training_step`` for out-of-memory errors (done automatically at train begin).

        Example:
            >>> cb = MemoryCallback()
            >>> cb.attach(object())  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: MemoryCallback.attach expects a transformers.Trainer...
        """
        if not isinstance(trainer, transformers.Trainer):
            raise InvalidInputError(
                f"MemoryCallback.attach expects a transformers.Trainer, received "
                f"{type(trainer).__name__}; pass the Trainer you call .train() on"
            )
        if self._attached is trainer:
            return self
        self._attached = trainer
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        step_fn = trainer.training_step
        callback = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return step_fn(*args, **kwargs)
            except BaseException as e:
                callback._failed(e, trainer)
                raise

        trainer.training_step = training_step  # type: ignore[method-assign]
        return self

    def _failed(self, exc: BaseException, trainer: Any) -> None:
        from torchmem.capture.recording import is_oom_error

        meter, self._meter = self._meter, None
        if meter is None:
            return
        meter.stop()
        if is_oom_error(exc):
            folder = self.oom_dir or getattr(trainer.args, "output_dir", None) or os.getcwd()
            os.makedirs(folder, exist_ok=True)
            self.oom_file = oom_path(folder, int(trainer.state.global_step))
            meter.tracker.save(self.oom_file)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _running_trainer()
        if trainer is not None:
            self.attach(trainer)
        objects = [o for o in (kwargs.get("model"), kwargs.get("optimizer")) if o is not None]
        self._meter = StepMeter(*objects).start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._meter is not None:
            self._meter.begin_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._meter is None:
            return
        peaks = self._meter.end_step()
        self.history.append(peaks)
        self._unlogged.append(peaks)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict[str, Any]] = None,
               **kwargs: Any) -> None:
        if logs is None or not self._unlogged:
            return
        merged: dict[str, int] = {}
        for peaks in self._unlogged:
            for k, v in peaks.metrics(self.prefix).items():
                merged[k] = max(merged.get(k, v), v)
        self._unlogged = []
        logs.update(merged)
        if state.log_history and isinstance(state.log_history[-1], dict):
            state.log_history[-1].update(merged)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._meter is not None:
            self._meter.stop()
            self._meter = None
