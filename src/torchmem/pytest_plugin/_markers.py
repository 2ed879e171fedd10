"""The pytest markers' arguments, parsed and checked at collection (``limit_memory``,
``limit_leaks``, ``fits_on``); bad arguments raise
:class:`~torchmem.errors.InvalidInputError` that names the marker, what was expected and the fix.

Example:
    >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
    >>> MemoryLimit.from_marker(Mark(args=("64 MB",), kwargs={})).limit
    64000000
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torchmem.errors import DeviceError, InvalidInputError
from torchmem.units import parse_bytes

__all__ = ["FitsOn", "LeakLimit", "MemoryLimit", "parse_marker_limit", "parse_item"]

_CUDA_METRICS = ("allocated", "reserved", "active")


def parse_marker_limit(value: Any, marker: str) -> int:
    """A marker's size argument in bytes (``"64 MiB"``, ``"64 MB"``, ``"1.5G"`` or an int).

    Raises :class:`~torchmem.errors.InvalidInputError` naming the marker and the fix.

    Example:
        >>> parse_marker_limit("1 KiB", "limit_memory")
        1024
        >>> parse_marker_limit("lots", "limit_memory")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: @pytest.mark.limit_memory: could not parse 'lots'...
    """
    try:
        return parse_bytes(value)
    except InvalidInputError as e:
        raise InvalidInputError(
            f"@pytest.mark.{marker}: {e}. Fix: write the limit like "
            f"@pytest.mark.{marker}(\"64 MiB\")"
        ) from None


def _device_arg(value: Any, marker: str) -> str:
    from torchmem._device import device_selector

    if not isinstance(value, str):
        raise InvalidInputError(
            f"@pytest.mark.{marker}: device must be a str such as 'cpu' or 'cuda:0', got "
            f"{type(value).__name__}: {value!r}"
        )
    try:
        return device_selector(value)
    except DeviceError as e:
        raise InvalidInputError(f"@pytest.mark.{marker}: {e}") from None


def _no_extra(marker: str, kwargs: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = sorted(set(kwargs) - set(allowed))
    if extra:
        raise InvalidInputError(
            f"@pytest.mark.{marker}: unknown keyword(s) {', '.join(extra)}; expected only "
            f"{', '.join(allowed)}"
        )


@dataclass(frozen=True)
class MemoryLimit:
    """A parsed ``limit_memory`` marker.

    Example:
        >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
        >>> MemoryLimit.from_marker(Mark(args=("2 MiB",), kwargs={"device": "cpu"}))
        MemoryLimit(limit=2097152, device='cpu', metric=None)
    """

    limit: int
    device: str = "cpu"
    metric: Optional[str] = None

    @classmethod
    def from_marker(cls, mark: Any) -> MemoryLimit:
        """Parse ``@pytest.mark.limit_memory(limit, device="cpu", metric=None)``.

        Example:
            >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
            >>> MemoryLimit.from_marker(Mark(args=("1 KiB",), kwargs={})).limit
            1024
        """
        args, kwargs = list(mark.args), dict(mark.kwargs)
        _no_extra("limit_memory", kwargs, ("limit", "device", "metric"))
        if len(args) > 2:
            raise InvalidInputError(
                f"@pytest.mark.limit_memory takes (limit, device='cpu'), got {len(args)} "
                "positional arguments"
            )
        if not args and "limit" not in kwargs:
            raise InvalidInputError(
                "@pytest.mark.limit_memory needs a limit, e.g. @pytest.mark.limit_memory('64 MiB')"
            )
        limit = parse_marker_limit(args[0] if args else kwargs["limit"], "limit_memory")
        device = _device_arg(args[1] if len(args) > 1 else kwargs.get("device", "cpu"),
                             "limit_memory")
        metric = kwargs.get("metric")
        if metric is not None:
            if metric not in _CUDA_METRICS:
                raise InvalidInputError(
                    f"@pytest.mark.limit_memory: metric must be one of "
                    f"{', '.join(map(repr, _CUDA_METRICS))}, got {metric!r}"
                )
            if not device.startswith("cuda"):
                raise InvalidInputError(
                    f"@pytest.mark.limit_memory: metric={metric!r} reads the CUDA allocator's "
                    f"peak, but device is {device!r}. Fix: pass device='cuda' or drop metric"
                )
        return cls(limit, device, metric)


@dataclass(frozen=True)
class LeakLimit:
    """A parsed ``limit_leaks`` marker (``device=None``: every device).

    Example:
        >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
        >>> LeakLimit.from_marker(Mark(args=("1 MiB",), kwargs={}))
        LeakLimit(limit=1048576, device=None)
    """

    limit: int
    device: Optional[str] = None

    @classmethod
    def from_marker(cls, mark: Any) -> LeakLimit:
        """Parse ``@pytest.mark.limit_leaks(limit, device=None)``.

        Example:
            >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
            >>> LeakLimit.from_marker(Mark(args=(0,), kwargs={"device": "cpu"})).device
            'cpu'
        """
        args, kwargs = list(mark.args), dict(mark.kwargs)
        _no_extra("limit_leaks", kwargs, ("limit", "device"))
        if len(args) > 2 or (not args and "limit" not in kwargs):
            raise InvalidInputError(
                "@pytest.mark.limit_leaks takes (limit, device=None), e.g. "
                "@pytest.mark.limit_leaks('1 MiB')"
            )
        limit = parse_marker_limit(args[0] if args else kwargs["limit"], "limit_leaks")
        dev = args[1] if len(args) > 1 else kwargs.get("device")
        return cls(limit, None if dev is None else _device_arg(dev, "limit_leaks"))


@dataclass(frozen=True)
class FitsOn:
    """A parsed ``fits_on`` marker: the GPU, the batch size and other estimate keywords.

    Example:
        >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
        >>> FitsOn.from_marker(Mark(args=("T4",), kwargs={"batch_size": 8}))
        FitsOn(gpu='T4', batch_size=8, options={})
    """

    gpu: Any
    batch_size: Optional[int] = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_marker(cls, mark: Any) -> FitsOn:
        """Parse ``@pytest.mark.fits_on(gpu, batch_size=None, steps=2, alloc_conf=None)``.

        Example:
            >>> from types import SimpleNamespace as Mark  # what pytest passes: .args, .kwargs
            >>> FitsOn.from_marker(Mark(args=("A100-40GB", 4), kwargs={"steps": 1})).options
            {'steps': 1}
        """
        args, kwargs = list(mark.args), dict(mark.kwargs)
        _no_extra("fits_on", kwargs, ("gpu", "batch_size", "steps", "alloc_conf"))
        if len(args) > 2 or (not args and "gpu" not in kwargs):
            raise InvalidInputError(
                "@pytest.mark.fits_on takes (gpu, batch_size=None), e.g. "
                "@pytest.mark.fits_on('A100-40GB', batch_size=64)"
            )
        gpu = args[0] if args else kwargs.pop("gpu")
        kwargs.pop("gpu", None)
        batch = args[1] if len(args) > 1 else kwargs.pop("batch_size", None)
        kwargs.pop("batch_size", None)
        if not isinstance(gpu, (str, int)) or isinstance(gpu, bool):
            raise InvalidInputError(
                f"@pytest.mark.fits_on: gpu must be a catalog name such as 'A100-40GB' or a "
                f"size such as '24 GiB', got {type(gpu).__name__}: {gpu!r}"
            )
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool)
                                  or batch < 1):
            raise InvalidInputError(
                f"@pytest.mark.fits_on: batch_size must be an int >= 1, got {batch!r}"
            )
        return cls(gpu, batch, kwargs)


def parse_item(item: Any) -> dict[str, Any]:
    """The torchmem markers of a pytest item, parsed: ``{"limit_memory": MemoryLimit, ...}``.

    Example:
        >>> class Item:
        ...     def get_closest_marker(self, name):
        ...         return None
        >>> parse_item(Item())
        {}
    """
    out: dict[str, Any] = {}
    mark = item.get_closest_marker("limit_memory")
    if mark is not None:
        out["limit_memory"] = MemoryLimit.from_marker(mark)
    mark = item.get_closest_marker("limit_leaks")
    if mark is not None:
        out["limit_leaks"] = LeakLimit.from_marker(mark)
    mark = item.get_closest_marker("fits_on")
    if mark is not None:
        out["fits_on"] = FitsOn.from_marker(mark)
    return out
