"""``torchmem gpu``: the gap between nvidia-smi and PyTorch, per GPU, each line with its source.

Per visible CUDA device: NVML's total and used (what nvidia-smi shows), the other processes on
the device, this process's NVML usage split into PyTorch's reserved (allocated and cached), the
CUDA context, NCCL and the unexplained rest, and the bytes no listed process holds (see
:mod:`torchmem.analysis._gpu_gap` for each line's source). The command starts CUDA itself, so it
measures the CUDA context on this machine (this process's NVML usage right after CUDA started;
the documented per-generation estimate where NVML cannot say). Its own PyTorch usage is zero:
your program's usage appears under "other processes"; inside your program call
``torchmem.devices.measure_cuda_context()`` first, then
``torchmem.analysis.gpu_gap(GpuReading.from_dict(torchmem.devices.read_gpu(0)))``.

On a machine without a CUDA GPU it exits 2 with the reason (there is nothing to compare with
nvidia-smi). ``--json`` prints ``{"devices": [{..., "rows": [{"line", "bytes", "source",
"depth"}], "reading": {...}}]}``.

Example:
    >>> from torchmem.cli import main
    >>> main(["gpu"])  # doctest: +SKIP
    cuda:0 (NVIDIA H100 80GB HBM3)
    ...
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchmem.cli._snapshot_common import emit_json

__all__ = ["add_arguments", "run", "gaps"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``torchmem gpu``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["--json", "--device", "1"]).device
        1
    """
    parser.add_argument("--device", type=int, default=None,
                        help="only this CUDA device index (default: every visible one)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def gaps(devices: list[int] | None = None, *, measure: bool = True) -> list[tuple[Any, dict[str, Any]]]:
    """``(GpuGap, reading dict)`` per CUDA device (default: all); raises
    :class:`~torchmem.errors.DeviceError` without a GPU. ``measure`` starts CUDA on each device
    first to measure its context (only possible before this process used it).

    Example:
        >>> from torchmem.errors import DeviceError
        >>> try:
        ...     found = gaps()
        ... except DeviceError as e:      # no GPU here: the message says why
        ...     found = []
        >>> all(g.reserved_bytes + g.context_bytes + g.nccl_bytes + g.unexplained_bytes
        ...     == g.process_bytes for g, _ in found)
        True
    """
    from torchmem.analysis._gpu_gap import GpuReading, gpu_gap
    from torchmem.devices import measure_cuda_context, read_gpu
    from torchmem.errors import DeviceError
    from torchmem.fit.verdict._catalog import CONTEXT_BYTES

    cuda = _cuda()
    if not cuda.is_available():
        raise DeviceError(
            "no CUDA GPU is visible here (torch.cuda.is_available() is False: a CPU-only build "
            "of torch, no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them), so there is "
            "nothing to compare with nvidia-smi"
        )
    count = int(cuda.device_count())
    wanted = list(range(count)) if devices is None else devices
    bad = [d for d in wanted if not 0 <= d < count]
    if bad:
        raise DeviceError(f"no CUDA device {bad[0]}: this machine has {count} (0 to {count - 1})")
    out = []
    for d in wanted:
        if measure:
            measure_cuda_context(d, cuda=cuda)
        reading = read_gpu(d, context_estimates=CONTEXT_BYTES, cuda=cuda)
        out.append((gpu_gap(GpuReading.from_dict(reading)), reading))
    return out


def _cuda() -> Any:
    """``torch.cuda`` (a test replaces it with recorded readings)."""
    import torch

    return torch.cuda


def run(args: argparse.Namespace) -> int:
    """Print the split per GPU (text or ``--json``); exit 0, or 2 without a GPU.

    Example:
        >>> import contextlib, io, json
        >>> from torchmem.errors import DeviceError
        >>> out = io.StringIO()
        >>> try:
        ...     with contextlib.redirect_stdout(out):
        ...         code = run(argparse.Namespace(device=None, json=True))
        ... except DeviceError:          # no GPU here
        ...     code = 2
        >>> code == 2 or "devices" in json.loads(out.getvalue())
        True
    """
    if sys.stderr.isatty():
        print("starting CUDA to measure its context ...", file=sys.stderr, flush=True)
    found = gaps(None if args.device is None else [args.device])
    note = ("this process is torchmem's own: its PyTorch usage is 0 and its NVML usage is its "
            "CUDA context; your program is among the other processes")
    if args.json:
        emit_json({"note": note, "devices": [{**g.to_dict(), "reading": r} for g, r in found]})
        return 0
    for g, _ in found:
        sys.stdout.write(g.text())
    sys.stdout.write(f"note: {note}\n")
    return 0
