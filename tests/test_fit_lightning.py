"""An unmodified Lightning ``Trainer.fit()`` under the estimate (issue 24): it runs (the metric
states torchmetrics deep-copies, the loss it logs), and the GPU it needs is the same step
written as a plain loop, computed the ordinary way."""

from __future__ import annotations

import pytest
import torch

import torchmem

L = pytest.importorskip("lightning")


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                       torch.nn.Linear(2048, 512))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).square().mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def _lightning(batch, model_class=_Model, **trainer_options):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 512)),
                                       batch_size=batch)
    model = model_class()                               # on the host: Lightning moves it
    options = {"devices": 1, **trainer_options}
    trainer = L.Trainer(max_steps=2, accelerator="gpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **options)
    return lambda: trainer.fit(model, data)


def _plain(batch):
    model = _Model().cuda()
    opt = model.configure_optimizers()
    x = torch.randn(batch, 512, device="cuda")

    def step():
        for _ in range(2):
            loss = model.net(x).square().mean()
            loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return step


def test_lightning_fit_needs_what_the_plain_loop_needs():
    fit = torchmem.estimate(_lightning, gpu="T4", batch_size=16, steps=1, margin=0)
    loop = torchmem.estimate(_plain, gpu="T4", batch_size=16, steps=1, margin=0)
    assert fit.fits and fit.assumed_values  # the logged loss was answered and listed
    # Lightning adds its logged metric's few scalars (32 B here) and their 512 B blocks
    assert 0 <= fit.peak_requested_bytes - loop.peak_requested_bytes <= 64
    assert 0 <= fit.peak_allocated_bytes - loop.peak_allocated_bytes <= 8 * 512
    assert fit.peak_reserved_bytes == loop.peak_reserved_bytes
    params = (512 * 2048 + 2048 + 2048 * 512 + 512) * 4
    assert fit.by_category["parameter"] == loop.by_category["parameter"] == params
    # Lightning runs forward and backward inside optimizer.step(closure): they are still the
    # model's (before: the activations were the optimizer's "other" and its modules were named
    # under the optimizer)
    for cat in ("gradient", "optimizer_state", "temporary"):
        assert fit.by_category[cat] == loop.by_category[cat], cat
    # the activations live at the peak: the loop's, and the logged metric's scalars (32 B)
    assert 0 <= fit.by_category["activation"] - loop.by_category["activation"] <= 64
    assert sorted(fit.by_module) == sorted(loop.by_module)  # none named under "Identity"
    # host memory: the model is built there, and at the end of fit() Lightning's teardown moves
    # the model (weights and gradients) and AdamW's two moments back to the host
    # (Strategy.teardown: module.cpu(), optimizer state to "cpu"), beside the 64 x 512 dataset;
    # plus AdamW's step counters and the logged scalars (a few bytes)
    dataset = 64 * 512 * 4
    assert 4 * params + dataset <= fit.host_peak_bytes <= 4 * params + dataset + 64
    assert loop.host_peak_bytes == params         # the plain loop: built there, then .cuda()


def _lightning_ddp(batch):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 512)),
                                       batch_size=batch)
    model = _Model()
    trainer = L.Trainer(max_steps=2, accelerator="gpu", devices=2, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    return lambda: trainer.fit(model, data)


def _plain_ddp(batch, side_stream=False):
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    class Forward(torch.nn.Module):  # what Lightning's wrapper runs: training_step's forward
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model.net(x)

    model = _Model().cuda()
    # Lightning's DDPStrategy._setup_model builds DDP under a stream of its own
    ctx = torch.cuda.stream(torch.cuda.Stream()) if side_stream else contextlib.nullcontext()
    with ctx:
        ddp = DDP(Forward(model), device_ids=[0])
    opt = model.configure_optimizers()
    x = torch.randn(batch, 512, device="cuda")

    def step():
        for _ in range(2):
            loss = ddp(x).square().mean()
            loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return step


def test_lightning_ddp_on_two_devices_needs_what_a_plain_ddp_loop_needs():
    """``Trainer(devices=2, strategy="ddp")`` as rank 0 of 2: the fake CUDA shows two devices
    (Lightning checks), the step runs through DDP's gradient buckets, and the GPU peaks equal a
    plain DDP loop's (DDP's buckets: one copy of the 4.2 MB of gradients, in two buckets)
    built as Lightning builds it: under a stream of its own, whose pool then holds the buckets'
    segment (20 MiB more reserved than the same loop building DDP on the default stream)."""
    fit = torchmem.estimate(_lightning_ddp, gpu="T4", batch_size=16, steps=1, margin=0,
                            world_size=2)
    loop = torchmem.estimate(_plain_ddp, gpu="T4", batch_size=16, steps=1, margin=0,
                             world_size=2, params={"side_stream": True})
    default = torchmem.estimate(_plain_ddp, gpu="T4", batch_size=16, steps=1, margin=0,
                                world_size=2)
    assert fit.world_size == loop.world_size == 2
    assert 0 <= fit.peak_requested_bytes - loop.peak_requested_bytes <= 64
    assert fit.peak_reserved_bytes == loop.peak_reserved_bytes
    assert loop.peak_allocated_bytes == default.peak_allocated_bytes
    # the 4.2 MB of buckets: a segment of 20 MiB (requests between 1 and 10 MiB) in the side
    # stream's pool, which the default stream cannot share
    assert loop.peak_reserved_bytes - default.peak_reserved_bytes == 20 << 20
    params = (512 * 2048 + 2048 + 2048 * 512 + 512) * 4
    assert fit.by_category["parameter"] == loop.by_category["parameter"] == params
    assert fit.by_category["gradient"] == loop.by_category["gradient"] == params
    # DDP's buckets hold every gradient once (the all-reduce's communication buffers)
    assert fit.by_category["communication"] == loop.by_category["communication"] == params


def test_a_trainer_that_saves_checkpoints_runs_and_writes_nothing(tmp_path, monkeypatch,
                                                                  capsys):
    """Lightning's ModelCheckpoint saves atomically (fsspec: a temporary file moved onto the
    target, then chmod) under a name formatted from 0-d tensors (``epoch=0-step=1``): the run
    goes on past its saves, nothing reaches the disk, the renames are listed."""
    import os
    import textwrap

    from torchmem.fit.targets._script import estimate_script

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck.py").write_text(textwrap.dedent("""
        import torch, lightning as L

        class M(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(64, 64)

            def training_step(self, batch, i):
                (x,) = batch
                loss = self.net(x).square().mean()
                self.log("train_loss", loss)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(64, 64)), batch_size=8)
        ck = L.pytorch.callbacks.ModelCheckpoint(dirpath="ckpts", every_n_train_steps=1,
                                                 save_top_k=-1, filename="{epoch}-{step}")
        L.Trainer(max_steps=3, accelerator="gpu", devices=1, logger=False, callbacks=[ck],
                  enable_progress_bar=False).fit(M(), data)
        # the checkpoint read back (Lightning's pl_load: fsspec, then torch.load of the file)
        m = M.load_from_checkpoint("ckpts/epoch=0-step=2.ckpt", map_location="cuda")
        print("restored", tuple(m.net.weight.shape), m.net.weight.is_cuda,
              torch.cuda.memory_allocated())
    """))
    e = estimate_script("ck.py", [], "T4", steps=5)
    assert e.script.steps_run == 3 and e.script.stopped == "end"
    assert os.listdir(tmp_path) == ["ck.py"]
    renamed = sorted(os.path.basename(w.path) for w in e.script.skipped_writes
                     if w.what.startswith("os.rename"))
    assert renamed[:2] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    restored = capsys.readouterr().out.split("restored ")[1].split()
    assert restored[:3] == ["(64,", "64)", "True"], restored


def _lightning_accumulating(batch):
    return _lightning(batch, accumulate_grad_batches=2)


def test_accumulation_lever_on_lightning_is_its_accumulate_grad_batches():
    """``grad_accumulation_2`` on a Lightning ``Trainer.fit()`` is Lightning's own
    ``accumulate_grad_batches=2`` at half the batch: the row equals that Trainer written by
    hand (all three GPU peaks), and says how it was applied."""
    e = torchmem.estimate(_lightning, gpu="T4", batch_size=16, steps=1, margin=0,
                          what_if=["grad_accumulation_2"])
    r = e.what_if[0]
    assert r.skipped is None and "accumulate_grad_batches=1 -> 2" in r.applied, r.applied
    h = torchmem.estimate(_lightning_accumulating, gpu="T4", batch_size=8, steps=1, margin=0)
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)


def _lightning_16_mixed(batch):
    return _lightning(batch, precision="16-mixed")


def test_fp16_lever_on_lightning_is_its_16_mixed_precision():
    """``fp16_autocast`` on a Lightning ``Trainer.fit()`` is Lightning's own
    ``precision="16-mixed"`` (its autocast and its GradScaler, which steps with Lightning's
    closure; torchmem's scaler refused the closure and the row failed): equal to that Trainer
    written by hand, all three GPU peaks."""
    e = torchmem.estimate(_lightning, gpu="T4", batch_size=16, steps=1, margin=0,
                          what_if=["fp16_autocast"])
    r = e.what_if[0]
    assert r.skipped is None and r.applied == "mixed precision by Lightning: precision='16-mixed'"
    h = torchmem.estimate(_lightning_16_mixed, gpu="T4", batch_size=16, steps=1, margin=0)
    assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
        h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes)


FABRIC = """
import sys, torch
import lightning as L
from lightning.fabric.strategies import FSDPStrategy
how = sys.argv[1] if sys.argv[1:] else ""
# by hand: Fabric's own sharding over 2 GPUs, or on one GPU with the state on the host
kw = ({"strategy": "fsdp", "devices": 2} if how == "fsdp" else
      {"strategy": FSDPStrategy(cpu_offload=True), "devices": 1} if how == "offload" else
      {"devices": 1})
fabric = L.Fabric(accelerator="cuda", **kw)
fabric.launch()
with fabric.rank_zero_first():  # litgpt's data setup: a Gloo group and its monitored barrier
    data = torch.randn(16, 512)
with fabric.init_module():
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
        for _ in range(4)])
model = fabric.setup_module(model)
opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
for i in range(3):
    loss = model(data.to(fabric.device)).pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    fabric.print(f"step {i} loss {loss.item():.4f}")
"""


def test_sharding_levers_on_fabric_are_its_own_fsdp_strategy(tmp_path):
    """Lightning Fabric's shape (litgpt's): ``fabric.launch()``, ``rank_zero_first()`` (a
    ``new_group(backend="gloo")`` and its ``monitored_barrier``: under the fake ranks the group
    is a fake one, the barrier returns; a Gloo group over the fake store failed every sharding
    row), ``fabric.setup_module(model)``, then the optimizer. The sharding levers are Fabric's
    own: ``fsdp_2`` is ``Fabric(strategy="fsdp", devices=2)`` and ``cpu_offload``
    ``Fabric(strategy=FSDPStrategy(cpu_offload=True), devices=1)``, each equal to that written by
    hand and estimated as rank 0 of its ranks, all three GPU peaks to the byte."""
    script = tmp_path / "fabric_script.py"
    script.write_text(FABRIC)
    e = torchmem.estimate_script(str(script), [], "T4", what_if=["fsdp_2", "cpu_offload"])
    rows = {r.lever: r for r in e.what_if}
    hands = {}
    for lever, how, world, said in (
            ("fsdp_2", "fsdp", 2, "sharded over 2 GPUs by Lightning Fabric: strategy='fsdp', "
                                  "devices=2"),
            ("cpu_offload", "offload", 1, "sharded over 1 GPU by Lightning Fabric: "
                                          "strategy=FSDPStrategy(cpu_offload=True), devices=1")):
        r = rows[lever]
        assert r.skipped is None, r.skipped
        assert r.applied == said
        h = hands[lever] = torchmem.estimate_script(str(script), [how], "T4", world_size=world)
        assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
            h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes), lever
    # FSDP1 over 2 ranks: each holds half the flat parameters (4 blocks of two Linear layers)
    params = 4 * (512 * 2048 + 2048 + 2048 * 512 + 512) * 4
    assert hands["fsdp_2"].model_state["parameter"] == params // 2
    assert rows["fsdp_2"].peak_requested_bytes < e.peak_requested_bytes
    assert rows["cpu_offload"].peak_requested_bytes < e.peak_requested_bytes


def test_sharding_levers_on_lightning_are_its_own_fsdp_strategy_or_shard_its_network():
    """``fsdp_2`` on a one-device Lightning ``Trainer`` is Lightning's own sharding:
    ``strategy="fsdp", devices=2`` (its ``FSDPStrategy``, FSDP1), equal to that written into
    the ``Trainer`` by hand and estimated as rank 0 of 2; ``cpu_offload`` (one GPU) is
    ``strategy=FSDPStrategy(cpu_offload=True)``, equal to that written by hand. All three GPU
    peaks to the byte."""
    e = torchmem.estimate(_lightning, gpu="T4", batch_size=16, what_if=["fsdp_2", "cpu_offload"])
    rows = {r.lever: r for r in e.what_if}

    fsdp = rows["fsdp_2"]
    assert fsdp.skipped is None, fsdp.skipped
    assert fsdp.applied == "sharded over 2 GPUs by Lightning: strategy='fsdp', devices=2"
    by_hand = torchmem.estimate(lambda b: _lightning(b, strategy="fsdp", devices=2), gpu="T4",
                                batch_size=16, world_size=2)
    offload = rows["cpu_offload"]
    assert offload.skipped is None and offload.applied == (
        "sharded over 1 GPU by Lightning: strategy=FSDPStrategy(cpu_offload=True), devices=1")
    from lightning.pytorch.strategies import FSDPStrategy

    offload_by_hand = torchmem.estimate(
        lambda b: _lightning(b, strategy=FSDPStrategy(cpu_offload=True)), gpu="T4",
        batch_size=16, world_size=1)
    for r, h in ((fsdp, by_hand), (offload, offload_by_hand)):
        assert (r.peak_requested_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (
            h.peak_requested_bytes, h.peak_allocated_bytes, h.peak_reserved_bytes), r.lever
        assert r.peak_requested_bytes < e.peak_requested_bytes
    # FSDP1 shards the flat parameters over the 2 ranks: half the model per rank
    params = (512 * 2048 + 2048 + 2048 * 512 + 512) * 4
    assert by_hand.model_state["parameter"] == params // 2
