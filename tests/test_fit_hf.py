"""``torchmem.estimate_hf`` and ``torchmem estimate --hf-config``: a transformers model from its
config alone (tiny configs written here; nothing is downloaded).

Ground truth: the same build run for real on CPU (eager attention, whose kernels are the same
on CPU and CUDA), counted by the independent storage census of ``test_fit_generate``; the KV
cache against the arithmetic ``2 x layers x kv_heads x head_dim x tokens x batch x dtype
bytes``; the weights against the model's parameter count.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import torchmem
from torchmem.cli import main
from torchmem.errors import InvalidInputError
from torchmem.fit import GPU

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
from test_fit_generate import census_peak  # noqa: E402
from torchmem.fit.targets._hf import load_config, make_build  # noqa: E402

LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 4, 2, 64, 256
CONFIG = {
    "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 128,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB, "max_position_embeddings": 4096,
}


def kv_arithmetic(tokens: int, batch: int, dtype_bytes: int) -> int:
    return 2 * LAYERS * KV_HEADS * (HIDDEN // HEADS) * tokens * batch * dtype_bytes


def weight_bytes(dtype_bytes: int, config: dict | None = None) -> int:
    cfg = transformers.LlamaConfig(**{k: v for k, v in (config or CONFIG).items()
                                      if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


@pytest.mark.parametrize("seq_len", [16, 48, 96])
def test_generate_matches_a_real_cpu_run(seq_len):
    batch, new = 2, 5
    est = torchmem.estimate_hf(CONFIG, task="generate", gpu="L4", batch_size=batch,
                               seq_len=seq_len, max_new_tokens=new, attn="eager",
                               dtype="float32")
    cfg = load_config(CONFIG)
    build = make_build(cfg, "generate", torch.float32, "eager", seq_len, new, "dynamic")
    assert est.peak_requested_bytes == census_peak(build, batch)
    cat = est.by_category
    assert cat["parameter"] >= weight_bytes(4)          # + the rotary buffer
    assert cat["parameter"] - weight_bytes(4) < 1024
    assert cat["activation"] > 0 and cat["kv_cache"] > 0 and "temporary" not in cat
    kv = est.kv_cache
    assert kv is not None
    assert kv.max_bytes == kv_arithmetic(seq_len + new - 1, batch, 4)
    assert kv.bytes_per_token == kv_arithmetic(1, 1, 4)
    assert kv.bytes_per_sequence == kv_arithmetic(seq_len + new - 1, 1, 4)


_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=256)
#: name -> (config, KV heads); every one has 2 layers of 4 heads of dimension 16
ARCHITECTURES = {
    "gpt2": ({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256,
              "n_positions": 512}, 4),
    "mistral": (dict(_SMALL, model_type="mistral", num_key_value_heads=2), 2),
    "qwen2": (dict(_SMALL, model_type="qwen2", num_key_value_heads=2), 2),
    "gpt_neox": (dict(_SMALL, model_type="gpt_neox"), 4),
    "opt": ({"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 256, "word_embed_proj_dim": 64}, 4),
    "falcon": (dict(_SMALL, model_type="falcon"), 1),            # multi-query attention
    "bloom": ({"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4,
               "vocab_size": 256}, 4),
    "gemma": (dict(_SMALL, model_type="gemma", num_key_value_heads=2, head_dim=16), 2),
    "phi": (dict(_SMALL, model_type="phi"), 4),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_generate_across_architectures_matches_a_real_cpu_run(arch):
    config, kv_heads = ARCHITECTURES[arch]
    batch, prompt, new = 2, 16, 3
    est = torchmem.estimate_hf(config, task="generate", gpu="L4", batch_size=batch,
                               seq_len=prompt, max_new_tokens=new, attn="eager",
                               dtype="float32")
    build = make_build(load_config(config), "generate", torch.float32, "eager", prompt, new,
                       "dynamic")
    assert est.peak_requested_bytes == census_peak(build, batch)
    assert est.kv_cache is not None
    assert est.kv_cache.max_bytes == 2 * 2 * kv_heads * 16 * (prompt + new - 1) * batch * 4


def test_forward_matches_a_real_cpu_run_and_has_no_cache():
    est = torchmem.estimate_hf(CONFIG, task="forward", gpu="L4", batch_size=3, seq_len=40,
                               attn="eager", dtype="float32")
    build = make_build(load_config(CONFIG), "forward", torch.float32, "eager", 40, 1, "dynamic")
    assert est.peak_requested_bytes == census_peak(build, 3)
    assert est.kv_cache is None and est.by_category["kv_cache"] == 0
    # the full logits (batch x seq x vocab, float32) are live at the end of the pass
    assert est.by_category["activation"] >= 3 * 40 * VOCAB * 4


def test_static_cache_in_bfloat16_is_allocated_at_its_full_length():
    est = torchmem.estimate_hf(CONFIG, task="generate", gpu="H100-80GB", batch_size=4,
                               seq_len=100, max_new_tokens=20, dtype="bfloat16",
                               params={"cache": "static"})
    kv = est.kv_cache
    assert kv is not None and kv.source == "transformers StaticCache"
    assert kv.max_bytes == kv_arithmetic(kv.tokens, 4, 2)
    assert kv.tokens >= 100 + 20 - 1
    assert est.by_category["kv_cache"] == kv.max_bytes     # all of it, from the first token
    assert est.by_category["parameter"] >= weight_bytes(2)


def test_train_task_holds_gradients_and_adamw_state():
    # one KV head per query head: fp32 SDPA runs the memory-efficient kernel, so the peak is in
    # backward with every gradient live (CONFIG's grouped KV heads take the math kernel on a GPU,
    # whose S x S forward activations move the peak into the forward, before any gradient)
    mha = {**CONFIG, "num_key_value_heads": HEADS}
    est = torchmem.estimate_hf(mha, task="train", gpu="L4", batch_size=2, seq_len=32,
                               dtype="float32")
    cat = est.by_category
    assert est.steps == 2 and est.attention_kernel == "efficient"
    assert cat["gradient"] == weight_bytes(4, mha)
    # two moments per parameter, plus one step count per parameter tensor
    assert 2 * weight_bytes(4, mha) <= cat["optimizer_state"] < 2 * weight_bytes(4, mha) + 4096


def test_grouped_kv_heads_in_fp32_take_the_math_kernel():
    """sdp_utils.cpp: the memory-efficient kernel admits no grouped query heads, and flash no
    fp32, so a GQA model in fp32 runs SDPA's math path on the GPU (seen on the H100 in
    tests/data/gpu/hf_trainer: B x H x S x S score blocks in sdpa_attention_forward)."""
    est = torchmem.estimate_hf(CONFIG, task="forward", gpu="L4", batch_size=2, seq_len=32,
                               dtype="float32")
    assert est.attention_kernel == "math"


def test_sdpa_kernel_follows_the_gpu():
    hopper = torchmem.estimate_hf(CONFIG, task="forward", gpu="H100-80GB", seq_len=64,
                                  dtype="bfloat16")
    turing = torchmem.estimate_hf(CONFIG, task="forward", gpu="T4", seq_len=64,
                                  dtype="float32")
    assert hopper.attention_kernel == "cudnn"  # PyTorch 2.13: cuDNN attention first on sm90
    assert turing.attention_kernel in ("efficient", "math")
    assert any("attn_implementation 'sdpa'" in n for n in hopper.notes)


def test_longest_context_is_a_true_boundary():
    """``maximize="seq_len"``: fits at the answer, not one token more (eager attention grows
    as S x S, so the boundary falls at a few hundred tokens on a GPU a little larger than
    the smallest run)."""
    small = torchmem.estimate_hf(CONFIG, task="generate", gpu="H100-80GB", seq_len=64,
                                 max_new_tokens=2, attn="eager", dtype="float32")
    card = GPU("test", small.peak_reserved_bytes + (8 << 20), (9, 0), "test",
               context_override=0)
    kw = dict(task="generate", gpu=card, max_new_tokens=2, attn="eager", dtype="float32",
              margin=0)
    est = torchmem.estimate_hf(CONFIG, maximize="seq_len", search_range=(64, 4096), **kw)
    best = est.max_value
    assert best is not None and best > 64
    assert est.to_dict()["max_seq_len"] == best
    assert torchmem.estimate_hf(CONFIG, seq_len=best, **kw).fits
    assert not torchmem.estimate_hf(CONFIG, seq_len=best + 1, **kw).fits


_REAL_GPU_GENERATE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_fit_hf import CONFIG
from torchmem.fit.targets._hf import load_config, make_build
step = make_build(load_config(CONFIG), "generate", torch.bfloat16, "sdpa", int(sys.argv[2]), 16,
                  "dynamic")(8)
step()
torch.cuda.synchronize()
print(json.dumps([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]))
"""


@pytest.mark.cuda
@pytest.mark.parametrize("seq_len", [512, 4096])
def test_generate_matches_the_real_gpu(seq_len):
    """On a GPU: the estimated peaks of a bf16 SDPA generate() (batch 8, 16 new tokens) are
    within 5% of ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` of the same
    build run there, in a fresh process."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _REAL_GPU_GENERATE, os.path.dirname(__file__),
                          str(seq_len)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    real_alloc, real_res = json.loads(out.stdout.strip().splitlines()[-1])
    props = torch.cuda.get_device_properties(0)
    here = GPU(props.name, props.total_memory, (props.major, props.minor), "this machine")
    est = torchmem.estimate_hf(CONFIG, task="generate", gpu=here, batch_size=8, seq_len=seq_len,
                               max_new_tokens=16, dtype="bfloat16", attn="sdpa", margin=0)
    assert est.fits
    assert abs(est.peak_allocated_bytes - real_alloc) <= 0.05 * real_alloc
    assert abs(est.peak_reserved_bytes - real_res) <= 0.05 * real_res


# -- where the config comes from -----------------------------------------------------------------


def test_config_from_a_file_a_folder_a_config_object_and_the_local_cache(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    from_file = load_config(str(tmp_path / "config.json"))
    from_dir = load_config(tmp_path)
    assert from_file.hidden_size == from_dir.hidden_size == HIDDEN
    original = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2)
    copied = load_config(original)
    assert copied is not original and copied.hidden_size == 32
    torchmem.estimate_hf(original, gpu="T4", seq_len=8, attn="eager")
    assert getattr(original, "_attn_implementation", None) != "eager"  # not mutated
    # a model name: only the local Hugging Face cache is read
    import huggingface_hub.constants as hub

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    (repo / "snapshots" / rev / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_config("acme/tiny-llama").num_key_value_heads == KV_HEADS
    with pytest.raises(InvalidInputError, match=r"not in the local Hugging Face cache"):
        load_config("acme/not-downloaded")


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"task": "decode"}, r"unknown task 'decode': expected one of forward, generate, train"),
    ({"cache": "paged"}, r"unknown cache 'paged'"),
    ({"attn": "flash_attention_9"}, r"unknown attn"),
    ({"dtype": "int8"}, r"dtype must be one of float32, float16, bfloat16"),
    ({"seq_len": 0}, r"seq_len must be an int >= 1"),
    ({"params": {"foo": 1}}, r"unknown parameter 'foo' for a model from its config: the "
                             r"parameters are seq_len, max_new_tokens, cache"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        torchmem.estimate_hf(CONFIG, gpu="T4", **kwargs)


def test_a_folder_without_config_json(tmp_path):
    with pytest.raises(InvalidInputError, match=r"has no config.json"):
        load_config(tmp_path)


@pytest.mark.parametrize(("config", "match"), [
    ({"model_type": "no_such_model"}, r"transformers cannot read the config dict .*no_such_model"),
    ({"hidden_size": 64}, r"has no 'model_type'"),
    ({"model_type": "vit"}, r"no causal language model for ViTConfig"),
    (dict(CONFIG, hidden_act="no_such_act"), r"transformers could not build LlamaForCausalLM"),
    (42, r"config must be a path to config.json, a dict"),
    ("./missing/config.json", r"no config file at"),
])
def test_configs_transformers_cannot_build(config, match):
    with pytest.raises(InvalidInputError, match=match):
        torchmem.estimate_hf(config, gpu="T4", seq_len=8)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(InvalidInputError, match=r"pip install 'torchmem\[transformers\]'"):
        torchmem.estimate_hf(CONFIG)


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_generate_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    rc = main(["estimate", "--hf-config", str(path), "--task", "generate", "--gpu", "L4",
               "--batch-size", "2", "--set", "seq_len=24", "--set", "max_new_tokens=3",
               "--dtype", "float16", "--attn", "eager", "--json"])
    out = capsys.readouterr()
    assert rc == 0
    d = json.loads(out.out)
    assert d["kv_cache_bytes_per_token"] == kv_arithmetic(1, 1, 2)
    assert d["kv_cache_max_bytes"] == kv_arithmetic(24 + 3 - 1, 2, 2)
    assert d["by_category"]["kv_cache"] == d["kv_cache_peak_bytes"] > 0
    assert d["params"] == {"seq_len": 24, "max_new_tokens": 3} and d["steps"] == 1
    assert "building the model" in out.err


def test_cli_text_prints_the_kv_cache(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["estimate", "--hf-config", str(tmp_path), "--task", "generate", "--gpu", "T4",
                 "--set", "seq_len=16", "--set", "max_new_tokens=2", "--attn", "eager"]) == 0
    out = capsys.readouterr().out
    per_token = kv_arithmetic(1, 1, 4)
    assert f"{per_token} B per token" in out and "KV cache (transformers DynamicCache)" in out


@pytest.mark.parametrize(("argv", "match"), [
    (["--hf-config", "./nope/config.json"], "no config file at"),
    (["--hf-config", "{cfg}", "--set", "cache=paged", "--task", "generate"], "unknown cache"),
    (["x.py:build", "--hf-config", "{cfg}"], "either a build function"),
])
def test_cli_bad_input_is_a_message_not_a_traceback(tmp_path, capsys, argv, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    rc = main(["estimate", *[a.replace("{cfg}", str(path)) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "Traceback" not in err
