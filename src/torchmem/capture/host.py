"""Host memory beyond tensors: RSS, USS and PSS of the whole process tree, over time.

A tensor tracker never sees the memory that kills many jobs: DataLoader workers whose private
memory grows while they iterate a dataset of Python objects. Every object a worker touches gets
its reference count written, so the forked page that holds it stops being shared and is copied
into the worker ("copy on read"); a dataset held as one NumPy array or tensor has no per-item
objects and stays shared. :func:`host_memory` reads the process tree once;
:class:`HostSampler` samples it in a background thread and summarises it per process.

- ``rss``: resident memory (shared pages counted in every process that maps them).
- ``uss``: memory private to the process (what it would give back on exit).
- ``pss``: ``uss`` plus each shared page divided among the processes sharing it (sums to the
  real total across a process tree).

Roles: the process sampled is ``"main"``; a descendant running the same Python executable
(a forked or spawned DataLoader or multiprocessing worker) is ``"worker"``; any other
descendant is ``"other"``.

Copy-on-read is suspected when a worker's USS grew by at least :data:`COPY_ON_READ_MIN_GROWTH`
(128 MiB) over its life, rising in at least 3 samples (growth while iterating, not a one-off
allocation at start).

Example:
    >>> from torchmem.capture.host import host_memory
    >>> procs = host_memory()
    >>> procs[0].role, procs[0].rss > 0, procs[0].uss > 0
    ('main', True, True)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import psutil

from torchmem.errors import InvalidInputError
from torchmem.units import MiB, format_bytes

__all__ = [
    "COPY_ON_READ_MIN_GROWTH",
    "HostSampler",
    "HostSummary",
    "ProcessMemory",
    "ProcessSummary",
    "host_memory",
]

#: A worker whose USS grows by this much while rising steadily is a copy-on-read suspect.
COPY_ON_READ_MIN_GROWTH = 128 * MiB


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory at one moment (bytes); ``pss`` is ``None`` where the OS has none.

    Example:
        >>> ProcessMemory(pid=1, role="main", name="python", rss=10, uss=8, pss=9).role
        'main'
    """

    pid: int
    role: str
    name: str
    rss: int
    uss: int
    pss: Optional[int]


def _role(proc: psutil.Process, root: psutil.Process, root_exe: str) -> str:
    if proc.pid == root.pid:
        return "main"
    try:
        return "worker" if proc.exe() == root_exe else "other"
    except (psutil.Error, OSError):
        return "other"


def _read(proc: psutil.Process, role: str) -> Optional[ProcessMemory]:
    try:
        info = proc.memory_full_info()
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        try:
            rss = int(proc.memory_info().rss)
        except psutil.Error:
            return None
        return ProcessMemory(proc.pid, role, "?", rss, rss, None)
    if not info.rss:  # exiting: its memory is already gone (and its executable unreadable)
        return None
    pss = getattr(info, "pss", None)
    return ProcessMemory(proc.pid, role, name, int(info.rss), int(getattr(info, "uss", info.rss)),
                         None if pss is None else int(pss))


def host_memory(pid: Optional[int] = None, *, children: bool = True) -> list[ProcessMemory]:
    """RSS, USS and PSS of a process (default: this one) and, with ``children``, every process
    below it; the process itself comes first.

    Example:
        >>> import os
        >>> [p.pid == os.getpid() for p in host_memory(children=False)]
        [True]
        >>> host_memory(-5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: host_memory expects the id of a running process...
    """
    try:
        root = psutil.Process(os.getpid() if pid is None else pid)
        root_exe = root.exe()
    except (psutil.Error, ValueError) as e:
        raise InvalidInputError(
            f"host_memory expects the id of a running process, got {pid!r} ({e}); pass None "
            "for this process or a pid from psutil.pids()"
        ) from None
    procs = [root]
    if children:
        try:
            procs += root.children(recursive=True)
        except psutil.Error:
            pass
    out = []
    for p in procs:
        m = _read(p, _role(p, root, root_exe))
        if m is not None:
            out.append(m)
    return out


@dataclass(frozen=True)
class ProcessSummary:
    """One process over a sampling run: peaks and the growth of its private memory (bytes).

    ``uss_growth`` is the peak USS minus the first USS sampled; ``rises`` counts the samples in
    which the USS went up by more than 1 MiB.

    Example:
        >>> s = ProcessSummary(7, "worker", "python", 300, 200, 150, 120, 5, 1.0, 2.0)
        >>> s.to_dict()["uss_growth_bytes"]
        120
    """

    pid: int
    role: str
    name: str
    rss_peak: int
    uss_peak: int
    pss_peak: Optional[int]
    uss_growth: int
    rises: int
    first_seen: float
    last_seen: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``torchmem run --json`` prints under ``"host"``.

        Example:
            >>> sorted(ProcessSummary(1, "main", "p", 3, 2, None, 0, 0, 0, 0).to_dict())
            ['pid', 'pss_peak_bytes', 'role', 'rss_peak_bytes', 'uss_growth_bytes', 'uss_peak_bytes']
        """
        return {
            "pid": self.pid,
            "role": self.role,
            "rss_peak_bytes": self.rss_peak,
            "uss_peak_bytes": self.uss_peak,
            "pss_peak_bytes": self.pss_peak,
            "uss_growth_bytes": self.uss_growth,
        }


@dataclass(frozen=True)
class HostSummary:
    """The process tree over a sampling run, and whether copy-on-read is suspected.

    Example:
        >>> w = ProcessSummary(8, "worker", "python", 900 << 20, 300 << 20, None, 270 << 20, 9, 0, 5)
        >>> HostSummary([w], samples=10).copy_on_read_suspect
        True
        >>> print(HostSummary([w], samples=10).text())  # doctest: +NORMALIZE_WHITESPACE
        Host memory by process (10 samples)
        pid  role    RSS peak    USS peak    USS growth
        8    worker  900.00 MiB  300.00 MiB  +270.00 MiB
        copy-on-read suspected: DataLoader workers' private memory grew while iterating (a dataset of Python objects?). Keep the data in one NumPy array or tensor, or read it from disk per item.
    """

    processes: list[ProcessSummary]
    samples: int
    suspects: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.suspects:
            self.suspects.extend(
                p.pid for p in self.processes
                if p.role == "worker" and p.uss_growth >= COPY_ON_READ_MIN_GROWTH and p.rises >= 3
            )

    @property
    def copy_on_read_suspect(self) -> bool:
        """Whether some worker's private memory grew steadily by 128 MiB or more.

        Example:
            >>> HostSummary([], samples=0).copy_on_read_suspect
            False
        """
        return bool(self.suspects)

    def to_dict(self) -> dict[str, Any]:
        """``{"processes": [...], "copy_on_read_suspect": bool, "samples": n}``.

        Example:
            >>> HostSummary([], samples=2).to_dict()
            {'processes': [], 'copy_on_read_suspect': False, 'samples': 2}
        """
        return {
            "processes": [p.to_dict() for p in self.processes],
            "copy_on_read_suspect": self.copy_on_read_suspect,
            "samples": self.samples,
        }

    def text(self) -> str:
        """A plain table: one row per process, then the copy-on-read warning if any.

        Example:
            >>> HostSummary([], samples=0).text()
            'Host memory by process (0 samples)\\nno process sampled'
        """
        lines = [f"Host memory by process ({self.samples} samples)"]
        if not self.processes:
            return lines[0] + "\nno process sampled"
        rows = [("pid", "role", "RSS peak", "USS peak", "USS growth")]
        for p in self.processes:
            rows.append((str(p.pid), p.role, format_bytes(p.rss_peak), format_bytes(p.uss_peak),
                         "+" + format_bytes(p.uss_growth)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if self.copy_on_read_suspect:
            lines.append(
                "copy-on-read suspected: DataLoader workers' private memory grew while iterating "
                "(a dataset of Python objects?). Keep the data in one NumPy array or tensor, or "
                "read it from disk per item."
            )
        return "\n".join(lines)


class HostSampler:
    """Samples :func:`host_memory` of a process tree every ``interval`` seconds in a thread.

    Use it as a context manager (or ``start()``/``stop()``); ``summary()`` gives the peaks and
    growth per process.

    Example:
        >>> import time
        >>> with HostSampler(interval=0.05) as s:
        ...     time.sleep(0.2)
        >>> summary = s.summary()
        >>> summary.samples >= 2, summary.processes[0].role
        (True, 'main')
    """

    def __init__(self, interval: float = 0.2, pid: Optional[int] = None) -> None:
        if not isinstance(interval, (int, float)) or interval <= 0:
            raise InvalidInputError(
                f"HostSampler interval must be a number of seconds > 0, got {interval!r}"
            )
        self.interval = float(interval)
        self.pid = os.getpid() if pid is None else pid
        self._series: dict[int, list[tuple[float, ProcessMemory]]] = {}
        self._samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def sample(self) -> list[ProcessMemory]:
        """Take one sample now (the thread calls this); returns it.

        Example:
            >>> HostSampler().sample()[0].role
            'main'
        """
        now = time.monotonic()
        procs = host_memory(self.pid)
        with self._lock:
            self._samples += 1
            for m in procs:
                self._series.setdefault(m.pid, []).append((now, m))
        return procs

    def latest(self, all_seen: bool = False) -> list[tuple[ProcessMemory, int]]:
        """The processes of the latest sample (with ``all_seen``, every process ever sampled,
        as last seen), each with its USS growth since it was first sampled; main first, then
        by pid.

        Example:
            >>> s = HostSampler(); _ = s.sample()
            >>> [(m.role, growth >= 0) for m, growth in s.latest()][:1]
            [('main', True)]
        """
        with self._lock:
            last = {pid: (pts[-1], pts[0][1]) for pid, pts in self._series.items()}
            newest = max((t for (t, _), _ in last.values()), default=None)
        # the role a process had when first seen (a process's role is read from its executable,
        # which an exiting process no longer shows), as summary() keeps it
        rows = [(dataclasses.replace(m, role=first.role), m.uss - first.uss)
                for (t, m), first in last.values() if all_seen or t == newest]
        rows.sort(key=lambda r: (r[0].role != "main", r[0].pid))
        return rows

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a vanished process tree must not kill the run
                pass

    def start(self) -> HostSampler:
        """Start sampling in a daemon thread.

        Example:
            >>> s = HostSampler(interval=0.05).start(); s.stop().summary().samples >= 1
            True
        """
        if self._thread is None:
            self.sample()  # the baseline, before the caller goes on
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="torchmem-host", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> HostSampler:
        """Stop the thread after one last sample.

        Example:
            >>> HostSampler().stop().summary().samples
            1
        """
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        try:
            self.sample()
        except Exception:  # noqa: BLE001
            pass
        return self

    def __enter__(self) -> HostSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self) -> HostSummary:
        """Per process: peaks, USS growth; main first, then by pid.

        Example:
            >>> s = HostSampler(); _ = s.sample(); _ = s.sample()
            >>> s.summary().processes[0].uss_growth >= 0
            True
        """
        out = []
        with self._lock:
            series = {pid: list(v) for pid, v in self._series.items()}
            samples = self._samples
        for pid, points in series.items():
            mems = [m for _, m in points]
            uss = [m.uss for m in mems]
            psss = [m.pss for m in mems if m.pss is not None]
            rises = sum(1 for a, b in zip(uss, uss[1:]) if b - a > MiB)
            out.append(ProcessSummary(
                pid=pid, role=mems[0].role, name=mems[0].name,
                rss_peak=max(m.rss for m in mems), uss_peak=max(uss),
                pss_peak=max(psss) if psss else None, uss_growth=max(uss) - uss[0], rises=rises,
                first_seen=points[0][0], last_seen=points[-1][0],
            ))
        out.sort(key=lambda p: (p.role != "main", p.pid))
        return HostSummary(out, samples=samples)
