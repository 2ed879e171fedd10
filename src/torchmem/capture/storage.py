"""Storage identity, byte spans, overlap and exact deduplicated byte counts.

Every tensor views a byte range of an ``UntypedStorage``. Views, slices, transposes, ``expand``,
tied weights and buffers that view parameters all share storages; counting ``numel *
element_size`` per tensor counts those bytes several times. The functions here count each byte
(or each storage) once, per device, and work for CPU, CUDA, meta and fake tensors alike (meta and
fake tensors have no real data pointer, so identity never relies on ``data_ptr``).

Identity: PyTorch keeps one Python ``UntypedStorage`` object per live storage, so
:func:`storage_of` returns the same object for a tensor and all its views. :func:`storage_id`
is an integer key that is unique among storages *alive at the same time*; use it only while you
hold the tensors (as every function here does), and use :func:`storage_ref` (a weak reference)
to follow a storage over time.

Example:
    >>> import torch
    >>> from torchmem.capture.storage import same_storage, overlaps, unique_bytes, tensor_span
    >>> w = torch.zeros(4, 4)               # 64 bytes
    >>> same_storage(w, w.t()), overlaps(w[:2], w[2:])
    (True, False)
    >>> tensor_span(w[1:, 1:])              # bytes [20, 64) of the storage
    Span(start=20, end=64)
    >>> unique_bytes([w, w.t(), w[1:]])
    {'cpu': 64}
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import NamedTuple

import torch

from torchmem._device import device_name
from torchmem.errors import DeviceError, InvalidInputError, UnsupportedTensorError

__all__ = [
    "Span",
    "device_str",
    "resolve_device",
    "storage_of",
    "storage_id",
    "storage_ref",
    "storage_nbytes",
    "tensor_span",
    "same_storage",
    "overlaps",
    "merge_spans",
    "unique_bytes",
    "storage_bytes",
]


class Span(NamedTuple):
    """A half-open byte range ``[start, end)`` inside one storage.

    Example:
        >>> Span(8, 24).nbytes
        16
    """

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Length of the span in bytes.

        Example:
            >>> Span(0, 0).nbytes
            0
        """
        return self.end - self.start


def _check_tensor(t: object, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(
            f"expected a torch.Tensor for {what}, got {type(t).__module__}.{type(t).__name__}"
        )
    if t.layout is not torch.strided:
        raise UnsupportedTensorError(
            f"{what} has layout {t.layout}; torchmem measures strided tensors only. "
            "Fix: convert it with .to_dense() first, or measure its component tensors "
            "(e.g. .indices() and .values() of a sparse COO tensor)."
        )
    if getattr(t, "is_nested", False):
        raise UnsupportedTensorError(
            f"{what} is a nested tensor; torchmem measures strided tensors only. "
            "Fix: measure its components (t.unbind()) or t.values() for jagged layouts."
        )
    return t


def device_str(device: torch.device | str | torch.Tensor) -> str:
    """Canonical device name: ``'cpu'``, ``'cuda:0'``, ``'meta'`` (``'cuda'`` gets its index).

    The rule is :func:`torchmem._device.device_name`'s.

    Example:
        >>> import torch
        >>> device_str(torch.zeros(1)), device_str("meta")
        ('cpu', 'meta')
    """
    return device_name(device)


def resolve_device(device: torch.device | str | int) -> torch.device:
    """Parse ``device`` and check that it exists on this machine; ``'cuda'`` gets its index.

    Raises :class:`~torchmem.errors.DeviceError` for an unknown device string (``'gpu'``) and for
    a device that is absent here (``'cuda:0'`` without CUDA, ``'cuda:7'`` with two GPUs). An int
    means that accelerator index, as in PyTorch.

    Example:
        >>> resolve_device("cpu"), resolve_device("meta")
        (device(type='cpu'), device(type='meta'))
        >>> resolve_device("gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.DeviceError: unknown device 'gpu': ...
    """
    if isinstance(device, (str, torch.device)):
        d = torch.device(device_name(device))
    elif isinstance(device, int) and not isinstance(device, bool):
        try:
            d = torch.device(device)
        except (RuntimeError, ValueError, TypeError) as e:
            raise DeviceError(
                f"device index {device} means an accelerator, but none is available on this "
                f"machine ({e}). Fix: pass 'cpu'"
            ) from None
    else:
        raise DeviceError(
            f"expected a device (torch.device, a string such as 'cuda:0', or an int), got "
            f"{type(device).__name__}: {device!r}"
        )
    if d.type in ("cpu", "meta"):
        return d
    mod = getattr(torch, d.type, None)
    available = getattr(mod, "is_available", None)
    if mod is None or available is None or not available():
        raise DeviceError(
            f"device {str(d)!r} is not available on this machine (torch {torch.__version__} "
            f"reports no {d.type} device). Fix: pass 'cpu' or a device that exists here"
        )
    count = getattr(mod, "device_count", None)
    index = d.index if d.index is not None else int(mod.current_device())
    if count is not None and index >= int(count()):
        raise DeviceError(
            f"device {str(d)!r} does not exist: this machine has {int(count())} {d.type} "
            f"device(s) (indices 0..{int(count()) - 1})"
        )
    return torch.device(d.type, index)


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The ``UntypedStorage`` a tensor views; the same object for all its views while alive.

    Example:
        >>> import torch
        >>> a = torch.arange(6)
        >>> storage_of(a) is storage_of(a.view(2, 3)[1])
        True
    """
    return _check_tensor(t).untyped_storage()


def storage_id(t: torch.Tensor | torch.UntypedStorage) -> int:
    """An integer identity for the storage of ``t``, unique among storages alive together.

    It is the address of PyTorch's C++ ``StorageImpl`` and works for meta and fake tensors, which
    all report ``data_ptr() == 0``. A dead storage's address can be reused by a new one, so keep
    the tensors alive while you compare keys, or use :func:`storage_ref` to follow a storage
    over time.

    Example:
        >>> import torch
        >>> a = torch.empty(3, device="meta"); b = torch.empty(3, device="meta")
        >>> storage_id(a) == storage_id(a[1:]), storage_id(a) == storage_id(b)
        (True, False)
    """
    s = t if isinstance(t, torch.UntypedStorage) else storage_of(t)
    return int(s._cdata)


def storage_ref(t: torch.Tensor | torch.UntypedStorage) -> weakref.ref[torch.UntypedStorage]:
    """A weak reference to the storage of ``t``; it turns ``None`` when the storage is freed.

    Example:
        >>> import torch, gc
        >>> a = torch.zeros(4)
        >>> r = storage_ref(a[1:])
        >>> r() is storage_of(a)
        True
        >>> del a; _ = gc.collect(); r() is None
        True
    """
    s = t if isinstance(t, torch.UntypedStorage) else storage_of(t)
    return weakref.ref(s)


def storage_nbytes(t: torch.Tensor | torch.UntypedStorage) -> int:
    """Size in bytes of the whole storage behind ``t`` (not just the part ``t`` views).

    Example:
        >>> import torch
        >>> storage_nbytes(torch.zeros(10, dtype=torch.float64)[:2])
        80
    """
    s = t if isinstance(t, torch.UntypedStorage) else storage_of(t)
    return int(s.nbytes())


def tensor_span(t: torch.Tensor) -> Span:
    """The byte range ``[start, end)`` of the storage that ``t`` can touch, in O(ndim).

    For any strides (zero strides from ``expand``, transposes, offsets) the lowest element is at
    ``storage_offset`` and the highest at ``storage_offset + sum((size_i - 1) * stride_i)``; the span
    ends one element after the highest. An empty tensor has an empty span at its offset.

    Example:
        >>> import torch
        >>> x = torch.zeros(3, 4, dtype=torch.int16)     # 24 bytes
        >>> tensor_span(x[:, 1:3]), tensor_span(x[0].expand(5, 4)), tensor_span(x[:0])
        (Span(start=2, end=22), Span(start=0, end=8), Span(start=0, end=0))
    """
    _check_tensor(t)
    es = int(t.element_size())
    offset = int(t.storage_offset()) * es
    if t.numel() == 0:
        return Span(offset, offset)
    lo = hi = 0  # element offsets of the lowest and highest element, relative to storage_offset
    for size, stride in zip(t.shape, t.stride()):
        reach = (int(size) - 1) * int(stride)
        if reach < 0:  # negative strides: not produced by PyTorch today; handled for safety
            lo += reach
        else:
            hi += reach
    return Span(offset + lo * es, offset + (hi + 1) * es)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` view the same storage (O(1); works on meta and fake tensors).

    torchlinops' ``same_storage`` instead asked whether one tensor's element addresses are a
    subset of the other's: the answers agree for a tensor and its views and for unrelated
    tensors, but two disjoint slices of one storage are the same storage here (use
    :func:`overlaps` to ask whether their bytes intersect). See :mod:`torchmem.compat.torchlinops`.

    Example:
        >>> import torch
        >>> a = torch.zeros(8)
        >>> same_storage(a, a[::2]), same_storage(a, a.clone())
        (True, False)
    """
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    return a.untyped_storage() is b.untyped_storage()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the byte spans of ``a`` and ``b`` in one storage intersect (O(1) per pair).

    Spans are the covering ranges from :func:`tensor_span`: two strided views that interleave
    without sharing an element (``x[::2]`` and ``x[1::2]``) count as overlapping, as they do for
    any range-based allocator accounting. Empty tensors overlap nothing.

    Example:
        >>> import torch
        >>> x = torch.zeros(10)
        >>> overlaps(x[:5], x[4:]), overlaps(x[:5], x[5:]), overlaps(x, x.clone())
        (True, False, False)
    """
    if not same_storage(a, b):
        return False
    sa, sb = tensor_span(a), tensor_span(b)
    if sa.nbytes == 0 or sb.nbytes == 0:
        return False
    return sa.start < sb.end and sb.start < sa.end


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[Span]:
    """Merge byte ranges into sorted, disjoint spans (empty ranges dropped).

    Example:
        >>> merge_spans([(8, 16), (0, 4), (2, 10), (20, 20)])
        [Span(start=0, end=16)]
    """
    out: list[Span] = []
    for s, e in sorted((int(s), int(e)) for s, e in spans if e > s):
        if out and s <= out[-1].end:
            if e > out[-1].end:
                out[-1] = Span(out[-1].start, e)
        else:
            out.append(Span(s, e))
    return out


def _iter_tensors(tensors: Iterable[torch.Tensor] | torch.Tensor) -> Iterable[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise InvalidInputError(
            f"expected a tensor or an iterable of tensors, got {type(tensors).__name__}"
        )
    return tensors


def unique_bytes(tensors: Iterable[torch.Tensor] | torch.Tensor) -> dict[str, int]:
    """Per device, the bytes of the union of the byte spans the tensors view.

    Each byte is counted once however many tensors view it (views, tied weights, partially
    overlapping slices, buffers that view parameters). Bytes of a storage that no given tensor
    views are not counted: see :func:`storage_bytes` for whole storages. O(n log n).

    Example:
        >>> import torch
        >>> x = torch.zeros(100, dtype=torch.uint8)
        >>> unique_bytes([x[:60], x[40:80], x[10:20]])
        {'cpu': 80}
    """
    by_storage: dict[int, tuple[str, list[tuple[int, int]]]] = {}
    keep: list[torch.Tensor] = []  # hold tensors so storage ids stay unique during the call
    for i, t in enumerate(_iter_tensors(tensors)):
        _check_tensor(t, f"tensors[{i}]")
        keep.append(t)
        key = storage_id(t)
        entry = by_storage.get(key)
        if entry is None:
            entry = by_storage[key] = (device_str(t.device), [])
        entry[1].append(tensor_span(t))
    out: dict[str, int] = {}
    for dev, spans in by_storage.values():
        total = sum(s.nbytes for s in merge_spans(spans))
        out[dev] = out.get(dev, 0) + total
    return out


def storage_bytes(tensors: Iterable[torch.Tensor] | torch.Tensor) -> dict[str, int]:
    """Per device, the summed sizes of the distinct storages the tensors view.

    This is what the allocator holds for them: a small slice of a big tensor keeps the whole
    storage alive.

    Example:
        >>> import torch
        >>> big = torch.zeros(1000, dtype=torch.uint8)
        >>> storage_bytes([big[:10], big[500:510]]), unique_bytes([big[:10], big[500:510]])
        ({'cpu': 1000}, {'cpu': 20})
    """
    seen: dict[int, tuple[str, int]] = {}
    keep: list[torch.Tensor] = []
    for i, t in enumerate(_iter_tensors(tensors)):
        _check_tensor(t, f"tensors[{i}]")
        keep.append(t)
        key = storage_id(t)
        if key not in seen:
            seen[key] = (device_str(t.device), storage_nbytes(t))
    out: dict[str, int] = {}
    for dev, n in seen.values():
        out[dev] = out.get(dev, 0) + n
    return out
