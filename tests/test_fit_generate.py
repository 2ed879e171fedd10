"""Generation under the estimator: transformers' ``generate()`` (dynamic and static caches) and a
decoding loop of our own, with the KV cache as its own category.

Ground truth is computed another way:

- the peak of requested bytes equals a real CPU run's peak, counted by :class:`LiveStorages`
  below (a dispatch mode of this file counting live storages with weak references; it shares
  no code with the estimator), with eager attention, whose kernels are the same on CPU and
  CUDA;
- the KV cache equals the arithmetic ``2 x layers x kv_heads x head_dim x tokens x batch x
  dtype bytes``, and the real cache object ``generate()`` returns on CPU.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchmem
from torchmem.errors import InvalidInputError
from torchmem.fit import GPU

transformers = pytest.importorskip("transformers")

LAYERS, HEADS, KV_HEADS, HIDDEN = 2, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS


class LiveStorages(TorchDispatchMode):
    """An independent census: every storage an operator returns, counted until it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s._cdata
                if key not in self.sizes:
                    self.sizes[key] = s.nbytes()
                    self.live += s.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(s, self._free, key)
        return out


def census_peak(build, batch: int, **params) -> int:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    with LiveStorages() as census:
        step = build(batch, **params)
        step()
        del step
    return census.peak


def llama(dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=172, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=1000,
                      max_position_embeddings=512, attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(dtype).eval()


def generate_build(batch: int, prompt: int = 16, new: int = 4, cache: str = "dynamic"):  # type: ignore[no-untyped-def]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = llama().to(dev)
    ids = torch.randint(3, 1000, (batch, prompt), device=dev)
    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def step() -> None:
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)
    return step


def kv_arithmetic(tokens: int, batch: int, dtype_bytes: int = 4) -> int:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * tokens * batch * dtype_bytes


def real_cache_bytes(batch: int, prompt: int, new: int, cache: str) -> tuple[int, int]:
    """The bytes and length of the cache a real CPU ``generate()`` returns."""
    torch.manual_seed(0)
    model = llama()
    ids = torch.randint(3, 1000, (batch, prompt))
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, **extra)
    tensors = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    return sum(t.numel() * t.element_size() for t in tensors), tensors[0].shape[-2]


@pytest.mark.parametrize(("prompt", "new"), [(8, 3), (24, 6), (40, 2)])
def test_generate_dynamic_cache_matches_a_real_cpu_run(prompt, new):
    batch = 2
    est = torchmem.estimate(generate_build, gpu="L4", batch_size=batch, steps=1,
                            params={"prompt": prompt, "new": new})
    truth = census_peak(generate_build, batch, prompt=prompt, new=new)
    assert est.peak_requested_bytes == truth
    params = sum(p.numel() * p.element_size() for p in llama().parameters())
    assert est.by_category["parameter"] >= params > 0
    # the cache holds prompt + new - 1 tokens at its fullest (the last token is never fed back)
    kv = est.kv_cache
    assert kv is not None and kv.source == "transformers DynamicCache"
    real_bytes, real_tokens = real_cache_bytes(batch, prompt, new, "dynamic")
    assert kv.tokens == real_tokens == prompt + new - 1
    assert kv.max_bytes == real_bytes == kv_arithmetic(prompt + new - 1, batch)
    assert kv.bytes_per_token == kv_arithmetic(1, 1)
    assert kv.bytes_per_sequence == kv_arithmetic(prompt + new - 1, 1)
    # live at the peak: part of the cache, as allocated so far; dropped when generate returns
    assert 0 < est.by_category["kv_cache"] == kv.peak_bytes <= kv.max_bytes
    assert kv.end_bytes == 0


def test_generate_static_cache_is_preallocated_at_its_full_length():
    batch, prompt, new = 2, 12, 5
    est = torchmem.estimate(generate_build, gpu="L4", batch_size=batch, steps=1,
                            params={"prompt": prompt, "new": new, "cache": "static"})
    assert est.peak_requested_bytes == census_peak(generate_build, batch, prompt=prompt,
                                                   new=new, cache="static")
    kv = est.kv_cache
    assert kv is not None and kv.source == "transformers StaticCache"
    real_bytes, real_tokens = real_cache_bytes(batch, prompt, new, "static")
    assert kv.tokens == real_tokens
    assert kv.max_bytes == real_bytes == kv_arithmetic(real_tokens, batch)
    # the whole cache is live at the peak (allocated before the first token), unlike a
    # dynamic cache at the same lengths
    assert est.by_category["kv_cache"] == kv.max_bytes
    dyn = torchmem.estimate(generate_build, gpu="L4", batch_size=batch, steps=1,
                            params={"prompt": prompt, "new": new})
    assert dyn.kv_cache is not None and dyn.by_category["kv_cache"] < kv.max_bytes


def test_generate_with_sdpa_on_the_fake_gpu_reports_the_cache():
    def build(batch: int):  # type: ignore[no-untyped-def]
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=172, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          vocab_size=1000, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
        ids = torch.zeros(batch, 64, dtype=torch.long, device="cuda")
        return lambda: model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)

    est = torchmem.estimate(build, gpu="H100-80GB", batch_size=4, steps=1)
    assert est.kv_cache is not None
    assert est.kv_cache.max_bytes == kv_arithmetic(64 + 8 - 1, 4, dtype_bytes=2)
    assert est.attention_kernel == "cudnn"  # PyTorch 2.13 puts cuDNN attention first on sm90


# -- a decoding loop of our own, its cache in module attributes ---------------------------------


class TinyDecoder(nn.Module):
    """One attention layer whose K/V cache lives in ``k_cache`` / ``v_cache`` and grows by
    ``cat`` each step, as hand-written decoders do."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def attend(self, x: torch.Tensor, past: tuple | None) -> tuple:
        """Attention over ``past`` keys/values and ``x``'s; the output and the new k, v."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        att = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.out(att.transpose(1, 2).reshape(b, s, -1)), k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        past = None if self.k_cache is None else (self.k_cache, self.v_cache)
        y, self.k_cache, self.v_cache = self.attend(x, past)
        return y


class ListCacheDecoder(TinyDecoder):
    """The same layer with its cache passed in and out as a keyword argument (a list)."""

    def forward(self, x: torch.Tensor, kv_cache: list | None = None) -> torch.Tensor:  # type: ignore[override]
        y, k, v = self.attend(x, tuple(kv_cache) if kv_cache else None)
        if kv_cache is not None:
            kv_cache[:] = [k, v]
        return y


def decoding_loop(batch: int, prompt: int = 10, new: int = 6, as_argument: bool = False):  # type: ignore[no-untyped-def]
    """Prefill ``prompt`` positions, then ``new`` steps of one; the cache in the module's
    attributes, or (``as_argument``) in a list passed as ``kv_cache=``."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    net = (ListCacheDecoder if as_argument else TinyDecoder)().to(dev)
    x = torch.randn(batch, prompt, 32, device=dev)

    def step() -> None:
        net.k_cache = net.v_cache = None
        kw = {"kv_cache": []} if as_argument else {}
        with torch.no_grad():
            y = net(x, **kw)[:, -1:]
            for _ in range(new):
                y = net(y, **kw)
    return step


def test_a_decoding_loop_of_our_own_with_named_cache_attributes():
    batch, prompt, new = 3, 10, 6
    est = torchmem.estimate(decoding_loop, gpu="T4", batch_size=batch, steps=1,
                            kv_cache_attr=["k_cache", "v_cache"])
    assert est.peak_requested_bytes == census_peak(decoding_loop, batch)
    kv = est.kv_cache
    assert kv is not None and kv.source == "attribute 'k_cache', attribute 'v_cache'"
    tokens = prompt + new
    per_token = 2 * 2 * 16 * 4                     # k and v x heads x head dim x float32
    assert (kv.tokens, kv.batch, kv.bytes_per_token) == (tokens, batch, per_token)
    assert kv.max_bytes == per_token * tokens * batch
    assert kv.end_bytes == kv.max_bytes             # still held by the module at the end
    # without the names nothing is reported as cache
    plain = torchmem.estimate(decoding_loop, gpu="T4", batch_size=batch, steps=1)
    assert plain.kv_cache is None and plain.by_category["kv_cache"] == 0
    assert plain.peak_requested_bytes == est.peak_requested_bytes


def test_kv_cache_keys_in_the_json():
    est = torchmem.estimate(decoding_loop, gpu="T4", batch_size=1, steps=1,
                            kv_cache_attr=["k_cache", "v_cache"])
    d = est.to_dict()
    assert d["by_category"]["kv_cache"] == d["kv_cache_peak_bytes"]
    assert d["kv_cache_bytes_per_token"] == 2 * 2 * 16 * 4
    assert d["kv_cache_bytes_per_sequence"] == 16 * 2 * 2 * 16 * 4
    assert d["kv_cache_tokens"] == 16 and d["kv_cache_batch"] == 1


def test_max_new_tokens_search_is_a_true_boundary():
    """``maximize`` over a generation parameter: fits at the answer, not one above (a GPU with
    1 MiB more than one new token takes, no context, no margin)."""

    def build(batch: int, new: int = 1):  # type: ignore[no-untyped-def]
        return decoding_loop(batch, prompt=2, new=new)

    one = torchmem.estimate(build, gpu="H100-80GB", batch_size=64, steps=1)
    card = GPU("test", one.peak_reserved_bytes + (1 << 20), (9, 0), "test", context_override=0)
    est = torchmem.estimate(build, gpu=card, batch_size=64, maximize="new", margin=0, steps=1,
                            search_range=(1, 256), kv_cache_attr=["k_cache"])
    best = est.max_value
    assert best is not None and best > 1
    assert est.kv_cache is not None and est.kv_cache.tokens == 2 + best
    assert torchmem.estimate(build, gpu=card, batch_size=64, params={"new": best}, margin=0,
                             steps=1).fits
    assert not torchmem.estimate(build, gpu=card, batch_size=64, params={"new": best + 1},
                                 margin=0, steps=1).fits


# -- bad input ------------------------------------------------------------------------------------


def test_bad_kv_cache_attr():
    with pytest.raises(InvalidInputError, match=r"kv_cache_attr must name attributes"):
        torchmem.estimate(decoding_loop, gpu="T4", kv_cache_attr=["not an identifier"])


def test_value_reads_outside_generate_are_errors_in_strict_mode():
    """With strict_values, only generate()'s own reads are answered; a read in user code is the
    clear error (by default it is answered and listed: tests/test_fit_values.py)."""

    def build(batch: int):  # type: ignore[no-untyped-def]
        x = torch.randn(batch, 8)
        llama()  # transformers is imported and patched

        def step() -> None:
            if x.sum() > 0:
                x.mul_(2)
        return step

    with pytest.raises(InvalidInputError, match=r"reads a tensor's value"):
        torchmem.estimate(build, gpu="T4", steps=1, strict_values=True)


def test_a_cache_passed_as_a_keyword_argument():
    kw = {"prompt": 7, "new": 5, "as_argument": True}
    est = torchmem.estimate(decoding_loop, gpu="T4", batch_size=2, steps=1, params=kw,
                            kv_cache_attr=["kv_cache"])
    assert est.peak_requested_bytes == census_peak(decoding_loop, 2, **kw)
    kv = est.kv_cache
    assert kv is not None and kv.source == "argument 'kv_cache'"
    assert (kv.tokens, kv.batch) == (7 + 5, 2)
    assert kv.max_bytes == 2 * 2 * 16 * 4 * 12 * 2
    assert kv.end_bytes == 0                      # the list dies with the step


def test_cli_kv_cache_attr_with_a_build_file(tmp_path, capsys):
    import json

    from torchmem.cli import main

    (tmp_path / "decode.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_fit_generate import decoding_loop as build\n"
    )
    rc = main(["estimate", f"{tmp_path / 'decode.py'}:build", "--gpu", "T4", "--batch-size",
               "3", "--steps", "1", "--kv-cache-attr", "k_cache", "--kv-cache-attr", "v_cache",
               "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert d["kv_cache_max_bytes"] == 2 * 2 * 16 * 4 * (10 + 6) * 3
    assert d["kv_cache_end_bytes"] == d["kv_cache_max_bytes"]
