"""``torchmem ledger``: device usage now, or polled for a while; text table or JSON.

On CUDA devices a one-reading table is followed by one line per GPU splitting nvidia-smi's
figure (this process = PyTorch reserved + CUDA context + unexplained; other processes; not
attributed), ``"gpu_gap"`` in ``--json``; ``torchmem gpu`` shows every line with its source.

Examples::

    torchmem ledger                      # every available device, one reading
    torchmem ledger --json               # the same as JSON
    torchmem ledger --poll 5 --interval 0.5 --device cpu --json
                                         # 5 s of readings from the background poller
    torchmem ledger --pid 4242           # also what process 4242 holds on each device

``total`` and ``used`` are the whole device's (every process's). ``--pid PID`` adds a column
with that process's memory: its resident set size (RSS, psutil) on ``cpu``, its GPU memory as
NVML reports it on ``cuda:N`` (``-`` where NVML is missing or the process uses no memory there).
Without ``--pid`` there is no per-process column: the only process at hand would be this
command itself. In ``--json`` the readings then carry ``pid``, ``pid_bytes`` and ``pid_measure``
(``"rss"`` or ``"nvml"``).

Example:
    >>> import io, json, contextlib
    >>> from torchmem.cli import main
    >>> buf = io.StringIO()
    >>> with contextlib.redirect_stdout(buf):
    ...     code = main(["ledger", "--json", "--device", "cpu"])
    >>> code, json.loads(buf.getvalue())["readings"][0]["device"]
    (0, 'cpu')
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from torchmem.errors import DeviceError, InvalidInputError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``torchmem ledger``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["--poll", "2", "--json"]).poll
        2.0
    """
    parser.add_argument(
        "--device", action="append", default=None,
        help="device to show (cpu, cuda, cuda:1); repeatable; default: every available device",
    )
    parser.add_argument(
        "--poll", type=float, default=0.0, metavar="SECONDS",
        help="keep reading for SECONDS with the background poller (default: one reading)",
    )
    parser.add_argument(
        "--interval", type=float, default=0.5, metavar="SECONDS",
        help="seconds between readings when polling (default 0.5)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--pid", type=int, default=None,
        help="also show this process's memory on each device (RSS on cpu, NVML on cuda)",
    )


def _pid_figure(pid: int, device: str) -> tuple[int | None, str | None]:
    """``(bytes, what was measured)`` of process ``pid`` on ``device``; ``(None, ...)`` when
    the source cannot tell."""
    if device == "cpu":
        import psutil

        try:
            return int(psutil.Process(pid).memory_info().rss), "rss"
        except psutil.Error:
            return None, "rss"
    from torchmem.devices import _nvml, _nvml_handle

    nv = _nvml()
    if nv is None:
        return None, None
    try:
        h = _nvml_handle(nv, int(device.split(":")[1]))
        for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
            if int(p.pid) == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory), "nvml"
    except Exception:  # noqa: BLE001 - the driver cannot say: shown as unknown
        return None, "nvml"
    return None, "nvml"


def _check_pid(pid: int | None) -> None:
    if pid is None:
        return
    import psutil

    if not psutil.pid_exists(pid):
        raise InvalidInputError(
            f"--pid {pid}: no such process here; expected the id of a running process (see "
            "'ps' or os.getpid() in your script)"
        )


def _reading(u: Any, pid: int | None) -> dict[str, Any]:
    d = dict(u.as_dict())
    d.pop("process", None)  # this command's own memory: not what anyone asks about
    if pid is not None:
        d["pid"] = pid
        d["pid_bytes"], d["pid_measure"] = _pid_figure(pid, u.device)
    return d


def _devices(args: argparse.Namespace) -> list[str]:
    from torchmem._device import device_selector
    from torchmem.devices import available_devices, normalize_device

    present = available_devices()
    if not args.device:
        return present
    out: list[str] = []
    for d in args.device:
        if device_selector(d) == "cuda":  # every CUDA device
            cudas = [p for p in present if p.startswith("cuda:")]
            if not cudas:
                raise DeviceError(
                    f"no CUDA device on this machine; available: {', '.join(present)}"
                )
            out.extend(cudas)
            continue
        name = normalize_device(d)
        if name not in present:
            raise DeviceError(
                f"device {d!r} is not available here; available: {', '.join(present)}"
            )
        out.append(name)
    return list(dict.fromkeys(out))


def _table(rows: list[Any], pid: int | None = None) -> str:
    from torchmem.units import format_bytes

    extra = f" {'pid ' + str(pid):>12}" if pid is not None else ""
    head = f"{'device':<8} {'total':>12} {'used':>12} {'used %':>7}{extra} {'source':<10}"
    lines = [head]
    for u in rows:
        cell = ""
        if pid is not None:
            n, _ = _pid_figure(pid, u.device)
            cell = f" {format_bytes(n) if n is not None else '-':>12}"
        lines.append(
            f"{u.device:<8} {format_bytes(u.total):>12} {format_bytes(u.used):>12} "
            f"{u.used_pct:>6.1f}%{cell} {u.source:<10}"
        )
    return "\n".join(lines)


def _gaps(devices: list[str]) -> list[Any]:
    """:class:`~torchmem.analysis.GpuGap` of the CUDA devices among ``devices`` (none on CPU)."""
    cuda = [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]
    if not cuda:
        return []
    from torchmem.cli.gpu import gaps

    return [g for g, _ in gaps(cuda)]


def run(args: argparse.Namespace) -> int:
    """Print device usage; return 0.

    Example:
        >>> run(argparse.Namespace(device=["cpu"], poll=0.0, interval=0.5, json=False, pid=None))  # doctest: +ELLIPSIS
        device ...
        0
    """
    from torchmem.devices import UsagePoller, poll_usage

    if args.poll < 0 or args.interval <= 0:
        raise InvalidInputError(
            f"--poll must be >= 0 and --interval > 0 seconds, got --poll {args.poll} "
            f"--interval {args.interval}"
        )
    devices = _devices(args)
    pid = getattr(args, "pid", None)
    _check_pid(pid)
    if args.poll == 0:
        gap = _gaps(devices)  # first: it measures the CUDA context before anything starts CUDA
        rows = [poll_usage(d) for d in devices]
        if args.json:
            doc: dict[str, Any] = {"readings": [_reading(u, pid) for u in rows]}
            if gap:
                doc["gpu_gap"] = [g.to_dict() for g in gap]
            print(json.dumps(doc, indent=2))
        else:
            print(_table(rows, pid))
            for g in gap:  # the gap to nvidia-smi, one line per GPU (torchmem gpu: every line)
                print(g.summary())
        return 0

    tty = sys.stderr.isatty()
    readings: list[dict[str, Any]] = []
    end = time.monotonic() + args.poll
    with UsagePoller(interval=args.interval) as poller:
        n = 0
        last: dict[str, float] = {}
        while True:
            rows = []
            for d in devices:
                u = poller.usage(d)
                if u is not None and last.get(d) != u.time:  # only new readings
                    last[d] = u.time
                    rows.append(u)
            n += 1
            if args.json:
                readings.extend(_reading(u, pid) for u in rows)
            elif rows:
                print(_table(rows, pid) + "\n", flush=True)
            left = end - time.monotonic()
            if tty:
                print(f"\rtorchmem ledger: reading {n}, {max(left, 0):.1f}s left ", end="",
                      file=sys.stderr, flush=True)
            if left <= 0:
                break
            time.sleep(min(args.interval, left))
    if tty:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps({"interval": args.interval, "seconds": args.poll, "readings": readings},
                         indent=2))
    return 0
