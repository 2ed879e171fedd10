"""The levers a user can ask for (:data:`LEVERS`): what each changes and what it costs, how two
are combined (:func:`combine`), which exclude each other and why, and the names checked
(:func:`check_levers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchmem.errors import InvalidInputError


@dataclass(frozen=True)
class Lever:
    """One memory lever: its name, the :class:`~torchmem.fit.levers._levers.LeverRun` settings, the
    world size it runs under (FSDP), its cost tier (0: free ... 5: more hardware) and the
    group of levers it excludes (one optimizer, one precision, ...).

    Example:
        >>> LEVERS[0].tier, LEVERS[0].group
        (3, 'checkpoint')
    """

    name: str
    settings: Mapping[str, Any]
    tier: int
    group: str
    world_size: int | None = None
    changes: str = ""
    #: the levers a combination (``"a+b"``) is made of; empty for one lever
    parts: tuple[Lever, ...] = ()

    @property
    def singles(self) -> tuple[Lever, ...]:
        """The single levers this one is made of (itself for a single lever).

        Example:
            >>> [lv.name for lv in combine(check_levers(["adafactor"]) * 1).singles]
            ['adafactor']
        """
        return self.parts or (self,)


def combine(levers: Sequence[Lever]) -> Lever:
    """One lever made of several (``"activation_checkpointing+grad_accumulation_4"``): their
    settings merged; an error when two of them are of one kind (two optimizers, two
    precisions, two world sizes) or the allocator is among them.

    Example:
        >>> combine(check_levers(["adafactor", "activation_checkpointing"])).name
        'adafactor + activation_checkpointing'
        >>> combine(check_levers(["adafactor", "optimizer_8bit"]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: levers adafactor and optimizer_8bit cannot be combined ...
    """
    if len(levers) == 1:
        return levers[0]
    seen: dict[str, str] = {}
    chosen: list[Lever] = []
    settings: dict[str, Any] = {}
    for lv in levers:
        if lv.name == "allocator":
            raise InvalidInputError(
                f"the {lv.name} lever is tried alone (the best combination adds the allocator "
                "settings itself); fix: list it apart, e.g. --what-if a+b,allocator"
            )
        if lv.group in seen:
            raise InvalidInputError(
                f"levers {seen[lv.group]} and {lv.name} cannot be combined (both set the "
                f"{lv.group}); fix: keep one of them"
            )
        for other in chosen:
            why = _exclusion(other, lv)
            if why is not None:
                raise InvalidInputError(
                    f"levers {other.name} and {lv.name} cannot be combined ({why}); fix: keep "
                    "one of them"
                )
        seen[lv.group] = lv.name
        chosen.append(lv)
        settings.update(lv.settings)
    ws = next((lv.world_size for lv in levers if lv.world_size), None)
    return Lever(" + ".join(lv.name for lv in levers), settings, max(lv.tier for lv in levers),
                 "+".join(lv.group for lv in levers), ws,
                 "; ".join(lv.changes for lv in levers), tuple(levers))


_BF16, _FP16 = torch.bfloat16, torch.float16
_LORA_SHARD = ("LoRA adapters are added before the optimizer, FSDP shards at that point too, "
               "and torchmem applies them in one order only")
#: levers that do not combine beyond their own group, by group or lever name (either way
#: round), and why
_EXCLUDES: dict[frozenset[str], str] = {
    frozenset({"lora", "shard"}): _LORA_SHARD,
    frozenset({"offload", "shard"}): (
        "FSDP's sharded parameters are DTensors, and cpu_offload's CPUOffloadPolicy already "
        "keeps the optimizer's state on the host"),
    frozenset({"offload", "optimizer"}): (
        "cpu_offload_optimizer runs the optimizer as written on the host: fused/foreach pick "
        "GPU kernels, and 8-bit Adam and Adafactor would change which optimizer is offloaded"),
    frozenset({"offload", "fp16_autocast"}): (
        "the gradient scaler would unscale the host copies' gradients, an order torchmem "
        "does not guess"),
}


def _exclusion(a: Lever, b: Lever) -> str | None:
    """Why single levers ``a`` and ``b`` (of different groups) do not combine, or ``None``."""
    for x in (a.group, a.name):
        for y in (b.group, b.name):
            why = _EXCLUDES.get(frozenset({x, y}))
            if why is not None:
                return why
    return None

#: every lever, in the order of the table before sorting (see the module's documentation)
LEVERS: tuple[Lever, ...] = (
    Lever("activation_checkpointing", {"checkpoint": True}, 3, "checkpoint",
          changes="recomputes each block's forward in backward"),
    Lever("grad_accumulation_2", {"accumulate": 2}, 4, "accumulate",
          changes="2 forward/backward passes per optimizer step"),
    Lever("grad_accumulation_4", {"accumulate": 4}, 4, "accumulate",
          changes="4 forward/backward passes per optimizer step"),
    Lever("bf16_autocast", {"autocast": _BF16}, 1, "autocast",
          changes="bfloat16 compute where autocast allows it"),
    Lever("fp16_autocast", {"autocast": _FP16, "scaler": True}, 1, "autocast",
          changes="float16 compute where autocast allows it, with a gradient scaler"),
    Lever("bf16_weights", {"weights_dtype": _BF16}, 2, "weights",
          changes="bfloat16 weights, gradients and optimizer state (no fp32 master copy)"),
    Lever("optimizer_fused", {"optimizer": {"fused": True, "foreach": False}}, 0, "optimizer",
          changes="none (the same optimizer's fused kernels)"),
    Lever("optimizer_foreach", {"optimizer": {"foreach": True, "fused": False}}, 0, "optimizer",
          changes="none (the same optimizer's multi-tensor kernels)"),
    Lever("optimizer_per_parameter", {"optimizer": {"foreach": False, "fused": False}}, 0,
          "optimizer", changes="slower: one parameter at a time"),
    Lever("optimizer_8bit", {"replace_optimizer": "adam8bit"}, 2, "optimizer",
          changes="8-bit Adam state (bitsandbytes)"),
    Lever("adafactor", {"replace_optimizer": "adafactor"}, 2, "optimizer",
          changes="Adafactor's factored second moments instead of the optimizer's state"),
    # tier 4: it changes what trains (adapters only), more than precision or the optimizer
    Lever("lora", {"lora": 8}, 4, "lora",
          changes="trains rank-8 adapters on the attention projections only"),
    Lever("fsdp_2", {"fsdp": True}, 5, "shard", 2, changes="2 GPUs"),
    Lever("fsdp_4", {"fsdp": True}, 5, "shard", 4, changes="4 GPUs"),
    Lever("fsdp_8", {"fsdp": True}, 5, "shard", 8, changes="8 GPUs"),
    Lever("cpu_offload", {"fsdp": "offload"}, 5, "shard", 1,
          changes="state on the host; every block's parameters copied in each pass"),
    # tier 3: a host step and two copies of the parameters' bytes per step, on one GPU
    Lever("cpu_offload_optimizer", {"offload_optimizer": True}, 3, "offload",
          changes="the optimizer's state and step on the host; gradients and parameters "
                  "copied each step"),
    Lever("allocator", {}, 0, "allocator", changes="none (allocator settings)"),
)
_BY_NAME = {lv.name: lv for lv in LEVERS}


def check_levers(names: Sequence[str] | None) -> list[Lever]:
    """The levers named (all of :data:`LEVERS` for ``None``); ``"a+b"`` names a combination
    (:func:`combine`); a clear error for unknown names.

    Example:
        >>> [lv.name for lv in check_levers(["adafactor", "grad_accumulation_4+adafactor"])]
        ['adafactor', 'grad_accumulation_4 + adafactor']
        >>> check_levers(["turbo"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: unknown lever 'turbo'; expected some of ...
    """
    if names is None:
        return list(LEVERS)
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise InvalidInputError(f"levers must be a list of lever names, got {names!r}")
    out = []
    for spec in names:
        parts = []
        for n in (p.strip() for p in spec.split("+")):
            if n not in _BY_NAME:
                raise InvalidInputError(
                    f"unknown lever {n!r}; expected some of {', '.join(_BY_NAME)} (or several "
                    "joined with '+'); fix: name levers from that list, or leave them out to "
                    "try every one"
                )
            parts.append(_BY_NAME[n])
        out.append(combine(parts))
    return out
