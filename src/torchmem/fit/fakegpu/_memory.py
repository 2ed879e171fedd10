"""The fake GPU's memory: every GPU storage of a fake run fed to the simulated caching allocator.

:class:`_State` is the tracker listener of :func:`torchmem.fit.run._engine.run_once`: each
storage birth on the GPU (:mod:`torchmem.fit.fakegpu._placement` says which are) is a
``malloc`` of :class:`~torchmem.sim.CachingAllocator`, each death a ``free``, in program order;
after each operator it adds what CUDA allocates and a CPU run never shows (the cuBLAS and
cuBLASLt workspaces per (thread, stream), the kernels' scratch buffers of
:class:`~torchmem.fit.fakegpu.kernels.CudaEmulation`). It keeps the running peaks and the first
allocation that does not fit (the out-of-memory point). :class:`DriverAddressAllocator` places
new segments as the CUDA driver tends to.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from torchmem.errors import InvalidInputError, SimulatedOutOfMemoryError
from torchmem.fit.fakegpu._placement import Placement
from torchmem.fit.verdict._estimate import OOMSite
from torchmem.model.events import Category, EventKind
from torchmem.sim import CachingAllocator

_ALLOC, _FREE = EventKind.ALLOC, EventKind.FREE


_GEMM_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation", "_scaled_mm",
)
_GEMMS = {getattr(torch.ops.aten, n) for n in _GEMM_NAMES if hasattr(torch.ops.aten, n)}


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


class _HostRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a real host storage, with its key and size (what its callback needs)."""

    __slots__ = ("key", "n")
    key: int
    n: int


class _State:
    """The simulator, the storages it holds, and the running peaks."""

    def __init__(
        self, sim: CachingAllocator, emu: Any, cc: tuple[int, int], frames: bool = False
    ) -> None:
        self.sim = sim
        self.frames = frames
        self.emu = emu
        #: called once when the run stops at its out-of-memory point (before the unwinding
        #: frees anything): the engine names the modules still running and freezes categories
        self.on_oom: Any = None
        #: the trace's categories as they were at the out-of-memory point (a forward tensor
        #: freed while the run unwinds would read "temporary" after it), or None
        self.oom_categories: Any = None
        self.addr: dict[int, int] = {}
        self.live_req = 0
        #: the decode-step record (:mod:`torchmem.fit.run._decode`), when extrapolating
        self.feed: Any = None
        #: the record of every request (:mod:`torchmem.fit.run._stream`), when asked
        self.stream: Any = None
        #: called at each new peak of requested bytes (:mod:`torchmem.fit.run._repeat`), and
        #: the live bytes by category and module it adds to the trace's at the peak
        self.on_peak_req: Any = None
        self.peak_extra: tuple[dict[str, int], dict[str, int]] | None = None
        self.peak_req = 0
        self.peak_req_seq = -1
        self.ws_at_peak = 0
        self.peak_alloc = 0
        self.frag_at_peak = 0
        self.peak_res = 0
        self.ws_bytes = 0  # workspace bytes held now
        self.ws_most = 0  # the most held at once (the estimate's workspace_bytes)
        self.ws_keys: set[object] = set()
        self.ws_blocks: list[tuple[int, int]] = []  # (address, size) of each held workspace
        #: where each storage is: the GPU or the host (:mod:`torchmem.fit.fakegpu._placement`)
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
        #: host storages the run made for real (its data preparation): key -> weak reference
        self.real_host: dict[int, Any] = {}
        self.pl.on_real_host = self.adopt_host
        self.end_seq = -1
        #: a per-rank estimate's categories and collectives (:mod:`torchmem.fit.fakegpu._dist`)
        self.dist: Any = None
        #: the memory levers applied (:mod:`torchmem.fit.levers._levers`), counting FLOPs when asked
        self.levers: Any = None
        #: the run's CUDA streams (:class:`~torchmem.fit.fakegpu._streams.Streams`): the stream
        #: each request is made on; None: all on the default stream
        self.streams: Any = None
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

    def _sim_malloc(self, nbytes: int, frames: Any) -> int:
        """The simulator's ``malloc`` on the current stream (or private pool), after the
        stream events the allocator processes first; raises its out-of-memory error."""
        streams = self.streams
        stream = 0
        if streams is not None:
            streams.before_malloc()
            stream = streams.key()
        return self.sim.malloc(nbytes, stream=stream, frames=frames)

    def _malloc(self, nbytes: int, ev: Any, op: str | None, label: str) -> int | None:
        frames = None
        if self.frames:
            frames = _frames(getattr(ev, "stack", None), op or label)
        try:
            addr = self._sim_malloc(nbytes, frames)
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
            if self.on_oom is not None:
                self.on_oom()
            return None
        self._peaks()
        return addr

    def _try_malloc(self, nbytes: int, op: str) -> int | None:
        """A request the caller catches the out-of-memory error of (``None`` then), as cuDNN
        catches a workspace's and tries its next plan."""
        try:
            addr = self._sim_malloc(nbytes, _frames(None, op) if self.frames else None)
        except SimulatedOutOfMemoryError:
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

    def adopt_host(self, storage: torch.UntypedStorage) -> None:
        """Count a real host storage the run made (outside the fake mode) as host memory until
        it is freed (a weak reference tells)."""
        key = storage._cdata
        if key in self.real_host:
            return
        n = storage.nbytes()
        self.host_live += n
        if self.host_live > self.host_peak:
            self.host_peak = self.host_live
        # one bound callback for every storage (no closure per storage: data preparation
        # makes one per line); the reference carries its key and size
        ref = _HostRef(storage, self._host_gone)
        ref.key, ref.n = key, n
        self.real_host[key] = ref

    def _host_gone(self, ref: _HostRef) -> None:
        if self.real_host.pop(ref.key, None) is not None:
            self._host(-ref.n)

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
                if self.on_peak_req is not None:
                    self.on_peak_req()
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

    def address(self, t: torch.Tensor) -> int | None:
        """The simulated address of ``t``'s block (``None``: not on the GPU, or empty)."""
        sid = self.sid_of.get(t.untyped_storage()._cdata)
        return None if sid is None else self.addr.get(sid)

    def _workspace(self, nbytes: int, op: str, label: str) -> None:
        addr = self._malloc(nbytes, None, op, label)
        if addr is not None:
            self.ws_blocks.append((addr, nbytes))
            self.ws_bytes += nbytes
            self.ws_most = max(self.ws_most, self.ws_bytes)

    def clear_workspaces(self) -> None:
        """``torch._C._cuda_clearCublasWorkspaces()``: every cuBLAS and cuBLASLt workspace goes
        back to the caching allocator (cached there, not released), and the next GEMM of each
        thread and stream allocates its own again, as ``CublasHandlePool.cpp``'s
        ``clearCublasWorkspaces`` does (it clears the maps that own them)."""
        for addr, nbytes in self.ws_blocks:
            self.sim.free(addr)
            self.ws_bytes -= nbytes
        self.ws_blocks.clear()
        self.ws_keys.clear()

    def after_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if not self.pl.current:  # an operator on host tensors: no GPU workspace
            return
        if self.ws_size and func.overloadpacket in _GEMMS:
            key: object = (
                "autograd" if torch._C._current_autograd_node() is not None
                else threading.get_ident(),
                self.streams.current if self.streams is not None else 0,
            )
            if key not in self.ws_keys:
                self.ws_keys.add(key)
                self._workspace(self.ws_size, str(func), "cuBLAS workspace")
            # cuBLASLt's own workspace, after the cuBLAS one, at the first Lt GEMM
            lt_key = ("cublasLt", key)
            if (
                self.lt_size
                and self.oom is None
                and lt_key not in self.ws_keys
                and self.emu.uses_cublaslt(func, args, kwargs or {})
            ):
                self.ws_keys.add(lt_key)
                self._workspace(self.lt_size, str(func), "cuBLASLt workspace")
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
                if int(entry[0]) <= 0:  # an empty buffer (a zero-length sequence): PyTorch
                    continue            # never calls the allocator for 0 bytes
                if len(entry) > 3:  # a size that another plan replaces when it does not fit
                    addr = self._try_malloc(int(entry[0]), str(func))  # type: ignore[misc]
                    if addr is None:
                        entry = (entry[3], entry[1], entry[2])  # type: ignore[misc]
                if len(entry) <= 3 or addr is None:
                    addr = self._malloc(int(entry[0]), None, str(func), str(entry[1]))
                if addr is None:
                    break
                held[i] = addr
                for j in entry[2] if len(entry) > 2 else ():  # type: ignore[misc]
                    if j in held:
                        self.sim.free(held.pop(j))
            for addr in reversed(list(held.values())):
                self.sim.free(addr)


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


def _make_sim(capacity: int, alloc_conf: str | None, total: int | None = None) -> CachingAllocator:
    """The estimate's allocator: ``capacity`` bytes for its segments (the GPU less its CUDA
    context); a ``per_process_memory_fraction`` in ``alloc_conf`` is a fraction of ``total``,
    the device's whole memory, as PyTorch takes it (default ``capacity``)."""
    if alloc_conf is None:
        return DriverAddressAllocator(capacity)
    if not isinstance(alloc_conf, str):
        raise InvalidInputError(
            f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string such as "
            f"'expandable_segments:True', got {type(alloc_conf).__name__}"
        )
    sim = DriverAddressAllocator(capacity, config=alloc_conf)
    fraction = sim.config.per_process_memory_fraction
    if fraction is not None and total is not None:
        sim.set_memory_fraction(fraction, total)
    return sim


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


def _live_at(
    tracker: Any, last_seq: int, st: _State, kv_ids: set[int] | frozenset[int] = frozenset()
) -> dict[int, tuple[int, str, str]]:
    """The storages live after event ``last_seq``: id -> (bytes, report key, module)."""
    over: dict[int, str] = st.dist.cat if st.dist is not None else {}
    live: dict[int, tuple[int, str, str]] = {}
    host = st.pl.host_ever
    frozen = st.oom_categories
    for ev in tracker.events():
        if ev.seq > last_seq:
            break
        if ev.device == "meta" or ev.storage in host:
            continue
        if ev.kind == _ALLOC:
            sid = ev.storage
            cat = ev.category if frozen is None or ev.seq >= len(frozen) else Category(
                frozen[ev.seq])
            key = "kv_cache" if sid in kv_ids else over.get(sid) or _KEYS.get(cat, "other")
            live[sid] = (ev.nbytes, key, ev.module or "")
        elif ev.kind == _FREE:
            live.pop(ev.storage, None)
    return live
