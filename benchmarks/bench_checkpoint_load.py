"""What estimating a script that loads a checkpoint costs, against the same script building the
model from its config, and against loading the checkpoint for real.

For each model shape a sparse Hugging Face checkpoint is written (a real safetensors header per
shard, the weights left as holes: no disk), and three processes run one after another:

1. ``torchmem estimate --gpu GPU fwd.py CKPT checkpoint``: ``from_pretrained(..., dtype=bf16,
   device_map="cuda")`` and one forward pass, under the estimate (no weight is read);
2. ``torchmem estimate --gpu GPU fwd.py CKPT config``: the same model from ``from_config`` and
   ``.to("cuda")``, the same forward (what the estimate cost before checkpoints were supported);
3. with ``--real`` (small shapes only): ``python fwd.py CKPT real``, transformers'
   ``from_pretrained`` onto the CPU for real (what a load costs in host RAM when weights are read).

Each prints its peak RSS (the process's ``ru_maxrss``), wall time and the parameter bytes the
estimate put on the simulated GPU (equal to the header's).

Usage: ``PYTHONPATH=src python benchmarks/bench_checkpoint_load.py [--models gpt2-124m,llama2-7b,llama2-70b] [--real]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _child import chosen, figure, measured  # noqa: E402
from _sparse_checkpoint import (  # noqa: E402
    LLAMA2_70B,
    llama_config,
    llama_tensors,
    write_sparse_checkpoint,
)

SHAPES = {
    # (llama_tensors arguments, GPU to estimate on)
    "gpt2-124m": (dict(hidden=768, intermediate=3072, layers=12, heads=12, kv_heads=12,
                       vocab=50257), "T4"),
    "llama2-7b": (dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32,
                       vocab=32000), "A100-40GB"),
    "llama2-70b": (LLAMA2_70B, "H200"),
    "tiny": (dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=4, vocab=1000), "T4"),
}

FWD = textwrap.dedent("""
    import sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    path, how = sys.argv[1], sys.argv[2]
    if how == "checkpoint":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    elif how == "config":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                 dtype=torch.bfloat16).to("cuda")
    else:  # real: the weights read onto the host
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        print("PARAMS", sum(p.numel() * p.element_size() for p in model.parameters()),
              file=sys.stderr)
        raise SystemExit(0)
    print("PARAMS", sum(p.numel() * p.element_size() for p in model.parameters()), file=sys.stderr)
    x = torch.randint(0, 1000, (1, 16), device="cuda")
    with torch.no_grad():
        model(x)
""")

def measure(cmd: list[str]) -> tuple[float, int, int, str]:
    """(wall s, peak RSS bytes, parameter bytes, stdout) of one process."""
    wall, rss, out, lines = measured(cmd)
    return wall, rss, figure(lines, "PARAMS"), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-124m,llama2-7b,llama2-70b",
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--real", action="store_true",
                    help="also load the (sparse) checkpoint for real, for shapes under 8 GB")
    a = ap.parse_args()
    names = chosen(ap, a.models, SHAPES)
    GiB = 2**30
    print(f"{'model':<11} {'checkpoint':>10} {'run':<22} {'wall s':>7} {'peak RSS':>10} "
          f"{'GPU params':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        fwd = Path(tmp) / "fwd.py"
        fwd.write_text(FWD)
        for name in names:
            shape, gpu = SHAPES[name]
            folder = Path(tmp) / name
            total = write_sparse_checkpoint(folder, llama_config(**shape), llama_tensors(**shape))
            runs = {}
            for how in ("checkpoint", "config"):
                print(f"  ... {name}: estimate from the {how}", file=sys.stderr, flush=True)
                runs[how] = measure([sys.executable, "-m", "torchmem", "estimate", "--json",
                                     "--gpu", gpu, str(fwd), str(folder), how])
                data = json.loads(runs[how][3][runs[how][3].index("{"):])
                if data["peak_requested_bytes"] < total:
                    raise SystemExit(f"{name} {how}: the estimate's peak "
                                     f"{data['peak_requested_bytes']:,} B is under the weights' "
                                     f"{total:,} B")
            if a.real and total < 8 * GiB:
                print(f"  ... {name}: load for real", file=sys.stderr, flush=True)
                runs["real"] = measure([sys.executable, str(fwd), str(folder), "real"])
            labels = {"checkpoint": f"estimate, {gpu}: load", "config": f"estimate, {gpu}: config",
                      "real": "python: real load (CPU)"}
            for how, (wall, rss, params, _) in runs.items():
                same = "" if params == total else "  DIFFERENT from the header"
                print(f"{name:<11} {total / GiB:>8.2f} G {labels[how]:<22} {wall:>7.1f} "
                      f"{rss / GiB:>8.2f} G {params / GiB:>9.2f} G{same}")
            ck, cf = runs["checkpoint"], runs["config"]
            print(f"{name:<11} checkpoint / config: wall {ck[0] / cf[0]:.2f}x, peak RSS "
                  f"{ck[1] / cf[1]:.2f}x" + (f"; estimate / real load: peak RSS "
                                              f"{ck[1] / runs['real'][1]:.2f}x"
                                              if "real" in runs else ""))


if __name__ == "__main__":
    main()
