"""Device names: the one rule that turns a device, as users and torch write it, into its name.

Every part of torchmem that names a device goes through :func:`device_name`. The rule:

* A name is ``"<type>"`` or ``"<type>:<index>"``, in lower case; white space around it is
  ignored and the index is a whole number (``" CUDA:01"`` -> ``"cuda:1"``).
* ``cpu`` and ``meta`` are one device each and carry no index (``"cpu:0"`` -> ``"cpu"``).
* An accelerator without an index (``"cuda"``, ``torch.device("cuda")``) is the current device
  of that type when torch is imported and has initialised that accelerator
  (``torch.cuda.current_device()``), else index 0. Naming a device never creates a CUDA context.
* An int ``N`` is ``"cuda:N"``.
* A ``torch.device`` (anything with ``type`` and ``index``) gives its own name, and a tensor
  (anything with a ``device``) the name of its device.
* The type must be one torch knows (``cpu``, ``cuda``, ``meta``, ``mps``, ``xpu``, ...).

:func:`device_selector` applies the same rule but leaves a missing index open (``"cuda"`` stays
``"cuda"``), for queries where a bare type means every device of that type.
:func:`split_device` is the parse both share. Bad input raises
:class:`~torchmem.errors.DeviceError`.

This module does not import torch; it asks torch for the current device only when something
else has imported it. Checking that a device exists on this machine needs torch:
:func:`torchmem.capture.storage.resolve_device` does it.

Example:
    >>> device_name(" CUDA:1"), device_name("cpu:0"), device_name(2), device_name("cuda")
    ('cuda:1', 'cpu', 'cuda:2', 'cuda:0')
    >>> device_selector("cuda"), device_selector("cuda:1")
    ('cuda', 'cuda:1')
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from torchmem.errors import DeviceError

__all__ = ["device_name", "device_selector", "split_device"]

#: Device types torch knows (``torch.device`` accepts these; a renamed private-use backend is
#: checked with torch itself).
_TYPES = frozenset({
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
})
#: Types with a single device: their names carry no index.
_UNINDEXED = frozenset({"cpu", "meta"})

# Names that cannot change for the life of the process (strings and torch.device objects with an
# index, or of an unindexed type), so the hot paths that name devices pay for a parse once.
_BY_STR: dict[str, str] = {}
_BY_DEVICE: dict[Any, str] = {}
_CACHE_MAX = 4096

_EXAMPLES = "a device such as 'cpu', 'cuda', 'cuda:1' or 'meta'"


def _bad_name(device: Any, why: str) -> DeviceError:
    return DeviceError(
        f"unknown device {device!r}: expected {_EXAMPLES}; {why}. Fix: pass a device name "
        "torch accepts (see torch.device)"
    )


def _torch_knows(dtype: str) -> bool:
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        torch.device(dtype)
    except Exception:
        return False
    return True


def split_device(device: Any) -> tuple[str, Optional[int]]:
    """``(type, index)`` of a device; the index is ``None`` when not given or for cpu and meta.

    Example:
        >>> split_device("cuda:1"), split_device("cuda"), split_device("cpu:0"), split_device(3)
        (('cuda', 1), ('cuda', None), ('cpu', None), ('cuda', 3))
        >>> split_device("gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.DeviceError: unknown device 'gpu': ... 'gpu' is not a device type torch ...
    """
    index: Optional[int]
    if isinstance(device, str):
        dtype, sep, rest = device.strip().lower().partition(":")
        if sep:
            if not (rest.isascii() and rest.isdigit()):
                raise _bad_name(device, "the index after ':' must be a whole number >= 0")
            index = int(rest)
        else:
            index = None
        if dtype not in _TYPES and not _torch_knows(dtype):
            raise _bad_name(device, f"{dtype!r} is not a device type torch knows")
    elif isinstance(device, bool):
        raise DeviceError(f"expected {_EXAMPLES}, got {device!r}. Fix: pass a device name")
    elif isinstance(device, int):
        if device < 0:
            raise DeviceError(
                f"expected a non-negative CUDA index, got {device}. Fix: pass 0, 1, ... or a "
                "device name such as 'cuda:0'"
            )
        return "cuda", device
    elif isinstance(getattr(device, "type", None), str) and hasattr(device, "index"):
        dtype, index = device.type, device.index  # a torch.device
    elif hasattr(device, "device") and not isinstance(device.device, (str, int)):
        return split_device(device.device)  # a tensor, or anything placed on a torch.device
    else:
        raise DeviceError(
            f"expected {_EXAMPLES}, a torch.device or an int (a CUDA index), got "
            f"{type(device).__name__}: {device!r}. Fix: pass a device name such as 'cuda:0'"
        )
    return dtype, None if dtype in _UNINDEXED else index


def _current_index(dtype: str) -> int:
    torch: Any = sys.modules.get("torch")
    module = getattr(torch, dtype, None) if torch is not None else None
    try:
        if module is not None and module.is_initialized():
            return int(module.current_device())
    except Exception:  # an accelerator module without these functions (mps)
        pass
    return 0


def device_name(device: Any) -> str:
    """The device's canonical name by the module's rule (``'cuda'`` gets the current index).

    Example:
        >>> import torch
        >>> device_name(torch.device("cuda", 1)), device_name(torch.zeros(1)), device_name("Meta")
        ('cuda:1', 'cpu', 'meta')
    """
    if type(device) is str:
        name = _BY_STR.get(device)
        if name is not None:
            return name
        cache: Optional[dict[Any, str]] = _BY_STR
    else:
        torch: Any = sys.modules.get("torch")
        if torch is None:
            cache = None
        elif type(device) is torch.device:
            name = _BY_DEVICE.get(device)
            if name is not None:
                return name
            cache = _BY_DEVICE
        elif isinstance(device, torch.Tensor):
            return device_name(device.device)
        else:
            cache = None
    dtype, index = split_device(device)
    if index is None:
        if dtype not in _UNINDEXED:
            return f"{dtype}:{_current_index(dtype)}"  # not cached: the current device can change
        name = dtype
    else:
        name = f"{dtype}:{index}"
    if cache is not None and len(cache) < _CACHE_MAX:
        cache[device] = name
    return name


def device_selector(device: Any) -> str:
    """A device's name, or its type alone when no index is given (``'cuda'``: every CUDA device).

    Example:
        >>> import torch
        >>> device_selector(torch.device("cuda")), device_selector(" CPU:0"), device_selector(1)
        ('cuda', 'cpu', 'cuda:1')
    """
    dtype, index = split_device(device)
    return dtype if index is None else f"{dtype}:{index}"
