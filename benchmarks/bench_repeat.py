"""Repeated calls replayed: a nanoGPT-shaped training script estimated with its repeated model
calls replayed into the simulator (the default) and with every call run (``--no-replay``, the
estimate before replays), side by side, each in its own process (wall time and peak RSS); the
two estimates must agree to the byte.

Workload (nanoGPT's defaults): transformers' ``GPT2LMHeadModel`` at GPT-2 124M (``use_cache=False``,
as for training: a call that returns a KV cache object is run, not replayed), batch 12 x 1024
tokens, bf16 autocast, fused AdamW; each optimizer step evaluates first (``--eval-iters`` no-grad
forwards of each of two splits) and then accumulates ``--accumulation`` micro-steps; the estimate
stops after two optimizer steps. ``--smoke``: 1 layer, 64 wide, batch 2 x 32, 4 evaluation
batches, 4 micro-steps (checks that it runs; the figures mean nothing).

Run:  python benchmarks/bench_repeat.py            (about 4 minutes on our 2 cores)
      python benchmarks/bench_repeat.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel
    smoke, eval_iters, accumulation = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
    # a training script's model: no KV cache returned (a call that returns one is run)
    cfg = (GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=32,
                      use_cache=False) if smoke else GPT2Config(use_cache=False))
    batch, seq = (2, 32) if smoke else (12, 1024)
    model = GPT2LMHeadModel(cfg).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    ctx = torch.autocast("cuda", torch.bfloat16)
    data = torch.randint(0, cfg.vocab_size, (batch * 64, seq))

    def get_batch():
        i = torch.randint(0, data.shape[0] - batch, (1,)).item()
        x = data[i:i + batch].pin_memory().to("cuda", non_blocking=True)
        return x, x.clone()

    for it in range(10):
        model.eval()
        with torch.no_grad():
            for split in ("train", "val"):
                for _ in range(eval_iters):
                    x, y = get_batch()
                    with ctx:
                        model(input_ids=x, labels=y).loss.item()
        model.train()
        x, y = get_batch()
        for micro in range(accumulation):
            with ctx:
                loss = model(input_ids=x, labels=y).loss / accumulation
            x, y = get_batch()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
""")

RUN = textwrap.dedent("""
    import json, resource, sys, time
    from torchmem.fit import estimate_script
    t = time.perf_counter()
    e = estimate_script(sys.argv[1], sys.argv[3:], "A100-40GB", replay_repeats=sys.argv[2] == "1")
    print(json.dumps({"wall": time.perf_counter() - t, "replayed": e.calls_replayed,
                      "peaks": [e.peak_requested_bytes, e.peak_allocated_bytes,
                                e.peak_reserved_bytes],
                      "by_category": e.by_category, "by_module": e.by_module,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


def _one(script: str, replay: bool, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, script, "1" if replay else "0", *args],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the estimate failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--eval-iters", type=int, default=None)
    ap.add_argument("--accumulation", type=int, default=None)
    a = ap.parse_args()
    evals = a.eval_iters if a.eval_iters is not None else (4 if a.smoke else 200)
    acc = a.accumulation if a.accumulation is not None else (4 if a.smoke else 40)
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        args = ["1" if a.smoke else "0", str(evals), str(acc)]
        fast = _one(script, True, args)
        full = _one(script, False, args)
    calls = 2 * (2 * evals + acc)
    print(f"{calls} model calls in two optimizer steps ({2 * evals} evaluation forwards and "
          f"{acc} micro-steps each)")
    print(f"replayed ({fast['replayed']} calls replayed): {fast['wall']:.1f} s, "
          f"{fast['rss'] / 2**30:.2f} GiB peak RSS")
    print(f"every call run (--no-replay):  {full['wall']:.1f} s, "
          f"{full['rss'] / 2**30:.2f} GiB peak RSS")
    print(f"ratio: {full['wall'] / fast['wall']:.2f}x faster; RSS "
          f"{fast['rss'] / full['rss']:.2f}x")
    same = all(fast[k] == full[k] for k in ("peaks", "by_category", "by_module"))
    print(f"peaks (requested, allocated, reserved) {fast['peaks']}: "
          f"{'equal' if same else 'DIFFERENT: ' + str(full['peaks'])}, split equal: {same}")
    if not same or not fast["replayed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
