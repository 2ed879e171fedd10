"""The longest context that fits: ``estimate(maximize="seq_len")`` against a hand-written
bisection over ``estimate`` calls (what a user would write without ``--max``).

Workload: transformers' ``LlamaForCausalLM`` from a Llama-2-7B-sized config (32 layers, hidden
4096, intermediate 11008, 32 heads, vocab 32000; 6.74 B parameters), bf16 weights, SDPA
attention, one prefill forward under ``torch.no_grad()`` keeping the last token's logits
(``build(batch, seq_len=2048)``), batch 1. ``--quick``: 4 layers, hidden 1024.

Both methods answer the same question with the same rule (the error margin kept free) and must
give the same answer; the table shows the probes (fake runs) each needed and the wall time.
  torchmem    estimate(build, gpu, maximize="seq_len"): doubling from the build's default,
              then the memory curve of the probes picks the next one (bisection after a
              misprediction)
  torchmem/256  the same with search_range=(2048, 2**22, 256): multiples of 256 only (the
              answer fits, answer + 256 does not)
  bisection   doubling from 2048 with estimate(build, gpu, params={"seq_len": n}), then
              bisection between the last fit and the first miss

Run:  python benchmarks/bench_search.py           (a few minutes on our 2 cores)
      python benchmarks/bench_search.py --quick
      python benchmarks/bench_search.py --quick --layers 1 --gpus RTX-4090   (the tests' smoke run)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import torchmem

QUICK = False
LAYERS: int | None = None  # --layers: overrides the config's layer count


def build(batch: int, seq_len: int = 2048) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if QUICK:
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    if LAYERS is not None:
        cfg.num_hidden_layers = LAYERS
    cfg.max_position_embeddings = max(seq_len, 2048)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16, as from_pretrained(dtype=...) does
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="cuda")

    def step() -> None:
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
    return step


def by_bisection(gpu: str) -> tuple[int, int]:
    """Doubling from 2048, then bisection, each probe an ``estimate`` with the same rule."""
    probes = 0

    def fits(n: int) -> bool:
        nonlocal probes
        probes += 1
        return torchmem.estimate(build, gpu=gpu, batch_size=1, params={"seq_len": n},
                                 steps=1).fits

    good, bad = 0, 2048
    while fits(bad):
        good, bad = bad, bad * 2
    if good == 0:
        good, bad = 0, 2048  # (not reached for these GPUs)
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, probes


def main() -> None:
    global QUICK, LAYERS
    gpus = ["RTX-4090", "H100-80GB"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small Llama (4 layers)")
    ap.add_argument("--layers", type=int, default=None, help="this many layers (default 32, 4 quick)")
    ap.add_argument("--gpus", default=",".join(gpus), help=f"comma-separated (default {','.join(gpus)})")
    args = ap.parse_args()
    QUICK, LAYERS = args.quick, args.layers
    gpus = [g for g in args.gpus.split(",") if g]
    if QUICK:
        what = f"Llama {LAYERS or 4} x 1024"
    else:
        what = "Llama-2-7B config" + (f" with {LAYERS} layers" if LAYERS is not None else "")
    print(f"{what}, bf16, SDPA, prefill forward, batch 1: the longest seq_len that fits\n")
    print(f"{'gpu':<11}{'method':<13}{'answer':>8}{'probes':>8}{'seconds':>9}  attention")
    torchmem.estimate(build, gpu=gpus[0], batch_size=1, steps=1)  # imports, first-call costs
    for g in gpus:
        t0 = time.perf_counter()
        e = torchmem.estimate(build, gpu=g, batch_size=1, maximize="seq_len", steps=1)
        t_guided = time.perf_counter() - t0
        t0 = time.perf_counter()
        e256 = torchmem.estimate(build, gpu=g, batch_size=1, maximize="seq_len", steps=1,
                                 search_range=(2048, 1 << 22, 256))
        t_step = time.perf_counter() - t0
        t0 = time.perf_counter()
        answer, n = by_bisection(g)
        t_bisect = time.perf_counter() - t0
        print(f"{g:<11}{'torchmem':<13}{e.max_value:>8}{len(e.probes):>8}{t_guided:9.1f}  "
              f"{e.attention_kernel}")
        print(f"{g:<11}{'torchmem/256':<13}{e256.max_value:>8}{len(e256.probes):>8}"
              f"{t_step:9.1f}")
        print(f"{g:<11}{'bisection':<13}{answer:>8}{n:>8}{t_bisect:9.1f}")
        same = "same answer" if answer == e.max_value else "DIFFERENT ANSWERS"
        print(f"{'':<11}time ratio torchmem / bisection: {t_guided / t_bisect:.2f} (probes "
              f"{len(e.probes)} vs {n}, {same}); torchmem/256 / bisection: "
              f"{t_step / t_bisect:.2f} (answer {e256.max_value} = {e.max_value} rounded down "
              f"to 256: {e256.max_value == e.max_value // 256 * 256})")


if __name__ == "__main__":
    main()
