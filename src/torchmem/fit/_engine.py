"""One fake run of a user's training step through the simulated caching allocator.

``build(batch_size)`` runs under fake tensors (no memory is allocated) with CUDA redirected to
the fake device (:mod:`torchmem.fit._env`), inside :func:`torchmem.track`: the tracker sees every
storage birth (operator outputs, with operator, module, phase and Python stack) and every death
(a weak reference on the storage fires as soon as PyTorch drops it; fake storages die as
promptly as real ones). A tracker listener sends each birth to
:meth:`~torchmem.sim.CachingAllocator.malloc` and each death to
:meth:`~torchmem.sim.CachingAllocator.free`, in program order, on an allocator with the GPU's
usable capacity. A thin dispatch mode on top adds what CUDA does and a CPU run never shows:
the cuBLAS workspace of each (thread, stream) at its first GEMM (backward runs on autograd's
own thread, so a training step has two), the cuBLASLt workspace at its first cuBLASLt GEMM (an
``addmm`` with a bias) and the kernels' transient workspaces
(:class:`~torchmem.fit._cuda.CudaEmulation`).

The first allocation the simulator cannot satisfy is the out-of-memory point: its operator,
module and stack are kept and the run stops there.

Example:
    >>> import torch
    >>> def build(batch):
    ...     net = torch.nn.Linear(256, 256, device="cuda")
    ...     x = torch.randn(batch, 256, device="cuda")
    ...     return lambda: net(x).sum().backward()
    >>> est = run_once(build, 8, "T4")
    >>> est.fits, est.peak_requested_bytes >= 2 * (256 * 256 + 256) * 4
    (True, True)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from torchmem.capture import track
from torchmem.capture._fast_mode import FastDispatchMode, frame_callback
from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError, TorchmemError
from torchmem.fit._catalog import GPU
from torchmem.fit._catalog import gpu as _gpu
from torchmem.fit._cuda import CudaEmulation
from torchmem.fit._decode import PATTERN, DecodeExtrapolation
from torchmem.fit._dist import DistWatch, FakeWorld, check_world_size
from torchmem.fit._env import fake_cuda
from torchmem.fit._estimate import Estimate, KVCache, OOMSite
from torchmem.fit._generate import LOCAL_SCALAR, GenerationPatches
from torchmem.fit._kv import KVWatch, check_attrs, kv_live_bytes
from torchmem.fit._placement import Placement
from torchmem.fit._readings import SimReadings
from torchmem.fit._shapes import HANDLED as SHAPE_OPS
from torchmem.fit._shapes import DataDependentShapes, check_routing
from torchmem.fit._stream import StreamRecorder
from torchmem.fit._values import ValueReads
from torchmem.model.events import Category, EventKind
from torchmem.sim import CachingAllocator

__all__ = ["run_once", "BuildFn", "BuildError"]

BuildFn = Callable[..., Callable[[], Any]]

_ALLOC, _FREE = EventKind.ALLOC, EventKind.FREE

_GEMM_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation", "_scaled_mm",
)
_GEMMS = {getattr(torch.ops.aten, n) for n in _GEMM_NAMES if hasattr(torch.ops.aten, n)}

#: Category label -> report key.
_KEYS = {
    Category.PARAMETER: "parameter",
    Category.BUFFER: "parameter",
    Category.GRADIENT: "gradient",
    Category.OPTIMIZER_STATE: "optimizer_state",
    Category.ACTIVATION: "activation",
    Category.TEMPORARY: "temporary",
    Category.INPUT: "input",
    Category.OTHER: "other",
    Category.COMMUNICATION: "communication",
}
_REPORT_KEYS = ("parameter", "gradient", "optimizer_state", "activation", "temporary",
                "input", "other", "kv_cache", "workspace", "communication")


class BuildError(InvalidInputError):
    """Raised by torchmem's own builds (:func:`torchmem.estimate_hf`): already says what was
    tried, so the estimate raises it as is, not wrapped as an error of the user's build.

    Example:
        >>> issubclass(BuildError, InvalidInputError)
        True
    """


class _Abort(BaseException):
    """Stops the user's step at the simulated out-of-memory point (not an Exception, so user
    code's ``except Exception`` does not swallow it)."""


def _emulation(card: GPU) -> CudaEmulation:
    """The CUDA behaviour of ``card``: its compute capability and multiprocessor count."""
    return CudaEmulation(card.compute_capability, multiprocessors=card.multiprocessors)


def _frames(stack: tuple[str, ...] | None, op: str) -> list[dict[str, Any]]:
    """A tracker stack (``"file:line:name"``, innermost last) as snapshot frames, innermost
    first, under a frame naming the operator (as PyTorch's snapshots show the C++ op)."""
    out: list[dict[str, Any]] = [{"filename": "??", "line": 0, "name": op}]
    for entry in reversed(stack or ()):
        file, _, rest = entry.rpartition(":")
        path, _, line = file.rpartition(":")
        if path and line.isdigit():
            out.append({"filename": path, "line": int(line), "name": rest})
        else:
            out.append({"filename": entry, "line": 0, "name": ""})
    return out


class _State:
    """The simulator, the storages it holds, and the running peaks."""

    def __init__(
        self, sim: CachingAllocator, emu: Any, cc: tuple[int, int], frames: bool = False
    ) -> None:
        self.sim = sim
        self.frames = frames
        self.emu = emu
        self.addr: dict[int, int] = {}
        self.live_req = 0
        #: the decode-step record (:mod:`torchmem.fit._decode`), when extrapolating
        self.feed: Any = None
        #: the record of every request (:mod:`torchmem.fit._stream`), when asked
        self.stream: Any = None
        self.peak_req = 0
        self.peak_req_seq = -1
        self.ws_at_peak = 0
        self.peak_alloc = 0
        self.frag_at_peak = 0
        self.peak_res = 0
        self.ws_bytes = 0
        self.ws_keys: set[object] = set()
        #: where each storage is: the GPU or the host (:mod:`torchmem.fit._placement`)
        self.pl = Placement()
        #: host memory: live and peak bytes (pinned or pageable)
        self.host_live = 0
        self.host_peak = 0
        #: storages already given back to the simulator (an extrapolated decode step's)
        self.gone: set[int] = set()
        self.oom: OOMSite | None = None
        #: stop the run once the reserved bytes pass this (a search's check that a value does
        #: not fit: the peak only grows, so the verdict is the full run's); ``stopped`` then
        self.stop_over: int | None = None
        self.stopped = False
        self.phase = "other"
        self.snapshot: Any = None
        #: live storages: key (UntypedStorage._cdata) -> tracker storage id, and back
        self.sid_of: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self.pl.key_to_sid = self.sid_of.get
        self.end_seq = -1
        #: a per-rank estimate's categories and collectives (:mod:`torchmem.fit._dist`)
        self.dist: Any = None
        #: the memory levers applied (:mod:`torchmem.fit._levers`), counting FLOPs when asked
        self.levers: Any = None
        # cuBLAS workspace per (thread, stream): CudaEmulation.gemm_workspace_bytes
        self.ws_size = int(emu.gemm_workspace_bytes) if emu is not None else 0
        # cuBLASLt workspace per (thread, stream): CudaEmulation.lt_workspace_bytes
        self.lt_size = int(emu.lt_workspace_bytes) if emu is not None else 0

    def _peaks(self) -> None:
        sim = self.sim
        a = sim.allocated_bytes
        if a > self.peak_alloc:
            self.peak_alloc = a
            self.frag_at_peak = sim.reserved_bytes - a
        if sim.reserved_bytes > self.peak_res:
            self.peak_res = sim.reserved_bytes
            if self.stop_over is not None and self.peak_res > self.stop_over and self.oom is None:
                # the run stops here as at an out-of-memory point; the estimate reports no
                # out-of-memory error but stopped_over (run_once)
                self.stopped = True
                self.oom = OOMSite(0, None, None, self.phase, (), sim.allocated_bytes,
                                   self.peak_res, f"stopped: reserved bytes passed "
                                   f"{self.stop_over:,}")

    def _malloc(self, nbytes: int, ev: Any, op: str | None, label: str) -> int | None:
        frames = None
        if self.frames:
            frames = _frames(getattr(ev, "stack", None), op or label)
        try:
            addr = self.sim.malloc(nbytes, frames=frames)
        except SimulatedOutOfMemoryError as e:
            self.oom = OOMSite(
                requested_bytes=nbytes,
                op=op,
                module=getattr(ev, "module", None),
                phase=getattr(getattr(ev, "phase", None), "label", self.phase),
                stack=tuple(getattr(ev, "stack", None) or ()),
                allocated_bytes=self.sim.allocated_bytes,
                reserved_bytes=self.sim.reserved_bytes,
                message=f"{label}: {e}",
            )
            return None
        self._peaks()
        return addr

    def _requested(self, delta: int, sid: int = -1) -> None:
        """Requested bytes change by ``delta`` (storage ``sid``'s); the decode-step and request
        records are told."""
        self.live_req += delta
        if self.feed is not None:
            self.feed.on_req(delta, sid)
        if self.stream is not None:
            self.stream.req(delta)

    def _host(self, n: int) -> None:
        self.host_live += n
        if self.host_live > self.host_peak:
            self.host_peak = self.host_live

    def listener(self, ev: Any, storage: Any) -> None:
        if self.oom is not None:  # the run stops at the first out-of-memory point
            return
        if ev.device == "meta":  # no memory anywhere (a model built on the meta device)
            return
        kind = ev.kind
        if kind == _ALLOC:
            n = ev.nbytes
            self.phase = ev.phase.label
            if storage is not None:
                key = storage._cdata
                self.sid_of[key] = ev.storage
                self.key_of[ev.storage] = key
            if not self.pl.current:  # a host storage: host memory, not the GPU's
                self.pl.host.add(ev.storage)
                self.pl.host_ever.add(ev.storage)
                self._host(n)
                return
            if storage is not None and self.dist is not None:
                self.dist.on_alloc(key, ev.storage, ev.op)
            if n:
                addr = self._malloc(n, ev, ev.op, "tensor storage")
                if addr is None:
                    return
                self.addr[ev.storage] = addr
            self._requested(n, ev.storage)
            if self.live_req > self.peak_req:
                self.peak_req = self.live_req
                self.peak_req_seq = ev.seq
                self.ws_at_peak = self.ws_bytes
        elif kind == _FREE:
            if ev.storage in self.gone:
                self.gone.discard(ev.storage)
            elif ev.storage in self.pl.host:  # host memory (or moved there by host_outputs)
                self.pl.host.discard(ev.storage)
                self._host(-ev.nbytes)
            else:
                self._requested(-ev.nbytes, ev.storage)
            key = self.key_of.pop(ev.storage, None)
            if key is not None and self.sid_of.get(key) == ev.storage:
                del self.sid_of[key]
                if self.dist is not None:
                    self.dist.on_free(key)
            addr = self.addr.pop(ev.storage, None)
            if addr is not None:
                self.sim.free(addr)

    def after_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if not self.pl.current:  # an operator on host tensors: no GPU workspace
            return
        if self.ws_size and func.overloadpacket in _GEMMS:
            key: object = (
                "autograd" if torch._C._current_autograd_node() is not None
                else threading.get_ident()
            )
            if key not in self.ws_keys:
                self.ws_keys.add(key)
                if self._malloc(self.ws_size, None, str(func), "cuBLAS workspace") is not None:
                    self.ws_bytes += self.ws_size
            # cuBLASLt's own workspace, after the cuBLAS one, at the first Lt GEMM
            lt_key = ("cublasLt", key)
            if (
                self.lt_size
                and self.oom is None
                and lt_key not in self.ws_keys
                and self.emu.uses_cublaslt(func, args, kwargs or {})
            ):
                self.ws_keys.add(lt_key)
                if self._malloc(self.lt_size, None, str(func), "cuBLASLt workspace") is not None:
                    self.ws_bytes += self.lt_size
        if self.emu is not None:
            # outputs CUDA keeps in host memory: not device memory after all
            for t in self.emu.host_outputs(func, out):
                sid = self.sid_of.get(t.untyped_storage()._cdata)
                addr = self.addr.pop(sid, None) if sid is not None else None
                if addr is not None:
                    self.sim.free(addr)
                    nbytes = t.untyped_storage().nbytes()
                    self._requested(-nbytes, -1 if sid is None else sid)
                    self.pl.host.add(sid)  # type: ignore[arg-type]
                    self.pl.host_ever.add(sid)  # type: ignore[arg-type]
                    self._host(nbytes)
        if self.emu is not None and self.oom is None:
            # All of a kernel's scratch buffers are live together, freed in reverse order.
            # (an entry may name earlier ones the kernel frees right after allocating it)
            held: dict[int, int] = {}
            for i, entry in enumerate(self.emu.transients(func, args, kwargs, out)):
                addr = self._malloc(int(entry[0]), None, str(func), str(entry[1]))
                if addr is None:
                    break
                held[i] = addr
                for j in entry[2] if len(entry) > 2 else ():  # type: ignore[misc]
                    if j in held:
                        self.sim.free(held.pop(j))
            for addr in reversed(list(held.values())):
                self.sim.free(addr)


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


_aten = torch.ops.aten
#: Backward formulas that scatter into a zero tensor they just made: done in place by a plain
#: run, out of place (one more full-size tensor) whenever a tensor subclass or a dispatch mode
#: is present (``areAnyTensorSubclassLike`` in gather_backward,
#: value_selecting_reduction_backward, cummaxmin_backward, masked_scatter_backward), which is
#: the case under fake tensors. The estimate runs the in-place form, as the GPU would.
_IN_PLACE = {
    _aten.scatter_add.default: _aten.scatter_add_.default,
    _aten.scatter.src: _aten.scatter_.src,
    _aten.scatter.value: _aten.scatter_.value,
    _aten.masked_scatter.default: _aten.masked_scatter_.default,
}
_ZEROS = {_aten.zeros, _aten.new_zeros, _aten.zeros_like}
#: floating-point operations per operator (torch.utils.flop_counter's formulas), for levers' costs
_FLOPS: dict[Any, Any] = dict(flop_registry)


_CONV_BACKWARD = _aten.convolution_backward.default
_ADD, _ADD_ = _aten.add.Tensor, _aten.add_.Tensor


def _accumulates_in_place(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
    """Whether this ``a + b`` is autograd summing two gradients of one input that a plain
    run does in place (``a.add_(b)``), where the fake run takes the out-of-place path.

    When a second gradient reaches an input that already has one, the engine's
    ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) repurposes the first:
    ``old_var.add_(var)`` when grad mode is off (no ``create_graph``), it holds the last
    reference to ``old_var`` and its storage, ``old_var`` is non-overlapping and dense, and
    neither is a tensor subclass; otherwise ``old_var + var``. Fake tensors are tensor
    subclasses, so under them it is always ``old_var + var``: one gradient-sized block more,
    allocated where the GPU allocates none. Taken here as the accumulation: an ``add`` with
    the default ``alpha`` run by the autograd engine (a graph task is running, grad mode
    off) on two tensors of one shape and dtype, the first a dense tensor that is its
    storage's only view and shares no storage with the second. (The use counts themselves
    are not visible under fake tensors; an add of that form inside a backward formula is
    taken as an accumulation too.)

    Example:
        >>> import torch
        >>> a, b = torch.ones(4), torch.ones(4)
        >>> _accumulates_in_place((a, b), None)          # not inside a backward pass
        False
    """
    if kwargs or len(args) != 2 or torch._C._current_graph_task_id() == -1:
        return False
    if torch.is_grad_enabled():
        return False
    a, b = args
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != torch.strided:
        return False
    if b.layout != torch.strided or not a.is_contiguous() or a.storage_offset():
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.nbytes() != a.numel() * a.element_size():
        return False
    return sa._cdata != sb._cdata


def _conv_backward_halves(args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """``convolution_backward``'s arguments split into the input-gradient call and the
    weight/bias-gradient call, when both halves are asked for (``None`` otherwise).

    Example:
        >>> a = (None,) * 10 + ([True, True, False],)
        >>> [h[10] for h in _conv_backward_halves(a)]
        [[True, False, False], [False, True, False]]
    """
    if len(args) != 11:
        return None
    mask = [bool(m) for m in args[10]]
    if len(mask) != 3 or not mask[0] or not (mask[1] or mask[2]):
        return None
    head = tuple(args[:10])
    return head + ([True, False, False],), head + ([False, mask[1], mask[2]],)


#: thread ident -> the exception (a class) to raise in that thread before its next operator
#: starts: a script's time limit (from its timer signal or timer thread) lands there, where no
#: bookkeeping is half done (:func:`request_stop`)
_STOPS: dict[int, Callable[[], BaseException]] = {}


def request_stop(ident: int, exc: Callable[[], BaseException] | None) -> None:
    """Raise ``exc()`` in thread ``ident`` before the next operator it runs under an estimate
    starts (``None`` withdraws the request); :func:`stop_pending` says whether it is still
    waiting.

    Example:
        >>> import threading
        >>> me = threading.get_ident()
        >>> request_stop(me, KeyboardInterrupt); stop_pending(me)
        True
        >>> request_stop(me, None); stop_pending(me)
        False
    """
    if exc is None:
        _STOPS.pop(ident, None)
    else:
        _STOPS[ident] = exc


def stop_pending(ident: int) -> bool:
    """Whether a stop asked for with :func:`request_stop` still waits for thread ``ident``'s
    next operator.

    Example:
        >>> stop_pending(-1)
        False
    """
    return ident in _STOPS


class _SimMode(FastDispatchMode):
    """Runs above the tracker: workspaces after each op's outputs; stops at the OOM point;
    backward scatters into fresh zeros run in place (see ``_IN_PLACE``); transformers' own
    value reads are answered (:mod:`torchmem.fit._generate`)."""

    def __init__(self, state: _State, gen: GenerationPatches | None = None,
                 values: ValueReads | None = None, routing: str = "balanced") -> None:
        super().__init__()
        self.state = state
        self.values = values or ValueReads(strict=True)
        self.gen = gen or GenerationPatches(self.values)
        self.shapes = DataDependentShapes(self.values, routing)
        self.zeros: Any = None  # weak reference to the last zeros made in backward

    inline_check = True  # the check below: no wrapper frame per operator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if frame_callback() is not None:  # compiled code runs: under torch._dynamo.disable
            return self._under_disable(func, types, args, kwargs)
        pl = self.state.pl
        if _STOPS and pl.depth == 0:
            stop = _STOPS.pop(threading.get_ident(), None)
            if stop is not None:
                raise stop()  # before this operator: nothing of it is recorded yet
        pl.depth += 1
        saved = pl.current
        pl.current = pl.for_op(args, kwargs)
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            pl.current = saved
            pl.depth -= 1

    def _dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        gen = self.gen
        values = self.values
        if func is LOCAL_SCALAR:
            if gen.installed:
                value = gen.answer(args[0])
                if value is not None:
                    if not values.strict:
                        values.record(values.stand_in(args[0])[0], value)
                    return value
            value = values.answer(args[0])
            if value is not None:
                return value
        if func is _CONV_BACKWARD and self.state.emu is not None and not kwargs:
            halves = _conv_backward_halves(args)
            if halves is not None:
                # CUDA (cudnn_convolution_backward) makes the input gradient, with its
                # workspace, before the weight gradient: two calls keep that order
                gi = self.__torch_dispatch__(func, types, halves[0])[0]
                _, gw, gb = self.__torch_dispatch__(func, types, halves[1])
                return (gi, gw, gb)
        if func is _ADD and _accumulates_in_place(args, kwargs):
            # autograd's InputBuffer would add the second gradient into the first in place
            return self.__torch_dispatch__(_ADD_, types, args)
        zeros, self.zeros = self.zeros, None
        if zeros is not None and args and func in _IN_PLACE and args[0] is zeros():
            func = _IN_PLACE[func]
        out: Any = NotImplemented
        if func in SHAPE_OPS and not values.strict:  # data-dependent: a size by rule
            out = self.shapes.run(func, args, kwargs)
        if out is NotImplemented:
            out = func(*args, **(kwargs or {}))
        values.note_output(func, out, args)
        self.shapes.note_output(func, args, out)
        if func.overloadpacket in _ZEROS and torch._C._current_autograd_node() is not None:
            self.zeros = weakref.ref(out)
        st = self.state
        if st.levers is not None and st.levers.count_flops:
            count = _FLOPS.get(func.overloadpacket)
            if count is not None:
                st.levers.flops += int(count(*args, **(kwargs or {}), out_val=out))
        if st.dist is not None:
            st.dist.after_op(func, args, kwargs, out)
        if st.oom is None:
            st.after_op(func, args, kwargs, out)
        if st.oom is not None:
            raise _Abort()
        return out


class DriverAddressAllocator(CachingAllocator):
    """The caching allocator with new segments placed the way the CUDA driver tends to place
    them: each ``cudaMalloc`` below the ones before it (top down), not at rising addresses.

    The address decides which block the allocator takes when free blocks tie on size: its
    free pools are ordered by (stream, size, address) (``BlockComparatorSize``), and the best
    fit is the first block not smaller than the request, so among equal sizes the lowest
    address wins. Which block that is shapes the splits and the segments made later. On the
    recorded H100 (driver 580) most new segments landed below all earlier ones (for the
    training runs of ``tests/data/gpu``: 110 of 155 segments of a GPT step, 22 of 60 with
    activation checkpointing, where a 2 MiB segment may land above); with that order the
    reserved peaks of those runs are reproduced (a GPT with activation checkpointing: exact,
    9.3 % over with rising addresses). The driver's placement is not documented; this is its
    usual order, not a guarantee.

    Example:
        >>> sim = DriverAddressAllocator(1 << 30)
        >>> a = sim.malloc(30 << 20)                  # a 30 MiB segment
        >>> b = sim.malloc(30 << 20)                  # a second one, below the first
        >>> b < a
        True
    """

    _TOP = 1 << 47  # where the first segment ends (2 MiB-aligned; any high value would do)

    def _segment_address(self, size: int) -> int:
        top = getattr(self, "_top", self._TOP)
        self._top = top - size
        return self._top


def _make_sim(capacity: int, alloc_conf: str | None) -> CachingAllocator:
    if alloc_conf is None:
        return DriverAddressAllocator(capacity)
    if not isinstance(alloc_conf, str):
        raise InvalidInputError(
            f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string such as "
            f"'expandable_segments:True', got {type(alloc_conf).__name__}"
        )
    return DriverAddressAllocator(capacity, config=alloc_conf)


def _source_of(fn: Any) -> tuple[str | None, int | None]:
    try:
        return inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return None, None


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_frame(exc: BaseException, prefer: set[str]) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if fr.filename in prefer:
            return fr
    for fr in reversed(frames):
        f = os.path.abspath(fr.filename)
        if not f.startswith(_TORCH_DIR) and not f.startswith(_OWN_DIR) and "<frozen" not in f:
            return fr
    return frames[-1] if frames else None


def _hint(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc)
    if name == "DataDependentOutputException" or "_local_scalar_dense" in text:
        return (" This reads a tensor's value (.item(), int(t), bool(t), .tolist(), an `if` on a "
                "tensor), which fake tensors do not have; fix: use Python numbers for control "
                "flow while estimating, or move that code out of build/step")
    if name == "DynamicOutputShapeException":
        return (" The output's shape depends on tensor values (nonzero, boolean-mask indexing, "
                "unique, ...), which fake tensors do not have; fix: use fixed-shape operations "
                "(torch.where, masked_fill) or move that code out of build/step")
    if ".numpy()" in text or "data pointer" in text or "tensor subclasses" in text:
        return (" Fake tensors have no data (.numpy(), data pointers, printing values); fix: "
                "keep such code out of build/step while estimating")
    return ""


def _user_error(exc: BaseException, what: str, fns: list[Any]) -> InvalidInputError:
    prefer = {f for f in (_source_of(fn)[0] for fn in fns) if f}
    fr = _user_frame(exc, prefer)
    where = f" at {fr.filename}:{fr.lineno}" + (f" ({fr.line.strip()})" if fr.line else "") if fr else ""
    return InvalidInputError(
        f"{what} raised {type(exc).__name__}{where}: {str(exc).strip()[:500]}.{_hint(exc)}"
        " (torchmem runs it under fake tensors; set TORCHMEM_DEBUG=1 for the full traceback)"
    )


def run_once(
    build: BuildFn,
    batch_size: int,
    gpu: str | int | GPU = "H100-80GB",
    *,
    steps: int = 2,
    alloc_conf: str | None = None,
    keep_snapshot: bool = False,
    params: Mapping[str, Any] | None = None,
    kv_cache_attr: Sequence[str] | None = None,
    world_size: int | None = None,
    strict_values: bool = False,
    extrapolate_decode: bool = False,
    default_device: str | None = None,
    routing: str = "balanced",
    levers: Any = None,
    stacks: bool = True,
    stream: list[Any] | None = None,
    stop_over: int | None = None,
) -> Estimate:
    """Build and run ``steps`` steps of ``build(batch_size, **params)`` on a fake ``gpu``; one
    estimate (``params`` are keyword arguments passed to ``build``, recorded in
    ``Estimate.params``).

    The KV cache (``Estimate.kv_cache``, ``by_category["kv_cache"]``) is found in
    transformers' cache objects and in the module attributes named by ``kv_cache_attr``
    (:mod:`torchmem.fit._kv`); transformers (``generate()``, its mask code) runs with its own
    value reads answered as on a GPU (:mod:`torchmem.fit._generate`).

    ``world_size=N`` runs rank 0 of an ``N``-rank job under a fake process group
    (:mod:`torchmem.fit._dist`): ``build`` may call ``fully_shard`` or wrap in DDP.

    Values read from tensors (``.item()``, ``float(t)``, ``if t:``, ``.tolist()``) are answered
    by :mod:`torchmem.fit._values`' policy and listed in ``Estimate.assumed_values``;
    ``strict_values=True`` refuses them instead. Outputs whose shape depends on values
    (``nonzero``, ``x[mask]``, ``masked_select``, ``unique``, mixture-of-experts routing) get a
    size by rule (:mod:`torchmem.fit._shapes`; ``routing="balanced"`` or ``"worst"`` for masks
    made by ``one_hot``), listed there too.

    Tensors stay where PyTorch puts them (:mod:`torchmem.fit._placement`): what ``build`` and
    ``step`` create on ``"cuda"`` or move there is GPU memory, what stays on the host is
    ``Estimate.host_peak_bytes``. ``default_device="cuda"`` runs both under
    ``torch.device("cuda")``, so tensors created without a device go to the GPU (as after
    ``torch.set_default_device("cuda")``). A step that puts nothing on the GPU is an error.

    ``levers`` (a :class:`torchmem.fit._levers.LeverRun`) applies memory levers to the model
    and optimizer ``build`` makes, and runs each step as its micro-steps (``torchmem
    estimate --what-if``, :mod:`torchmem.fit._whatif`). ``stacks=False`` records no Python
    stacks (faster by about a quarter; the out-of-memory site and snapshot then have none).

    ``extrapolate_decode=True`` (one step, no snapshot) runs only the first iterations of
    ``generate()``'s loop through the model and replays the rest into the simulator
    (:mod:`torchmem.fit._decode`): the same peaks and verdict, per-category split
    (``by_category``, ``by_module``) and ``kv_cache`` figures, in a fraction of the time;
    ``Estimate.decode_replayed`` counts the iterations replayed (0: none) and
    ``Estimate.decode_split_exact`` is false when the split could not follow them; when
    something after the replay cannot be reproduced the full run is made instead.

    ``stream=[]`` fills that list with every request made to the simulator
    (:mod:`torchmem.fit._stream`), the extrapolated ones included.

    ``stop_over=N`` stops the run as soon as the reserved bytes pass ``N`` (a search checking
    that a value does not fit: the peak only grows, so the verdict is the full run's, made in
    less time): the estimate does not fit, has no ``oom`` and sets ``Estimate.stopped_over``;
    its peaks are those reached when it stopped (lower bounds of the full run's).

    Example:
        >>> import torch
        >>> def build(batch):
        ...     x = torch.zeros(batch, 1024, device="cuda")   # 4 KiB per row
        ...     return lambda: x + 1
        >>> e = run_once(build, 4, "T4", steps=1)
        >>> e.peak_requested_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes
        (32768, 32768, 2097152)
    """
    if not callable(build):
        raise InvalidInputError(
            f"build must be a function build(batch_size) -> step, got {type(build).__name__}"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InvalidInputError(f"steps must be an int >= 1, got {steps!r}")
    card = _gpu(gpu)
    attrs = check_attrs(kv_cache_attr)
    world = check_world_size(world_size)
    on_device = check_default_device(default_device)
    routing = check_routing(routing)
    kw = dict(params or {})
    call = f"build({', '.join([repr(batch_size)] + [f'{k}={v!r}' for k, v in kw.items()])})"
    from torch._subclasses import FakeTensorMode

    sim = _make_sim(card.usable_bytes, alloc_conf)
    emu = _emulation(card)
    st = _State(sim, emu, card.compute_capability, frames=keep_snapshot)
    st.stop_over = stop_over

    readings = SimReadings(
        sim, total_bytes=card.total_bytes, context_bytes=card.context_bytes,
        on_record=lambda on: setattr(st, "frames", on or keep_snapshot),
    )
    tracker = track(stacks=stacks or keep_snapshot, listeners=[st.listener])
    step: Any = None
    failure: InvalidInputError | None = None
    values = ValueReads(strict=strict_values)
    gen = GenerationPatches(values)
    kv = KVWatch(attrs, st.sid_of.get)
    feed = None
    if extrapolate_decode and steps == 1 and not keep_snapshot and world is None:
        feed = _DecodeFeed(st, tracker, kv)
        gen.on_check = feed.check
    if stream is not None:
        stream.clear()
        st.stream = StreamRecorder(sim, stream)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    st.levers = levers
    lever_ctx = levers if levers is not None else _Null()
    with _world(world, fake_mode, build, st, tracker), tracker:
        with fake_mode, fake_cuda(
            card.name, card.compute_capability, empty_cache=sim.empty_cache, readings=readings,
            total_bytes=card.total_bytes,
            context_bytes=card.context_bytes, placement=st.pl,
        ):
            emu_ctx = emu if emu is not None else _Null()
            with emu_ctx, _SimMode(st, gen, values, routing), kv, lever_ctx:
                try:
                    gen.install()
                    try:
                        with on_device():
                            step = build(batch_size if levers is None
                                         else levers.batch(batch_size), **kw)
                    except _Abort:
                        raise
                    except Exception as e:
                        if st.oom is None:
                            if isinstance(e, BuildError):
                                failure = e
                            else:
                                failure = _user_error(e, call, [build])
                                failure.__cause__ = e
                    if failure is None and st.oom is None and not callable(step):
                        file, line = _source_of(build)
                        at = f" (defined at {file}:{line})" if file else ""
                        failure = InvalidInputError(
                            f"{call}{at} returned {type(step).__name__}, expected a "
                            "zero-argument step() callable that runs one training iteration; "
                            "fix: end build with `return step`"
                        )
                    gen.install()  # build may have imported transformers
                    for _ in range(steps):
                        if failure is not None or st.oom is not None:
                            break
                        try:
                            with on_device():
                                if levers is None:
                                    step()
                                else:
                                    levers.run_step(step)
                        except _Abort:
                            raise
                        except Exception as e:
                            if st.oom is None:
                                failure = _user_error(e, "step()", [step, build])
                                failure.__cause__ = e
                except _Abort:
                    pass
                finally:
                    gen.remove()
                    st.end_seq = len(tracker) - 1
                    if st.dist is not None:
                        st.dist.walk()  # the state at the end, before build's objects go
                    if keep_snapshot and failure is None:
                        # the state at the end of the last step (or at the OOM point), before
                        # build's objects are dropped
                        st.snapshot = sim.snapshot()
                    step = None
    if failure is not None:
        raise failure
    if tracker.listener_errors:
        raise TorchmemError(
            f"internal error in the estimate's allocator feed: {tracker.listener_errors[0]!r}"
        )
    if feed is not None and feed.rec.replayed and not feed.rec.valid:
        return run_once(build, batch_size, gpu, steps=steps, alloc_conf=alloc_conf,
                        params=params, kv_cache_attr=kv_cache_attr, world_size=world_size,
                        strict_values=strict_values, default_device=default_device,
                        routing=routing, levers=levers, stacks=stacks, stream=stream,
                        stop_over=stop_over)
    if st.oom is None and st.peak_req == 0 and st.host_peak > 0 and not st.ws_bytes:
        file, line = _source_of(build)
        at = f" ({file}:{line})" if file else ""
        raise InvalidInputError(
            f"{call}{at} and its step put nothing on the GPU: all "
            f"{st.host_peak:,} bytes of its tensors stayed on the host (tensors created without "
            "a device are CPU tensors, as in PyTorch); expected a step that runs on the GPU; "
            "fix: create tensors with device='cuda' and move the model with .to('cuda'), or "
            "pass default_device='cuda' (CLI: --default-device cuda) to put tensors created "
            "without a device on the GPU"
        )
    est = _result(card, batch_size, steps, alloc_conf, st, tracker, keep_snapshot, kv, feed)
    est.params = kw
    est.assumed_values = [r.to_dict() for r in values.reads]
    if emu is not None:  # None: a plain fake run without the CUDA emulation (benchmarks/gpu_truth.py)
        est.attention_kernel, attention_notes = emu.attention_report()
        est.notes.extend(attention_notes)
    if world is not None:
        _dist_result(est, world, st, tracker)
    return est


def check_default_device(device: Any) -> Callable[[], Any]:
    """Validate ``default_device`` (``None``, ``"cpu"`` or ``"cuda"``): a context factory
    that puts tensors created without a device there.

    Example:
        >>> with check_default_device("cuda")():
        ...     pass
        >>> check_default_device("gpu")
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: default_device must be None, 'cpu' or 'cuda', got 'gpu'; fix: pass 'cuda' to create tensors without a device on the GPU
    """
    if device is None or device == "cpu" or device == torch.device("cpu"):
        return contextlib.nullcontext
    if device in ("cuda", "cuda:0") or device == torch.device("cuda"):
        return lambda: torch.device("cuda")
    raise InvalidInputError(
        f"default_device must be None, 'cpu' or 'cuda', got {device!r}; fix: pass 'cuda' to "
        "create tensors without a device on the GPU"
    )


@contextlib.contextmanager
def _world(
    world: int | None, fake_mode: Any, build: Any, st: _State, tracker: Any
) -> Iterator[None]:
    """For a per-rank estimate (``world`` ranks): the fake process group and the watch of
    the run's categories and collectives (:mod:`torchmem.fit._dist`); nothing otherwise."""
    if world is None:
        yield
        return
    with FakeWorld(world, fake_mode, [getattr(build, "__globals__", {})], (_SimMode,)), DistWatch(
        st.sid_of.get, lambda: len(tracker)
    ) as watch:
        st.dist = watch
        yield


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _result(
    card: GPU, batch_size: int, steps: int, alloc_conf: str | None, st: _State, tracker: Any,
    keep_snapshot: bool,
    kv: KVWatch | None = None,
    feed: _DecodeFeed | None = None,
) -> Estimate:
    by_cat = dict.fromkeys(_REPORT_KEYS, 0)
    kv_ids = kv.ids if kv is not None else set()
    by_mod: dict[str, int] = {}
    replayed = feed.rec.replayed if feed is not None else 0
    if feed is not None and feed.exact and feed.peak_split is not None:  # peak in the replay
        for key, n in feed.peak_split[1].items():
            by_cat[key] += n
        by_mod = dict(feed.peak_split[2])
    elif st.peak_req_seq >= 0:
        for n, key, mod in _live_at(tracker, st.peak_req_seq, st, kv_ids).values():
            by_cat[key] += n
            name = mod or "(outside any module)"
            by_mod[name] = by_mod.get(name, 0) + n
    by_cat["workspace"] = st.ws_at_peak
    top = dict(sorted(by_mod.items(), key=lambda kv: -kv[1])[:15])
    return Estimate(
        gpu=card.name,
        batch_size=batch_size,
        fits=st.oom is None,
        capacity_bytes=card.total_bytes,
        overhead_bytes=card.context_bytes,
        peak_requested_bytes=st.peak_req,
        peak_allocated_bytes=st.peak_alloc,
        peak_reserved_bytes=st.peak_res,
        by_category=by_cat,
        by_module=top,
        oom=None if st.stopped else st.oom,
        stopped_over=st.stop_over if st.stopped else None,
        fragmentation_bytes=st.frag_at_peak,
        workspace_bytes=st.ws_bytes,
        overhead={"cuda_context": card.context_bytes},
        steps=steps,
        alloc_conf=alloc_conf,
        compute_capability=card.compute_capability,
        snapshot=st.snapshot,
        kv_cache=_kv_cache(kv, by_cat["kv_cache"], st, tracker, feed),
        host_peak_bytes=st.host_peak,
        decode_replayed=replayed,
        decode_split_exact=not replayed or feed is None or feed.exact,
    )


def _live_at(
    tracker: Any, last_seq: int, st: _State, kv_ids: set[int] | frozenset[int] = frozenset()
) -> dict[int, tuple[int, str, str]]:
    """The storages live after event ``last_seq``: id -> (bytes, report key, module)."""
    over: dict[int, str] = st.dist.cat if st.dist is not None else {}
    live: dict[int, tuple[int, str, str]] = {}
    host = st.pl.host_ever
    for ev in tracker.events():
        if ev.seq > last_seq:
            break
        if ev.device == "meta" or ev.storage in host:
            continue
        if ev.kind == _ALLOC:
            sid = ev.storage
            key = "kv_cache" if sid in kv_ids else over.get(sid) or _KEYS.get(ev.category, "other")
            live[sid] = (ev.nbytes, key, ev.module or "")
        elif ev.kind == _FREE:
            live.pop(ev.storage, None)
    return live


def _dist_result(est: Estimate, world: int, st: _State, tracker: Any) -> None:
    """A per-rank estimate's own figures: the world size, the model state at the end of the
    last ``optimizer.step()``, the collectives and their largest buffers."""
    watch = st.dist
    est.world_size = world
    est.collectives = {
        name: {"calls": calls, "largest_buffer_bytes": size}
        for name, (calls, size) in sorted(watch.collectives.items())
    }
    if watch.model_state_pos > 0:
        state = dict.fromkeys(("parameter", "gradient", "optimizer_state", "communication"), 0)
        for n, key, _ in _live_at(tracker, watch.model_state_pos - 1, st).values():
            if key in state:
                state[key] += n
        est.model_state = state
    est.notes.append(
        f"rank 0 of {world} (a fake process group: collectives move no data; every buffer "
        "has its per-rank size)"
    )


def _kv_cache(kv: KVWatch | None, at_peak: int, st: _State, tracker: Any,
              feed: _DecodeFeed | None = None) -> KVCache | None:
    """The KV cache's figures, ``None`` when the run had no cache; with decode steps
    replayed (``feed``), carried on over the replayed iterations."""
    if kv is None or not kv.ids:
        return None
    grown = feed.kv_figures() if feed is not None else None
    if grown is not None and feed is not None:
        end = feed.kv_end_bytes(st.end_seq)
        max_bytes, tokens = grown
    else:
        (end,) = kv_live_bytes(tracker.events(), kv.ids, [st.end_seq])
        max_bytes, tokens = kv.max_bytes, kv.tokens
    return KVCache(
        peak_bytes=at_peak,
        end_bytes=end,
        max_bytes=max_bytes,
        bytes_per_token=kv.bytes_per_token,
        bytes_per_sequence=max_bytes // kv.batch if kv.batch else 0,
        tokens=tokens,
        batch=kv.batch,
        source=", ".join(sorted(kv.sources)),
    )
