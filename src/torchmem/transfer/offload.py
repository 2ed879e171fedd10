"""Layer-by-layer offloaded inference: run a model larger than the device, two layers at a time.

:func:`offload_forward` keeps the layers where they are (usually host memory) and, for each
layer, copies its weights to the device, runs it with those copies
(``torch.func.functional_call``, so the modules are never modified) and drops them. The weights of
layer ``i + 1`` are fetched *while* layer ``i`` computes: on accelerators the copy runs on the
transfer stream and the compute on the compute stream, joined by events, with the fetched weights
``record_stream``-ed so their memory is reused only after the layer ran. So at most two layers'
weights are resident on the device, and host-to-device copies of pageable weights go through one
reusable pair of (pinned) staging buffers: at most two chunks of staging memory.

On a CPU-only machine the same loop runs with synchronous copies, the fetch of layer ``i + 1``
on a worker thread while layer ``i`` computes (``device="cpu"`` copies the weights;
``device="meta"`` is a shape-only dry run that measures what the device would hold). With
``overlap=False`` the order is fixed (fetch ``i + 1`` after layer ``i`` ran, before it is
dropped), so the resident peak is exactly the largest pair of neighbouring layers; with overlap it
is at most that (a fast layer may be dropped before the next fetch allocates).

Example:
    >>> import torch
    >>> layers = [torch.nn.Linear(8, 8) for _ in range(3)]       # 288 bytes of weights each
    >>> x = torch.randn(2, 8)
    >>> r = offload_forward(layers, x, "cpu", chunk_bytes=128, overlap=False)
    >>> ref = layers[2](layers[1](layers[0](x)))
    >>> torch.equal(r.output, ref), r.layer_bytes, r.peak_resident_bytes, r.peak_staging_bytes
    (True, (288, 288, 288), 576, 256)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from torchmem.errors import InvalidInputError
from torchmem.transfer.engine import transfer
from torchmem.transfer.pipeline import move_storages
from torchmem.transfer.staging import DEFAULT_CHUNK_BYTES, StagingBuffers, _chunk_size, _LiveBytes
from torchmem.transfer.streams import DeviceLike, DeviceSpec, use_stream
from torchmem.units import format_bytes

__all__ = ["OffloadResult", "offload_forward"]


@dataclass(eq=False)
class OffloadResult:
    """What :func:`offload_forward` did, with measured byte counts.

    ``layer_bytes`` are the weight bytes copied per layer; ``peak_resident_bytes`` the highest
    bytes of fetched weights alive on the device at once (measured from their storages);
    ``peak_staging_bytes`` the highest staging memory alive. ``shape_only`` for ``meta``.

    Example:
        >>> import torch
        >>> r = offload_forward([torch.nn.Linear(2, 2)], torch.ones(1, 2), "meta")
        >>> r.layers, r.bytes_moved, r.shape_only
        (1, 24, True)
    """

    output: Any
    device: str
    layers: int
    layer_bytes: tuple[int, ...]
    chunks: int
    peak_resident_bytes: int
    peak_staging_bytes: int
    staging_buffers_created: int
    shape_only: bool = False
    seconds: float = 0.0

    @property
    def bytes_moved(self) -> int:
        """Total weight bytes copied to the device.

        Example:
            >>> OffloadResult(None, "cpu", 2, (10, 20), 2, 30, 0, 0).bytes_moved
            30
        """
        return sum(self.layer_bytes)

    def __repr__(self) -> str:
        return (
            f"OffloadResult({self.layers} layers -> {self.device}: moved "
            f"{format_bytes(self.bytes_moved)} in {self.chunks} chunk(s), peak resident "
            f"{format_bytes(self.peak_resident_bytes)}, peak staging "
            f"{format_bytes(self.peak_staging_bytes)}{', shape-only' if self.shape_only else ''})"
        )


def _layer_tensors(layer: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, p in layer.named_parameters(remove_duplicate=False):
        names.append(name)
        tensors.append(p.detach())
    for name, b in layer.named_buffers(remove_duplicate=False):
        names.append(name)
        tensors.append(b)
    return names, tensors


def _run_threaded(
    mods: list[nn.Module], y: Any, fetch: Callable[[int], dict[str, torch.Tensor]], ledger: Any
) -> Any:
    """CPU and meta: fetch layer ``i + 1`` on a worker thread while layer ``i`` computes."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchmem-prefetch") as pool:
        pending: Optional[Future[dict[str, torch.Tensor]]] = pool.submit(fetch, 0)
        for i, layer in enumerate(mods):
            assert pending is not None
            current = pending.result()
            # layer i is resident; fetching i + 1 now keeps at most two layers on the device
            pending = pool.submit(fetch, i + 1) if i + 1 < len(mods) else None
            y = torch.func.functional_call(layer, current, (y,))
            _retire(current, None, ledger)
            current = {}  # drop this layer before the next fetch is submitted
    return y


def _retire(weights: dict[str, torch.Tensor], compute: Any, ledger: Any) -> None:
    """Hand a layer's fetched weights back (a function, so no loop variable keeps one alive).

    Several names can view one storage (tied weights, a buffer viewing a parameter): the ledger
    is told once per storage, as ``fetch`` told it once per storage about the allocation."""
    freed: set[int] = set()
    for t in weights.values():
        if compute is not None:
            t.record_stream(compute)  # the allocator reuses it only after this layer's kernels ran
        if ledger is not None:
            key = int(t.untyped_storage()._cdata)  # weights holds the tensors: keys stay unique
            if key not in freed:
                freed.add(key)
                ledger.free(t)


def offload_forward(
    layers: Iterable[nn.Module],
    x: Any,
    device: DeviceLike,
    *,
    chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
    staging: Optional[StagingBuffers] = None,
    ledger: Any = None,
    overlap: bool = True,
) -> OffloadResult:
    """Run ``layers`` in sequence on ``device`` with weights fetched layer by layer (inference).

    ``layers`` is an ``nn.Sequential``, ``nn.ModuleList`` or any iterable of modules, each called
    with the previous output. ``x`` is moved to ``device`` first. Weights are copied in chunks of
    ``chunk_bytes`` through ``staging`` (one reusable pair of buffers for the whole run, created
    if not given); the weights of layer ``i + 1`` are fetched while layer ``i`` runs, so at most
    two layers are resident. ``overlap`` (default) overlaps each fetch with the previous layer's
    compute: on accelerators through the transfer and compute streams, on ``cpu`` / ``meta``
    through one worker thread (copies and most kernels release the GIL); ``overlap=False`` runs
    them one after the other on CPU. Runs under ``torch.no_grad()``. ``ledger`` (anything with
    ``allocate(tensor)`` / ``free(tensor)``) sees every fetched weight and staging buffer come
    and go. The output stays on ``device``.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> r = offload_forward(model, torch.ones(3, 4), "meta", chunk_bytes=32)
        >>> tuple(r.output.shape), r.layer_bytes, r.peak_resident_bytes
        ((3, 1), (80, 0, 20), 80)
    """
    mods = list(layers)
    for i, m in enumerate(mods):
        if not isinstance(m, nn.Module):
            raise InvalidInputError(
                f"layers[{i}] is a {type(m).__name__}, expected a torch.nn.Module. Fix: pass an "
                "nn.Sequential, nn.ModuleList or a list of modules."
            )
    cb = _chunk_size(chunk_bytes)
    spec = device if isinstance(device, DeviceSpec) else DeviceSpec(device)
    shape_only = spec.type == "meta"
    t0 = time.perf_counter()
    plan = [_layer_tensors(m) for m in mods]
    layer_nbytes = [
        sum(int(s.nbytes()) for s in {id(s): s for s in (t.untyped_storage() for t in ts)}.values())
        for _, ts in plan
    ]
    own_pool = staging is None
    pool = staging or StagingBuffers(cb, device="meta" if shape_only else "cpu")
    pool.reset_peak()
    created0 = pool.buffers_created
    cap = min(pool.chunk_bytes, max(layer_nbytes, default=0))
    if cap > 0:  # size both buffers once for the whole run (no regrowth between layers)
        pool.acquire(0, cap, ledger=ledger)
        pool.acquire(1, cap, ledger=ledger)
    resident = _LiveBytes()
    moved: list[int] = []
    chunks = 0

    def fetch(i: int) -> dict[str, torch.Tensor]:
        nonlocal chunks
        names, tensors = plan[i]
        new, sizes, _, _, _ = move_storages(
            tensors, spec, chunk_bytes=cb, staging=pool, ledger=ledger
        )
        seen: set[int] = set()
        for t in new:
            key = int(t.untyped_storage()._cdata)
            if key not in seen:
                seen.add(key)
                resident.add(t)
                if ledger is not None:
                    ledger.allocate(t)
        moved.append(sum(sizes))
        chunks += len(sizes)
        return dict(zip(names, new))

    compute = spec.compute()
    with torch.no_grad():
        y = transfer(x, spec) if isinstance(x, torch.Tensor) else x
        if overlap and compute is None and mods:
            y = _run_threaded(mods, y, fetch, ledger)
        else:
            current = fetch(0) if mods else {}
            for i, layer in enumerate(mods):
                with use_stream(compute):
                    y = torch.func.functional_call(layer, current, (y,))
                # Fetch the next layer while this one computes: on an accelerator the layer's
                # kernels are queued on the compute stream and the copies on the transfer stream.
                following = fetch(i + 1) if i + 1 < len(mods) else {}
                _retire(current, compute, ledger)
                current = following
            del current
    result = OffloadResult(
        y, str(spec.device), len(mods), tuple(moved), chunks, resident.peak, pool.peak_bytes,
        pool.buffers_created - created0, shape_only, time.perf_counter() - t0,
    )
    if own_pool:
        pool.release(ledger)
    return result
