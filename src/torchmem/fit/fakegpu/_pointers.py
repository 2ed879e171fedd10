"""Data pointers of fake tensors: distinct per storage, shared by views, and listed.

Libraries compare data pointers to find tensors that share memory: transformers' and
safetensors' ``storage_ptr`` / ``id_tensor_storage`` (tied weights before a save), optimizers
and fused kernels that group tensors by address, a script's own ``a.data_ptr() == b.data_ptr()``.
A fake tensor has no memory, so PyTorch answers 0 for every one of them (with a deprecation
warning): every tensor then looks like every other.

While :class:`SimulatedPointers` is active, ``Tensor.data_ptr()`` of a fake tensor and
``UntypedStorage.data_ptr()`` of its storage answer as the real ones do, from the estimate's own
allocator simulation:

- a GPU storage: the address the simulated caching allocator gave its block (distinct from every
  other live block, as on the GPU; the values themselves differ from a real run's, whose
  segments start wherever ``cudaMalloc`` puts them);
- a host storage: a made-up address, distinct per storage (from ``HOST_BASE`` up, far from the
  simulated GPU addresses);
- a storage of 0 bytes: 0 (PyTorch never allocates for it);
- a tensor: its storage's address plus ``storage_offset() * element_size()``, so views of one
  storage share addresses as in the real run.

Real tensors (and meta ones, which PyTorch answers with 0) keep their own pointers. Each place in
the user's code that reads a fake pointer is listed once among the estimate's assumed values
(op ``Tensor.data_ptr``, value ``"simulated address"``): the identity is exact, the number is not.

Example:
    >>> import torch
    >>> from torchmem.fit.fakegpu._values import ValueReads
    >>> from torch._subclasses import FakeTensorMode
    >>> class _Sim:  # what the estimate's simulator state provides
    ...     sid_of, addr = {}, {}
    >>> with FakeTensorMode():
    ...     a, b = torch.empty(4), torch.empty(4)
    >>> sim, values = _Sim(), ValueReads()
    >>> sim.sid_of = {a.untyped_storage()._cdata: 1, b.untyped_storage()._cdata: 2}
    >>> sim.addr = {1: 4096}
    >>> with SimulatedPointers(sim, values):
    ...     pa, pb, pv = a.data_ptr(), b.data_ptr(), a[1:].data_ptr()
    >>> pa, pv - pa, pb >= HOST_BASE
    (4096, 4, True)
    >>> [(r.op, r.value) for r in values.reads]
    [('Tensor.data_ptr', 'simulated address')]
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HOST_BASE", "SimulatedPointers"]

#: Where the made-up addresses of host storages start (32 TiB): far below the simulated GPU
#: segments, which the estimate places downwards from 128 TiB, as the driver does.
HOST_BASE = 1 << 45


class SimulatedPointers:
    """Context manager: fake tensors' ``data_ptr()`` answered from ``state`` (the estimate's
    simulator state: ``sid_of`` maps a storage's ``_cdata`` to its id, ``addr`` an id to its
    simulated GPU address) and each read listed in ``values``
    (:class:`~torchmem.fit.fakegpu._values.ValueReads`). Not re-entrant. See the module
    docstring for the rule and an example."""

    def __init__(self, state: Any, values: Any) -> None:
        self.state = state
        self.values = values
        self.host: dict[int, int] = {}  # storage id -> made-up host address
        self.next_host = HOST_BASE
        self.saved: list[tuple[Any, str, Any]] = []

    def storage_ptr(self, storage: Any) -> int | None:
        """The simulated address of fake storage ``storage``, or None for one the estimate
        does not know (a real storage, a meta one)."""
        sid = self.state.sid_of.get(storage._cdata)
        if sid is None:
            return None
        nbytes = storage.nbytes()
        if not nbytes:
            return 0
        addr = self.state.addr.get(sid)
        if addr is None:
            addr = self.host.get(sid)
            if addr is None:
                addr = self.host[sid] = self.next_host
                self.next_host += -(-nbytes // 512) * 512  # aligned as allocations are
        self.values.record("Tensor.data_ptr", "simulated address")
        return int(addr)

    def __enter__(self) -> SimulatedPointers:
        from torch._subclasses.fake_tensor import FakeTensor

        storage_data_ptr = torch.UntypedStorage.data_ptr
        me = self

        def untyped_data_ptr(self: Any) -> int:
            if self.device.type == "meta":  # a fake tensor's storage is a meta storage
                got = me.storage_ptr(self)
                if got is not None:
                    return got
            return int(storage_data_ptr(self))

        def tensor_data_ptr(self: torch.Tensor) -> int:
            with torch._C.DisableTorchFunction():
                storage = self.untyped_storage()
                offset = int(self.storage_offset()) * self.element_size()
            got = me.storage_ptr(storage)
            if got is None:
                return 0  # what PyTorch answers for a fake tensor it does not know
            return got + offset if got else 0

        for owner, name, new in ((torch.UntypedStorage, "data_ptr", untyped_data_ptr),
                                 (FakeTensor, "data_ptr", tensor_data_ptr)):
            self.saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, new)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, old in reversed(self.saved):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.saved.clear()
