"""Moving bytes between devices: single transfers and chunked, double-buffered pipelines.

Rules every path here follows:

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

import math
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from torchmem.errors import InvalidInputError, TransferError, UnsupportedTensorError
from torchmem.transfer.streams import (
    DeviceLike,
    DeviceSpec,
    _require_available,
    canonical_device,
    current_stream,
    transfer_stream,
    use_stream,
)
from torchmem.units import MiB, format_bytes, parse_bytes

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "StagingBuffers",
    "TransferResult",
    "PendingTransfer",
    "transfer",
    "transfer_async",
    "chunked_transfer",
    "transfer_module",
]

DEFAULT_CHUNK_BYTES = 16 * MiB
"""Default chunk size of staged transfers (two chunks of staging memory at most)."""


# --------------------------------------------------------------------------------------------
# input checks


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


def _chunk_size(chunk_bytes: Union[int, str]) -> int:
    n = parse_bytes(chunk_bytes) if isinstance(chunk_bytes, str) else chunk_bytes
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidInputError(
            f"chunk_bytes must be a positive int (or a string like '64 MiB'), got {chunk_bytes!r}. "
            "Fix: pass e.g. chunk_bytes=64 * 2**20."
        )
    return n


def _check_on(x: torch.Tensor, spec: DeviceSpec, label: str, other: DeviceSpec) -> None:
    got = canonical_device(x.device)
    if got != spec.device:
        raise TransferError(
            f"{label} expected its input on {spec.device} (the source device), got a tensor on "
            f"{got}. Fix: move it first with x.to('{spec.device}'), or use the operator in the "
            f"other direction (its adjoint .H takes tensors on {other.device})."
        )


def _no_data(src: torch.device, dst: torch.device) -> TransferError:
    return TransferError(
        f"cannot transfer from {src} to {dst}: a meta tensor has shapes but no data. Fix: "
        f"materialize it on {dst} (torch.empty_like(x, device='{dst}')) or keep the run "
        "shape-only by targeting 'meta'."
    )


# --------------------------------------------------------------------------------------------
# measured live bytes and staging buffers


class _LiveBytes:
    """Live and peak bytes of the storages added, measured: each storage's finalizer subtracts."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.count = 0
        self._lock = threading.Lock()

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        n = int(s.nbytes())
        weakref.finalize(s, self._sub, n)
        with self._lock:
            self.live += n
            self.count += 1
            self.peak = max(self.peak, self.live)

    def _sub(self, n: int) -> None:
        with self._lock:
            self.live -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live


class StagingBuffers:
    """Two reusable host staging buffers (double buffering) of at most ``chunk_bytes`` each.

    Buffers are pinned when ``pin`` is true (default: when an accelerator is available, since
    only pinned memory can be copied asynchronously), plain CPU memory otherwise, or meta tensors
    for shape-only runs (``device="meta"``). A buffer is created on first use, sized to the
    largest chunk of the transfer, and reused by later transfers; before it is refilled the host
    waits on the event of the copy that last read it. ``live_bytes``, ``peak_bytes`` and
    ``buffers_created`` are measured from the storages actually allocated (a finalizer on each
    storage subtracts its bytes when it is freed). Not thread-safe: use one per thread.

    Example:
        >>> pool = StagingBuffers(chunk_bytes=1024, pin=False)
        >>> b = pool.acquire(0, 100, capacity=512)
        >>> b.numel(), pool.live_bytes, pool.buffers_created
        (100, 512, 1)
        >>> del b; pool.release(); pool.live_bytes
        0
    """

    def __init__(
        self,
        chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
        *,
        pin: Optional[bool] = None,
        device: DeviceLike = "cpu",
    ) -> None:
        self.chunk_bytes = _chunk_size(chunk_bytes)
        dev = canonical_device(device)
        if dev.type not in ("cpu", "meta"):
            raise InvalidInputError(
                f"staging buffers live in host memory ('cpu') or are shape-only ('meta'), got "
                f"device={dev}. Fix: pass device='cpu' (pinned when an accelerator is present)."
            )
        can_pin = dev.type == "cpu" and torch.accelerator.is_available()
        if pin is None:
            pin = can_pin
        if pin and not can_pin:
            raise InvalidInputError(
                f"pin=True needs an accelerator backend for pinned host memory, and device='cpu'; "
                f"here torch.accelerator.is_available() is {torch.accelerator.is_available()} and "
                f"device={dev}. Fix: pass pin=None (pin when possible) or pin=False."
            )
        self.device = dev
        self.pinned = bool(pin)
        self._bufs: list[Optional[torch.Tensor]] = [None, None]
        self._events: list[Any] = [None, None]
        self._live = _LiveBytes()

    @property
    def live_bytes(self) -> int:
        """Bytes of staging storage alive now (measured).

        Example:
            >>> StagingBuffers(64, pin=False).live_bytes
            0
        """
        return self._live.live

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`live_bytes` since creation or the last :meth:`reset_peak`.

        Example:
            >>> p = StagingBuffers(64, pin=False); _ = p.acquire(1, 10, 64); p.peak_bytes
            64
        """
        return self._live.peak

    @property
    def buffers_created(self) -> int:
        """How many staging storages this object has allocated so far.

        Example:
            >>> StagingBuffers(64, pin=False).buffers_created
            0
        """
        return self._live.count

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes.

        Example:
            >>> p = StagingBuffers(64, pin=False); p.reset_peak(); p.peak_bytes
            0
        """
        self._live.reset_peak()

    def wait(self, slot: int) -> None:
        """Block the host until the last copy that used buffer ``slot`` has finished.

        Example:
            >>> StagingBuffers(64, pin=False).wait(0)
        """
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()
            self._events[slot] = None

    def record(self, slot: int, event: Any) -> None:
        """Remember the event after which buffer ``slot`` may be reused (``None``: reusable now).

        Example:
            >>> StagingBuffers(64, pin=False).record(0, None)
        """
        self._events[slot] = event

    def acquire(
        self, slot: int, nbytes: int, capacity: Optional[int] = None, ledger: Any = None
    ) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of buffer ``slot`` (0 or 1), once it is free to refill.

        The buffer is (re)allocated when missing or smaller than ``capacity`` (default
        ``nbytes``; never more than ``chunk_bytes``). New buffers are reported to ``ledger``.

        Example:
            >>> StagingBuffers(64, pin=False).acquire(0, 8).dtype
            torch.uint8
        """
        if slot not in (0, 1):
            raise InvalidInputError(f"slot must be 0 or 1 (double buffering), got {slot!r}")
        cap = max(int(nbytes), int(capacity or 0))
        if cap > self.chunk_bytes:
            raise InvalidInputError(
                f"a staging buffer holds at most chunk_bytes={self.chunk_bytes}, asked for {cap}. "
                "Fix: split the copy into chunks of at most chunk_bytes."
            )
        self.wait(slot)
        buf = self._bufs[slot]
        if buf is None or buf.numel() < cap:
            if buf is not None:
                self._drop(slot, ledger)
            buf = torch.empty(cap, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
            self._bufs[slot] = buf
            self._live.add(buf)
            if ledger is not None:
                ledger.allocate(buf)
        return buf[:nbytes]

    def _drop(self, slot: int, ledger: Any = None) -> None:
        buf = self._bufs[slot]
        self._bufs[slot] = None
        if buf is not None and ledger is not None:
            ledger.free(buf)

    def release(self, ledger: Any = None) -> None:
        """Wait for pending copies and free both buffers (reported to ``ledger`` when given).

        Example:
            >>> p = StagingBuffers(64, pin=False); b = p.acquire(0, 64); p.live_bytes
            64
            >>> del b; p.release(); p.live_bytes
            0
        """
        for slot in (0, 1):
            self.wait(slot)
            self._drop(slot, ledger)

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else str(self.device)
        return (
            f"StagingBuffers(chunk_bytes={format_bytes(self.chunk_bytes)}, {kind}, "
            f"live={format_bytes(self.live_bytes)}, peak={format_bytes(self.peak_bytes)})"
        )


# --------------------------------------------------------------------------------------------
# results


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


# --------------------------------------------------------------------------------------------
# byte sources and sinks for the chunk loop


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
                f"staging must be a torchmem.StagingBuffers, got {type(pool).__name__}. Fix: pass "
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


# --------------------------------------------------------------------------------------------
# public transfers


def _as_spec(d: DeviceLike) -> DeviceSpec:
    return d if isinstance(d, DeviceSpec) else DeviceSpec(d)


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


def _module_tensors(module: torch.nn.Module) -> list[tuple[Any, str, str, torch.Tensor]]:
    """(owner, kind, name, tensor) for every parameter, gradient and buffer, once per object."""
    seen: set[int] = set()
    out: list[tuple[Any, str, str, torch.Tensor]] = []
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in seen:
                seen.add(id(p))
                out.append((mod, "param", name, p))
                if p.grad is not None:
                    out.append((p, "grad", name, p.grad))
        for name, b in list(mod._buffers.items()):
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append((mod, "buffer", name, b))
    return out


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
    chunk sizes, staging buffers created, peak staging bytes and the number of storages.
    """
    if not tensors:
        return [], (), 0, 0, 0
    devs = {canonical_device(t.device) for t in tensors}
    if len(devs) != 1:
        raise TransferError(
            f"expected all tensors on one device, got {sorted(map(str, devs))}. Fix: move each "
            "device's tensors separately."
        )
    ispec, ospec = DeviceSpec(devs.pop()), _as_spec(device)
    if ispec.type == "meta" and ospec.type != "meta":
        raise _no_data(ispec.device, ospec.device)
    _require_available(ospec.device)
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        storages.setdefault(int(s._cdata), s)
    keys = list(storages)
    src_flats = [_storage_bytes_view(storages[k]) for k in keys]
    dst_flats = [
        _empty_on((f.numel(),), torch.uint8, ispec, ospec) for f in src_flats
    ]
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
    new_storage = {k: d.untyped_storage() for k, d in zip(keys, dst_flats)}
    rebuilt = []
    for t in tensors:
        s = new_storage[int(t.untyped_storage()._cdata)]
        r = torch.empty(0, dtype=t.dtype, device=ospec.device).set_(
            s, t.storage_offset(), t.size(), t.stride()
        )
        rebuilt.append(r)
    return rebuilt, sizes, created, peak, len(keys)


def _set_param(owner: torch.nn.Module, name: str, new: torch.Tensor) -> None:
    p = owner._parameters[name]
    assert p is not None
    if torch._has_compatible_shallow_copy_type(p, new):
        p.data = new  # keeps the Parameter object (optimizers hold it)
        return
    # e.g. cpu -> meta: .data cannot change the tensor type; swap the new contents into the same
    # Python object as Module.to does with swap_module_params_on_conversion.
    fresh = torch.nn.Parameter(new, requires_grad=p.requires_grad)
    try:
        torch.utils.swap_tensors(p, fresh)
    except RuntimeError:
        owner._parameters[name] = fresh


def transfer_module(
    module: torch.nn.Module,
    device: DeviceLike,
    *,
    chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
    staging: Optional[StagingBuffers] = None,
    ledger: Any = None,
) -> TransferResult:
    """Move a module's parameters, gradients and buffers to ``device`` in place, in chunks.

    Each distinct storage is copied once (tied weights and views that share a storage stay
    shared); small tensors are packed into the same chunk. Parameters keep their identity
    (``p.data`` is replaced), so optimizers holding them keep working. ``ledger`` gets
    ``allocate`` for the new tensors; the old storages are not credited as freed here (they may
    still be held elsewhere): a ledger that tracks storage deaths credits them when they die.

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
    entries = _module_tensors(module)
    ospec = _as_spec(device)
    t0 = time.perf_counter()
    srcs = [e[3] for e in entries]
    by_dev: dict[str, list[int]] = {}
    for i, t in enumerate(srcs):
        by_dev.setdefault(str(canonical_device(t.device)), []).append(i)
    all_sizes: list[int] = []
    created = peak = nstorages = 0
    source = ",".join(sorted(by_dev)) or str(ospec.device)
    for idxs in by_dev.values():
        group = [srcs[i] for i in idxs]
        new, sizes, c, p, ns = move_storages(
            [t.detach() for t in group], ospec, chunk_bytes=cb, staging=staging, ledger=ledger
        )
        all_sizes.extend(sizes)
        created += c
        peak = max(peak, p)
        nstorages += ns
        for i, t_new in zip(idxs, new):
            owner, kind, name, _ = entries[i]
            if kind == "param":
                _set_param(owner, name, t_new)
            elif kind == "grad":
                owner.grad = t_new
            else:
                owner._buffers[name] = t_new
            if ledger is not None:
                ledger.allocate(t_new)
    return TransferResult(
        None, source, str(ospec.device), sum(all_sizes), cb, tuple(all_sizes), created, peak,
        storages=nstorages, shape_only=ospec.type == "meta", seconds=time.perf_counter() - t0,
    )
