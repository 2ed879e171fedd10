"""``estimate``: one fake run at a batch size, or a search for the largest batch that fits.

The search doubles the batch from 1 until a run does not fit, then bisects between the last
batch that fit and the first that did not. Every probe is a fresh fake run (a new simulated
allocator, new fake tensors), so nothing carries over between probes.

Example:
    >>> import torch
    >>> def build(batch):
    ...     x = torch.zeros(batch, 1 << 18)           # 1 MiB per row
    ...     return lambda: x * 2
    >>> e = estimate(build, gpu="2 GiB", max_batch_size=True, steps=1)
    >>> e.max_batch_size, e.fits, e.batch_size == e.max_batch_size
    (758, True, True)
"""

from __future__ import annotations

from collections.abc import Callable

from torchmem.errors import InvalidInputError
from torchmem.fit._catalog import GPU
from torchmem.fit._catalog import gpu as _gpu
from torchmem.fit._engine import BuildFn, run_once
from torchmem.fit._estimate import Estimate

__all__ = ["estimate"]

#: The search stops doubling here (a build that ignores its batch size would never stop).
MAX_SEARCH_BATCH = 1 << 24


def estimate(
    build: BuildFn,
    gpu: str | int | GPU = "H100-80GB",
    batch_size: int | None = None,
    *,
    max_batch_size: bool = False,
    steps: int = 2,
    alloc_conf: str | None = None,
    progress: Callable[[str], None] | None = None,
    keep_snapshot: bool = False,
) -> Estimate:
    """Will ``build``'s training step fit on ``gpu``? Estimated without the GPU, exactly.

    ``build(batch_size)`` builds the model, optimizer and data and returns a zero-argument
    ``step()`` that runs one iteration. torchmem calls it under fake tensors (no memory is
    allocated) with CUDA redirected to the fake device, so code written for ``"cuda"`` runs
    unchanged, then runs ``step()`` ``steps`` times (default 2: the second step sees the
    optimizer state and the cached blocks) through a simulation of PyTorch's CUDA caching
    allocator with the GPU's usable memory (``alloc_conf``: a ``PYTORCH_CUDA_ALLOC_CONF``
    string). ``gpu`` is a catalog name (:data:`torchmem.fit.GPUS`) or a size (``"23.5 GiB"``).

    ``batch_size=None`` means 1. ``max_batch_size=True`` searches for the largest batch that
    fits (doubling, then bisection; ``progress(message)`` is told each probe) and returns that
    batch's estimate with ``max_batch_size`` set (0 when even batch 1 does not fit: then the
    estimate is batch 1's, with its out-of-memory point).

    ``keep_snapshot=True`` keeps the simulated run as a PyTorch-format
    :class:`~torchmem.model.Snapshot` in ``Estimate.snapshot`` (the state at the end of the
    last step, or at the out-of-memory point, with every allocator event and each
    allocation's operator and Python stack), for :func:`torchmem.write_snapshot` and the
    viewer.

    Bad input raises :class:`~torchmem.errors.InvalidInputError`: a build that raises or
    returns no callable, or code that needs tensor values fake tensors do not have (``.item()``,
    ``.numpy()``, data-dependent shapes); the message names the file and line.

    Example:
        >>> import torch
        >>> def build(batch):
        ...     net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        ...     x = torch.randn(batch, 64, device="cuda")   # "cuda" is fine: it is faked
        ...     return lambda: net.to("cuda")(x).sum().backward()
        >>> e = estimate(build, gpu="RTX-4090", batch_size=16)
        >>> e.fits, e.oom, e.peak_reserved_bytes >> 20
        (True, None, 22)
    """
    card = _gpu(gpu)
    if batch_size is not None and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
    ):
        raise InvalidInputError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    if max_batch_size and batch_size is not None:
        raise InvalidInputError(
            "give either batch_size or max_batch_size=True, not both; fix: drop batch_size to "
            "search for the largest batch that fits"
        )
    if not max_batch_size:
        return run_once(build, batch_size or 1, card, steps=steps, alloc_conf=alloc_conf,
                        keep_snapshot=keep_snapshot)

    say = progress or (lambda msg: None)
    probes: list[tuple[int, bool]] = []
    cache: dict[int, Estimate] = {}

    def probe(b: int) -> Estimate:
        e = run_once(build, b, card, steps=steps, alloc_conf=alloc_conf)
        probes.append((b, e.fits))
        cache[b] = e
        if e.fits or e.oom is None:
            say(f"batch {b}: fits (peak reserved {e.peak_reserved_bytes:,} B of "
                f"{e.usable_bytes:,} B usable)")
        else:
            where = e.oom.op or "?"
            if e.oom.module:
                where += f" in {e.oom.module}"
            say(f"batch {b}: does not fit (out of memory at {where}, {e.oom.phase}: "
                f"{e.oom.requested_bytes:,} B requested with {e.oom.reserved_bytes:,} B "
                "reserved)")
        return e

    good, bad = 0, 0
    b = 1
    while True:
        if probe(b).fits:
            good = b
            if b >= MAX_SEARCH_BATCH:
                break
            b *= 2
        else:
            bad = b
            break
    notes = []
    if bad == 0:
        notes.append(f"stopped searching at batch {good}: does build use its batch_size?")
    else:
        while bad - good > 1:
            mid = (good + bad) // 2
            if probe(mid).fits:
                good = mid
            else:
                bad = mid
    if good == 0:
        best = cache[1]
    elif keep_snapshot:
        best = run_once(build, good, card, steps=steps, alloc_conf=alloc_conf, keep_snapshot=True)
    else:
        best = cache[good]
    best.searched = True
    best.max_batch_size = good
    best.probes = probes
    best.notes.extend(notes)
    return best
