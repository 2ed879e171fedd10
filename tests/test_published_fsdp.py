"""Published per-rank GPU memory of FSDP1 (issue 43, more published runs): PyTorch's own test.

Source: pytorch/pytorch, ``test/distributed/fsdp/test_fsdp_memory.py``
(``TestFSDPMemory.test_fsdp_memory``, BSD-3-Clause), as collected in
``../shared/data/public-gpu-truth-2.md`` section 4. It runs in PyTorch's multi-GPU CUDA CI
("Memory expectations are CUDA-specific"), so its expectations hold on real GPUs: two ranks,
``FullyShardedDataParallel`` around a conv net (a stem, three conv blocks, a linear head; each
BatchNorm, each part and the whole model wrapped), SGD with momentum, four iterations, and
``round(memory_allocated() / 2**20)`` read after clearing the cuBLAS workspaces at six points of
each iteration. The published values (MiB, current allocated, rank 0):

- iteration 0: start ``s + 1``; after forward and after the loss 340 (51 with the blocks
  checkpointed); after backward ``2s + 1``; after the step ``3s + 1``; done ``2s + 1``;
- later iterations: start ``2s + 1``; after forward and the loss ``340 + s`` (``51 + s``); after
  backward and after the step ``3s + 1``; done ``2s + 1``;

where ``s = int(model / 2)`` and ``model`` is the unsharded model's allocated MiB, measured by
the test itself. The test allows 1 MiB either way per reading (its rounding); the estimate meets
every reading exactly, so this test asks for equality.

The recipe is rebuilt here in our own code (:data:`SCRIPT`) and run unmodified under
``torchmem.estimate_script(..., world_size=2)``: the fake process group, the fake GPU's
``memory_allocated()`` answered by the allocator simulator, and
``torch._C._cuda_clearCublasWorkspaces()`` (a CUDA build's) giving the workspaces back to it.
The model's size is checked against arithmetic on a host copy of the model too.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import torchmem

pytestmark = pytest.mark.xdist_group("published_fsdp")

MiB = 1 << 20

#: the recipe of the published test, rebuilt (see the module's docstring); prints its readings
SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.utils.checkpoint import checkpoint


    def norm(channels, wrap):
        layer = nn.BatchNorm2d(channels)
        return FSDP(layer) if wrap else layer


    class Net(nn.Module):
        def __init__(self, width=128, wrap=False, ckpt=False):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3), norm(64, wrap), nn.ReLU(inplace=True))
            layers, cin = [], 64
            for _ in range(3):
                layers += [nn.Conv2d(cin, width, 5, padding=2), norm(width, wrap),
                           nn.ReLU(inplace=True)]
                cin = width
            self.blocks = nn.Sequential(*layers, nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten())
            self.head = nn.Linear(width, 10)
            self.ckpt = ckpt

        def forward(self, x):
            h = self.stem(x)
            h = checkpoint(self.blocks, h, use_reentrant=True) if self.ckpt else self.blocks(h)
            return self.head(h)


    def mib():
        torch._C._cuda_clearCublasWorkspaces()
        return round(torch.cuda.memory_allocated() / 2**20)


    ckpt = sys.argv[1:] == ["ckpt"]
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    plain = Net().cuda()
    got = {"model": mib()}
    del plain
    batch = torch.randn(2, 3, 224, 224).cuda()
    torch.manual_seed(0)
    net = Net(wrap=True, ckpt=ckpt)
    net.stem, net.blocks, net.head = FSDP(net.stem), FSDP(net.blocks), FSDP(net.head)
    net = FSDP(net.cuda())
    loss_fn = nn.MSELoss()
    opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    for it in range(4):
        got[f"{it} start"] = mib()
        out = net(batch)
        got[f"{it} after fwd"] = mib()
        total = sum(o.sum() for o in out[0])
        loss = loss_fn(total, torch.tensor(0.0).cuda())
        got[f"{it} after loss"] = mib()
        loss.backward()
        got[f"{it} after bwd"] = mib()
        opt.step()
        got[f"{it} after step"] = mib()
        net.zero_grad(set_to_none=True)
        got[f"{it} done"] = mib()
    print("READINGS " + json.dumps(got))
''')


def _published(model_mib: int, ckpt: bool) -> dict[str, int]:
    """The published expectations (the source's rule, its two measured constants)."""
    s = model_mib // 2
    saved = 51 if ckpt else 340  # "get it from printed memory usage" in the source
    want = {"model": model_mib}
    for it in range(4):
        first = it == 0
        want[f"{it} start"] = s + 1 if first else 2 * s + 1
        want[f"{it} after fwd"] = want[f"{it} after loss"] = saved + (0 if first else s)
        want[f"{it} after bwd"] = 2 * s + 1 if first else 3 * s + 1
        want[f"{it} after step"] = 3 * s + 1
        want[f"{it} done"] = 2 * s + 1
    return want


def _model_mib_by_arithmetic() -> int:
    """The unsharded model's allocated MiB from a host copy: each parameter and buffer one
    block, rounded up to the allocator's 512 B."""
    ns: dict[str, object] = {}
    exec(SCRIPT.split("def mib")[0], ns)  # the imports and the model's classes only
    net = ns["Net"]()  # type: ignore[operator]
    tensors = [*net.parameters(), *net.buffers()]
    return round(sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in tensors) / MiB)


@pytest.mark.parametrize("ckpt", [False, True], ids=["no_ckpt", "ckpt"])
@pytest.mark.filterwarnings("ignore:The passed-in .module. is on CPU")
def test_fsdp1_readings_equal_pytorchs_published_expectations(
        ckpt: bool, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    script = tmp_path / "fsdp_memory.py"
    script.write_text(SCRIPT)
    est = torchmem.estimate_script(script, ["ckpt"] if ckpt else [], gpu="H100-80GB",
                                   world_size=2, steps=10)
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("READINGS ")]
    assert len(lines) == 1, "the script did not run to its end under the estimate"
    got = json.loads(lines[0][len("READINGS "):])
    assert got["model"] == _model_mib_by_arithmetic() == 4
    assert got == _published(got["model"], ckpt)
    # every reading comes from the run's allocator: the forward's saved activations are the
    # peak, and the estimate's peak allocated is at least the largest reading
    assert est.peak_allocated_bytes >= max(got.values()) * MiB - MiB // 2
    assert est.world_size == 2


def test_published_rule_is_the_sources() -> None:
    # the rule above, spelled out for the source's measured model size (4 MiB, so s = 2)
    want = _published(4, ckpt=False)
    assert [want[f"0 {k}"] for k in ("start", "after fwd", "after bwd", "after step", "done")] \
        == [3, 340, 5, 7, 5]
    assert [want[f"1 {k}"] for k in ("start", "after fwd", "after bwd", "after step", "done")] \
        == [5, 342, 7, 7, 5]
    assert _published(4, ckpt=True)["2 after loss"] == 53
