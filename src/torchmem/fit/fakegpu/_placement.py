"""Host and GPU apart in the fake run: which fake storages the simulated GPU holds.

The estimate runs every tensor as a fake *CPU* tensor (a CPU-only PyTorch cannot run autograd
on fake CUDA tensors), so where a tensor lives is kept here, per storage, as PyTorch would
decide it on a machine with a GPU:

- a call with an explicit device (``device="cuda"``, ``device=0``, ``torch.device("cuda")``,
  ``device="cpu"``; ``with torch.device("cuda")`` and ``torch.set_default_device("cuda")``
  add one to factory calls) makes its new storages there;
- ``.to("cuda")``, ``.cuda()``, ``.to(other)``, ``module.to(...)`` of a host tensor copy it
  to the GPU (a new GPU storage; the host one lives on while referenced), ``.cpu()`` and
  ``.to("cpu")`` of a GPU tensor copy it to the host; ``.pin_memory()`` copies a host tensor
  into (pinned) host memory;
- any other operator makes its outputs on the GPU when one of its tensor inputs is there
  (CUDA accepts host scalars beside GPU tensors), on the host when all are on the host;
- a factory call with no device (``torch.zeros(3)``) makes host memory, as in PyTorch, except
  inside a call on GPU tensors (the temporaries an operator makes are on its device).

Code that asks where a tensor is sees the GPU: ``x.device`` is ``cuda:0``, ``x.is_cuda`` is
``True``, ``x.get_device()`` is 0 for GPU tensors; PyTorch's own internals (inside an
operator) still see the fake CPU device.

Example:
    >>> pl = Placement()
    >>> pl.gpu_of([]), pl.forced
    (None, None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Placement"]

_CUDA0 = torch.device("cuda", 0)
_REAL = (torch.Tensor, torch.nn.Parameter)


class Placement:
    """Where each live fake storage is: the set of host storages (tracker ids) and the
    placement of the call being run.

    ``key_to_sid`` maps a storage's key (``UntypedStorage._cdata``) to the tracker's storage
    id (the estimate's ``_State.sid_of.get``).

    Example:
        >>> pl = Placement()
        >>> with pl.force(False):
        ...     pl.for_op((), {})
        False
        >>> pl.for_op((), {})        # a factory operator outside any call: the host
        False
    """

    def __init__(self, key_to_sid: Callable[[int], int | None] | None = None) -> None:
        self.key_to_sid = key_to_sid or (lambda key: None)
        #: tracker ids of live host storages
        self.host: set[int] = set()
        #: tracker ids of every storage that was ever on the host
        self.host_ever: set[int] = set()
        #: placement forced on every storage the current call makes (True: GPU)
        self.forced: bool | None = None
        #: placement of storages made by an operator with no tensor input (True: GPU)
        self.context: bool = False
        #: >0 while an operator is being dispatched (PyTorch's internals see the CPU)
        self.depth = 0
        #: the placement of the operator being dispatched (read by the allocation feed)
        self.current: bool = True
        #: told each host storage the run makes for real (data prepared from host data, see
        #: :mod:`torchmem.fit.fakegpu._env`), for the estimate's host-memory count; None: the
        #: run makes none
        self.on_real_host: Callable[[torch.UntypedStorage], None] | None = None

    # -- queries ---------------------------------------------------------------------------------

    def is_gpu(self, t: torch.Tensor) -> bool | None:
        """``True`` when ``t``'s storage is on the simulated GPU, ``False`` on the host, ``None``
        when the run does not know it (a tensor made outside the estimate)."""
        try:
            with torch._C.DisableTorchFunction():
                key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # a subclass without one storage
            return True
        sid = self.key_to_sid(key)
        if sid is None:
            return None
        return sid not in self.host

    def gpu_of(self, tensors: Any) -> bool | None:
        """The placement of an operator's outputs from its tensor inputs: ``True`` when one
        is on the GPU, ``False`` when all known ones are on the host, ``None`` without any."""
        seen = None
        for t in tensors:
            g = self.is_gpu(t)
            if g:
                return True
            if g is False:
                seen = False
        return seen

    def for_op(self, args: Any, kwargs: Any) -> bool:
        """Where the operator about to run with ``args``/``kwargs`` makes new storages."""
        if self.forced is not None:
            return self.forced
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None and getattr(dev, "type", dev) == "cuda":
                return True  # asked for below the function mode (inside another operator)
        # a plain (real) tensor is a constant lifted into the run (torch.tensor(numpy_array)):
        # it does not place the output; fake tensors and subclasses (DTensor) do
        tensors = [t for t in _tensors(args, kwargs) if type(t) not in _REAL]
        if not tensors:
            return self.context
        if not self.host:  # nothing on the host: every known input is on the GPU
            return True
        g = self.gpu_of(tensors)
        return self.context if g is None else g

    # -- scopes ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def force(self, gpu: bool | None) -> Iterator[None]:
        """Every storage made inside is on the GPU (``True``) or the host (``False``);
        ``None`` changes nothing."""
        if gpu is None:
            yield
            return
        saved = self.forced
        self.forced = gpu
        try:
            yield
        finally:
            self.forced = saved

    @contextlib.contextmanager
    def within(self, gpu: bool) -> Iterator[None]:
        """A call on tensors placed ``gpu``: the temporaries its operators make there."""
        saved = self.context
        self.context = gpu
        try:
            yield
        finally:
            self.context = saved

    # -- the tensor's own view -----------------------------------------------------------------

    def device_property(self, original: Any) -> property:
        """``FakeTensor.device`` that says ``cuda:0`` for GPU tensors outside operators."""

        def device(t: torch.Tensor) -> torch.device:
            d = original.__get__(t)
            # only tensors the run made on the GPU: a tensor it does not know (DTensor's
            # metadata propagation, outside the run's modes) keeps its device, so PyTorch's
            # fake-tensor cache never records "cuda" for a fake CPU tensor
            if self.depth == 0 and d.type == "cpu" and self.is_gpu(t):
                return _CUDA0
            return d

        return property(device)


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an operator's arguments (one level of lists, as operators take)."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(b for b in a if isinstance(b, torch.Tensor))
    return out
