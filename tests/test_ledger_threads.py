"""Thread safety: concurrent allocate/free pairs, shared storages and automatic frees end exact.

The unit test runs 8 threads x 20,000 pairs (the full 8 x 100,000 runs in
benchmarks/bench_ledger.py, which checks the same totals) to keep the suite quick on 2 cores.
"""

from __future__ import annotations

import sys
import threading

import torch

from torchmem import Ledger

THREADS = 8
PAIRS = 20_000


def _run(workers: list[threading.Thread]) -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads very often: maximise interleaving
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)


def test_eight_threads_allocate_free_pairs_exact() -> None:
    led = Ledger()
    sizes = [(i + 1) * 16 for i in range(THREADS)]  # a different storage size per thread
    own = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    shared = torch.zeros(1000, dtype=torch.uint8)  # every thread also allocates this one
    led.allocate(shared)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            t = own[i]
            view = shared[i:]
            for _ in range(PAIRS):
                led.allocate(t)
                led.allocate(view)  # already counted: adds nothing, from any thread
                led.free(t)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    _run([threading.Thread(target=work, args=(i,)) for i in range(THREADS)])
    assert not errors
    r = led.record()
    assert r.allocated == 1000  # only the shared storage is still counted
    assert r.freed == PAIRS * sum(sizes)
    assert r.allocations == THREADS * PAIRS + 1
    assert r.frees == THREADS * PAIRS
    assert r.live_storages == 1
    assert r.peak <= 1000 + sum(sizes)


def test_automatic_frees_from_many_threads_exact() -> None:
    led = Ledger()
    per_thread = 2_000
    errors: list[BaseException] = []
    stop = threading.Event()

    def make(i: int) -> None:
        try:
            for k in range(per_thread):
                t = torch.empty(8 + (k % 4) * 8, dtype=torch.uint8)
                led.allocate(t)
                del t  # dies here: an automatic free, possibly while another thread holds the lock
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    def read() -> None:
        while not stop.is_set():
            led.allocated()
            led.record("cpu")

    reader = threading.Thread(target=read)
    reader.start()
    _run([threading.Thread(target=make, args=(i,)) for i in range(THREADS)])
    stop.set()
    reader.join()
    assert not errors
    expect = THREADS * sum(8 + (k % 4) * 8 for k in range(per_thread))
    r = led.record()
    assert (r.allocated, r.freed, r.live_storages) == (0, expect, 0)
    assert r.allocations == r.frees == r.auto_frees == THREADS * per_thread
