"""The fake GPU: run user code under fake tensors as if a CUDA device were present.

On a CPU-only build of PyTorch, fake tensors on a *fake CUDA* device abort the process in
autograd, so the estimate runs on fake *CPU* tensors and treats every one of them as memory of
the target GPU. For user code written for CUDA this module makes that work:

- ``device="cuda"``, ``torch.device("cuda:0")``, ``.to("cuda")``, ``.cuda()``,
  ``module.cuda()`` and ``torch.set_default_device("cuda")`` are redirected to the fake CPU
  device (a ``TorchFunctionMode`` rewrites device arguments);
- ``torch.cuda.is_available()`` is ``True``, ``device_count()`` 1, ``get_device_name()`` the
  target GPU's name, ``get_device_capability()`` its compute capability,
  ``is_bf16_supported()`` follows it; ``synchronize``, ``set_device``, ``manual_seed`` do
  nothing; ``empty_cache()`` empties the *simulated* cache; ``memory_allocated()``,
  ``memory_reserved()`` and their ``max_`` forms read the simulator;
- ``nn.init.trunc_normal_`` samples without rejection (the real loop reads tensor values);
  ``GradScaler.step`` steps the optimizer without asking (with ``.item()``) whether a gradient
  was inf/NaN: the estimate follows the usual path, finite gradients;
- with the CUDA emulation, ``torch.autocast("cpu", ...)`` (what device-agnostic code asks for,
  since fake tensors report ``cpu``) is CUDA autocast;
- everything is restored on exit.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), fake_cuda("H100-80GB", (9, 0)):
    ...     ok = torch.cuda.is_available()
    ...     x = torch.ones(4, device="cuda").cuda()
    >>> ok, x.device.type, torch.cuda.is_available()
    (True, 'cpu', False)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["fake_cuda"]

_CPU = torch.device("cpu")


def _is_cuda(x: Any) -> bool:
    if isinstance(x, str):
        return x == "cuda" or x.startswith("cuda:")
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return False


def _fake_apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` for fake parameters: PyTorch swaps fake parameters with
    ``swap_tensors``, which fails while anything holds a weak reference to them (the tracker
    does); a conversion is applied in place with ``.data =``, as for real CPU/CUDA tensors, and
    a no-op conversion (``.to("cuda")`` here) leaves the parameter alone."""
    if recurse:
        for m in self.children():
            m._apply(fn)
    for p in self._parameters.values():
        if p is None:
            continue
        with torch.no_grad():
            q = fn(p)
        if q is not p:
            p.data = q
        g = p.grad
        if g is not None:
            with torch.no_grad():
                h = fn(g)
            if h is not g:
                p.grad = h
    for k, b in self._buffers.items():
        if b is not None:
            self._buffers[k] = fn(b)
    return self


def _fake_trunc_normal(
    tensor: torch.Tensor, mean: float, std: float, a: float, b: float,
    generator: Any = None,
) -> torch.Tensor:
    """``nn.init.trunc_normal_`` without rejection sampling, whose loop reads tensor values
    (``mask.any()``), which fake tensors do not have. In place, like the real one; the real
    one's short-lived masks (during ``build``) are not simulated."""
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator).clamp_(a, b)


def _fake_maybe_opt_step(
    self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any
) -> Any:
    """``GradScaler`` steps the optimizer when no gradient was inf/NaN, which it learns with
    ``.item()``; fake gradients have no values, so the estimate takes the common path (finite
    gradients: the optimizer steps and its state is allocated)."""
    return optimizer.step(*args, **kwargs)


def _autocast_as_cuda() -> type:
    """``torch.autocast`` that turns ``device_type="cpu"`` into ``"cuda"``: on the fake GPU
    every tensor's device reads ``cpu``, so device-agnostic code
    (``torch.autocast(x.device.type, ...)``) asks for CPU autocast where the real run would get
    CUDA's."""
    base = torch.amp.autocast_mode.autocast

    class autocast(base):  # type: ignore[valid-type,misc]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if device_type == "cpu" and not caller.startswith("torch."):
                # user code; torch's own (checkpoint's recomputation) restores exact states
                device_type = "cuda"
            super().__init__(device_type, *args, **kwargs)

    autocast.__doc__ = base.__doc__
    return autocast


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the (fake) CPU device."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and args and _is_cuda(args[0]):
            return _CPU
        if func is torch.device and args and args[0] == "cuda":
            return _CPU
        if any(_is_cuda(a) for a in args):
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        dev = kwargs.get("device")
        if dev is not None and (_is_cuda(dev) or isinstance(dev, int)):
            kwargs = dict(kwargs, device=_CPU)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda(
    name: str,
    capability: tuple[int, int],
    *,
    empty_cache: Callable[[], None] | None = None,
    counters: Callable[[], tuple[int, int, int, int]] | None = None,
    cuda_autocast: bool = False,
) -> Iterator[None]:
    """Make user code see one CUDA device named ``name`` while fake tensors stand in for it.

    ``empty_cache`` is called by ``torch.cuda.empty_cache()``; ``counters`` returns
    ``(allocated, reserved, max_allocated, max_reserved)`` for the ``torch.cuda.memory_*``
    functions. ``cuda_autocast``: ``torch.autocast("cpu", ...)`` means CUDA autocast (set when
    the CUDA emulation, which applies CUDA's autocast policy, is active). Not thread-safe and not re-entrant: one estimate at a time per process.

    Example:
        >>> import torch
        >>> with fake_cuda("T4", (7, 5)):
        ...     torch.cuda.get_device_name(), torch.cuda.is_bf16_supported()
        ('T4', False)
    """
    cuda = torch.cuda
    counts = counters or (lambda: (0, 0, 0, 0))
    patches: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "get_device_name": lambda *a, **k: name,
        "get_device_capability": lambda *a, **k: capability,
        "is_bf16_supported": lambda *a, **k: capability >= (8, 0),
        "empty_cache": (lambda: empty_cache()) if empty_cache else (lambda: None),
        "memory_allocated": lambda *a, **k: counts()[0],
        "memory_reserved": lambda *a, **k: counts()[1],
        "max_memory_allocated": lambda *a, **k: counts()[2],
        "max_memory_reserved": lambda *a, **k: counts()[3],
        "reset_peak_memory_stats": lambda *a, **k: None,
    }
    saved = {k: getattr(cuda, k) for k in patches if hasattr(cuda, k)}
    module_apply = torch.nn.Module._apply
    init = torch.nn.init
    trunc = init._no_grad_trunc_normal_
    from torch.amp.grad_scaler import GradScaler

    opt_step = GradScaler._maybe_opt_step
    autocast_cls = torch.amp.autocast_mode.autocast
    mode = _CudaToCpu()
    try:
        for k, v in patches.items():
            setattr(cuda, k, v)
        torch.nn.Module._apply = _fake_apply  # type: ignore[method-assign]
        init._no_grad_trunc_normal_ = _fake_trunc_normal
        GradScaler._maybe_opt_step = _fake_maybe_opt_step  # type: ignore[method-assign]
        if cuda_autocast:
            torch.autocast = torch.amp.autocast = _autocast_as_cuda()  # type: ignore[misc,assignment]
        with mode:
            yield
    finally:
        torch.nn.Module._apply = module_apply  # type: ignore[method-assign]
        init._no_grad_trunc_normal_ = trunc
        GradScaler._maybe_opt_step = opt_step  # type: ignore[method-assign]
        torch.autocast = torch.amp.autocast = autocast_cls  # type: ignore[misc]
        for k in patches:
            if k in saved:
                setattr(cuda, k, saved[k])
            else:
                delattr(cuda, k)
