"""Independent ground truth for the trainer callbacks' step figures (shared by their tests).

- :func:`outside`: the bytes of every live tensor that a tracker started with ``model`` does not
  count (a census of all live tensors minus the model's parameters).
- :class:`DDPBuckets`: DDP's gradient buckets, alive before training but found by a census only
  once a dispatch mode has wrapped them (subtracted from later censuses).
- :class:`StepProfile`: PyTorch's profiler over one step; ``rise()`` sums every allocation and
  free the CPU allocator reported, in time order, and returns the highest point above the start.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from torchmem.capture import inspect_memory


def census() -> int:
    """Bytes of every live CPU tensor's storage, each storage once."""
    return int(inspect_memory(all_live=True).unique_bytes["cpu"])


def outside(model: torch.nn.Module) -> int:
    """Bytes alive now that the callback's tracker does not count: all but the parameters."""
    gc.collect()
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return census() - params


class DDPBuckets:
    """DDP's gradient buckets, which a census finds late.

    DDP's C++ reducer makes its buckets in its constructor, where no Python object wraps them,
    so a census at train start misses them; a dispatch mode (the tracker's) wraps them at their
    first ``all_reduce``, and from then on the garbage collector finds them. They were alive at
    train start all along, so a census must not count them as new. Made before training starts
    (``find_unused_parameters=True``: never rebuilt), they are recognised by their sizes, from
    DDP's own logging data (``bucket_sizes``); measured with the profiler: no allocation of
    that size at that address happens during the steps.
    """

    def __init__(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.sizes: set[int] = set()
        for o in gc.get_objects():
            if issubclass(type(o), DDP):
                data = o._get_ddp_logging_data()
                self.sizes |= {int(b) for b in str(data["bucket_sizes"]).split(",") if b}
        assert self.sizes, "no DistributedDataParallel module alive"
        assert not self._found(), "a bucket is visible at train start: nothing to correct"

    def _found(self) -> dict[int, int]:
        """The bucket-sized CPU storages the garbage collector finds now: pointer -> bytes."""
        return {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                for o in gc.get_objects()
                if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu"
                and o.untyped_storage().nbytes() in self.sizes}

    def seen_late(self) -> int:
        """Bytes of the buckets a census finds now (none was found at train start)."""
        return sum(self._found().values())


class StepProfile:
    """The profiler's memory events over one step."""

    def __init__(self) -> None:
        self.prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self.prof.__enter__()

    def rise(self) -> int:
        """Stop; the highest point of the summed allocations above the step's start."""
        from torch._C._profiler import _EventType

        self.prof.__exit__(None, None, None)
        rows = []
        stack: list[Any] = list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                rows.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
            stack.extend(e.children)
        rows.sort()
        cur = best = 0
        for _, size in rows:
            cur += size
            best = max(best, cur)
        return best


#: (part of the step that fails, kind of error) for the callbacks' out-of-memory tests.
OOM_CASES = [
    ("forward", "torch"),
    ("backward", "cpu-allocator"),
    ("clip", "torch"),
    ("optimizer", "torch"),
    ("optimizer", "cpu-allocator"),
]


def raise_oom(kind: str) -> None:
    """Raise a real PyTorch out-of-memory error: ``"torch"`` constructs ``torch.OutOfMemoryError``
    (what CUDA raises); ``"cpu-allocator"`` asks PyTorch's CPU allocator for 1 PiB, which fails
    with its ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``."""
    if kind == "torch":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (in a test)")
    torch.empty(1 << 50, dtype=torch.uint8)
    raise AssertionError("the CPU allocator gave 1 PiB")


class FailingAdam(torch.optim.Adam):
    """Adam whose ``fail_at``-th ``step`` call (1-based) raises :func:`raise_oom` of ``kind``."""

    def __init__(self, params: Any, fail_at: int, kind: str) -> None:
        super().__init__(params, lr=1e-3)
        self.calls, self.fail_at, self.kind = 0, fail_at, kind

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.calls += 1
        if self.calls == self.fail_at:
            if closure is not None:
                closure()   # Lightning runs the forward and backward inside the closure
            raise_oom(self.kind)
        return super().step(closure)


def fail_in_backward(out: torch.Tensor, kind: str) -> torch.Tensor:
    """``out`` with a gradient hook that raises :func:`raise_oom` of ``kind`` in backward."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        raise_oom(kind)
        return grad

    out.register_hook(hook)
    return out
