"""The levers the Hugging Face libraries apply themselves.

transformers' ``Trainer``, set where its arguments are made: ``TrainingArguments`` (and their
subclasses) made while a lever is on get ``fp16=True``/``bf16=True`` (the autocast
levers: its accelerate mixed precision and gradient scaler, instead of torchmem's) and
activation checkpointing (``activation_checkpointing=True``; ``gradient_checkpointing=True``
before transformers 5), as those options written by hand (``--fp16``,
``--gradient_checkpointing`` on a script's command line) would; an option the program already
gives is kept. An accelerate ``Accelerator`` (a loop of one's own, run_clm_no_trainer's) made
while a lever is on gets ``mixed_precision="fp16"``/``"bf16"`` (its autocast, fp32 outputs and
gradient scaler) and, for the sharding levers, ``fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2)`` (``cpu_offload=True`` for ``cpu_offload``), as ``accelerate launch`` with
those settings would give; settings it is given (or its environment gives) are kept.

Example:
    >>> from types import SimpleNamespace
    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class TrainingArguments:
    ...     fp16: bool = False
    ...     bf16: bool = False
    ...     gradient_checkpointing: bool = False
    ...     def __post_init__(self):
    ...         pass
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

from torchmem.errors import InvalidInputError

__all__ = ["patch_training_args", "patch_accelerator", "split_trainer_batch"]


def patch_training_args(lever: Any, module: Any) -> Callable[[], None] | None:
    """Wrap ``module.TrainingArguments.__post_init__`` (``module``: ``transformers.training_args``;
    subclasses such as ``Seq2SeqTrainingArguments`` or TRL's configs run it too) so that
    arguments made while ``lever`` is on get its precision and checkpointing as the Trainer's own
    options, before the arguments derive the rest from them; the undo callable (``None`` where
    there is no such class)."""
    cls = getattr(module, "TrainingArguments", None)
    if not isinstance(cls, type) or "__post_init__" not in vars(cls):
        return None
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    checkpoint = next((n for n in ("activation_checkpointing", "gradient_checkpointing")
                       if n in names), None)
    orig = vars(cls)["__post_init__"]

    def post_init(targs: Any) -> None:
        if (lever.autocast is not None and not lever.trainer_precision
                and {"fp16", "bf16"} <= names and not targs.fp16 and not targs.bf16):
            key = "fp16" if lever.autocast == torch.float16 else "bf16"
            setattr(targs, key, True)
            lever.trainer_precision = f"by the Trainer: {key}=True"
            lever._user_scales = True  # the Trainer's own scaler: the lever's stays out
        if (lever.checkpoint and checkpoint is not None and not lever.trainer_checkpoints
                and not any(getattr(targs, n, None) for n in (
                    "activation_checkpointing", "gradient_checkpointing"))):
            setattr(targs, checkpoint, True)
            lever.trainer_checkpoints = f"by the Trainer: {checkpoint}=True"
        orig(targs)

    functools.update_wrapper(post_init, orig)
    setattr(cls, "__post_init__", post_init)  # noqa: B010
    return lambda: setattr(cls, "__post_init__", orig)


def split_trainer_batch(lever: Any, targs: Any) -> None:
    """A script that sets its batch in code (``TrainingArguments(per_device_train_batch_size=8)``,
    TRL's ``SFTConfig(...)``): the accumulation lever divides the Trainer's own per-device batch
    into ``lever.accumulate`` micro-batches and multiplies its ``gradient_accumulation_steps``,
    as the same two arguments written by hand would; a batch that does not divide is an error.

    Example:
        >>> from types import SimpleNamespace
        >>> lever = SimpleNamespace(accumulate=2, accumulated_by="", trainer_accumulates=False)
        >>> targs = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1)
        >>> split_trainer_batch(lever, targs); targs.per_device_train_batch_size, lever.accumulated_by
        (4, 'by the Trainer: per_device_train_batch_size=8 -> 4, gradient_accumulation_steps=1 -> 2')
    """
    b = getattr(targs, "per_device_train_batch_size", None)
    k = getattr(targs, "gradient_accumulation_steps", None)
    n = lever.accumulate
    if lever.accumulated_by or n < 2 or type(b) is not int or type(k) is not int:
        return
    if b % n:
        raise InvalidInputError(
            f"the Trainer's per_device_train_batch_size={b} (set in the script) does not split "
            f"into {n} micro-batches; expected a multiple of {n}")
    targs.per_device_train_batch_size, targs.gradient_accumulation_steps = b // n, k * n
    lever.trainer_accumulates = True
    lever.accumulated_by = (f"by the Trainer: per_device_train_batch_size={b} -> {b // n}, "
                            f"gradient_accumulation_steps={k} -> {k * n}")


def patch_accelerator(lever: Any, module: Any) -> Callable[[], None] | None:
    """Wrap ``module.Accelerator.__init__`` (``module``: ``accelerate.accelerator``) so that an
    ``Accelerator`` made while ``lever`` is on gets its precision and sharding as accelerate's
    own settings (see the module's documentation); the undo callable, or ``None``.

    Example:
        >>> from types import SimpleNamespace
        >>> class Accelerator:
        ...     def __init__(self, mixed_precision=None, fsdp_plugin=None):
        ...         self.mixed_precision = mixed_precision
        >>> lever = SimpleNamespace(autocast=torch.bfloat16, fsdp=False, trainer_precision="",
        ...                         trainer_shards="", _user_scales=False)
        >>> undo = patch_accelerator(lever, SimpleNamespace(Accelerator=Accelerator))
        >>> Accelerator().mixed_precision, lever.trainer_precision
        ('bf16', "by accelerate: Accelerator(mixed_precision='bf16')")
        >>> undo(); Accelerator().mixed_precision is None
        True
    """
    import os

    cls = getattr(module, "Accelerator", None)
    if not isinstance(cls, type) or "__init__" not in vars(cls):
        return None
    orig = vars(cls)["__init__"]

    def init(acc: Any, *args: Any, **kwargs: Any) -> None:
        env_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if (lever.autocast is not None and not lever.trainer_precision
                and kwargs.get("mixed_precision") is None and env_precision == "no"):
            # (a Trainer's own Accelerator is given mixed_precision="no" or its fp16/bf16)
            want = "fp16" if lever.autocast == torch.float16 else "bf16"
            kwargs["mixed_precision"] = want
            lever.trainer_precision = f"by accelerate: Accelerator(mixed_precision={want!r})"
            lever._user_scales = True  # accelerate's own scaler: the lever's stays out
        if (lever.fsdp and not lever.trainer_shards and not getattr(lever, "sharded", ())
                and kwargs.get("fsdp_plugin") is None
                and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true"):
            from accelerate.utils import FullyShardedDataParallelPlugin

            offload = lever.fsdp == "offload"
            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                   cpu_offload=offload)
            lever.trainer_shards = (
                "by accelerate: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin("
                f"fsdp_version=2{', cpu_offload=True' if offload else ''}))")
        orig(acc, *args, **kwargs)

    functools.update_wrapper(init, orig)
    setattr(cls, "__init__", init)  # noqa: B010
    return lambda: setattr(cls, "__init__", orig)
