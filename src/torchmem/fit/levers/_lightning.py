"""The levers Lightning applies itself: its ``Trainer`` and ``Fabric`` made while a lever is on
get the lever as their own option, as a user would write it.

- **Accumulation** (``Trainer`` only; Fabric accumulates in the user's loop): its
  ``accumulate_grad_batches`` multiplied by the lever's ``k`` (it calls the optimizer's step
  every that many batches).
- **Mixed precision**: a full-precision ``Trainer`` or ``Fabric`` gets ``precision="16-mixed"``
  or ``"bf16-mixed"`` (its autocast and, for float16, its ``GradScaler``), instead of
  torchmem's autocast and scaler.
- **Sharding**: on one device with no strategy of its own, ``fsdp_N`` gives it
  ``strategy="fsdp", devices=N`` (Lightning's ``FSDPStrategy``, FSDP1; the lever runs as rank 0
  of N) and ``cpu_offload`` ``strategy=FSDPStrategy(cpu_offload=True), devices=1``.

Only where Lightning is imported (a forked lever worker has imported what the step as written
imported).

Example:
    >>> from types import SimpleNamespace
    >>> undo = patch_lightning(SimpleNamespace(fsdp=False, autocast=None, accumulate=1))
    >>> for u in undo:
    ...     u()                                   # every Trainer and Fabric as it was
    >>> "32-true" in FULL_PRECISION
    True
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["patch_lightning", "FULL_PRECISION"]

#: Lightning's ``precision`` values of a full-precision run (None: not given, its default)
FULL_PRECISION = (None, 32, "32", "32-true")

_CLASSES = (("lightning.pytorch", "Trainer"), ("pytorch_lightning", "Trainer"),
            ("lightning.fabric", "Fabric"), ("lightning_fabric", "Fabric"))


def patch_lightning(lever: Any) -> list[Callable[[], None]]:
    """Patch the ``__init__`` of every imported Lightning ``Trainer`` and ``Fabric`` so that
    one made while ``lever`` (a :class:`~torchmem.fit.levers._levers.LeverRun`) is on gets the
    lever as its own option (see the module's documentation); the undo callables."""
    undo: list[Callable[[], None]] = []
    for name, cls in _CLASSES:
        owner = getattr(sys.modules.get(name), cls, None)
        if not isinstance(owner, type) or "__init__" not in vars(owner):
            continue
        orig = vars(owner)["__init__"]
        who = "Lightning" if cls == "Trainer" else "Lightning Fabric"

        def init(tr: Any, *args: Any, __orig: Any = orig, __who: str = who,
                 __fabric: bool = cls == "Fabric", __name: str = name, **kwargs: Any) -> None:
            if lever.autocast is not None and kwargs.get("precision") in FULL_PRECISION:
                # Lightning's own mixed precision: its autocast and (float16) GradScaler,
                # which calls the optimizer's step with Lightning's closure
                want = "16-mixed" if lever.autocast == torch.float16 else "bf16-mixed"
                kwargs["precision"] = want
                lever._user_scales = True  # the lever's scaler stays out
                lever.trainer_precision = f"by {__who}: precision={want!r}"
            if lever.fsdp and not lever.trainer_shards:
                _shards(lever, kwargs, __who, __name)
            # (Fabric has no accumulation of its own: the user's loop does it)
            if not __fabric and lever.accumulate > 1 and not lever.accumulated_by:
                k = kwargs.get("accumulate_grad_batches", 1)
                kwargs["accumulate_grad_batches"] = int(k) * lever.accumulate
                lever.trainer_accumulates = True
                lever.accumulated_by = (f"by Lightning: accumulate_grad_batches={k} -> "
                                        f"{kwargs['accumulate_grad_batches']}")
            __orig(tr, *args, **kwargs)

        functools.update_wrapper(init, orig)
        setattr(owner, "__init__", init)  # noqa: B010
        undo.append(lambda t=owner, o=orig: setattr(t, "__init__", o))  # type: ignore[misc]
    return undo


def _shards(lever: Any, kwargs: dict[str, Any], who: str, package: str) -> None:
    """Lightning's own sharding for ``fsdp_N`` and ``cpu_offload``: only where it runs on one
    device with no strategy chosen (the lever's world is the fake group's N ranks;
    ``cpu_offload``'s is one rank, with ``FSDPStrategy(cpu_offload=True)`` from ``package``'s
    strategies)."""
    import torch.distributed as dist

    n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    offload = lever.fsdp == "offload"
    if (n < 2 and not offload) or kwargs.get("strategy", "auto") != "auto":
        return
    if kwargs.get("devices", "auto") not in ("auto", 1, "1", [0]):
        return
    if offload:
        strategies = importlib.import_module(f"{package}.strategies")
        kwargs["strategy"] = strategies.FSDPStrategy(cpu_offload=True)
        said = "FSDPStrategy(cpu_offload=True)"
    else:
        kwargs["strategy"], said = "fsdp", "'fsdp'"
    kwargs["devices"] = n
    lever.trainer_shards = f"by {who}: strategy={said}, devices={n}"
