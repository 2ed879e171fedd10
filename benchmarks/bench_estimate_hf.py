"""Longest context of a 7B Llama (bf16) on a 24 GB and an 80 GB GPU, from its config alone.

Workload: transformers' ``LlamaForCausalLM`` from the config below (Llama-2-7B's shape: 32
layers, hidden 4096, intermediate 11008, 32 heads and 32 KV heads, vocab 32000; 6.74 B
parameters; max_position_embeddings raised to 131072 so long prompts are in range), bf16,
SDPA attention, batch 1, ``generate()`` with a dynamic cache: a prompt of ``seq_len`` tokens,
then ``--new-tokens`` new tokens (default 1: the prompt's prefill and its KV cache, the step
where a long context peaks). Nothing is downloaded: the config is written here.

Methods, side by side:
  torchmem     torchmem.estimate_hf(config, task="generate", gpu=..., maximize="seq_len"):
               every probe builds the model with fake tensors and runs generate() through the
               simulated caching allocator (weights, KV cache, activations, cuBLAS workspace,
               CUDA context, allocator rounding, the documented error margin); the answer is a
               true boundary (fits at the answer, not one token more)
  arithmetic   what calculators print: (GPU memory - weights) / KV bytes per token, with
               weights = parameters x 2 bytes and KV = 2 x layers x kv_heads x head_dim x 2
               bytes per token, GPU memory = the card's cudaMemGetInfo total

Since issue 26 the search predicts most probes from the allocator requests of the probes that
ran (``torchmem.fit.run._stream``) and runs the answer and one more for real (their decode steps
after the first few replayed through the simulator, ``torchmem.fit.run._decode``); since session
11 the answer's per-category split and KV-cache figures come from that replay too, where
before the answer was run a third time with every decode step through the model.
``--rerun-answer`` restores that third run (the path before), ``--all-real`` runs every probe
(the search before issue 26), ``--compare`` runs the search as now and with the answer rerun,
side by side, with the answers, the time ratio and whether the split and KV figures agree.

It prints each answer, the ratio torchmem / arithmetic, the breakdown at torchmem's answer,
the probes and the wall time (the bar: both GPUs in under a minute on our 2 cores).

Run:  python benchmarks/bench_estimate_hf.py
      python benchmarks/bench_estimate_hf.py --new-tokens 16
      python benchmarks/bench_estimate_hf.py --new-tokens 16 --gpus "24 GiB"
      python benchmarks/bench_estimate_hf.py --new-tokens 16 --gpus "24 GiB" --compare
      python benchmarks/bench_estimate_hf.py --quick      (4 layers: a smoke run)
      python benchmarks/bench_estimate_hf.py --layers 1 --gpus RTX-4090   (the tests' smoke run)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

CONFIG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
GPUS = ("RTX-4090", "H100-80GB")


def arithmetic(cfg: dict, total_bytes: int) -> tuple[int, int, int]:
    """(weights bytes, KV bytes per token, longest context) by the calculators' arithmetic."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                              cfg["vocab_size"])
    head_dim = h // heads
    per_layer = (h * h * 2 + h * kv_heads * head_dim * 2   # q, o; k, v
                 + 3 * h * inter + 2 * h)                  # mlp; two norms
    params = layers * per_layer + 2 * vocab * h + h         # + embeddings, lm_head, final norm
    weights = params * 2
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    return weights, kv_per_token, (total_bytes - weights) // kv_per_token


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 layers instead of 32")
    ap.add_argument("--layers", type=int, default=None, help="this many layers instead of 32")
    ap.add_argument("--gpus", default=",".join(GPUS),
                    help=f"comma-separated (default {','.join(GPUS)})")
    ap.add_argument("--all-real", action="store_true",
                    help="run every probe (no predicted probes: the search before issue 26)")
    ap.add_argument("--rerun-answer", action="store_true",
                    help="run the answer a third time in full for its split (the path before "
                    "session 11)")
    ap.add_argument("--compare", action="store_true",
                    help="the search as now, then with --rerun-answer, with the time ratio")
    args = ap.parse_args()
    import torchmem
    import torchmem.fit.search._bracket as search_mod
    from torchmem.fit import gpu
    from torchmem.units import format_bytes as fmt

    layers = args.layers or (4 if args.quick else CONFIG["num_hidden_layers"])
    cfg = dict(CONFIG, num_hidden_layers=layers)
    gpus = [g for g in args.gpus.split(",") if g]
    # warm-up, untimed: imports and first-call costs would go to whichever mode runs first
    torchmem.estimate_hf(dict(cfg, num_hidden_layers=1), task="generate", gpu=gpus[0],
                         seq_len=8, max_new_tokens=4)
    t_all = time.perf_counter()
    modes = ["predicted", "answer rerun"] if args.compare else [
        "all real" if args.all_real else "answer rerun" if args.rerun_answer else "predicted"]
    rounds = search_mod.STREAM_ROUNDS
    inexact = search_mod._inexact
    seen: dict[str, tuple[float, Any]] = {}
    for name, mode in [(g, m) for g in gpus for m in modes]:
        search_mod.STREAM_ROUNDS = rounds if mode != "all real" else 0
        # the path before session 11: an answer with decode steps replayed is run in full
        search_mod._inexact = ((lambda e: e.decode_replayed > 0) if mode == "answer rerun"
                               else inexact)
        card = gpu(name)
        weights, per_token, answer = arithmetic(cfg, card.total_bytes)
        t0 = time.perf_counter()
        est = torchmem.estimate_hf(
            cfg, task="generate", gpu=card, batch_size=1, seq_len=max(1, answer // 4),
            max_new_tokens=args.new_tokens, maximize="seq_len",
            progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True),
        )
        took = time.perf_counter() - t0
        best = est.max_value or 0
        cat = est.by_category
        kv = est.kv_cache
        guessed = len(est.predicted_probes)
        print(f"{name} ({fmt(card.total_bytes)} total) [{mode}]: longest context "
              f"{best:,} tokens (torchmem) vs {answer:,} (arithmetic); ratio "
              f"{best / answer:.3f}; {len(est.probes)} probes ({guessed} predicted) in "
              f"{took:.1f} s")
        print(f"  at {best:,} tokens: weights {fmt(cat['parameter'])} (arithmetic "
              f"{fmt(weights)}), KV cache {fmt(cat['kv_cache'])} "
              f"({fmt(kv.bytes_per_token) if kv else '?'} per token; arithmetic "
              f"{fmt(per_token)}), activations {fmt(cat['activation'])}, workspace "
              f"{fmt(cat['workspace'])}, CUDA context {fmt(est.overhead_bytes)}, peak "
              f"reserved {fmt(est.peak_reserved_bytes)}, margin {fmt(est.margin_bytes)}, "
              f"kernel {est.attention_kernel}; decode steps replayed in the answer's run: "
              f"{est.decode_replayed}")
        if name in seen:
            t_first, first = seen[name]
            same = [k for k in ("max_value", "peak_requested_bytes", "peak_allocated_bytes",
                                "peak_reserved_bytes", "by_category", "by_module", "kv_cache")
                    if getattr(first, k) != getattr(est, k)]
            print(f"  {modes[0]} / {mode} time: {t_first / took:.3f}; answer, peaks, split, "
                  f"by_module and KV figures {'equal' if not same else 'DIFFER: ' + str(same)}")
        else:
            seen[name] = (took, est)
    total = time.perf_counter() - t_all
    what = "both GPUs" if gpus == list(GPUS) else ", ".join(gpus)
    print(f"total {total:.1f} s for {what} (bar: under 60 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
