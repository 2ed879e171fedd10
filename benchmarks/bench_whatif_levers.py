"""Benchmark: ``--what-if`` on a Llama-7B training step (issue 25's speed goal: the table of
about 15 estimates in at most 3 minutes on our 2 cores), beside what a user does without it.

Workload: transformers' ``LlamaForCausalLM`` from a config (32 layers, hidden 4096,
intermediate 11008, 32 heads, vocab 32000; 6.74 B parameters), fp32 weights, AdamW, batch 2 x
2048 tokens, ``loss.backward(); opt.step(); opt.zero_grad()``, on an H100-80GB (it does not fit
as written: 16 bytes per parameter of model state alone). ``--quick``: 4 layers, hidden 1024, 512
tokens, on a 2 GiB card; ``--smoke``: 2 layers, hidden 64 (checks that it runs).

Methods, each in this process, one after the other:
  what-if     torchmem.estimate(build, what_if=True): every lever, the table and the best
              combination (each lever's run on the card with unbounded memory; reruns on the
              card only where blocks fit it)
  one         torchmem.estimate(build): the step as written, once (what each variant written by
              hand and estimated separately costs: the table replaces about 15 of them)

Prints the wall time of each, the what-if's time over one estimate (how many estimates' worth
the table costs) and the process's peak RSS.

Run:  python benchmarks/bench_whatif_levers.py            (a few minutes on our 2 cores)
      python benchmarks/bench_whatif_levers.py --quick
      python benchmarks/bench_whatif_levers.py --smoke
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import torchmem


def _config(size: str):  # noqa: ANN202
    from transformers import LlamaConfig

    if size == "smoke":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                           max_position_embeddings=32), 32, "1 GiB"
    if size == "quick":
        return LlamaConfig(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                           max_position_embeddings=512), 512, "2 GiB"
    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=2048), 2048, "H100-80GB"


def main() -> None:
    """Run the benchmark (see the module's documentation).

    Example:
        >>> import subprocess, sys
        >>> r = subprocess.run([sys.executable, "benchmarks/bench_whatif_levers.py", "--smoke"],
        ...                    capture_output=True, text=True)  # doctest: +SKIP
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    size = "smoke" if a.smoke else "quick" if a.quick else "full"
    cfg, seq, card = _config(size)

    def build(batch: int):  # noqa: ANN202
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return step

    t = time.perf_counter()
    one = torchmem.estimate(build, gpu=card, batch_size=2)
    t_one = time.perf_counter() - t
    t = time.perf_counter()
    n = [0]

    def say(msg: str) -> None:
        n[0] += msg.startswith("what-if")
        print(f"  [{time.perf_counter() - t:6.1f} s] {msg}", flush=True)

    e = torchmem.estimate(build, gpu=card, batch_size=2, what_if=True, progress=say)
    t_table = time.perf_counter() - t
    from torchmem.fit.levers._whatif import what_if_lines

    print("\n".join(what_if_lines(e.what_if, e.what_if_best, e)))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    done = sum(r.skipped is None for r in e.what_if)
    print(f"\nLlama ({size}), batch 2 x {seq}, {card}: as written "
          f"{'fits' if one.fits else 'does not fit'}")
    print(f"one estimate {t_one:.1f} s; what-if table ({done} levers run, "
          f"{len(e.what_if) - done} skipped, best combination included) {t_table:.1f} s = "
          f"{t_table / t_one:.1f} estimates' time; peak RSS {rss:.2f} GiB")


if __name__ == "__main__":
    main()
