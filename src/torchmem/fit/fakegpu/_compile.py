"""``torch.compile`` under an estimate: where the program compiles, said in the report.

The fake run does not compile: Dynamo does not trace frames while the estimate's dispatch modes
run, so a compiled model or function runs operator by operator, as
``torch.compile(..., backend="eager")`` would. On the GPU, Inductor's code keeps fewer
temporaries (fused kernels), may save other tensors for backward (its partitioner recomputes
cheap ones) and, with ``mode="reduce-overhead"``, keeps CUDA graph pools reserved. The figures
are the eager step's, and the report must say so instead of passing them off as the compiled
step's: :func:`compile_calls` records each call of ``torch.compile`` (``nn.Module.compile``
calls it too) with its site and options, and :func:`compile_note` words the report's note.

Example:
    >>> import torch
    >>> with compile_calls() as calls:
    ...     f = torch.compile(lambda x: x + 1, mode="max-autotune")
    >>> [(c.mode, c.fullgraph) for c in calls]
    [('max-autotune', False)]
    >>> compile_note(calls).startswith("torch.compile: 1 call")
    True
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompileCall", "compile_calls", "compile_note"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class CompileCall:
    """One ``torch.compile`` call of the program: where (``file:line``, the first frame
    outside torch), on what (a module's class name or a function's name) and its options.

    Example:
        >>> CompileCall("train.py:12", "GPT", "default", False, None).where
        'train.py:12'
    """

    where: str
    target: str
    mode: str
    fullgraph: bool
    dynamic: bool | None


def _site() -> str:
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != os.path.abspath(__file__):
            return f"{f.f_code.co_filename}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "?"


def _target_name(model: Any) -> str:
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    owner = getattr(model, "__self__", None)  # nn.Module.compile hands over its bound _call_impl
    if isinstance(owner, torch.nn.Module):
        return type(owner).__name__
    return getattr(model, "__qualname__", None) or type(model).__name__


@contextlib.contextmanager
def compile_calls() -> Iterator[list[CompileCall]]:
    """Record every ``torch.compile`` call made inside the block (the call itself is
    ``torch.compile``'s own: what it returns runs as it would under the estimate).

    Example:
        >>> import torch
        >>> with compile_calls() as calls:
        ...     net = torch.compile(torch.nn.Linear(2, 2), fullgraph=True)
        >>> calls[0].target, calls[0].fullgraph
        ('Linear', True)
    """
    calls: list[CompileCall] = []
    original = torch.compile

    @functools.wraps(original)
    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        if model is None:  # torch.compile(mode=...) as a decorator: recorded when it is applied
            return original(model, *args, **kwargs)
        calls.append(CompileCall(_site(), _target_name(model), kwargs.get("mode") or "default",
                                 bool(kwargs.get("fullgraph", False)), kwargs.get("dynamic")))
        return original(model, *args, **kwargs)

    torch.compile = compile  # type: ignore[assignment]
    try:
        yield calls
    finally:
        torch.compile = original


def compile_note(calls: list[CompileCall]) -> str:
    """The report's note for the program's ``torch.compile`` calls ("" when there are none).

    Example:
        >>> compile_note([CompileCall("train.py:12", "GPT", "default", False, None)])[:60]
        'torch.compile: 1 call (GPT at train.py:12, mode default); th'
    """
    if not calls:
        return ""
    shown = []
    for c in calls[:3]:
        extra = ", fullgraph" if c.fullgraph else ""
        shown.append(f"{c.target} at {c.where}, mode {c.mode}{extra}")
    more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
    graphs = any(c.mode in ("reduce-overhead", "max-autotune") for c in calls)
    return (
        f"torch.compile: {len(calls)} call{'s' if len(calls) > 1 else ''} "
        f"({'; '.join(shown)}{more}); the estimate ran the compiled code eagerly, operator by "
        "operator (as backend='eager' does): these are the eager step's peaks. On the GPU, "
        "Inductor's fused kernels keep fewer temporaries and its partitioner may save other "
        "tensors for backward, so the compiled step's peaks can be lower or higher"
        + ("; CUDA graphs (this mode records them) keep their private pools reserved on top"
           if graphs else "")
    )
