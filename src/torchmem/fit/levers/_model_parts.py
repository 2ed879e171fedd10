"""Where the levers act on a user's model: its repeated blocks (what ``checkpoint`` and ``fsdp``
wrap) and its attention projections (what ``lora`` targets), found by structure alone; the
roots holding an optimizer's parameters, the model inside a framework's wrapper, and the
small changes made to a block's call (checkpointed, cast).

Example:
    >>> import torch
    >>> [n for n, _ in repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))]
    ['0', '1']
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attention_projections", "repeated_blocks"]


def repeated_blocks(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks of ``root``: the children of each ``ModuleList``/``Sequential``
    holding two or more modules of one class, outermost first (blocks inside a block are not
    listed again); ``(qualified name, module)`` pairs.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
        ...         self.head = torch.nn.Linear(2, 1)
        >>> [n for n, _ in repeated_blocks(Net())]
        ['layers.0', 'layers.1', 'layers.2']
    """
    out: list[tuple[str, torch.nn.Module]] = []
    inside: list[str] = []
    for name, m in root.named_modules():
        if any(name == p or name.startswith(p + ".") for p in inside):
            continue
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        kids = list(m.named_children())
        if len(kids) < 2 or len({type(k) for _, k in kids}) != 1:
            continue
        if not any(True for _ in kids[0][1].parameters()):
            continue  # a stack of parameter-free modules (activations) is no block
        for k, child in kids:
            q = f"{name}.{k}" if name else k
            out.append((q, child))
            inside.append(q)
    return out


def _linear_types() -> tuple[type, ...]:
    """``Linear``, and transformers' ``Conv1D`` where a model may hold one (its module is
    imported: importing it here would cost seconds for models without it)."""
    import sys

    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (torch.nn.Linear, conv1d) if isinstance(conv1d, type) else (torch.nn.Linear,)


def _is_attention(name: str, module: torch.nn.Module) -> bool:
    attr = name.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__.lower().rstrip("0123456789")
    return "attn" in attr or "attention" in attr or cls.endswith(("attention", "attn"))


def attention_projections(root: torch.nn.Module) -> list[str]:
    """The attention projections of ``root``, as peft's ``target_modules`` names them: the last
    name of each ``Linear`` layer (or transformers' GPT-2 ``Conv1D``) whose parent is an
    attention module (its attribute name has ``attn`` or ``attention`` in it, or its class
    name ends with ``Attention``/``Attn``), leaving out names also used outside attention
    (BERT's ``dense``, GPT-2's ``c_proj``, which the MLP has too).

    Example:
        >>> import torch
        >>> class Attention(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.q_proj, self.v_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...         self.dense = torch.nn.Linear(4, 4)
        >>> class Block(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.mixer, self.dense = Attention(), torch.nn.Linear(4, 4)
        >>> attention_projections(torch.nn.Sequential(Block(), Block()))
        ['q_proj', 'v_proj']
    """
    linear = _linear_types()
    mods = dict(root.named_modules())
    inside: set[str] = set()
    outside: set[str] = set()
    for name, m in mods.items():
        if not name or not isinstance(m, linear):
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        attn = bool(parent) and _is_attention(parent, mods[parent])
        (inside if attn else outside).add(name.rsplit(".", 1)[-1])
    return sorted(inside - outside)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.__torchmem_checkpointed__ = True  # type: ignore[attr-defined]
    return run


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def _has_float_params(m: torch.nn.Module) -> bool:
    return any(p.is_floating_point() for p in m.parameters())


def _unwrapped(root: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a framework's wrapper that FSDP cannot shard in place:
    Lightning Fabric's ``_FabricModule`` (``fabric.setup_module(model)``) forwards to it and
    reads its own attributes through ``__getattr__``; ``fully_shard`` changes the class of the
    module it shards, so it goes on the model inside, as ``fully_shard(model)`` written before
    ``setup_module`` would."""
    inner = getattr(root, "_forward_module", None)
    if type(root).__name__ == "_FabricModule" and isinstance(inner, torch.nn.Module):
        return inner
    return root


def _shard_targets(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``fsdp`` shards (each after its repeated blocks): the model itself, or
    for a Lightning ``LightningModule`` (its ``training_step`` calls its submodules, never
    its own ``forward``, so FSDP's hooks on it would never gather) each child that holds
    parameters, as ``fully_shard(self.net)`` written in its ``configure_model`` would."""
    if any(c.__name__ == "LightningModule" for c in type(root).__mro__):
        kids = [m for m in root.children() if any(True for _ in m.parameters())]
        if kids and sum(p.numel() for k in kids for p in k.parameters()) == sum(
                p.numel() for p in root.parameters()):  # every parameter in a child
            return kids
    return [root]


def _roots_holding(ids: set[int]) -> list[torch.nn.Module]:
    """The outermost modules (not a child of another live module) holding any of the
    parameters ``ids``."""
    frozen = gc.get_freeze_count() > 0
    if frozen:  # the estimate froze what existed before the run: a model built before it
        gc.unfreeze()  # is among those (gc.get_objects leaves frozen objects out)
    try:
        with warnings.catch_warnings():  # isinstance on lazy module attributes may warn
            warnings.simplefilter("ignore")
            # type(), not isinstance: a weak proxy to a module (Lightning keeps some) passes
            # isinstance but is not one (and cannot be hashed)
            mods = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    finally:
        if frozen:
            gc.freeze()
    children: set[int] = set()
    for m in mods:
        for c in m.children():
            children.add(id(c))
    return [m for m in mods if id(m) not in children
            and any(id(p) in ids for p in m.parameters())]
