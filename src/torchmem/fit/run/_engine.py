"""One fake run of a user's training step through the simulated caching allocator.

``build(batch_size)`` runs under fake tensors (no memory is allocated) with CUDA redirected to
the fake device (:mod:`torchmem.fit.fakegpu._env`), inside :func:`torchmem.track`: the tracker sees every
storage birth (operator outputs, with operator, module, phase and Python stack) and every death
(a weak reference on the storage fires as soon as PyTorch drops it; fake storages die as
promptly as real ones). A tracker listener sends each birth to
:meth:`~torchmem.sim.CachingAllocator.malloc` and each death to
:meth:`~torchmem.sim.CachingAllocator.free`, in program order, on an allocator with the GPU's
usable capacity (:mod:`torchmem.fit.fakegpu._memory`). A thin dispatch mode on top
(:mod:`torchmem.fit.fakegpu._dispatch`) adds what CUDA does and a CPU run never shows:
the cuBLAS workspace of each (thread, stream) at its first GEMM (backward runs on autograd's
own thread, so a training step has two), the cuBLASLt workspace at its first cuBLASLt GEMM (an
``addmm`` with a bias) and the kernels' transient workspaces
(:class:`~torchmem.fit.fakegpu.kernels.CudaEmulation`).

The first allocation the simulator cannot satisfy is the out-of-memory point: its operator,
module and stack are kept and the run stops there.

Example:
    >>> import torch
    >>> def build(batch):
    ...     net = torch.nn.Linear(256, 256, device="cuda")
    ...     x = torch.randn(batch, 256, device="cuda")
    ...     return lambda: net(x).sum().backward()
    >>> est = run_once(build, 8, "T4")
    >>> est.fits, est.peak_requested_bytes >= 2 * (256 * 256 + 256) * 4
    (True, True)
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from torchmem.capture import track
from torchmem.errors import InvalidInputError, TorchmemError
from torchmem.fit.fakegpu._compile import compile_calls, compile_note
from torchmem.fit.fakegpu._dispatch import _Abort, _SimMode
from torchmem.fit.fakegpu._dist import DistWatch, FakeWorld, check_rank, check_world_size
from torchmem.fit.fakegpu._env import fake_cuda
from torchmem.fit.fakegpu._generate import GenerationPatches
from torchmem.fit.fakegpu._memory import _REPORT_KEYS, _live_at, _make_sim, _State
from torchmem.fit.fakegpu._pointers import SimulatedPointers
from torchmem.fit.fakegpu._readings import SimReadings
from torchmem.fit.fakegpu._shapes import check_routing
from torchmem.fit.fakegpu._streams import Streams
from torchmem.fit.fakegpu._values import ValueReads
from torchmem.fit.fakegpu.kernels import CudaEmulation
from torchmem.fit.run._decode_feed import _DecodeFeed
from torchmem.fit.run._kv import KVWatch, check_attrs, kv_live_bytes
from torchmem.fit.run._repeat import RepeatedCalls
from torchmem.fit.run._stream import StreamRecorder
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._catalog import gpu as _gpu
from torchmem.fit.verdict._estimate import Estimate, KVCache

__all__ = ["run_once", "BuildFn", "BuildError"]

BuildFn = Callable[..., Callable[[], Any]]


class BuildError(InvalidInputError):
    """Raised by torchmem's own builds (:func:`torchmem.estimate_hf`): already says what was
    tried, so the estimate raises it as is, not wrapped as an error of the user's build.

    Example:
        >>> issubclass(BuildError, InvalidInputError)
        True
    """


def _emulation(card: GPU) -> CudaEmulation:
    """The CUDA behaviour of ``card``: its compute capability and multiprocessor count."""
    return CudaEmulation(card.compute_capability, multiprocessors=card.multiprocessors)


def _source_of(fn: Any) -> tuple[str | None, int | None]:
    try:
        return inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return None, None


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchmem/


def _user_frame(exc: BaseException, prefer: set[str]) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if fr.filename in prefer:
            return fr
    for fr in reversed(frames):
        f = os.path.abspath(fr.filename)
        if not f.startswith(_TORCH_DIR) and not f.startswith(_OWN_DIR) and "<frozen" not in f:
            return fr
    return frames[-1] if frames else None


def _hint(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc)
    if name == "DataDependentOutputException" or "_local_scalar_dense" in text:
        return (" This reads a tensor's value (.item(), int(t), bool(t), .tolist(), an `if` on a "
                "tensor), which fake tensors do not have; fix: use Python numbers for control "
                "flow while estimating, or move that code out of build/step")
    if name == "DynamicOutputShapeException":
        return (" The output's shape depends on tensor values (nonzero, boolean-mask indexing, "
                "unique, ...), which fake tensors do not have; fix: use fixed-shape operations "
                "(torch.where, masked_fill) or move that code out of build/step")
    if ".numpy()" in text or "data pointer" in text or "tensor subclasses" in text:
        return (" Fake tensors have no data (.numpy(), data pointers, printing values); fix: "
                "keep such code out of build/step while estimating")
    return ""


def _user_error(exc: BaseException, what: str, fns: list[Any]) -> InvalidInputError:
    prefer = {f for f in (_source_of(fn)[0] for fn in fns) if f}
    fr = _user_frame(exc, prefer)
    where = f" at {fr.filename}:{fr.lineno}" + (f" ({fr.line.strip()})" if fr.line else "") if fr else ""
    return InvalidInputError(
        f"{what} raised {type(exc).__name__}{where}: {str(exc).strip()[:500]}.{_hint(exc)}"
        " (torchmem runs it under fake tensors; set TORCHMEM_DEBUG=1 for the full traceback)"
    )


def run_once(
    build: BuildFn,
    batch_size: int,
    gpu: str | int | GPU = "H100-80GB",
    *,
    steps: int = 2,
    alloc_conf: str | None = None,
    keep_snapshot: bool = False,
    params: Mapping[str, Any] | None = None,
    kv_cache_attr: Sequence[str] | None = None,
    world_size: int | None = None,
    rank: int = 0,
    strict_values: bool = False,
    extrapolate_decode: bool = False,
    default_device: str | None = None,
    routing: str = "balanced",
    levers: Any = None,
    stacks: bool = True,
    stream: list[Any] | None = None,
    stop_over: int | None = None,
    replay_repeats: bool = True,
    bound: str = "upper",
    lower: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Estimate:
    """Build and run ``steps`` steps of ``build(batch_size, **params)`` on a fake ``gpu``; one
    estimate (``params`` are keyword arguments passed to ``build``, recorded in
    ``Estimate.params``).

    The KV cache (``Estimate.kv_cache``, ``by_category["kv_cache"]``) is found in
    transformers' cache objects and in the module attributes named by ``kv_cache_attr``
    (:mod:`torchmem.fit.run._kv`); transformers (``generate()``, its mask code) runs with its own
    value reads answered as on a GPU (:mod:`torchmem.fit.fakegpu._generate`).

    ``world_size=N`` runs rank ``rank`` (default 0) of an ``N``-rank job under a fake process
    group (:mod:`torchmem.fit.fakegpu._dist`): ``build`` may call ``fully_shard`` or wrap in DDP.

    Values read from tensors (``.item()``, ``float(t)``, ``if t:``, ``.tolist()``) are answered
    by :mod:`torchmem.fit.fakegpu._values`' policy and listed in ``Estimate.assumed_values``;
    ``strict_values=True`` refuses them instead. Outputs whose shape depends on values
    (``nonzero``, ``x[mask]``, ``masked_select``, ``unique``, mixture-of-experts routing) get a
    size by rule (:mod:`torchmem.fit.fakegpu._shapes`; ``routing="balanced"`` or ``"worst"`` for masks
    made by ``one_hot``), listed there too.

    Tensors stay where PyTorch puts them (:mod:`torchmem.fit.fakegpu._placement`): what ``build`` and
    ``step`` create on ``"cuda"`` or move there is GPU memory, what stays on the host is
    ``Estimate.host_peak_bytes``. ``default_device="cuda"`` runs both under
    ``torch.device("cuda")``, so tensors created without a device go to the GPU (as after
    ``torch.set_default_device("cuda")``). A step that puts nothing on the GPU is an error.

    ``levers`` (a :class:`torchmem.fit.levers._levers.LeverRun`) applies memory levers to the model
    and optimizer ``build`` makes, and runs each step as its micro-steps (``torchmem
    estimate --what-if``, :mod:`torchmem.fit.levers._whatif`). ``stacks=False`` records no Python
    stacks (faster by about a quarter; the out-of-memory site and snapshot then have none:
    ``keep_snapshot=True`` with it keeps the allocator's blocks and requests, not their frames).

    ``extrapolate_decode=True`` (one step, no snapshot) runs only the first iterations of
    ``generate()``'s loop through the model and replays the rest into the simulator
    (:mod:`torchmem.fit.run._decode`): the same peaks and verdict, per-category split
    (``by_category``, ``by_module``) and ``kv_cache`` figures, in a fraction of the time;
    ``Estimate.decode_replayed`` counts the iterations replayed (0: none) and
    ``Estimate.decode_split_exact`` is false when the split could not follow them; when
    something after the replay cannot be reproduced the full run is made instead.

    ``replay_repeats=True`` (the default) replays the calls of the outermost module that repeat
    earlier ones (a script's later micro-steps and evaluation forwards) into the simulator
    instead of running the model again (:mod:`torchmem.fit.run._repeat`): the same peaks,
    verdict and split; ``Estimate.calls_replayed`` counts them. ``False`` runs every call.

    What the GPU decides at run time is bounded: ``bound="upper"`` (the default, the
    estimate's figures and verdict) takes the most it can hold, ``"lower"`` the least. Each
    CUDA stream has its own pool, and a block ``record_stream`` marked for another stream is
    free only once that stream's work is done (:mod:`torchmem.fit.fakegpu._streams`): at the
    latest where the program waits for the GPU, at the earliest by the next allocation. cuDNN's
    heuristics size a convolution's workspace (:mod:`torchmem.fit.fakegpu.kernels._conv`): at
    most the largest seen, at least the NHWC copies. A run with either is run again with
    ``"lower"`` for ``Estimate.peak_reserved_lower_bytes`` (``range_causes`` says why; its
    output to stdout and stderr is not shown again; ``progress(message)`` is told before it);
    ``lower=False`` leaves that run out (a search's probes, the what-if's rows: the verdicts
    take the upper figures).

    ``stream=[]`` fills that list with every request made to the simulator
    (:mod:`torchmem.fit.run._stream`), the extrapolated ones included.

    ``stop_over=N`` stops the run as soon as the reserved bytes pass ``N`` (a search checking
    that a value does not fit: the peak only grows, so the verdict is the full run's, made in
    less time): the estimate does not fit, has no ``oom`` and sets ``Estimate.stopped_over``;
    its peaks are those reached when it stopped (lower bounds of the full run's).

    Example:
        >>> import torch
        >>> def build(batch):
        ...     x = torch.zeros(batch, 1024, device="cuda")   # 4 KiB per row
        ...     return lambda: x + 1
        >>> e = run_once(build, 4, "T4", steps=1)
        >>> e.peak_requested_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes
        (32768, 32768, 2097152)
    """
    if not callable(build):
        raise InvalidInputError(
            f"build must be a function build(batch_size) -> step, got {type(build).__name__}"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InvalidInputError(f"steps must be an int >= 1, got {steps!r}")
    card = _gpu(gpu)
    attrs = check_attrs(kv_cache_attr)
    world = check_world_size(world_size)
    rank = check_rank(rank, world)
    on_device = check_default_device(default_device)
    routing = check_routing(routing)
    kw = dict(params or {})
    call = f"build({', '.join([repr(batch_size)] + [f'{k}={v!r}' for k, v in kw.items()])})"
    from torch._subclasses import FakeTensorMode

    sim = _make_sim(card.usable_bytes, alloc_conf, card.total_bytes)
    emu = _emulation(card)
    # a snapshot's blocks carry their Python frames unless stacks=False asks for none (the
    # what-if's step as written keeps one only for the allocator lever's replay)
    frames = keep_snapshot and stacks
    st = _State(sim, emu, card.compute_capability, frames=frames)
    st.stop_over = stop_over
    if bound not in ("upper", "lower"):
        raise InvalidInputError(f"bound must be 'upper' or 'lower', got {bound!r}")
    if emu is not None:
        emu.upper = bound == "upper"
    streams = Streams(sim, st.address, "late" if bound == "upper" else "early")
    st.streams = streams

    readings = SimReadings(
        sim, total_bytes=card.total_bytes, context_bytes=card.context_bytes,
        on_record=lambda on: setattr(st, "frames", on or frames),
    )
    tracker = track(stacks=stacks or frames, listeners=[st.listener])

    def at_oom() -> None:
        # the split at the out-of-memory point is the one at that moment: the modules still
        # running name their children not called yet (their parameters are parameters), and
        # the categories are kept before the unwinding frees the forward's tensors
        name_open = getattr(tracker, "_name_open_modules", None)
        if name_open is not None:
            name_open()
        st.oom_categories = bytes(tracker.trace.category)

    st.on_oom = at_oom
    step: Any = None
    failure: InvalidInputError | None = None
    values = ValueReads(strict=strict_values)
    values.on_read = lambda: streams.synchronize([streams.current])
    gen = GenerationPatches(values)
    kv = KVWatch(attrs, st.sid_of.get)
    feed = None
    if extrapolate_decode and steps == 1 and not keep_snapshot and world is None:
        feed = _DecodeFeed(st, tracker, kv)
        gen.on_check = feed.check
    if stream is not None:
        stream.clear()
        st.stream = StreamRecorder(sim, stream)
    repeats = None
    if replay_repeats and feed is None and not frames:
        repeats = RepeatedCalls(st, tracker, values)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    st.levers = levers
    lever_ctx = levers if levers is not None else _Null()
    # what exists before the run (torch, torchmem, the user's imports: hundreds of thousands of
    # objects) is left out of the garbage collector's passes while it runs: a step or script
    # that makes many objects (fake tensors, data preparation) otherwise pays for full passes
    # over them, several times what its plain run pays (a process that froze objects itself
    # keeps its own freeze)
    with _world(world, fake_mode, build, st, tracker, rank), tracker, _gc_frozen():
        with fake_mode, fake_cuda(
            card.name, card.compute_capability, empty_cache=sim.empty_cache, readings=readings,
            clear_workspaces=st.clear_workspaces,
            total_bytes=card.total_bytes,
            context_bytes=card.context_bytes, placement=st.pl, devices=world or 1, values=values,
            streams=streams,
        ):
            emu_ctx = emu if emu is not None else _Null()
            with emu_ctx, _SimMode(st, gen, values, routing), kv, lever_ctx, \
                    SimulatedPointers(st, values), _own_hooks_unannounced(), \
                    compile_calls() as compiled:
                try:
                    gen.install()
                    if repeats is not None:
                        repeats.install()
                    try:
                        with on_device():
                            step = build(batch_size if levers is None
                                         else levers.batch(batch_size), **kw)
                    except _Abort:
                        raise
                    except Exception as e:
                        if st.oom is None:
                            if isinstance(e, BuildError):
                                failure = e
                            else:
                                failure = _user_error(e, call, [build])
                                failure.__cause__ = e
                    if failure is None and st.oom is None and not callable(step):
                        file, line = _source_of(build)
                        at = f" (defined at {file}:{line})" if file else ""
                        failure = InvalidInputError(
                            f"{call}{at} returned {type(step).__name__}, expected a "
                            "zero-argument step() callable that runs one training iteration; "
                            "fix: end build with `return step`"
                        )
                    gen.install()  # build may have imported transformers
                    for _ in range(steps):
                        if failure is not None or st.oom is not None:
                            break
                        try:
                            with on_device():
                                if levers is None:
                                    step()
                                else:
                                    levers.run_step(step)
                        except _Abort:
                            raise
                        except Exception as e:
                            if st.oom is None:
                                failure = _user_error(e, "step()", [step, build])
                                failure.__cause__ = e
                except _Abort:
                    pass
                finally:
                    gen.remove()
                    if repeats is not None:
                        repeats.remove()
                    st.end_seq = len(tracker) - 1
                    if st.dist is not None:
                        st.dist.walk()  # the state at the end, before build's objects go
                    if keep_snapshot and failure is None:
                        # the state at the end of the last step (or at the OOM point), before
                        # build's objects are dropped
                        st.snapshot = sim.snapshot()
                    step = None
    if failure is not None:
        raise failure
    if tracker.listener_errors:
        raise TorchmemError(
            f"internal error in the estimate's allocator feed: {tracker.listener_errors[0]!r}"
        )
    if (feed is not None and feed.rec.replayed and not feed.rec.valid
            or repeats is not None and repeats.replayed and not repeats.valid):
        return run_once(build, batch_size, gpu, steps=steps, alloc_conf=alloc_conf,
                        params=params, kv_cache_attr=kv_cache_attr, world_size=world_size,
                        rank=rank,
                        strict_values=strict_values, default_device=default_device,
                        routing=routing, levers=levers, stacks=stacks, stream=stream,
                        stop_over=stop_over, bound=bound, lower=lower, progress=progress,
                        replay_repeats=repeats is None or repeats.valid)
    if st.oom is None and st.peak_req == 0 and st.host_peak > 0 and not st.ws_most:
        file, line = _source_of(build)
        at = f" ({file}:{line})" if file else ""
        raise InvalidInputError(
            f"{call}{at} and its step put nothing on the GPU: all "
            f"{st.host_peak:,} bytes of its tensors stayed on the host (tensors created without "
            "a device are CPU tensors, as in PyTorch); expected a step that runs on the GPU; "
            "fix: create tensors with device='cuda' and move the model with .to('cuda'), or "
            "pass default_device='cuda' (CLI: --default-device cuda) to put tensors created "
            "without a device on the GPU"
        )
    est = _result(card, batch_size, steps, alloc_conf, st, tracker, keep_snapshot, kv, feed)
    est.params = kw
    est.rank = rank
    if repeats is not None:
        est.calls_replayed = repeats.replayed
    est.assumed_values = [r.to_dict() for r in values.reads]
    from torchmem.fit.fakegpu import _bnb, _checkpoints

    est.notes.extend(_checkpoints.NOTES)  # models loaded from their config alone
    if compiled:  # torch.compile ran eagerly here: the report says so
        est.notes.append(compile_note(compiled))
    if _bnb.PAGED:
        est.notes.append(_bnb.paged_note())
    if emu is not None:  # None: a plain fake run without the CUDA emulation (benchmarks/gpu_truth.py)
        est.attention_kernel, attention_notes = emu.attention_report()
        est.notes.extend(attention_notes)
    if world is not None:
        _dist_result(est, world, st, tracker)
    closed = emu.closed_calls if emu is not None else 0
    if (streams.recorded or closed) and bound == "upper" and lower and st.oom is None \
            and not est.incomplete:
        if progress is not None:
            progress("the lower figure: running the program again with the GPU's run-time "
                     "choices at their least")
        _lower_figure(est, streams.recorded, closed, lambda: run_once(
            build, batch_size, gpu, steps=steps, alloc_conf=alloc_conf, params=params,
            kv_cache_attr=kv_cache_attr, world_size=world_size, rank=rank,
            strict_values=strict_values, default_device=default_device, routing=routing,
            levers=levers, stacks=False, replay_repeats=replay_repeats, bound="lower"))
    return est


def _lower_figure(est: Estimate, recorded: int, closed: int, run_lower: Callable[[], Estimate]
                  ) -> None:
    """Set ``est.peak_reserved_lower_bytes`` from the same run with the GPU's run-time choices
    at their least (``run_lower``, its output not shown again), and say which choices make
    the range."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            low = run_lower()
    except TorchmemError as e:  # the figures stand; only the range is missing
        est.notes.append(f"no lower figure: its run failed ({str(e).splitlines()[0][:200]})")
        return
    est.peak_reserved_lower_bytes = min(low.peak_reserved_bytes, est.peak_reserved_bytes)
    if recorded:
        est.range_causes.append(
            f"record_stream marked {recorded:,} block{'s' if recorded != 1 else ''} for "
            "another stream: a block is free only once that stream's work is done; the "
            "figures take the latest the GPU can finish it (where the program waits for it), "
            "the lower one the earliest (at once)")
    if closed:
        est.range_causes.append(
            f"cuDNN sized the workspace of {closed:,} convolution call"
            f"{'s' if closed != 1 else ''} by its own heuristics: the figures take the most "
            "it was seen to take (NHWC copies, up to 15 split-K partial filters of at most "
            "8 MiB), the lower one the NHWC copies alone")


def check_default_device(device: Any) -> Callable[[], Any]:
    """Validate ``default_device`` (``None``, ``"cpu"`` or ``"cuda"``): a context factory
    that puts tensors created without a device there.

    Example:
        >>> with check_default_device("cuda")():
        ...     pass
        >>> check_default_device("gpu")
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: default_device must be None, 'cpu' or 'cuda', got 'gpu'; fix: pass 'cuda' to create tensors without a device on the GPU
    """
    if device is None or device == "cpu" or device == torch.device("cpu"):
        return contextlib.nullcontext
    if device in ("cuda", "cuda:0") or device == torch.device("cuda"):
        return lambda: torch.device("cuda")
    raise InvalidInputError(
        f"default_device must be None, 'cpu' or 'cuda', got {device!r}; fix: pass 'cuda' to "
        "create tensors without a device on the GPU"
    )


@contextlib.contextmanager
def _world(
    world: int | None, fake_mode: Any, build: Any, st: _State, tracker: Any, rank: int = 0
) -> Iterator[None]:
    """For a per-rank estimate (``world`` ranks): the fake process group and the watch of
    the run's categories and collectives (:mod:`torchmem.fit.fakegpu._dist`); nothing otherwise."""
    if world is None:
        yield
        return
    with FakeWorld(world, fake_mode, [getattr(build, "__globals__", {})], (_SimMode,),
                   rank=rank), DistWatch(
        st.sid_of.get, lambda: len(tracker)
    ) as watch:
        st.dist = watch
        yield


@contextlib.contextmanager
def _own_hooks_unannounced() -> Iterator[None]:
    """Without torch's warning that ``torch.compile(module)`` meets global module hooks: the
    hooks are the estimate's own tracker's, not the user's (the user's own program gets no
    such warning on the GPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there "
                                r"are global hooks on modules")
        yield


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Inside, the objects that existed on entry are out of the garbage collector's passes
    (``gc.freeze``); on exit they are back in (``gc.unfreeze``). Nothing is done where the
    process has frozen objects itself.

    Example:
        >>> import gc
        >>> with _gc_frozen():
        ...     gc.get_freeze_count() > 0
        True
        >>> gc.get_freeze_count()
        0
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _result(
    card: GPU, batch_size: int, steps: int, alloc_conf: str | None, st: _State, tracker: Any,
    keep_snapshot: bool,
    kv: KVWatch | None = None,
    feed: _DecodeFeed | None = None,
) -> Estimate:
    by_cat = dict.fromkeys(_REPORT_KEYS, 0)
    kv_ids = kv.ids if kv is not None else set()
    by_mod: dict[str, int] = {}
    replayed = feed.rec.replayed if feed is not None else 0
    if feed is not None and feed.exact and feed.peak_split is not None:  # peak in the replay
        for key, n in feed.peak_split[1].items():
            by_cat[key] += n
        by_mod = dict(feed.peak_split[2])
    elif st.peak_req_seq >= 0:
        for n, key, mod in _live_at(tracker, st.peak_req_seq, st, kv_ids).values():
            by_cat[key] += n
            name = mod or "(outside any module)"
            by_mod[name] = by_mod.get(name, 0) + n
    if st.peak_extra is not None:  # replayed calls' own blocks live at the peak
        for key, n in st.peak_extra[0].items():
            by_cat[key] = by_cat.get(key, 0) + n
        for name, n in st.peak_extra[1].items():
            by_mod[name] = by_mod.get(name, 0) + n
        by_mod = {k: n for k, n in by_mod.items() if n}
    by_cat["workspace"] = st.ws_at_peak
    top = dict(sorted(by_mod.items(), key=lambda kv: -kv[1]))  # every module, largest first
    return Estimate(
        gpu=card.name,
        batch_size=batch_size,
        fits=st.oom is None,
        capacity_bytes=card.total_bytes,
        overhead_bytes=card.context_bytes,
        peak_requested_bytes=st.peak_req,
        peak_allocated_bytes=st.peak_alloc,
        peak_reserved_bytes=st.peak_res,
        by_category=by_cat,
        by_module=top,
        oom=None if st.stopped else st.oom,
        stopped_over=st.stop_over if st.stopped else None,
        fragmentation_bytes=st.frag_at_peak,
        workspace_bytes=st.ws_most,
        overhead={"cuda_context": card.context_bytes},
        steps=steps,
        alloc_conf=alloc_conf,
        compute_capability=card.compute_capability,
        snapshot=st.snapshot,
        kv_cache=_kv_cache(kv, by_cat["kv_cache"], st, tracker, feed),
        host_peak_bytes=st.host_peak,
        decode_replayed=replayed,
        decode_split_exact=not replayed or feed is None or feed.exact,
    )


def _dist_result(est: Estimate, world: int, st: _State, tracker: Any) -> None:
    """A per-rank estimate's own figures: the world size, the model state at the end of the
    last ``optimizer.step()``, the collectives and their largest buffers."""
    watch = st.dist
    est.world_size = world
    est.collectives = {
        name: {"calls": calls, "largest_buffer_bytes": size}
        for name, (calls, size) in sorted(watch.collectives.items())
    }
    if watch.model_state_pos > 0:
        state = dict.fromkeys(("parameter", "gradient", "optimizer_state", "communication"), 0)
        for n, key, _ in _live_at(tracker, watch.model_state_pos - 1, st).values():
            if key in state:
                state[key] += n
        est.model_state = state
    est.notes.append(
        f"rank {est.rank} of {world} (a fake process group: collectives move no data; every buffer "
        "has its per-rank size)"
    )


def _kv_cache(kv: KVWatch | None, at_peak: int, st: _State, tracker: Any,
              feed: _DecodeFeed | None = None) -> KVCache | None:
    """The KV cache's figures, ``None`` when the run had no cache; with decode steps
    replayed (``feed``), carried on over the replayed iterations."""
    if kv is None or not kv.ids:
        return None
    grown = feed.kv_figures() if feed is not None else None
    if grown is not None and feed is not None:
        end = feed.kv_end_bytes(st.end_seq)
        max_bytes, tokens = grown
    else:
        (end,) = kv_live_bytes(tracker.events(), kv.ids, [st.end_seq])
        max_bytes, tokens = kv.max_bytes, kv.tokens
    return KVCache(
        peak_bytes=at_peak,
        end_bytes=end,
        max_bytes=max_bytes,
        bytes_per_token=kv.bytes_per_token,
        bytes_per_sequence=max_bytes // kv.batch if kv.batch else 0,
        tokens=tokens,
        batch=kv.batch,
        source=", ".join(sorted(kv.sources)),
    )
