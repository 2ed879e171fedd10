"""Staging memory for chunked transfers: :class:`StagingBuffers`, measured rather than assumed.

A chunked transfer copies through at most two host buffers of ``chunk_bytes`` each (double
buffering). :class:`StagingBuffers` owns that pair, reuses it across transfers, and reports the
live and peak bytes of the storages it actually allocated (a weak finalizer on each storage
subtracts its bytes when it is freed).

Example:
    >>> pool = StagingBuffers("1 KiB", pin=False)
    >>> _ = pool.acquire(0, 100, capacity=512); pool.live_bytes, pool.peak_bytes
    (512, 512)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Union

import torch

from torchmem.errors import InvalidInputError
from torchmem.transfer.streams import DeviceLike, canonical_device
from torchmem.units import MiB, format_bytes, parse_bytes

__all__ = ["DEFAULT_CHUNK_BYTES", "StagingBuffers"]

DEFAULT_CHUNK_BYTES = 16 * MiB
"""Default chunk size of staged transfers (two chunks of staging memory at most)."""


def _chunk_size(chunk_bytes: Union[int, str]) -> int:
    n = parse_bytes(chunk_bytes) if isinstance(chunk_bytes, str) else chunk_bytes
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidInputError(
            f"chunk_bytes must be a positive int (or a string like '64 MiB'), got {chunk_bytes!r}. "
            "Fix: pass e.g. chunk_bytes=64 * 2**20."
        )
    return n


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
