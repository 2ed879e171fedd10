"""QLoRA estimated without a GPU and without the weights: what the estimate says and costs, next to
the same fine-tune in bf16 and to accelerate's ``estimate-memory`` rule for int4.

For each model shape a sparse Hugging Face checkpoint is written (a real safetensors header, the
weights left as holes), then two processes run ``torchmem estimate --json --gpu GPU`` on one
training script, each a fresh process:

- ``qlora``: ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit=True, nf4, double
  quantization, bf16 compute)``, ``prepare_model_for_kbit_training`` (gradient checkpointing),
  LoRA r=16 on every linear layer, bitsandbytes' ``PagedAdamW8bit``, ``model.train()``, two
  steps of batch 1 x 512 tokens;
- ``lora-bf16``: the same model loaded in bf16, the same LoRA, gradient checkpointing and
  ``torch.optim.AdamW``.

Printed: the GPU bytes right after the load (the script reads ``torch.cuda.memory_stats()``'s
``requested_bytes.all.current``, answered by the simulator), the arithmetic for the 4-bit load
(bitsandbytes' packing: two weights per byte, one uint8 absmax per 64, one float32 per 256
absmax, offset, code and map copies; embeddings, norms and the head stay bf16; the rotary
embedding's two float32 buffers), accelerate's ``estimate-memory`` figure for int4 (its rule:
the float32 size / 8; it has no training figure for int4), the peak reserved, the estimator's
wall time and peak RSS, and the ratios.

Usage: ``PYTHONPATH=src python benchmarks/bench_qlora.py [--models llama2-7b] [--gpu T4]``
(needs transformers, peft, accelerate and bitsandbytes: ``pip install -e ".[test]"``).
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
from _sparse_checkpoint import llama_config, llama_tensors, write_sparse_checkpoint  # noqa: E402

SHAPES = {
    "llama2-7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32,
                      vocab=32000),
    "tiny": dict(hidden=256, intermediate=640, layers=2, heads=4, kv_heads=4, vocab=1000),
}

TRAIN = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    path, how, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if how == "qlora":
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant,
                                                     device_map={"": 0})
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     device_map={"": 0})
    print("LOADED", torch.cuda.memory_stats()["requested_bytes.all.current"], file=sys.stderr)
    if how == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if how == "qlora":
        import bitsandbytes
        opt = bitsandbytes.optim.PagedAdamW8bit(params, lr=2e-4)
    else:
        opt = torch.optim.AdamW(params, lr=2e-4)
    for _ in range(2):
        x = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
""")

def four_bit_load(shape: dict[str, int]) -> int:
    """Bytes a 4-bit load of a Llama checkpoint keeps on the GPU (see the module docstring)."""
    h, i, v, n_layers = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    linears = [h * h, kv * h, kv * h, h * h, i * h, i * h, h * i]
    per = 0
    for n in linears:
        blocks = -(-n // 64)
        per += -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4 + 256 * 4 + 16 * 4
    bf16 = 2 * (2 * v * h + (2 * n_layers + 1) * h)  # embeddings, head, norms
    rope = 2 * 4 * (h // shape["heads"] // 2)  # inv_freq and original_inv_freq (float32)
    return per * n_layers + 256 * 4 + bf16 + rope


def accelerate_int4(shape: dict[str, int]) -> int:
    """accelerate's ``estimate-memory`` for int4: the model's float32 size / 8 (its
    ``gather_data``), computed in this process on an empty model built from the config."""
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM, LlamaConfig

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{
            k: v for k, v in llama_config(**shape).items() if k != "architectures"}),
            dtype=torch_float32())
    total, _ = calculate_maximum_sizes(model)
    return int(total / 8)


def torch_float32() -> object:
    import torch

    return torch.float32


def measure(cmd: list[str]) -> tuple[float, int, int, dict]:
    """(wall s, peak RSS bytes, GPU bytes after the load, the estimate's JSON)."""
    wall, rss, out, lines = measured(cmd, timeout=3600)
    return wall, rss, figure(lines, "LOADED"), json.loads(out[out.index("{"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama2-7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--gpu", default="T4", help="the GPU to estimate on (default T4, 16 GB)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    a = ap.parse_args()
    names = chosen(ap, a.models, SHAPES)
    GiB = 2**30
    print(f"{'model':<10} {'run':<10} {'loaded':>9} {'peak reserved':>14} {'fits':>5} "
          f"{'wall s':>7} {'peak RSS':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(TRAIN)
        for name in names:
            shape = SHAPES[name]
            folder = Path(tmp) / name
            weights = write_sparse_checkpoint(folder, llama_config(**shape), llama_tensors(**shape))
            runs = {}
            for how in ("qlora", "lora-bf16"):
                print(f"  ... {name}: estimate {how}", file=sys.stderr, flush=True)
                runs[how] = measure([sys.executable, "-m", "torchmem", "estimate", "--json",
                                     "--gpu", a.gpu, str(script), str(folder), how, str(a.seq)])
            for how, (wall, rss, loaded, data) in runs.items():
                print(f"{name:<10} {how:<10} {loaded / GiB:>7.2f} G "
                      f"{data['peak_reserved_bytes'] / GiB:>12.2f} G {str(data['fits']):>5} "
                      f"{wall:>7.1f} {rss / GiB:>7.2f} G")
            q, b = runs["qlora"], runs["lora-bf16"]
            want = four_bit_load(shape)
            same = "equal" if q[2] == want else f"DIFFERENT by {q[2] - want:+,} B"
            print(f"{name:<10} 4-bit load: {q[2]:,} B estimated, {want:,} B by arithmetic ({same});"
                  f" accelerate estimate-memory int4: {accelerate_int4(shape):,} B")
            print(f"{name:<10} qlora / lora-bf16: loaded {q[2] / b[2]:.2f}x, peak reserved "
                  f"{q[3]['peak_reserved_bytes'] / b[3]['peak_reserved_bytes']:.2f}x; "
                  f"estimator peak RSS / checkpoint: {q[1] / weights:.3f}x")


if __name__ == "__main__":
    main()
