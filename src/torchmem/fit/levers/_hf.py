"""The levers transformers' ``Trainer`` applies itself, set where its arguments are made:
``TrainingArguments`` made while a lever is on get ``fp16=True``/``bf16=True`` (the autocast
levers: its accelerate mixed precision and gradient scaler, instead of torchmem's) and
activation checkpointing (``activation_checkpointing=True``; ``gradient_checkpointing=True``
before transformers 5), as those options written by hand (``--fp16``,
``--gradient_checkpointing`` on a script's command line) would; an option the program already
gives is kept.

Example:
    >>> from types import SimpleNamespace
    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class TrainingArguments:
    ...     fp16: bool = False
    ...     bf16: bool = False
    ...     gradient_checkpointing: bool = False
    >>> lever = SimpleNamespace(autocast=torch.float16, checkpoint=True, trainer_precision="",
    ...                         trainer_checkpoints="", _user_scales=False)
    >>> undo = patch_training_args(lever, SimpleNamespace(TrainingArguments=TrainingArguments))
    >>> TrainingArguments()
    TrainingArguments(fp16=True, bf16=False, gradient_checkpointing=True)
    >>> lever.trainer_precision, lever.trainer_checkpoints
    ('by the Trainer: fp16=True', 'by the Trainer: gradient_checkpointing=True')
    >>> undo(); TrainingArguments()
    TrainingArguments(fp16=False, bf16=False, gradient_checkpointing=False)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["patch_training_args"]


def patch_training_args(lever: Any, module: Any) -> Callable[[], None] | None:
    """Wrap ``module.TrainingArguments.__init__`` (``module``: ``transformers.training_args``)
    so that arguments made while ``lever`` is on get its precision and checkpointing as the
    Trainer's own options; the undo callable (``None`` where there is no such class)."""
    cls = getattr(module, "TrainingArguments", None)
    if not isinstance(cls, type) or "__init__" not in vars(cls):
        return None
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    checkpoint = next((n for n in ("activation_checkpointing", "gradient_checkpointing")
                       if n in names), None)
    orig = vars(cls)["__init__"]

    def init(targs: Any, *args: Any, **kwargs: Any) -> None:
        if (lever.autocast is not None and not lever.trainer_precision
                and not kwargs.get("fp16") and not kwargs.get("bf16")
                and {"fp16", "bf16"} <= names):
            key = "fp16" if lever.autocast == torch.float16 else "bf16"
            kwargs[key] = True
            lever.trainer_precision = f"by the Trainer: {key}=True"
            lever._user_scales = True  # the Trainer's own scaler: the lever's stays out
        if (lever.checkpoint and checkpoint is not None and not lever.trainer_checkpoints
                and not kwargs.get(checkpoint)):
            kwargs[checkpoint] = True
            lever.trainer_checkpoints = f"by the Trainer: {checkpoint}=True"
        orig(targs, *args, **kwargs)

    functools.update_wrapper(init, orig)
    setattr(cls, "__init__", init)  # noqa: B010
    return lambda: setattr(cls, "__init__", orig)
