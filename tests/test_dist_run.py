"""``torchmem run --nproc-per-node N`` and ``torchrun ... -m torchmem run``: gloo ranks on CPU.

Each rank writes ``NAME.rank{R}.tmtrace`` with its rank metadata; the parent prints each rank's
peak read back from the files and the merged summary (``NAME.merged.json``, written by the
parent, or by rank 0 under plain torchrun once the other ranks' traces are complete), names a
rank that crashed (its exit code is the job's; the merge says it was cut short) while the other
ranks' traces are complete, and refuses a script that never starts a process group or a rank
count below 1. The per-rank peaks against an independent census are in
``test_dist_census.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchmem.cli import main
from torchmem.cli._dist import rank_info, rank_trace_path
from torchmem.io.tmtrace import load_trace
from torchmem.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]

DDP = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        model(torch.randn(8, 16)).sum().backward(); opt.step(); opt.zero_grad()
        if i == 1 and dist.get_rank() == int(os.environ.get("CRASH_RANK", "-1")):
            os._exit(3)          # a hard crash: no exception, no cleanup, no trace save
    dist.destroy_process_group()
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHMEM_RUN_OPTIONS", "TORCHMEM_JOB_ID"):
        env.pop(name, None)
    return env


def _torchmem(tmp_path: Path, *argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchmem", *argv], cwd=tmp_path,
                          env=_env(**extra), capture_output=True, text=True, timeout=300)


def test_rank_names_and_environment() -> None:
    assert rank_trace_path("a/b.tmtrace", 0) == "a/b.rank0.tmtrace"
    assert rank_trace_path("run", 7) == "run.rank7.tmtrace"
    info = rank_info({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                      "TORCHELASTIC_RUN_ID": "elastic", "TORCHMEM_JOB_ID": "ours"})
    assert info is not None and (info.rank, info.world_size, info.local_rank) == (3, 4, 1)
    assert info.job_id == "ours"                      # the parent's id wins over the launcher's
    assert rank_info({"RANK": "0", "WORLD_SIZE": "2"}) is None   # no LOCAL_RANK: not a launcher
    with pytest.raises(Exception, match="0 <= RANK < WORLD_SIZE"):
        rank_info({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


@pytest.mark.parametrize("n", ["0", "-2"])
def test_rank_count_below_one_is_a_clear_error(n: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert main(["run", "--nproc-per-node", n, str(script)]) == 2
    err = capsys.readouterr().err
    assert f"--nproc-per-node expects a number of ranks >= 1, got {n}" in err
    assert "Traceback" not in err


def test_options_that_need_one_trace_are_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert main(["run", "--nproc-per-node", "2", "--live", str(script)]) == 2
    assert "--live is not available with --nproc-per-node" in capsys.readouterr().err


def _peaks_printed(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"^\s+(\d+)\s+(\S+ \S+)\s+\d+\s+/", out, re.M)}


@pytest.mark.slow
def test_two_ranks_write_their_traces_and_the_parent_prints_their_peaks(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    proc = _torchmem(tmp_path, "run", "--nproc-per-node", "2", "-o", "job.tmtrace", "ddp.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = [load_trace(tmp_path / f"job.rank{r}.tmtrace") for r in (0, 1)]
    metas = [t.metadata for t in traces]
    assert [(m["rank"], m["world_size"], m["local_rank"]) for m in metas] == [(0, 2, 0), (1, 2, 1)]
    assert metas[0]["job_id"] == metas[1]["job_id"] and metas[0]["job_id"]
    assert {m["backend"] for m in metas} == {"gloo"}
    assert not any("cut_short" in m for m in metas)
    printed = _peaks_printed(proc.stdout)
    # the parent's figures are the ones in the files, rank by rank
    assert printed == {r: format_bytes(traces[r].peak()["cpu"]) for r in (0, 1)}
    assert f"job {metas[0]['job_id']}" in proc.stdout
    # and it wrote and printed the merged summary of the job
    merged = json.loads((tmp_path / "job.merged.json").read_text())
    assert merged["complete"] and merged["job_id"] == metas[0]["job_id"]
    assert [r["peak"] for r in merged["ranks"]] == [t.peak()["cpu"] for t in traces]
    assert f"Job {metas[0]['job_id']}: 2 of 2 rank(s), complete" in proc.stdout


@pytest.mark.slow
def test_under_torchrun_each_rank_finds_itself(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "torchmem", "run", "-o", "tr", "ddp.py"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metas = [load_trace(tmp_path / f"tr.rank{r}.tmtrace").metadata for r in (0, 1)]
    assert [m["rank"] for m in metas] == [0, 1]
    assert metas[0]["job_id"] == metas[1]["job_id"] != "none"   # torchrun's run id
    # rank 0 waited for rank 1's complete trace and merged both
    merged = json.loads((tmp_path / "tr.merged.json").read_text())
    assert merged["complete"] and merged["job_id"] == metas[0]["job_id"]
    assert proc.stdout.count("2 of 2 rank(s), complete") == 1


@pytest.mark.slow
def test_a_crashed_rank_is_named_and_the_others_traces_are_complete(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    proc = _torchmem(tmp_path, "run", "--nproc-per-node", "2", "-o", "cr", "ddp.py",
                     CRASH_RANK="1")
    assert proc.returncode == 3, proc.stderr[-3000:]          # the crashed rank's exit code
    assert "rank 1 failed (exit code 3)" in proc.stderr
    assert "rank 0 failed" not in proc.stderr
    t0 = load_trace(tmp_path / "cr.rank0.tmtrace")
    assert "cut_short" not in t0.metadata                      # complete, saved by rank 0
    assert sum(1 for e in t0.events() if e.op == "step") == 2  # both finished steps are there
    t1 = load_trace(tmp_path / "cr.rank1.tmtrace")             # a readable prefix
    assert "cut_short" in t1.metadata and t1.metadata["rank"] == 1
    merged = json.loads((tmp_path / "cr.merged.json").read_text())
    assert not merged["complete"] and merged["cut_short"] == [1]
    assert "INCOMPLETE" in proc.stdout


@pytest.mark.slow
def test_a_script_without_a_process_group_is_refused_after_the_run(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("import torch\nx = torch.ones(100)\n")
    proc = _torchmem(tmp_path, "run", "--nproc-per-node", "2", "-o", "p", "plain.py")
    assert proc.returncode == 2
    assert "ranks 0, 1 never called torch.distributed.init_process_group" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert load_trace(tmp_path / "p.rank1.tmtrace").peak() == {"cpu": 400}
    assert not (tmp_path / "p.merged.json").exists()    # not a job: nothing merged
    # under torchrun the rank says so itself
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", "torchmem", "run", "-o", "q", "plain.py"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "rank 0 never called torch.distributed.init_process_group" in proc.stderr
