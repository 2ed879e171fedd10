"""Published per-rank bounds of FSDP2 (issue 43, more published runs): PyTorch's own test.

Source: pytorch/pytorch, ``test/distributed/_composable/fsdp/test_fully_shard_memory.py``
(``TestFullyShardMemory.test_fully_shard_training_memory``, BSD-3-Clause), named in
``../shared/data/public-gpu-truth-2.md`` section 4. It runs in PyTorch's multi-GPU CUDA CI, so
its bounds hold on real GPUs: two ranks; a 3-block transformer (dim 768, 12 heads, vocabulary
32, untied output) with each block and then the model ``fully_shard``-ed, optionally with CPU
offload and with or without resharding after the forward; Adam without ``foreach``; one
forward on a (1, 4) input, backward, ``step()`` and ``zero_grad()``. At each phase the rank's
``round(active_bytes.all.peak / 1e6)`` less its value after a warm-up (a 768 x 768 linear's
forward and backward, then ``empty_cache()``) must not pass a bound computed from the model's
own element counts (MB = 1e6): after sharding ``(sharded + one block) x 4 B + 4 MB``; after
the forward ``(3 x block + non-block) x 4 B + 16 MB`` (+ the sharded parameters without
offload), or ``(sharded + unsharded + block) x 4 B + 16 MB`` without resharding; after backward
likewise with 2 x sharded, or 1.5 x block; after the step ``4 x sharded x 4 B + 16 MB``; after
``zero_grad`` ``3 x sharded x 4 B + 32 MB``.

The recipe is rebuilt here in our own code (:data:`SCRIPT`, our own transformer of the same
shape: the bounds are formulas of the model's own counts) and run unmodified under
``torchmem.estimate_script(..., world_size=2)``. The bounds are upper bounds of a run on a real
GPU, so an estimate above one is an overestimate there (never a false "fits"); the phases the
estimate passes today are listed (:data:`_OVER`, with what is known of each) and the test
fails when that list changes, either way.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import torchmem

pytestmark = pytest.mark.xdist_group("published_fsdp")

SCRIPT = textwrap.dedent('''
    import functools, json, sys
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard


    class Block(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
            self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            b, s, d = x.shape
            h = self.attention_norm(x)
            q, k, v = (w(h).view(b, s, self.heads, -1).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
            x = x + self.drop(self.wo(a.transpose(1, 2).reshape(b, s, d)))
            return x + self.drop(self.w2(F.gelu(self.w1(self.ffn_norm(x)))))


    class Transformer(nn.Module):
        def __init__(self, vocab=32, dim=768, heads=12, layers=3, seq=16):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.pos_embeddings = nn.Embedding(seq, dim)
            self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
            self.norm, self.output = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            pos = torch.arange(ids.size(1), device=ids.device)
            h = self.tok_embeddings(ids) + self.pos_embeddings(pos)
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h)).float()


    reshard, offload = sys.argv[1] == "1", sys.argv[2] == "1"
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())


    def peak():
        return round(torch.cuda.memory_stats()["active_bytes.all.peak"] / 1e6)


    def current():
        return round(torch.cuda.memory_stats()["active_bytes.all.current"] / 1e6)


    torch.manual_seed(42)
    lin = nn.Linear(768, 768, device="cuda")
    lin(torch.randn(1, 768, device="cuda")).sum().backward()
    torch.cuda.empty_cache()
    base = peak()
    model = Transformer()
    count = lambda m: sum(p.numel() for p in m.parameters())
    numel = count(model)
    got = {"numel": numel, "sharded": (numel + 1) // 2, "block": count(model.layers[0]),
           "non_block": sum(count(m) for m in (model.tok_embeddings, model.pos_embeddings,
                                               model.norm, model.output))}
    shard = functools.partial(fully_shard, reshard_after_forward=reshard,
                              offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for layer in model.layers:
        shard(layer)
    shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    got["init_peak"], got["init_current"] = peak() - base, current() - base
    loss = model(torch.randint(0, 32, (1, 4), device="cuda"))
    got["forward"] = peak() - base
    loss.sum().backward()
    got["backward"] = peak() - base
    del loss
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    got["step"] = peak() - base
    opt.zero_grad()
    torch.cuda.reset_peak_memory_stats()
    got["zero_grad"] = peak() - base
    print("READINGS " + json.dumps(got))
''')


def _bounds(got: dict[str, int], reshard: bool, offload: bool) -> dict[str, float]:
    """The published test's bounds (MB) for this model's counts."""
    sharded, block, numel, other = got["sharded"], got["block"], got["numel"], got["non_block"]
    mb = 4 / 1e6  # fp32 bytes per element, in MB
    init = (1.5 * block if offload else sharded + block) * mb
    if reshard:
        forward = (3 * block + other) * mb + 16 + (0 if offload else sharded * mb)
        backward = (3 * block + other) * mb + 16 + (0 if offload else 2 * sharded * mb)
    else:
        forward = (sharded + numel + block) * mb + 16
        backward = (sharded + numel + 1.5 * block) * mb + 16
    step = 16 + (0 if offload else 4 * sharded * mb)
    zero = 0 if offload else 3 * sharded * mb + 32
    return {"init_peak": init + 4, "init_current": init, "forward": forward,
            "backward": backward, "step": step, "zero_grad": zero}


def _readings(tmp_path: Path, capfd: pytest.CaptureFixture[str], reshard: bool,
              offload: bool) -> dict[str, int]:
    script = tmp_path / "fully_shard_memory.py"
    script.write_text(SCRIPT)
    est = torchmem.estimate_script(script, ["1" if reshard else "0", "1" if offload else "0"],
                                   gpu="H100-80GB", world_size=2, steps=10)
    assert est.world_size == 2
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("READINGS ")]
    assert len(lines) == 1, "the script did not run to its end under the estimate"
    return json.loads(lines[0][len("READINGS "):])


# The gaps found, pinned so that a change in either direction shows (each a phase whose
# estimate passes the real GPU's bound: an overestimate there): without resharding, torch
# 2.13's FSDP2 keeps the previous all-gather output referenced while the next block's copy-out
# runs (two live at once: forward and backward about 20 MB over); the optimizer step is under
# 1 MB over (Adam's two temporaries of the largest sharded parameter, 4.7 MB each, and the
# rounding to whole MB); with CPU offload the backward is 16 MB over and 1 MB stays after
# zero_grad (a bound of 0): causes not found yet.
_OVER = {(True, False): {"step"}, (False, False): {"forward", "backward", "step"},
         (True, True): {"backward", "zero_grad"}}


@pytest.mark.parametrize("reshard, offload", [(True, False), (False, False), (True, True)],
                         ids=["reshard", "no_reshard", "offload"])
@pytest.mark.filterwarnings("ignore:The passed-in .module. is on CPU")
def test_fsdp2_phases_within_pytorchs_published_bounds(
        reshard: bool, offload: bool, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    got = _readings(tmp_path, capfd, reshard, offload)
    bounds = _bounds(got, reshard, offload)
    over = {k for k, bound in bounds.items() if got[k] > bound}
    assert over == _OVER[(reshard, offload)], (got, bounds)
    for k in set(bounds) - over:
        assert 0 <= got[k] <= bounds[k]
