"""torchmem's pytest plugin: tensor-memory limits, leak checks and GPU fit, as markers.

Installed with torchmem (the ``pytest11`` entry point ``torchmem``); nothing to configure.

Markers:

- ``@pytest.mark.limit_memory("64 MiB", device="cpu")``: the test fails when the peak of live
  tensor memory its body allocates on that device (torchmem's tracker) exceeds the limit. On CUDA
  the allocator's own peak is checked too (``metric="allocated"``, the default there,
  ``"reserved"`` or ``"active"``), measured after the CUDA context, the RNG and cuBLAS workspace
  are warmed up, so first-use allocations are never counted as the test's (``"reserved"``
  counts only what the test made the allocator take from the device: a request that a block
  cached before the test can serve does not grow it). ``device="cuda"``
  means the current CUDA device of the process (each pytest-xdist worker its own). The message
  shows the peak, the limit and the largest allocations live at the peak (operator, module, call
  site).
- ``@pytest.mark.limit_leaks("1 MiB")``: fails when the tensor memory the body allocated is
  still alive after it (after a garbage collection) beyond the limit, listing what leaked,
  where it was allocated and, for the three largest, what still holds it
  (:func:`torchmem.why_alive`'s retention paths). ``device=`` restricts the check to one device.
- ``@pytest.mark.fits_on("A100-40GB", batch_size=64)``: the test returns (or yields) a
  ``build(batch_size)`` function (:func:`torchmem.fit.estimate`'s protocol); the plugin runs the
  estimate on the CPU and fails, with the estimate's report, when the step would not fit. Other
  keywords (``steps``, ``alloc_conf``) go to :func:`torchmem.fit.estimate`.

Options: ``--torchmem`` tracks every test and prints the tests with the highest peaks at the end
(``--torchmem-top N``, default 5); ``--torchmem-dir DIR`` keeps each tracked test's trace as
``DIR/<test id>.tmtrace`` for ``torchmem view`` (and implies ``--torchmem``).

Only the test body is tracked (fixtures run outside it). A test with none of the markers, in a
run without the options, is not touched: no tracker is started and torch is not imported by the
plugin. Bad marker arguments (``"lots"``, ``device="tpu"``) are collection errors that say what
was expected.

Layout: this module holds the hooks; ``_markers`` parses the markers' arguments, ``_report``
reads a tracked body's events for the failure messages.

Example:
    >>> parse_marker_limit("64 MB", "limit_memory"), parse_marker_limit(1024, "limit_leaks")
    (64000000, 1024)
"""

from __future__ import annotations

import gc
import inspect
import os
import re
import sys
from collections.abc import Generator, Iterator
from typing import Any, Optional

import pytest

from torchmem.errors import InvalidInputError
from torchmem.pytest_plugin._markers import (
    FitsOn,
    LeakLimit,
    MemoryLimit,
    parse_item,
    parse_marker_limit,
)
from torchmem.pytest_plugin._report import live_at_end, rows_text, site_of, top_live_at_peak
from torchmem.units import format_bytes

__all__ = [
    "FitsOn",
    "LeakLimit",
    "MemoryLimit",
    "live_at_end",
    "parse_marker_limit",
    "top_live_at_peak",
]

_MARKERS = ("limit_memory", "limit_leaks", "fits_on")
_STATE_KEY = pytest.StashKey["_Session"]()


# --------------------------------------------------------------------------- CUDA


def _cuda_warm(device: str) -> Any:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"torchmem limit_memory on {device!r}: CUDA is not available")
    dev = torch.device(device)
    torch.cuda.init()
    with torch.cuda.device(dev):
        a = torch.randn(64, 64, device=dev)  # the context and the RNG state
        (a @ a).sum().item()  # cuBLAS handle and workspace
        del a
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_stats(dev)


def _cuda_peak(device: str, metric: str, before: Any) -> int:
    import torch

    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    return int(stats[f"{metric}_bytes.all.peak"]) - int(before.get(f"{metric}_bytes.all.current", 0))


# --------------------------------------------------------------------------- the session state


class _Session:
    def __init__(self, config: Any) -> None:
        self.report = bool(config.getoption("torchmem")) or bool(config.getoption("torchmem_dir"))
        self.top = int(config.getoption("torchmem_top"))
        self.dir = config.getoption("torchmem_dir")
        self.peaks: list[tuple[int, str, str]] = []  # (bytes, device, nodeid)


class _PeakCollector:
    """Collects each tracked test's peak from its report (this process's, or a pytest-xdist
    worker's: user properties travel with the report)."""

    def __init__(self, state: _Session) -> None:
        self.state = state

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "call":
            return
        for key, value in getattr(report, "user_properties", ()):
            if key == "torchmem_peak":
                self.state.peaks.append((int(value[0]), str(value[1]), report.nodeid))


def _trace_name(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:180] + ".tmtrace"


def pytest_addoption(parser: Any) -> None:
    """The ``--torchmem``, ``--torchmem-top`` and ``--torchmem-dir`` options.

    Example:
        >>> callable(pytest_addoption)
        True
    """
    group = parser.getgroup("torchmem", "tensor memory (torchmem)")
    group.addoption("--torchmem", action="store_true", default=False,
                    help="track every test's tensor memory and list the highest peaks at the end")
    group.addoption("--torchmem-top", type=int, default=5, metavar="N",
                    help="how many tests --torchmem lists (default 5)")
    group.addoption("--torchmem-dir", default=None, metavar="DIR",
                    help="keep each tracked test's trace in DIR (for 'torchmem view'); "
                         "implies --torchmem")


def pytest_configure(config: Any) -> None:
    """Register the markers and the session state.

    Example:
        >>> callable(pytest_configure)
        True
    """
    config.addinivalue_line(
        "markers",
        "limit_memory(limit, device='cpu', metric=None): fail when the test body's peak of live "
        "tensor memory on the device exceeds limit (torchmem)",
    )
    config.addinivalue_line(
        "markers",
        "limit_leaks(limit, device=None): fail when tensor memory allocated by the test body is "
        "still alive after it, beyond limit (torchmem)",
    )
    config.addinivalue_line(
        "markers",
        "fits_on(gpu, batch_size=None): the test returns a build(batch_size) function; fail when "
        "its training step would not fit on the GPU (torchmem.fit.estimate, runs on CPU)",
    )
    top = config.getoption("torchmem_top", 5)
    if top is not None and int(top) < 1:
        raise pytest.UsageError(f"--torchmem-top expects a whole number >= 1, got {top}")
    d = config.getoption("torchmem_dir", None)
    if d:
        if os.path.exists(d) and not os.path.isdir(d):
            raise pytest.UsageError(
                f"--torchmem-dir {d!r} is a file; expected a folder (it is created if missing)"
            )
        os.makedirs(d, exist_ok=True)
    config.stash[_STATE_KEY] = _Session(config)
    if config.stash[_STATE_KEY].report:
        config.pluginmanager.register(_PeakCollector(config.stash[_STATE_KEY]),
                                      "torchmem-peak-collector")
    if any(str(getattr(p, "__name__", "")).startswith("pytest_memray")
           for p in config.pluginmanager.get_plugins()):
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(
                "torchmem: pytest-memray is also loaded and acts on the same markers, "
                "limit_memory and limit_leaks (for host memory, where 'MB' means MiB and 'MiB' "
                "is an error), so a marked test is checked by both. Fix: run with -p no:memray "
                "for torchmem's tensor-memory limits, or -p no:torchmem for memray's"
            ),
            stacklevel=2,
        )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: Any) -> Generator[None, Any, Any]:
    """Turn bad marker arguments into a collection error of the file that holds the test.

    Example:
        >>> callable(pytest_make_collect_report)
        True
    """
    report = yield
    if report.outcome != "passed" or not report.result:
        return report
    problems = []
    for item in report.result:
        if not isinstance(item, pytest.Item):
            continue
        try:
            item.stash[_ITEM_KEY] = parse_item(item)
        except InvalidInputError as e:
            problems.append(f"{item.nodeid}: {e}")
    if problems:
        report.outcome = "failed"
        report.longrepr = "torchmem: bad marker arguments\n" + "\n".join(problems)
        report.result = []
    return report


_ITEM_KEY = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: Any) -> Any:
    """Collect a generator test that carries ``fits_on`` (it yields its ``build``).

    Example:
        >>> pytest_pycollect_makeitem(None, "x", 1) is None
        True
    """
    if not inspect.isgeneratorfunction(obj) or not collector.funcnamefilter(name):
        return None
    marks = getattr(obj, "pytestmark", [])
    if not any(getattr(m, "name", None) == "fits_on" for m in marks):
        return None
    return list(collector._genfunctions(name, obj))


def _markers_of(item: Any) -> dict[str, Any]:
    got = item.stash.get(_ITEM_KEY, None)
    if got is None:  # an item not made by a Module collector (a plugin's own items)
        got = parse_item(item)
        item.stash[_ITEM_KEY] = got
    return got


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Any:
    """Run a ``fits_on`` test: call it for its ``build``, estimate, fail when it does not fit.

    Example:
        >>> callable(pytest_pyfunc_call)
        True
    """
    fits = _markers_of(pyfuncitem).get("fits_on")
    if fits is None:
        return None
    func = pyfuncitem.obj
    args = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
    result = func(**args)
    gen: Optional[Iterator[Any]] = None
    if inspect.isgenerator(result):
        gen = result
        try:
            result = next(gen)
        except StopIteration:
            pytest.fail(f"{pyfuncitem.nodeid}: @pytest.mark.fits_on expects the test to yield a "
                        "build(batch_size) function; it yielded nothing", pytrace=False)
    if not callable(result):
        pytest.fail(
            f"{pyfuncitem.nodeid}: @pytest.mark.fits_on expects the test to return (or yield) a "
            f"build(batch_size) function that returns step(); it returned "
            f"{type(result).__name__}: {result!r:.80}. Fix: end the test with 'return build'",
            pytrace=False,
        )
    from torchmem.fit import estimate

    try:
        est = estimate(result, gpu=fits.gpu, batch_size=fits.batch_size, **fits.options)
    except InvalidInputError as e:
        pytest.fail(f"{pyfuncitem.nodeid}: @pytest.mark.fits_on({fits.gpu!r}): {e}",
                    pytrace=False)
    finally:
        if gen is not None:
            for _ in gen:  # the code after the yield runs, like a fixture's teardown
                pass
    pyfuncitem.user_properties.append(("torchmem_estimate", est.to_dict()))
    if not est.fits:
        import io

        from torchmem.cli.estimate import render_text

        buf = io.StringIO()
        render_text(est, file=buf)
        pytest.fail(
            f"torchmem: the training step does not fit on {est.gpu}"
            f"{'' if est.batch_size is None else f' at batch size {est.batch_size}'}\n"
            + _drop_runner_frames(buf.getvalue()),
            pytrace=False,
        )
    return True


_RUNNER_FRAME = re.compile(r"^\s+\S*[/\\](_pytest|pluggy)[/\\]\S+:\d+:\S+\s*$")


def _drop_runner_frames(text: str) -> str:
    # the estimate's stack lines of pytest's and pluggy's own frames say nothing about the test
    return "\n".join(line for line in text.split("\n") if not _RUNNER_FRAME.match(line))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: Any) -> Generator[None, Any, Any]:
    """Track the test body when a marker or an option asks for it; check the limits after.

    Example:
        >>> callable(pytest_runtest_call)
        True
    """
    state: Optional[_Session] = item.config.stash.get(_STATE_KEY, None)
    markers = _markers_of(item)
    mem: Optional[MemoryLimit] = markers.get("limit_memory")
    leaks: Optional[LeakLimit] = markers.get("limit_leaks")
    if mem is None and leaks is None and not (state is not None and state.report):
        return (yield)  # zero overhead: nothing asked for tracking

    from torchmem._device import device_name
    from torchmem.capture.tracker import track

    mem_device = None if mem is None else device_name(mem.device)
    cuda_before = None
    metric = None
    if mem is not None and mem_device is not None and mem_device.startswith("cuda"):
        metric = mem.metric or "allocated"
        cuda_before = _cuda_warm(mem_device)
    held: dict[int, Any] = {}  # storage id -> weak reference, for the leak report's paths
    listeners = [] if leaks is None else [_storage_refs(held)]
    tracker = track(stacks=True, stack_depth=6, metadata={"pytest": item.nodeid},
                    listeners=listeners)
    tracker.__enter__()
    try:
        result = yield
        if leaks is not None:
            gc.collect()
            tracker.mark("torchmem-leak-check")  # records the frees the collection caused
    finally:
        tracker.__exit__(*sys.exc_info())
        if state is not None and state.report:
            peaks = tracker.peak()
            if peaks:
                dev, top = max(peaks.items(), key=lambda kv: kv[1])
                # on the report, so that the controller of pytest-xdist's workers sees it too
                item.user_properties.append(("torchmem_peak", [top, dev]))
            if state.dir:
                tracker.save(os.path.join(state.dir, _trace_name(item.nodeid)))

    failures = []
    if mem is not None and mem_device is not None:
        tracked = tracker.peak().get(mem_device, 0)
        if tracked > mem.limit:
            rows = top_live_at_peak(tracker.events(), mem_device)
            failures.append(
                "\n".join([
                    f"torchmem: test used too much tensor memory on {mem_device}: peak "
                    f"{format_bytes(tracked)} ({tracked} bytes) > limit {format_bytes(mem.limit)} "
                    f"({mem.limit} bytes)",
                    "  largest allocations live at the peak:",
                    *rows_text(rows),
                ])
            )
        if metric is not None and cuda_before is not None:
            alloc_peak = _cuda_peak(mem_device, metric, cuda_before)
            if alloc_peak > mem.limit:
                failures.append(
                    f"torchmem: the CUDA allocator's {metric} peak on {mem_device} was "
                    f"{format_bytes(alloc_peak)} ({alloc_peak} bytes) > limit "
                    f"{format_bytes(mem.limit)} ({mem.limit} bytes)"
                )
    if leaks is not None:
        left = live_at_end(tracker.events(), leaks.device)
        total = sum(e.nbytes for e in left)
        if total > leaks.limit:
            where = "" if leaks.device is None else f" on {leaks.device}"
            lines = [
                f"torchmem: test leaked {format_bytes(total)} ({total} bytes) of tensor memory"
                f"{where} > limit {format_bytes(leaks.limit)} ({leaks.limit} bytes): "
                f"{len(left)} storage(s) allocated in the test are alive after it (after gc)",
                f"    {'bytes':>12}  operator / module / allocated at",
            ]
            for i, e in enumerate(left[:10]):
                lines.append(f"    {format_bytes(e.nbytes):>12}  {e.op or '?'} / "
                             f"{e.module or '-'} / {site_of(e)}  [{e.device}]")
                if i < _LEAK_PATHS:
                    lines.extend(_held_by(held.get(e.storage)))
            if len(left) > 10:
                lines.append(f"    ... and {len(left) - 10} more")
            failures.append("\n".join(lines))
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """With ``--torchmem``: the tests with the highest peaks of tensor memory.

    Example:
        >>> callable(pytest_terminal_summary)
        True
    """
    state: Optional[_Session] = config.stash.get(_STATE_KEY, None)
    if state is None or not state.report:
        return
    terminalreporter.write_sep("=", "torchmem: highest tensor-memory peaks")
    rows = sorted(state.peaks, key=lambda r: (-r[0], r[2]))[: state.top]
    if not rows:
        terminalreporter.write_line("no tensor memory was allocated by a tracked test")
    for nbytes, dev, nodeid in rows:
        terminalreporter.write_line(f"{format_bytes(nbytes):>12}  {dev:<8}  {nodeid}")
    if state.dir:
        terminalreporter.write_line(
            f"traces in {os.path.abspath(state.dir)} (open one with: torchmem view FILE)"
        )


#: How many of the largest leaked storages get their retention paths in a limit_leaks failure.
_LEAK_PATHS = 3


def _storage_refs(held: dict[int, Any]) -> Any:
    """A tracker listener keeping a weak reference to each storage the test body allocates
    (dropped when it is freed), so that a leak report can say what still holds it."""
    import weakref

    from torchmem.model.events import EventKind

    def on_event(event: Any, storage: Any) -> None:
        if event.kind is EventKind.ALLOC and storage is not None:
            held[event.storage] = weakref.ref(storage)
        elif event.kind is EventKind.FREE:
            held.pop(event.storage, None)

    return on_event


def _held_by(ref: Any) -> list[str]:
    """The retention paths of a leaked storage (:func:`torchmem.why_alive`), as indented lines."""
    storage = None if ref is None else ref()
    if storage is None:
        return []
    from torchmem.capture.retention import why_alive

    found = why_alive(storage, max_paths=2, timeout=30.0, _skip=1)
    del storage
    lines = [f"        held by: {p}" for p in found]
    if not found:
        lines.append(f"        held by: no path found{f' ({found.note})' if found.note else ''}")
    if found.stopped:
        lines.append(f"        (search stopped early: {found.stopped})")
    return lines
