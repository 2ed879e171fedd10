"""PyTorch's out-of-memory errors, recognised on every allocator, and the ``oom`` trace entry a
snapshot gets when the allocator did not record one (used by :class:`~torchmem.capture.oom_guard`).

Example:
    >>> is_oom_error(RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GiB, ...)"))
    True
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from torchmem.model.snapshot import Snapshot

__all__ = [
    "OOM_MESSAGES", "is_oom_error", "is_host_oom", "requested_bytes", "append_device_oom",
    "append_host_oom",
]


#: Message fragments of PyTorch's out-of-memory errors (matched case-insensitively), per
#: allocator: CPU (``c10/core/impl/alloc_cpu.cpp``: "DefaultCPUAllocator: can't allocate memory:
#: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)" on POSIX, "...: not
#: enough memory: ..." on Windows); CUDA ("CUDA out of memory. Tried to allocate ...", a
#: ``torch.OutOfMemoryError``; "CUDA error: out of memory" from CUDA calls outside the
#: allocator; "Tried to allocate more than 1EB memory"); ROCm ("HIP out of memory"); MPS ("MPS
#: backend out of memory (MPS allocated: ...)", a ``RuntimeError``); XPU ("XPU out of memory.
#: Tried to allocate ...", a ``torch.OutOfMemoryError``); cuBLAS and cuDNN workspace failures
#: (``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``).
OOM_MESSAGES: tuple[str, ...] = (
    "out of memory",
    "defaultcpuallocator: can't allocate memory",
    "defaultcpuallocator: not enough memory",
    "tried to allocate more than 1eb memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)

_UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "PIB": 1 << 50,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def is_oom_error(exc: BaseException) -> bool:
    """True for PyTorch's out-of-memory errors, on every allocator it has.

    ``torch.OutOfMemoryError`` (CUDA, XPU; also ``torch.cuda.OutOfMemoryError``), Python's
    ``MemoryError``, and a ``RuntimeError`` whose message has one of :data:`OOM_MESSAGES` (the
    CPU allocator's "DefaultCPUAllocator: can't allocate memory", MPS, HIP, cuBLAS, cuDNN).

    Example:
        >>> import torch
        >>> try:
        ...     torch.empty(1 << 50, dtype=torch.uint8)   # 1 PiB: the CPU allocator refuses it
        ... except RuntimeError as e:
        ...     real = e
        >>> is_oom_error(real), is_oom_error(MemoryError()), is_oom_error(ValueError("x"))
        (True, True, False)
    """
    oom_types: tuple[type[BaseException], ...] = (MemoryError,)
    for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)):
        if isinstance(t, type):
            oom_types += (t,)
    if isinstance(exc, oom_types):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(m in text for m in OOM_MESSAGES)


def is_host_oom(exc: BaseException) -> bool:
    """A host-memory OOM: ``MemoryError`` or the CPU allocator's error.

    Example:
        >>> is_host_oom(MemoryError()), is_host_oom(RuntimeError("CUDA out of memory."))
        (True, False)
    """
    return isinstance(exc, MemoryError) or "defaultcpuallocator" in str(exc).lower()


def requested_bytes(exc: BaseException) -> int | None:
    """The size an out-of-memory error says was requested, in bytes (``None`` if it does not say).

    Reads the CPU allocator's "you tried to allocate N bytes" and the CUDA/XPU/HIP/MPS
    allocators' "Tried to allocate 2.00 GiB" (rounded to what the message shows).

    Example:
        >>> requested_bytes(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ..."))
        2147483648
        >>> requested_bytes(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes."))
        4096
        >>> requested_bytes(MemoryError()) is None
        True
    """
    import re

    nbytes = getattr(exc, "nbytes", None)
    if isinstance(nbytes, int) and nbytes > 0:
        return nbytes
    text = str(exc)
    m = re.search(r"tried to allocate (\d+) bytes", text, re.IGNORECASE)
    if m:
        return int(m.group(1))
    m = re.search(r"tried to allocate ([\d.]+) ?([KMGTP]?i?B)\b", text, re.IGNORECASE)
    if m and m.group(2).upper() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    return None


def append_device_oom(snap: Snapshot, exc: BaseException) -> bool:
    """Add an ``oom`` entry read from a device OOM's message to a snapshot without one.

    A snapshot taken after a CUDA (XPU, HIP) OOM without recorded history has the allocator's
    state but no ``oom`` entry. PyTorch's message names the device ("GPU 0"), the request
    ("Tried to allocate 20.00 MiB": the segment size, rounded as printed) and the free memory
    ("of which 3.06 MiB is free"); with them ``torchmem oom`` can explain the state. Returns
    whether an entry was added (the message must name the device and the request); the entry's
    ``user_metadata`` says where its figures come from.

    Example:
        >>> from torchmem.io.pytorch_snapshot import from_pytorch
        >>> s = from_pytorch({"segments": [], "device_traces": []})
        >>> append_device_oom(s, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. "
        ...     "GPU 1 has a total capacity of 79.19 GiB of which 1.50 GiB is free."))
        True
        >>> e = s.trace(1)[0]
        >>> e.action, e.size, e.device_free
        ('oom', 2147483648, 1610612736)
    """
    import re

    text = str(exc)
    size = requested_bytes(exc)
    dev = re.search(r"\bGPU (\d+)", text)
    if size is None or dev is None:
        return False
    free = re.search(r"of which ([\d.]+) ?([KMGTP]?i?B) is free", text, re.IGNORECASE)
    device_free = (int(float(free.group(1)) * _UNITS[free.group(2).upper()])
                   if free and free.group(2).upper() in _UNITS else 0)
    index = int(dev.group(1))
    note = "added by torchmem.oom_guard from the error message (sizes rounded as printed): "
    _append_oom(snap, index, f"cuda:{index}", device_free, size, (note + text.split("\n")[0])[:300])
    return True


def append_host_oom(snap: Snapshot, exc: BaseException) -> None:
    """Append a host OOM's ``oom`` entry to the snapshot's CPU trace: the size from the error's
    message (0 when it does not say), ``device_free`` the OS's available memory now.

    Example:
        >>> s = Snapshot()
        >>> append_host_oom(s, MemoryError("you tried to allocate 4096 bytes"))
        >>> e = s.trace(0)[0]
        >>> e.action, e.size, e.device_free > 0, s.device_names[0]
        ('oom', 4096, True, 'cpu')
    """
    import psutil

    dev = next((d for d, n in snap.device_names.items() if n == "cpu"), 0)
    _append_oom(snap, dev, "cpu", int(psutil.virtual_memory().available),
                requested_bytes(exc) or 0, f"{type(exc).__name__}: {exc}"[:200])


def _append_oom(snap: Snapshot, dev: int, name: str, device_free: int, size: int, note: str) -> None:
    """Append an ``oom`` entry to device ``dev``'s trace, after its last entry in time."""
    t = snap.new_trace(dev)
    snap.device_names.setdefault(dev, name)
    n = len(t)
    time_us = t.times[n - 1] if n and t.has_time else (None if n else 0)
    t.append("oom", int(device_free), int(size), 0, time_us, 0)
    if n == 0 and t.user_metadata is None:
        t.user_metadata = array("I")
    if t.user_metadata is not None:
        t.user_metadata.append(_add_text(t, note))
    if t.compile_contexts is not None:
        t.compile_contexts.append(_add_text(t, "N/A"))


def _add_text(t: Any, text: str) -> int:
    t.texts.append(text)
    return len(t.texts) - 1
