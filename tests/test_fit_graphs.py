"""CUDA graphs and memory pools in the estimate (:mod:`torchmem.fit.fakegpu._graphs`): a
capture allocates from a private pool that stays reserved while the graph lives.

Expected figures are the caching allocator's segment arithmetic (a request between 1 and
10 MiB gets a 20 MiB segment; ``shared/docs/cuda-caching-allocator.md``), computed here; the
readings are the program's own ``torch.cuda.memory_reserved()`` under the estimate.
"""

from __future__ import annotations

import pytest
import torch

import torchmem
from test_fit_streams import MiB, _est, _mib  # the same helpers: n MiB on the GPU, one step
from torchmem.fit import GPU


def test_a_captures_pool_stays_reserved_until_the_graph_goes():
    seen: dict[str, object] = {}

    def build(batch: int):
        x = _mib(4)  # a 20 MiB segment of the default pool

        def step() -> None:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                seen["capturing"] = torch.cuda.is_current_stream_capturing()
                y = x + 1     # 4 MiB: the pool's first 20 MiB segment
                t = x * 2
                del t         # back to the pool: the next request of the capture reuses it
                z = x - 1
            seen["after"] = torch.cuda.is_current_stream_capturing()
            seen["pool"] = torch.cuda.memory_reserved()
            del y, z
            torch.cuda.empty_cache()  # the graph lives: its pool stays
            seen["kept"] = torch.cuda.memory_reserved()
            w = _mib(20)  # x's segment has 16 MiB free, the graph's a free 20 MiB: not for it
            seen["beside"] = torch.cuda.memory_reserved()
            del w
            g.reset()
            torch.cuda.empty_cache()
            seen["released"] = torch.cuda.memory_reserved()
        return step

    e = _est(build)
    assert seen["capturing"] is True and seen["after"] is False
    assert seen["pool"] == 2 * 20 * MiB
    assert seen["kept"] == 2 * 20 * MiB
    assert seen["beside"] == 3 * 20 * MiB
    assert seen["released"] == 20 * MiB
    assert e.peak_reserved_bytes == 3 * 20 * MiB


def test_graphs_share_a_pool_when_asked():
    def build(batch: int, share: bool):
        x = _mib(4)

        def step() -> None:
            g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1):
                y = x + 1
            del y  # free in g1's pool
            pool = g1.pool() if share else None
            with torch.cuda.graph(g2, pool=pool):
                z = x + 2  # reuses y's block when the pools are one
            del z
        return step

    shared = _est(build, params={"share": True})
    apart = _est(build, params={"share": False})
    assert shared.peak_reserved_bytes == 20 * MiB + 20 * MiB
    assert apart.peak_reserved_bytes == 20 * MiB + 2 * 20 * MiB
    handle = _est(lambda b: (lambda: torch.cuda.graph_pool_handle()))
    assert handle.peak_reserved_bytes == 0


def test_replays_allocate_nothing_and_need_a_capture():
    def build(batch: int, replays: int):
        x = _mib(4)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 3

        def step() -> None:
            for _ in range(replays):
                g.replay()
            y.sum()
        return step

    one = torchmem.estimate(build, gpu="H100-80GB", batch_size=1, margin=0, params={"replays": 1})
    many = torchmem.estimate(build, gpu="H100-80GB", batch_size=1, margin=0,
                             params={"replays": 50})
    assert (one.peak_allocated_bytes, one.peak_reserved_bytes) == (
        many.peak_allocated_bytes, many.peak_reserved_bytes)
    # x and y (4 MiB each, in two pools), the sum's small block
    assert one.peak_reserved_bytes == 2 * 20 * MiB + 2 * MiB

    def early(batch: int):
        g = torch.cuda.CUDAGraph()
        return g.replay

    with pytest.raises(torchmem.errors.InvalidInputError, match="without a preceding successful capture"):
        _est(early)


def test_make_graphed_callables_keeps_its_static_tensors_in_the_pool():
    def build(batch: int):
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 256)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(batch, 256, device="cuda", requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(model, (x,))

        def step() -> None:
            graphed(torch.randn(batch, 256, device="cuda", requires_grad=True)).sum().backward()
            opt.step()
            opt.zero_grad()
        return step

    e = torchmem.estimate(build, gpu="H100-80GB", batch_size=512, margin=0, steps=2,
                          keep_snapshot=True)
    pooled = [b for s in e.snapshot.segments if s.segment_pool_id != (0, 0) for b in s.blocks
              if b.state == "active_allocated"]
    sizes = sorted(b.size for b in pooled)
    # the forward graph's static output (512 x 256 fp32) and the backward graph's static
    # gradient of the input live in the shared pool, among the captures' own blocks
    assert sizes.count(512 * 256 * 4) >= 2
    assert e.oom is None


def test_a_mem_pool_holds_its_blocks_until_it_is_deleted():
    seen: dict[str, int] = {}

    def build(batch: int):
        def step() -> None:
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                a = _mib(4)
            del a
            torch.cuda.empty_cache()
            seen["kept"] = torch.cuda.memory_reserved()
            b = _mib(4)  # not from the pool
            seen["beside"] = torch.cuda.memory_reserved()
            del b, pool
            torch.cuda.empty_cache()
            seen["released"] = torch.cuda.memory_reserved()
        return step

    _est(build)
    assert seen == {"kept": 20 * MiB, "beside": 2 * 20 * MiB, "released": 0}


def test_a_capture_that_does_not_fit_runs_out_of_memory_in_the_pool():
    def build(batch: int):
        x = _mib(20)

        def step() -> None:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys = [x + i for i in range(3)]  # 3 x 20 MiB in the pool
            del ys
        return step

    card = GPU("64 MiB", total_bytes=64 * MiB, compute_capability=(9, 0), source="test",
               context_override=0)
    e = _est(build, gpu=card)
    assert e.oom is not None and e.oom.requested_bytes == 20 * MiB


def test_the_simulators_private_pools_outlive_the_collector_and_the_oom_retry():
    from torchmem.sim import CachingAllocator

    # the collector (garbage_collection_threshold) frees the default pool's cached segments
    # only; the out-of-memory retry's release leaves a pool in use, frees it once released
    a = CachingAllocator(100 * MiB, "garbage_collection_threshold:0.3", memory_fraction=1.0)
    a.use_pool(7)
    g = a.malloc(40 * MiB, stream=a.pool_stream(7))
    d = a.malloc(40 * MiB)
    a.free(g)
    a.free(d)
    big = a.malloc(40 * MiB)  # GC: the default pool's 40 MiB segment is reused, nothing freed
    a.free(big)
    x = a.malloc(50 * MiB)  # 40 + 40 + 50 > 100: the default 40 is collected, the pool's kept
    assert a.reserved_bytes == 90 * MiB
    a.free(x)
    try:
        a.malloc(70 * MiB)  # 40 (pool, in use) + 70 > 100: the retry cannot free the pool
    except torchmem.errors.SimulatedOutOfMemoryError:
        pass
    else:
        raise AssertionError("expected an out-of-memory error")
    a.release_pool(7)
    a.malloc(70 * MiB)  # the retry now frees the pool's segment
    assert a.reserved_bytes == 70 * MiB
    with pytest.raises(torchmem.errors.InvalidInputError, match="pool must be an int"):
        a.pool_stream(-1)


def test_the_pending_gpu_cases_run_under_the_estimate():
    """The two cases written for the next GPU session (tests/gpu_cases.py PENDING) estimate
    here: the graph's pool survives each step's empty_cache, the prefetcher gets a range."""
    import gpu_cases

    c = gpu_cases.PENDING["cuda_graph"]
    e = torchmem.estimate(lambda b: c.build(b, **c.params), gpu="H100-80GB",
                          batch_size=c.batch_size, margin=0, keep_snapshot=True)
    pooled = [s for s in e.snapshot.segments if s.segment_pool_id != (0, 0)]
    # the capture stream's cuBLAS workspace (32 MiB) and its two outputs' segments
    assert sum(s.total_size for s in pooled) >= 32 * MiB
    p = gpu_cases.PENDING["prefetch_stream"]
    f = torchmem.estimate(lambda b: p.build(b, **p.params), gpu="H100-80GB",
                          batch_size=p.batch_size, margin=0)
    assert f.peak_reserved_lower_bytes is not None
    # a batch is 16 MiB; the upper figure keeps all eight of a step waiting, the lower one
    assert f.peak_reserved_bytes - f.peak_reserved_lower_bytes == 7 * 16 * MiB
