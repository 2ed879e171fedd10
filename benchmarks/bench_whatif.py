"""Benchmark: what-if replays (``torchmem.sim.whatif`` / ``suggest``) beside a plain ``replay``.

For the real snapshots whose traces replay exactly (``tests/data``: DeComFL from empty, MAGMA27
and notHanmin mid-run; notHanmin is the largest file) and for a generated trace of ``--requests``
requests (default 1,000,000 mallocs and frees, drawn with a fixed seed: 60 % small requests up to
1 MiB, 35 % up to 16 MiB, 5 % up to 256 MiB, at most 400 live blocks, frees mostly last-in
first-out; recorded by running :class:`torchmem.sim.CachingAllocator` and taking its snapshot,
which is how an estimate's run looks), times, best of ``--reps``:

- ``replay``: ``torchmem.sim.replay(snapshot)``, what ``torchmem replay`` runs, the baseline: one
  pass of the trace through the simulator (plus the start-state rebuild of a mid-run trace);
- ``whatif``: ``whatif(snapshot)``, the recorded settings: the recorded run's figures (the trace
  tallied, the exact replay and a pass up to its peak) and the what-if's (its own walk, recorded
  OOMs retried, and a pass up to its peak), compared figure for figure;
- ``whatif exp``: ``whatif(snapshot, "expandable_segments:True")``;
- ``suggest``: ``suggest(snapshot)``, the nine documented settings (real snapshots only, unless
  ``--suggest-generated``).

Prints the times, each over ``replay`` (the ratio), and whether the what-if with the recorded
settings equals the recorded run (``identical``), so a regression in exactness shows here too.

Run:  python benchmarks/bench_whatif.py [--reps 3] [--requests 1000000] [--files NAME,...]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

sys.path.insert(0, str(HERE))

from bench_replay import FILES, best  # noqa: E402  (the same traces, the same timer)
from torchmem.io import load_snapshot  # noqa: E402
from torchmem.model.snapshot import Snapshot  # noqa: E402
from torchmem.sim import CachingAllocator, replay, suggest, whatif  # noqa: E402


def generated(requests: int, seed: int = 0) -> Snapshot:
    """A recorded run of ``requests`` mallocs and frees (see the module's docstring)."""
    rng = random.Random(seed)
    a = CachingAllocator()
    live: list[int] = []
    for _ in range(requests):
        if live and (len(live) > 400 or rng.random() < 0.45):
            j = rng.randrange(len(live)) if rng.random() < 0.3 else len(live) - 1
            a.free(live.pop(j))
        else:
            r = rng.random()
            if r < 0.6:
                size = rng.randint(1, 1 << 20)
            elif r < 0.95:
                size = rng.randint(1 << 20, 16 << 20)
            else:
                size = rng.randint(16 << 20, 256 << 20)
            live.append(a.malloc(size))
    return a.snapshot()


def row(name: str, snap: Snapshot, reps: int, with_suggest: bool) -> None:
    n = len(snap.trace(0))
    t_rep, _ = best(lambda: replay(snap, 0), reps)
    t_wi, w = best(lambda: whatif(snap), reps)
    t_exp, e = best(lambda: whatif(snap, "expandable_segments:True"), reps)
    d = w.devices[0]
    x = e.devices[0]
    sug = "-"
    if with_suggest:
        t_sug, s = best(lambda: suggest(snap), reps)
        b = s.devices[0].best
        sug = f"{t_sug:.2f}s {t_sug / t_rep:>4.1f}x"
        sug += f" best {b.change if b else 'none'}"
    print(f"{name:<46} {n:>9} {t_rep:>7.2f}s {t_wi:>7.2f}s {t_wi / t_rep:>4.1f}x "
          f"{t_exp:>7.2f}s {t_exp / t_rep:>4.1f}x  {'yes' if d.identical else 'NO':<9} "
          f"{d.recorded.peak_reserved_bytes >> 20:>6} -> {x.whatif.peak_reserved_bytes >> 20:<6} "
          f" {sug}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--suggest-generated", action="store_true",
                    help="also time suggest() on the generated trace (nine more replays)")
    ap.add_argument("--files", default=",".join(FILES),
                    help="comma-separated real snapshots of tests/data to time (default: all three)")
    args = ap.parse_args()
    files = [f for f in args.files.split(",") if f]
    unknown = [f for f in files if f not in FILES]
    if unknown:
        ap.error(f"unknown file(s) {unknown}; the files are {', '.join(FILES)}")
    print(f"{'trace':<46} {'entries':>9} {'replay':>8} {'whatif':>8} {'ratio':>5} "
          f"{'whatif exp':>8} {'ratio':>5}  {'identical':<9} {'reserved MiB (exp)':<16} suggest")
    for name in files:
        row(name, load_snapshot(HERE.parent / "tests" / "data" / name), args.reps, True)
    t0 = time.perf_counter()
    snap = generated(args.requests)
    print(f"(generated {args.requests} requests in {time.perf_counter() - t0:.1f}s)", flush=True)
    row(f"generated, {args.requests} requests", snap, 1, args.suggest_generated)


if __name__ == "__main__":
    main()
