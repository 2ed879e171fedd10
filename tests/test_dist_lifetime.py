"""Tracking under ``torch.distributed`` leaves the process group's lifetime alone (2 gloo ranks).

Two hazards found when CI aborted two-rank jobs at exit ("terminate called without an active
exception", see ``torchmem._distributed``):

- entering a dispatch mode after ``init_process_group`` imports ``torch.distributed.nn.functional``,
  whose default arguments then hold the default group, so ``destroy_process_group`` does not
  destroy it. The control run (a do-nothing dispatch mode, no torchmem) shows the hazard is real;
  with torchmem's tracker, imported after the group exists (the worst case), the group dies at
  ``destroy_process_group`` (a weak reference to it is dead), and the functional collectives still
  use the default group (an ``all_reduce`` of ones sums to the world size).
- the per-step gather of figures returns only once gloo's thread has released its tensors:
  every tensor it passed to ``all_gather`` is held by nothing else (use count 1) when it returns.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed missing")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, weakref
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.utils._python_dispatch import TorchDispatchMode

    class Nothing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def rank_main(rank, variant, out, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        result = {}
        if variant == "control":
            with Nothing():
                dist.all_reduce(torch.ones(4))
        else:
            import torchmem                      # after the group exists: the worst case
            import torchmem._distributed as D
            passed = []
            real = dist.all_gather
            def all_gather(outs, mine, *a, **k):
                passed.extend([mine, *outs])
                return real(outs, mine, *a, **k)
            dist.all_gather = all_gather
            net = torch.nn.Linear(64, 64)
            with torchmem.track(net):
                net(torch.ones(8, 64)).sum().backward()
                dist.all_reduce(torch.ones(4))
                figures = {"rank": rank, "only_on_%d" % rank: 100 + rank}
                result["gathered"] = D.gather_dicts(figures)
                result["use_counts"] = [t._use_count() for t in passed]
            import torch.distributed.nn.functional as F
            result["defaults_hold_group"] = any(
                d is dist.group.WORLD for d in F.all_reduce.__defaults__)
            result["functional_sum"] = F.all_reduce(torch.ones(2)).tolist()
        group = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        import gc; gc.collect()
        result["group_alive_after_destroy"] = group() is not None
        with open(os.path.join(out, f"{variant}{rank}.json"), "w") as f:
            json.dump(result, f)

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2], int(sys.argv[3])), nprocs=2)
    """
)


def _run(tmp_path: Path, variant: str) -> list[dict]:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(script), variant, str(tmp_path), str(port)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{variant}{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_a_plain_dispatch_mode_keeps_the_group_alive(tmp_path: Path) -> None:
    """The control: what torch does without torchmem's guard."""
    for rank in _run(tmp_path, "control"):
        assert rank["group_alive_after_destroy"] is True


@pytest.mark.slow
def test_tracking_leaves_the_group_destroyable_and_gathers_safely(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "tracked")
    for r, rank in enumerate(ranks):
        assert rank["group_alive_after_destroy"] is False
        assert rank["defaults_hold_group"] is False
        assert rank["functional_sum"] == [2.0, 2.0]          # the default group: 2 ranks
        assert rank["gathered"] == [{"rank": 0, "only_on_0": 100},
                                    {"rank": 1, "only_on_1": 101}]
        # two all_gathers (sizes, then payloads) of 1 + 2 tensors each, all released
        assert rank["use_counts"] == [1] * 6, (r, rank["use_counts"])


def test_gather_without_a_group_is_the_one_dict() -> None:
    from torchmem._distributed import gather_dicts

    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this test process")
    assert gather_dicts({"memory/peak_bytes": 7}) == [{"memory/peak_bytes": 7}]
