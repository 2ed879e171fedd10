"""The gap to nvidia-smi: why a GPU shows more memory used than PyTorch reports.

nvidia-smi's "used" is NVML's device figure. This module splits it, from one set of readings
(:class:`GpuReading`, read by :func:`torchmem.devices.read_gpu` or recorded), into lines whose
sources are stated:

=============================  ===============================================================
line                           source
=============================  ===============================================================
total                          NVML ``nvmlDeviceGetMemoryInfo().total``
used (nvidia-smi)              NVML ``nvmlDeviceGetMemoryInfo().used``
other processes                NVML ``nvmlDeviceGetComputeRunningProcesses``: other PIDs' usage
this process                   the same NVML list, this PID's ``usedGpuMemory`` (when the
                               driver does not say, e.g. in some containers: used minus the
                               other processes)
PyTorch reserved               ``torch.cuda.memory_reserved`` (segments of the caching
                               allocator), of which ``torch.cuda.memory_allocated`` is in use
                               and the rest cached
CUDA context                   measured: this process's NVML usage right after CUDA started
                               (:func:`torchmem.devices.measure_cuda_context`, before anything
                               was allocated); else the documented estimate per GPU generation
                               (:data:`torchmem.fit.CONTEXT_BYTES`)
NCCL                           bytes when measured (rarely possible); the number of NCCL
                               process groups otherwise, their buffers then sit in "unexplained"
unexplained (this process)     this process - reserved - context - NCCL: libraries that call
                               cudaMalloc themselves (cuDNN/cuBLAS handles, Triton, NCCL),
                               kernel images loaded after the context was measured (CUDA's lazy
                               module loading), or an estimate that was off
not attributed to any process  used - this process - other processes: the driver's own
                               reservations, processes NVML does not list (other containers)
=============================  ===============================================================

Example:
    >>> GiB, MiB = 1 << 30, 1 << 20
    >>> g = gpu_gap(GpuReading(0, "H100", total_bytes=80 * GiB, used_bytes=30 * GiB,
    ...     process_bytes=20 * GiB, reserved_bytes=18 * GiB, allocated_bytes=15 * GiB,
    ...     context_bytes=512 * MiB, other_processes=((4242, 9 * GiB),)))
    >>> g.unexplained_bytes // MiB, g.unattributed_bytes // MiB
    (1536, 1024)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.units import format_bytes as _fb

__all__ = ["GpuReading", "GpuGap", "gpu_gap"]


@dataclass(frozen=True)
class GpuReading:
    """One GPU's readings at one moment (bytes), the input of :func:`gpu_gap`.

    ``process_bytes`` is ``None`` when NVML does not list this process; ``context_bytes`` is
    the measured CUDA context (``None``: not measured), ``context_estimate_bytes`` the documented
    estimate used then; ``other_processes`` holds ``(pid, bytes)`` pairs. ``source`` says where
    the device figures came from (``"nvml"``, or ``"torch.cuda.mem_get_info"`` without NVML).

    Example:
        >>> r = GpuReading.from_dict({"device": 0, "name": "x", "total_bytes": 100,
        ...     "used_bytes": 40, "process_bytes": None, "reserved_bytes": 10,
        ...     "allocated_bytes": 5, "other_processes": [[7, 20]]})
        >>> r.other_processes, r.to_dict()["other_processes"]
        (((7, 20),), [[7, 20]])
    """

    device: int
    name: str
    total_bytes: int
    used_bytes: int
    process_bytes: int | None
    reserved_bytes: int
    allocated_bytes: int
    context_bytes: int | None = None
    context_estimate_bytes: int | None = None
    nccl_bytes: int | None = None
    nccl_process_groups: int = 0
    other_processes: tuple[tuple[int, int], ...] = ()
    source: str = "nvml"
    notes: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuReading:
        """Build from a dict of readings (:func:`torchmem.devices.read_gpu`'s, or recorded).

        Unknown keys are an error (a misspelt reading must not silently count as zero).

        Example:
            >>> GpuReading.from_dict({"device": 0, "name": "x", "total_bytes": 1, "used_bytes": 1,
            ...     "process_bytes": 1, "reserved_bytes": 0, "allocated_bytes": 0, "typo": 1})
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: GpuReading: unknown reading(s) ['typo']; expected keys among ['allocated_bytes', 'context_bytes', 'context_estimate_bytes', 'device', 'name', 'nccl_bytes', 'nccl_process_groups', 'notes', 'other_processes', 'process_bytes', 'reserved_bytes', 'source', 'total_bytes', 'used_bytes']
        """
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(d) - known)
        if extra:
            raise InvalidInputError(
                f"GpuReading: unknown reading(s) {extra}; expected keys among {sorted(known)}"
            )
        kw = dict(d)
        kw["other_processes"] = tuple((int(p), int(b)) for p, b in kw.get("other_processes", ()))
        kw["notes"] = tuple(kw.get("notes", ()))
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (pairs as lists).

        Example:
            >>> GpuReading(0, "x", 1, 1, None, 0, 0).to_dict()["process_bytes"] is None
            True
        """
        d = asdict(self)
        d["other_processes"] = [list(p) for p in self.other_processes]
        d["notes"] = list(self.notes)
        return d


@dataclass
class GpuGap:
    """The used bytes of one GPU split into explained lines and the unexplained rest.

    ``rows`` are ``{"line", "bytes", "source", "depth"}`` in display order (``depth`` indents
    a part under its whole). ``process_bytes`` is NVML's figure for this process, or used minus
    the other processes when NVML does not list it (``notes`` says so).

    Example:
        >>> g = gpu_gap(GpuReading(0, "x", 100, 60, 50, 30, 20, context_bytes=15))
        >>> [(r["line"], r["bytes"]) for r in g.rows][-2:]
        [('unexplained (this process)', 5), ('not attributed to any process', 10)]
    """

    device: int
    name: str
    total_bytes: int
    used_bytes: int
    process_bytes: int
    other_processes_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    context_bytes: int
    context_source: str
    nccl_bytes: int
    unexplained_bytes: int
    unattributed_bytes: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> gpu_gap(GpuReading(0, "x", 100, 60, 50, 30, 20, context_bytes=15)).to_dict()["unexplained_bytes"]
            5
        """
        return asdict(self)

    def text(self) -> str:
        """The lines as a table, one per row, with their sources.

        Example:
            >>> print(gpu_gap(GpuReading(0, "x", 100, 60, 50, 30, 20, context_bytes=15)).text().splitlines()[0])
            cuda:0 (x)
        """
        out = [f"cuda:{self.device} ({self.name})"]
        for r in self.rows:
            label = "  " * (r["depth"] + 1) + r["line"]
            out.append(f"{label:<36} {_fb(r['bytes']):>12}   {r['source']}")
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out) + "\n"

    def summary(self) -> str:
        """One line: this process's NVML bytes split, and the other processes.

        Example:
            >>> gpu_gap(GpuReading(0, "x", 100, 60, 50, 30, 20, context_bytes=15)).summary()
            'cuda:0 vs nvidia-smi: this process 50 B = PyTorch reserved 30 B + CUDA context 15 B (measured) + unexplained 5 B; other processes 0 B; not attributed 10 B'
        """
        nccl = f" + NCCL {_fb(self.nccl_bytes)}" if self.nccl_bytes else ""
        return (
            f"cuda:{self.device} vs nvidia-smi: this process {_fb(self.process_bytes)} = PyTorch "
            f"reserved {_fb(self.reserved_bytes)} + CUDA context {_fb(self.context_bytes)} "
            f"({self.context_source}){nccl} + unexplained {_fb(self.unexplained_bytes)}; other "
            f"processes {_fb(self.other_processes_bytes)}; not attributed "
            f"{_fb(self.unattributed_bytes)}"
        )


def gpu_gap(r: GpuReading) -> GpuGap:
    """Split NVML's used bytes of one GPU (see the module docs for each line's source).

    Example:
        >>> g = gpu_gap(GpuReading(0, "x", 100, 60, None, 30, 20, context_estimate_bytes=12,
        ...                        other_processes=((9, 25),)))
        >>> g.process_bytes, g.context_source, g.unexplained_bytes, g.unattributed_bytes
        (35, 'estimate', -7, 0)
    """
    for name in ("total_bytes", "used_bytes", "reserved_bytes", "allocated_bytes"):
        v = getattr(r, name)
        if not isinstance(v, int) or v < 0:
            raise InvalidInputError(f"gpu_gap: {name} should be a byte count >= 0, got {v!r}")
    notes = list(r.notes)
    others = sum(b for _pid, b in r.other_processes)
    if r.process_bytes is not None:
        process, p_source = r.process_bytes, "NVML, this PID's usedGpuMemory"
    else:
        process, p_source = max(0, r.used_bytes - others), "used minus the other processes"
        notes.append("NVML does not list this process (a container hides PIDs, or an old "
                     "driver): its usage is taken as used minus the other processes")
    if r.context_bytes is not None:
        context, c_source = r.context_bytes, "measured"
        c_detail = "measured: this process's NVML usage right after CUDA started"
    elif r.context_estimate_bytes is not None:
        context, c_source = r.context_estimate_bytes, "estimate"
        c_detail = "estimate for this GPU generation (torchmem.fit.CONTEXT_BYTES)"
    else:
        context, c_source = 0, "unknown"
        c_detail = "unknown (counted in unexplained)"
    nccl = r.nccl_bytes or 0
    if r.nccl_bytes is not None:
        n_detail = "measured"
    elif r.nccl_process_groups:
        n_detail = (f"{r.nccl_process_groups} NCCL process group(s); their buffers are not "
                    "measured and sit in unexplained")
    else:
        n_detail = "no NCCL process group in this process"
    unexplained = process - r.reserved_bytes - context - nccl
    unattributed = r.used_bytes - process - others
    if unexplained < 0 and c_source == "estimate":
        notes.append("unexplained is negative: this process's context is smaller than the "
                     "estimate; measure it with torchmem.devices.measure_cuda_context()")
    cached = r.reserved_bytes - r.allocated_bytes
    others_src = ", ".join(f"PID {p} {_fb(b)}" for p, b in r.other_processes) or "none listed"
    rows = [
        _row("total", r.total_bytes, f"{r.source}: device memory", 0),
        _row("used (nvidia-smi)", r.used_bytes, f"{r.source}: used", 0),
        _row("other processes", others, f"NVML process list: {others_src}", 1),
        _row("this process", process, p_source, 1),
        _row("PyTorch reserved", r.reserved_bytes, "torch.cuda.memory_reserved()", 2),
        _row("allocated", r.allocated_bytes, "torch.cuda.memory_allocated()", 3),
        _row("cached, not allocated", cached, "reserved - allocated", 3),
        _row("CUDA context", context, c_detail, 2),
        _row("NCCL", nccl, n_detail, 2),
        _row("unexplained (this process)", unexplained,
             "this process - reserved - context - NCCL", 2),
        _row("not attributed to any process", unattributed,
             "used - this process - other processes", 1),
    ]
    return GpuGap(r.device, r.name, r.total_bytes, r.used_bytes, process, others,
                  r.reserved_bytes, r.allocated_bytes, context, c_source, nccl, unexplained,
                  unattributed, rows, notes)


def _row(line: str, nbytes: int, source: str, depth: int) -> dict[str, Any]:
    return {"line": line, "bytes": nbytes, "source": source, "depth": depth}
