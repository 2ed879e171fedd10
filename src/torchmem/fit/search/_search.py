"""``estimate``: one fake run with given parameters, or a search for the largest value that fits.

``build(batch_size, **params)`` is called; any integer parameter can be maximized (the batch
size, ``seq_len``, ``max_new_tokens``, ...). The search starts from the search range's low end
(or the build's default for that keyword, or 1), doubles until a run does not fit (halves
first when the start does not fit), then narrows the bracket between the last value that fit
and the first that did not: the probes that ran to the end give the memory curve (peak
reserved bytes against the value), and the largest value the curve says fits is probed next,
then the value above it; after a misprediction one bisection step follows, so the answer is
always a true boundary (it fits; one more does not). Every probe is a fresh fake run (a new simulated allocator, new fake
tensors), so nothing carries over between probes. A probe fits when it keeps the error margin
free (:mod:`torchmem.fit.verdict._margin`), the rule of every answer.

Example:
    >>> import torch
    >>> def build(batch):
    ...     x = torch.zeros(batch, 1 << 18, device="cuda")   # 1 MiB per row
    ...     return lambda: x * 2
    >>> e = estimate(build, gpu="2 GiB", max_batch_size=True, steps=1, margin=0)
    >>> e.max_batch_size, e.fits, e.batch_size == e.max_batch_size
    (758, True, True)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu._dist import check_rank, check_world_size, levers_on_rank_0
from torchmem.fit.run._engine import BuildFn, run_once
from torchmem.fit.search._bracket import _search, _stream_search
from torchmem.fit.search._checks import _apply_margin, _check_params, _check_range, _is_int
from torchmem.fit.search._lever_runs import _what_if
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._catalog import gpu as _gpu
from torchmem.fit.verdict._estimate import Estimate
from torchmem.fit.verdict._margin import check_margin, margin_for

__all__ = ["estimate"]


def estimate(
    build: BuildFn,
    gpu: str | int | GPU = "H100-80GB",
    batch_size: int | None = None,
    *,
    params: Mapping[str, Any] | None = None,
    maximize: str | None = None,
    max_batch_size: bool = False,
    search_range: tuple[int, ...] | None = None,
    steps: int = 2,
    alloc_conf: str | None = None,
    progress: Callable[[str], None] | None = None,
    keep_snapshot: bool = False,
    margin: int | str | None = None,
    kv_cache_attr: Sequence[str] | None = None,
    world_size: int | None = None,
    strict_values: bool = False,
    default_device: str | None = None,
    routing: str = "balanced",
    what_if: bool | Sequence[str] = False,
    rank: int = 0,
    replay_repeats: bool = True,
) -> Estimate:
    """Will ``build``'s step fit on ``gpu``? Estimated without the GPU, with an error margin.

    ``build(batch_size, **params)`` builds the model, optimizer and data and returns a
    zero-argument ``step()`` that runs one iteration. torchmem calls it under fake tensors (no
    memory is allocated) with CUDA redirected to the fake device, so code written for
    ``"cuda"`` runs unchanged, then runs ``step()`` ``steps`` times (default 2: the second step
    sees the optimizer state and the cached blocks) through a simulation of PyTorch's CUDA
    caching allocator with the GPU's usable memory (``alloc_conf``: a
    ``PYTORCH_CUDA_ALLOC_CONF`` string). ``gpu`` is a catalog name
    (:data:`torchmem.fit.GPUS`) or a size (``"23.5 GiB"``).

    Tensors stay where PyTorch puts them: what is created on ``"cuda"`` (``device="cuda"``,
    ``.cuda()``, ``.to("cuda")``, ``module.to("cuda")``, ``torch.set_default_device("cuda")``)
    is simulated GPU memory; what stays on the host is not, and is reported apart as
    ``Estimate.host_peak_bytes``; ``x.device``, ``x.is_cuda`` and ``torch.autocast`` see the
    GPU. ``default_device="cuda"`` puts tensors created without a device on the GPU (for a
    device-agnostic ``build``). A step that puts nothing on the GPU is an error that says so.

    ``batch_size=None`` means 1. ``params`` are keyword arguments for ``build`` (``seq_len``,
    ``max_new_tokens``, ...; ``"batch_size"`` in it sets the batch size); a name ``build``
    does not take is an error that lists the ones it takes.

    ``maximize="seq_len"`` searches for the largest integer value of that keyword that fits
    (``maximize="batch_size"`` or ``max_batch_size=True`` for the batch): from
    ``search_range``'s low end, or the build's default for it, or 1, doubling until a run does
    not fit (halving first when the start does not fit), then narrowing the bracket where the
    memory curve of the probes so far says the boundary is (bisection after a misprediction).
    ``search_range=(lo, hi)`` bounds it (an error when ``lo`` does not fit; a note when ``hi``
    does); ``(lo, hi, step)`` probes multiples of ``step`` only, so the answer fits and
    ``answer + step`` does not (fewer probes for long contexts). The search
    checks that memory grows with the parameter and says so in ``notes`` (and a
    ``RuntimeWarning``) when it does not. It returns the answer's estimate with ``maximized``,
    ``max_value`` (and ``max_batch_size`` for the batch) and ``probes``; ``max_value`` is 0
    when not even 1 fits (then the estimate is that run's, with its out-of-memory point).
    ``progress(message)`` is told each probe.

    ``margin``: every answer keeps the estimator's documented error margin free
    (:mod:`torchmem.fit.verdict._margin`: by default 1 % of the peak reserved bytes plus 256 MiB for
    the CUDA context's uncertainty); ``fits`` is true only with it kept free, and
    ``fits_without_margin`` gives the simulated run's own verdict. An int is bytes, a string a
    size (``"1 GiB"``) or a share of the peak (``"2%"``); ``0`` turns it off.

    The attention kernel ``scaled_dot_product_attention`` would run on that GPU (flash,
    memory-efficient or math, from dtype, compute capability, head dim and mask) is the one
    simulated; ``attention_kernel`` and ``notes`` say which.

    ``keep_snapshot=True`` keeps the simulated run as a PyTorch-format
    :class:`~torchmem.model.Snapshot` in ``Estimate.snapshot`` (the state at the end of the
    last step, or at the out-of-memory point, with every allocator event and each
    allocation's operator and Python stack), for :func:`torchmem.write_snapshot` and the
    viewer.

    The KV cache of a generation step (transformers' ``generate()``, or a decoding loop of
    your own) is reported as ``by_category["kv_cache"]`` and ``Estimate.kv_cache`` (bytes per
    token and per sequence): the tensors transformers' cache objects hold, or those held by
    the module attributes named in ``kv_cache_attr`` (``["k_cache", "v_cache"]``).

    Values the step reads from tensors (``loss.item()``, ``float(grad_norm)``, ``if
    mask.all():``, ``.tolist()``), which fake tensors do not have, are answered by a documented
    policy (finite losses and norms, masks all ones, nothing non-finite: see
    :mod:`torchmem.fit.fakegpu._values`) and listed in ``Estimate.assumed_values`` (where, the operator
    that made the tensor, the value assumed, how often); ``strict_values=True`` refuses them
    with an error naming the line instead. Outputs whose shape depends on values
    (``nonzero``, ``torch.where(mask)``, ``x[mask]``, ``masked_select``, ``unique``) get a
    documented size (every element selected or distinct; a mixture-of-experts routing mask made
    by ``one_hot`` gives each expert its share, ``routing="balanced"``, or every token,
    ``routing="worst"``), listed in ``assumed_values`` too (:mod:`torchmem.fit.fakegpu._shapes`).

    Calls of the outermost module that repeat earlier ones with the same shapes (the
    micro-steps of gradient accumulation, evaluation forwards) are replayed into the simulator
    once two of them did the same, instead of run again (:mod:`torchmem.fit.run._repeat`): the
    same peaks, verdict and split in a fraction of the time; ``Estimate.calls_replayed`` counts
    them, and ``replay_repeats=False`` runs every call.

    ``world_size=N`` estimates one rank (``rank``, default 0) of an ``N``-rank job without the
    ranks (``rank=R`` runs rank R: its own shards where a plan splits unevenly):
    torchmem creates PyTorch's fake process group of ``N`` ranks for ``build`` and ``step``,
    so ``build`` may call ``fully_shard`` (FSDP2) or wrap the model in
    ``DistributedDataParallel``; shards, all-gathers, reduce-scatters and DDP's gradient
    buckets get their real per-rank sizes, and the collectives' buffers are
    ``by_category["communication"]``. ``Estimate.model_state`` gives the parameter,
    gradient, optimizer-state and communication bytes at the end of the last
    ``optimizer.step()`` and ``Estimate.collectives`` each collective's calls and largest
    buffer (:mod:`torchmem.fit.fakegpu._dist` says how; a process group already initialised in this
    process is an error). The group is destroyed afterwards.

    ``what_if=True`` (or a list of lever names) also tries the memory levers on the step
    (:mod:`torchmem.fit.levers._whatif`: activation checkpointing, gradient accumulation, bf16,
    the optimizer's implementations, 8-bit Adam, Adafactor, FSDP over 2/4/8 GPUs, CPU
    offload, the allocator settings of ``--suggest``), each applied by torchmem to the model and
    optimizer ``build`` makes, and sets ``Estimate.what_if`` (one row per lever, sorted by
    peak reserved; levers the step cannot take say why) and ``Estimate.what_if_best`` (the
    cheapest combination that fits, found greedily; ``None`` when none does, a row named
    ``as_written`` when the step fits without a lever). With
    ``maximize``, the levers are tried at the batch (and parameters) given, and the largest
    value each of the three best levers allows is searched too (``cost["max_value"]``).

    Bad input raises :class:`~torchmem.errors.InvalidInputError`: a build that raises or
    returns no callable, or code that needs tensor values fake tensors do not have (``.item()``,
    ``.numpy()``, data-dependent shapes); the message names the file and line.

    Example:
        >>> import torch
        >>> def build(batch, seq_len=128):
        ...     net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        ...     x = torch.randn(batch, seq_len, 64, device="cuda")  # "cuda" is fine: it is faked
        ...     return lambda: net.to("cuda")(x).sum().backward()
        >>> e = estimate(build, gpu="RTX-4090", batch_size=16, params={"seq_len": 256})
        >>> e.fits, e.oom, e.params, e.peak_requested_bytes >= 2 * 16 * 256 * 64 * 4
        (True, None, {'seq_len': 256}, True)
    """
    card = _gpu(gpu)
    margin = check_margin(margin)
    world_size = check_world_size(world_size)
    rank = check_rank(rank, world_size)
    kw = dict(params or {})
    if not all(isinstance(k, str) for k in kw):
        raise InvalidInputError(f"params must map keyword names to values, got keys {list(kw)}")
    if "batch_size" in kw:
        if batch_size is not None:
            raise InvalidInputError(
                "the batch size was given twice (batch_size= and params['batch_size']); "
                "fix: give it once"
            )
        batch_size = kw.pop("batch_size")
    if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
        raise InvalidInputError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    if max_batch_size:
        if maximize not in (None, "batch_size"):
            raise InvalidInputError(
                f"max_batch_size=True and maximize={maximize!r} both ask for a search; one "
                "parameter is maximized at a time"
            )
        maximize = "batch_size"
    if maximize is not None and (not isinstance(maximize, str) or not maximize.isidentifier()):
        raise InvalidInputError(
            f"maximize must name one of build's integer parameters, e.g. 'seq_len', "
            f"got {maximize!r}"
        )
    if not callable(build):
        raise InvalidInputError(
            f"build must be a function build(batch_size, **params) -> step, got "
            f"{type(build).__name__}"
        )
    searched = [maximize] if maximize not in (None, "batch_size") else []
    accepted = _check_params(build, [*kw, *searched], kw)
    lo, hi, step = _check_range(search_range, maximize)

    def run(b: int, extra: Mapping[str, Any], snap: bool = False, fast: bool = False,
            stream: list[Any] | None = None, stop_over: int | None = None,
            lower: bool = False) -> Estimate:
        # a probe extrapolates generate()'s later decode steps (same peaks, verdict, split and
        # KV figures; an answer whose split could not follow the replay is rerun in full) and
        # records no Python stacks (a quarter of a run's time): they are only shown for an
        # out-of-memory site, and an answer with one (nothing fits) is rerun with them
        e = run_once(build, b, card, steps=steps, alloc_conf=alloc_conf, keep_snapshot=snap,
                     params={**kw, **extra}, kv_cache_attr=kv_cache_attr,
                     world_size=world_size, rank=rank, strict_values=strict_values,
                     extrapolate_decode=fast, default_device=default_device,
                     routing=routing, stream=stream, stop_over=stop_over,
                     stacks=not fast, replay_repeats=replay_repeats, lower=lower,
                     progress=progress)
        return _apply_margin(e, margin, card)

    if what_if is not False:
        from torchmem.fit.levers._whatif import check_levers

        if maximize is not None and maximize != "batch_size" and maximize in kw:
            raise InvalidInputError(
                f"{maximize!r} is both set (params) and maximized; fix: drop it from params"
            )

        levers_on_rank_0(rank)
        chosen = check_levers(None if what_if is True else what_if)
        return _what_if(build, card, batch_size or 1, kw, chosen, maximize, margin, progress,
                        dict(steps=steps, alloc_conf=alloc_conf, kv_cache_attr=kv_cache_attr,
                             world_size=world_size, strict_values=strict_values,
                             default_device=default_device, routing=routing,
                             replay_repeats=replay_repeats),
                        keep_snapshot, search_range)

    if maximize is None:  # a plain estimate: with its lower figure where the GPU chooses
        return run(batch_size or 1, {}, keep_snapshot, lower=True)

    if maximize == "batch_size":
        if batch_size is not None:
            raise InvalidInputError(
                "give either batch_size or a search for the largest batch (max_batch_size=True, "
                "maximize='batch_size'), not both; fix: drop batch_size to search"
            )
        start = lo if lo is not None else 1

        def probe_run(v: int) -> Estimate:
            return run(v, {}, fast=True)
    else:
        if maximize in kw:
            raise InvalidInputError(
                f"{maximize!r} is both set (params) and maximized; fix: drop it from params to "
                "search for its largest value"
            )
        default = accepted.get(maximize, inspect.Parameter.empty)
        if default is not inspect.Parameter.empty and default is not None and not _is_int(default):
            raise InvalidInputError(
                f"cannot maximize {maximize!r}: build's default for it is "
                f"{type(default).__name__} {default!r}, and the search only takes integer "
                "parameters (a length, a count, a batch size)"
            )
        start = lo if lo is not None else (default if _is_int(default) and default >= 1 else 1)
        fixed_batch = batch_size or 1

        def probe_run(v: int) -> Estimate:
            return run(fixed_batch, {maximize: v}, fast=True)

    def fits_at(reserved: float) -> bool:
        """The fits rule for a run peaking at ``reserved`` bytes (the margin kept free)."""
        r = max(0, int(reserved))
        return r + margin_for(margin, card, r) <= card.usable_bytes

    if maximize != "batch_size" and world_size is None:
        # probes predicted from the requests of earlier ones; the answer checked for real
        return _stream_search(
            maximize,
            lambda v, s, stop=None: run(fixed_batch, {maximize: v}, fast=True, stream=s,
                                        stop_over=stop),
            lambda e: _apply_margin(e, margin, card),
            (start, lo, hi, card, progress, keep_snapshot,
             lambda v: run(fixed_batch, {maximize: v}, keep_snapshot), fits_at, step),
        )
    return _search(maximize, probe_run, start, lo, hi, card, progress, keep_snapshot,
                   lambda v: run(v, {}, keep_snapshot) if maximize == "batch_size"
                   else run(batch_size or 1, {maximize: v}, keep_snapshot), fits_at, step)
