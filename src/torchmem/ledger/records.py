"""The ledger's figures: :class:`LedgerRecord` and the running counters behind it.

A :class:`~torchmem.ledger.accounting.Ledger` keeps one ``_Stats`` per device (``"cpu"``,
``"cuda:0"``, ``"meta"``) and one ``_Agg`` (allocated bytes and peak) per device type with
indexed devices (``"cuda"``) and for all devices together; a query turns them into a frozen
:class:`LedgerRecord`.

Example:
    >>> r = LedgerRecord("cuda:0", allocated=2048, peak=4096, live_storages=1)
    >>> print(r)
    cuda:0: allocated 2.00 KiB (peak 4.00 KiB), freed 0 B, 1 live storage(s), 0 GC run(s)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from torchmem.units import format_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["LedgerRecord"]

#: What the ledger's queries take: ``None`` (all devices), a device type (``"cuda"``: every
#: index) or one device (``"cuda:1"``, ``torch.device("cuda", 1)``).
DeviceLike = Union[str, "torch.device", None]


@dataclass(frozen=True)
class LedgerRecord:
    """The ledger's figures for one device, one device type or all devices.

    ``allocated`` is the bytes of counted storages alive now; ``freed`` the bytes freed since the
    last auto-GC run on that device (MemLord's counter, which a GC trigger resets);
    ``freed_total`` every byte freed since the ledger was created or reset; ``peak`` the highest
    ``allocated`` seen. Counts: ``allocations`` (storages counted), ``frees`` (explicit and
    automatic), ``auto_frees`` (frees by storage death), ``live_storages`` and ``gc_runs``.

    Example:
        >>> import torch
        >>> from torchmem.ledger import Ledger
        >>> led = Ledger(); t = torch.zeros(256)
        >>> _ = led.allocate(t); _ = led.free(t)
        >>> r = led.record("cpu"); (r.allocated, r.freed, r.peak, r.allocations, r.frees)
        (0, 1024, 1024, 1, 1)
    """

    device: str
    allocated: int = 0
    freed: int = 0
    freed_total: int = 0
    peak: int = 0
    allocations: int = 0
    frees: int = 0
    auto_frees: int = 0
    live_storages: int = 0
    gc_runs: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (ints only, plus the device name).

        Example:
            >>> LedgerRecord("cpu", allocated=5).as_dict()["allocated"]
            5
        """
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        return (
            f"{self.device}: allocated {format_bytes(self.allocated)} (peak "
            f"{format_bytes(self.peak)}), freed {format_bytes(self.freed_total)}, "
            f"{self.live_storages} live storage(s), {self.gc_runs} GC run(s)"
        )



class _Stats:
    """Running figures of one device (the fields of :class:`LedgerRecord`)."""

    __slots__ = (
        "allocated", "freed", "freed_total", "peak", "allocations", "frees", "auto_frees",
        "live", "gc_runs",
    )

    def __init__(self) -> None:
        self.allocated = self.freed = self.freed_total = self.peak = 0
        self.allocations = self.frees = self.auto_frees = self.live = self.gc_runs = 0

    def record(self, name: str) -> LedgerRecord:
        return LedgerRecord(
            name, self.allocated, self.freed, self.freed_total, self.peak, self.allocations,
            self.frees, self.auto_frees, self.live, self.gc_runs,
        )


class _Agg:
    """Running allocated bytes and peak of a device type or of all devices."""

    __slots__ = ("allocated", "peak")

    def __init__(self) -> None:
        self.allocated = self.peak = 0
