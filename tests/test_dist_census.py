"""Each rank's peak, from its trace, against an independent census on that rank (gloo, CPU).

``torchmem run --nproc-per-node W`` runs a small Adam training job on W ranks, wrapped in DDP
or sharded with FSDP2 (``fully_shard`` per layer and at the root). In the last iteration, after
``opt.step()`` and before ``zero_grad()``, each rank makes a ``(rank + 1) * 64 KiB`` tensor: the
ranks' peaks differ on purpose, and the peak is at a point where Python can take a census.

Ground truth, three ways:

* the census: every live plain tensor the garbage collector finds (``DTensor`` wrappers are
  skipped: their local shards are plain tensors), each storage once, minus those alive before
  the script started; taken on the rank at the peak point, once settled. Under load (about
  one run in twenty) a census there also finds a flat ``[W * shard]`` float tensor of the
  first unit that no Python object refers to (only C++ holds it: the collective's work on
  gloo's own threads, which run Python then) and that is gone by the next scan; the trace has
  every all-gather and reduce-scatter buffer of that size freed by then. So the census is
  repeated until two, 50 ms apart, agree (a known limit of a dispatch-level tracker:
  buffers held inside a collective's work are not operator outputs it can follow);
* arithmetic from the model: parameters, gradients and Adam's two moments of every parameter
  (DDP: whole; FSDP2: the rank's padded dim-0 shard, ``ceil(rows / W)`` rows) plus Adam's
  4-byte step counters; DDP's one gradient bucket holds every parameter's bytes;
* the collectives' buffers by hand: DDP's bucket (``c10d::allreduce_``) is the parameters'
  bytes; each FSDP2 unit's all-gather output and reduce-scatter input are W times the unit's
  shard bytes, its reduce-scatter output (the sharded gradient) one shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from torchmem.analysis import summarize
from torchmem.io.tmtrace import load_trace

ROOT = Path(__file__).resolve().parents[1]
SPIKE = 64 * 1024
LAYERS = [(16, 32), (32, 4)]  # Linear(in, out): weight (out, in), bias (out,)

TRAIN = textwrap.dedent(
    """
    import gc, json, os, sys, time
    import torch, torch.distributed as dist

    def storages():
        out = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and type(o) in (torch.Tensor, torch.nn.Parameter):
                s = o.untyped_storage()
                out[s.data_ptr() or id(s)] = s.nbytes()
        return out

    MODE, OUT = sys.argv[1], sys.argv[2]
    before = storages()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if MODE == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net)
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(net[0]); fully_shard(net[2]); model = fully_shard(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(3):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        if i == 2:
            spike = torch.ones((rank + 1) * SPIKE // 4)
            # settled: gloo's own threads may hold a collective's flat buffer (a tensor no
            # Python object refers to, never an operator's output) for a moment after the
            # step; count once two censuses 50 ms apart agree (no tensor is made meanwhile)
            census, tries = None, 0
            while tries < 40:
                now = storages()
                total = sum(b for k, b in now.items() if k not in before)
                if total == census:
                    break
                census, tries = total, tries + 1
                time.sleep(0.05)
        opt.zero_grad()
    with open(os.path.join(OUT, f"census{rank}.json"), "w") as f:
        json.dump({"census": census, "tries": tries,
                   "sizes": sorted(b for k, b in now.items() if k not in before)}, f)
    dist.destroy_process_group()
    """
).replace("SPIKE", str(SPIKE))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _shard_bytes(world: int) -> list[int]:
    """Per FSDP2 unit (one per Linear): the rank's padded shard of its weight and bias."""
    return [4 * (_ceil(o, world) * i + _ceil(o, world)) for i, o in LAYERS]


def _param_bytes() -> int:
    return sum(4 * (o * i + o) for i, o in LAYERS)


def _run(tmp_path: Path, mode: str, world: int) -> list:
    (tmp_path / "train.py").write_text(TRAIN)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHMEM_RUN_OPTIONS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--nproc-per-node", str(world), "-o", "job",
         "train.py", mode, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [load_trace(tmp_path / f"job.rank{r}.tmtrace") for r in range(world)]


def _census(tmp_path: Path, rank: int) -> int:
    return int(json.loads((tmp_path / f"census{rank}.json").read_text())["census"])


def _why(trace: object, tmp_path: Path, rank: int) -> str:
    """For a failed comparison: the census's storage sizes and the trace's live ones at its peak."""
    live: dict[int, tuple[int, str | None, str]] = {}
    best, at = -1, {}
    total = 0
    for e in trace.events():  # type: ignore[attr-defined]
        if e.kind.label == "alloc":
            live[e.storage] = (e.nbytes, e.op, e.category.label)
            total += e.nbytes
        elif e.kind.label == "free" and e.storage in live:
            total -= live.pop(e.storage)[0]
        if total > best:
            best, at = total, dict(live)
    sizes = json.loads((tmp_path / f"census{rank}.json").read_text())["sizes"]
    return f"rank {rank}: census sizes {sizes}; trace live at its peak {sorted(at.values())}"


def _allocs_by_op(trace: object, category: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for e in trace.events():  # type: ignore[attr-defined]
        if e.kind.label == "alloc" and e.category.label == category:
            out[e.op].append(e.nbytes)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_rank_peaks_equal_the_census(tmp_path: Path, world: int) -> None:
    traces = _run(tmp_path, "ddp", world)
    p = _param_bytes()
    for rank, trace in enumerate(traces):
        peak = trace.peak()["cpu"]
        assert peak == _census(tmp_path, rank), _why(trace, tmp_path, rank)
        at_peak = summarize(trace).categories_at_peak
        assert at_peak["parameter"] == p
        assert at_peak["gradient"] == p
        assert at_peak["optimizer_state"] == 2 * p + 4 * 4      # exp_avg, exp_avg_sq, steps
        assert at_peak["communication"] == p                     # the one gradient bucket
        assert at_peak["other"] == (rank + 1) * SPIKE
        assert peak == 5 * p + 16 + (rank + 1) * SPIKE
        comm = _allocs_by_op(trace, "communication")
        # the bucket made by the constructor, and the one rebuilt in the second iteration
        assert comm["c10d::allreduce_"] == [p, p]
        assert trace.metadata["world_size"] == world and trace.metadata["rank"] == rank


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_rank_peaks_equal_the_census(tmp_path: Path, world: int) -> None:
    traces = _run(tmp_path, "fsdp", world)
    shards = _shard_bytes(world)
    s = sum(shards)
    for rank, trace in enumerate(traces):
        peak = trace.peak()["cpu"]
        assert peak == _census(tmp_path, rank), _why(trace, tmp_path, rank)
        at_peak = summarize(trace).categories_at_peak
        assert at_peak["parameter"] == s                         # the sharded parameters
        assert at_peak["gradient"] == s                          # the sharded gradients
        assert at_peak["optimizer_state"] == 2 * s + 4 * 4
        assert (rank + 1) * SPIKE <= at_peak["other"] < (rank + 1) * SPIKE + 1024
        comm = _allocs_by_op(trace, "communication")
        assert set(comm) == {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"}
        assert set(comm["c10d::_allgather_base_"]) == {world * b for b in shards}
        assert set(comm["c10d::_reduce_scatter_base_"]) == {world * b for b in shards}
        # 3 iterations, each unit reduce-scattered once per backward
        assert sorted(comm["c10d::_reduce_scatter_base_"]) == sorted(3 * [world * b for b in shards])
        grads = _allocs_by_op(trace, "gradient")["c10d::_reduce_scatter_base_"]
        assert sorted(grads) == sorted(3 * shards)               # the output is the gradient
        # the unsharded parameters, re-made for every forward and backward all-gather
        unsharded = _allocs_by_op(trace, "parameter")["fsdp::split_with_sizes_copy"]
        assert set(unsharded) == {4 * o * i for i, o in LAYERS} | {4 * o for _, o in LAYERS}
