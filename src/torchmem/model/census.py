"""Storage census results and move plans as plain data (no torch import).

A :class:`MemoryReport` is what :func:`torchmem.inspect_memory` produces: one
:class:`TensorRecord` per distinct tensor object, one :class:`StorageRecord` per distinct storage,
and the totals derived from them. Bytes are ``int`` everywhere. Three totals are kept per device:

- ``unique_bytes``: the union of the byte ranges the tensors view, each byte counted once;
- ``storage_bytes``: the summed sizes of the distinct storages (what the allocator holds);
- ``naive_bytes``: ``sum(numel * element_size)`` over tensors, i.e. what a tool that ignores
  sharing would report.

Categories are the labels of :class:`torchmem.model.events.Category` (``parameter``, ``buffer``,
``gradient``, ``optimizer_state``, ``other``). A storage viewed from several categories is
counted once, under the first category in :data:`CATEGORY_ORDER`, so categories sum to the
device total.

Example:
    >>> t = TensorRecord(name="w", category="parameter", device="cpu", dtype="float32",
    ...                  shape=(2, 2), stride=(2, 1), storage_offset=0, element_size=4,
    ...                  span_start=0, span_end=16, storage=0)
    >>> s = StorageRecord(index=0, device="cpu", nbytes=16, used_bytes=16,
    ...                   names=["w", "w_t"], categories=["parameter"])
    >>> r = MemoryReport(tensors=[t], storages=[s])
    >>> r.unique_bytes, r.storage_bytes, r.naive_bytes, r.total_unique_bytes
    ({'cpu': 16}, {'cpu': 16}, {'cpu': 16}, 16)
    >>> r.sharing_groups
    [['w', 'w_t']]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = [
    "CATEGORY_ORDER",
    "TensorRecord",
    "StorageRecord",
    "MemoryReport",
    "PlannedStorage",
    "MovePlan",
]

#: Priority used to attribute a storage seen from several categories (first wins).
CATEGORY_ORDER: tuple[str, ...] = (
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "activation",
    "input",
    "temporary",
    "communication",
    "other",
)


def _cat_rank(c: str) -> int:
    try:
        return CATEGORY_ORDER.index(c)
    except ValueError:
        return len(CATEGORY_ORDER)


@dataclass
class TensorRecord:
    """One distinct tensor object: where it lives and which bytes of its storage it views.

    ``storage`` is the :attr:`StorageRecord.index` of the storage it views.
    ``storage_offset`` is in elements (as in PyTorch); ``span_start``/``span_end`` are the byte
    range ``[start, end)`` inside the storage (see :func:`torchmem.capture.storage.tensor_span`).
    ``aliases`` lists further names of the *same* tensor object (tied weights).

    Example:
        >>> r = TensorRecord(name="x", category="other", device="cpu", dtype="int16",
        ...                  shape=(3,), stride=(1,), storage_offset=1, element_size=2,
        ...                  span_start=2, span_end=8, storage=0)
        >>> r.numel, r.nbytes
        (3, 6)
    """

    name: str
    category: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    element_size: int
    span_start: int
    span_end: int
    storage: int
    aliases: list[str] = field(default_factory=list)
    requires_grad: bool = False
    type_name: str = "Tensor"

    @property
    def numel(self) -> int:
        """Number of elements.

        Example:
            >>> TensorRecord("e", "other", "cpu", "float32", (0, 5), (5, 1), 0, 4, 0, 0, 0).numel
            0
        """
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """``numel * element_size``: the tensor's logical size, ignoring sharing.

        Example:
            >>> TensorRecord("e", "other", "cpu", "float64", (4,), (0,), 0, 8, 0, 8, 0).nbytes
            32
        """
        return self.numel * self.element_size

    @property
    def names(self) -> list[str]:
        """The name and every alias.

        Example:
            >>> TensorRecord("a", "parameter", "cpu", "float32", (1,), (1,), 0, 4, 0, 4, 0,
            ...              aliases=["b"]).names
            ['a', 'b']
        """
        return [self.name, *self.aliases]


@dataclass
class StorageRecord:
    """One distinct storage: its size, the bytes the named tensors use, and who views it.

    Example:
        >>> StorageRecord(0, "cpu", nbytes=100, used_bytes=60, names=["a", "b"],
        ...               categories=["parameter", "buffer"]).category
        'parameter'
    """

    index: int
    device: str
    nbytes: int
    used_bytes: int
    names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)

    @property
    def category(self) -> str:
        """The category this storage's bytes are attributed to (first in CATEGORY_ORDER).

        Example:
            >>> StorageRecord(0, "cpu", 4, 4, ["g"], ["gradient"]).category
            'gradient'
        """
        if not self.categories:
            return "other"
        return min(self.categories, key=_cat_rank)

    @property
    def shared(self) -> bool:
        """True when more than one name views this storage.

        Example:
            >>> StorageRecord(0, "cpu", 4, 4, ["a"], ["other"]).shared
            False
        """
        return len(self.names) > 1


class _DeferredRows(Protocol):
    """What :meth:`MemoryReport._deferred` builds its records from."""

    def build(self) -> tuple[list[TensorRecord], list[StorageRecord]]: ...


@dataclass
class MemoryReport:
    """The result of a storage census: per-tensor rows, per-storage rows and totals.

    ``skipped`` counts live objects that could not be measured (e.g. sparse tensors or tensor
    subclasses without a storage) when scanning every live tensor; ``skipped_kinds`` says why.

    Example:
        >>> r = MemoryReport(tensors=[], storages=[StorageRecord(0, "meta", 8, 4, ["a"],
        ...                  ["buffer"])])
        >>> r.by_category, r.devices
        ({'meta': {'buffer': 4}}, ['meta'])
        >>> MemoryReport.from_dict(r.to_dict()) == r
        True
    """

    tensors: list[TensorRecord] = field(default_factory=list)
    storages: list[StorageRecord] = field(default_factory=list)
    source: str = ""
    skipped: int = 0
    skipped_kinds: dict[str, int] = field(default_factory=dict)

    # -- records built when first read ---------------------------------------------------
    @classmethod
    def _deferred(cls, rows: _DeferredRows, source: str = "", skipped: int = 0,
                  skipped_kinds: dict[str, int] | None = None) -> MemoryReport:
        """A report whose ``tensors`` and ``storages`` are built from ``rows`` when one of them
        is first read (a census of every live tensor has tens of thousands of rows, and a
        printed report needs only a few of their columns). ``rows`` holds plain values (names,
        shapes, numbers), never the tensors, so the report keeps no memory alive.

        Example:
            >>> class Rows:
            ...     def build(self):
            ...         return [], [StorageRecord(0, "cpu", 8, 8, ["a"], ["other"])]
            >>> r = MemoryReport._deferred(Rows(), source="demo")
            >>> r.unique_bytes, r == MemoryReport(storages=r.storages, source="demo")
            ({'cpu': 8}, True)
        """
        rep = cls(source=source, skipped=skipped, skipped_kinds=dict(skipped_kinds or {}))
        del rep.tensors, rep.storages
        rep.__dict__["_rows"] = rows
        return rep

    def _unbuilt(self) -> _DeferredRows | None:
        """The rows of a deferred report whose records are not built yet, else None.

        Example:
            >>> MemoryReport()._unbuilt() is None
            True
        """
        return self.__dict__.get("_rows")

    def __getattr__(self, name: str) -> Any:
        # only reached when ordinary lookup fails: the records of a deferred report (above)
        if name in ("tensors", "storages"):
            rows = self.__dict__.get("_rows")
            if rows is not None:
                # the rows are dropped only once the records are in place: another thread
                # reading meanwhile builds them too and the first records stay
                tensors, storages = rows.build()
                self.__dict__.setdefault("tensors", tensors)
                self.__dict__.setdefault("storages", storages)
                self.__dict__.pop("_rows", None)
                return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        # pickle and copy see the built records, not the deferred rows
        if "_rows" in self.__dict__:
            self.__getattr__("tensors")
        return dict(self.__dict__)

    # -- totals ---------------------------------------------------------------------------
    @property
    def devices(self) -> list[str]:
        """Devices present, sorted (``cpu`` first, then by name).

        Example:
            >>> MemoryReport(storages=[StorageRecord(0, "meta", 1, 1), StorageRecord(1, "cpu", 1, 1)]).devices
            ['cpu', 'meta']
        """
        devs = {s.device for s in self.storages} | {t.device for t in self.tensors}
        return sorted(devs, key=lambda d: (d != "cpu", d))

    @property
    def unique_bytes(self) -> dict[str, int]:
        """Per device, bytes of the union of viewed byte ranges (each byte once).

        Example:
            >>> MemoryReport(storages=[StorageRecord(0, "cpu", 10, 6)]).unique_bytes
            {'cpu': 6}
        """
        out: dict[str, int] = {}
        for s in self.storages:
            out[s.device] = out.get(s.device, 0) + s.used_bytes
        return out

    @property
    def storage_bytes(self) -> dict[str, int]:
        """Per device, summed sizes of the distinct storages.

        Example:
            >>> MemoryReport(storages=[StorageRecord(0, "cpu", 10, 6)]).storage_bytes
            {'cpu': 10}
        """
        out: dict[str, int] = {}
        for s in self.storages:
            out[s.device] = out.get(s.device, 0) + s.nbytes
        return out

    @property
    def naive_bytes(self) -> dict[str, int]:
        """Per device, ``sum(numel * element_size)`` over tensors (sharing ignored).

        Example:
            >>> t = TensorRecord("x", "other", "cpu", "float32", (4,), (0,), 0, 4, 0, 4, 0)
            >>> MemoryReport(tensors=[t, t]).naive_bytes
            {'cpu': 32}
        """
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.device] = out.get(t.device, 0) + t.nbytes
        return out

    @property
    def total_unique_bytes(self) -> int:
        """Unique bytes summed over all devices.

        Example:
            >>> MemoryReport().total_unique_bytes
            0
        """
        return sum(s.used_bytes for s in self.storages)

    @property
    def by_category(self) -> dict[str, dict[str, int]]:
        """``{device: {category: unique bytes}}``; each storage counted once (see module doc).

        Example:
            >>> MemoryReport(storages=[StorageRecord(0, "cpu", 8, 8, ["a", "b"],
            ...              ["buffer", "parameter"])]).by_category
            {'cpu': {'parameter': 8}}
        """
        out: dict[str, dict[str, int]] = {}
        for s in self.storages:
            d = out.setdefault(s.device, {})
            d[s.category] = d.get(s.category, 0) + s.used_bytes
        return {
            dev: dict(sorted(cats.items(), key=lambda kv: _cat_rank(kv[0])))
            for dev, cats in out.items()
        }

    @property
    def sharing_groups(self) -> list[list[str]]:
        """For every storage viewed by two or more names, the names that share it.

        Example:
            >>> MemoryReport(storages=[StorageRecord(0, "cpu", 4, 4, ["a"]),
            ...                        StorageRecord(1, "cpu", 4, 4, ["b", "c"])]).sharing_groups
            [['b', 'c']]
        """
        return [list(s.names) for s in self.storages if s.shared]

    def tensor(self, name: str) -> TensorRecord:
        """The record whose name or alias is ``name`` (KeyError if absent).

        Example:
            >>> t = TensorRecord("a", "other", "cpu", "float32", (1,), (1,), 0, 4, 0, 4, 0, ["b"])
            >>> MemoryReport(tensors=[t]).tensor("b").name
            'a'
        """
        for t in self.tensors:
            if t.name == name or name in t.aliases:
                return t
        raise KeyError(name)

    def select(self, device: str | None = None, category: str | None = None) -> MemoryReport:
        """A report restricted to one device and/or category (storage indices are kept).

        Example:
            >>> r = MemoryReport(storages=[StorageRecord(0, "cpu", 4, 4), StorageRecord(1, "meta", 8, 8)])
            >>> r.select(device="meta").unique_bytes
            {'meta': 8}
        """
        tensors = [t for t in self.tensors
                   if (device is None or t.device == device)
                   and (category is None or t.category == category)]
        keep = {t.storage for t in tensors}
        storages = [s for s in self.storages
                    if (device is None or s.device == device)
                    and (category is None or s.index in keep)]
        return MemoryReport(tensors=tensors, storages=storages, source=self.source,
                            skipped=self.skipped, skipped_kinds=dict(self.skipped_kinds))

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the records plus the derived totals.

        Example:
            >>> sorted(MemoryReport().to_dict())  # doctest: +NORMALIZE_WHITESPACE
            ['by_category', 'naive_bytes', 'sharing_groups', 'skipped', 'skipped_kinds',
             'source', 'storage_bytes', 'storages', 'tensors', 'unique_bytes']
        """
        return {
            "source": self.source,
            "unique_bytes": self.unique_bytes,
            "storage_bytes": self.storage_bytes,
            "naive_bytes": self.naive_bytes,
            "by_category": self.by_category,
            "sharing_groups": self.sharing_groups,
            "skipped": self.skipped,
            "skipped_kinds": dict(self.skipped_kinds),
            "tensors": [
                {**asdict(t), "shape": list(t.shape), "stride": list(t.stride), "nbytes": t.nbytes}
                for t in self.tensors
            ],
            "storages": [asdict(s) for s in self.storages],
        }

    def _repr_html_(self) -> str:
        """Rich display in Jupyter: totals per device, bytes by category, the largest storages.

        Example:
            >>> r = MemoryReport(storages=[StorageRecord(0, "cpu", 4096, 4096, ["w"], ["parameter"])])
            >>> "4.00 KiB" in r._repr_html_() and "<td>w</td>" in r._repr_html_()
            True
        """
        from torchmem.model._html import fmt_bytes, html_block, html_table

        uniq, naive = self.unique_bytes, self.naive_bytes
        per = html_table(
            "per device",
            ["device", "unique bytes", "naive bytes (views counted again)", "storages"],
            [[d, fmt_bytes(uniq.get(d, 0)), fmt_bytes(naive.get(d, 0)),
              sum(1 for s in self.storages if s.device == d)] for d in self.devices],
        )
        cats = html_table(
            "by category",
            ["device", "category", "bytes"],
            [[d, c, fmt_bytes(n)] for d, per_cat in self.by_category.items()
             for c, n in per_cat.items()],
        )
        big = sorted(self.storages, key=lambda s: (-s.nbytes, s.index))[:10]
        top = html_table(
            "largest storages (top 10)",
            ["bytes", "device", "category", "tensors"],
            [[fmt_bytes(s.nbytes), s.device, s.category, ", ".join(s.names[:4])
              + (" ..." if len(s.names) > 4 else "")] for s in big],
        )
        total = fmt_bytes(self.total_unique_bytes)
        return html_block(f"torchmem MemoryReport: {len(self.storages)} storages, {total}",
                          per, cats, top)

    def to_json(self, indent: int | None = 2) -> str:
        """The :meth:`to_dict` form as a JSON string.

        Example:
            >>> MemoryReport().to_json(indent=None)[:40]
            '{"source": "", "unique_bytes": {}, "stor'
        """
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """Rebuild a report from :meth:`to_dict` output (derived totals are recomputed).

        Example:
            >>> MemoryReport.from_dict({"tensors": [], "storages": []}).storages
            []
        """
        names = {f for f in TensorRecord.__dataclass_fields__}
        tensors = []
        for t in data.get("tensors", []):
            kw = {k: v for k, v in t.items() if k in names}
            kw["shape"] = tuple(kw["shape"])
            kw["stride"] = tuple(kw["stride"])
            tensors.append(TensorRecord(**kw))
        storages = [StorageRecord(**s) for s in data.get("storages", [])]
        return cls(
            tensors=tensors,
            storages=storages,
            source=data.get("source", ""),
            skipped=int(data.get("skipped", 0)),
            skipped_kinds=dict(data.get("skipped_kinds", {})),
        )


@dataclass
class PlannedStorage:
    """One storage in a :class:`MovePlan`: where it is, where it goes, who views it.

    ``action`` is ``"keep"`` (already in place, untouched), ``"move"`` (same bytes on another
    device) or ``"convert"`` (dtype change, possibly also a device change).

    Example:
        >>> PlannedStorage("cpu", "meta", "float32", "float32", 64, 64, ["w", "w_t"], "move").shared
        True
    """

    source_device: str
    target_device: str
    source_dtype: str
    target_dtype: str
    source_nbytes: int
    target_nbytes: int
    names: list[str]
    action: str

    @property
    def shared(self) -> bool:
        """True when more than one name views this storage.

        Example:
            >>> PlannedStorage("cpu", "cpu", "int8", "int8", 1, 1, ["a"], "keep").shared
            False
        """
        return len(self.names) > 1


@dataclass
class MovePlan:
    """What :func:`torchmem.memory_aware_to` would do, without doing it.

    ``gains[device]`` is the bytes newly allocated there; ``losses[device]`` the bytes of old
    storages the module stops referencing there (freed unless something else holds them).

    Example:
        >>> p = MovePlan("meta", None, [PlannedStorage("cpu", "meta", "float32", "float32",
        ...              64, 64, ["a", "b"], "move")])
        >>> p.gains, p.losses, p.shared_groups
        ({'meta': 64}, {'cpu': 64}, [['a', 'b']])
    """

    device: str | None
    dtype: str | None
    storages: list[PlannedStorage] = field(default_factory=list)

    @property
    def gains(self) -> dict[str, int]:
        """Bytes allocated per device by the move.

        Example:
            >>> MovePlan(None, None).gains
            {}
        """
        out: dict[str, int] = {}
        for s in self.storages:
            if s.action != "keep":
                out[s.target_device] = out.get(s.target_device, 0) + s.target_nbytes
        return out

    @property
    def losses(self) -> dict[str, int]:
        """Bytes released per device by the move (if nothing else holds the old storages).

        Example:
            >>> MovePlan(None, None).losses
            {}
        """
        out: dict[str, int] = {}
        for s in self.storages:
            if s.action != "keep":
                out[s.source_device] = out.get(s.source_device, 0) + s.source_nbytes
        return out

    @property
    def net(self) -> dict[str, int]:
        """``gains - losses`` per device (negative: the device frees memory).

        Example:
            >>> MovePlan("meta", None, [PlannedStorage("cpu", "meta", "f", "f", 8, 8, ["a"],
            ...          "move")]).net
            {'cpu': -8, 'meta': 8}
        """
        out: dict[str, int] = {}
        for d, n in self.gains.items():
            out[d] = out.get(d, 0) + n
        for d, n in self.losses.items():
            out[d] = out.get(d, 0) - n
        return dict(sorted(out.items()))

    @property
    def shared_groups(self) -> list[list[str]]:
        """Names that share one storage (they will share one storage after the move too).

        Example:
            >>> MovePlan(None, None).shared_groups
            []
        """
        return [list(s.names) for s in self.storages if s.shared]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the derived totals.

        Example:
            >>> MovePlan("cpu", None).to_dict()["gains"]
            {}
        """
        return {
            "device": self.device,
            "dtype": self.dtype,
            "gains": self.gains,
            "losses": self.losses,
            "net": self.net,
            "shared_groups": self.shared_groups,
            "storages": [asdict(s) for s in self.storages],
        }
