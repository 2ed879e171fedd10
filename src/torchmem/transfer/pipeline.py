"""The chunk loop behind every staged transfer: bytes copied through two staging buffers.

A source (one tensor, or the distinct storages behind several tensors) is read as a byte stream
in chunks of at most ``chunk_bytes``; each chunk is gathered into staging buffer ``k % 2`` and
copied to the target while the next chunk is gathered into the other buffer (see
:mod:`torchmem.transfer.engine` for the stream and event rules). Non-contiguous sources are read
block by block, never copied whole. :func:`move_storages` copies the storages behind a set of
tensors in packed chunks and rebuilds the tensors on the target with the same aliasing.

Example:
    >>> import torch
    >>> base = torch.arange(6.0); views = [base[:2], base[2:]]
    >>> new, sizes, created, peak, storages = move_storages(
    ...     views, "cpu", chunk_bytes=16, staging=None, ledger=None)
    >>> sizes, storages, new[1].storage_offset(), new[0].untyped_storage() is new[1].untyped_storage()
    ((16, 8), 1, 2, True)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import torch

from torchmem.errors import InvalidInputError, TransferError
from torchmem.transfer.staging import StagingBuffers
from torchmem.transfer.streams import (
    DeviceLike,
    DeviceSpec,
    _require_available,
    canonical_device,
    transfer_stream,
    use_stream,
)

__all__ = ["copy_storages", "move_storages"]


def _no_data(src: torch.device, dst: torch.device) -> TransferError:
    return TransferError(
        f"cannot transfer from {src} to {dst}: a meta tensor has shapes but no data. Fix: "
        f"materialize it on {dst} (torch.empty_like(x, device='{dst}')) or keep the run "
        "shape-only by targeting 'meta'."
    )


def _as_spec(d: DeviceLike) -> DeviceSpec:
    return d if isinstance(d, DeviceSpec) else DeviceSpec(d)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _storage_bytes_view(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


class _Bytes:
    """Several flat uint8 tensors seen as one byte stream (a chunk may span several)."""

    def __init__(self, flats: Sequence[torch.Tensor]) -> None:
        self.flats = list(flats)
        self.starts: list[int] = []
        pos = 0
        for f in self.flats:
            self.starts.append(pos)
            pos += f.numel()
        self.nbytes = pos

    def _pieces(self, a: int, b: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        for f, s in zip(self.flats, self.starts):
            e = s + f.numel()
            if e <= a or s >= b:
                continue
            lo, hi = max(a, s), min(b, e)
            yield f, lo - s, hi - s, lo - a

    def read(self, a: int, b: int, buf: torch.Tensor, non_blocking: bool = False) -> None:
        for f, lo, hi, pos in self._pieces(a, b):
            buf[pos : pos + hi - lo].copy_(f[lo:hi], non_blocking=non_blocking)

    def write(self, a: int, b: int, buf: torch.Tensor, non_blocking: bool = False) -> None:
        for f, lo, hi, pos in self._pieces(a, b):
            f[lo:hi].copy_(buf[pos : pos + hi - lo], non_blocking=non_blocking)

    def tensors(self) -> list[torch.Tensor]:
        return self.flats


def _blocks(t: torch.Tensor, a: int, b: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` covering its row-major elements ``[a, b)``, in order (at most 2*ndim)."""
    if a >= b:
        return
    if t.dim() <= 1:
        yield t.reshape(-1)[a:b] if t.dim() == 0 else t[a:b]
        return
    inner = math.prod(t.shape[1:])
    ia, ra = divmod(a, inner)
    ib, rb = divmod(b, inner)
    if ia == ib:
        yield from _blocks(t[ia], ra, rb)
        return
    if ra:
        yield from _blocks(t[ia], ra, inner)
        ia += 1
    if ib > ia:
        yield t[ia:ib]
    if rb:
        yield from _blocks(t[ib], 0, rb)


class _Strided:
    """One non-contiguous tensor read in row-major order without a full contiguous copy."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.es = t.element_size()
        self.nbytes = t.numel() * self.es

    def read(self, a: int, b: int, buf: torch.Tensor, non_blocking: bool = False) -> None:
        typed = buf[: b - a].view(self.t.dtype)
        pos = 0
        for block in _blocks(self.t, a // self.es, b // self.es):
            n = block.numel()
            typed[pos : pos + n].view(block.shape).copy_(block, non_blocking=non_blocking)
            pos += n

    def tensors(self) -> list[torch.Tensor]:
        return [self.t]


_Source = Union[_Bytes, _Strided]


def _plan(nbytes: int, chunk_bytes: int, align: int) -> list[tuple[int, int]]:
    step = chunk_bytes - chunk_bytes % align
    if step <= 0:
        raise InvalidInputError(
            f"chunk_bytes={chunk_bytes} is smaller than one element ({align} bytes). "
            f"Fix: use chunk_bytes >= {align}."
        )
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def _engine_stream(ispec: DeviceSpec, ospec: DeviceSpec) -> Any:
    """The stream that drives a copy: the source's when it is an accelerator, else the target's."""
    if ispec.is_accelerator:
        return ispec.stream_to(ospec.device)
    if ospec.is_accelerator:
        if ospec.transfer_stream is not None:
            return ospec.transfer_stream
        return transfer_stream(ispec.device, ospec.device)
    return None


def _pipeline(
    src: _Source,
    sink: _Bytes,
    ispec: DeviceSpec,
    ospec: DeviceSpec,
    pool: StagingBuffers,
    chunk_bytes: int,
    align: int,
    ledger: Any,
) -> tuple[tuple[int, ...], Any]:
    """The double-buffered chunk loop. Returns the chunk sizes copied and the final event."""
    plan = _plan(src.nbytes, chunk_bytes, align)
    if not plan:
        return (), None
    capacity = plan[0][1] - plan[0][0]
    ts = _engine_stream(ispec, ospec)
    sizes: list[int] = []
    if not ispec.is_accelerator:
        # Host (or meta) source: gather chunk k into buffer k % 2 on the host, then copy it to the
        # target; with an accelerator target the copy is queued on the transfer stream and the
        # host goes on gathering chunk k + 1 into the other buffer while the DMA runs.
        for k, (a, b) in enumerate(plan):
            slot = k & 1
            buf = pool.acquire(slot, b - a, capacity, ledger)  # waits for the copy k - 2
            src.read(a, b, buf)
            with use_stream(ts):
                sink.write(a, b, buf, non_blocking=ts is not None)
            pool.record(slot, ts.record_event() if ts is not None else None)
            sizes.append(b - a)
        last = ts.record_event() if ts is not None else None
        if last is not None:
            consumer = ospec.compute()
            consumer.wait_event(last)
            for t in sink.tensors():
                t.record_stream(consumer)
        return tuple(sizes), last
    # Accelerator source, host target: DMA chunk k into a pinned buffer on the transfer stream,
    # and while it runs drain chunk k - 1 from the other buffer into the target on the host.
    producer = ispec.compute()
    ts.wait_event(producer.record_event())
    pending: Optional[tuple[int, int, int, torch.Tensor]] = None
    for k, (a, b) in enumerate(plan):
        slot = k & 1
        buf = pool.acquire(slot, b - a, capacity, ledger)
        with use_stream(ts):
            src.read(a, b, buf, non_blocking=True)
        pool.record(slot, ts.record_event())
        if pending is not None:
            pa, pb, pslot, pbuf = pending
            pool.wait(pslot)
            sink.write(pa, pb, pbuf)
        pending = (a, b, slot, buf)
        sizes.append(b - a)
    assert pending is not None
    pa, pb, pslot, pbuf = pending
    pool.wait(pslot)
    sink.write(pa, pb, pbuf)
    for t in src.tensors():
        t.record_stream(ts)
    return tuple(sizes), None


def _new_pool(pool: Optional[StagingBuffers], chunk_bytes: int, shape_only: bool) -> StagingBuffers:
    if pool is not None:
        if not isinstance(pool, StagingBuffers):
            raise InvalidInputError(
                f"staging must be a torchmem.transfer.StagingBuffers, got {type(pool).__name__}. Fix: pass "
                "StagingBuffers(chunk_bytes) or None for a temporary one."
            )
        return pool
    return StagingBuffers(chunk_bytes, device="meta" if shape_only else "cpu")


def _empty_on(shape: Sequence[int], dtype: torch.dtype, ispec: DeviceSpec, ospec: DeviceSpec) -> torch.Tensor:
    # Allocate on the transfer stream when one drives the copy, so the allocator orders reuse.
    with use_stream(_engine_stream(ispec, ospec) if ospec.is_accelerator else None):
        return torch.empty(tuple(shape), dtype=dtype, device=ospec.device)


def _staged(
    x: torch.Tensor,
    ispec: DeviceSpec,
    ospec: DeviceSpec,
    pool: Optional[StagingBuffers],
    chunk_bytes: int,
    ledger: Any,
) -> tuple[torch.Tensor, tuple[int, ...], Any, StagingBuffers]:
    shape_only = ospec.type == "meta"
    pool = _new_pool(pool, chunk_bytes, shape_only)
    chunk = min(chunk_bytes, pool.chunk_bytes)
    # The result is laid out as Tensor.to lays it out (memory_format=torch.preserve_format:
    # empty_like keeps the input's dimension order), and chunks follow the result's memory order,
    # so permutations such as x.t() are read as their plain bytes.
    with use_stream(_engine_stream(ispec, ospec) if ospec.is_accelerator else None):
        out = torch.empty_like(x, device=ospec.device)
    perm = sorted(range(x.dim()), key=lambda d: -int(out.stride()[d]))
    out_p, x_p = (out.permute(perm), x.permute(perm)) if x.dim() else (out, x)
    if not out_p.is_contiguous():  # pragma: no cover - empty_like always gives a dense layout
        out = _empty_on(x.shape, x.dtype, ispec, ospec)
        out_p, x_p = out, x
    src: _Source = _Bytes([_flat_bytes(x_p)]) if x_p.is_contiguous() else _Strided(x_p)
    sink = _Bytes([_flat_bytes(out_p)])
    sizes, ev = _pipeline(src, sink, ispec, ospec, pool, chunk, x.element_size(), ledger)
    return out, sizes, ev, pool


def copy_storages(
    storages: Sequence[torch.UntypedStorage],
    device: DeviceLike,
    *,
    chunk_bytes: int,
    staging: Optional[StagingBuffers],
    ledger: Any,
) -> tuple[list[torch.UntypedStorage], tuple[int, ...], int, int]:
    """Copy distinct storages, all on one device, to ``device`` in packed chunks (one new each).

    Small storages share a chunk. GPU to GPU is one stream-ordered copy per storage (no
    staging). Returns the new storages (in order), the chunk sizes, the staging buffers created
    and the peak staging bytes. ``staging`` is reused when given; ``ledger`` hears about staging
    buffers only.

    Example:
        >>> import torch
        >>> s = [torch.ones(3).untyped_storage(), torch.zeros(2).untyped_storage()]
        >>> new, sizes, created, peak = copy_storages(
        ...     s, "meta", chunk_bytes=8, staging=None, ledger=None)
        >>> [n.nbytes() for n in new], sizes, created, peak
        ([12, 8], (8, 8, 4), 2, 16)
    """
    if not storages:
        return [], (), 0, 0
    devs = {canonical_device(s.device) for s in storages}
    if len(devs) != 1:
        raise TransferError(
            f"expected all tensors on one device, got {sorted(map(str, devs))}. Fix: move each "
            "device's tensors separately."
        )
    ispec, ospec = DeviceSpec(devs.pop()), _as_spec(device)
    if ispec.type == "meta" and ospec.type != "meta":
        raise _no_data(ispec.device, ospec.device)
    _require_available(ospec.device)
    src_flats = [_storage_bytes_view(s) for s in storages]
    dst_flats = [_empty_on((f.numel(),), torch.uint8, ispec, ospec) for f in src_flats]
    if ispec.is_accelerator and ospec.is_accelerator:
        ts = _engine_stream(ispec, ospec)
        ts.wait_event(ispec.compute().record_event())
        with use_stream(ts):
            for sf, df in zip(src_flats, dst_flats):
                df.copy_(sf, non_blocking=True)
        for sf in src_flats:
            sf.record_stream(ts)
        consumer = ospec.compute()
        consumer.wait_event(ts.record_event())
        for d in dst_flats:
            d.record_stream(consumer)
        n = sum(f.numel() for f in src_flats)
        sizes: tuple[int, ...] = (n,) if n else ()
        created = peak = 0
    else:
        if ispec.is_accelerator and staging is None and ospec.type == "cpu":
            staging = StagingBuffers(chunk_bytes)
        pool = _new_pool(staging, chunk_bytes, ospec.type == "meta")
        pool.reset_peak()
        created0 = pool.buffers_created
        sizes, _ = _pipeline(
            _Bytes(src_flats), _Bytes(dst_flats), ispec, ospec, pool,
            min(chunk_bytes, pool.chunk_bytes), 1, ledger,
        )
        created, peak = pool.buffers_created - created0, pool.peak_bytes
        if staging is None:
            pool.release(ledger)
    return [d.untyped_storage() for d in dst_flats], sizes, created, peak


def move_storages(
    tensors: Sequence[torch.Tensor],
    device: DeviceLike,
    *,
    chunk_bytes: int,
    staging: Optional[StagingBuffers],
    ledger: Any,
) -> tuple[list[torch.Tensor], tuple[int, ...], int, int, int]:
    """Copy the distinct storages behind ``tensors`` to ``device`` in packed chunks.

    Returns the tensors rebuilt on the target (same sizes, strides, offsets and aliasing), the
    chunk sizes, staging buffers created, peak staging bytes and the number of storages (see
    :func:`copy_storages`).

    Example:
        >>> import torch
        >>> w = torch.ones(4, 2); new, *_ = move_storages(
        ...     [w, w.t()], "meta", chunk_bytes=64, staging=None, ledger=None)
        >>> new[1].stride(), new[1].untyped_storage() is new[0].untyped_storage()
        ((1, 2), True)
    """
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        storages.setdefault(int(s._cdata), s)
    keys = list(storages)
    new, sizes, created, peak = copy_storages(
        [storages[k] for k in keys], device, chunk_bytes=chunk_bytes, staging=staging,
        ledger=ledger,
    )
    new_storage = dict(zip(keys, new))
    rebuilt = []
    for t in tensors:
        s = new_storage[int(t.untyped_storage()._cdata)]
        r = torch.empty(0, dtype=t.dtype, device=s.device).set_(
            s, t.storage_offset(), t.size(), t.stride()
        )
        rebuilt.append(r)
    return rebuilt, sizes, created, peak, len(keys)
