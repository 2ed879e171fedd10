"""The published GPU runs of ``shared/data/public-gpu-truth.md`` rebuilt as estimate builds.

Not a test module. The transformers documentation page "Efficient Training on a Single GPU"
(``perf_train_gpu_one``, docs v4.18 to v4.2x, January 2022; its first part is
``docs/source/en/model_memory_anatomy.md``, the code is still in the repository's translated
copy ``docs/source/zh/perf_train_gpu_one.md``) fine-tunes bert-large-uncased for sequence
classification with transformers' ``Trainer`` on a Tesla V100-SXM2 16 GB and prints, after
``trainer.train()``, the GPU memory NVML reports as used. Each of its ten variants is one
:data:`VARIANTS` entry; :func:`bert_run` builds it as the page runs it, through the ``Trainer``
(or the page's hand-written ``accelerate`` loop), for :func:`torchmem.estimate`
(``steps=1``: the build's step runs ``trainer.train()`` for ``max_steps`` optimizer steps).

What is reproduced of 2022 (transformers about 4.16, torch about 1.10) and how:

- the ``Trainer``'s default optimizer then, transformers' own per-parameter AdamW
  (``optim="adamw_hf"``, gone from transformers 5): ``torch.optim.AdamW(foreach=False,
  fused=False)`` passed as ``optimizers=(opt, None)``, in the Trainer's two parameter groups
  (weight decay and no decay), lr 5e-5; the same one-parameter-at-a-time update (its
  ``denom`` temporary is one parameter large; torch's per-parameter loop makes a second one
  for the bias correction);
- eager BERT attention (``attn_implementation="eager"``: scores, softmax, dropout on the
  probabilities);
- torch 1.10's softmax, whose backward node kept its input besides its output (one more
  score-sized tensor per layer until backward; :class:`_Softmax2022`, pytorch/pytorch#49600:
  torch 2 keeps only the output), and torch 1.10's ``zero_grad()``, which zeroed gradients in
  place (``set_to_none=False`` until torch 2.0), so the second step runs its forward with last
  step's gradients still allocated (:func:`_zero_grad_2022`);
- ``fp16=True``: fp16 autocast and a gradient scaler (transformers 5 gets both from
  accelerate; 4.16 used ``torch.cuda.amp`` directly: the same autocast and scaler);
- ``gradient_checkpointing=True``: reentrant checkpointing of each layer as 4.16 did
  (``gradient_checkpointing_kwargs={"use_reentrant": True}``; transformers 5 defaults to the
  non-reentrant form);
- ``optim="adafactor"``: transformers' ``Adafactor`` (``scale_parameter=False,
  relative_step=False``, as the Trainer sets it);
- bitsandbytes ``Adam8bit``: :class:`torchmem.fit.Adam8bitStandIn` (bitsandbytes does not run
  here), with the page's two parameter groups and bitsandbytes 2022's block size (2048);
- the ``accelerate`` loop: ``Accelerator(mixed_precision="fp16", gradient_accumulation_steps=4)``
  (the page's ``Accelerator(fp16=True)`` of accelerate 0.5), the page's loop
  (``loss / 4``, ``accelerator.backward``, a step every 4 batches) and
  ``model.gradient_checkpointing_enable()`` (reentrant, as above).

Where the runs here must differ from 2022: ``evaluation_strategy="steps"`` without an evaluation
set is refused by transformers 5 (``eval_strategy``), and 4.16 would not have evaluated within
the run anyway (its first evaluation was due at step 500 of 128), so it is left out;
``max_steps`` is small (the peak is reached by the second optimizer step; the page ran 128);
``save_strategy="no"`` (4.16 saved nothing either: its first checkpoint was due at step 500);
the page's inputs have no attention mask, as here (transformers 5's BERT then adds no mask to
the scores; 4.16 added an all-zero extended mask, a short-lived score-sized temporary).

Example:
    >>> sorted(VARIANTS)[:2]
    ['accelerate_8bit', 'accum']
    >>> BERT_LARGE_UNCASED["hidden_size"], BERT_LARGE_UNCASED["num_hidden_layers"]
    (1024, 24)
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

#: The V100's CUDA context as the page measured it: NVML's used memory after
#: ``torch.ones((1, 1)).to("cuda")`` (MiB). Added to each estimate's peak reserved memory.
CONTEXT_MIB = 1343
#: The GPU the page ran on (nvidia-smi: ``Tesla V100-SXM2``, 16160 MiB).
GPU = "V100-16GB"
SEQ_LEN, DATASET_SIZE = 512, 512

#: bert-large-uncased's config.json as published on the Hugging Face Hub
#: (huggingface.co/google-bert/bert-large-uncased/blob/main/config.json), written out so that
#: nothing is downloaded; ``num_labels=2`` is what AutoModelForSequenceClassification adds.
BERT_LARGE_UNCASED: dict[str, Any] = {
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30522,
}


@dataclass(frozen=True)
class Variant:
    """One row of the page's table: its arguments and the GPU memory it printed (MiB)."""

    label: str
    published_mib: int
    batch: int = 4
    accumulation: int = 1
    checkpointing: bool = False
    fp16: bool = False
    optimizer: str = "adamw_hf"  # "adamw_hf", "adafactor" or "adam8bit"
    loop: str = "trainer"  # "trainer" or "accelerate"

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps to run: two (the second sees the optimizer state)."""
        return 2


_SMALL = {"batch": 1, "accumulation": 4}
#: The page's ten runs, in its order.
VARIANTS: dict[str, Variant] = {
    "vanilla": Variant("bs=4", 14949),
    "accum": Variant("bs=1, ga=4", 8681, **_SMALL),
    "accum_ckpt": Variant("bs=1, ga=4, gc", 6775, **_SMALL, checkpointing=True),
    "fp16": Variant("bs=4, fp16", 13939, fp16=True),
    "accum_ckpt_fp16": Variant("bs=1, ga=4, gc, fp16", 7275, **_SMALL, checkpointing=True,
                               fp16=True),
    "adafactor": Variant("bs=4, adafactor", 12295, optimizer="adafactor"),
    "accum_ckpt_fp16_adafactor": Variant("bs=1, ga=4, gc, fp16, adafactor", 4847, **_SMALL,
                                         checkpointing=True, fp16=True, optimizer="adafactor"),
    "adam8bit": Variant("bs=4, Adam8bit", 13085, optimizer="adam8bit"),
    "accum_ckpt_fp16_8bit": Variant("bs=1, ga=4, gc, fp16, Adam8bit", 5363, **_SMALL,
                                    checkpointing=True, fp16=True, optimizer="adam8bit"),
    "accelerate_8bit": Variant("accelerate loop: bs=1, ga=4, gc, fp16, Adam8bit", 5363, **_SMALL,
                               checkpointing=True, fp16=True, optimizer="adam8bit",
                               loop="accelerate"),
}


class DummyDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The page's dummy data: ``input_ids`` random integers in [100, 30000), ``labels`` from
    ``np.random.randint(0, 1, dataset_size)`` (all 0), rows given as torch tensors made on
    access, as ``datasets.Dataset.set_format("pt")`` gives them (datasets is not needed)."""

    def __init__(self, seq_len: int = SEQ_LEN, size: int = DATASET_SIZE) -> None:
        rng = np.random.default_rng(0)
        self.ids = rng.integers(100, 30000, (size, seq_len))
        self.labels = np.zeros(size, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.ids[i]), "labels": torch.tensor(self.labels[i])}


def _model(checkpointing_in_model: bool) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(**BERT_LARGE_UNCASED, num_labels=2, attn_implementation="eager")
    model = BertForSequenceClassification(cfg)  # built on the host ...
    if checkpointing_in_model:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.to("cuda")  # ... and moved, as the page's from_pretrained(...).to("cuda")


class _Softmax2022(torch.autograd.Function):
    """torch 1.10's softmax: its backward node kept the *input* as well as the output
    (``_softmax_backward_data(grad, result, dim, self)``; pytorch/pytorch#49600, changed after
    1.10 to keep only the input's dtype). Under CUDA autocast softmax runs in float32 (its fp32
    list), so the float32 copy of the input is what was kept."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:  # type: ignore[override]
        if torch.is_autocast_enabled("cuda") and x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        y = torch.softmax(x, dim)
        ctx.save_for_backward(x, y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, y = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, ctx.dim, x.dtype), None


@contextlib.contextmanager
def _torch_2022() -> Iterator[None]:
    """``torch.nn.functional.softmax`` as torch 1.10 ran it for autograd (:class:`_Softmax2022`)."""
    original = F.softmax

    def softmax(input: torch.Tensor, dim: Any = None, _stacklevel: int = 3,
                dtype: Any = None) -> torch.Tensor:
        if dtype is None and dim is not None and torch.is_grad_enabled() and input.requires_grad:
            return _Softmax2022.apply(input, dim)  # type: ignore[no-any-return]
        return original(input, dim, _stacklevel, dtype)

    F.softmax = softmax
    try:
        yield
    finally:
        F.softmax = original


def _zero_grad_2022(*objs: Any) -> None:
    """torch 1.10's ``zero_grad()``: gradients zeroed in place and kept (``set_to_none=False``,
    the default until torch 2.0), where torch 2 sets them to ``None``: 4.16's Trainer called
    ``model.zero_grad()``, the page's accelerate loop ``optimizer.zero_grad()``."""
    for obj in objs:
        method = obj.zero_grad

        def zero_grad(set_to_none: bool = False, _method: Any = method) -> None:
            _method(set_to_none=set_to_none)
        obj.zero_grad = zero_grad


def _groups(model: Any, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """The page's two parameter groups (weight decay; biases and LayerNorm weights without)."""
    from transformers.trainer_pt_utils import get_parameter_names

    decay = [n for n in get_parameter_names(model, [torch.nn.LayerNorm]) if "bias" not in n]
    return [
        {"params": [p for n, p in model.named_parameters() if n in decay],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]


def _optimizer(v: Variant, model: Any, lr: float) -> Any:
    if v.optimizer == "adamw_hf":
        return torch.optim.AdamW(_groups(model), lr=lr, foreach=False, fused=False)
    if v.optimizer == "adam8bit":
        from torchmem.fit import Adam8bitStandIn

        return Adam8bitStandIn(_groups(model), lr=lr, blocksize=2048)
    return None  # optim="adafactor": the Trainer makes it


def bert_run(batch_size: int, variant: str = "vanilla", max_steps: int | None = None,
             ) -> Callable[[], None]:
    """:data:`VARIANTS` ``[variant]`` as the page runs it; ``batch_size`` is the per-device
    batch (the page's is :attr:`Variant.batch`), ``max_steps`` the optimizer steps
    (default :attr:`Variant.optimizer_steps`)."""
    v = VARIANTS[variant]
    steps = max_steps or v.optimizer_steps
    if v.loop == "accelerate":
        return _accelerate_run(batch_size, v, steps)
    from transformers import Trainer, TrainingArguments

    model = _model(False)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="torchmem-public-truth-"), num_train_epochs=1,
        log_level="error", report_to="none", per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=v.accumulation, gradient_checkpointing=v.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": True} if v.checkpointing else None,
        fp16=v.fp16, optim="adafactor" if v.optimizer == "adafactor" else "adamw_torch",
        max_steps=steps, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    _zero_grad_2022(model)
    optimizer = _optimizer(v, model, args.learning_rate)
    trainer = Trainer(model=model, args=args, train_dataset=DummyDataset(),
                      optimizers=(optimizer, None))

    def step() -> None:
        with _torch_2022():
            trainer.train()
    return step


def _accelerate_run(batch_size: int, v: Variant, steps: int) -> Callable[[], None]:
    """The page's hand-written accelerate loop (its "Using Accelerate" section)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    model = _model(v.checkpointing)
    loader = DataLoader(DummyDataset(), batch_size=batch_size)
    accelerator = Accelerator(mixed_precision="fp16" if v.fp16 else "no",
                              gradient_accumulation_steps=v.accumulation)
    optimizer = _optimizer(v, model, 5e-5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    _zero_grad_2022(optimizer)

    def step() -> None:
        with _torch_2022():
            _loop()

    def _loop() -> None:
        model.train()
        for i, batch in enumerate(loader, start=1):
            loss = model(**batch).loss
            loss = loss / v.accumulation
            accelerator.backward(loss)
            if i % v.accumulation == 0:
                optimizer.step()
                optimizer.zero_grad()
            if i == steps * v.accumulation:
                break
    return step


def estimate(variant: str, max_steps: int | None = None) -> Any:
    """:func:`torchmem.estimate` of one variant on the V100 16 GB (no margin)."""
    import torchmem

    v = VARIANTS[variant]
    return torchmem.estimate(bert_run, gpu=GPU, batch_size=v.batch,
                             params={"variant": variant, "max_steps": max_steps}, steps=1,
                             margin=0)


def estimated_mib(e: Any) -> float:
    """An estimate as the page's figure: peak reserved + the page's measured context (MiB)."""
    return e.peak_reserved_bytes / 2**20 + CONTEXT_MIB


#: The page's other variants as ``--what-if`` levers applied to its vanilla run (issue 25: from
#: the vanilla run alone, the what-if must reproduce them within the same 5%). The accelerate
#: loop is the last Trainer row's figure and is not a lever.
WHAT_IF: dict[str, str] = {
    "accum": "grad_accumulation_4",
    "accum_ckpt": "grad_accumulation_4+activation_checkpointing",
    "fp16": "fp16_autocast",
    "accum_ckpt_fp16": "grad_accumulation_4+activation_checkpointing+fp16_autocast",
    "adafactor": "adafactor",
    "accum_ckpt_fp16_adafactor":
        "grad_accumulation_4+activation_checkpointing+fp16_autocast+adafactor",
    "adam8bit": "optimizer_8bit",
    "accum_ckpt_fp16_8bit":
        "grad_accumulation_4+activation_checkpointing+fp16_autocast+optimizer_8bit",
}


def what_if(variants: list[str], progress: Callable[[str], None] | None = None,
            max_steps: int | None = None) -> Any:
    """:func:`torchmem.estimate` of the vanilla run with ``--what-if`` for the levers of
    ``variants`` (:data:`WHAT_IF`); returns the estimate (its ``what_if`` rows)."""
    import torchmem

    return torchmem.estimate(bert_run, gpu=GPU, batch_size=VARIANTS["vanilla"].batch,
                             params={"variant": "vanilla", "max_steps": max_steps}, steps=1,
                             margin=0,
                             what_if=[WHAT_IF[v] for v in variants], progress=progress)


def what_if_mib(e: Any, variant: str) -> float:
    """The what-if row of ``variant``'s levers as the page's figure (MiB, with its context)."""
    name = WHAT_IF[variant].replace("+", " + ")
    row = next(r for r in e.what_if if r.lever == name)
    if row.peak_reserved_bytes is None:
        raise AssertionError(f"{name} was not applied: {row.skipped}")
    return row.peak_reserved_bytes / 2**20 + CONTEXT_MIB
