"""The levers' optimizer-side helpers: the host copies ``cpu_offload_optimizer`` trains, whether
an optimizer already runs the kernels a lever asks for, and a skipped ``step(closure)``.

Example:
    >>> _same_kernels({"fused": True}, {"fused": True, "foreach": False})
    True
"""

from __future__ import annotations

from typing import Any

import torch

__all__: list[str] = []


def _host_copies(params: list[Any]) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Pinned host copies of the parameters that train (each with a pinned host gradient,
    made in that order, parameter by parameter), the parameter groups on them, and the
    ``(GPU parameter, host copy)`` pairs; parameters that do not train are left out."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(ps: list[Any]) -> list[Any]:
        out = []
        for p in ps:
            if not p.requires_grad:
                continue
            with torch.no_grad():
                h = torch.empty_like(p, device="cpu", pin_memory=True)
                h.copy_(p.detach())
                h.grad = torch.empty_like(h, pin_memory=True)
            pairs.append((p, h))
            out.append(h)
        return out

    groups: list[Any] = []
    loose: list[Any] = []
    for p in params:
        if isinstance(p, dict):
            ps = p["params"] if not isinstance(p["params"], torch.Tensor) else [p["params"]]
            groups.append({**p, "params": host(list(ps))})
        else:
            loose.append(p)
    return (groups if groups else host(loose)), pairs


def _same_kernels(written: dict[str, Any], lever: dict[str, Any]) -> bool:
    """Whether an optimizer made with the keyword arguments ``written`` already runs the
    kernels the lever's ``optimizer`` settings ask for: ``fused=True`` (foreach is then
    unused), ``foreach=True`` without fused, or the per-parameter loop (``foreach=False``,
    not fused; ``None`` means foreach on CUDA, so it is not the loop).

    Example:
        >>> _same_kernels({"lr": 1e-3, "fused": True}, {"fused": True, "foreach": False})
        True
        >>> _same_kernels({}, {"foreach": False, "fused": False})
        False
    """
    if lever.get("fused"):
        return written.get("fused") is True
    if lever.get("foreach"):
        return written.get("foreach") is True and not written.get("fused")
    return written.get("foreach") is False and not written.get("fused")


def _closure_only(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A skipped ``optimizer.step(closure)``: the closure runs (its forward and backward, with
    gradients on, as ``step`` runs it), the step does not; ``None`` without a closure."""
    closure = args[0] if args else kwargs.get("closure")
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
