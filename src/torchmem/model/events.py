"""The event stream: torchmem's core data model for memory over time (plain data, no torch).

Producers (the dispatch-mode tracker, the ledger's capture, CUDA allocator history) emit
:class:`Event` records; consumers (summaries, plots, trace files, snapshots, the viewer, the
allocator simulator) read them. An event is the allocation or the free of one *storage*, or a
marker (iteration step, phase boundary, user annotation).

Codes are small ``IntEnum`` values so that traces can be stored column-wise and compactly.

Example:
    >>> e = Event(seq=0, kind=EventKind.ALLOC, time_ns=10, device="cpu", nbytes=4096,
    ...           storage=1, op="aten::mm", module="encoder.0", phase=Phase.FORWARD,
    ...           category=Category.ACTIVATION)
    >>> e.kind.label, e.phase.label, e.category.label, e.signed_bytes, e.thread
    ('alloc', 'forward', 'activation', 4096, None)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["EventKind", "Phase", "Category", "Event"]


class _Labeled(IntEnum):
    @property
    def label(self) -> str:
        """Lower-case name used in files, JSON and tables.

        Example:
            >>> Phase.BACKWARD.label
            'backward'
        """
        return self.name.lower()

    @classmethod
    def from_label(cls, text: str) -> _Labeled:
        """Parse a label back (case-insensitive).

        Example:
            >>> Category.from_label("Optimizer_State") is Category.OPTIMIZER_STATE
            True
        """
        try:
            return cls[text.upper()]
        except KeyError:
            choices = ", ".join(m.label for m in cls)
            raise ValueError(f"unknown {cls.__name__} {text!r}; expected one of: {choices}") from None


class EventKind(_Labeled):
    """What an event records.

    Example:
        >>> [k.label for k in EventKind]
        ['alloc', 'free', 'mark']
    """

    ALLOC = 0
    FREE = 1
    MARK = 2  # a step marker, phase boundary or user annotation; nbytes is 0


class Phase(_Labeled):
    """Where in a training step an event happened.

    Example:
        >>> Phase(1).label
        'forward'
    """

    OTHER = 0
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3


class Category(_Labeled):
    """What a storage holds.

    Example:
        >>> Category.GRADIENT.label
        'gradient'
    """

    OTHER = 0
    PARAMETER = 1
    BUFFER = 2
    GRADIENT = 3
    ACTIVATION = 4
    OPTIMIZER_STATE = 5
    INPUT = 6
    TEMPORARY = 7
    #: buffers of collective operations (all_reduce buckets, all_gather / reduce_scatter outputs)
    COMMUNICATION = 8


@dataclass(frozen=True)
class Event:
    """One allocation, free or marker.

    ``storage`` is an integer unique *within one trace* for the storage's whole life (never a
    reused memory address). ``step`` counts iterations (step markers seen so far). ``stack`` is
    innermost-last ``"file:line:function"`` strings, or ``None`` when stacks were off. ``thread``
    is the name of the Python thread the allocation or free happened on (``None`` in traces
    recorded before torchmem named threads, and for producers that do not know). For a FREE
    event, ``op``/``module``/``phase`` describe where the free happened and ``category`` repeats
    the category of the allocation. For a MARK, ``op`` holds the marker's name.

    Example:
        >>> Event(seq=3, kind=EventKind.FREE, time_ns=99, device="cuda:0", nbytes=512,
        ...       storage=7).signed_bytes
        -512
    """

    seq: int
    kind: EventKind
    time_ns: int
    device: str
    nbytes: int
    storage: int
    op: str | None = None
    module: str | None = None
    phase: Phase = Phase.OTHER
    category: Category = Category.OTHER
    step: int = 0
    stack: tuple[str, ...] | None = None
    thread: str | None = None

    @property
    def signed_bytes(self) -> int:
        """``+nbytes`` for an allocation, ``-nbytes`` for a free, 0 for a marker.

        Example:
            >>> Event(0, EventKind.MARK, 0, "cpu", 0, 0, op="step").signed_bytes
            0
        """
        if self.kind is EventKind.ALLOC:
            return self.nbytes
        if self.kind is EventKind.FREE:
            return -self.nbytes
        return 0
