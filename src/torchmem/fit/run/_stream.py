"""A search's probes predicted from the allocator requests of earlier probes.

A probe of a length (``seq_len`` of ``generate()``, of a prefill) asks the simulated allocator
for the same requests in the same order at every length, only with sizes that grow by a
constant per token: the weights do not change, the activations and the KV cache (the prompt's,
then one token longer at each decode step) are ``length x`` a fixed row. :class:`StreamRecorder`
records what a probe does to the simulator (a ``malloc`` of a size, a ``free`` of which earlier
block, an ``empty_cache``, a change of the requested bytes); :class:`StreamModel` takes two
finished probes (no out-of-memory) whose records are the same sequence and predicts the record
at any other length, every value on the straight line through the two (an integer step per
token, or no prediction); :func:`replay` feeds a record to a fresh simulator: its peaks and
out-of-memory verdict are those the probe would get, as the same requests give the same
simulator the same result.

The search (:mod:`torchmem.fit.search._search`) runs its probes this way, without the model, and
runs the answer and one more for real: the answer stands when those two verdicts agree (it
fits, one more does not), and the search runs again with real probes when they do not.

Example:
    >>> from torchmem.fit.run._engine import _make_sim
    >>> def record(n):                  # weights, then an activation of n rows, freed
    ...     r = StreamRecorder(_make_sim(1 << 30, None))
    ...     w = r.sim.malloc(4096); a = r.sim.malloc(1024 * n); r.sim.free(a)
    ...     return r.events
    >>> m = StreamModel(); m.add(10, record(10)); m.add(20, record(20))
    >>> m.predict(35) == record(35)
    True
    >>> replay(m.predict(35), _make_sim(1 << 30, None))[:3]   # requested, allocated, reserved
    (0, 39936, 2097152)
"""

from __future__ import annotations

from typing import Any

from torchmem.errors import SimulatedOutOfMemoryError

__all__ = ["StreamRecorder", "StreamModel", "replay"]

#: One request: (kind, value, ref): ``("m", size, -1)``, ``("f", 0, index of the malloc)``,
#: ``("e", 0, -1)``, ``("r", delta of requested bytes, -1)``, ``("x", bytes allowed, -1)`` (a
#: memory fraction set by the program).
Event = tuple[str, int, int]


class StreamRecorder:
    """Records the requests made to ``sim`` (its ``malloc``, ``free`` and ``empty_cache``,
    wrapped here) in :attr:`events` (the list ``events``, when given); :meth:`req` records a change of the requested bytes.

    Example:
        >>> from torchmem.fit.run._engine import _make_sim
        >>> r = StreamRecorder(_make_sim(1 << 30, None))
        >>> a = r.sim.malloc(512); r.req(512); r.sim.free(a); r.events
        [('m', 512, -1), ('r', 512, -1), ('f', 0, 0)]
    """

    def __init__(self, sim: Any, events: list[Event] | None = None) -> None:
        self.sim = sim
        self.events: list[Event] = events if events is not None else []
        where: dict[int, int] = {}  # address -> index of its malloc
        events = self.events
        malloc, free, empty = sim.malloc, sim.free, sim.empty_cache

        def rec_malloc(size: int, *a: Any, **kw: Any) -> int:
            addr = malloc(size, *a, **kw)  # an out-of-memory ends the record (incomplete)
            if kw.get("stream", 0):  # another stream's pool: no prediction from this record
                events.append(("f", 0, -1))
            where[addr] = len(events)
            events.append(("m", size, -1))
            return addr

        def rec_free(addr: int, *a: Any, **kw: Any) -> Any:
            events.append(("f", 0, where.pop(addr, -1)))
            return free(addr, *a, **kw)

        def rec_empty(*a: Any, **kw: Any) -> Any:
            events.append(("e", 0, -1))
            return empty(*a, **kw)

        sim.malloc, sim.free, sim.empty_cache = rec_malloc, rec_free, rec_empty
        fraction = getattr(sim, "set_memory_fraction", None)
        if fraction is not None:
            def rec_fraction(*a: Any, **kw: Any) -> Any:
                out = fraction(*a, **kw)
                events.append(("x", sim.allowed_bytes, -1))
                return out

            sim.set_memory_fraction = rec_fraction

    def req(self, delta: int) -> None:
        """Record a change of the requested bytes."""
        if delta:
            self.events.append(("r", delta, -1))


class StreamModel:
    """Records of finished probes by value; :meth:`predict` the record at another value.

    Example:
        >>> m = StreamModel(); m.add(4, [("m", 40, -1)]); m.predict(5) is None   # one point
        True
        >>> m.add(6, [("m", 60, -1)]); m.predict(5)
        [('m', 50, -1)]
    """

    def __init__(self) -> None:
        self.points: dict[int, list[Event]] = {}

    def add(self, value: int, events: list[Event]) -> None:
        """Add the record of a probe at ``value`` that ran to the end."""
        self.points[value] = events

    def _basis(self, value: int) -> list[tuple[int, list[Event]]] | None:
        """The (up to) three records nearest ``value``, if they are one sequence."""
        near = sorted(self.points.items(), key=lambda p: (abs(p[0] - value), p[0]))[:3]
        if len(near) < 2:
            return None
        first = near[0][1]
        for _, other in near[1:]:
            if len(other) != len(first):
                return None
            for ea, eb in zip(first, other):
                if ea[0] != eb[0] or ea[2] != eb[2] or (ea[0] == "f" and ea[2] < 0):
                    return None
        return sorted(near)

    def predict(self, value: int) -> list[Event] | None:
        """The record at ``value``: each value on the line through the two nearest records,
        or the parabola through the three nearest; ``None`` when they are not one sequence,
        a value is not a whole number, or a size would be negative."""
        basis = self._basis(value)
        if basis is None:
            return None
        x = value
        out: list[Event] = []
        if len(basis) == 2:
            (x0, a), (x1, b) = basis
            den = x1 - x0
            for ea, eb in zip(a, b):
                num = ea[1] * den + (eb[1] - ea[1]) * (x - x0)
                q, r = divmod(num, den)
                if r or (q < 0 and ea[0] == "m"):
                    return None
                out.append((ea[0], q, ea[2]))
            return out
        (x0, a), (x1, b), (x2, c) = basis
        d = (x1 - x0) * (x2 - x1) * (x2 - x0)
        lin = (x - x0) * (x2 - x1) * (x2 - x0)
        quad = (x - x0) * (x - x1)
        u, w = x1 - x0, x2 - x1
        for ea, eb, ec in zip(a, b, c):
            y0, y1, y2 = ea[1], eb[1], ec[1]
            num = y0 * d + (y1 - y0) * lin + ((y2 - y1) * u - (y1 - y0) * w) * quad
            q, r = divmod(num, d)
            if r or (q < 0 and ea[0] == "m"):
                return None
            out.append((ea[0], q, ea[2]))
        return out

    @property
    def ready(self) -> bool:
        """Whether there are records enough for a prediction (two)."""
        return len(self.points) >= 2


def replay(events: list[Event], sim: Any) -> tuple[int, int, int, int, int | None]:
    """Feed ``events`` to ``sim``: ``(peak requested, peak allocated, peak reserved,
    fragmentation at the allocated peak, size of the request that ran out of memory or
    None)``, the peaks as the estimator keeps them.

    Example:
        >>> from torchmem.fit.run._engine import _make_sim
        >>> replay([("m", 3 << 20, -1), ("m", 1 << 30, -1)], _make_sim(1 << 30, None))
        (0, 3145728, 20971520, 17825792, 1073741824)
    """
    addr: dict[int, int] = {}
    req = peak_req = peak_alloc = frag = peak_res = 0
    malloc, free = sim.malloc, sim.free
    for i, (kind, value, ref) in enumerate(events):
        if kind == "m":
            try:
                addr[i] = malloc(value)
            except SimulatedOutOfMemoryError:
                return peak_req, peak_alloc, peak_res, frag, value
            a = sim.allocated_bytes
            if a > peak_alloc:
                peak_alloc, frag = a, sim.reserved_bytes - a
            if sim.reserved_bytes > peak_res:
                peak_res = sim.reserved_bytes
        elif kind == "f":
            free(addr.pop(ref))
        elif kind == "r":
            req += value
            if req > peak_req:
                peak_req = req
        elif kind == "x":
            sim.set_memory_fraction(1.0, value)  # value bytes allowed, as in the probe
        else:
            sim.empty_cache()
    return peak_req, peak_alloc, peak_res, frag, None
