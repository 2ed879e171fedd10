"""``estimate_hf``: will a transformers model fit, from its config alone (no weights read).

The model is built from the config under fake tensors, like any ``build`` of
:func:`torchmem.estimate` (no memory is allocated, no weights are read or downloaded), then one
task runs on the fake GPU:

- ``forward``: one forward pass over ``seq_len`` tokens per sequence, no cache, under
  ``torch.no_grad()`` (inference);
- ``generate``: ``model.generate()`` on a prompt of ``seq_len`` tokens, then exactly
  ``max_new_tokens`` new tokens (``min_new_tokens = max_new_tokens``: EOS never stops it early,
  the most memory it can take), greedy, with the model's default cache (``cache="dynamic"``) or
  a ``StaticCache`` (``cache="static"``, allocated at its full length before the first token);
  one ``step`` is one ``generate()`` call;
- ``train``: one training step, ``model(input_ids, labels=input_ids).loss.backward()``, then
  ``AdamW.step()`` and ``zero_grad()`` (default ``steps=2``: the second sees the optimizer
  state).

``by_category`` gives the weights as ``parameters``, the KV cache as ``kv_cache`` (see
:mod:`torchmem.fit.run._kv`) and, for the inference tasks, everything else a forward pass holds as
``activations`` (without a backward pass, all of it is transient; the tracker's
``temporaries`` are folded in). The attention implementation is ``attn`` (by default the one
transformers picks for the model: SDPA where the model supports it, else eager; ``"eager"``
keeps ``batch x heads x S x S`` scores); with SDPA, the kernel CUDA would choose for that dtype
and GPU is the one simulated. The notes say which implementation the model ran.

Example:
    >>> cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    ...        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...        "vocab_size": 256}
    >>> e = estimate_hf(cfg, task="generate", gpu="T4", seq_len=32, max_new_tokens=4,
    ...                 dtype="float16")
    >>> e.fits, e.kv_cache.bytes_per_token == 2 * 2 * 2 * 16 * 2, e.kv_cache.tokens
    (True, True, 35)
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchmem._environ import environ_set
from torchmem.errors import InvalidInputError
from torchmem.fit.run._engine import BuildError
from torchmem.fit.search._search import estimate
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._estimate import Estimate

__all__ = ["estimate_hf", "load_config", "TASKS"]

#: The tasks ``estimate_hf`` runs.
TASKS = ("forward", "generate", "train")
_CACHES = ("dynamic", "static")
_ATTNS = ("sdpa", "eager")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
#: seq_len when neither the call nor ``params`` give one (capped at the model's maximum).
DEFAULT_SEQ_LEN = 2048
_INSTALL = "pip install 'torchmem[transformers]' (or pip install transformers)"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise InvalidInputError(
            f"estimating from a Hugging Face config needs transformers, which is not installed; "
            f"fix: {_INSTALL}"
        ) from None
    return transformers


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _from_dict(d: Mapping[str, Any], what: str) -> Any:
    tf = _transformers()
    model_type = d.get("model_type")
    if not isinstance(model_type, str):
        raise InvalidInputError(
            f"{what} has no 'model_type' (e.g. \"llama\"), so transformers cannot tell which "
            "model it configures; fix: add it, as config.json files saved by transformers have"
        )
    rest = {k: v for k, v in d.items() if k != "model_type"}
    try:
        return tf.AutoConfig.for_model(model_type, **rest)
    except Exception as e:
        raise InvalidInputError(
            f"transformers cannot read {what} (model_type {model_type!r}): {_short(e)}; fix: "
            "check model_type and the fields, or upgrade transformers for a newer architecture"
        ) from None


def load_config(config: object) -> Any:
    """A transformers ``PretrainedConfig`` from a path to ``config.json`` (or its folder), a
    dict, a ``PretrainedConfig`` (copied), or a model name whose config is already in the
    local Hugging Face cache (never downloaded).

    Example:
        >>> load_config({"model_type": "gpt2", "n_layer": 2}).n_layer
        2
    """
    tf = _transformers()
    if isinstance(config, tf.PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, Mapping):
        return _from_dict(config, "the config dict")
    if not isinstance(config, (str, os.PathLike)):
        raise InvalidInputError(
            f"config must be a path to config.json, a dict, a transformers PretrainedConfig or "
            f"a model name in the local Hugging Face cache, got {type(config).__name__}"
        )
    path = os.fspath(config)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise InvalidInputError(
                f"the folder {path!r} has no config.json; fix: pass the path to the config file"
            )
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidInputError(
                f"cannot read the config {path!r}: {_short(e)}; expected a JSON config.json as "
                "transformers saves it"
            ) from None
        if not isinstance(d, dict):
            raise InvalidInputError(f"{path!r} holds a JSON {type(d).__name__}, expected an object")
        return _from_dict(d, repr(path))
    if path.endswith(".json") or path.startswith((".", "/", "~")):
        raise InvalidInputError(f"no config file at {path!r}; fix: pass the path to config.json")
    try:
        with environ_set({"HF_HUB_OFFLINE": "1"}):  # only the local cache is read
            return tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise InvalidInputError(
            f"the config of {path!r} is not in the local Hugging Face cache (torchmem never "
            f"downloads; {_short(e)}); fix: pass a path to its config.json, or fetch it once "
            f"with `hf download {path} config.json`"
        ) from None


def _dtype(dtype: object, cfg: Any) -> torch.dtype:
    if dtype is None:
        # transformers 5 names it dtype (torch_dtype is deprecated), 4.x torch_dtype
        name = "dtype" if hasattr(type(cfg), "dtype") or "dtype" in vars(cfg) else "torch_dtype"
        dtype = getattr(cfg, name, None) or torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.").lower()
        if name in _DTYPES:
            return _DTYPES[name]
    raise InvalidInputError(
        f"dtype must be one of float32, float16, bfloat16 (or torch dtypes), got {dtype!r}"
    )


def _check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise BuildError(
            f"unknown {name} {value!r}: expected one of {', '.join(choices)}"
        )
    return str(value)


def _model_class(cfg: Any) -> Any:
    tf = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise InvalidInputError(
            f"transformers has no causal language model for {type(cfg).__name__} "
            f"(model_type {getattr(cfg, 'model_type', '?')!r}); estimate_hf builds "
            "AutoModelForCausalLM models (decoder LMs: Llama, Mistral, Qwen, GPT-2, ...)"
        )
    return tf.AutoModelForCausalLM


def _int(name: str, v: object, low: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise BuildError(f"{name} must be an int >= {low}, got {v!r}")
    return v


def make_build(
    cfg: Any, task: str, dtype: torch.dtype, attn: str | None, seq_len: int,
    max_new_tokens: int, cache: str, seen: dict[str, Any] | None = None,
) -> Callable[..., Callable[[], Any]]:
    """``build(batch_size, seq_len=..., max_new_tokens=..., cache=...)`` for ``task`` on the
    model ``cfg`` describes (see the module docstring); the keywords' defaults are the
    arguments. ``attn=None`` leaves the attention implementation to transformers; the one the
    model got is put in ``seen["attn"]``.

    Example:
        >>> cfg = load_config({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
        ...                    "vocab_size": 64})
        >>> build = make_build(cfg, "forward", torch.float32, "eager", 8, 1, "dynamic")
        >>> step = build(2, seq_len=4); step()
    """
    auto = _model_class(cfg)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    name = getattr(model_cls, "__name__", "AutoModelForCausalLM")

    def build(batch_size: int, seq_len: int = seq_len, max_new_tokens: int = max_new_tokens,
              cache: str = cache) -> Callable[[], Any]:
        seq_len = _int("seq_len", seq_len, 1)
        new = _int("max_new_tokens", max_new_tokens, 1)
        cache = _check_choice("cache", cache, _CACHES)
        attn_kw = {} if attn is None else {"attn_implementation": attn}
        try:
            model = auto.from_config(copy.deepcopy(cfg), dtype=dtype, **attn_kw)
        except Exception as e:
            raise BuildError(
                f"transformers could not build {name} from this {type(cfg).__name__} (dtype "
                f"{str(dtype).removeprefix('torch.')}, attn_implementation "
                f"{attn or 'as transformers picks'}): {_short(e)}; fix: check the config's "
                "fields" + (" or try attn='eager'" if attn == "sdpa" else "")
            ) from None
        if seen is not None:
            seen["attn"] = getattr(model.config, "_attn_implementation", attn)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model.to(dev)
        ids = torch.zeros((batch_size, seq_len), dtype=torch.long, device=dev)
        if task == "train":
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def train_step() -> None:
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return train_step
        model.eval()
        if task == "forward":
            def forward_step() -> None:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
            return forward_step
        mask = torch.ones_like(ids)
        extra: dict[str, Any] = {"cache_implementation": "static"} if cache == "static" else {}

        def generate_step() -> None:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, **extra)
        return generate_step

    return build


def estimate_hf(
    config: object,
    task: str = "forward",
    gpu: str | int | GPU = "H100-80GB",
    batch_size: int | None = 1,
    *,
    seq_len: int | None = None,
    max_new_tokens: int = 16,
    cache: str = "dynamic",
    dtype: str | torch.dtype | None = None,
    attn: str | None = None,
    params: Mapping[str, Any] | None = None,
    maximize: str | None = None,
    kv_cache_attr: Sequence[str] | None = None,
    steps: int | None = None,
    **options: Any,
) -> Estimate:
    """Will a transformers model fit on ``gpu`` for ``task``? From its config alone.

    ``config``: a path to ``config.json`` (or its folder), a dict, a ``PretrainedConfig``, or a
    model name whose config is already in the local Hugging Face cache (never downloaded; the
    lookup runs with ``HF_HUB_OFFLINE=1``). No weights are read: the model is built with fake
    tensors. ``task``: ``"forward"``, ``"generate"`` or ``"train"`` (see
    :mod:`torchmem.fit.targets._hf`). ``seq_len`` tokens per sequence (the prompt, for
    ``generate``; default 2048, capped at ``max_position_embeddings``), ``max_new_tokens``
    new tokens and ``cache`` (``"dynamic"``, ``"static"``) for ``generate``; ``dtype`` of the
    weights (default: the config's ``dtype``, else float32); ``attn``: ``"sdpa"`` or
    ``"eager"`` (default: transformers' choice for the model, SDPA where supported). ``params`` set the same keywords (``{"seq_len": 32768, "cache":
    "static"}``) and ``maximize="seq_len"`` searches for the longest context that fits
    (``seq_len`` is where the search starts), as :func:`torchmem.estimate` does, which runs it
    (``options``: its other keywords, such as ``search_range``, ``alloc_conf``, ``progress``,
    ``margin``, ``keep_snapshot``).
    ``steps``: default 1 for ``forward`` and ``generate`` (one call), 2 for ``train``.
    ``what_if=True`` (or lever names) with ``task="train"`` tries the memory levers on the
    model the config builds and its AdamW (see :func:`torchmem.estimate`); the inference
    tasks take no levers (an error says so).

    The result is :func:`torchmem.estimate`'s :class:`~torchmem.fit.Estimate`, with the KV
    cache in ``by_category["kv_cache"]`` and ``kv_cache`` (bytes per token and per sequence);
    for ``forward`` and ``generate`` the tracker's ``temporaries`` are reported as
    ``activations``. Bad input (a config transformers cannot build, an unknown task)
    raises :class:`~torchmem.errors.InvalidInputError` saying what was tried.

    Example:
        >>> cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        ...        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
        >>> e = estimate_hf(cfg, task="train", gpu="T4", seq_len=16)
        >>> cat = e.by_category        # AdamW: two moments per gradient (and a step count each)
        >>> e.fits, cat["gradient"], cat["optimizer_state"] // cat["gradient"]
        (True, 460032, 2)
    """
    task = _check_choice("task", task, TASKS)
    cache = _check_choice("cache", cache, _CACHES)
    if attn is not None:
        attn = _check_choice("attn", attn, _ATTNS)
    unknown = sorted(set(params or {}) - {"seq_len", "max_new_tokens", "cache", "batch_size"})
    if unknown:
        raise InvalidInputError(
            f"unknown parameter {unknown[0]!r} for a model from its config: the parameters are "
            "seq_len, max_new_tokens, cache (dynamic or static) and batch_size"
        )
    if options.get("what_if", False) is not False and task != "train":
        raise InvalidInputError(
            f"what_if tries memory levers on a training step (checkpointing, gradient "
            f"accumulation, the optimizer, LoRA, FSDP), got task {task!r}, which runs no "
            "backward pass and makes no optimizer; fix: task='train' (--task train), or drop "
            "what_if (--what-if)"
        )
    cfg = load_config(config)
    torch_dtype = _dtype(dtype, cfg)
    longest = getattr(cfg, "max_position_embeddings", None)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, longest) if isinstance(longest, int) else DEFAULT_SEQ_LEN
    seen: dict[str, Any] = {}
    build = make_build(cfg, task, torch_dtype, attn, _int("seq_len", seq_len, 1),
                       _int("max_new_tokens", max_new_tokens, 1), cache, seen)
    if steps is None:
        steps = 2 if task == "train" else 1
    est = estimate(build, gpu, batch_size, params=params, maximize=maximize,
                   kv_cache_attr=kv_cache_attr, steps=steps, **options)
    if task != "train":
        cat = est.by_category
        cat["activation"] = cat.get("activation", 0) + cat.pop("temporary", 0)
    est.notes.append(
        f"{type(cfg).__name__} built from the config with fake tensors: task {task}, "
        f"{str(torch_dtype).removeprefix('torch.')} weights, attn_implementation "
        f"{seen.get('attn', attn)!r}"
        + (f", {cache} cache" if task == "generate" else "")
    )
    return est

