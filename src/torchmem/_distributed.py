"""Two hazards of ``torch.distributed`` that torchmem must not trigger (measured on torch 2.13).

- **A process group kept alive.** The first dispatch mode a process enters imports
  ``torch._dynamo``, which imports ``torch.distributed.nn.functional``, whose functions take
  ``group=group.WORLD`` as a default argument, evaluated at import. Imported while a process group
  exists, those defaults hold it for the rest of the process: ``destroy_process_group`` no longer
  destroys it, and gloo's worker threads outlive the interpreter. :func:`keep_defaults_groupless`,
  called before torchmem enters a dispatch mode (the tracker's entry, the fake group of per-rank
  estimates), imports that module first: with no group yet its defaults are ``None`` (the default
  group at call time); with one, it puts ``None`` back in the group's place.
- **A collective's tensors released on gloo's thread at exit.** A gloo collective's work is
  released by gloo's worker thread after the caller's ``wait()`` returned; releasing a tensor
  that Python no longer holds needs the GIL, and if the interpreter is shutting down by then the
  thread is killed inside a destructor: the rank aborts ("terminate called without an active
  exception"). In about a third of ``all_gather`` calls the work still holds the tensors when
  ``wait()`` returns (for under a millisecond); with the switch interval raised to 5 s to widen
  that window, ``all_gather_object`` right before exit aborted 2 and 6-7 of 20 two-rank runs.
  :func:`gather_dicts` gathers with tensors it holds until gloo has released them (their use
  count is back to one), so a rank may exit right after it: 0 of 20 in the same harness.

Example:
    >>> keep_defaults_groupless()        # no process group: imports the module, nothing else
    >>> import torch.distributed.nn.functional as F
    >>> F.all_reduce.__defaults__[-1] is None
    True
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import types
from typing import Any

import torch

__all__ = ["gather_dicts", "keep_defaults_groupless"]

_NN_FUNCTIONAL = "torch.distributed.nn.functional"
#: how long :func:`gather_dicts` waits for gloo to release its tensors (never forever)
_RELEASE_WAIT_S = 2.0


def keep_defaults_groupless() -> None:
    """Make sure ``torch.distributed.nn.functional`` holds no process group in its defaults.

    Call before entering a dispatch mode. Imports the module if no one has (cheap: about 3 ms);
    if a process group exists while importing it, each default that holds that group becomes
    ``None`` (the same group at call time, and no reference that outlives
    ``destroy_process_group``). A module someone else imported earlier is left as it is.

    Example:
        >>> keep_defaults_groupless(); keep_defaults_groupless()   # idempotent
        >>> import sys; "torch.distributed.nn.functional" in sys.modules
        True
    """
    dist = torch.distributed
    if _NN_FUNCTIONAL in sys.modules or not dist.is_available():
        return
    group = dist.group.WORLD if dist.is_initialized() else None
    module = importlib.import_module(_NN_FUNCTIONAL)
    if group is None:
        return
    for fn in vars(module).values():
        if isinstance(fn, types.FunctionType) and fn.__defaults__ and any(
            d is group for d in fn.__defaults__
        ):
            fn.__defaults__ = tuple(None if d is group else d for d in fn.__defaults__)


def _object_device() -> torch.device:
    """The device PyTorch's own object collectives use with the default group."""
    c10d = torch.distributed.distributed_c10d
    kind = getattr(c10d, "_get_object_coll_device", lambda: "cpu")()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def _all_gather_held(outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """``all_gather`` that returns once gloo's thread no longer holds the tensors (CPU only;
    at most :data:`_RELEASE_WAIT_S`), the GIL released meanwhile so that it can."""
    torch.distributed.all_gather(outs, mine)
    if mine.device.type != "cpu":
        return
    deadline = time.monotonic() + _RELEASE_WAIT_S
    tensors = [mine, *outs]
    while any(t._use_count() > 1 for t in tensors) and (  # type: ignore[attr-defined]
        time.monotonic() < deadline
    ):
        time.sleep(0.0005)


def gather_dicts(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``figures`` (a JSON-able dict), in rank order, over the default group.

    Like ``all_gather_object`` (ranks may send different keys and sizes), but safe to exit right
    after (see the module docstring). Without an initialised process group: ``[figures]``.

    Example:
        >>> gather_dicts({"memory/peak_bytes": 1024})     # one process, no process group
        [{'memory/peak_bytes': 1024}]
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [figures]
    device, world = _object_device(), dist.get_world_size()
    payload = json.dumps(figures).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _all_gather_held(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    _all_gather_held(outs, mine)
    return [json.loads(bytes(o[:n].cpu().tolist())) for o, n in zip(outs, lengths)]
