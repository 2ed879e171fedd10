"""``torchmem estimate --hf-config config.json --task generate``: from a model's config alone.

The options :func:`add_arguments` adds to ``torchmem estimate`` and the function that runs
:func:`torchmem.estimate_hf` from them (:func:`estimate_from_args`); ``--kv-cache-attr`` also
applies to a ``file.py:build`` estimate. :func:`kv_lines` are the KV cache lines of the text
report.

Example:
    >>> import argparse; p = argparse.ArgumentParser(); add_arguments(p)
    >>> ns = p.parse_args(["--hf-config", "config.json", "--task", "generate", "--attn", "eager"])
    >>> ns.hf_config, ns.task, ns.attn, ns.dtype, ns.kv_cache_attr
    ('config.json', 'generate', 'eager', None, [])
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from torchmem.errors import InvalidInputError

__all__ = ["add_arguments", "estimate_from_args", "kv_lines"]

_TASKS = ("forward", "generate", "train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--hf-config`` options (and ``--kv-cache-attr``) of ``torchmem estimate``.

    Example:
        >>> import argparse; p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["--kv-cache-attr", "k_cache", "--kv-cache-attr", "v_cache"]).kv_cache_attr
        ['k_cache', 'v_cache']
    """
    parser.add_argument(
        "--hf-config", default=None, metavar="PATH|NAME",
        help="estimate a transformers model from its config alone (no weights read): a path to "
             "config.json (or its folder) or a model name already in the local Hugging Face "
             "cache (never downloaded); replaces the build function",
    )
    parser.add_argument(
        "--task", default=None, choices=_TASKS,
        help="with --hf-config: forward (one pass over seq_len tokens), generate (a seq_len "
             "prompt, then --set max_new_tokens=N new tokens, default 16; --set cache=static "
             "for a static cache) or train (one AdamW step); default forward",
    )
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="with --hf-config: the weights' dtype (default: the config's, "
                             "else float32)")
    parser.add_argument("--attn", default=None, choices=("sdpa", "eager"),
                        help="with --hf-config: attention implementation (default: "
                             "transformers' choice for the model, sdpa where supported: the "
                             "kernel CUDA picks for the dtype and GPU; eager keeps batch x "
                             "heads x S x S scores)")
    parser.add_argument("--kv-cache-attr", action="append", default=[], metavar="NAME",
                        help="a module attribute (or forward keyword argument) that holds the "
                             "KV cache (repeatable), for a decoding loop of your own; "
                             "transformers' caches are found without it")


def estimate_from_args(
    args: argparse.Namespace,
    card: Any,
    *,
    params: Mapping[str, Any],
    maximize: str | None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> Any:
    """Run :func:`torchmem.estimate_hf` for ``--hf-config`` (``args.batch_size``,
    ``args.steps``: default 1 for forward/generate, 2 for train), with the ``--set``
    ``params``, the ``--max`` parameter and :func:`torchmem.estimate`'s ``options``.

    Example:
        >>> ns = argparse.Namespace(hf_config="x.json", task="decode", spec=None)
        >>> estimate_from_args(ns, "T4", params={}, maximize=None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: --task 'decode': expected one of forward, ...
    """
    from torchmem.fit import estimate_hf

    task = getattr(args, "task", None) or "forward"
    if task not in _TASKS:
        raise InvalidInputError(f"--task {task!r}: expected one of {', '.join(_TASKS)}")
    if getattr(args, "spec", None):
        raise InvalidInputError(
            f"give either a build function ({args.spec}) or --hf-config, not both"
        )
    batch = getattr(args, "batch_size", None)
    if maximize != "batch_size" and batch is None:
        batch = 1
    if progress is not None:
        progress(f"building the model of {args.hf_config} with fake tensors (task {task})")
    return estimate_hf(
        args.hf_config, task, card, batch, dtype=getattr(args, "dtype", None),
        attn=getattr(args, "attn", None), params=params, maximize=maximize,
        kv_cache_attr=getattr(args, "kv_cache_attr", None) or None,
        steps=getattr(args, "steps", None), progress=progress, **options,
    )


def kv_lines(est: Any) -> list[str]:
    """The KV cache lines of the text report (none when the run had no cache).

    Example:
        >>> from torchmem.fit import Estimate, KVCache
        >>> e = Estimate("T4", 2, True, 100, 10, 1, 2, 3)
        >>> e.kv_cache = KVCache(1 << 20, 0, 1 << 20, 512, 1 << 19, 1024, 2, "transformers DynamicCache")
        >>> print("\\n".join(kv_lines(e)))  # doctest: +NORMALIZE_WHITESPACE
        KV cache (transformers DynamicCache): 1.00 MiB at the peak, 0 B at the end, at most 1.00 MiB
          512 B per token, 512.00 KiB per sequence (1024 tokens x batch 2 at its fullest)
    """
    from torchmem.units import format_bytes as fmt

    kv = getattr(est, "kv_cache", None)
    if kv is None:
        return []
    return [
        f"KV cache ({kv.source}): {fmt(kv.peak_bytes)} at the peak, {fmt(kv.end_bytes)} at the "
        f"end, at most {fmt(kv.max_bytes)}",
        f"  {fmt(kv.bytes_per_token)} per token, {fmt(kv.bytes_per_sequence)} per sequence "
        f"({kv.tokens} tokens x batch {kv.batch} at its fullest)",
    ]
