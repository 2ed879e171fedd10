"""The memory levers, applied by torchmem to the user's own model and optimizer at run time.

An estimate made with levers (:func:`torchmem.fit.run._engine.run_once`'s ``levers``) runs the
user's ``build`` and ``step`` unchanged; :class:`LeverRun` finds the model and the optimizer as
they are made and changes them the way a user would by hand:

- **the model** is found when it is first called: a module called outside any other module's
  call is a *root* (the model; a loss module too). Before its first call, ``checkpoint`` wraps
  each *repeated block* (the children of a ``ModuleList``/``Sequential`` of two or more modules
  of one class, outermost first) so that its forward runs under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, as
  ``x = checkpoint(block, x, use_reentrant=False)`` written in the parent's forward would;
  ``autocast`` runs every call of a root under ``torch.autocast("cuda", dtype)``, as
  ``with torch.autocast("cuda", dtype): out = model(x)`` would (with ``scaler``, fp16's
  gradient scaler: one ``torch.amp.GradScaler("cuda")``, made with the first optimizer; a
  one-element tensor's ``backward()`` runs as ``scaler.scale(loss).backward()`` and each
  optimizer's ``step()`` as ``scaler.step(opt); scaler.update()``); ``bf16_weights`` converts the
  roots holding the optimizer's parameters with ``.to(torch.bfloat16)`` when the optimizer is
  made (before it, as ``model.to(torch.bfloat16)`` written before the optimizer would; roots
  first called without an optimizer are converted at that call) and casts the floating-point
  tensor arguments of their calls to bfloat16 (``model(x.to(torch.bfloat16))``).
- **the optimizer** is found when it is made (every ``torch.optim.Optimizer``): ``optimizer``
  passes ``fused=True`` / ``foreach=True`` / ``foreach=False, fused=False`` to the
  optimizer's own constructor (when it takes them); ``replace_optimizer`` makes the optimizer
  another class on the same parameter groups and learning rate (``torch.optim.Adafactor``,
  :class:`torchmem.fit.Adam8bitStandIn`); ``fsdp`` applies FSDP2's ``fully_shard`` to each
  repeated block and then to the root holding the optimizer's parameters, before the
  optimizer is made, and gives the optimizer the sharded parameters (as the FSDP2 tutorial's
  code does); the estimate runs under the fake process group of that many ranks; ``lora``
  wraps each root holding the optimizer's parameters with peft's
  ``get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=<its attention
  projections>, lora_dropout=0.0))`` (``fan_in_fan_out=True`` for GPT-2's ``Conv1D``) before the optimizer is made (after ``bf16_weights``'
  conversion), and gives the optimizer the trainable parameters (the adapters), in the
  wrapped model's order, as ``AdamW(p for p in model.parameters() if p.requires_grad)``
  written after ``get_peft_model`` would (:func:`attention_projections` finds the targets);
  a transformers ``Trainer`` is given ``get_peft_model(model, ...)`` instead of its model
  when it is made, as a user passing a peft model to it would;
  ``offload_optimizer`` makes the optimizer on pinned host copies of the parameters that
  train (``torch.empty_like(p, device="cpu", pin_memory=True)`` filled from ``p``, and a
  pinned host gradient, parameter by parameter), after the other changes; its ``step()``
  copies each GPU gradient into the host one, steps on the host and copies each parameter
  back into the GPU one, and its ``zero_grad()`` drops the GPU gradients (ZeRO-Offload, as
  DeepSpeed and torchao's ``CPUOffloadOptimizer`` do it).
- **the step**: ``accumulate=k`` builds the batch as ``batch_size // k`` and runs ``step()``
  ``k`` times per optimizer step, the optimizers' ``step()`` and ``zero_grad()`` skipped in
  all but the last (gradients accumulate, as a hand-written accumulation loop does); a
  transformers ``Trainer`` made by ``build`` gets ``gradient_accumulation_steps`` times ``k``
  instead (its per-device batch is the micro-batch) and the step runs once.

``count_flops`` adds up the floating-point operations of every operator run
(``torch.utils.flop_counter``'s formulas), so the cost of recomputation can be given.

Example:
    >>> import torch
    >>> lr = LeverRun(checkpoint=True)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> with lr:
    ...     _ = net(torch.randn(2, 4))
    >>> lr.wrapped
    ['0', '1']
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchmem.fit.levers._hf import split_trainer_batch
from torchmem.fit.levers._lightning import patch_lightning
from torchmem.fit.levers._model_parts import (
    _cast,
    _checkpointed,
    _has_float_params,
    _roots_holding,
    _shard_targets,
    _unwrapped,
    attention_projections,
    repeated_blocks,
)
from torchmem.fit.levers._optimizer_parts import _closure_only, _host_copies, _same_kernels

__all__ = ["LeverRun", "attention_projections", "repeated_blocks"]



def _bind(opt: Any, name: str, fn: Callable[..., Any]) -> None:
    """Set ``opt.<name>`` to ``fn`` as a method bound to ``opt``: code that wraps an optimizer's
    ``step`` reads ``opt.step.__func__`` (torch's learning-rate schedulers do), which a plain
    function has not."""
    setattr(opt, name, types.MethodType(lambda _opt, *a, **k: fn(*a, **k), opt))


class LeverRun:
    """One estimate's levers (see the module's documentation); a context manager that
    installs them for ``build`` and ``step`` and records what it changed.

    ``checkpoint``: checkpoint each repeated block; ``autocast``: a dtype to autocast roots'
    calls to; ``weights_dtype``: convert the model's floating-point weights to it;
    ``optimizer``: keyword arguments for the optimizers' constructors
    (``{"fused": True, "foreach": False}``); ``replace_optimizer``: a class to make instead
    (called with the parameter groups and ``lr``); ``fsdp``: shard with ``fully_shard`` (the
    estimate must run with ``world_size``; ``"offload"``: with ``CPUOffloadPolicy``); ``accumulate``: micro-batches per optimizer step;
    ``lora``: the rank of LoRA adapters on the attention projections (0: none);
    ``scaler``: fp16's gradient scaler loop around backward and the optimizer's step;
    ``offload_optimizer``: the optimizer's state and step on the host;
    ``count_flops``: count floating-point operations.

    After the run: ``wrapped`` (the blocks checkpointed), ``roots`` (class names of the
    modules called at top level), ``optimizers`` (class names made), ``optimizer_refused``
    (why an optimizer change could not be made), ``converted``, ``sharded``, ``flops``;
    ``adapted`` (``(model class, target modules, adapted layers, trainable parameters,
    all parameters)`` per model given LoRA adapters) and ``lora_refused`` (why not);
    ``scaled`` (optimizers stepped through the gradient scaler); ``offloaded`` (``(optimizer
    class, parameters, their bytes)`` per optimizer moved to the host).

    Example:
        >>> import torch
        >>> lr = LeverRun(optimizer={"foreach": False, "fused": False})
        >>> with lr:
        ...     opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        >>> opt.defaults["foreach"], lr.optimizers
        (False, ['AdamW'])
    """

    def __init__(
        self,
        *,
        checkpoint: bool = False,
        autocast: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        optimizer: dict[str, Any] | None = None,
        replace_optimizer: type | None = None,
        fsdp: bool | str = False,
        accumulate: int = 1,
        lora: int = 0,
        scaler: bool = False,
        offload_optimizer: bool = False,
        count_flops: bool = False,
    ) -> None:
        self.checkpoint = checkpoint
        self.autocast = autocast
        self.weights_dtype = weights_dtype
        self.optimizer = dict(optimizer or {})
        self.replace_optimizer = replace_optimizer
        self.fsdp = fsdp
        self.accumulate = int(accumulate)
        self.lora = int(lora)
        self.scaler = scaler
        self.offload_optimizer = offload_optimizer
        self.count_flops = count_flops
        self.flops = 0
        self.wrapped: list[str] = []
        self.roots: list[str] = []
        self.optimizers: list[str] = []
        self.optimizer_refused: list[str] = []
        #: optimizers made with the lever's kernel choice already (``AdamW(fused=True)``)
        self.optimizer_already: list[str] = []
        self.converted: list[str] = []
        self.sharded: list[str] = []
        self.adapted: list[tuple[str, list[str], int, int, int]] = []
        self.lora_refused: list[str] = []
        #: the program's own LoRA run instead of peft's (litgpt's finetune_lora), in words
        self.lora_by = ""
        #: activation checkpointing the Trainer does itself, in words
        self.trainer_checkpoints = ""
        self.scaled: list[str] = []
        self.offloaded: list[tuple[str, int, int]] = []
        self.trainer_accumulates = False
        #: a script's run: it is one run of the whole script (its own loop); its batch option is
        #: divided by the caller, and every ``accumulate``-th optimizer step is made
        self.script_accumulates = False
        #: how the step accumulates itself once its batch is divided ("by the script: its own
        #: option multiplied", "by the program: ...", "by Lightning: ..."); "" when the lever's
        #: every k-th optimizer step does it
        self.accumulated_by = ""
        #: a script whose batch is set in code for a transformers ``Trainer``: the Trainer's own
        #: per_device_train_batch_size is divided where it is made (:func:`split_trainer_batch`)
        self.trainer_batch = False
        #: the optimizer a ``Trainer`` was told to make itself (its ``optim``), in words
        self.trainer_optimizer = ""
        #: the mixed precision a ``Trainer`` was told to run itself (Lightning's), in words
        self.trainer_precision = ""
        #: the sharding a ``Trainer`` was told to do itself (transformers' ``fsdp``), in words
        self.trainer_shards = ""
        self._grad_scaler: Any = None
        self._user_scales = False
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._done: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._opts: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._peft: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._tls = threading.local()
        self._undo: list[Callable[[], None]] = []

    def __getstate__(self) -> dict[str, Any]:
        """What a worker process hands back: the settings and what was changed (the patches,
        weak sets and thread state stay behind)."""
        keep = ("checkpoint", "autocast", "weights_dtype", "optimizer", "replace_optimizer",
                "fsdp", "accumulate", "lora", "scaler", "offload_optimizer", "count_flops",
                "flops", "wrapped", "roots", "optimizers", "optimizer_refused",
                "optimizer_already", "converted",
                "sharded", "adapted", "lora_refused", "scaled", "offloaded",
                "trainer_accumulates", "script_accumulates", "accumulated_by",
                "trainer_optimizer", "trainer_precision", "trainer_shards", "lora_by",
                "trainer_checkpoints")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.__dict__.update(state)

    # -- the step ----------------------------------------------------------------------------

    def batch(self, batch_size: int) -> int:
        """The batch ``build`` is called with (the micro-batch under accumulation).

        Example:
            >>> LeverRun(accumulate=4).batch(16)
            4
        """
        if self.script_accumulates or self.accumulated_by or self.trainer_batch:
            return batch_size  # the script's own batch option is divided instead
        return batch_size // self.accumulate if self.accumulate > 1 else batch_size

    def run_step(self, step: Callable[[], Any]) -> None:
        """One optimizer step: ``step()`` once, or ``accumulate`` times with the optimizers'
        ``step``/``zero_grad`` skipped in all but the last.

        Example:
            >>> calls = []
            >>> LeverRun(accumulate=2).run_step(lambda: calls.append(1)); calls
            [1, 1]
        """
        if (self.trainer_accumulates or self.script_accumulates or self.accumulated_by
                or self.trainer_batch):
            step()  # the Trainer (gradient_accumulation_steps) or the script's loop accumulates
            return
        for i in range(self.accumulate):
            if i < self.accumulate - 1:
                with self._skip_optimizer():
                    step()
            else:
                step()

    @contextlib.contextmanager
    def _skip_optimizer(self) -> Iterator[None]:
        def noop(*a: Any, **k: Any) -> None:
            _closure_only(a, k)  # step(closure): the forward and backward still run

        opts: list[Any] = list(self._opts)
        # the levers' own step/zero_grad (scaler, offload) are instance attributes too
        saved = [{k: o.__dict__[k] for k in ("step", "zero_grad") if k in o.__dict__}
                 for o in opts]
        for o in opts:
            _bind(o, "step", noop)
            _bind(o, "zero_grad", noop)
        try:
            yield
        finally:
            for o, before in zip(opts, saved):
                o.__dict__.pop("step", None)
                o.__dict__.pop("zero_grad", None)
                o.__dict__.update(before)

    def _every_kth_step(self, opt: Any) -> None:
        """A script's loop steps every iteration: ``opt.step`` is made every ``accumulate``-th
        call only, and ``opt.zero_grad`` only where the count of steps is a multiple of
        ``accumulate`` (before the first step, and after each step made), so gradients
        accumulate over ``accumulate`` iterations whether the loop zeroes before its forward
        or after its step (transformers' Trainer, which accumulates itself, is left alone)."""
        calls = [0]
        lever = self
        inner_step, inner_zero_grad = opt.step, opt.zero_grad  # the other levers' wrappers too

        def step(*args: Any, **kwargs: Any) -> Any:
            if lever.trainer_accumulates:
                return inner_step(*args, **kwargs)
            calls[0] += 1
            if calls[0] % lever.accumulate:
                # a micro-batch: its gradients accumulate (with step(closure), as Lightning
                # and LBFGS call it, the closure's forward and backward run, the step does not)
                return _closure_only(args, kwargs)
            return inner_step(*args, **kwargs)

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            if lever.trainer_accumulates or calls[0] % lever.accumulate == 0:
                return inner_zero_grad(*args, **kwargs)
            return None

        _bind(opt, "step", step)
        _bind(opt, "zero_grad", zero_grad)

    # -- installation --------------------------------------------------------------------------

    def __enter__(self) -> LeverRun:
        self._patch_call()
        self._patch_optimizers()
        if self.scaler:
            self._patch_backward()
        if self.accumulate > 1 or self.autocast is not None or self.fsdp:
            self._patch_lightning()
        self._patch_hf()
        return self

    def _patch_lightning(self) -> None:
        """Lightning's ``Trainer`` and ``Fabric`` apply the levers they have themselves
        (:func:`torchmem.fit.levers._lightning.patch_lightning`)."""
        self._undo.extend(patch_lightning(self))

    def _patch_hf(self) -> None:
        """The Hugging Face libraries apply the levers they have themselves, each patched where
        the step imports it (importing transformers here costs seconds per lever, in every
        forked worker, for a step that never uses it): transformers' ``Trainer``
        (:meth:`_patch_trainer_class`), its ``TrainingArguments``
        (:func:`torchmem.fit.levers._hf.patch_training_args`: fp16/bf16, checkpointing) and
        accelerate's ``Accelerator`` (:func:`torchmem.fit.levers._hf.patch_accelerator`: mixed
        precision, the FSDP2 plugin)."""
        from torchmem.fit.fakegpu._imports import when_imported
        from torchmem.fit.levers._hf import patch_accelerator, patch_training_args

        patches: dict[str, Callable[[Any], Callable[[], None] | None]] = {}
        if (self.accumulate > 1 or self.lora or self.fsdp
                or self.replace_optimizer in (torch.optim.Adafactor, _adam8bit())):
            patches["transformers.trainer"] = self._patch_trainer_class
        if self.autocast is not None or self.checkpoint:
            patches["transformers.training_args"] = lambda m: patch_training_args(self, m)
        if self.autocast is not None or self.fsdp:
            patches["accelerate.accelerator"] = lambda m: patch_accelerator(self, m)
        if patches:
            stack = contextlib.ExitStack()
            stack.enter_context(when_imported(patches))
            self._undo.append(stack.close)

    def _patch_trainer_class(self, module: Any) -> Callable[[], None] | None:
        """transformers' ``Trainer`` accumulates itself: its ``gradient_accumulation_steps``
        is multiplied by ``accumulate`` (its per-device batch is the micro-batch ``build`` was
        given), and each step runs once. With ``lora`` the ``Trainer`` is given
        ``get_peft_model(model, ...)`` instead of ``model``, as a user passing a peft model
        to it would (so its peft-aware code runs, and the adapters are made where the
        model is, before the ``Trainer`` moves it to the GPU). The ``adafactor`` lever sets its
        ``optim="adafactor"`` (transformers' own Adafactor, as the option written by hand).
        ``optimizer_8bit`` sets ``optim="adamw_bnb_8bit"`` where bitsandbytes is installed.
        The sharding levers set its own ``fsdp=True`` with ``fsdp_config={}`` (FSDP2 through
        accelerate: each ``_no_split_modules`` block, the embeddings, the model) or
        ``{"cpu_offload": True}``, as ``TrainingArguments(fsdp=True, ...)`` written by hand
        would; torchmem's own ``fully_shard`` then stays out. Patched on
        ``transformers.trainer`` once imported (:meth:`_patch_hf`)."""
        import importlib.util

        Trainer = getattr(module, "Trainer", None)  # noqa: N806 - the class, by its name
        if not isinstance(Trainer, type) or "__init__" not in vars(Trainer):
            return None
        orig = vars(Trainer)["__init__"]
        lever = self

        def init(trainer: Any, *args: Any, **kwargs: Any) -> None:
            targs = kwargs.get("args", args[1] if len(args) > 1 else None)
            if lever.trainer_batch and targs is not None:
                split_trainer_batch(lever, targs)
            if (lever.accumulate > 1 and targs is not None and not lever.accumulated_by
                    and hasattr(targs, "gradient_accumulation_steps")):
                # (not where the script's own option was multiplied: it feeds the Trainer)
                k = targs.gradient_accumulation_steps
                targs.gradient_accumulation_steps = k * lever.accumulate
                lever.trainer_accumulates = True
                lever.accumulated_by = (f"by the Trainer: gradient_accumulation_steps={k} -> "
                                        f"{k * lever.accumulate}")
            if (lever.replace_optimizer is torch.optim.Adafactor and targs is not None
                    and getattr(targs, "optim", None) is not None):
                # the Trainer's own way: optim="adafactor" (transformers' Adafactor)
                targs.optim = "adafactor"
                lever.trainer_optimizer = ("the Trainer's optim='adafactor' (transformers' "
                                           "Adafactor)")
            if (lever.replace_optimizer is _adam8bit() and targs is not None
                    and getattr(targs, "optim", None) is not None
                    and importlib.util.find_spec("bitsandbytes") is not None):
                # the Trainer's own way: optim="adamw_bnb_8bit" (bitsandbytes' 8-bit AdamW,
                # which runs under the estimate where bitsandbytes is installed)
                targs.optim = "adamw_bnb_8bit"
                lever.trainer_optimizer = ("the Trainer's optim='adamw_bnb_8bit' "
                                           "(bitsandbytes' 8-bit AdamW)")
            if (lever.fsdp and targs is not None and not getattr(targs, "fsdp", True)
                    and hasattr(targs, "_process_fsdp_args")):
                # the Trainer's own way: what TrainingArguments(fsdp=True, fsdp_config=...)
                # makes of it (accelerate's FSDP2 plugin arguments)
                config = {"cpu_offload": True} if lever.fsdp == "offload" else {}
                targs.fsdp, targs.fsdp_config = True, dict(config)
                targs.fsdp_plugin_args = targs._process_fsdp_args()
                lever.trainer_shards = f"by the Trainer: fsdp=True, fsdp_config={config}"
            model = kwargs.get("model", args[0] if args else None)
            if (lever.lora and isinstance(model, torch.nn.Module) and model not in lever._peft
                    and importlib.util.find_spec("peft") is not None):
                wrapped = lever._get_peft_model(model)
                if wrapped is not None:  # the Trainer given the peft model, as by hand
                    if "model" in kwargs:
                        kwargs["model"] = wrapped
                    else:
                        args = (wrapped, *args[1:])
            orig(trainer, *args, **kwargs)

        functools.update_wrapper(init, orig)  # inspect.signature(Trainer) as written
        setattr(Trainer, "__init__", init)  # noqa: B010
        return lambda: setattr(Trainer, "__init__", orig)

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch_call(self) -> None:
        cls = torch.nn.Module
        orig = cls.__call__
        lever = self

        def call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            tls = lever._tls
            depth = getattr(tls, "depth", 0)
            ctx: Any = None
            if depth == 0:
                if module not in lever._seen:
                    lever._roots.add(module)
                    lever.roots.append(type(module).__name__)
                    lever._first_call(module)
                if module in lever._roots:
                    if lever.weights_dtype is not None and module in lever._done:
                        args = _cast(args, lever.weights_dtype)
                        kwargs = _cast(kwargs, lever.weights_dtype)
                    if lever.autocast is not None and not lever.trainer_precision:
                        ctx = torch.autocast("cuda", dtype=lever.autocast)
            lever._seen.add(module)
            tls.depth = depth + 1
            try:
                if ctx is None:
                    return orig(module, *args, **kwargs)
                with ctx:
                    return orig(module, *args, **kwargs)
            finally:
                tls.depth = depth

        functools.update_wrapper(call, orig)
        cls.__call__ = call  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(cls, "__call__", orig))

    def _first_call(self, root: torch.nn.Module) -> None:
        for m in root.modules():
            self._seen.add(m)
        if self.checkpoint and not self.trainer_checkpoints:
            for name, block in repeated_blocks(root):
                if getattr(block.forward, "__torchmem_checkpointed__", False):
                    continue
                block.forward = _checkpointed(block.forward)  # type: ignore[method-assign]
                self.wrapped.append(name)
        if self.weights_dtype is not None and root not in self._done and _has_float_params(root):
            self._convert(root)

    def _convert(self, root: torch.nn.Module) -> None:
        root.to(self.weights_dtype)
        self._done.add(root)
        self.converted.append(type(root).__name__)

    def _patch_optimizers(self) -> None:
        from torch.optim import Optimizer

        lever = self
        classes = [c for c in vars(torch.optim).values()
                   if isinstance(c, type) and issubclass(c, Optimizer) and "__init__" in vars(c)]
        from torchmem.fit.fakegpu._bnb import Adam8bitStandIn

        classes.append(Adam8bitStandIn)
        if Optimizer not in classes:
            classes.append(Optimizer)

        for c in dict.fromkeys(classes):
            orig = vars(c)["__init__"]

            def init(self: Any, params: Any, *args: Any, __orig: Any = orig, __cls: Any = c,
                     **kwargs: Any) -> None:
                tls = lever._tls
                if getattr(tls, "in_opt", False):
                    __orig(self, params, *args, **kwargs)
                    return
                tls.in_opt = True
                try:
                    lever._make_optimizer(self, __cls, __orig, params, args, kwargs)
                finally:
                    tls.in_opt = False

            # the signature as written: scripts look for options in it (nanoGPT and litgpt
            # pass fused=True where "fused" in inspect.signature(torch.optim.AdamW).parameters)
            functools.update_wrapper(init, orig)
            setattr(c, "__init__", init)  # noqa: B010
            self._undo.append(lambda c=c, orig=orig: setattr(c, "__init__", orig))  # type: ignore[misc]

    def _make_optimizer(self, opt: Any, cls: type, orig: Any, params: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
        params = list(params) if not isinstance(params, torch.Tensor) else [params]
        self.optimizers.append(type(opt).__name__)
        self._opts.add(opt)
        if self.weights_dtype is not None or self.fsdp or self.lora:
            params = self._model_changes(params)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.offload_optimizer:
            params, pairs = _host_copies(params)
        self._make(opt, cls, orig, params, args, kwargs)
        if pairs is not None:
            self._offload(opt, pairs)
        elif self.scaler:
            self._scale(opt)
        if self.script_accumulates and self.accumulate > 1:
            self._every_kth_step(opt)  # outermost: a skipped call skips the wrappers too

    def _make(self, opt: Any, cls: type, orig: Any, params: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        import inspect

        if (self.replace_optimizer is not None and type(opt) is not self.replace_optimizer
                and not self.trainer_optimizer):  # the Trainer made the one asked for
            new = self.replace_optimizer
            lr = kwargs.get("lr", args[0] if args else None)
            opt.__class__ = new
            extra = {} if lr is None else {"lr": lr}
            vars(new)["__init__"](opt, params, **extra)
            return
        if self.optimizer:
            try:
                sig = inspect.signature(orig)
            except (TypeError, ValueError):
                sig = None
            names = set(sig.parameters) if sig is not None else set()
            missing = [k for k in self.optimizer if k not in names]
            if missing:
                self.optimizer_refused.append(
                    f"{type(opt).__name__} takes no {', '.join(k + '=' for k in missing)} argument"
                )
            else:
                if _same_kernels(kwargs, self.optimizer):
                    shown = ", ".join(f"{k}={kwargs[k]!r}" for k in ("fused", "foreach")
                                      if kwargs.get(k) is not None)
                    self.optimizer_already.append(f"{type(opt).__name__}({shown})")
                kwargs = {**kwargs, **self.optimizer}
        orig(opt, params, *args, **kwargs)

    # -- the optimizer's step: gradient scaler, host offload ----------------------------------

    def _scale(self, opt: Any) -> None:
        """``fp16_autocast``'s gradient scaler: one ``torch.amp.GradScaler("cuda")`` for the
        run; the optimizer's ``step()`` becomes ``scaler.step(opt); scaler.update()`` (and
        ``loss.backward()`` is ``scaler.scale(loss).backward()``, :meth:`_patch_backward`)."""
        if self._grad_scaler is None:
            self._grad_scaler = torch.amp.GradScaler("cuda")
        scaler = self._grad_scaler
        inner = opt.step
        lever = self

        def step(*args: Any, **kwargs: Any) -> Any:
            tls = lever._tls
            if getattr(tls, "in_step", False) or lever._user_scales:
                return inner(*args, **kwargs)  # scaler.step calls optimizer.step()
            tls.in_step = True
            try:
                out = scaler.step(opt, *args, **kwargs)
                scaler.update()
                return out
            finally:
                tls.in_step = False

        _bind(opt, "step", step)
        self.scaled.append(type(opt).__name__)

    def _offload(self, opt: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``cpu_offload_optimizer``: ``opt`` was made on pinned host copies of its
        parameters (:func:`_host_copies`); its ``step()`` copies each GPU gradient into its
        host copy's gradient, steps on the host, and copies each updated host parameter back
        into the GPU one; ``zero_grad()`` drops the GPU gradients (the host ones are kept)."""
        inner = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            with torch.no_grad():
                for dev, host in pairs:
                    if dev.grad is not None and host.grad is not None:
                        host.grad.copy_(dev.grad)
                out = inner(*args, **kwargs)
                for dev, host in pairs:
                    dev.copy_(host)
            return out

        def zero_grad(set_to_none: bool = True) -> None:
            for dev, _ in pairs:
                dev.grad = None

        _bind(opt, "step", step)
        _bind(opt, "zero_grad", zero_grad)
        self.offloaded.append((type(opt).__name__, len(pairs),
                               sum(d.numel() * d.element_size() for d, _ in pairs)))

    def _patch_backward(self) -> None:
        """``loss.backward()`` of a one-element tensor, once an optimizer is made, runs as
        ``scaler.scale(loss).backward()``; not once the step scales with a ``GradScaler``
        of its own (then the lever's scaler stays out of backward and the step)."""
        orig = torch.Tensor.backward
        lever = self

        def backward(t: torch.Tensor, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
            tls = lever._tls
            scaler = lever._grad_scaler
            if (scaler is None or lever._user_scales or gradient is not None
                    or t.numel() != 1 or getattr(tls, "in_backward", False)):
                return orig(t, gradient, *args, **kwargs)
            tls.in_backward = True
            try:
                return orig(scaler.scale(t), None, *args, **kwargs)
            finally:
                tls.in_backward = False

        torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]
        self._undo.append(lambda: setattr(torch.Tensor, "backward", orig))
        # a step with its own GradScaler (a Trainer's fp16, a hand-written loop) keeps it alone
        scaler_cls = torch.amp.GradScaler
        scale = scaler_cls.scale

        def user_scale(scaler: Any, outputs: Any) -> Any:
            if scaler is not lever._grad_scaler:
                lever._user_scales = True
            return scale(scaler, outputs)

        scaler_cls.scale = user_scale  # type: ignore[method-assign,assignment]
        self._undo.append(lambda: setattr(scaler_cls, "scale", scale))

    def _model_changes(self, params: list[Any]) -> list[Any]:
        """bf16 weights, LoRA and FSDP at the optimizer's making: on the roots holding
        ``params``."""
        flat: list[Any] = []
        for p in params:
            if isinstance(p, dict):
                flat.extend(p["params"] if not isinstance(p["params"], torch.Tensor)
                            else [p["params"]])
            else:
                flat.append(p)
        ids = {id(p) for p in flat}
        roots = _roots_holding(ids)
        for root in roots:
            if self.weights_dtype is not None and root not in self._done:
                self._convert(root)
        if self.lora and self.lora_by:
            self._own_adapters(roots)
        elif self.lora:
            params = self._adapt(roots, params)
        if not self.fsdp or self.trainer_shards:
            return params
        remap: dict[int, Any] = {}
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        kw: dict[str, Any] = ({"offload_policy": CPUOffloadPolicy()}
                              if self.fsdp == "offload" else {})
        targets = {id(t): t for r in roots for t in _shard_targets(_unwrapped(r))}
        # let go of the parameters fully_shard replaces: each block's originals are freed as
        # it is sharded, as with fully_shard written before the optimizer
        owned = {id(q) for t in targets.values() for q in t.parameters()}
        keys = [id(p) if isinstance(p, torch.Tensor) and id(p) in owned else p for p in params]
        params[:] = []
        flat.clear()
        for root in targets.values():  # once each (two roots may lead to one model)
            if isinstance(root, FSDPModule):
                continue  # sharded by an earlier optimizer (Lightning's fit() run again)
            old = {id(p): n for n, p in root.named_parameters()}
            for name, block in repeated_blocks(root):
                fully_shard(block, **kw)
                self.sharded.append(name)
            self.sharded.append(type(root).__name__)  # (fully_shard renames its class)
            fully_shard(root, **kw)
            new = dict(root.named_parameters())
            for i, n in old.items():
                if n in new:
                    remap[i] = new[n]
        out: list[Any] = []
        for p in keys:
            if isinstance(p, int):  # fully_shard keeps every parameter's name
                out.append(remap[p])
            elif isinstance(p, dict):
                ps = p["params"] if not isinstance(p["params"], torch.Tensor) else [p["params"]]
                out.append({**p, "params": [remap.get(id(q), q) for q in ps]})
            else:
                out.append(remap.get(id(p), p))
        return out

    def _get_peft_model(self, root: torch.nn.Module) -> torch.nn.Module | None:
        """``get_peft_model(root, LoraConfig(...))`` on ``root``'s attention projections,
        recorded in ``adapted``; ``None`` (the reason in ``lora_refused``) without them."""
        training, total = _trainable(root)
        if training and all("lora_" in n for n, _ in training):
            self.lora_refused.append(
                f"no change: {type(root).__name__} already trains LoRA adapters only "
                f"({sum(k for _, k in training):,} of {total:,} parameters)")
            return None
        targets = attention_projections(root)
        if not targets:
            self.lora_refused.append(
                f"no attention projections in {type(root).__name__} (Linear layers inside "
                "a module named attn or attention)")
            return None
        from peft import LoraConfig, get_peft_model  # seconds to import: only when it applies

        # GPT-2's Conv1D keeps its weight transposed: peft's fan_in_fan_out says so
        conv = any(type(m).__name__ == "Conv1D" for n, m in root.named_modules()
                   if n.rsplit(".", 1)[-1] in targets)
        config = LoraConfig(r=self.lora, lora_alpha=2 * self.lora,
                            target_modules=targets, lora_dropout=0.0,
                            fan_in_fan_out=conv)
        name = type(root).__name__
        with warnings.catch_warnings():  # transformers' deprecations, seen through peft
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = get_peft_model(root, config)
        mine = [p for p in wrapped.parameters() if p.requires_grad]
        layers = sum(1 for n, _ in root.named_modules()
                     if n.rsplit(".", 1)[-1] in targets and not n.endswith("base_layer"))
        total = sum(p.numel() for p in wrapped.parameters())
        self.adapted.append((name, targets, layers, sum(p.numel() for p in mine), total))
        self._peft.add(wrapped)
        return wrapped

    def _own_adapters(self, roots: list[torch.nn.Module]) -> None:
        """The program's own LoRA adapters (``lora_by``), recorded in ``adapted`` as peft's
        would be: the layers holding ``lora_`` parameters, trainable and all parameters."""
        for root in roots:
            training, total = _trainable(root)
            layers = {n.split(".lora_")[0] for n, _ in training if ".lora_" in n}
            self.adapted.append((type(root).__name__, [self.lora_by], len(layers),
                                 sum(k for _, k in training), total))

    def _adapt(self, roots: list[torch.nn.Module], params: list[Any]) -> list[Any]:
        """LoRA adapters on each root's attention projections (peft's ``get_peft_model``);
        the parameters the optimizer gets instead of ``params``: each wrapped root's
        trainable ones, in its order, where its first parameter was (frozen ones dropped)."""
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            self.lora_refused.append("peft is not installed (pip install peft)")
            return params
        owner: dict[int, int] = {}
        trainable: dict[int, list[Any]] = {}
        for i, root in enumerate(roots):
            if root in self._peft:  # wrapped when a Trainer was given it: its own parameters
                continue
            before = {id(p) for p in root.parameters()}
            wrapped = self._get_peft_model(root)
            if wrapped is None:
                continue
            owner.update(dict.fromkeys(before, i))
            trainable[i] = [p for p in wrapped.parameters() if p.requires_grad]

        def remap(ps: list[Any]) -> list[Any]:
            out: list[Any] = []
            for p in ps:
                i = owner.get(id(p))
                if i is None:
                    out.append(p)
                elif i in trainable:
                    out.extend(trainable.pop(i))
            return out

        out: list[Any] = []
        for p in params:
            if isinstance(p, dict):
                ps = p["params"] if not isinstance(p["params"], torch.Tensor) else [p["params"]]
                kept = remap(list(ps))
                if kept:
                    out.append({**p, "params": kept})
            else:
                out.extend(remap([p]))
        return out


def _trainable(root: torch.nn.Module) -> tuple[list[tuple[str, int]], int]:
    """``root``'s parameters that train, as ``(name, elements)``, and all its elements.

    Example:
        >>> net = torch.nn.Linear(2, 3); net.bias.requires_grad = False
        >>> _trainable(net)
        ([('weight', 6)], 9)
    """
    named = list(root.named_parameters())
    return ([(n, p.numel()) for n, p in named if p.requires_grad],
            sum(p.numel() for _, p in named))


def _adam8bit() -> type:
    """The ``optimizer_8bit`` lever's class (:class:`torchmem.fit.Adam8bitStandIn`)."""
    from torchmem.fit.fakegpu._bnb import Adam8bitStandIn

    return Adam8bitStandIn
