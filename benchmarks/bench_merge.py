"""Benchmark: ``torchmem merge`` of 64 rank traces of 1M events each, from the files.

The traces: one synthetic FSDP-like training run of N events (default 1,000,000; parameters up
front, then per iteration and layer an all_gather buffer (communication) made and freed, an
activation kept until backward, a temporary, a reduce_scatter output, gradients once, step
markers; operators, modules and call sites as the tracker records them), written once per rank
with the rank's metadata and its sizes scaled by ``1 + rank % 4`` (so the ranks differ), as
``bench.rank{R}.tmtrace`` files. Generating and writing them is not timed.

Timed, each in a fresh process (wall clock, CPU time and the peak RSS of that process and its
children from ``wait4``; on a shared machine the CPU time is the steadier figure):

1. ``torchmem merge DIR/bench.rank*.tmtrace -o merged.json -q``: loads, reduces and drops one
   trace at a time (and the same with ``--jobs 2``: two worker processes);
2. the alternative a user would run without a merge: ``torchmem summary`` of each rank's file
   (load + ``summarize_trace``), on ``--baseline`` files (default 8), scaled to all ranks.

The issue's bar: 64 x 1M events merged in <= 60 s and <= 8 GiB on this machine. Holding all 64
traces at once would take 64 x 47 bytes x N of columns (printed for comparison).

Run:  python benchmarks/bench_merge.py [--ranks 64] [--events 1000000] [--baseline 8] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))

from torchmem.io.tmtrace import save_trace  # noqa: E402
from torchmem.model.events import Category, EventKind, Phase  # noqa: E402
from torchmem.model.trace import BYTES_PER_EVENT, COLUMNS, Trace  # noqa: E402


def make_run(n_events: int, seed: int = 0) -> Trace:
    """One rank's FSDP-like run of about ``n_events`` events."""
    rng = random.Random(seed)
    tr = Trace()
    layers = 32
    sites = [f"/home/user/project/model.py:{100 + i}:forward" for i in range(layers)]
    fsdp = "/venv/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:200:foreach_all_gather"
    sid = 0
    sizes: dict[int, int] = {}

    def alloc(t: int, n: int, op: str, mod: str, phase: Phase, cat: Category, step: int,
              site: str) -> int:
        nonlocal sid
        sid += 1
        sizes[sid] = n
        tr.append(EventKind.ALLOC, t, "cuda:0", n, sid, op=op, module=mod, phase=phase,
                  category=cat, step=step, stack=("/home/user/project/train.py:40:main", site))
        return sid

    def free(t: int, s: int, step: int) -> None:
        tr.append(EventKind.FREE, t, "cuda:0", sizes.pop(s), s, step=step)

    for i in range(layers):  # the shards of the parameters
        alloc(0, 2 * 1024 * 1024, "", f"Model.layers.{i}", Phase.OTHER, Category.PARAMETER, 0,
              sites[i])
    t = step = 0
    while len(tr) < n_events:
        acts = []
        for i in range(layers):
            t += 1
            mod = f"Model.layers.{i}"
            buf = alloc(t, 16 * 1024 * 1024, "_c10d_functional::all_gather_into_tensor", mod,
                        Phase.FORWARD, Category.COMMUNICATION, step, fsdp)
            acts.append((alloc(t, rng.randint(1, 64) * 65536, "aten::mm", mod, Phase.FORWARD,
                               Category.ACTIVATION, step, sites[i]), i))
            tmp = alloc(t, 65536, "aten::gelu", mod, Phase.FORWARD, Category.TEMPORARY, step,
                        sites[i])
            free(t, tmp, step)
            free(t, buf, step)
        for s, i in reversed(acts):
            t += 1
            mod = f"Model.layers.{i}"
            rs = alloc(t, 2 * 1024 * 1024, "_c10d_functional::reduce_scatter_tensor", mod,
                       Phase.BACKWARD, Category.COMMUNICATION, step, fsdp)
            if step == 0:
                alloc(t, 2 * 1024 * 1024, "aten::mm", mod, Phase.BACKWARD, Category.GRADIENT,
                      step, sites[i])
            free(t, rs, step)
            free(t, s, step)
        tr.append(EventKind.MARK, t, "cuda:0", 0, 0, op="step", step=step)
        step += 1
    return tr


def rank_copy(base: Trace, rank: int, world: int) -> Trace:
    """``base`` as rank ``rank`` of a ``world``-rank job, its sizes scaled by 1 + rank % 4."""
    tr = Trace({"rank": rank, "world_size": world, "local_rank": rank % 8,
                "job_id": "bench", "backend": "nccl"})
    for name, _, _ in COLUMNS:
        getattr(tr, name).extend(getattr(base, name))
    k = 1 + rank % 4
    if k != 1:
        tr.nbytes = array("q", [b * k for b in base.nbytes])
    tr.set_tables(base.devices, base.strings, base.stacks, base.threads)
    return tr


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and peak RSS (bytes) of ``cmd`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read() if p.stderr else ""
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # maxrss: KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--baseline", type=int, default=8, help="files the alternative summarises")
    ap.add_argument("--jobs", type=int, default=2, help="also time 'merge --jobs N' (1: skip)")
    ap.add_argument("--dir", default=None, help="folder for the traces (default: a temporary one)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        t0 = time.perf_counter()
        base = make_run(args.events)
        for r in range(args.ranks):
            save_trace(rank_copy(base, r, args.ranks), Path(d) / f"bench.rank{r}.tmtrace")
        size = sum(f.stat().st_size for f in Path(d).iterdir())
        print(f"wrote {args.ranks} rank traces of {len(base):,} events ({size / 2**30:.2f} GiB) "
              f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        del base

        out = Path(d) / "merged.json"
        mw, mc, mrss = timed([sys.executable, "-m", "torchmem", "merge",
                             str(Path(d) / "bench.rank*.tmtrace"), "-o", str(out), "-q"])
        jw = jc = jrss = 0.0
        if args.jobs > 1:
            jw, jc, jrss = timed([sys.executable, "-m", "torchmem", "merge",
                                  str(Path(d) / "bench.rank*.tmtrace"), "-o", str(out), "-q",
                                  "--jobs", str(args.jobs)])
        n = min(args.baseline, args.ranks)
        files = [str(Path(d) / f"bench.rank{r}.tmtrace") for r in range(n)]
        code = ("import sys\nfrom torchmem.io.tmtrace import load_trace\n"
                "from torchmem.analysis.summary import summarize_trace\n"
                "for p in sys.argv[1:]:\n    summarize_trace(load_trace(p))\n")
        bw, bc, brss = timed([sys.executable, "-c", code, *files])
        per_merge, per_base = mc / args.ranks, bc / n
        held = args.ranks * args.events * BYTES_PER_EVENT
        print(f"merge of {args.ranks} ranks x {args.events:,} events from the files: "
              f"{mw:.1f} s wall / {mc:.1f} s CPU ({per_merge:.2f} s CPU per rank), peak RSS "
              f"{mrss / 2**20:.0f} MiB  [bar: <= 60 s, <= 8 GiB]")
        if args.jobs > 1:
            print(f"  with --jobs {args.jobs}: {jw:.1f} s wall / {jc:.1f} s CPU in the workers, "
                  f"peak RSS of one worker {jrss / 2**20:.0f} MiB; wall {mw / jw:.2f}x faster")
        print(f"torchmem summary of each file (load + summarize_trace, {n} files): "
              f"{bw / n:.2f} s wall / {per_base:.2f} s CPU per rank -> {per_base * args.ranks:.1f} "
              f"s CPU for {args.ranks}, peak RSS {brss / 2**20:.0f} MiB; merge / summaries = "
              f"{per_merge / per_base:.2f}x CPU")
        print(f"holding all {args.ranks} traces at once would take {held / 2**30:.1f} GiB of "
              f"columns; the merge's peak RSS is {mrss / held:.3f}x that")


if __name__ == "__main__":
    main()
