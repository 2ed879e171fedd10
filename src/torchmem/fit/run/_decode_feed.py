"""The decode extrapolation wired into a run: :class:`_DecodeFeed` feeds the simulator's requests
to a :class:`~torchmem.fit.run._decode.DecodeExtrapolation` and replays its extrapolated
``generate()`` iterations into the simulator, keeping the run's split by category, module and
KV cache.
"""

from __future__ import annotations

from typing import Any

from torchmem.fit.fakegpu._generate import GenerationPatches
from torchmem.fit.fakegpu._memory import _ALLOC, _KEYS, _live_at, _State
from torchmem.fit.run._decode import PATTERN, DecodeExtrapolation
from torchmem.fit.run._kv import KVWatch, kv_live_bytes


class _DecodeFeed:
    """Feeds the simulator's requests to a :class:`DecodeExtrapolation` (the record) and
    replays its extrapolated iterations into the simulator (the sink).

    The replay also keeps the run's per-category split: each replayed change of the requested
    bytes is labelled with the category and module of the storage it repeats (the last real
    iteration's), so the live bytes by category and module are known at a peak inside the
    replay (:attr:`peak_split`); the KV cache's figures are carried on by their per-iteration
    step (:meth:`kv_figures`). :attr:`exact` is false when the labels or the cache's figures
    do not repeat from iteration to iteration (the split is then the iterations that ran)."""

    def __init__(self, st: _State, tracker: Any, kv: KVWatch) -> None:
        self.st, self.tracker, self.kv = st, tracker, kv
        self.rec = DecodeExtrapolation(st.sim)
        self.handle: dict[int, int] = {}  # address -> record handle
        self.addr_of: dict[int, int] = {}  # record handle -> address
        sim = st.sim
        malloc, free, empty = sim.malloc, sim.free, sim.empty_cache

        def rec_malloc(size: int, *a: Any, **kw: Any) -> int:
            addr = malloc(size, *a, **kw)
            if kw.get("stream", 0):  # another stream's pool: not reproduced by the replay
                self.rec.valid = False
            if self.rec.recording:
                h = self.rec.on_malloc(size)
                self.handle[addr], self.addr_of[h] = h, addr
            return addr

        def rec_free(addr: int, *a: Any, **kw: Any) -> None:
            h = self.handle.pop(addr, None)
            if h is not None:
                del self.addr_of[h]
                if self.rec.recording:
                    self.rec.on_free(h)
            free(addr, *a, **kw)

        def rec_empty(*a: Any, **kw: Any) -> Any:
            if self.rec.recording:
                self.rec.on_empty()
            return empty(*a, **kw)

        sim.malloc, sim.free, sim.empty_cache = rec_malloc, rec_free, rec_empty  # type: ignore[method-assign,assignment]
        st.feed = self.rec
        self.sid_of_addr: dict[int, int] = {}
        #: the KV cache's (max_bytes, tokens, batch, bytes_per_token) at each loop check
        self.kv_marks: list[tuple[int, int, int, int]] = []
        #: whether the split and KV figures follow the replay (see the class docstring)
        self.exact = True
        #: storage id -> (category key, module) or None (not counted), for the replay's labels
        self.labels: dict[int, tuple[str, str] | None] = {}
        #: live bytes by category and by module (and live storages by module) in the replay
        self.cat: dict[str, int] = {}
        self.mod: dict[str, int] = {}
        self.mod_n: dict[str, int] = {}
        #: (requested bytes, by category, by module) at the replay's highest peak, if any
        self.peak_split: tuple[int, dict[str, int], dict[str, int]] | None = None
        self.start_live: dict[int, tuple[int, str, str]] = {}
        self.gone: set[int] = set()

    def check(self, gen: GenerationPatches) -> bool:
        """At a loop check: replay the remaining iterations when they repeat; True if so."""
        self.rec.mark()
        kv = self.kv
        self.kv_marks.append((kv.max_bytes, kv.tokens, kv.batch, kv.bytes_per_token))
        if self.rec.replayed or gen.length is None or gen.max_length is None:
            return False
        remaining = gen.max_length - gen.length
        if remaining < 1 or self.rec.pattern() is None:
            return False
        self.sid_of_addr = {a: sid for sid, a in self.st.addr.items()}
        self._start_split()
        done = self.rec.replay(remaining, self)
        self.gone = set(self.st.gone)
        if self.st.oom is not None:
            self.exact = False  # a partial iteration: its cache figures are not the step's
        return done

    # -- the split --------------------------------------------------------------------------------

    def _start_split(self) -> None:
        """The live bytes by category and module now, and the labels of the last iteration's
        storages; :attr:`exact` false when the labels or the cache's figures do not repeat.

        A storage's category is settled when it is freed (one freed in the region it was made
        in is a temporary), so the last iteration's storages, some still live, take the labels
        of the iteration before it (each of whose storages is freed by now, as the pattern
        frees each block within the next iteration), checked against the one before that."""
        st, kv_ids = self.st, self.kv.ids
        last, prev, first = (self.rec.segment_tags(k) for k in range(1, PATTERN + 1))
        wanted = {t for t in (*prev, *first) if t >= 0}
        over: dict[int, str] = st.dist.cat if st.dist is not None else {}
        host = st.pl.host_ever
        known: dict[int, tuple[str, str] | None] = {}
        for ev in self.tracker.events():
            sid = ev.storage
            if ev.kind == _ALLOC and sid in wanted:
                key = "kv_cache" if sid in kv_ids else over.get(sid) or _KEYS.get(
                    ev.category, "other")
                known[sid] = None if sid in host else (key, ev.module or "")
        if any(known.get(a) != known.get(b) for a, b in zip(prev, first)):
            self.exact = False
        for t, model in zip(last, prev):
            if t >= 0:
                if self.labels.get(t, known.get(model)) != known.get(model):
                    self.exact = False
                self.labels[t] = known.get(model)
        self.start_live = _live_at(self.tracker, len(self.tracker) - 1, st, kv_ids)
        for sid, (n, key, mod) in self.start_live.items():
            label = self.labels.get(sid, (key, mod))
            if label is None:
                continue
            key, name = label[0], label[1] or "(outside any module)"
            self.cat[key] = self.cat.get(key, 0) + n
            self.mod[name] = self.mod.get(name, 0) + n
            self.mod_n[name] = self.mod_n.get(name, 0) + 1
        marks = self.kv_marks[-PATTERN - 1:]
        steps = {tuple(b - a for a, b in zip(m0, m1)) for m0, m1 in zip(marks, marks[1:])}
        if len(marks) < PATTERN + 1 or len(steps) != 1:
            self.exact = False
        else:
            d_max, d_tokens, d_batch, d_bpt = steps.pop()
            if d_max < 0 or d_tokens < 0 or d_batch or d_bpt:
                self.exact = False

    def kv_figures(self) -> tuple[int, int] | None:
        """The KV cache's ``(max_bytes, tokens)`` after the replayed iterations (``None``:
        nothing replayed, or the figures do not follow the replay)."""
        if not self.rec.replayed or not self.exact or len(self.kv_marks) < 2:
            return None
        (m0, t0, _, _), (m1, t1, _, _) = self.kv_marks[-2], self.kv_marks[-1]
        r = self.rec.replayed
        return m1 + r * (m1 - m0), t1 + r * (t1 - t0)

    def kv_end_bytes(self, end_seq: int) -> int:
        """The cache's bytes live at ``end_seq``: the real storages', and the replay's own
        while the real ones it freed in the replay live on (the objects holding them do)."""
        kv_ids = self.kv.ids
        gone = self.gone & kv_ids
        real, held = kv_live_bytes(self.tracker.events(), kv_ids - gone, [end_seq])[0], 0
        if gone and kv_live_bytes(self.tracker.events(), gone, [end_seq])[0]:
            start = sum(n for sid, (n, key, _) in self.start_live.items() if key == "kv_cache")
            freed = sum(self.start_live[sid][0] for sid in gone if sid in self.start_live)
            held = self.cat.get("kv_cache", 0) - (start - freed)
        return real + held

    # -- the sink ---------------------------------------------------------------------------------

    def malloc(self, size: int) -> int | None:
        addr = self.st._malloc(size, None, "decode step (extrapolated)", "tensor storage")
        return None if self.st.stopped else addr  # a stop ends the replay too

    def free(self, h: int, own: bool) -> None:
        st = self.st
        if own:
            addr = self.addr_of.pop(h)
            self.handle.pop(addr, None)
            sid = self.sid_of_addr.get(addr)
            if sid is not None and st.addr.get(sid) == addr:
                del st.addr[sid]
                st.gone.add(sid)  # its real death later changes nothing
        else:
            addr = h
        st.sim.free(addr)

    def req(self, delta: int, tag: int = -1) -> None:
        st = self.st
        st.live_req += delta
        if st.stream is not None:
            st.stream.req(delta)
        label = self.labels.get(tag)
        if label is not None:
            key, mod = label
            name = mod or "(outside any module)"
            self.cat[key] = self.cat.get(key, 0) + delta
            self.mod[name] = self.mod.get(name, 0) + delta
            self.mod_n[name] = self.mod_n.get(name, 0) + (1 if delta > 0 else -1)
        if st.live_req > st.peak_req:
            st.peak_req = st.live_req
            st.peak_req_seq = len(self.tracker) - 1
            st.ws_at_peak = st.ws_bytes
            mods = {m: n for m, n in self.mod.items() if self.mod_n.get(m, 0) > 0}
            self.peak_split = (st.peak_req, dict(self.cat), mods)

    def empty(self) -> None:
        self.st.sim.empty_cache()
