"""Per-rank memory of an FSDP2 job without the ranks: ``torchmem.estimate(..., world_size=N)``
side by side with what users run instead, each in a fresh subprocess (wall time, peak RSS).

Workload: transformers' ``LlamaForCausalLM`` from a config (TinyLlama-1.1B: 22 layers, hidden
2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000; 1.10 B parameters), fp32 weights,
``fully_shard`` on every decoder layer and on the model (bf16 compute and all-gathers, fp32
reduce-scatters: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), AdamW,
batch 1 x 2048 tokens, 2 steps of ``loss.backward(); opt.step(); opt.zero_grad()``; rank 0 of
``N``. ``--quick``: 4 layers, hidden 512, 512 tokens. ``--smoke``: 2 layers, hidden 64, vocab
1000, 32 tokens (checks that it runs; the figures mean nothing).

Methods:
  torchmem        torchmem.estimate(build, gpu="H100-80GB", batch_size=1, world_size=N):
                  fake process group and fake tensors set up by torchmem; peak requested
                  (exact), allocated (blocks), reserved (segments), the communication buffers,
                  the model state, a verdict
  fsdpmemtracker  PyTorch's FSDPMemTracker on the same model and steps, with the setup a user
                  writes by hand: PyTorch's fake process group (backend "fake", FakeStore), the
                  device mesh built before FakeTensorMode is entered, fully_shard(mesh=...);
                  peak tensor bytes by FSDP category (no allocator: no reserved figure, no
                  verdict)
  formula         ZeRO-3 arithmetic, as DeepSpeed's estimate_zero3_model_states_mem_needs:
                  parameters x (4 weights + 4 gradients + 8 AdamW) / N; no activations, no
                  gathered layers, no buffers, no allocator

Run:  python benchmarks/bench_fit_dist.py                  (world sizes 8 and 64; a few minutes)
      python benchmarks/bench_fit_dist.py --quick
      python benchmarks/bench_fit_dist.py --smoke --world-sizes 2
"""

from __future__ import annotations

import argparse

from _child import run_child

CHILD = r'''
import json, resource, sys, time
import torch
method, size, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

def config():
    from transformers import LlamaConfig
    if size == "smoke":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                           max_position_embeddings=32), 32
    if size == "quick":
        return LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                           max_position_embeddings=512), 512
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                       max_position_embeddings=2048), 2048

def parts(batch, mesh=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM
    cfg, seq = config()
    model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, step, ids

def build(batch):
    return parts(batch)[2]

t0 = time.perf_counter()
out = {}
if method == "torchmem":
    import torchmem
    e = torchmem.estimate(build, gpu="H100-80GB", batch_size=1, world_size=n)
    out = {"peak_requested": e.peak_requested_bytes, "peak_allocated": e.peak_allocated_bytes,
           "peak_reserved": e.peak_reserved_bytes, "fits": e.fits,
           "communication": e.by_category["communication"],
           "model_state": sum(v for k, v in e.model_state.items() if k != "communication")}
elif method == "fsdpmemtracker":
    import torch.distributed as dist
    from torch._subclasses import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    mesh = init_device_mesh("cpu", (n,))  # outside FakeTensorMode: a mesh reads its values
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, opt, step, ids = parts(1, mesh)
        fmt = FSDPMemTracker(model, opt)
        fmt.track_inputs((ids,))  # made before its context: counted only when given
        with fmt:
            for _ in range(2):
                step()
                fmt.reset_mod_stats()  # it refuses a second iteration otherwise
        (peak,) = fmt.get_tracker_snapshot("peak").values()
    dist.destroy_process_group()
    names = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    out = {"peak_requested": names["Total"],
           "communication": names["All Gather"] + names["Reduce Scatter"]}
elif method == "formula":
    from transformers import LlamaForCausalLM
    cfg, _ = config()
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    out = {"parameters": params, "peak_requested": params * 16 // n}
out["seconds"] = time.perf_counter() - t0
out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
'''

METHODS = ("torchmem", "fsdpmemtracker", "formula")


def run(method: str, size: str, n: int) -> dict:
    return run_child(CHILD, method, size, str(n))


def gib(n: int | None) -> str:
    """GiB with three decimals (per-rank figures are small)."""
    return f"{'-':>11}" if n is None else f"{n / 2**30:7.3f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small Llama config")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama (tests: it runs)")
    ap.add_argument("--world-sizes", default="8,64", help="comma-separated, default 8,64")
    args = ap.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    what = {"smoke": "Llama 2 x 64, 32 tokens", "quick": "Llama 4 x 512, 512 tokens",
            "full": "TinyLlama-1.1B config, 1 x 2048 tokens"}[size]
    print(f"{what}, FSDP2 per layer (bf16 gathers), AdamW; rank 0 of N; each method in a "
          "fresh subprocess\n")
    for n in (int(x) for x in args.world_sizes.split(",")):
        res = {m: run(m, size, n) for m in METHODS}
        print(f"world size {n}")
        print(f"  {'method':<15}{'seconds':>8}{'peak RSS':>13}  {'requested':>11}  "
              f"{'allocated':>11}  {'reserved':>11}  {'comm. at peak':>13}  verdict")
        for m, r in res.items():
            if "error" in r:
                print(f"  {m:<15} failed: {r['error']}")
                continue
            verdict = ("fits" if r["fits"] else "OOM") + " on H100-80GB" if m == "torchmem" else ""
            print(f"  {m:<15}{r['seconds']:8.1f}{gib(r['max_rss']):>13}  "
                  f"{gib(r.get('peak_requested'))}  {gib(r.get('peak_allocated'))}  "
                  f"{gib(r.get('peak_reserved'))}  {gib(r.get('communication')):>13}  {verdict}")
        t, f = res["torchmem"], res["fsdpmemtracker"]
        if "error" not in t and "error" not in f:
            print(f"  peak requested torchmem - FSDPMemTracker: "
                  f"{t['peak_requested'] - f['peak_requested']:,} B; "
                  f"time torchmem / FSDPMemTracker: {t['seconds'] / f['seconds']:.2f}; "
                  f"peak RSS: {t['max_rss'] / f['max_rss']:.2f}")
        z = res["formula"]
        if "error" not in t and "error" not in z:
            print(f"  ZeRO-3 formula / torchmem model state: "
                  f"{z['peak_requested'] / t['model_state']:.3f}; formula / torchmem peak "
                  f"reserved: {z['peak_requested'] / t['peak_reserved']:.3f}")
        print()


if __name__ == "__main__":
    main()
