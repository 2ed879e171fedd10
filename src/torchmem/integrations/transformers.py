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

Out of memory, in any part of a step: ``Trainer`` has no exception hook for callbacks, so the
callback finds the ``Trainer`` that calls it (the caller of its callback handler) and guards,
on that instance, every call a step makes: ``training_step`` (forward and backward),
``_clip_grad_norm`` (gradient clipping), the optimizer's and the LR scheduler's ``step``, and
``train`` itself (an error anywhere else: evaluation, ``zero_grad``, saving). It does so at
``on_init_end`` when it is passed to ``Trainer(callbacks=[...])``, else at ``on_train_begin``
(then ``train`` of that run is not guarded; the step's parts are). An out-of-memory error
(:func:`torchmem.capture.is_oom_error`: ``torch.OutOfMemoryError``, the CPU allocator's "can't
allocate memory", ``MemoryError``) writes the run's trace, per rank, to ``oom_dir`` (default
``args.output_dir``) as ``torchmem-oom-rank<r>-step<s>.tmtrace`` where it was raised, then goes
on. Use :meth:`MemoryCallback.attach` to do this explicitly.

Example:
    >>> from torchmem.integrations.transformers import MemoryCallback
    >>> MemoryCallback().history
    []
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Optional

from torchmem.errors import InvalidInputError
from torchmem.integrations._meter import StepMeter, StepPeaks, check_min_version

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
        # weakly: a callback kept for its history must not keep the Trainer, its model (and under
        # DDP the process group the model holds) alive
        self._attached: Optional[weakref.ref[Any]] = None

    def attach(self, trainer: Any) -> MemoryCallback:
        """Put this callback first among ``trainer``'s callbacks and guard its ``train``,
        ``training_step`` and ``_clip_grad_norm`` for out-of-memory errors (done automatically,
        see the module docstring).

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
        if self._attached is not None and self._attached() is trainer:
            return self
        self._attached = weakref.ref(trainer)
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        for name in ("train", "training_step", "_clip_grad_norm"):
            self._guard(trainer, name, trainer)
        return self

    def _guard(self, obj: Any, name: str, trainer: Any) -> None:
        """Replace ``obj.name`` (on the instance) by a call that dumps the trace on an OOM."""
        fn = getattr(obj, name, None)
        if fn is None or getattr(fn, "_torchmem_guard", None) is self:
            return
        callback = self

        @functools.wraps(fn)  # keeps the marks others put on it (the LR scheduler's on step)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                callback._failed(e, trainer)
                raise

        guarded._torchmem_guard = self  # type: ignore[attr-defined]
        setattr(obj, name, guarded)

    def _failed(self, exc: BaseException, trainer: Any) -> None:
        meter, self._meter = self._meter, None
        if meter is not None:
            folder = self.oom_dir or getattr(trainer.args, "output_dir", None)
            self.oom_file = meter.fail(exc, folder, int(trainer.state.global_step)) or self.oom_file

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _running_trainer()
        if trainer is not None:
            self.attach(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._attached() if self._attached is not None else None
        trainer = trainer if trainer is not None else _running_trainer()
        if trainer is not None:
            self.attach(trainer)
            for part in (kwargs.get("optimizer"), kwargs.get("lr_scheduler")):
                if part is not None:
                    self._guard(part, "step", trainer)
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
