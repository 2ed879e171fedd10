"""Devices and streams for transfers: :class:`DeviceSpec` and the per-pair transfer streams.

Streams and events go through the device-generic ``torch.Stream`` / ``torch.Event`` /
``torch.accelerator`` APIs, so CUDA, XPU and other accelerators share one code path. CPU and
``meta`` have no streams: transfers that involve only them are synchronous (meta: shape-only).

Example:
    >>> spec = DeviceSpec("cpu")
    >>> spec, spec.is_accelerator, spec.compute()
    (DeviceSpec(cpu), False, None)
    >>> transfer_stream("cpu", "meta") is None       # no accelerator involved: no stream
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch

from torchmem._device import device_name
from torchmem.errors import DeviceError, InvalidInputError

__all__ = [
    "DeviceSpec",
    "DeviceLike",
    "canonical_device",
    "is_accelerator",
    "device_available",
    "transfer_stream",
    "peek_transfer_stream",
    "current_stream",
    "use_stream",
    "stream_repr",
]

DeviceLike = Union[str, int, torch.device, "DeviceSpec"]

# One transfer stream per (source, target) device pair, created on first use and kept for the
# life of the process (streams are cheap, and reusing one keeps transfers between a pair ordered).
_PAIR_STREAMS: dict[tuple[str, str], Any] = {}
_PAIR_LOCK = threading.Lock()


def canonical_device(device: DeviceLike) -> torch.device:
    """Parse a device (``"cuda"`` gets its current index; ``"cpu"`` and ``"meta"`` stay bare).

    Raises :class:`~torchmem.errors.DeviceError` for a string torch does not know.

    Example:
        >>> canonical_device("cpu"), canonical_device(torch.device("meta"))
        (device(type='cpu'), device(type='meta'))
    """
    if isinstance(device, DeviceSpec):
        return device.device
    return torch.device(device_name(device))


def is_accelerator(device: DeviceLike) -> bool:
    """True for devices with streams (cuda, xpu, mps, ...); False for ``cpu`` and ``meta``.

    Example:
        >>> is_accelerator("cpu"), is_accelerator("meta"), is_accelerator("cuda:1")
        (False, False, True)
    """
    return canonical_device(device).type not in ("cpu", "meta")


def device_available(device: DeviceLike) -> bool:
    """True when tensors can live on ``device`` in this process.

    Example:
        >>> device_available("cpu"), device_available("meta")
        (True, True)
    """
    d = canonical_device(device)
    if d.type in ("cpu", "meta"):
        return True
    mod = getattr(torch, d.type, None)
    try:
        if mod is None or not mod.is_available():
            return False
        count = int(mod.device_count()) if hasattr(mod, "device_count") else 1
    except Exception:
        return False
    return d.index is None or d.index < count


def _require_available(device: torch.device) -> None:
    if not device_available(device):
        raise DeviceError(
            f"device {device} is not available in this process (torch.{device.type} reports it "
            "missing or the index is out of range). Fix: pick a device that exists here, e.g. "
            "'cpu', or 'meta' for a shape-only run."
        )


def current_stream(device: DeviceLike) -> Any:
    """The current stream of an accelerator device, or ``None`` for ``cpu`` / ``meta``.

    Example:
        >>> current_stream("cpu") is None
        True
    """
    d = canonical_device(device)
    if d.type in ("cpu", "meta"):
        return None
    _require_available(d)
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None and acc.type == d.type:
        return torch.accelerator.current_stream(d)
    return getattr(torch, d.type).current_stream(d)  # pragma: no cover - non-default backends


def _check_stream(stream: Any, device: torch.device, what: str) -> Any:
    if stream is None:
        return None
    if not (hasattr(stream, "wait_event") and hasattr(stream, "record_event")):
        raise InvalidInputError(
            f"{what} must be a torch.Stream (or a backend stream such as torch.cuda.Stream), got "
            f"{type(stream).__name__}. Fix: pass torch.Stream(device) or leave it None."
        )
    stype = getattr(stream, "device_type", None)
    if stype is None:
        stype = torch.device(stream.device).type
    if isinstance(stype, int):  # some backends report an enum value; compare through .device
        stype = torch.device(stream.device).type
    if stype != device.type:
        raise InvalidInputError(
            f"{what} lives on a {stype} device but the DeviceSpec is for {device}. "
            f"Fix: create the stream on {device} (torch.Stream('{device}'))."
        )
    return stream


def stream_repr(stream: Any) -> str:
    """Short text for a stream: its device and id, e.g. ``'cuda:0#0x3'``.

    Example:
        >>> stream_repr(torch.Stream("cpu"))
        'cpu#0x0'
    """
    if stream is None:
        return "none"
    sid = getattr(stream, "stream_id", None)
    if sid is None:  # pragma: no cover - backends without stream_id
        sid = getattr(stream, "cuda_stream", 0)
    dev = getattr(stream, "device", None)
    dtype = getattr(stream, "device_type", None)
    if isinstance(dev, torch.device):
        name = str(dev)
    elif isinstance(dtype, str):
        idx = getattr(stream, "device_index", -1)
        name = dtype if idx is None or idx < 0 else f"{dtype}:{idx}"
    else:  # pragma: no cover
        name = str(dev)
    return f"{name}#0x{int(sid or 0):x}"


def transfer_stream(source: DeviceLike, target: DeviceLike) -> Any:
    """The cached transfer stream for copies from ``source`` to ``target`` (created once per pair).

    The stream lives on the device that drives the copy: the source when it is an accelerator
    (GPU to GPU and GPU to CPU), else the target (CPU to GPU). ``None`` when neither device is an
    accelerator (CPU and meta copies are synchronous).

    Example:
        >>> transfer_stream("cpu", "cpu") is None
        True
        >>> s = transfer_stream("cuda:0", "cuda:1")             # doctest: +SKIP
        >>> s is transfer_stream("cuda:0", "cuda:1")            # doctest: +SKIP
        True
    """
    src, dst = canonical_device(source), canonical_device(target)
    engine = src if is_accelerator(src) else dst if is_accelerator(dst) else None
    if engine is None:
        return None
    _require_available(engine)
    key = (str(src), str(dst))
    with _PAIR_LOCK:
        stream = _PAIR_STREAMS.get(key)
        if stream is None:
            stream = torch.Stream(device=engine)
            _PAIR_STREAMS[key] = stream
    return stream


def peek_transfer_stream(source: DeviceLike, target: DeviceLike) -> Any:
    """The cached transfer stream of a pair if it was already created, else ``None``.

    Example:
        >>> peek_transfer_stream("cpu", "meta") is None
        True
    """
    key = (str(canonical_device(source)), str(canonical_device(target)))
    with _PAIR_LOCK:
        return _PAIR_STREAMS.get(key)


@contextlib.contextmanager
def use_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` current on its device for the block (no-op for ``None``).

    Example:
        >>> with use_stream(None):
        ...     pass
    """
    if stream is None:
        yield
        return
    if hasattr(stream, "__enter__"):
        with stream:
            yield
        return
    prev = torch.accelerator.current_stream(stream.device)  # pragma: no cover
    torch.accelerator.set_stream(stream)  # pragma: no cover
    try:  # pragma: no cover
        yield
    finally:  # pragma: no cover
        torch.accelerator.set_stream(prev)


class DeviceSpec:
    """A device plus the streams used to move tensors to and from it.

    ``compute_stream`` is where producers and consumers of tensors on this device run (``None``:
    whatever stream is current when the transfer happens). ``transfer_stream`` is the stream
    copies driven by this device run on (``None``: the cached stream for each (source, target)
    pair, see :func:`transfer_stream`). CPU and meta specs have no streams; a stream passed for
    them is kept (and shown) but transfers there are synchronous.

    Example:
        >>> DeviceSpec("meta")
        DeviceSpec(meta)
        >>> DeviceSpec("cpu", compute_stream=torch.Stream("cpu"))
        DeviceSpec(cpu, compute=cpu#0x0)
        >>> DeviceSpec("cpu") == DeviceSpec(torch.device("cpu"))
        True
    """

    def __init__(
        self,
        device: DeviceLike = "cpu",
        compute_stream: Optional[Any] = None,
        transfer_stream: Optional[Any] = None,
    ) -> None:
        if isinstance(device, DeviceSpec):
            compute_stream = compute_stream or device.compute_stream
            transfer_stream = transfer_stream or device.transfer_stream
        self.device: torch.device = canonical_device(device)
        self.compute_stream: Any = _check_stream(compute_stream, self.device, "compute_stream")
        self.transfer_stream: Any = _check_stream(transfer_stream, self.device, "transfer_stream")

    @property
    def type(self) -> str:
        """The device type (``'cpu'``, ``'cuda'``, ``'meta'``, ...).

        Example:
            >>> DeviceSpec("meta").type
            'meta'
        """
        return self.device.type

    @property
    def is_accelerator(self) -> bool:
        """True when the device has streams.

        Example:
            >>> DeviceSpec("cpu").is_accelerator
            False
        """
        return is_accelerator(self.device)

    def compute(self) -> Any:
        """The stream producers/consumers use here: ``compute_stream`` or the current stream.

        Example:
            >>> DeviceSpec("cpu").compute() is None
            True
        """
        if not self.is_accelerator:
            return None
        return self.compute_stream if self.compute_stream is not None else current_stream(self.device)

    def stream_to(self, other: DeviceLike) -> Any:
        """The stream a copy between this device and ``other`` runs on, driven from here.

        Example:
            >>> DeviceSpec("cpu").stream_to("meta") is None
            True
        """
        if self.is_accelerator and self.transfer_stream is not None:
            return self.transfer_stream
        return transfer_stream(self.device, canonical_device(other))

    def copy(self) -> DeviceSpec:
        """An independent spec with the same device and streams.

        Example:
            >>> s = DeviceSpec("cpu"); c = s.copy()
            >>> c == s and c is not s
            True
        """
        return DeviceSpec(self.device, self.compute_stream, self.transfer_stream)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceSpec):
            return NotImplemented
        return (
            self.device == other.device
            and self.compute_stream is other.compute_stream
            and self.transfer_stream is other.transfer_stream
        )

    def __hash__(self) -> int:
        return hash((str(self.device), id(self.compute_stream), id(self.transfer_stream)))

    def describe(self, *, transfer: Any = None) -> str:
        """The device and its streams as short text (used by reprs; never recurses).

        Example:
            >>> DeviceSpec("cpu").describe()
            'cpu'
        """
        parts = [str(self.device)]
        if self.compute_stream is not None:
            parts.append(f"compute={stream_repr(self.compute_stream)}")
        ts = transfer if transfer is not None else self.transfer_stream
        if ts is not None:
            parts.append(f"transfer={stream_repr(ts)}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"DeviceSpec({self.describe()})"
