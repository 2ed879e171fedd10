"""Under DDP the logged figures are the maximum across ranks: 2 gloo ranks on CPU, with
Lightning (``strategy="ddp"``) and with transformers' ``Trainer`` under ``torchrun``.

Lightning's own ``strategy="ddp"`` launches the second rank (it runs the script again with
``LOCAL_RANK=1``). The ranks differ on purpose: rank 1 makes an extra 1 MiB temporary in each
``training_step``, alive through the forward, so its peak is higher. Ground truth per rank and step, as in
``test_integrations_lightning``: a census of every live tensor at the step's start (minus what
was alive at train start other than the model: the data, DDP's gradient buckets) and PyTorch's
profiler for the step's rise. DDP's C++ reducer makes its bucket before training where no Python
object wraps it; the tracker's dispatch mode wraps it at its first ``all_reduce``, after which
the garbage collector finds it: ``_step_census.DDPBuckets`` keeps the census from counting that
bucket, alive since before training, as new (the tracker rightly does not count it). What
every rank logs must equal the maximum of the ranks' censuses.

``find_unused_parameters=True`` keeps DDP from rebuilding its gradient bucket after the first
step: the rebuild allocates the new bucket and frees the old one inside one C++ call, which the
dispatch-level tracker records free-first (it sees an operator's output when the operator
returns), so the profiler's rise of that step is one bucket (8,708 bytes here) higher than the
tracker's. A known limit of the tracker, measured while writing this test, not of the max.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")

ROOT = Path(__file__).resolve().parents[1]
SLACK = 128
EXTRA = 1 << 20

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from _step_census import DDPBuckets, StepProfile, census, outside
    from torchmem.integrations.lightning import MemoryCallback

    OUT = sys.argv[1]

    class Census(pl.Callback):
        def __init__(self):
            self.starts, self.rises = [], []

        def on_train_start(self, trainer, module):
            self.outside = outside(module)   # after DDP made its buckets
            self.buckets = DDPBuckets()

        def on_train_batch_start(self, trainer, module, batch, idx):
            self.starts.append(census() - self.outside - self.buckets.seen_late())
            self.prof = StepProfile()

        def on_train_batch_end(self, trainer, module, out, batch, idx):
            self.rises.append(self.prof.rise())

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, idx):
            x, y = batch
            extra = torch.ones(EXTRA // 4) if self.global_rank == 1 else None
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            del extra   # rank 1's temporary lives through the forward
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    if __name__ == "__main__":
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(96, 32), torch.randn(96, 1))
        census_cb, cb = Census(), MemoryCallback()
        trainer = pl.Trainer(
            max_steps=3, callbacks=[census_cb, cb], accelerator="cpu", devices=2,
            strategy="ddp_find_unused_parameters_true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT)
        trainer.fit(Tiny(), DataLoader(data, batch_size=16))
        with open(os.path.join(OUT, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"starts": census_cb.starts, "rises": census_cb.rises,
                       "logged": [p.metrics() for p in cb.history]}, f)
    """
).replace("EXTRA // 4", str(EXTRA // 4))


@pytest.mark.slow
def test_logged_figures_are_the_max_over_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
               MASTER_ADDR="127.0.0.1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_logged_max(tmp_path)


def _check_logged_max(folder: Path) -> None:
    """Both ranks logged the same three steps, each the max of the two ranks' censuses."""
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["logged"] == ranks[1]["logged"]
    assert len(ranks[0]["logged"]) == 3
    for step, logged in enumerate(ranks[0]["logged"]):
        peaks = [r["starts"][step] + r["rises"][step] for r in ranks]
        starts = [r["starts"][step] for r in ranks]
        # the ranks really differ: rank 1's extra temporary raises its peak (by 1 MiB less
        # the few KiB rank 0's backward and optimizer step rise above its forward)
        assert peaks[1] - peaks[0] >= EXTRA - 64 * 1024
        assert abs(logged["memory/live_at_start_bytes"] - max(starts)) <= SLACK
        assert 0 <= max(peaks) - logged["memory/peak_bytes"] <= 2 * SLACK, (step, logged, peaks)


MISMATCH = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torchmem.integrations._meter import StepMeter

    def rank_main(rank, out, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        net = torch.nn.Linear(64, 64)
        meter = StepMeter(net).start()
        meter.begin_step()
        if rank == 0:
            x = torch.ones(1024)            # 4 KiB, outside any module: phase "other" only
            del x
        else:
            y = net(torch.ones(32, 64))     # a forward phase only rank 1 has
            del y
        peaks = meter.end_step()
        meter.stop()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(peaks.metrics(), f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        mp.spawn(rank_main, args=(sys.argv[1], port), nprocs=2)
    """
)


@pytest.mark.slow
def test_ranks_that_saw_different_phases_still_agree(tmp_path: Path) -> None:
    """Rank 0's step has only an "other" phase, rank 1's a forward: a fixed-length all_reduce
    would hang or mix figures; matched by name, each figure is the max of the ranks that had it."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    params = 64 * 64 * 4 + 64 * 4
    # live at start: the parameters on both ranks; rank 0's peak: + 4 KiB; rank 1's: + input
    # 8 KiB + output 8 KiB
    assert r0["memory/live_at_start_bytes"] == r1["memory/live_at_start_bytes"] == params
    assert r0["memory/peak_bytes"] == r1["memory/peak_bytes"] == params + 2 * 8192
    assert r0["memory/other_peak_bytes"] == params + 8192   # rank 1's input, made outside a module
    assert "memory/forward_peak_bytes" not in r0
    assert r1["memory/forward_peak_bytes"] == params + 2 * 8192


TRANSFORMERS_DDP = textwrap.dedent(
    """
    import gc, json, os, sys, weakref
    import torch, transformers
    from _step_census import DDPBuckets, StepProfile, census, outside
    from torchmem.integrations.transformers import MemoryCallback
    EXTRA = 1 << 20

    class Census(transformers.TrainerCallback):
        def __init__(self):
            self.starts, self.rises = [], []
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.outside = outside(model)
            self.buckets = DDPBuckets()
        def on_step_begin(self, args, state, control, **kw):
            self.starts.append(census() - self.outside - self.buckets.seen_late())
            self.prof = StepProfile()
        def on_step_end(self, args, state, control, **kw):
            self.rises.append(self.prof.rise())

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        def forward(self, x, labels):
            extra = torch.ones(EXTRA // 4) if int(os.environ["RANK"]) == 1 else None
            loss = torch.nn.functional.mse_loss(self.net(x), labels)
            del extra
            return {"loss": loss}

    if __name__ == "__main__":
        out = sys.argv[1]
        g = torch.Generator().manual_seed(0)
        data = [{"x": torch.randn(32, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(96)]
        args = transformers.TrainingArguments(output_dir=os.path.join(out, "o"), max_steps=3, per_device_train_batch_size=16,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, learning_rate=1e-3, ddp_find_unused_parameters=True)
        model = Tiny()
        c, cb = Census(), MemoryCallback()
        tr = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[c, cb])
        tr.train()
        rank = int(os.environ["RANK"])
        logged = [{k: v for k, v in row.items() if k.startswith("memory/")} for row in tr.state.log_history if "memory/peak_bytes" in row]
        result = {"starts": c.starts, "rises": c.rises, "logged": logged,
                  "world": torch.distributed.get_world_size()}
        # PyTorch's documented shutdown. The Trainer leaves the group alive, and its own
        # store_flos() all_gather at train end can still be held by gloo's thread at interpreter
        # exit, which aborts the rank (PyTorch's race, reproduced without torchmem: an
        # all_gather right before exit aborted 2 of 20 two-rank runs). The DDP model holds the
        # group, so it goes first; our callback, kept for its history, must not hold it.
        group = weakref.ref(torch.distributed.group.WORLD)
        del tr, model
        gc.collect()
        torch.distributed.destroy_process_group()
        gc.collect()
        result["group_alive_after_destroy"] = group() is not None
        result["history"] = len(cb.history)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    """
)


@pytest.mark.slow
def test_transformers_under_torchrun_logs_the_max_over_two_gloo_ranks(tmp_path: Path) -> None:
    """transformers' ``Trainer`` under ``torchrun --nproc_per_node 2`` on CPU (gloo); rank 1
    keeps an extra 1 MiB through its forward. What both ranks log (``state.log_history``) is
    the maximum of the two ranks' censuses."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    (tmp_path / "hf_train.py").write_text(TRANSFORMERS_DDP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(tmp_path / "hf_train.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world"] == 2
        # the callback (still referenced, 3 steps in its history) keeps no Trainer or model
        # alive: destroy_process_group really ends the group
        assert result["history"] == 3
        assert result["group_alive_after_destroy"] is False
    _check_logged_max(tmp_path)
