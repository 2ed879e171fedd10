"""The result of an estimate: :class:`Estimate` (plain data, JSON via :meth:`Estimate.to_dict`).

Example:
    >>> e = Estimate(gpu="T4", batch_size=8, fits=True, capacity_bytes=100, overhead_bytes=10,
    ...              peak_requested_bytes=40, peak_allocated_bytes=50, peak_reserved_bytes=60)
    >>> e.headroom_bytes, list(e.to_dict())[:4]
    (30, ['fits', 'peak_requested_bytes', 'peak_allocated_bytes', 'peak_reserved_bytes'])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Estimate", "OOMSite", "KVCache"]


@dataclass
class KVCache:
    """The KV cache of an estimated run: what the cache objects (or the attributes named by
    ``kv_cache_attr``) held.

    ``peak_bytes``: cache storages live at the estimate's peak of requested bytes (the
    ``kv_cache`` entry of ``by_category``); ``end_bytes``: live at the end of the last step;
    ``max_bytes``: the most the cache held at once; ``bytes_per_token``: bytes one token of
    one sequence takes (``2 x layers x kv_heads x head_dim x dtype bytes`` for a standard
    cache); ``bytes_per_sequence``: ``max_bytes`` per sequence of the batch (``tokens`` x
    ``bytes_per_token`` for a plain cache; more when the cache keeps views into larger
    storages, as a sliding window does after its prefill); ``tokens`` and ``batch``: the cache's length (a static cache: its
    maximum length, allocated up front) and batch at ``max_bytes``; ``source``: what held it.

    Example:
        >>> kv = KVCache(1024, 0, 2048, 64, 1024, 16, 2, "transformers DynamicCache")
        >>> kv.to_dict()["kv_cache_bytes_per_token"]
        64
    """

    peak_bytes: int
    end_bytes: int
    max_bytes: int
    bytes_per_token: int
    bytes_per_sequence: int
    tokens: int
    batch: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        """The ``kv_cache_*`` keys of :meth:`Estimate.to_dict`.

        Example:
            >>> sorted(KVCache(0, 0, 0, 0, 0, 0, 0, "x").to_dict())[:3]
            ['kv_cache_batch', 'kv_cache_bytes_per_sequence', 'kv_cache_bytes_per_token']
        """
        return {
            "kv_cache_peak_bytes": self.peak_bytes,
            "kv_cache_end_bytes": self.end_bytes,
            "kv_cache_max_bytes": self.max_bytes,
            "kv_cache_bytes_per_token": self.bytes_per_token,
            "kv_cache_bytes_per_sequence": self.bytes_per_sequence,
            "kv_cache_tokens": self.tokens,
            "kv_cache_batch": self.batch,
            "kv_cache_source": self.source,
        }


@dataclass
class OOMSite:
    """The allocation that would run out of memory: size, operator, module, phase, stack.

    Example:
        >>> OOMSite(1024, "aten::mm", "Net.fc", "forward", ("train.py:12 step",)).to_dict()["op"]
        'aten::mm'
    """

    requested_bytes: int
    op: str | None
    module: str | None
    phase: str
    stack: tuple[str, ...] = ()
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form.

        Example:
            >>> sorted(OOMSite(1, None, None, "other").to_dict())[:3]
            ['allocated_bytes', 'message', 'module']
        """
        return {
            "requested_bytes": self.requested_bytes,
            "op": self.op,
            "module": self.module,
            "phase": self.phase,
            "stack": list(self.stack),
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "message": self.message,
        }


@dataclass
class Estimate:
    """Will it fit? The figures of one simulated run (or of a search's answer).

    Bytes are ints. ``capacity_bytes`` is the GPU's total memory, ``overhead_bytes`` the CUDA
    context (outside PyTorch's allocator), so the simulated allocator had
    ``capacity_bytes - overhead_bytes``. ``peak_requested_bytes`` is the peak sum of live
    tensor storages (exact), ``peak_allocated_bytes`` the peak of allocator blocks (rounded
    requests, cuBLAS workspaces included), ``peak_reserved_bytes`` the peak of cudaMalloc'd
    segments. ``by_category`` and ``by_module`` are the storages live at the peak of requested
    bytes (plus ``workspace``, the library workspaces live then; ``by_module`` has every module,
    largest first). ``fragmentation_bytes`` is
    reserved minus allocated at the peak of allocated bytes. ``oom`` says where it would run out
    of memory (``None`` when it fits). ``snapshot`` is the simulated run as a
    :class:`~torchmem.model.Snapshot` when asked for (``keep_snapshot=True``). ``kv_cache``
    (:class:`KVCache`, ``None`` when the run had none) describes the KV cache; ``to_dict``
    gives it as the ``kv_cache_*`` keys. ``host_peak_bytes`` is the peak of host memory the
    run's tensors held (a model built on the host before ``.to("cuda")``, batches, pinned
    staging buffers, state offloaded to the CPU): not GPU memory, and in none of the figures
    above. ``what_if`` (:class:`~torchmem.fit.levers._whatif.WhatIfRow` s, sorted by peak reserved) and
    ``what_if_best`` are the memory levers tried (``estimate(..., what_if=True)``).

    ``fits`` keeps the estimator's error margin free: it is true only when the run did not run
    out of memory *and* ``headroom_bytes >= margin_bytes``; ``fits_without_margin`` is the
    verdict of the simulated run alone (``None``: no margin was applied, same as ``fits``).
    ``params`` are the keyword arguments ``build`` was called with. A search sets
    ``maximized`` (the parameter's name), ``max_value`` (the largest value that fits; 0 when
    none does) and, for the batch size, ``max_batch_size``. ``attention_kernel`` names the
    kernel(s) ``scaled_dot_product_attention`` ran (``"flash"``, ``"efficient"``, ``"math"``;
    ``None`` when it was not called).

    A per-rank estimate (``world_size=N``: rank ``rank`` of an ``N``-rank job, rank 0 unless
    asked for another, under a fake process group, :mod:`torchmem.fit.fakegpu._dist`) sets
    ``world_size`` and ``rank``; ``by_category["communication"]``
    holds the collectives' buffers live at the peak; ``model_state`` gives the
    ``parameter``, ``gradient``, ``optimizer_state`` and ``communication`` bytes live at the
    end of the last ``optimizer.step()`` (empty when the step never calls one);
    ``collectives`` gives each collective operator's calls and largest buffer.

    ``decode_replayed`` counts the iterations of ``generate()``'s loop that were replayed
    into the simulator instead of run through the model (:mod:`torchmem.fit.run._decode`; 0:
    none): the peaks and verdict are the full run's, and so are ``by_category``,
    ``by_module`` and ``kv_cache`` unless ``decode_split_exact`` is false (they are then the
    iterations that ran). ``calls_replayed`` counts the calls of the outermost module (a
    micro-step's forward and its backward, an evaluation forward) that repeated earlier calls
    and were replayed into the simulator instead of run (:mod:`torchmem.fit.run._repeat`): the
    peaks, verdict and split are the full run's. ``predicted`` marks a search probe predicted from earlier probes'
    allocator requests (:mod:`torchmem.fit.run._stream`), not run; a search's answer lists those
    values in ``predicted_probes``. ``stopped_over`` is set on a search's check of the value
    above its answer when that run stopped as soon as its reserved bytes passed this many
    (the most that fits with the margin): it does not fit, as the full run would not, and its
    peaks are those reached when it stopped. ``incomplete`` says why a run gives no verdict
    (a script stopped at its time limit before the optimizer steps asked for): its peaks are
    those until then, ``fits`` is false and the verdict line says INCOMPLETE.

    Where the GPU's timing decides part of the figure (blocks ``record_stream`` marked for
    another stream are free only once that stream's work is done:
    :mod:`torchmem.fit.fakegpu._streams`), the peaks and the verdict take the latest it can be
    done and ``peak_reserved_lower_bytes`` the earliest; ``range_causes`` says why (JSON:
    ``peak_reserved_range`` as ``[lower, upper]`` and ``range_causes``). ``None`` and empty for a
    run without such choices: its figures are single.

    Example:
        >>> e = Estimate(gpu="T4", batch_size=1, fits=False, capacity_bytes=10, overhead_bytes=2,
        ...              peak_requested_bytes=0, peak_allocated_bytes=0, peak_reserved_bytes=0)
        >>> e.usable_bytes, e.to_dict()["oom"]
        (8, None)
        >>> e.decode_replayed, e.decode_split_exact, e.predicted, e.predicted_probes, e.stopped_over
        (0, True, False, [], None)
        >>> e.calls_replayed, e.peak_reserved_lower_bytes, e.range_causes
        (0, None, [])
    """

    gpu: str
    batch_size: int | None
    fits: bool
    capacity_bytes: int
    overhead_bytes: int
    peak_requested_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    oom: OOMSite | None = None
    max_batch_size: int | None = None
    fragmentation_bytes: int = 0
    workspace_bytes: int = 0
    overhead: dict[str, int] = field(default_factory=dict)
    steps: int = 2
    alloc_conf: str | None = None
    compute_capability: tuple[int, int] = (9, 0)
    searched: bool = False
    probes: list[tuple[int, bool]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    snapshot: Any = field(default=None, repr=False)
    kv_cache: KVCache | None = None
    params: dict[str, Any] = field(default_factory=dict)
    maximized: str | None = None
    max_value: int | None = None
    margin_bytes: int = 0
    margin_rule: str = ""
    fits_without_margin: bool | None = None
    attention_kernel: str | None = None
    world_size: int | None = None
    #: the rank a per-rank estimate ran (0 unless asked for another)
    rank: int = 0
    model_state: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    assumed_values: list[dict[str, Any]] = field(default_factory=list)
    host_peak_bytes: int = 0
    what_if: list[Any] = field(default_factory=list)
    what_if_best: Any = None
    decode_replayed: int = 0
    decode_split_exact: bool = True
    calls_replayed: int = 0
    predicted: bool = False
    predicted_probes: list[int] = field(default_factory=list)
    stopped_over: int | None = None
    incomplete: str | None = None
    peak_reserved_lower_bytes: int | None = None
    range_causes: list[str] = field(default_factory=list)

    @property
    def usable_bytes(self) -> int:
        """What the simulated allocator had: capacity minus the CUDA context.

        Example:
            >>> Estimate("x", 1, True, 100, 30, 0, 0, 0).usable_bytes
            70
        """
        return self.capacity_bytes - self.overhead_bytes

    @property
    def headroom_bytes(self) -> int:
        """Usable bytes left at the peak of reserved memory (negative: short by that much).

        Example:
            >>> Estimate("x", 1, True, 100, 30, 0, 0, 50).headroom_bytes
            20
        """
        return self.usable_bytes - self.peak_reserved_bytes

    @property
    def headroom_after_margin_bytes(self) -> int:
        """Headroom left once the error margin is kept free (negative: short by that much).

        Example:
            >>> Estimate("x", 1, True, 100, 30, 0, 0, 50, margin_bytes=15).headroom_after_margin_bytes
            5
        """
        return self.headroom_bytes - self.margin_bytes

    def verdict_line(self) -> str:
        """One line: the GPU, the batch and parameters, the verdict and the headroom (the
        margin kept free, when there is one).

        Example:
            >>> e = Estimate("T4", 8, True, 100 << 20, 30 << 20, 0, 0, 50 << 20,
            ...              params={"seq_len": 4096}, margin_bytes=1 << 20)
            >>> e.verdict_line()
            'T4, batch 8, seq_len 4096: FITS (headroom 20.00 MiB of 70.00 MiB usable; margin 1.00 MiB kept free)'
        """
        from torchmem.units import format_bytes

        what = f", batch {self.batch_size}" if self.batch_size is not None else ""
        what += "".join(f", {k} {v}" for k, v in self.params.items())
        if self.world_size is not None:
            what += f", rank {self.rank} of {self.world_size}"
        kept = f"; margin {format_bytes(self.margin_bytes)} kept free" if self.margin_bytes else ""
        if self.incomplete:
            return (f"{self.gpu}{what}: INCOMPLETE, no verdict ({self.incomplete}); peak "
                    f"reserved so far {format_bytes(self.peak_reserved_bytes)} of "
                    f"{format_bytes(self.usable_bytes)} usable")
        return (f"{self.gpu}{what}: {'FITS' if self.fits else 'DOES NOT FIT'} (headroom "
                f"{format_bytes(self.headroom_bytes)} of {format_bytes(self.usable_bytes)} "
                f"usable{kept})")

    def search_line(self) -> str | None:
        """The search's answer and its probes (``+`` fits, ``-`` does not); ``None`` without a
        search.

        Example:
            >>> e = Estimate("T4", 1, True, 100, 30, 0, 0, 50, searched=True, maximized="seq_len",
            ...              max_value=96, probes=[(64, True), (128, False), (96, True)])
            >>> e.search_line()
            'largest seq_len that fits: 96 (3 probes: 64+, 128-, 96+)'
        """
        if not self.searched:
            return None
        name = self.maximized or "batch_size"
        label = "batch" if name == "batch_size" else name
        answer = self.max_value if self.maximized else self.max_batch_size
        probes = ", ".join(f"{v}{'+' if f else '-'}" for v, f in self.probes)
        return f"largest {label} that fits: {answer} ({len(self.probes)} probes: {probes})"

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the verdict, the memory lines, what is live at the peak, and
        the what-if table when levers were tried (``estimate(..., what_if=True)``).

        Example:
            >>> "FITS (headroom 67 B" in Estimate("x", 4, True, 100, 30, 1, 2, 3)._repr_html_()
            True
        """
        from torchmem.model._html import estimate_html

        return estimate_html(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: the documented keys first, then extras.

        Example:
            >>> d = Estimate("x", 4, True, 100, 30, 1, 2, 3).to_dict()
            >>> list(d)[:9]  # doctest: +NORMALIZE_WHITESPACE
            ['fits', 'peak_requested_bytes', 'peak_allocated_bytes', 'peak_reserved_bytes',
             'capacity_bytes', 'overhead_bytes', 'by_category', 'oom', 'host_peak_bytes']
        """
        d: dict[str, Any] = {
            "fits": self.fits,
            "peak_requested_bytes": self.peak_requested_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "capacity_bytes": self.capacity_bytes,
            "overhead_bytes": self.overhead_bytes,
            "by_category": dict(self.by_category),
            "oom": None if self.oom is None else self.oom.to_dict(),
            "host_peak_bytes": self.host_peak_bytes,
        }
        if self.searched:
            name = self.maximized or "batch_size"
            d[f"max_{name}"] = self.max_value if self.maximized else self.max_batch_size
            if name != "batch_size" and self.max_batch_size is not None:
                d["max_batch_size"] = self.max_batch_size
            d["maximized"] = name
        d.update(
            incomplete=self.incomplete,
            margin_bytes=self.margin_bytes,
            fits_without_margin=self.fits if self.fits_without_margin is None
            else self.fits_without_margin,
            headroom_after_margin_bytes=self.headroom_after_margin_bytes,
            margin_rule=self.margin_rule,
            attention_kernel=self.attention_kernel,
            params=dict(self.params),
        )
        d.update(
            gpu=self.gpu,
            compute_capability=list(self.compute_capability),
            batch_size=self.batch_size,
            steps=self.steps,
            alloc_conf=self.alloc_conf,
            usable_bytes=self.usable_bytes,
            headroom_bytes=self.headroom_bytes,
            fragmentation_bytes=self.fragmentation_bytes,
            workspace_bytes=self.workspace_bytes,
            overhead=dict(self.overhead),
            by_module=dict(self.by_module),
        )
        if self.searched:
            d["probes"] = [{self.maximized or "batch_size": v, "fits": f} for v, f in self.probes]
        if self.kv_cache is not None:
            d.update(self.kv_cache.to_dict())
        if self.world_size is not None:
            d.update(world_size=self.world_size, rank=self.rank,
                     model_state=dict(self.model_state),
                     collectives={k: dict(v) for k, v in self.collectives.items()})
        d["assumed_values"] = [dict(a) for a in self.assumed_values]
        if self.calls_replayed:
            d["calls_replayed"] = self.calls_replayed
        if self.peak_reserved_lower_bytes is not None:
            d["peak_reserved_range"] = [self.peak_reserved_lower_bytes, self.peak_reserved_bytes]
            d["range_causes"] = list(self.range_causes)
        if self.what_if:
            d["what_if"] = [r.to_dict() for r in self.what_if]
            d["what_if_best"] = None if self.what_if_best is None else self.what_if_best.to_dict()
        if self.notes:
            d["notes"] = list(self.notes)
        return d
