"""Checkpoints whose weights are holes: a real safetensors header (or sharded index), the data
left unwritten (``os.truncate`` makes a sparse file), so a 140 GB checkpoint takes no disk.

Used by the checkpoint tests and ``benchmarks/bench_checkpoint_load.py``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
          "BOOL": 1}


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """One safetensors file with ``tensors`` (name -> (dtype name, shape)); returns its size."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * _SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
    size = 8 + len(raw) + at
    os.truncate(path, size)
    return size


def write_sparse_checkpoint(folder: Path, config: dict, tensors: dict[str, tuple[str, list[int]]],
                            shard_bytes: int = 5 * 2**30) -> int:
    """A Hugging Face checkpoint folder: ``config.json``, shards of at most ``shard_bytes`` and
    ``model.safetensors.index.json``; returns the weights' bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shards: list[dict[str, tuple[str, list[int]]]] = [{}]
    size = 0
    total = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * _SIZES[dtype]
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, shape)
        size += n
        total += n
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_sparse_safetensors(folder / file, shard)
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def llama_tensors(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                  vocab: int, dtype: str = "BF16", tied: bool = False
                  ) -> dict[str, tuple[str, list[int]]]:
    """The tensor names and shapes of a transformers ``LlamaForCausalLM`` checkpoint."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    out: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": (dtype, [vocab, hidden])}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (dtype, [hidden])
        out[p + "self_attn.q_proj.weight"] = (dtype, [hidden, hidden])
        out[p + "self_attn.k_proj.weight"] = (dtype, [kv, hidden])
        out[p + "self_attn.v_proj.weight"] = (dtype, [kv, hidden])
        out[p + "self_attn.o_proj.weight"] = (dtype, [hidden, hidden])
        out[p + "post_attention_layernorm.weight"] = (dtype, [hidden])
        out[p + "mlp.gate_proj.weight"] = (dtype, [intermediate, hidden])
        out[p + "mlp.up_proj.weight"] = (dtype, [intermediate, hidden])
        out[p + "mlp.down_proj.weight"] = (dtype, [hidden, intermediate])
    out["model.norm.weight"] = (dtype, [hidden])
    if not tied:
        out["lm_head.weight"] = (dtype, [vocab, hidden])
    return out


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 vocab: int, tied: bool = False) -> dict:
    """A ``config.json`` for :func:`llama_tensors`' checkpoint."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
            "tie_word_embeddings": tied, "hidden_act": "silu", "rope_theta": 10000.0}


#: Llama-2-70B's shapes (its published config.json)
LLAMA2_70B = dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000)
