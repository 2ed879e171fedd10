"""One typed, normalised model of a memory snapshot (plain data, no torch, no file I/O).

A :class:`Snapshot` is what every PyTorch memory snapshot format normalises into (the modern dict
with ``device_traces``, the bare list of segments from ``torch.cuda.memory_snapshot()``, the
2.0-era blocks that carry ``history`` and no ``address``, our JSON) and what torchmem's own
tracker traces convert into. Reading and writing PyTorch's format is
:mod:`torchmem.io.pytorch_snapshot`; converting a trace is :mod:`torchmem.io.convert`.

The parts (:class:`Frame`, :class:`Block`, :class:`Segment`, :class:`TraceEntry`,
:class:`DeviceTrace`) live in :mod:`torchmem.model.snapshot_parts` and are re-exported here, so
this module is the one place to import the snapshot model from.

Example:
    >>> snap = Snapshot()
    >>> f = snap.intern_frame("train.py", 7, "step")
    >>> snap.segments.append(Segment(0, 4096, 2097152, segment_type="small", blocks=[
    ...     Block(4096, 512, 100, "active_allocated", (f,)),
    ...     Block(4608, 2096640, 0, "inactive")]))
    >>> snap.new_trace(0).append("alloc", 4096, 100, 0, 5, snap.intern_stack((f,)))
    >>> seg = snap.segments[0]
    >>> seg.total_size, seg.blocks[0].frames[0].name, len(snap.traces[0])
    (2097152, 'step', 1)
    >>> snap.traces[0][0].action, snap.traces[0][0].size
    ('alloc', 100)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchmem.model import snapshot_parts
from torchmem.model.snapshot_parts import ACTIONS as ACTIONS
from torchmem.model.snapshot_parts import BLOCK_STATES as BLOCK_STATES
from torchmem.model.snapshot_parts import Block as Block
from torchmem.model.snapshot_parts import DeviceTrace as DeviceTrace
from torchmem.model.snapshot_parts import Frame as Frame
from torchmem.model.snapshot_parts import Segment as Segment
from torchmem.model.snapshot_parts import Stack as Stack
from torchmem.model.snapshot_parts import TraceEntry as TraceEntry
from torchmem.model.snapshot_parts import _Slotted

__all__ = ["SourceInfo", "Snapshot"]
__all__ += snapshot_parts.__all__


class SourceInfo(_Slotted):
    """Where a snapshot came from and which format features it had.

    ``format`` is ``"dict"`` (modern, with ``device_traces``), ``"list"`` (bare list of segments),
    ``"legacy-history"`` (2.0-era blocks with ``history``), ``"torchmem-json"``,
    ``"torchmem-events"`` (built from a tracker trace) or ``"memory"`` (built in memory).

    Example:
        >>> SourceInfo(format="list").format
        'list'
    """

    __slots__ = ("path", "format", "pickle_protocol", "features")

    def __init__(
        self,
        path: str | None = None,
        format: str = "memory",
        pickle_protocol: int | None = None,
        features: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.format = format
        self.pickle_protocol = pickle_protocol
        self.features = features


class Snapshot:
    """A normalised memory snapshot: segments and blocks at the end, device traces, settings.

    Attributes: ``segments`` (sorted by device then address), ``traces`` (``{device: DeviceTrace}``),
    ``num_trace_devices`` (length of ``device_traces`` in the source), ``allocator_settings``
    (dict or ``None``), ``external_annotations`` (list of dicts or ``None``), ``device_names``
    (``{index: "cuda:0" | "cpu" | ...}``), ``notes`` (honest remarks about how it was produced),
    ``source`` (:class:`SourceInfo`), ``stacks`` (the interned stack table; index 0 is ``()``).

    Example:
        >>> s = Snapshot()
        >>> s.devices, s.traces, s.stacks
        ([], {}, [()])
    """

    __slots__ = (
        "segments",
        "traces",
        "num_trace_devices",
        "allocator_settings",
        "external_annotations",
        "device_names",
        "notes",
        "source",
        "stacks",
        "_stack_index",
        "_frame_index",
    )

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.traces: dict[int, DeviceTrace] = {}
        self.num_trace_devices = 0
        self.allocator_settings: dict[str, Any] | None = None
        self.external_annotations: list[dict[str, Any]] | None = None
        self.device_names: dict[int, str] = {}
        self.notes: list[str] = []
        self.source = SourceInfo()
        self.stacks: list[tuple[Frame, ...]] = [()]
        self._stack_index: dict[tuple[Frame, ...], int] = {(): 0}
        self._frame_index: dict[Frame, Frame] = {}

    # ------------------------------------------------------------------ interning
    def intern_frame(self, filename: str, line: int, name: str) -> Frame:
        """The snapshot's single shared :class:`Frame` for these values.

        Example:
            >>> s = Snapshot()
            >>> s.intern_frame("a.py", 1, "f") is s.intern_frame("a.py", 1, "f")
            True
        """
        f = Frame(filename, line, name)
        return self._frame_index.setdefault(f, f)

    def intern_stack(self, frames: Sequence[Frame]) -> int:
        """Index of this stack (tuple of frames) in :attr:`stacks`, adding it if new.

        Example:
            >>> s = Snapshot(); f = s.intern_frame("a.py", 1, "f")
            >>> s.intern_stack((f,)), s.intern_stack([f]), s.intern_stack(())
            (1, 1, 0)
        """
        key = tuple(frames)
        idx = self._stack_index.get(key)
        if idx is None:
            idx = len(self.stacks)
            self.stacks.append(key)
            self._stack_index[key] = idx
        return idx

    def new_trace(self, device: int) -> DeviceTrace:
        """Create (or return) the :class:`DeviceTrace` of ``device``.

        Example:
            >>> s = Snapshot(); s.new_trace(1) is s.new_trace(1), s.num_trace_devices
            (True, 2)
        """
        t = self.traces.get(device)
        if t is None:
            t = self.traces[device] = DeviceTrace(device, self.stacks)
            self.num_trace_devices = max(self.num_trace_devices, device + 1)
        return t

    # ------------------------------------------------------------------ queries
    @property
    def devices(self) -> list[int]:
        """Device indexes that have segments or trace entries.

        Example:
            >>> Snapshot().devices
            []
        """
        devs = {s.device for s in self.segments}
        devs.update(d for d, t in self.traces.items() if len(t))
        return sorted(devs)

    def device_name(self, device: int) -> str:
        """Human name of a device index (``"cuda:N"`` unless the producer said otherwise).

        Example:
            >>> Snapshot().device_name(1)
            'cuda:1'
        """
        return self.device_names.get(device, f"cuda:{device}")

    def segments_of(self, device: int) -> list[Segment]:
        """Segments of one device, sorted by address.

        Example:
            >>> Snapshot().segments_of(0)
            []
        """
        return [s for s in self.segments if s.device == device]

    def trace(self, device: int) -> DeviceTrace:
        """The trace of ``device`` (an empty one when it has none).

        Example:
            >>> len(Snapshot().trace(3))
            0
        """
        t = self.traces.get(device)
        return t if t is not None else DeviceTrace(device, self.stacks)

    def _repr_html_(self) -> str:
        """Rich display in Jupyter: per device, segments, reserved, allocated and trace entries
        (``%torchmem_snapshot`` after ``%load_ext torchmem`` shows the interactive viewer).

        Example:
            >>> from torchmem.model.snapshot_parts import Block, Segment
            >>> s = Snapshot(); s.segments.append(Segment(0, 0, 2 << 20,
            ...     blocks=[Block(0, 1 << 20, 1 << 20, "active_allocated")]))
            >>> "2.00 MiB" in s._repr_html_() and "1.00 MiB" in s._repr_html_()
            True
        """
        from torchmem.model._html import fmt_bytes, html_block, html_table

        rows = []
        for d in self.devices:
            segs = self.segments_of(d)
            rows.append([
                self.device_name(d), len(segs), fmt_bytes(sum(g.total_size for g in segs)),
                fmt_bytes(sum(g.allocated_size for g in segs)),
                fmt_bytes(sum(g.active_size for g in segs)), len(self.trace(d)),
            ])
        table = html_table(
            "per device",
            ["device", "segments", "reserved", "allocated", "active", "trace entries"],
            rows,
        )
        notes = "".join(f"<div>note: {_esc(n)}</div>" for n in self.notes)
        return html_block(f"torchmem Snapshot ({self.source.format})", table, notes)

    def __repr__(self) -> str:
        n = sum(len(t) for t in self.traces.values())
        return (
            f"Snapshot(devices={self.devices}, segments={len(self.segments)}, "
            f"trace_entries={n}, format={self.source.format!r})"
        )


def _esc(text: Any) -> str:
    import html

    return html.escape(str(text))
