"""Will a Llama-7B training step fit? ``torchmem.estimate`` side by side with what users run
instead, each in a fresh subprocess (wall time and peak RSS of that process).

Workload: transformers' ``LlamaForCausalLM`` from a config (32 layers, hidden 4096,
intermediate 11008, 32 heads, vocab 32000; 6.74 B parameters), fp32, AdamW, batch 1 x 2048
tokens, ``loss.backward(); opt.step(); opt.zero_grad()``. ``--quick``: 4 layers, hidden 1024,
intermediate 2752, 512 tokens. ``--smoke``: 2 layers, hidden 64, vocab 1000, 32 tokens (checks
that it runs; the figures mean nothing).

Methods:
  torchmem       torchmem.estimate(build, gpu="H200", batch_size=1): 2 steps under fake
                 tensors through the simulated caching allocator: peak requested (exact),
                 allocated (blocks) and reserved (segments), fits or not
  memtracker     PyTorch's torch.distributed._tools.mem_tracker.MemTracker under
                 FakeTensorMode, the same 2 steps: peak of tensor bytes per module (allocated
                 only; no caching allocator, so no reserved figure and no fit verdict)
  formula        parameter count x 4 bytes x 4 (weights, gradients, two AdamW states) on the
                 meta device, as `accelerate estimate-memory` and DeepSpeed's estimators do:
                 no activations, no temporaries, no allocator

Run:  python benchmarks/bench_estimate.py           (about 1 minute on our 2 cores)
      python benchmarks/bench_estimate.py --quick
      python benchmarks/bench_estimate.py --smoke
"""

from __future__ import annotations

import argparse

from _child import run_child

CHILD = r'''
import json, resource, sys, time
import torch
method, size = sys.argv[1], sys.argv[2]

def config():
    from transformers import LlamaConfig
    if size == "smoke":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                           max_position_embeddings=32), 32
    if size == "quick":
        return LlamaConfig(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                           max_position_embeddings=512), 512
    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=2048), 2048

def parts(batch):
    from transformers import LlamaForCausalLM
    cfg, seq = config()
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, step

def build(batch):
    return parts(batch)[2]

t0 = time.perf_counter()
out = {}
if method == "torchmem":
    import torchmem
    e = torchmem.estimate(build, gpu="H200", batch_size=1, default_device="cuda")
    out = {"peak_requested": e.peak_requested_bytes, "peak_allocated": e.peak_allocated_bytes,
           "peak_reserved": e.peak_reserved_bytes, "fits_h200": e.fits,
           "fits_h200_sim": e.fits_without_margin, "margin": e.margin_bytes,
           "fits_h100": e.peak_reserved_bytes <= torchmem.fit.gpu("H100-80GB").usable_bytes}
elif method == "memtracker":
    from torch._subclasses import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    with FakeTensorMode():
        model, opt, step = parts(1)
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for _ in range(2):
                step()
                mt.reset_mod_stats()
        peak = mt.get_tracker_snapshot("peak")
    out = {"peak_allocated": int(sum(d.get("Total", 0) for d in peak.values()))}
elif method == "formula":
    from transformers import LlamaForCausalLM
    cfg, _ = config()
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    out = {"parameters": n, "peak_requested": n * 4 * 4}
out["seconds"] = time.perf_counter() - t0
out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
'''


def run(method: str, size: str) -> dict:
    return run_child(CHILD, method, size)


def gib(n: int | None) -> str:
    return f"{'-':>11}" if n is None else f"{n / 2**30:7.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small Llama config")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama (tests: it runs)")
    args = ap.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    what = {"smoke": "Llama 2 x 64, 32 tokens", "quick": "Llama 4 x 1024, 512 tokens",
            "full": "Llama-7B config, 1 x 2048 tokens"}[size]
    print(f"{what}, fp32 AdamW training step; each method in a fresh subprocess\n")
    res = {m: run(m, size) for m in ("torchmem", "memtracker", "formula")}
    print(f"{'method':<12}{'seconds':>9}{'peak RSS':>13}  {'requested':>11}  {'allocated':>11}"
          f"  {'reserved':>11}  verdict")
    for m, r in res.items():
        if "error" in r:
            print(f"{m:<12} failed: {r['error']}")
            continue
        verdict = ""
        if m == "torchmem":
            h200 = "fits" if r["fits_h200"] else "OOM"
            if r.get("fits_h200_sim") and not r["fits_h200"]:
                h200 = f"fits only without the {gib(r['margin']).strip()} margin"
            verdict = f"H200 {h200}, H100-80GB {'fits' if r['fits_h100'] else 'OOM'}"
        print(f"{m:<12}{r['seconds']:9.1f}{gib(r['max_rss']):>13}  {gib(r.get('peak_requested'))}"
              f"  {gib(r.get('peak_allocated'))}  {gib(r.get('peak_reserved'))}  {verdict}")
    t = res["torchmem"]
    if "error" not in t:
        for m in ("memtracker", "formula"):
            r = res[m]
            if "error" in r:
                continue
            fig = r.get("peak_allocated") or r.get("peak_requested")
            print(f"torchmem reserved / {m} figure: {t['peak_reserved'] / fig:.3f}   "
                  f"time ratio torchmem / {m}: {t['seconds'] / r['seconds']:.2f}")
        limits = "" if size != "full" else (
            f"   (goal: <= 120 s and <= 4 GiB: {'met' if t['seconds'] <= 120 and t['max_rss'] <= 4 << 30 else 'NOT met'})")
        print(f"torchmem: {t['seconds']:.1f} s, peak RSS {t['max_rss'] / 2**30:.2f} GiB{limits}")


if __name__ == "__main__":
    main()
