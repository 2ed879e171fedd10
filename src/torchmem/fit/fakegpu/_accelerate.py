"""accelerate under an estimate: its state sees the simulated GPU, so mixed precision is on.

accelerate decides its device once per process (``PartialState``: ``torch.device("cuda")`` when
``torch.cuda.is_available()``) and, from that device, whether ``mixed_precision="fp16"`` runs
autocast with a gradient scaler: only when ``device.type != "cpu"`` (``Accelerator.__init__``,
``native_amp``); on a CPU device fp16 is silently ignored. transformers' ``Trainer`` runs its
``fp16=True`` through accelerate. Under an estimate the fake tensors live on the (fake) CPU
device (:mod:`torchmem.fit.fakegpu._env`); an accelerate state made before the estimate (or by code
that asks under PyTorch's own device rules) would keep "cpu" and train an fp16 run in fp32, as
no GPU would.

:func:`accelerate_on_gpu` makes accelerate's default device the CUDA device (a ``torch.device``
made outside the rewrite; what accelerate moves to it still lands on the fake device) and gives
the estimate a fresh accelerate state (accelerate keeps one per process: a state made before the
estimate would keep its CPU device, and the estimate's must not outlive it); both are restored on
exit. So ``Accelerator(mixed_precision="fp16")`` gets ``native_amp``, ``torch.autocast("cuda",
float16)`` (CUDA's autocast policy, :mod:`torchmem.fit.fakegpu.kernels`) and a ``GradScaler("cuda")``, as
on the GPU. Nothing happens when accelerate is not installed.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> from torchmem.fit.fakegpu.kernels import CudaEmulation
    >>> from torchmem.fit.fakegpu._env import fake_cuda
    >>> with FakeTensorMode(), fake_cuda("V100-16GB", (7, 0)), CudaEmulation((7, 0)):
    ...     from accelerate import Accelerator
    ...     acc = Accelerator(mixed_precision="fp16")
    ...     on_gpu = (acc.device.type, acc.native_amp, acc.scaler is not None)
    >>> on_gpu
    ('cuda', True, True)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator

import torch

__all__ = ["accelerate_on_gpu"]

#: The device accelerate is given (made outside the estimate's device rewrite, which this
#: module may be imported under).
with torch._C.DisableTorchFunction():
    CUDA = torch.device("cuda")


@contextlib.contextmanager
def accelerate_on_gpu() -> Iterator[None]:
    """accelerate's default device is CUDA and its state fresh inside; restored on exit.

    Example:
        >>> with accelerate_on_gpu():
        ...     pass
    """
    if importlib.util.find_spec("accelerate") is None:
        yield
        return
    import accelerate.utils.random as arandom
    from accelerate.state import AcceleratorState, GradientState, PartialState

    states = (PartialState, AcceleratorState, GradientState)
    sync = arandom.__dict__.get("synchronize_rng_state")
    if sync is not None:
        arandom.synchronize_rng_state = _own_state_kept(sync)
    saved = [dict(cls._shared_state) for cls in states]
    default_device = PartialState.__dict__["default_device"]
    for cls in states:
        cls._shared_state.clear()
    PartialState.default_device = property(lambda self: CUDA)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PartialState.default_device = default_device  # type: ignore[method-assign]
        if sync is not None:
            arandom.synchronize_rng_state = sync
        for cls, old in zip(states, saved):
            cls._shared_state.clear()
            cls._shared_state.update(old)


def _fake(t: object) -> bool:
    """A tensor without data: a fake tensor, or one on the meta device."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.is_meta)


class _StateKept:
    """A ``torch.Generator`` whose ``set_state`` keeps its own state when given one without
    data (a fake tensor)."""

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator

    def get_state(self) -> torch.Tensor:
        return self._generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        if not _fake(state):
            self._generator.set_state(state)

    def __getattr__(self, name: str) -> object:
        return getattr(self._generator, name)


def _own_state_kept(original: Callable[..., None]) -> Callable[..., None]:
    """accelerate's ``synchronize_rng_state`` under fake ranks: rank 0's random state goes to
    the GPU, is broadcast and comes back (the GPU copy allocated and freed as on the GPUs), but
    what comes back is a fake tensor, which no generator can take; each rank keeps its own
    state, as rank 0 of a real job does (it receives its own). Before, every accelerate
    data loader with ``shuffle=True`` failed at its first batch under ``--world-size N``.

    Example:
        >>> g = torch.Generator(); before = g.get_state()
        >>> sync = _own_state_kept(lambda rng_type=None, generator=None: generator.set_state(
        ...     torch.empty(5056, dtype=torch.uint8, device="meta")))
        >>> sync("generator", generator=g)      # a state without data: the generator keeps its own
        >>> bool(torch.equal(g.get_state(), before))
        True
    """

    @functools.wraps(original)
    def synchronize_rng_state(rng_type: object = None, generator: object = None) -> None:
        kept = _StateKept(generator) if isinstance(generator, torch.Generator) else generator
        set_rng_state = torch.set_rng_state

        def own(new_state: torch.Tensor) -> None:
            if not _fake(new_state):
                set_rng_state(new_state)

        torch.set_rng_state = own
        try:
            original(rng_type, generator=kept)
        finally:
            torch.set_rng_state = set_rng_state

    return synchronize_rng_state
