"""Dispatch modes that skip torch's dynamo guard while no compiled code runs.

PyTorch wraps the ``__torch_dispatch__`` of every ``TorchDispatchMode`` subclass in
``torch._dynamo.disable`` (``TorchDispatchMode.__init_subclass__``), so that ``torch.compile``
never traces into a mode's Python code. The wrapper costs two Python frames and four switches of
the frame-evaluation callback on every operator, also when nothing is compiled: on the MLP step
of ``benchmarks/bench_tracker.py`` it was about a quarter of the tracker's time. torchmem's modes
see every operator, so :class:`FastDispatchMode` (their base) calls ``__torch_dispatch__``
directly while no frame-evaluation callback is installed (no compiled code is running, so the
wrapper would change nothing), and through the same ``torch._dynamo.disable`` wrapper otherwise.
Where the check is not available (a PyTorch without ``torch._C._dynamo``), torch's own wrapper
stays.

Example:
    >>> import torch
    >>> class Count(FastDispatchMode):
    ...     n = 0
    ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    ...         Count.n += 1
    ...         return func(*args, **(kwargs or {}))
    >>> with Count():
    ...     _ = torch.ones(2) + 1
    >>> Count.n
    2
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FastDispatchMode", "frame_callback"]

try:  # the frame-evaluation callback torch.compile installs while compiled code runs
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _callback
except ImportError:  # pragma: no cover - a PyTorch without dynamo
    _callback = None  # type: ignore[assignment]


def _no_callback() -> None:
    return None


#: The frame-evaluation callback now (``None`` while no compiled code runs): the check a
#: subclass with ``inline_check = True`` makes first in its ``__torch_dispatch__``.
frame_callback: Callable[[], Any] = _callback if _callback is not None else _no_callback


class FastDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` skips ``torch._dynamo.disable``'s
    wrapper while no compiled code runs (see the module's documentation).

    Example:
        >>> class Noop(FastDispatchMode):
        ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ...         return func(*args, **(kwargs or {}))
        >>> with Noop():
        ...     torch.ones(2).sum().item()
        2.0
    """

    #: A subclass whose ``__torch_dispatch__`` starts with ``if frame_callback() is not None:
    #: return self._under_disable(func, types, args, kwargs)`` sets this: its method is then
    #: called with no wrapper frame at all (the hottest modes: the tracker's, the estimator's).
    inline_check = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: torch does not wrap; __init_subclass__ below installs the guarded call
        return _callback is None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        raw = cls.__dict__.get("__torch_dispatch__")
        if _callback is None or raw is None or isinstance(raw, classmethod):
            if raw is not None and not isinstance(raw, classmethod):
                cls._under_disable = raw  # type: ignore[attr-defined]
            return
        under_disable = torch._disable_dynamo(raw, recursive=True)
        cls._under_disable = under_disable  # type: ignore[method-assign]
        if cls.__dict__.get("inline_check", False) and _skip_frame(raw):
            return
        cls.__torch_dispatch__ = _guarded(raw, under_disable)  # type: ignore[method-assign]

    def __enter__(self) -> Any:
        if _callback is not None and "torch._dynamo" not in sys.modules:
            # torch's wrapper imported torch._dynamo at a mode's first operator; import it
            # here, in the process that enters the mode: torch's own functions wrapped in
            # torch._dynamo.disable import it at their first call, and in forked workers
            # (DataLoader) that import would be private memory in each (about 35 MiB)
            import torch._dynamo  # noqa: F401
        return super().__enter__()

    def _under_disable(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """``__torch_dispatch__`` under ``torch._dynamo.disable`` (set per subclass)."""
        raise NotImplementedError  # pragma: no cover - replaced in every subclass


def _skip_frame(fn: Callable[..., Any]) -> bool:
    """Mark ``fn``'s own frame for torch.compile to skip (neither compiled nor inlined; the
    frames it calls are not skipped); whether that could be done."""
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )

        set_code_exec_strategy(fn.__code__,
                               _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another PyTorch
        return False
    return True


def _guarded(raw: Callable[..., Any], under_disable: Callable[..., Any]) -> Callable[..., Any]:
    """``raw`` called directly while no frame-evaluation callback is installed, else under
    ``torch._dynamo.disable`` (as ``TorchDispatchMode`` does for every call)."""
    callback = _callback

    def __torch_dispatch__(self: Any, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if callback() is None:
            return raw(self, func, types, args, kwargs)
        return under_disable(self, func, types, args, kwargs)

    __torch_dispatch__.__wrapped__ = raw  # type: ignore[attr-defined]
    __torch_dispatch__.__doc__ = raw.__doc__
    # torch.compile never compiles or inlines this frame itself (torch's wrapper gets that from
    # living in torch's own files); the frames it calls are guarded as above
    return __torch_dispatch__ if _skip_frame(__torch_dispatch__) else under_disable
