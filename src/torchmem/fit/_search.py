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
free (:mod:`torchmem.fit._margin`), the rule of every answer.

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

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.fit._catalog import GPU
from torchmem.fit._catalog import gpu as _gpu
from torchmem.fit._dist import check_world_size
from torchmem.fit._engine import BuildFn, _make_sim, run_once
from torchmem.fit._estimate import Estimate, OOMSite
from torchmem.fit._margin import MarginSpec, check_margin, describe_margin, margin_for
from torchmem.fit._stream import StreamModel, replay
from torchmem.units import format_bytes

__all__ = ["estimate"]

#: The search stops doubling here (a build that ignores the parameter would never stop).
MAX_SEARCH_BATCH = 1 << 24


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _signature(build: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(build)
    except (TypeError, ValueError):
        return None


def _keywords(build: Any) -> tuple[dict[str, Any], bool] | None:
    """``build``'s keyword parameters (after the batch size) with their defaults
    (``inspect.Parameter.empty`` when none), and whether it takes ``**kwargs``; ``None`` when
    the signature cannot be read."""
    sig = _signature(build)
    if sig is None:
        return None
    params = list(sig.parameters.values())
    out: dict[str, Any] = {}
    var_kw = False
    first = True
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is p.VAR_POSITIONAL:
            first = False
        elif first and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            first = False  # the batch size
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out[p.name] = p.default
    return out, var_kw


def _check_value(where: str, name: str, value: Any, default: Any) -> None:
    """A value whose type does not match the default's (an int parameter given ``'abc'``)."""
    if default is inspect.Parameter.empty or default is None or value is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = _is_int(value)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        return
    if not ok:
        kind = type(default).__name__
        raise InvalidInputError(
            f"{where}(): {name}={value!r} ({type(value).__name__}) does not fit the parameter: "
            f"its default is {kind} {default!r}; fix: give a {kind}, e.g. {name}={default!r}"
        )


def _check_params(
    build: Any, names: list[str], values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Fail clearly when ``build`` does not take one of ``names`` (or a value does not match
    its default's type); the keywords it takes."""
    info = _keywords(build)
    if info is None:
        return {}
    accepted, var_kw = info
    where = getattr(build, "__qualname__", None) or type(build).__name__
    for name, value in (values or {}).items():
        if name in accepted:
            _check_value(where, name, value, accepted[name])
    for name in names:
        if name not in accepted and not var_kw:
            takes = ", ".join(accepted) if accepted else "none besides the batch size"
            raise InvalidInputError(
                f"{where}() takes no parameter {name!r}; its keyword parameters: {takes}; "
                f"fix: add `{name}` to build's signature (build(batch_size, {name}=...)) or "
                "set one it takes"
            )
    return accepted


def _apply_margin(e: Estimate, margin: MarginSpec, card: GPU) -> Estimate:
    e.margin_bytes = margin_for(margin, card, e.peak_reserved_bytes)
    e.margin_rule = describe_margin(margin, card)
    e.fits_without_margin = e.fits
    if e.fits and e.headroom_bytes < e.margin_bytes:
        e.fits = False
        e.notes.append(
            f"fits the simulation with {format_bytes(e.headroom_bytes)} free, less than the "
            f"error margin {format_bytes(e.margin_bytes)} ({e.margin_rule}); counted as not "
            "fitting (margin=0 judges the simulated run alone)"
        )
    return e


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
    (:mod:`torchmem.fit._margin`: by default 1 % of the peak reserved bytes plus 256 MiB for
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
    :mod:`torchmem.fit._values`) and listed in ``Estimate.assumed_values`` (where, the operator
    that made the tensor, the value assumed, how often); ``strict_values=True`` refuses them
    with an error naming the line instead. Outputs whose shape depends on values
    (``nonzero``, ``torch.where(mask)``, ``x[mask]``, ``masked_select``, ``unique``) get a
    documented size (every element selected or distinct; a mixture-of-experts routing mask made
    by ``one_hot`` gives each expert its share, ``routing="balanced"``, or every token,
    ``routing="worst"``), listed in ``assumed_values`` too (:mod:`torchmem.fit._shapes`).

    ``world_size=N`` estimates one rank (rank 0) of an ``N``-rank job without the ranks:
    torchmem creates PyTorch's fake process group of ``N`` ranks for ``build`` and ``step``,
    so ``build`` may call ``fully_shard`` (FSDP2) or wrap the model in
    ``DistributedDataParallel``; shards, all-gathers, reduce-scatters and DDP's gradient
    buckets get their real per-rank sizes, and the collectives' buffers are
    ``by_category["communication"]``. ``Estimate.model_state`` gives the parameter,
    gradient, optimizer-state and communication bytes at the end of the last
    ``optimizer.step()`` and ``Estimate.collectives`` each collective's calls and largest
    buffer (:mod:`torchmem.fit._dist` says how; a process group already initialised in this
    process is an error). The group is destroyed afterwards.

    ``what_if=True`` (or a list of lever names) also tries the memory levers on the step
    (:mod:`torchmem.fit._whatif`: activation checkpointing, gradient accumulation, bf16,
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
            stream: list[Any] | None = None, stop_over: int | None = None) -> Estimate:
        # a probe extrapolates generate()'s later decode steps (same peaks, verdict, split and
        # KV figures; an answer whose split could not follow the replay is rerun in full) and
        # records no Python stacks (a quarter of a run's time): they are only shown for an
        # out-of-memory site, and an answer with one (nothing fits) is rerun with them
        e = run_once(build, b, card, steps=steps, alloc_conf=alloc_conf, keep_snapshot=snap,
                     params={**kw, **extra}, kv_cache_attr=kv_cache_attr,
                     world_size=world_size, strict_values=strict_values,
                     extrapolate_decode=fast, default_device=default_device,
                     routing=routing, stream=stream, stop_over=stop_over,
                     stacks=not fast)
        return _apply_margin(e, margin, card)

    if what_if is not False:
        from torchmem.fit._whatif import check_levers

        if maximize is not None and maximize != "batch_size" and maximize in kw:
            raise InvalidInputError(
                f"{maximize!r} is both set (params) and maximized; fix: drop it from params"
            )

        chosen = check_levers(None if what_if is True else what_if)
        return _what_if(build, card, batch_size or 1, kw, chosen, maximize, margin, progress,
                        dict(steps=steps, alloc_conf=alloc_conf, kv_cache_attr=kv_cache_attr,
                             world_size=world_size, strict_values=strict_values,
                             default_device=default_device, routing=routing),
                        keep_snapshot, search_range)

    if maximize is None:
        return run(batch_size or 1, {}, keep_snapshot)

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


def _check_range(
    search_range: object, maximize: str | None
) -> tuple[int | None, int | None, int]:
    if search_range is None:
        return None, None, 1
    if maximize is None:
        raise InvalidInputError(
            "search_range is only used by a search; fix: also pass maximize='seq_len' (or "
            "max_batch_size=True), or drop search_range"
        )
    got: list[int] = []
    if isinstance(search_range, (tuple, list)) and len(search_range) in (2, 3):
        got = [x for x in search_range if _is_int(x)]
        if len(got) != len(search_range):
            got = []
    step = got[2] if len(got) == 3 else 1
    ok = bool(got) and 1 <= got[0] <= got[1] and step >= 1
    if not ok or got[1] // step < -(-got[0] // step):
        raise InvalidInputError(
            f"search_range must be (low, high) or (low, high, step) ints with 1 <= low <= high "
            f"and a multiple of step between them, got {search_range!r}"
        )
    return got[0], got[1], step


def _describe(name: str, v: int, e: Estimate) -> str:
    if e.predicted:
        return _describe_run(name, v, e) + " [predicted from earlier probes' requests]"
    return _describe_run(name, v, e)


def _describe_run(name: str, v: int, e: Estimate) -> str:
    if e.stopped_over is not None:
        return (f"{name} {v}: does not fit with the margin (stopped once its reserved bytes "
                f"passed {e.stopped_over:,} B, the most that leaves the margin free of the "
                f"{e.usable_bytes:,} B usable)")
    if e.fits:
        return (f"{name} {v}: fits (peak reserved {e.peak_reserved_bytes:,} B of "
                f"{e.usable_bytes:,} B usable, margin {e.margin_bytes:,} B)")
    if e.oom is None:
        return (f"{name} {v}: does not fit with the margin (peak reserved "
                f"{e.peak_reserved_bytes:,} B of {e.usable_bytes:,} B usable leaves "
                f"{e.headroom_bytes:,} B, under the {e.margin_bytes:,} B margin)")
    where = e.oom.op or "?"
    if e.oom.module:
        where += f" in {e.oom.module}"
    return (f"{name} {v}: does not fit (out of memory at {where}, {e.oom.phase}: "
            f"{e.oom.requested_bytes:,} B requested with {e.oom.reserved_bytes:,} B reserved)")


def _search(
    name: str,
    run: Callable[[int], Estimate],
    start: int,
    lo: int | None,
    hi: int | None,
    card: GPU,
    progress: Callable[[str], None] | None,
    keep_snapshot: bool,
    rerun: Callable[[int], Estimate],
    fits_at: Callable[[float], bool],
    step: int = 1,
) -> Estimate:
    """The search, in units of ``step`` (values ``u * step``)."""
    say = progress or (lambda msg: None)
    label = "batch" if name == "batch_size" else name
    top = hi // step if hi is not None else max(1, MAX_SEARCH_BATCH // step)
    floor = -(-lo // step) if lo is not None else 1
    start = max(-(-start // step), floor)
    cache: dict[int, Estimate] = {}
    order: list[int] = []

    def probe(u: int) -> Estimate:
        e = run(u * step)
        cache[u] = e
        order.append(u)
        say(_describe(label, u * step, e))
        return e

    notes: list[str] = []
    good, bad = 0, 0
    first = probe(start)
    if first.fits:
        good = start
        while good < top:
            nxt = min(good * 2, top)
            e = probe(nxt)
            if not e.fits:
                bad = nxt
                break
            good = nxt
    else:
        bad = start
        v = start
        while v > floor:
            v = max(v // 2, floor)
            if probe(v).fits:
                good = v
                break
            bad = v
        if good == 0 and lo is not None:
            raise InvalidInputError(
                f"nothing fits on {card.name} for {name} in {lo}..{hi}: tried "
                + "; ".join(_describe(name, u * step, cache[u]) for u in order)
                + "; fix: lower the range's low end, the other parameters, or pick a GPU "
                "with more memory"
            )
    if good and bad:
        # The memory curve guides the next probe; a guided probe that does not halve the
        # bracket (a misprediction, or a one-sided creep on a staircase of segment roundings)
        # is followed by a bisection step, and after two mispredictions bisection finishes.
        trust, misses = True, 0
        while bad - good > 1:
            guess = _predict(good, bad, cache, fits_at) if trust and misses < 2 else None
            if guess is not None and guess[1] and guess[0] >= bad - 1 > good + 1:
                guess = None  # "fits just below the miss" tells nothing a bisection would not
            mid = (good + bad) // 2 if guess is None else guess[0]
            width = bad - good
            ok = probe(mid).fits
            if ok:
                good = mid
            else:
                bad = mid
            misses += guess is not None and ok != guess[1]
            trust = guess is None or 2 * (bad - good) <= width
    elif good and not bad:
        if hi is not None:
            notes.append(f"the whole search range fits ({name} {good * step} fits): the "
                         f"largest {name} that fits may be higher; raise the range's high end")
        else:
            notes.append(f"stopped searching at {name} {good * step}: does build use {name}?")
        flat = {cache[u].peak_requested_bytes for u in order}
        if len(order) > 1 and len(flat) == 1:
            notes.append(_flat_note(name, [u * step for u in order],
                                    {u * step: e for u, e in cache.items()}))
    vcache = {u * step: e for u, e in cache.items()}
    vorder = [u * step for u in order]
    notes.extend(_monotonic_notes(name, vorder, vcache))
    for n in notes:
        if "does not grow" in n or "not monotone" in n:
            warnings.warn(n, RuntimeWarning, stacklevel=3)
    if good == 0:  # nothing fits: the probe's out-of-memory site, with its Python stack
        u = floor if floor in cache else order[-1]
        best = rerun(u * step) if cache[u].oom is not None else cache[u]
    elif keep_snapshot or _inexact(cache[good]) or cache[good].predicted:
        best = rerun(good * step)
    else:
        best = cache[good]
    best.searched = True
    best.maximized = name
    best.max_value = good * step
    if name == "batch_size":
        best.max_batch_size = good * step
    if good == 0:
        best.notes.append(f"not even {name} {floor * step} fits")
    elif step > 1 and bad:
        best.notes.append(f"searched in steps of {step}: {name} {good * step} fits, "
                          f"{(good + 1) * step} does not")
    best.probes = [(v, vcache[v].fits) for v in vorder]
    best.notes.extend(notes)
    return best


#: Searches on predicted probes before the search runs every probe for real.
STREAM_ROUNDS = 3


def _stream_search(
    name: str,
    run: Callable[..., Estimate],
    margin: Callable[[Estimate], Estimate],
    args: tuple[Any, ...],
) -> Estimate:
    """:func:`_search` with probes predicted by :mod:`torchmem.fit._stream` once two probes of
    ``generate()`` (decode steps extrapolated) ran to the end: the answer and the value above
    it are then run for real (decode steps extrapolated: the answer's split and KV figures
    are those of the full run, which is made only when they could not follow the replay), and
    the answer stands
    when their verdicts are the predicted ones (it fits, one more does not); otherwise the
    search runs again with those runs added (up to :data:`STREAM_ROUNDS` times, while they
    add a record), then with every probe run for real (the runs made so far are reused).

    The check of the value above the answer, predicted not to fit, stops as soon as its
    reserved bytes pass the most that fits (``run``'s third argument): the peak only grows,
    so its verdict is the full run's; a stopped run teaches the prediction nothing."""
    start, lo, hi, card, progress, keep_snapshot, rerun, fits_at, step = args  # _search's
    real: dict[int, Estimate] = {}
    model = StreamModel()
    say = progress or (lambda msg: None)
    most = _most_that_fits(fits_at, card.usable_bytes)

    def real_probe(v: int, stop: bool = False) -> Estimate:
        if v not in real:
            events: list[Any] = []
            e = run(v, events, most) if stop and most is not None else run(v, events)
            real[v] = e
            if e.oom is None and e.stopped_over is None:
                model.add(v, events)
        return real[v]

    def answer(v: int) -> Estimate:
        e = real_probe(v)  # a copy: the search writes its answer's fields
        return rerun(v) if keep_snapshot or _inexact(e) or e.oom is not None else (
            dataclasses.replace(e, notes=list(e.notes)))

    predicted: set[int] = set()  # this round's

    def probe(v: int) -> Estimate:
        if v in real:
            return real[v]
        # only generate()'s probes (decode steps extrapolated) are predicted: every other
        # search runs as before, each probe real
        events = model.predict(v) if all(_replayed(real[x]) for x in model.points) else None
        if events is None:
            return real_probe(v)
        predicted.add(v)
        base = real[min(model.points, key=lambda x: abs(x - v))]
        return margin(_predicted(base, replay(events, _make_sim(card.usable_bytes,
                                                                base.alloc_conf)), name, v))

    for _ in range(STREAM_ROUNDS):
        predicted.clear()
        known = len(model.points)
        best = _search(name, probe, start, lo, hi, card, progress, keep_snapshot, answer,
                       fits_at, step)
        good = best.max_value or 0
        if not predicted:
            return best
        checks = [good, good + step] if good else [(-(-lo // step) if lo else 1) * step]
        top = hi if hi is not None else MAX_SEARCH_BATCH
        wrong = []
        for v in checks:
            if v in predicted and v <= top:
                e = real_probe(v, stop=v != good)
                say(f"checked by a run: {_describe_run(name, v, e)}")
                if e.fits != (v == good):
                    wrong.append(v)
        if good and not best.fits:  # the answer's own run (rerun in full, when it is)
            wrong.append(good)
        if not wrong:
            best.predicted_probes = sorted(predicted)
            best.notes.append(
                f"{len(predicted)} of the search's {len(best.probes)} probes were predicted from "
                f"the allocator requests of the {len(real)} that ran; the answer and one more "
                "ran, with the predicted verdicts")
            return best
        say(f"the prediction at {name} {wrong[0]} was wrong; searching again")
        if len(model.points) == known:  # nothing learned: the next round would be the same
            break
    best = _search(name, real_probe, start, lo, hi, card, progress, keep_snapshot, answer,
                   fits_at, step)
    best.predicted_probes = []
    return best


def _most_that_fits(fits_at: Callable[[float], bool], usable: int) -> int | None:
    """The largest peak reserved byte count that ``fits_at`` accepts (the margin's rule
    grows with the peak, so the accepted counts are ``0..most``); ``None`` when none is.

    Example:
        >>> _most_that_fits(lambda r: r + 10 <= 100, 100)
        90
    """
    if not fits_at(0):
        return None
    lo, hi = 0, usable
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_at(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _predicted(base: Estimate, got: tuple[int, int, int, int, int | None], name: str,
               v: int) -> Estimate:
    """The estimate of a probe at ``v`` predicted from the requests replayed: ``base`` (a real
    probe) with the replay's peaks and verdict."""
    req, alloc, res, frag, oom = got
    e = dataclasses.replace(base, notes=[], fits=oom is None, peak_requested_bytes=req,
                            peak_allocated_bytes=alloc, peak_reserved_bytes=res,
                            fragmentation_bytes=frag, params={**base.params, name: v})
    e.oom = None if oom is None else OOMSite(oom, None, None, "predicted", (), alloc, res,
                                             "predicted from earlier probes' requests")
    e.predicted, e.decode_replayed = True, 0
    return e


def _replayed(e: Estimate) -> bool:
    """Whether the probe ``e`` extrapolated decode steps (:mod:`torchmem.fit._decode`)."""
    return e.decode_replayed > 0


def _inexact(e: Estimate) -> bool:
    """Whether ``e``'s per-category split and KV figures are not the full run's (decode
    steps replayed without them following): an answer so is rerun in full."""
    return e.decode_replayed > 0 and not e.decode_split_exact


def _predict(
    good: int, bad: int, cache: dict[int, Estimate], fits_at: Callable[[float], bool]
) -> tuple[int, bool] | None:
    """The next probe in the bracket ``(good, bad)`` and whether it should fit, from the memory curve of the probes that
    ran to the end (their peak reserved bytes are exact): the largest value the curve says fits
    (expected to fit), or ``good + 1`` when it says nothing above ``good`` does (expected not
    to). Between a fitting probe and an exact one above it the curve is a straight line
    (regula falsi); beyond the last exact probe, the parabola through the three nearest (a line
    when that bends down). ``None`` when fewer than two probes ran to the end."""
    pts = sorted((v, float(e.peak_reserved_bytes)) for v, e in cache.items()
                 if e.oom is None and e.stopped_over is None)
    below = [p for p in pts if p[0] <= good]
    above = [p for p in pts if good < p[0] < bad]
    if not below or len(pts) < 2:
        return None
    if above:
        (x0, y0), (x1, y1) = below[-1], above[0]
        curve = _line(x0, y0, x1, y1)
    elif len(below) >= 3:
        curve = _parabola(below[-3:]) or _line(*below[-2], *below[-1])
    elif len(below) == 2:
        curve = _line(*below[0], *below[1])
    else:
        return None
    lo_v, hi_v = good, bad - 1
    if not fits_at(curve(lo_v + 1)):
        return good + 1, False
    while lo_v < hi_v:  # the largest v in (good, bad) the curve says fits
        mid = (lo_v + hi_v + 1) // 2
        if fits_at(curve(mid)):
            lo_v = mid
        else:
            hi_v = mid - 1
    return lo_v, True


def _line(x0: float, y0: float, x1: float, y1: float) -> Callable[[float], float]:
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    return lambda x: y0 + slope * (x - x0)


def _parabola(p: list[tuple[int, float]]) -> Callable[[float], float] | None:
    (x0, y0), (x1, y1), (x2, y2) = p
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    a = (d12 - d01) / (x2 - x0)
    if a < 0:
        return None
    return lambda x: y0 + d01 * (x - x0) + a * (x - x0) * (x - x1)


def _flat_note(name: str, order: list[int], cache: dict[int, Estimate]) -> str:
    a, b = min(order), max(order)
    return (f"memory does not grow with {name}: the same peak ({cache[a].peak_requested_bytes:,}"
            f" B requested) at every probe from {name} {a} to {name} {b}")


def _monotonic_notes(name: str, order: list[int], cache: dict[int, Estimate]) -> list[str]:
    """Where a larger value used less memory, or fit where a smaller one did not."""
    vals = sorted(order)
    out: list[str] = []
    for a, b in zip(vals, vals[1:]):
        ea, eb = cache[a], cache[b]
        both_ran = ea.oom is None and eb.oom is None  # an OOM cuts a run's peak short
        shrinks = both_ran and eb.peak_requested_bytes < ea.peak_requested_bytes
        if shrinks or (eb.fits and not ea.fits):
            out.append(
                f"memory is not monotone in {name}: {name} {a} peaks at "
                f"{ea.peak_requested_bytes:,} B requested ({'fits' if ea.fits else 'does not fit'})"
                f", {name} {b} at {eb.peak_requested_bytes:,} B "
                f"({'fits' if eb.fits else 'does not fit'}); the search assumes memory grows "
                f"with {name}, so the answer may not be the largest that fits"
            )
            break
    return out


def _what_if(build: BuildFn, card: GPU, batch: int, kw: dict[str, Any], levers: list[Any],
             maximize: str | None, margin: MarginSpec, progress: Callable[[str], None] | None,
             opts: dict[str, Any], keep_snapshot: bool,
             search_range: tuple[int, ...] | None) -> Estimate:
    """``estimate(..., what_if=...)``: the step as written, then each lever (see
    :mod:`torchmem.fit._whatif`)."""

    def one(on: GPU, lr: Any, b: int | None, extra: Mapping[str, Any] | None, snap: bool,
            stacks: bool, world_size: int | None, alloc_conf: str | None) -> Estimate:
        o = dict(opts)
        if world_size is not None:
            o["world_size"] = world_size
        if alloc_conf is not None:
            o["alloc_conf"] = alloc_conf
        return run_once(build, batch if b is None else b, on, keep_snapshot=snap,
                        params={**kw, **(extra or {})}, levers=lr, stacks=stacks, **o)

    return what_if_runs(one, card, batch, levers, maximize, margin, progress, keep_snapshot,
                        search_range)


def what_if_runs(one: Callable[..., Estimate], card: GPU, batch: int, levers: list[Any],
                 maximize: str | None, margin: MarginSpec,
                 progress: Callable[[str], None] | None, keep_snapshot: bool,
                 search_range: tuple[int, ...] | None, script: bool | str = False) -> Estimate:
    """The what-if of a step that ``one(card, lever_run, batch, extra_params, keep_snapshot,
    stacks, world_size, alloc_conf)`` estimates once (a build function's, or a script's with
    ``script=True``, or the flag of the script's batch option, which accumulation divides):
    the step as written (returned, with ``what_if`` and ``what_if_best``
    set), each lever, the best combination, the largest value with ``maximize``."""
    from torchmem.fit._whatif import _lever_run, what_if

    # Each run is made on the card with unbounded memory first (the peaks the step needs, not
    # those at an out-of-memory point); a run whose peak reserved passes the card's usable
    # memory is made again on the card itself, which decides (the allocator frees its cache
    # and retries before it runs out): the same run where it never reached the limit.
    big = dataclasses.replace(card, total_bytes=card.total_bytes + (1 << 50),
                              context_override=card.context_bytes)

    def once(chosen: Sequence[Any], on: GPU, stacks: bool, world_size: int | None = None,
             alloc_conf: str | None = None, snap: bool = False, b: int | None = None,
             extra: Mapping[str, Any] | None = None) -> tuple[Estimate, Any]:
        lr = _lever_run(chosen)
        with warnings.catch_warnings():  # FSDP2 on a user's model may warn of views
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            e = one(on, lr, b, extra, snap, stacks, world_size, alloc_conf)
        return e, lr

    def settle(e: Estimate, lr: Any, real: tuple[Estimate, Any] | None) -> tuple[Estimate, Any]:
        # ``e``: a run on the unbounded card; ``real``: the same run on the card, made where
        # ``e``'s blocks passed the usable memory (the card decides; None: not made)
        if real is not None:
            if real[0].oom is None:
                return _apply_margin(real[0], margin, card), real[1]
            e.oom = real[0].oom
        e.gpu, e.capacity_bytes = card.name, card.total_bytes
        e.fits = e.oom is None and e.peak_reserved_bytes <= card.usable_bytes
        return _apply_margin(e, margin, card), lr

    def run(chosen: Sequence[Any], world_size: int | None = None, alloc_conf: str | None = None,
            snap: bool = False, b: int | None = None,
            extra: Mapping[str, Any] | None = None) -> tuple[Estimate, Any]:
        # without Python stacks (a quarter of a run's time): they are shown only for the step
        # as written's out-of-memory site and a snapshot the caller keeps
        e, lr = once(chosen, big, False, world_size, alloc_conf, snap, b, extra)
        real = None
        if e.peak_reserved_bytes > card.usable_bytes:
            if e.peak_allocated_bytes <= card.usable_bytes:
                # the cache passed the usable memory, not the blocks: the allocator frees its
                # cache and retries before it runs out, so the card itself decides
                real = once(chosen, card, False, world_size, alloc_conf, snap, b, extra)
            else:
                e.notes.append(
                    f"needs {format_bytes(e.peak_allocated_bytes)} of blocks at its peak, more "
                    f"than the {format_bytes(card.usable_bytes)} usable: out of memory on the "
                    f"{card.name}")
        return settle(e, lr, real)

    say = progress or (lambda m: None)
    say("what-if: the step as written ...")
    want_snap = keep_snapshot or any(lv.name == "allocator" for lv in levers)
    # The step as written on the unbounded card. Where its blocks or cache pass the usable
    # memory, its rerun on the card (which finds the out-of-memory site, with stacks) runs in
    # the pool beside the levers: they need only this run's figures.
    first, first_lr = once([], big, keep_snapshot, snap=want_snap)
    base, base_lr = settle(first, first_lr, None)  # provisional while the rerun is pending
    site: Callable[[], Any] | None = None
    if first.peak_reserved_bytes > card.usable_bytes:
        def site() -> Any:
            return once([], card, True, snap=want_snap)

    def on_site(real: tuple[Estimate, Any]) -> tuple[Estimate, Any]:
        nonlocal base, base_lr
        base, base_lr = settle(first, first_lr, real)
        return base, base_lr

    def suggest(e: Estimate) -> str | None:
        from torchmem.sim import suggest as _suggest

        if e.snapshot is None:
            return None
        dev = _suggest(e).devices[0]
        return None if dev.best is None else dev.best.alloc_conf

    rows, best = what_if(run, base, base_lr, card, levers, batch, progress, suggest,
                         workers=None, script=script, site=site, on_site=on_site)
    if maximize is not None:
        _lever_max(run, rows, maximize, batch, card, margin, say, search_range, base)
    base.what_if = rows
    base.what_if_best = best
    if not keep_snapshot:
        base.snapshot = None
    return base


def _lever_max(run: Callable[..., tuple[Estimate, Any]], rows: Sequence[Any], maximize: str,
               batch: int, card: GPU, margin: MarginSpec, say: Callable[[str], None],
               search_range: tuple[int, ...] | None, base: Estimate) -> None:
    """The largest value of ``maximize`` the step as written allows (``base``'s search
    figures) and each of the three levers with the lowest peak reserved (their row's
    ``cost["max_value"]``)."""
    from torchmem.fit._whatif import _BY_NAME

    top = [r for r in rows if r.skipped is None and r.lever in _BY_NAME
           and "accumulate" not in _BY_NAME[r.lever].settings and r.lever != "allocator"][:3]
    lo, hi, step = _check_range(search_range, maximize)

    def fits_at(reserved: float) -> bool:
        n = max(0, int(reserved))
        return n + margin_for(margin, card, n) <= card.usable_bytes

    for r in [None, *top]:
        levers = [] if r is None else [_BY_NAME[r.lever]]
        ws = None if r is None else levers[0].world_size

        def probe(v: int, levers: list[Any] = levers, ws: int | None = ws) -> Estimate:
            if maximize == "batch_size":
                return run(levers, world_size=ws, b=v)[0]
            return run(levers, world_size=ws, extra={maximize: v})[0]

        say(f"what-if {'as written' if r is None else r.lever}: largest {maximize} ...")
        start = lo if lo is not None else (batch if maximize == "batch_size" else 1)
        e = _search(maximize, probe, start, lo, hi, card, None, False, probe, fits_at, step)
        found = e.max_value if maximize != "batch_size" else e.max_batch_size
        if r is None:
            base.searched, base.maximized, base.probes = True, maximize, e.probes
            base.max_value = found
            if maximize == "batch_size":
                base.maximized, base.max_batch_size = None, found
        else:
            r.cost["max_value"] = found
            r.cost["maximized"] = maximize
