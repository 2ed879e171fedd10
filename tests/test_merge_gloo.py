"""A real ``torch.distributed`` job (gloo on loopback, launched by PyTorch's own launcher) whose
ranks each write a trace, merged by ``torchmem merge``.

Ground truth from the construction: every rank runs the same DDP step on the same data, and rank
``r`` also holds ``(r + 1) * EXTRA`` bytes made at one line of the script, so the heaviest rank is
the last, the lightest rank 0, their peaks differ by exactly ``(world - 1) * EXTRA`` bytes, all
of it at that line; DDP's all_reduce bucket holds the model's gradients, whose bytes follow from
the layer shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchmem
from torchmem.analysis.summary import summarize_trace
from torchmem.cli.merge import merge_files
from torchmem.io.tmtrace import load_trace

EXTRA = 256 * 1024
PARAM_BYTES = 4 * (64 * 256 + 256 + 256 * 8 + 8)  # Linear(64, 256), Linear(256, 8), float32

WORKER = '''
import os, sys, torch, torch.distributed as dist
from torch import nn
import torchmem

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
meta = {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "job_id": os.environ["TORCHELASTIC_RUN_ID"], "backend": dist.get_backend()}
with torchmem.track(ddp, opt, stacks=True, metadata=meta, path=f"{out}.rank{rank}.tmtrace"):
    extra = torch.zeros((rank + 1) * EXTRA // 4)  # EXTRA LINE
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        ddp(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
    t = torch.ones(1000)
    gathered = [torch.empty(1000) for _ in range(world)]
    dist.all_gather(gathered, t)
dist.destroy_process_group()
'''.replace("EXTRA //", f"{EXTRA} //")


def _launch(tmp: Path, world: int) -> Path:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    src = str(Path(torchmem.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(script), str(tmp / "job")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "job"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_job_merged(tmp_path: Path, world: int) -> None:
    job = _launch(tmp_path, world)
    files = [Path(f"{job}.rank{r}.tmtrace") for r in range(world)]
    out = tmp_path / "merged.json"
    m = merge_files([f"{job}.rank*.tmtrace"], out)
    assert m.complete and m.world_size == world and [r.rank for r in m.ranks] == list(range(world))
    assert {r.backend for r in m.ranks} == {"gloo"}
    assert [r.local_rank for r in m.ranks] == list(range(world))
    for r, f in zip(m.ranks, files):
        s = summarize_trace(load_trace(f), top=10**6)
        assert (r.peak, r.final_live, r.iterations) == (s.peak["cpu"], s.final_live["cpu"],
                                                        s.iterations)
        assert r.steps == 3
        # DDP's all_reduce bucket: the flat gradients, as many bytes as the parameters
        bucket = [c for c in r.collectives if c.operator.startswith("c10d::allreduce")]
        assert bucket and bucket[0].allocated == PARAM_BYTES
    # the ranks' peaks differ by the extra bytes, up to a scalar or two that the ranks' threads
    # (DDP's reducer) may free at a slightly different moment
    peaks = [r.peak for r in m.ranks]
    assert all(abs(b - a - EXTRA) <= 64 for a, b in zip(peaks, peaks[1:])), peaks
    d = m.difference
    assert d is not None
    assert (m.heaviest, m.lightest) == (world - 1, 0)
    assert abs(d.bytes - (world - 1) * EXTRA) <= 64
    assert m.imbalance == pytest.approx(peaks[-1] / peaks[0])
    line = next(i for i, t in enumerate(WORKER.splitlines(), 1) if "EXTRA LINE" in t)
    site = f"{tmp_path / 'worker.py'}:{line}:<module>"
    top = d.groupings["call_site"].rows[0]
    assert (top.name, top.heavy, top.light) == (site, world * EXTRA, EXTRA)
    assert top.share == pytest.approx(1.0, abs=1e-3)
    assert d.groupings["operator"].rows[0].name == "aten::zeros"
    assert d.named_share is not None and d.named_share >= 0.999
    saved = json.loads(out.read_text())
    assert saved["complete"] and saved["difference"]["bytes"] == d.bytes
    if world == 4:  # a rank whose trace is absent (crashed before writing) is reported
        files[2].unlink()
        m = merge_files([f"{job}.rank*.tmtrace"])
        assert m.missing == [2] and not m.complete and len(m.ranks) == 3
