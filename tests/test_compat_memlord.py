"""torchmem.compat.MemLord: MemLord's API and observable behaviour on an exact torchmem.Ledger.

Covers every behaviour MemLord's own test-suite checks (tests/test_core*.py, test_auto_gc.py,
test_finalizer.py, test_snake.py, test_regression.py, test_dtype_casts.py, test_multi_device.py,
test_resource_calls.py of ModelCloud/MemLord), with exact byte counts computed another way
(``numel() * element_size()``, parameter and buffer sums) instead of lower bounds.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import torchmem.compat.memlord as memlord_mod
from torchmem.compat import MemLord
from torchmem.compat.memlord import (
    MEMLORD_DEFAULT_STRATEGY,
    UnsupportedObjectError,
    format_bytes,
    get_device_mem_stats,
)
from torchmem.errors import InvalidInputError

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.complex64]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def module_nbytes(m: nn.Module) -> int:
    return sum(nbytes(p) for p in m.parameters()) + sum(nbytes(b) for b in m.buffers())


@pytest.fixture(autouse=True)
def _debug_off_and_hooks_restored() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in ("DEBUG", "TORCHMEM_DEBUG") if k in os.environ}
    empty, to = torch.empty, torch.Tensor.to
    yield
    for k in ("DEBUG", "TORCHMEM_DEBUG"):
        os.environ.pop(k, None)
    os.environ.update(saved)
    gc.collect()  # hooks of MemLords that died without disable() are removed with them
    assert torch.empty is empty and torch.Tensor.to is to
    # MemLord's usage poller (get_device_mem_stats) lives for the process, as MemLord's does;
    # later test files count the poller threads, so each test here closes it
    with memlord_mod._poller_lock:
        poller, memlord_mod._poller = memlord_mod._poller, None
    if poller is not None:
        poller.close()


@pytest.fixture
def lord() -> MemLord:
    return MemLord(auto_gc_strategy={})


@pytest.fixture
def hooked(lord: MemLord) -> Iterator[MemLord]:
    """A MemLord with Python hooks on (factories and clone), turned off after the test."""
    hooks = lord.hook_into_python()
    yield lord
    hooks.disable()


# ----------------------------------------------------------------------------- core API


def test_allocate_free_tensor_exact(lord: MemLord) -> None:
    t = torch.empty(256, 256)
    lord.allocate(t)
    assert lord.allocated(CPU) == (nbytes(t), "256 KiB")
    assert lord.allocated() == lord.allocated("cpu") == (262144, "256 KiB")
    lord.free(t)
    assert lord.allocated(CPU) == (0, "0 B")
    assert lord.freed(CPU) == (nbytes(t), "256 KiB")


def test_allocate_free_module_params_and_buffers(lord: MemLord) -> None:
    m = nn.Sequential(nn.Linear(128, 256), nn.BatchNorm1d(256))
    expected = module_nbytes(m)
    assert expected == (128 * 256 + 256 + 256 * 2) * 4 + (256 * 2 * 4 + 8)  # params + buffers
    lord.allocate(m)
    assert lord.allocated(CPU)[0] == expected
    lord.free(m)
    assert (lord.allocated()[0], lord.freed()[0]) == (0, expected)


def test_tuple_single_call_one_summary_per_device(lord: MemLord, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ["DEBUG"] = "1"
    t1, t2 = torch.empty(128, 128), torch.empty(64, 64)
    total = nbytes(t1) + nbytes(t2)
    lord.allocate((t1, t2))
    out = capsys.readouterr().out
    assert out.count("[allocate-summary]") == 1
    assert "MemLord: [allocate] +80 KiB on cpu, now 80 KiB" in out
    assert "MemLord: [allocate-summary] cpu: 80 KiB" in out
    assert lord.allocated(CPU)[0] == total
    lord.free((t1, t2))
    out = capsys.readouterr().out
    assert out.count("[free-summary]") == 1
    assert "MemLord: [free] -80 KiB on cpu, now 0 B" in out
    assert "MemLord: [freed] query=cpu, result=80 KiB" in out or lord.freed(CPU)[0] == total
    assert lord.freed(CPU)[0] == total


def test_debug_off_prints_nothing(lord: MemLord, capsys: pytest.CaptureFixture[str]) -> None:
    t = torch.empty(10)
    lord.allocate(t)
    lord.free(t)
    lord.allocated()
    lord.reset()
    assert capsys.readouterr().out == ""


def test_debug_query_and_type_summaries(capsys: pytest.CaptureFixture[str]) -> None:
    os.environ["DEBUG"] = "1"
    lord = MemLord({})
    lord._allocated_by_dev[torch.device("cuda", 0)] = 10
    lord._allocated_by_dev[torch.device("cuda", 1)] = 20
    lord.allocate(torch.empty(4))
    lord.allocated(torch.device("cuda"))
    lord.reset()
    out = capsys.readouterr().out
    assert "[allocate-summary] cuda:0: 10 B" in out and "[allocate-summary] cuda:1: 20 B" in out
    assert "[allocate-summary] cuda: 30 B" in out  # a type with several devices gets a total
    assert "[allocate-summary] cpu: 16 B" in out
    assert "[allocated] query=cuda, result=30 B" in out
    assert "[reset] counters cleared" in out


def test_type_aggregation_and_index_selection(lord: MemLord) -> None:
    t1, t2 = torch.empty(100, 100), torch.empty(200, 50)
    lord.allocate((t1, t2))
    assert lord.allocated(torch.device("cpu")) == lord.allocated(CPU) == lord.allocated()
    lord._allocated_by_dev[torch.device("cuda", 0)] = 1000
    lord._allocated_by_dev[torch.device("cuda", 1)] = 24
    assert lord.allocated(torch.device("cuda"))[0] == 1024
    assert lord.allocated(torch.device("cuda", 1))[0] == 24
    assert lord.allocated("cuda:0")[0] == 1000
    assert lord.allocated()[0] == nbytes(t1) + nbytes(t2) + 1024


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_exact(lord: MemLord, dtype: torch.dtype) -> None:
    t = torch.empty(257, 129, dtype=dtype)
    lord.allocate(t)
    assert lord.allocated(CPU)[0] == 257 * 129 * torch.empty(0, dtype=dtype).element_size()
    lord.free(t)
    assert lord.freed(CPU)[0] == nbytes(t)


def test_no_drift_views_and_repeats_count_once(lord: MemLord) -> None:
    x = torch.zeros(1000)
    lord.allocate(x)
    lord.allocate(x[10:])  # MemLord counted this view again (dedup only inside one call)
    lord.allocate((x, x.view(10, 100)))
    assert lord.allocated()[0] == 4000
    lord.free(x)
    lord.free(x[5:])  # already credited
    assert (lord.allocated()[0], lord.freed()[0]) == (0, 4000)
    del x
    gc.collect()
    assert lord.freed()[0] == 4000  # its death is not credited a second time


def test_free_of_uncounted_credits_nothing(lord: MemLord) -> None:
    lord.free(torch.zeros(10))
    assert lord.freed() == (0, "0 B") and lord.ledger.untracked_frees == 1


def test_meta_tensors_are_not_counted(lord: MemLord) -> None:
    lord.allocate(torch.empty(1000, device="meta"))
    assert lord.allocated() == (0, "0 B")


def test_sparse_counts_its_components(lord: MemLord) -> None:
    s = torch.eye(5).to_sparse()
    lord.allocate(s)
    assert lord.allocated()[0] == nbytes(s._indices()) + nbytes(s._values())


def test_reset_keeps_following_counted_storages(lord: MemLord) -> None:
    lord.set_callsite_tracking(True)
    x = torch.zeros(4)
    lord.allocate(x)
    lord.reset()
    assert lord.allocated() == (0, "0 B") and lord.top_alloc_site() is None
    del x
    assert lord.freed() == (16, "16 B")


def test_human_strings_match_memlord_format() -> None:
    assert [format_bytes(n) for n in (0, 1, 1023, 1024, 1536, 1127, 2**30, 1181116006, 2**50)] == [
        "0 B", "1 B", "1023 B", "1 KiB", "1.5 KiB", "1.1 KiB", "1 GiB", "1.1 GiB", "1024 TiB",
    ]


def test_bad_input_raises_invalid_input_error(lord: MemLord) -> None:
    with pytest.raises(UnsupportedObjectError, match="expected a torch.Tensor.*got builtins.str"):
        lord.allocate("x")
    with pytest.raises(TypeError, match="in the tuple"):  # MemLord raised TypeError: still true
        lord.free((torch.zeros(1), 3))
    with pytest.raises(InvalidInputError, match="a list can be passed as tuple"):
        lord.allocate([torch.zeros(1)])
    with pytest.raises(InvalidInputError, match="expected None .* got 3.5"):
        lord.allocated(3.5)
    with pytest.raises(InvalidInputError, match="got 'gpu0'"):
        lord.freed("gpu0")
    assert lord.allocated() == (0, "0 B")


# ----------------------------------------------------------------------------- hotspots


def test_hotspots_track_file_and_line(lord: MemLord) -> None:
    assert lord.top_alloc_site() is None  # off by default: nothing recorded
    lord.allocate(torch.empty(8))
    assert lord.top_alloc_site() is None
    lord.set_callsite_tracking(True)
    t = torch.empty(64, 64)
    line = _line() + 1
    lord.allocate(t)
    dev, site, n = lord.top_alloc_site()
    assert (dev, site, n) == (CPU, f"{__file__}:{line}", nbytes(t))
    assert lord.top_alloc_site(torch.device("cpu")) == (dev, site, n)
    assert lord.top_alloc_site(torch.device("cuda")) is None
    line = _line() + 1
    lord.free(t)
    assert lord.top_free_site() == (CPU, f"{__file__}:{line}", nbytes(t))


def test_track_callsite_constructor_argument() -> None:
    lord = MemLord({}, track_callsite=True)
    lord.allocate(torch.zeros(3))
    assert lord.top_alloc_site()[2] == 12


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


# ----------------------------------------------------------------------------- auto-GC


def _fake_gc(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    calls: list[torch.device] = []
    monkeypatch.setattr(memlord_mod, "_run_backend_gc", lambda d: calls.append(d) or True)
    return calls


def test_default_and_empty_strategies() -> None:
    assert MemLord()._auto_gc_strategy == MEMLORD_DEFAULT_STRATEGY  # None: MemLord's bands
    assert [(b.lo, b.hi, b.percent) for b in MemLord()._bands] == [
        (0.0, 50.0, 60.0), (50.0, 75.0, 50.0), (75.0, 101.0, 40.0)]
    assert MemLord({})._bands == []


def test_percent_band_selection_and_trigger(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_gc(monkeypatch)
    lord = MemLord({
        (0, 50): {"metric": "max", "threshold": {"bytes": 1024}},
        (50, 101): {"metric": "freed", "threshold": {"percent": 0.1}},
    })
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (10 * 1024, 1024, 10.0))
    lord._allocated_by_dev[CPU] = 1023
    lord._maybe_auto_gc(CPU)
    assert calls == []  # 1023 < 1024
    lord._allocated_by_dev[CPU] = 2048
    lord._maybe_auto_gc(CPU)
    assert calls == [CPU] and lord._allocated_by_dev[CPU] == 0
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (10 * 1024, 6 * 1024, 60.0))
    calls.clear()
    lord._allocated_by_dev[CPU] = 10**6  # the high band looks at freed only
    lord._freed_by_dev[CPU] = 10  # 0.1% of 10 KiB = 10 bytes
    lord._maybe_auto_gc(CPU)
    assert calls == [CPU]
    assert lord._freed_by_dev[CPU] == 0 and lord._allocated_by_dev[CPU] == 0
    assert (lord.gc_runs(), lord.gc_runs(CPU), lord._gc_total_count) == (2, 2, 2)


def test_bytes_and_percent_resolve_to_the_smaller(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_gc(monkeypatch)
    lord = MemLord({(0, 101): {"metric": "allocated", "threshold": {"bytes": 5000, "percent": 10}}})
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (10_000, 100, 1.0))
    lord._allocated_by_dev[CPU] = 1000  # 10% of 10_000: the smaller threshold (MemLord's rule)
    lord._maybe_auto_gc(CPU)
    assert calls == [CPU]
    assert lord.ledger._default_bands == []  # the Ledger underneath runs no policy of its own


def test_no_band_or_unknown_capacity_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_gc(monkeypatch)
    lord = MemLord({(50, 101): {"metric": "max", "threshold": {"percent": 1}}})
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (10_000, 100, 1.0))
    lord._allocated_by_dev[CPU] = 10**9
    lord._maybe_auto_gc(CPU)  # used 1%: no band
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (None, None, 90.0))
    lord._maybe_auto_gc(CPU)  # percent of an unknown capacity: no threshold
    assert calls == [] and lord.gc_runs() == 0


def test_auto_gc_from_free_resets_the_whole_family(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_gc(monkeypatch)
    lord = MemLord({(0, 101): {"metric": "freed", "threshold": {"bytes": 1}}})
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (100, 90, 90.0))
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    lord._allocated_by_dev.update({d0: 10, d1: 11})
    lord._freed_by_dev.update({d0: 7, d1: 3})
    lord._maybe_auto_gc(d0)
    assert calls == [d0]
    assert [lord._allocated_by_dev[d] for d in (d0, d1)] == [0, 0]
    assert [lord._freed_by_dev[d] for d in (d0, d1)] == [0, 0]
    assert (lord.gc_runs(d0), lord.gc_runs(d1), lord.gc_runs("cuda")) == (1, 0, 1)
    x = torch.zeros(16)
    lord.allocate(x)
    lord.free(x)  # freed 64 >= 1 on cpu: triggers after the free
    assert calls == [d0, CPU] and lord.freed(CPU) == (0, "0 B")
    assert lord.ledger.record("cpu").freed_total == 64  # the exact ledger keeps its figures


def test_cpu_backend_gc_does_nothing_as_in_memlord() -> None:
    assert memlord_mod._run_backend_gc(CPU) is False
    lord = MemLord({(0, 101): {"metric": "allocated", "threshold": {"bytes": 1}}})
    x = torch.zeros(16)
    lord.allocate(x)  # crosses the band, but CPU has no cache to empty: no run, no reset
    assert lord.allocated()[0] == 64 and lord.gc_runs() == 0


def test_auto_gc_report_is_printed_even_without_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_gc(monkeypatch)
    lord = MemLord({(0, 101): {"metric": "freed", "threshold": {"bytes": 1}}})
    monkeypatch.setattr(lord, "_device_memory_stats", lambda d: (1024, 900, 87.9))
    lord._allocated_by_dev[CPU] = 2048
    lord._freed_by_dev[CPU] = 2048
    lord._maybe_auto_gc(CPU)
    out = capsys.readouterr().out
    assert out.startswith("MemLord: [auto_gc] cpu: ran GC (dev_gc_runs=1, global_gc_runs=1); ")
    assert "band=0–101% used≈87.9%; metric=freed value=2 KiB threshold=1 B" in out
    assert "  - cpu: allocated=2 KiB, freed=2 KiB, dev_gc_runs=1; device_smi(total=1 KiB" in out


def test_invalid_strategies_raise(lord: MemLord) -> None:
    with pytest.raises(InvalidInputError, match="metric must be one of"):
        lord.set_auto_gc_strategy({(0, 101): {"metric": "mean", "threshold": {"bytes": 1}}})
    with pytest.raises(InvalidInputError, match="band key must be"):
        lord.set_auto_gc_strategy({"all": {"metric": "max", "threshold": {"bytes": 1}}})
    with pytest.raises(ValueError, match="'bytes' and/or 'percent'"):  # MemLord raised ValueError
        lord.set_auto_gc_strategy({(0, 101): {"metric": "max", "threshold": {}}})
    assert lord._bands == []


def test_device_mem_stats_are_cached_and_fast() -> None:
    total, used, pct = get_device_mem_stats(CPU)
    assert total and total > 0 and used is not None and 0 < pct <= 100
    assert get_device_mem_stats(torch.device("meta")) == (None, None, 0.0)
    t0 = time.perf_counter()
    for _ in range(2000):
        get_device_mem_stats(CPU)
    assert (time.perf_counter() - t0) / 2000 < 1e-4  # a cached read, not a device query


# ----------------------------------------------------------------------------- Python hooks


def test_finalizer_credits_del(hooked: MemLord) -> None:
    lord = hooked
    t = torch.empty(256, 256)
    expected = nbytes(t)
    assert lord.allocated(CPU)[0] == expected
    del t
    gc.collect()
    assert (lord.allocated(CPU)[0], lord.freed(CPU)[0]) == (0, expected)


def test_finalizer_waits_for_the_last_reference(hooked: MemLord) -> None:
    lord = hooked
    t = torch.empty(128, 128)
    alias, view = t, t[3:]
    del t
    gc.collect()
    assert lord.freed(CPU)[0] == 0
    del alias
    gc.collect()
    assert lord.freed(CPU)[0] == 0  # the view still holds the storage (exact, not per tensor)
    del view
    assert lord.freed(CPU)[0] == 128 * 128 * 4
    gc.collect()
    gc.collect()
    assert lord.freed(CPU)[0] == 128 * 128 * 4  # credited once


def test_module_created_under_hooks_is_credited_on_del(hooked: MemLord) -> None:
    lord = hooked
    m = nn.Linear(128, 256)
    expected = module_nbytes(m)
    assert lord.allocated(CPU)[0] == expected  # the parameters' storages, counted once
    del m
    gc.collect()
    assert (lord.allocated(CPU)[0], lord.freed(CPU)[0]) == (0, expected)


def test_factories_counted_exactly(hooked: MemLord) -> None:
    lord = hooked
    made = [
        torch.empty(123, 321), torch.rand(128, 17), torch.eye(99), torch.linspace(0, 1, steps=257),
        torch.randperm(513), torch.normal(0.0, 1.0, size=(64, 33)), torch.zeros(3, 3),
        torch.ones(5), torch.full((4,), 2.0), torch.arange(10), torch.randint(0, 9, (7,)),
        torch.tensor([1.0, 2.0]),
    ]
    made += [torch.zeros_like(made[0]), torch.clone(made[1]), made[2].clone()]
    assert lord.allocated(CPU)[0] == sum(nbytes(x) for x in made)


def test_deep_autowrap_off_leaves_clone_alone(lord: MemLord) -> None:
    hooks = lord.hook_into_python(enable_deep_autowrap=False)
    try:
        x = torch.ones(10)
        y = x.clone()
        assert lord.allocated()[0] == nbytes(x)
        lord.allocate(y)
        assert lord.allocated()[0] == 2 * nbytes(x)
    finally:
        hooks.disable()


def test_factory_wrappers_off_counts_only_clones(lord: MemLord) -> None:
    hooks = lord.hook_into_python(enable_factory_wrappers=False)
    try:
        x = torch.ones(10)
        assert lord.allocated()[0] == 0 and torch.ones is not None
        y = x.clone()
        assert lord.allocated()[0] == nbytes(y)
    finally:
        hooks.disable()


def test_out_argument_and_views_are_not_allocations(hooked: MemLord) -> None:
    lord = hooked
    buf = torch.empty(1000)
    before = lord.allocated(CPU)[0]
    assert before == 4000
    torch.normal(0.0, 1.0, size=buf.shape, out=buf)
    view = torch.as_strided(buf, (256, 2), (2, 1))
    assert lord.allocated(CPU)[0] == before and view.shape == (256, 2)


def test_explicit_allocate_under_hooks_does_not_double_count(hooked: MemLord) -> None:
    lord = hooked
    t = torch.empty(100)
    lord.allocate(t)  # MemLord counted it a second time here
    lord.hook_into_python().register(t)  # the same hooks, already on
    assert lord.allocated()[0] == 400
    lord.free(t)
    del t
    assert (lord.allocated()[0], lord.freed()[0]) == (0, 400)


def test_temporaries_beyond_the_queue_are_counted(hooked: MemLord) -> None:
    lord = hooked
    keep = [torch.empty(2) for _ in range(memlord_mod._MAX_QUEUED + 10)]
    for _ in range(memlord_mod._MAX_QUEUED + 10):
        _ = torch.empty(4)
    del _
    n = memlord_mod._MAX_QUEUED + 10
    assert lord.allocated()[0] == 8 * n
    assert lord.freed()[0] == 16 * n
    r = lord.ledger.record()
    assert (r.allocations, r.live_storages) == (2 * n, n)
    del keep
    assert lord.freed()[0] == 24 * n


def test_finalizer_does_not_run_auto_gc(lord: MemLord, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = lord.hook_into_python()
    ready, release, holder = threading.Event(), threading.Event(), {}

    def worker() -> None:
        holder["t"] = torch.empty(1024)
        ready.set()
        release.wait()
        holder.pop("t")
        gc.collect()

    th = threading.Thread(target=worker)
    th.start()
    assert ready.wait(5)
    calls = []
    monkeypatch.setattr(lord, "_maybe_auto_gc", lambda *a: calls.append(a))
    release.set()
    th.join(5)
    gc.collect()
    assert calls == [] and lord.freed()[0] == 4096
    hooks.disable()


def test_concurrent_hooks_no_deadlock_and_exact(lord: MemLord) -> None:
    hooks = lord.hook_into_python()
    stop, errors, made = threading.Event(), [], [0]
    lock = threading.Lock()

    def worker() -> None:
        try:
            while not stop.is_set():
                x, y = torch.empty(4096), torch.zeros(2048)
                del x, y
                with lock:
                    made[0] += 1
                gc.collect(0)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for th in threads:
        th.start()
    time.sleep(0.5)
    stop.set()
    for th in threads:
        th.join(5)
    assert not any(th.is_alive() for th in threads) and not errors
    assert lord.allocated()[0] == 0
    assert lord.freed()[0] == made[0] * (4096 + 2048) * 4
    hooks.disable()


def test_hooks_are_shared_and_restored() -> None:
    orig_empty, orig_clone = torch.empty, torch.Tensor.clone
    a, b = MemLord({}), MemLord({})
    ha, hb = a.hook_into_python(), b.hook_into_python()
    assert a.hook_into_python() is ha and torch.empty is not orig_empty
    x = torch.empty(10)
    assert a.allocated()[0] == b.allocated()[0] == 40
    ha.disable()
    y = torch.empty(5)
    assert (a.allocated()[0], b.allocated()[0]) == (40, 60)
    hb.disable()
    assert torch.empty is orig_empty and torch.Tensor.clone is orig_clone
    ha.enable()
    assert torch.empty is not orig_empty
    ha.disable()
    del x, y


def test_forgotten_hooks_go_with_their_memlord() -> None:
    orig = torch.empty
    lord = MemLord({})
    lord.hook_into_python()  # never disabled, as MemLord's tests do
    assert torch.empty is not orig
    del lord
    gc.collect()
    assert torch.empty is orig


# ----------------------------------------------------------------------------- torch hooks


def test_same_device_dtype_cast_counted_once(lord: MemLord) -> None:
    th, ph = lord.hook_into_torch(), lord.hook_into_python()
    try:
        t = torch.empty(256, 128)
        assert lord.allocated(CPU)[0] == nbytes(t)
        u = t.to(dtype=torch.float16)
        assert lord.allocated(CPU)[0] == nbytes(t) + nbytes(u) == 256 * 128 * 6
        assert t.to(torch.float32) is t and lord.allocated(CPU)[0] == 256 * 128 * 6  # a no-op
        del t, u
        gc.collect()
        assert (lord.allocated()[0], lord.freed()[0]) == (0, 256 * 128 * 6)
    finally:
        th.disable()
        ph.disable()


def test_device_move_credits_the_source_once(lord: MemLord, capsys: pytest.CaptureFixture[str]) -> None:
    hooks = lord.hook_into_torch()
    try:
        os.environ["DEBUG"] = "1"
        t = torch.ones(100)  # never allocated: the move still credits its bytes (MemLord)
        out = t.to("meta")  # the meta copy itself is not counted
        log = capsys.readouterr().out
        assert "MemLord: [free] [hook] -400 B on cpu, now 0 B" in log
        del os.environ["DEBUG"]
        assert (lord.allocated()[0], lord.freed(CPU)[0]) == (0, 400)
        del t
        gc.collect()
        assert lord.freed(CPU)[0] == 400  # its death is not credited again
        assert out.device.type == "meta"
    finally:
        hooks.disable()


def test_module_to_dtype_counts_new_parameters(lord: MemLord, capsys: pytest.CaptureFixture[str]) -> None:
    m = nn.Linear(129, 257)
    f32 = module_nbytes(m)
    hooks = lord.hook_into_torch()
    try:
        os.environ["DEBUG"] = "1"
        m.to(torch.float64)
        assert "[allocate] [hook] +" in capsys.readouterr().out
        assert lord.allocated(CPU)[0] == 2 * f32 == module_nbytes(m)
    finally:
        hooks.disable()
    assert torch.nn.Module.to is not None and hooks.enabled is False


def test_torch_hooks_idempotent_and_restored(lord: MemLord) -> None:
    orig = torch.Tensor.to
    h = lord.hook_into_torch()
    assert lord.hook_into_torch() is h and callable(torch.Tensor.to) and torch.Tensor.to is not orig
    h.poll()
    h.disable()
    h.disable()
    assert torch.Tensor.to is orig


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_to_cpu_move(lord: MemLord) -> None:
    hooks = lord.hook_into_torch()
    try:
        t = torch.empty(512, 512, device="cuda:0")
        out = t.to("cpu")
        assert lord.allocated(CPU)[0] == nbytes(out) == nbytes(t)
        assert lord.freed(torch.device("cuda", 0))[0] == nbytes(t)
        assert lord.freed(torch.device("cuda"))[0] == nbytes(t)
    finally:
        hooks.disable()


@pytest.mark.cuda
def test_cuda_finalizer_and_backend_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    lord = MemLord({(0, 101): {"metric": "freed", "threshold": {"bytes": 1}}})
    d0 = torch.device("cuda", 0)
    t = torch.empty(256, 256, device=d0)
    lord.allocate(t)
    assert lord.allocated(d0)[0] == nbytes(t)
    lord.free(t)  # a real torch.cuda.empty_cache() run: counters of every CUDA device reset
    assert lord.gc_runs(d0) == 1 and lord.freed(d0) == (0, "0 B")
