"""The public transfers and their results: a tensor (:func:`transfer`, :func:`transfer_async`,
:func:`chunked_transfer`) or a module (:func:`transfer_module`) to another device.

The chunk loop lives in :mod:`torchmem.transfer.pipeline`, its staging buffers in
:mod:`torchmem.transfer.staging`, streams and device specs in :mod:`torchmem.transfer.streams`.
Rules every path follows:

* GPU to GPU: the copy runs on the (source, target) transfer stream after that stream waits on an
  event recorded on the producer's stream; the source is ``record_stream``-ed onto the transfer
  stream so the caching allocator cannot hand its memory out early; the consumer stream waits on
  an event recorded after the copy. Nothing calls a device-wide synchronize.
* CPU to GPU: ``non_blocking`` only from pinned memory. Pageable tensors are staged chunk by chunk
  through (at most) two reusable pinned buffers: while the DMA engine copies chunk ``k`` the host
  gathers chunk ``k + 1`` into the other buffer; a buffer is refilled only after the event of its
  previous copy has completed.
* GPU to CPU: synchronized by default (the host waits on the copy's event, not the device);
  :func:`transfer_async` returns a :class:`PendingTransfer` with the event instead.
* CPU to CPU and anything to meta run the *same* chunk loop with synchronous copies (meta:
  shape-only, staging buffers are meta tensors), so chunk arithmetic and staging sizes are
  measured on machines without a GPU.

Staging memory is measured, not assumed: :class:`StagingBuffers` tracks the storages it actually
allocated through weak finalizers, and reports their live and peak bytes.

Example:
    >>> import torch
    >>> x = torch.arange(10, dtype=torch.float32)
    >>> r = chunked_transfer(x, "cpu", chunk_bytes=16)      # 40 bytes in chunks of 16
    >>> r.chunk_sizes, r.peak_staging_bytes, torch.equal(r.tensor, x)
    ((16, 16, 8), 32, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from torchmem.errors import InvalidInputError, TransferError, UnsupportedTensorError
from torchmem.move import move_module
from torchmem.transfer.pipeline import (
    _as_spec,
    _engine_stream,
    _new_pool,
    _no_data,
    _staged,
    copy_storages,
)
from torchmem.transfer.staging import DEFAULT_CHUNK_BYTES, StagingBuffers, _chunk_size
from torchmem.transfer.streams import (
    DeviceLike,
    DeviceSpec,
    _require_available,
    canonical_device,
    current_stream,
    use_stream,
)
from torchmem.units import format_bytes

__all__ = [
    "TransferResult",
    "PendingTransfer",
    "transfer",
    "transfer_async",
    "chunked_transfer",
    "transfer_module",
]


def _check_tensor(x: object, what: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InvalidInputError(
            f"expected a torch.Tensor for {what}, got {type(x).__module__}.{type(x).__name__}. "
            "Fix: pass a tensor (use transfer_module for an nn.Module)."
        )
    if x.layout is not torch.strided or getattr(x, "is_nested", False):
        raise UnsupportedTensorError(
            f"{what} has layout {x.layout}{' (nested)' if x.is_nested else ''}; transfers handle "
            "strided tensors only. Fix: move its component tensors (e.g. .indices() and .values()) "
            "or convert it with .to_dense()."
        )
    return x


def _check_on(x: torch.Tensor, spec: DeviceSpec, label: str, other: DeviceSpec) -> None:
    got = canonical_device(x.device)
    if got != spec.device:
        raise TransferError(
            f"{label} expected its input on {spec.device} (the source device), got a tensor on "
            f"{got}. Fix: move it first with x.to('{spec.device}'), or use the operator in the "
            f"other direction (its adjoint .H takes tensors on {other.device})."
        )


@dataclass(eq=False)
class TransferResult:
    """What a chunked transfer did: the result and measured byte counts.

    ``bytes_moved`` is the data copied to the target (for a ``meta`` target nothing is copied and
    ``shape_only`` is true; the figure is the bytes that would move). ``chunk_sizes`` are the
    chunks actually copied, in bytes. ``peak_staging_bytes`` is the highest staging memory alive
    during the transfer, measured from the staging storages. ``event`` (accelerator targets) is
    the event consumers wait on; the consumer stream already waits on it.

    Example:
        >>> import torch
        >>> r = chunked_transfer(torch.zeros(3, dtype=torch.int16), "meta", chunk_bytes=4)
        >>> r.shape_only, r.bytes_moved, r.chunks, r.tensor.device.type
        (True, 6, 2, 'meta')
    """

    tensor: Optional[torch.Tensor]
    source: str
    target: str
    bytes_moved: int
    chunk_bytes: int
    chunk_sizes: tuple[int, ...]
    staging_buffers_created: int
    peak_staging_bytes: int
    storages: int = 1
    shape_only: bool = False
    seconds: float = 0.0
    event: Any = field(default=None, repr=False)

    @property
    def chunks(self) -> int:
        """Number of chunks copied.

        Example:
            >>> import torch
            >>> chunked_transfer(torch.zeros(0), "cpu").chunks
            0
        """
        return len(self.chunk_sizes)

    def __repr__(self) -> str:
        return (
            f"TransferResult({self.source} -> {self.target}: {format_bytes(self.bytes_moved)} in "
            f"{self.chunks} chunk(s) of <= {format_bytes(self.chunk_bytes)}, peak staging "
            f"{format_bytes(self.peak_staging_bytes)}{', shape-only' if self.shape_only else ''})"
        )


@dataclass(eq=False)
class PendingTransfer:
    """A transfer whose copy may still be running: wait on ``event`` before reading ``tensor``.

    Example:
        >>> import torch
        >>> p = transfer_async(torch.ones(2), "meta")
        >>> p.ready(), p.wait().device.type
        (True, 'meta')
    """

    tensor: torch.Tensor
    event: Any = None

    def ready(self) -> bool:
        """True when the copy has finished (never blocks).

        Example:
            >>> import torch
            >>> PendingTransfer(torch.ones(1)).ready()
            True
        """
        return self.event is None or bool(self.event.query())

    def wait(self) -> torch.Tensor:
        """Block the host until the copy is done (waits on the event only), then return the tensor.

        Example:
            >>> import torch
            >>> PendingTransfer(torch.ones(1)).wait()
            tensor([1.])
        """
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


def _transfer(
    x: torch.Tensor,
    ispec: DeviceSpec,
    ospec: DeviceSpec,
    *,
    non_blocking: bool = False,
    staging: Optional[StagingBuffers] = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ledger: Any = None,
    label: str = "transfer",
) -> tuple[torch.Tensor, Any]:
    """Move ``x`` from ``ispec`` to ``ospec``; returns ``(tensor, event or None)``."""
    _check_tensor(x)
    _check_on(x, ispec, label, ospec)
    src, dst = ispec.device, ospec.device
    if src == dst:
        return x, None
    if dst.type == "meta":
        out = x.to("meta")
        if ledger is not None:
            ledger.allocate(out)
        return out, None
    if src.type == "meta":
        raise _no_data(src, dst)
    _require_available(src)
    _require_available(dst)
    if not ispec.is_accelerator:  # CPU -> accelerator
        if x.is_pinned():
            ts = _engine_stream(ispec, ospec)
            with use_stream(ts):
                out = x.to(dst, non_blocking=True)
            ev = ts.record_event()
            consumer = ospec.compute()
            consumer.wait_event(ev)
            out.record_stream(consumer)
        else:
            out, _, ev, _ = _staged(x, ispec, ospec, staging, chunk_bytes, ledger)
        if ledger is not None:
            ledger.allocate(out)
        return out, ev
    ts = _engine_stream(ispec, ospec)
    ts.wait_event(ispec.compute().record_event())  # the copy starts after the producer's work
    if not ospec.is_accelerator:  # accelerator -> CPU
        out = torch.empty(tuple(x.shape), dtype=x.dtype, pin_memory=non_blocking)
        with use_stream(ts):
            out.copy_(x, non_blocking=non_blocking)
        x.record_stream(ts)
        ev = ts.record_event()
        if not non_blocking:
            ev.synchronize()  # waits for this copy only, not the whole device
    else:  # accelerator -> accelerator
        with use_stream(ts):
            out = x.to(dst, non_blocking=True)
        x.record_stream(ts)
        ev = ts.record_event()
        consumer = ospec.compute()
        consumer.wait_event(ev)
        if consumer is not current_stream(dst):
            out.record_stream(consumer)
    if ledger is not None:
        ledger.allocate(out)
    return out, ev


def transfer(
    x: torch.Tensor,
    device: DeviceLike,
    *,
    source: Optional[DeviceLike] = None,
    staging: Optional[StagingBuffers] = None,
    chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
    ledger: Any = None,
) -> torch.Tensor:
    """Move a tensor to ``device`` the right way for the device pair (see the module notes).

    Returns ``x`` itself when it is already there (like ``Tensor.to``). Host targets are
    synchronized; accelerator targets are ordered on the consumer stream (``compute_stream`` of a
    :class:`DeviceSpec` target, else the current stream). ``source`` (default: ``x.device``) is
    checked against ``x``. New tensors are reported to ``ledger.allocate`` when given.

    Example:
        >>> import torch
        >>> y = transfer(torch.ones(2, 3), "meta")
        >>> y.device.type, tuple(y.shape)
        ('meta', (2, 3))
        >>> x = torch.ones(2); transfer(x, "cpu") is x
        True
    """
    x = _check_tensor(x)
    ispec = _as_spec(source if source is not None else x.device)
    out, _ = _transfer(
        x, ispec, _as_spec(device), staging=staging, chunk_bytes=_chunk_size(chunk_bytes),
        ledger=ledger,
    )
    return out


def transfer_async(
    x: torch.Tensor,
    device: DeviceLike,
    *,
    source: Optional[DeviceLike] = None,
    staging: Optional[StagingBuffers] = None,
    chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
    ledger: Any = None,
) -> PendingTransfer:
    """Like :func:`transfer`, but GPU to CPU copies do not block: wait on the returned event.

    The host tensor of a GPU to CPU copy is pinned (required for an asynchronous copy); read it
    only after :meth:`PendingTransfer.wait` (or once :meth:`PendingTransfer.ready`). For other
    pairs the event, when there is one, is the one the consumer stream already waits on.

    Example:
        >>> import torch
        >>> p = transfer_async(torch.ones(4), "cpu")        # same device: done at once
        >>> p.event is None, p.wait().sum().item()
        (True, 4.0)
        >>> p = transfer_async(torch.ones(4, device="cuda"), "cpu")  # doctest: +SKIP
        >>> p.wait()                                                 # doctest: +SKIP
        tensor([1., 1., 1., 1.])
    """
    x = _check_tensor(x)
    ispec = _as_spec(source if source is not None else x.device)
    out, ev = _transfer(
        x, ispec, _as_spec(device), non_blocking=True, staging=staging,
        chunk_bytes=_chunk_size(chunk_bytes), ledger=ledger,
    )
    return PendingTransfer(out, ev)


def chunked_transfer(
    x: torch.Tensor,
    device: DeviceLike,
    *,
    chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
    staging: Optional[StagingBuffers] = None,
    ledger: Any = None,
) -> TransferResult:
    """Copy a (large) tensor to ``device`` in chunks through two staging buffers; always copies.

    At most two chunks of staging memory are alive (fewer for small tensors); chunk boundaries
    fall on element boundaries (``chunk_bytes`` is rounded down to a multiple of the element
    size). The result has the layout ``Tensor.to`` gives (``preserve_format``: a permutation such
    as ``x.t()`` keeps its strides and is copied as plain bytes); inputs with gaps or overlaps
    (stepped slices, ``expand``) are read block by block, never copied whole. CPU to CPU and CPU to meta run the same loop synchronously. GPU to GPU
    needs no staging and is one stream-ordered copy. ``staging`` reuses a
    :class:`StagingBuffers` across calls; ``ledger`` receives ``allocate``/``free`` for staging
    buffers and ``allocate`` for the result.

    Example:
        >>> import torch
        >>> x = torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, ::2]   # gaps: 6 ints
        >>> r = chunked_transfer(x, "cpu", chunk_bytes=10)                  # 2 ints per chunk
        >>> r.chunk_sizes, r.peak_staging_bytes, torch.equal(r.tensor, x)
        ((8, 8, 8), 16, True)
        >>> y = torch.zeros(3, 4).t()
        >>> chunked_transfer(y, "cpu").tensor.stride() == y.to("cpu", copy=True).stride() == (1, 4)
        True
    """
    x = _check_tensor(x)
    cb = _chunk_size(chunk_bytes)
    ispec, ospec = DeviceSpec(x.device), _as_spec(device)
    if ispec.type == "meta" and ospec.type != "meta":
        raise _no_data(ispec.device, ospec.device)
    _require_available(ospec.device)
    t0 = time.perf_counter()
    if ispec.is_accelerator and ospec.is_accelerator:
        if ispec.device == ospec.device:
            with use_stream(ospec.compute()):
                out = x.clone(memory_format=torch.contiguous_format)
            ev = None
        else:
            out, ev = _transfer(x, ispec, ospec)
            out = out.contiguous()
        if ledger is not None:
            ledger.allocate(out)
        n = x.numel() * x.element_size()
        return TransferResult(
            out, str(ispec.device), str(ospec.device), n, cb, (n,) if n else (), 0, 0,
            seconds=time.perf_counter() - t0, event=ev,
        )
    if ispec.is_accelerator and staging is None and ospec.type == "cpu":
        staging = StagingBuffers(cb)  # pinned: the DMA target of each chunk
    pool = _new_pool(staging, cb, ospec.type == "meta")
    pool.reset_peak()
    created0 = pool.buffers_created
    out, sizes, ev, pool = _staged(x, ispec, ospec, pool, cb, ledger)
    if ledger is not None:
        ledger.allocate(out)
    result = TransferResult(
        out, str(ispec.device), str(ospec.device), sum(sizes), min(cb, pool.chunk_bytes), sizes,
        pool.buffers_created - created0, pool.peak_bytes, shape_only=ospec.type == "meta",
        seconds=time.perf_counter() - t0, event=ev,
    )
    if staging is None:
        pool.release(ledger)
    return result


def transfer_module(
    module: torch.nn.Module,
    device: DeviceLike,
    *,
    chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
    staging: Optional[StagingBuffers] = None,
    ledger: Any = None,
) -> TransferResult:
    """Move a module's parameters, gradients and buffers to ``device`` in place, in chunks.

    A thin call into :func:`torchmem.move.move_module`, the move behind
    :func:`torchmem.memory_aware_to`: the same aliasing, identity and all-or-nothing guarantees
    (on failure the module is left as it was), with every storage copied (also those already on
    ``device``) through this package's chunked, stream-ordered pipeline. Each distinct storage is
    copied once (tied weights and views that share a storage stay shared); small tensors are
    packed into the same chunk. Parameters keep their identity, so optimizers holding them keep
    working. ``ledger`` gets ``allocate`` for the new tensors; the old storages are not credited
    as freed here (they may still be held elsewhere): a ledger that tracks storage deaths credits
    them when they die.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 4)                    # 64 + 16 bytes
        >>> r = transfer_module(lin, "meta", chunk_bytes=32)
        >>> lin.weight.device.type, r.bytes_moved, r.chunk_sizes, r.storages
        ('meta', 80, (32, 32, 16), 2)
    """
    if not isinstance(module, torch.nn.Module):
        raise InvalidInputError(
            f"expected a torch.nn.Module, got {type(module).__name__}. Fix: use chunked_transfer "
            "for a tensor."
        )
    cb = _chunk_size(chunk_bytes)
    ospec = _as_spec(device)
    t0 = time.perf_counter()
    sources: set[str] = set()
    sizes: list[int] = []
    created = peak = nstorages = 0

    def copier(
        storages: list[torch.UntypedStorage], target: torch.device
    ) -> list[torch.UntypedStorage]:
        nonlocal created, peak, nstorages
        by_dev: dict[str, list[int]] = {}
        for i, s in enumerate(storages):
            by_dev.setdefault(str(canonical_device(s.device)), []).append(i)
        out: list[Any] = [None] * len(storages)
        for dev, idxs in by_dev.items():
            new, moved, c, p = copy_storages(
                [storages[i] for i in idxs], ospec, chunk_bytes=cb, staging=staging,
                ledger=ledger,
            )
            sources.add(dev)
            sizes.extend(moved)
            created += c
            peak = max(peak, p)
            nstorages += len(idxs)
            for i, n in zip(idxs, new):
                out[i] = n
        return out

    moved = move_module(module, ospec.device, copy=True, copier=copier)
    if ledger is not None:
        for t in moved:
            ledger.allocate(t)
    return TransferResult(
        None, ",".join(sorted(sources)) or str(ospec.device), str(ospec.device), sum(sizes), cb,
        tuple(sizes), created, peak, storages=nstorages, shape_only=ospec.type == "meta",
        seconds=time.perf_counter() - t0,
    )
