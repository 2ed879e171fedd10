"""Decode steps extrapolated: ``generate()``'s later tokens fed to the simulator without the model.

Each iteration of ``generate()``'s loop after the first few (the prefill, the first decode
steps) asks the allocator for the same requests in the same order, with sizes growing by a
constant per token (the KV cache, the token ids, the attention masks: one token longer each
time). :class:`DecodeExtrapolation` records what each iteration does to the simulator (a
``malloc`` of a size, a ``free`` of an earlier block, a change of the requested bytes, an
``empty_cache``), and at the loop check before an iteration, when the last :data:`PATTERN`
iterations are the same sequence with every size and byte count an arithmetic progression
(and every free naming a block of the same place in the same or the previous iteration;
the first of them may free its predecessor's blocks in that one's own order), it replays the remaining iterations through the simulator, sizes extended by
their constant step, and ends the loop: the model runs no more forward passes. The peaks
(requested, allocated, reserved) and the out-of-memory verdict are those of the full run,
which the same requests give the same simulator.

What it cannot reproduce makes the result :attr:`~DecodeExtrapolation.valid` false (the caller
then runs the full loop): any allocation after the replay (code after the loop, a second
``generate()``) other than what the replay ended. The estimate of an extrapolated run keeps
exact peaks and verdict, and (:class:`torchmem.fit.run._decode_feed._DecodeFeed`) its per-category split
and KV-cache figures: each replayed change of the requested bytes carries the tag of the request
it repeats (the storage), so the replay knows what category and module each byte is, and the
cache's length and size grow by their per-iteration step. Where those do not repeat, the
estimate says so (``decode_split_exact`` false) and ``estimate``'s search reruns its answer.

Example:
    >>> from torchmem.sim import CachingAllocator
    >>> d = DecodeExtrapolation(CachingAllocator(1 << 30))
    >>> for n in range(4):                  # four iterations: each frees the last cache block
    ...     d.mark()
    ...     h = d.on_malloc(1024 * (n + 8)); d.on_req(1024 * (n + 8))
    ...     if n: d.on_free(n - 1); d.on_req(-1024 * (n + 7))
    >>> d.mark()                           # the check before the fifth: last three repeat
    >>> [(kind, last, step) for kind, last, step, _, _ in d.pattern()]
    [('m', 11264, 1024), ('r', 11264, 1024), ('f', 0, 0), ('r', -10240, -1024)]
"""

from __future__ import annotations

from typing import Any

__all__ = ["DecodeExtrapolation", "PATTERN"]

#: Iterations that must repeat the same sequence before the rest is extrapolated.
PATTERN = 3


class DecodeExtrapolation:
    """The record of the simulator requests per loop iteration, and their replay.

    ``on_malloc(size)`` (returns the block's handle), ``on_free(handle)``,
    ``on_req(delta)`` (requested bytes) and ``on_empty()`` are called by the estimator as
    the run goes; ``mark()`` at each loop check. ``pattern()`` is the per-iteration step of
    the last :data:`PATTERN` iterations (``None`` when they do not repeat), ``replay`` feeds
    ``count`` more iterations to a sink.

    Example:
        >>> d = DecodeExtrapolation(None)
        >>> d.mark(); h = d.on_malloc(8); d.mark(); d.pattern() is None
        True
    """

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        #: (kind, value, segment of the block freed or -1, index in it) per request
        self.events: list[tuple[str, int, int, int]] = []
        #: the caller's tag of each request (``on_req``'s, the storage; -1: none)
        self.tags: list[int] = []
        #: handle -> (segment, index within it)
        self.where: list[tuple[int, int]] = []
        self.starts: list[int] = []
        self.recording = True
        #: iterations replayed (0: none)
        self.replayed = 0
        #: false when something after the replay could not be reproduced
        self.valid = True

    # -- recording ------------------------------------------------------------------------------

    def _segment(self) -> int:
        return len(self.starts) - 1

    def _index(self) -> int:
        return len(self.events) - (self.starts[-1] if self.starts else 0)

    def on_malloc(self, size: int) -> int:
        """Record a malloc of ``size`` bytes; its handle."""
        if self.replayed and self.recording:
            self.valid = False
        self.where.append((self._segment(), self._index()))
        self.events.append(("m", size, -1, 0))
        self.tags.append(-1)
        return len(self.where) - 1

    def on_free(self, handle: int) -> None:
        """Record a free of the block ``handle``."""
        seg, idx = self.where[handle]
        self.events.append(("f", 0, seg, idx))
        self.tags.append(-1)

    def on_req(self, delta: int, tag: int = -1) -> None:
        """Record a change of the requested bytes (``tag``: the caller's, e.g. the storage)."""
        if delta:
            self.events.append(("r", delta, -1, 0))
            self.tags.append(tag)

    def on_empty(self) -> None:
        """Record an ``empty_cache()``."""
        self.events.append(("e", 0, -1, 0))
        self.tags.append(-1)

    def mark(self) -> None:
        """A loop check: a new iteration starts."""
        self.starts.append(len(self.events))

    # -- the pattern ----------------------------------------------------------------------------

    def _seg(self, s: int) -> list[tuple[str, int, int, int]]:
        end = self.starts[s + 1] if s + 1 < len(self.starts) else len(self.events)
        return self.events[self.starts[s]:end]

    def segment_tags(self, back: int) -> list[int]:
        """The tags of the requests of the complete iteration ``back`` before the one now
        starting (1: the last), in order.

        Example:
            >>> d = DecodeExtrapolation(None)
            >>> d.mark(); d.on_req(8, tag=3); d.mark(); d.segment_tags(1)
            [3]
        """
        s = len(self.starts) - 1 - back
        end = self.starts[s + 1] if s + 1 < len(self.starts) else len(self.events)
        return self.tags[self.starts[s]:end]

    def pattern(self) -> list[tuple[str, int, int, int, int]] | None:
        """The last iteration and its step per token: ``(kind, value, step, back, index)``
        (``back``: how many iterations before the block freed was made), or ``None`` when the
        last :data:`PATTERN` complete iterations are not one arithmetic sequence."""
        last = len(self.starts) - 1  # the iteration now starting is not complete
        if last < PATTERN or len(self.starts) < PATTERN + 1:
            return None
        segs = [self._seg(s) for s in range(last - PATTERN, last)]
        first = last - PATTERN
        if len({len(s) for s in segs}) != 1 or not segs[0]:
            return None
        out: list[tuple[str, int, int, int, int]] = []
        for evs in zip(*segs):
            kinds = {e[0] for e in evs}
            if len(kinds) != 1:
                return None
            kind = evs[0][0]
            if kind == "f":
                # the first iteration's frees of the iteration before it (outside the pattern,
                # with its own order) are not compared; the later ones must agree
                backs = {(first + k - e[2], e[3]) for k, e in enumerate(evs)
                         if k or first - e[2] == 0}
                if len(backs) != 1:
                    return None
                back, idx = backs.pop()
                if back >= PATTERN - 1 and back:  # a block made before the pattern
                    return None
                if evs[0][2] != first and (evs[0][2] != first - 1 or back != 1):
                    return None
                out.append(("f", 0, 0, back, idx))
                continue
            values = [e[1] for e in evs]
            steps = {b - a for a, b in zip(values, values[1:])}
            if len(steps) != 1:
                return None
            out.append((kind, values[-1], steps.pop(), 0, 0))
        return out

    def replay(self, count: int, sink: Any) -> bool:
        """Feed ``count`` more iterations of :meth:`pattern` to ``sink`` (``malloc(size) ->
        handle or None`` (out of memory: stop), ``free(handle, own)``, ``req(delta, tag)``
        (``tag``: that of the request it repeats in the last iteration), ``empty()``); whether
        a pattern was found. The handles are the sink's."""
        pat = self.pattern()
        if pat is None:
            return False
        # the sink's handles of the last PATTERN iterations' blocks: iteration -> index -> handle
        last = len(self.starts) - 1
        mine: dict[tuple[int, int], Any] = {}
        known = {h: w for h, w in enumerate(self.where) if w[0] >= last - PATTERN}
        tags = self.segment_tags(1)
        for h, w in known.items():
            mine[w] = ("own", h)
        self.recording = False
        try:
            for k in range(1, count + 1):
                seg = last - 1 + k
                for idx, (kind, value, step, back, ref) in enumerate(pat):
                    if kind == "m":
                        h = sink.malloc(value + k * step)
                        if h is None:
                            return True
                        mine[(seg, idx)] = ("sink", h)
                    elif kind == "f":
                        tag, h = mine.pop((seg - back, ref))
                        sink.free(h, tag == "own")
                    elif kind == "r":
                        sink.req(value + k * step, tags[idx])
                    else:
                        sink.empty()
                self.replayed += 1
        finally:
            self.recording = True
        return True
