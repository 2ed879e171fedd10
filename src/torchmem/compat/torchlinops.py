"""torchlinops users' API, importable from ``torchmem`` (backed by torchmem's exact storage model).

Mapping from ``torchlinops.utils`` (0.8.3):

==========================  ===================================================================
torchlinops                 torchmem
==========================  ===================================================================
``MemReporter``             :class:`MemReporter` -- same ``format_mode`` and ``report(module)``;
                            prints per-device rows and totals, and now *returns* the
                            :class:`~torchmem.model.census.MemoryReport`. Totals count each byte
                            once for any strides (torchlinops only deduplicated contiguous,
                            nested tensors, and needed quadratic time). With a module, buffers
                            and gradients are included too (torchlinops listed parameters only).
``get_device(idx)``         :func:`get_device` -- same: ``cuda:idx`` for ``idx >= 0``, else cpu.
``device_ordinal(device)``  :func:`device_ordinal` -- same value (-1 for cpu/meta, the index
                            otherwise) without allocating a tensor; an absent device raises
                            :class:`~torchmem.errors.DeviceError`.
``cdata(t)``                :func:`cdata` -- same value: the storage's ``_cdata`` address.
``tensor_memory_span(t)``   :func:`tensor_memory_span` -- same ``(min, max)`` inclusive element
                            offsets, in O(ndim) instead of enumerating 2**ndim corners; an empty
                            tensor gives the empty range ``(offset, offset - 1)``.
``same_storage(x, y)``      :func:`torchmem.capture.storage.same_storage` -- see below.
``memory_aware_to``         :func:`torchmem.memory_aware_to` (also keeps grads, optimizer state)
``memory_aware_deepcopy``   :func:`torchmem.memory_aware_deepcopy` (truly independent)
==========================  ===================================================================

``same_storage`` semantics: torchlinops answered "is the set of element addresses of one tensor a
subset of the other's" by listing every element (O(numel), and only for tensors that
``view(-1)`` accepts). torchmem answers "do they view the same storage" in O(1), for any
strides. They agree for a tensor and any view of it, and for unrelated tensors; they differ for
two *disjoint* parts of one storage (``x[:5]`` and ``x[5:]``: torchlinops False, torchmem True;
use :func:`torchmem.capture.overlaps` to ask whether their bytes intersect) and for empty tensors
(torchlinops True for any two empty tensors).

Units: ``format_mode="GB"`` prints decimal units (kB/MB/GB, base 1000); ``"GiB"`` prints binary
units (KiB/MiB/GiB, base 1024). torchlinops' docstring had these swapped; its output was right.

Example:
    >>> import io, torch, torchmem
    >>> x = torch.zeros(4, 4)
    >>> torchmem.compat.tensor_memory_span(x[1:, ::2]), torchmem.compat.cdata(x) == torchmem.compat.cdata(x.t())
    ((4, 14), True)
    >>> torchmem.compat.device_ordinal("cpu"), torchmem.compat.get_device(1)
    (-1, device(type='cuda', index=1))
"""

from __future__ import annotations

import gc
import sys
from math import prod
from operator import add
from typing import IO

import torch

from torchmem.capture.census import _Rows, inspect_memory
from torchmem.capture.storage import resolve_device, same_storage, storage_id, tensor_span
from torchmem.errors import InvalidInputError
from torchmem.model.census import MemoryReport
from torchmem.units import format_bytes

__all__ = [
    "MemReporter",
    "get_device",
    "device_ordinal",
    "cdata",
    "tensor_memory_span",
    "same_storage",
]


def get_device(device_idx: int = -1) -> torch.device:
    """``cuda:<idx>`` for ``idx >= 0``, else ``cpu`` (as in torchlinops; no existence check).

    Example:
        >>> get_device(), get_device(0)
        (device(type='cpu'), device(type='cuda', index=0))
    """
    if isinstance(device_idx, bool) or not isinstance(device_idx, int):
        raise InvalidInputError(
            f"get_device expected an int device index (-1 for cpu), got {type(device_idx).__name__}"
        )
    return torch.device(f"cuda:{device_idx}" if device_idx >= 0 else "cpu")


def device_ordinal(device: torch.device | str | int) -> int:
    """The device index, -1 for cpu and meta, without allocating a tensor.

    ``'cuda'`` without an index gives the current device. Raises
    :class:`~torchmem.errors.DeviceError` for unknown or absent devices (torchlinops raised
    whatever the failed allocation raised).

    Example:
        >>> device_ordinal(torch.device("cpu")), device_ordinal("meta")
        (-1, -1)
        >>> device_ordinal("cuda:0")  # doctest: +SKIP
        0
    """
    d = resolve_device(device)
    if d.type in ("cpu", "meta"):
        return -1
    return -1 if d.index is None else int(d.index)


def cdata(t: torch.Tensor) -> int:
    """Address of the tensor's storage (``untyped_storage()._cdata``), as in torchlinops.

    Equal for all views of one storage while it is alive; see :func:`torchmem.storage_id`.

    Example:
        >>> a = torch.zeros(3)
        >>> cdata(a) == cdata(a[1:]), cdata(a) == cdata(a.clone())
        (True, False)
    """
    return storage_id(t)


def tensor_memory_span(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` storage offsets, in elements and inclusive, that ``t`` can touch. O(ndim).

    Same values as torchlinops (which enumerated all corners); for byte spans use
    :func:`torchmem.tensor_span`. Empty tensors give ``(offset, offset - 1)``.

    Example:
        >>> x = torch.zeros(3, 4)
        >>> tensor_memory_span(x.t()), tensor_memory_span(x[1, 1:3]), tensor_memory_span(x[:0])
        ((0, 11), (5, 6), (0, -1))
    """
    span = tensor_span(t)  # byte span [start, end); element offsets are its bounds / element size
    es = int(t.element_size())
    return span.start // es, span.end // es - 1


class MemReporter:
    """Per-device tensor memory report with torchlinops' interface.

    ``format_mode="GiB"`` (default) prints binary units (base 1024); ``"GB"`` prints decimal
    units (base 1000). ``report(module=None)`` reports ``module``'s parameters, buffers and
    gradients, or every live tensor when ``module`` is None (after ``gc.collect()``, as
    torchlinops did), prints it like torchlinops did and returns the :class:`~torchmem.model.census.MemoryReport`.

    Example:
        >>> import io, torch
        >>> m = torch.nn.Linear(256, 256)
        >>> out = io.StringIO()
        >>> r = MemReporter(format_mode="GB").report(m, file=out)
        >>> print(out.getvalue().splitlines()[-1])
        Total: 263.17 kB
        >>> r.unique_bytes
        {'cpu': 263168}
    """

    def __init__(self, format_mode: str = "GiB") -> None:
        if format_mode not in ("GB", "GiB"):
            raise InvalidInputError(
                f"format_mode should be 'GB' (base 1000) or 'GiB' (base 1024), got {format_mode!r}"
            )
        self.format_mode = format_mode
        self.last_report: MemoryReport | None = None

    def _fmt(self, n: int) -> str:
        return format_bytes(n, decimal=self.format_mode == "GB")

    def report(self, module: torch.nn.Module | None = None, file: IO[str] | None = None) -> MemoryReport:
        """Print the per-device report of ``module`` (or all live tensors) and return it.

        Example:
            >>> import io, torch
            >>> emb = torch.nn.Embedding(10, 10); lin = torch.nn.Linear(10, 10, bias=False)
            >>> lin.weight = emb.weight
            >>> out = io.StringIO()
            >>> MemReporter().report(torch.nn.Sequential(emb, lin), file=out).unique_bytes
            {'cpu': 400}
        """
        # the cyclic collector stays paused until the report is printed: its rows are tens of
        # thousands of new objects that a collection would only scan (gc.collect() still runs)
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            rep = self._report(module, file)
        finally:
            if was_enabled:
                gc.enable()
        self.last_report = rep
        return rep

    def _report(self, module: torch.nn.Module | None, file: IO[str] | None) -> MemoryReport:
        if module is not None:
            rep = inspect_memory(module)
        else:  # torchlinops collected garbage before scanning: keep that behaviour
            rep = inspect_memory(all_live=True, collect_garbage=True)
        out = sys.stdout if file is None else file
        # printed from the census's columns: the report's records are built only if read
        rows = rep._unbuilt()
        assert isinstance(rows, _Rows), "inspect_memory returns a report whose records are unbuilt"
        # shared storages need their spans merged by the records: the report's own (kept)
        totals = rows.unique_bytes() if rows.distinct else rep.unique_bytes
        devices, devs = rows.devices, rows.devs
        names, shapes, sizes = rows.first_names, rows.shapes, rows.sizes
        # one formatting per distinct (shape, element size): many tensors share a few shapes
        tails = {key: f"\t{tuple(key[0])}\t\t{self._fmt(prod(key[0]) * key[1])}"
                 for key in set(zip(shapes, sizes))}
        by_dev: dict[str, list[str]] = {}
        if len(devices) == 1:  # the common case: every row is the one device's
            by_dev[devices[0]] = list(map(add, names, map(tails.__getitem__, zip(shapes, sizes))))
        else:
            for d, name, key in zip(devs, names, zip(shapes, sizes)):
                rows_of = by_dev.get(d)
                if rows_of is None:
                    rows_of = by_dev[d] = []
                rows_of.append(name + tails[key])
        lines: list[str] = []
        for dev in devices:
            lines.append(f"Device {dev}")
            lines.append("=" * 20)
            lines.extend(by_dev.get(dev, []))
            lines.append(f"Total: {self._fmt(totals.get(dev, 0))}")
        if lines:  # one write: the same text as a print() per line
            out.write("\n".join(lines) + "\n")
        return rep
