"""Device capacity and usage: what a device holds now, read once or polled in the background.

Sources, in order of preference:

* ``cpu``: :mod:`psutil` -- system memory (``total``, ``used = total - available``) and this
  process's resident set size (``process``).
* ``cuda:i``: NVML through ``nvidia-ml-py`` (optional extra ``torchmem[nvml]``; needs no CUDA
  context), else :func:`torch.cuda.mem_get_info`. ``process`` is this process's NVML figure when
  the driver reports it, else PyTorch's reserved bytes for that device. The two sources differ
  by the memory the driver keeps for itself: NVML (like nvidia-smi) counts it in both ``total``
  and ``used``, ``cudaMemGetInfo`` in neither (measured on an H100 80GB, driver 580: NVML total
  85,520,809,984 B, ``mem_get_info`` total 85,017,493,504 B, 480 MiB apart; ``tests/data/gpu``).

Devices absent on this machine are skipped cleanly: :func:`available_devices` lists only those
that exist, :func:`poll_usage` raises :class:`~torchmem.errors.DeviceError` for the others and
:meth:`UsagePoller.usage` returns ``None`` for them.

:class:`UsagePoller` runs one daemon thread per device that someone asked about, at a configurable
interval; threads start on the first :meth:`~UsagePoller.usage` call for a device, stop on
:meth:`~UsagePoller.close` and at interpreter exit. Anything with a ``usage(device) ->
DeviceUsage | None`` method is a *usage source* (see :class:`UsageSource`); the ledger's auto-GC
reads one, and tests inject their own.

:func:`read_gpu` reads what :func:`torchmem.analysis.gpu_gap` needs to split nvidia-smi's figure
(NVML's device and per-process usage, PyTorch's reserved and allocated bytes, the CUDA context
measured by :func:`measure_cuda_context`, NCCL process groups). The module is over 600 lines
because the polling and these readings share the NVML state and the UUID-based handle lookup.

Example:
    >>> u = poll_usage("cpu")
    >>> u.device, u.total > 0, 0 <= u.used_pct <= 100, u.process is not None and u.process > 0
    ('cpu', True, True, True)
    >>> with UsagePoller(interval=0.05) as poller:
    ...     poller.usage("cpu").total == u.total
    True
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from torchmem._device import device_name
from torchmem.errors import DeviceError, InvalidInputError
from torchmem.units import format_bytes

__all__ = [
    "DeviceUsage",
    "UsageSource",
    "UsagePoller",
    "available_devices",
    "poll_usage",
    "poll_all",
    "normalize_device",
    "read_gpu",
    "measure_cuda_context",
]


@dataclass(frozen=True)
class DeviceUsage:
    """One reading of a device's memory: capacity, used bytes and used percent.

    ``process`` is this process's share where the source knows it (RSS on CPU), else ``None``.
    ``time`` is :func:`time.time` at the reading; ``source`` names where it came from
    (``"psutil"``, ``"nvml"``, ``"torch.cuda"`` or a test's own name).

    Example:
        >>> u = DeviceUsage("cuda:0", total=80 * 2**30, used=20 * 2**30)
        >>> u.used_pct, u.free, str(u)
        (25.0, 64424509440, 'cuda:0: 20.00 GiB / 80.00 GiB used (25.0%)')
    """

    device: str
    total: int
    used: int
    process: Optional[int] = None
    source: str = "manual"
    time: float = 0.0

    @property
    def used_pct(self) -> float:
        """Used bytes as a percentage of capacity (0.0 when capacity is unknown).

        Example:
            >>> DeviceUsage("cpu", total=200, used=50).used_pct
            25.0
        """
        return 100.0 * self.used / self.total if self.total > 0 else 0.0

    @property
    def free(self) -> int:
        """Capacity minus used bytes (never negative).

        Example:
            >>> DeviceUsage("cpu", total=200, used=50).free
            150
        """
        return max(0, self.total - self.used)

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form for JSON (bytes stay ints).

        Example:
            >>> DeviceUsage("cpu", 100, 25, source="x").as_dict()["used_pct"]
            25.0
        """
        return {
            "device": self.device,
            "total": self.total,
            "used": self.used,
            "free": self.free,
            "used_pct": round(self.used_pct, 3),
            "process": self.process,
            "source": self.source,
            "time": self.time,
        }

    def __str__(self) -> str:
        return (
            f"{self.device}: {format_bytes(self.used)} / {format_bytes(self.total)} used "
            f"({self.used_pct:.1f}%)"
        )


@runtime_checkable
class UsageSource(Protocol):
    """Anything that answers ``usage(device) -> DeviceUsage | None`` without blocking for long.

    The ledger's auto-GC reads the device's used % from one. :class:`UsagePoller` is the real one;
    a test can pass its own object.

    Example:
        >>> class Fixed:
        ...     def usage(self, device):
        ...         return DeviceUsage(device, total=100, used=90)
        >>> isinstance(Fixed(), UsageSource), Fixed().usage("cpu").used_pct
        (True, 90.0)
    """

    def usage(self, device: str) -> Optional[DeviceUsage]: ...


def normalize_device(device: Any) -> str:
    """Canonical device name for polling: ``'cpu'`` or ``'cuda:<index>'``.

    Accepts a string, a ``torch.device`` or an int (a CUDA index); names follow
    :func:`torchmem._device.device_name` (``'cuda'`` is the current CUDA device, ``'cuda:0'``
    until CUDA is initialised). Other device types raise :class:`~torchmem.errors.DeviceError`.

    Example:
        >>> normalize_device("cuda"), normalize_device(1), normalize_device("cpu")
        ('cuda:0', 'cuda:1', 'cpu')
    """
    if isinstance(device, bool):
        raise InvalidInputError(f"expected a device such as 'cpu' or 'cuda:0', got {device!r}")
    name = device_name(device)
    if name != "cpu" and not name.startswith("cuda:"):
        raise DeviceError(
            f"expected a device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}; "
            "usage polling knows CPU and CUDA devices only"
        )
    return name


# ---------------------------------------------------------------------------------------------
# CPU


def _cpu_usage() -> DeviceUsage:
    import psutil

    vm = psutil.virtual_memory()
    try:
        rss: Optional[int] = int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # pragma: no cover - psutil cannot read our own process
        rss = None
    total = int(vm.total)
    return DeviceUsage(
        "cpu", total=total, used=total - int(vm.available), process=rss, source="psutil",
        time=time.time(),
    )


# ---------------------------------------------------------------------------------------------
# CUDA: NVML when available (no CUDA context needed), else torch.cuda.mem_get_info

_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {"tried": False, "ok": False}


def _nvml() -> Any:
    """The ``pynvml`` module after a successful ``nvmlInit``, or ``None``."""
    with _nvml_lock:
        if not _nvml_state["tried"]:
            _nvml_state["tried"] = True
            try:
                import pynvml  # from the nvidia-ml-py package

                pynvml.nvmlInit()
                _nvml_state["ok"] = True
                _nvml_state["mod"] = pynvml
            except Exception:  # no package, no driver, no GPU
                _nvml_state["ok"] = False
        return _nvml_state.get("mod") if _nvml_state["ok"] else None


def _cuda_count() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _nvml_handle(nv: Any, index: int) -> Any:
    # torch's index follows CUDA_VISIBLE_DEVICES; NVML's does not. Match by UUID when we can.
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if uuid:
            key = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            return nv.nvmlDeviceGetHandleByUUID(key)
    except Exception:
        pass
    return nv.nvmlDeviceGetHandleByIndex(index)


def _cuda_usage(index: int) -> DeviceUsage:
    import torch

    name = f"cuda:{index}"
    nv = _nvml()
    if nv is not None:
        try:
            h = _nvml_handle(nv, index)
            info = nv.nvmlDeviceGetMemoryInfo(h)
            proc: Optional[int] = None
            try:
                pid = os.getpid()
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if int(p.pid) == pid and p.usedGpuMemory is not None:
                        proc = int(p.usedGpuMemory)
            except Exception:
                proc = None
            return DeviceUsage(
                name, total=int(info.total), used=int(info.used), process=proc, source="nvml",
                time=time.time(),
            )
        except Exception:
            pass  # fall back to torch
    free, total = torch.cuda.mem_get_info(index)
    return DeviceUsage(
        name, total=int(total), used=int(total) - int(free),
        process=int(torch.cuda.memory_reserved(index)), source="torch.cuda", time=time.time(),
    )


# ---------------------------------------------------------------------------------------------
# the gap to nvidia-smi: readings for torchmem.analysis.gpu_gap

#: CUDA context bytes measured by :func:`measure_cuda_context`, per device index.
_CONTEXT: dict[int, int] = {}


def _handle(nv: Any, cuda: Any, index: int) -> Any:
    """NVML's handle of torch's device ``index`` (by UUID: CUDA_VISIBLE_DEVICES renumbers)."""
    try:
        uuid = str(cuda.get_device_properties(index).uuid)
        if uuid:
            return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        pass
    return nv.nvmlDeviceGetHandleByIndex(index)


def _processes(nv: Any, h: Any) -> dict[int, int | None]:
    """``{pid: used bytes or None}`` of the compute and graphics processes NVML lists."""
    out: dict[int, int | None] = {}
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            procs = getattr(nv, fn)(h)
        except Exception:
            continue
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out[int(p.pid)] = None if used is None else int(used)
    return out


def _torch_cuda() -> Any:
    import torch

    return torch.cuda


def measure_cuda_context(
    device: Any = 0, *, nvml: Any = None, cuda: Any = None
) -> Optional[int]:
    """Start CUDA on ``device`` and measure its context with NVML; ``None`` when it cannot.

    Call it before anything else uses CUDA in the process: the context is then this process's
    NVML usage right after CUDA started (or, where NVML does not list processes, the rise of the
    device's used bytes, which another process allocating at the same moment would distort).
    Once CUDA is running it returns the figure measured earlier, if any. The result is kept for
    :func:`read_gpu`. ``nvml`` and ``cuda`` replace ``pynvml`` and ``torch.cuda`` (tests).

    Example:
        >>> c = measure_cuda_context(0)   # None on a machine without a GPU or NVML
        >>> c is None or c > 0
        True
    """
    index = int(normalize_device(device).split(":")[1]) if not isinstance(device, int) else device
    cuda = cuda if cuda is not None else _torch_cuda()
    if index in _CONTEXT:
        return _CONTEXT[index]
    if cuda.is_initialized() and not _CONTEXT:
        return None  # CUDA was started by someone else: its contexts may exist already
    nv = nvml if nvml is not None else _nvml()
    if nv is None or not cuda.is_available():
        return None
    pid = os.getpid()
    before: Optional[int] = None
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):  # NVML's index is torch's only then
        try:
            h0 = nv.nvmlDeviceGetHandleByIndex(index)
            if _processes(nv, h0).get(pid):
                return None  # this process already has a context there
            before = int(nv.nvmlDeviceGetMemoryInfo(h0).used)
        except Exception:
            before = None
    cuda.mem_get_info(index)  # creates the context on that device
    try:
        h = _handle(nv, cuda, index)
        mine = _processes(nv, h).get(pid)
        after = int(nv.nvmlDeviceGetMemoryInfo(h).used)
    except Exception:
        return None
    context = mine if mine is not None else (after - before if before is not None else None)
    if context is not None:
        _CONTEXT[index] = context
    return context


def read_gpu(
    device: Any = 0,
    *,
    context_estimates: Optional[dict[int, int]] = None,
    nvml: Any = None,
    cuda: Any = None,
) -> dict[str, Any]:
    """The readings of one GPU for :func:`torchmem.analysis.gpu_gap` (a dict of bytes).

    NVML's total and used, every process NVML lists with its usage (this one apart),
    ``torch.cuda.memory_reserved``/``memory_allocated``, the context measured by
    :func:`measure_cuda_context` (else ``context_estimate_bytes`` from ``context_estimates``, a
    table ``{compute-capability major: bytes}`` such as :data:`torchmem.fit.CONTEXT_BYTES`), and
    the number of NCCL process groups when ``torch.distributed`` is initialised. Without NVML
    the device figures come from ``torch.cuda.mem_get_info`` and there are no per-process ones.
    ``nvml`` and ``cuda`` replace ``pynvml`` and ``torch.cuda`` (tests use recorded readings).

    Example:
        >>> try:
        ...     r = read_gpu(0)
        ... except DeviceError:
        ...     r = None                  # no GPU on this machine
        >>> r is None or r["used_bytes"] <= r["total_bytes"]
        True
    """
    index = int(normalize_device(device).split(":")[1]) if not isinstance(device, int) else device
    cuda = cuda if cuda is not None else _torch_cuda()
    if not cuda.is_available() or index >= int(cuda.device_count()):
        raise DeviceError(
            f"cannot read cuda:{index}: this machine has "
            f"{int(cuda.device_count()) if cuda.is_available() else 0} visible CUDA device(s)"
        )
    nv = nvml if nvml is not None else _nvml()
    notes: list[str] = []
    pid = os.getpid()
    d: dict[str, Any] = {"device": index}
    readings = None
    if nv is not None:
        try:
            h = _handle(nv, cuda, index)
            info = nv.nvmlDeviceGetMemoryInfo(h)
            name = nv.nvmlDeviceGetName(h)
            procs = _processes(nv, h)
            readings = (int(info.total), int(info.used),
                        name.decode() if isinstance(name, bytes) else str(name), procs)
        except Exception as e:  # a driver error: fall back to torch
            notes.append(f"NVML failed ({type(e).__name__}: {e}); device figures from torch")
    if readings is not None:
        total, used, name, procs = readings
        d.update(name=name, total_bytes=total, used_bytes=used, process_bytes=procs.get(pid),
                 other_processes=sorted((p, b or 0) for p, b in procs.items() if p != pid),
                 source="nvml")
    else:
        free, total = cuda.mem_get_info(index)
        d.update(name=str(cuda.get_device_properties(index).name), total_bytes=int(total),
                 used_bytes=int(total) - int(free), process_bytes=None, other_processes=[],
                 source="torch.cuda.mem_get_info")
        notes.append("NVML is not available (pip install nvidia-ml-py): no per-process figures")
    d["reserved_bytes"] = int(cuda.memory_reserved(index))
    d["allocated_bytes"] = int(cuda.memory_allocated(index))
    d["context_bytes"] = _CONTEXT.get(index)
    if d["context_bytes"] is None and context_estimates:
        major = int(cuda.get_device_capability(index)[0])
        d["context_estimate_bytes"] = context_estimates.get(major, max(context_estimates.values()))
    d["nccl_process_groups"] = _nccl_groups()
    d["notes"] = notes
    return d


def _nccl_groups() -> int:
    """How many process groups use NCCL (0 when torch.distributed is not initialised)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0
        from torch.distributed.distributed_c10d import _world

        return sum(1 for pg in list(_world.pg_map) if dist.get_backend(pg) == "nccl")
    except Exception:
        return 0


# ---------------------------------------------------------------------------------------------
# public one-shot functions


def available_devices() -> list[str]:
    """Devices whose usage can be polled here: ``'cpu'`` then each visible ``'cuda:i'``.

    Example:
        >>> import torch
        >>> available_devices() == ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        True
    """
    return ["cpu"] + [f"cuda:{i}" for i in range(_cuda_count())]


def poll_usage(device: Any = "cpu") -> DeviceUsage:
    """Read one device's usage now (synchronously).

    Raises :class:`~torchmem.errors.DeviceError` for a device absent on this machine.

    Example:
        >>> import psutil
        >>> poll_usage("cpu").total == psutil.virtual_memory().total
        True
        >>> poll_usage("cuda:0")  # doctest: +SKIP
        DeviceUsage(device='cuda:0', total=..., used=..., ...)
    """
    name = normalize_device(device)
    if name == "cpu":
        return _cpu_usage()
    index = int(name.split(":")[1])
    count = _cuda_count()
    if index >= count:
        raise DeviceError(
            f"cannot poll {name}: this machine has {count} visible CUDA device(s); "
            f"use one of {available_devices()} (see torchmem.available_devices())"
        )
    return _cuda_usage(index)


def poll_all() -> dict[str, DeviceUsage]:
    """Usage of every available device, read now.

    Example:
        >>> sorted(poll_all()) == sorted(available_devices())
        True
    """
    out: dict[str, DeviceUsage] = {}
    for name in available_devices():
        try:
            out[name] = poll_usage(name)
        except Exception:  # a device that vanished or a driver error: skip it
            continue
    return out


# ---------------------------------------------------------------------------------------------
# background polling

_live_pollers: weakref.WeakSet[UsagePoller] = weakref.WeakSet()
_live_lock = threading.Lock()


def _close_all_pollers() -> None:  # atexit
    with _live_lock:
        pollers = list(_live_pollers)
    for p in pollers:
        p.close()


atexit.register(_close_all_pollers)


class _DeviceThread:
    """One daemon thread refreshing one device's reading."""

    def __init__(self, owner: UsagePoller, device: str, first: DeviceUsage) -> None:
        self.device = device
        self.latest = first
        self.reads = 1
        self.errors = 0
        self.stop = threading.Event()
        owner_ref = weakref.ref(owner)
        self.thread = threading.Thread(
            target=self._run, args=(owner_ref,), name=f"torchmem-usage-{device}", daemon=True
        )

    def _run(self, owner_ref: weakref.ref[UsagePoller]) -> None:
        while True:
            owner = owner_ref()
            if owner is None:
                return
            interval = owner.interval
            read = owner._read
            del owner  # do not keep the poller alive while sleeping
            if self.stop.wait(interval):
                return
            try:
                self.latest = read(self.device)
                self.reads += 1
            except Exception:
                self.errors += 1


class UsagePoller:
    """Background usage polling: one daemon thread per device asked about, at ``interval`` seconds.

    :meth:`usage` returns the latest reading without blocking (the first call for a device reads
    synchronously and starts that device's thread). Absent devices give ``None`` and start no
    thread. :meth:`close` stops and joins every thread; pollers still open at interpreter exit are
    closed by an ``atexit`` handler. Usable as a context manager.

    ``reader`` replaces the real reading function (``poll_usage``) -- e.g. to feed a fixed
    sequence of readings through the real threads.

    Example:
        >>> p = UsagePoller(interval=0.05)
        >>> p.usage("cpu").source, p.running_devices()
        ('psutil', ['cpu'])
        >>> p.close(); p.running_devices()
        []
    """

    def __init__(self, interval: float = 0.2, *, reader: Any = None) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise InvalidInputError(
                f"UsagePoller interval must be a positive number of seconds, got {interval!r}; "
                "try 0.2"
            )
        self.interval = float(interval)
        self._read = reader if reader is not None else poll_usage
        self._threads: dict[str, _DeviceThread] = {}
        self._absent: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        with _live_lock:
            _live_pollers.add(self)

    def usage(self, device: Any) -> Optional[DeviceUsage]:
        """Latest reading for ``device`` (``'cpu'``, ``'cuda:1'``, ...), or ``None`` if absent.

        Example:
            >>> with UsagePoller() as p:
            ...     p.usage("cpu").device, p.usage("cuda:99")
            ('cpu', None)
        """
        t = self._threads.get(device)  # fast path: an already polled canonical name
        if t is not None:
            return t.latest
        try:
            name = normalize_device(device)
        except DeviceError:
            return None  # meta, mps, ...: nothing to poll
        t = self._threads.get(name)
        if t is not None:
            return t.latest
        if name in self._absent or self._closed:
            return None
        with self._lock:
            t = self._threads.get(name)
            if t is not None:
                return t.latest
            try:
                first = self._read(name)
            except DeviceError:
                self._absent.add(name)
                return None
            if first is None:
                self._absent.add(name)
                return None
            t = _DeviceThread(self, name, first)
            self._threads[name] = t
            t.thread.start()
            return first

    def reads(self, device: Any) -> int:
        """How many readings this poller took for ``device`` so far (0 if never polled).

        Example:
            >>> with UsagePoller() as p:
            ...     _ = p.usage("cpu"); p.reads("cpu") >= 1
            True
        """
        t = self._threads.get(normalize_device(device))
        return t.reads if t is not None else 0

    def running_devices(self) -> list[str]:
        """Devices whose polling thread is alive.

        Example:
            >>> UsagePoller().running_devices()
            []
        """
        return sorted(n for n, t in self._threads.items() if t.thread.is_alive())

    def close(self, timeout: float = 2.0) -> None:
        """Stop and join every polling thread (idempotent).

        Example:
            >>> p = UsagePoller(); p.close(); p.close()
        """
        with self._lock:
            self._closed = True
            threads = list(self._threads.values())
            self._threads.clear()
        for t in threads:
            t.stop.set()
        for t in threads:
            if t.thread is not threading.current_thread():
                t.thread.join(timeout)
        with _live_lock:
            _live_pollers.discard(self)

    def __enter__(self) -> UsagePoller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"UsagePoller(interval={self.interval}, devices={self.running_devices()})"
