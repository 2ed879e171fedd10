"""The extrapolated decode steps (:mod:`torchmem.fit.run._decode`) give the full run's peaks."""

from __future__ import annotations

import pytest
import torch

from torchmem.fit.run._engine import run_once

pytest.importorskip("transformers")

from torchmem.fit.targets._hf import load_config, make_build  # noqa: E402

CONFIGS = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256},
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64,
             "bos_token_id": 0, "eos_token_id": 0},
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("seq_len", [5, 100])
def test_extrapolated_decode_has_the_full_runs_peaks(arch, cache, seq_len):
    build = make_build(load_config(CONFIGS[arch]), "generate", torch.float16, None, seq_len,
                       12, cache)
    full = run_once(build, 1, "T4", steps=1, default_device="cuda")
    fast = run_once(build, 1, "T4", steps=1, extrapolate_decode=True, default_device="cuda")
    assert fast.decode_replayed > 0 and full.decode_replayed == 0
    key = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "fits")
    assert [getattr(fast, k) for k in key] == [getattr(full, k) for k in key]
    # the split at the peak and the cache's figures follow the replayed steps too
    assert fast.decode_split_exact
    assert fast.by_category == full.by_category and fast.by_module == full.by_module
    assert fast.kv_cache == full.kv_cache and full.kv_cache is not None
    if cache == "dynamic":
        assert full.kv_cache.tokens == seq_len + 11


def _kept_cache_build(seq_len):
    """generate() whose output (the cache with it) the step keeps: live at the step's end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(batch):
        model = LlamaForCausalLM(LlamaConfig(**CONFIGS["llama"])).half().to("cuda")
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="cuda")
        kept = []

        def step():
            with torch.no_grad():
                kept.append(model.generate(ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=12, min_new_tokens=12,
                                           do_sample=False, pad_token_id=0,
                                           return_dict_in_generate=True))
        return step
    return build


@pytest.mark.parametrize("seq_len", [5, 60])
def test_a_cache_kept_after_generate_has_the_full_runs_end_bytes(seq_len):
    build = _kept_cache_build(seq_len)
    full = run_once(build, 2, "T4", steps=1)
    fast = run_once(build, 2, "T4", steps=1, extrapolate_decode=True)
    assert fast.decode_replayed > 0 and fast.decode_split_exact
    assert full.kv_cache is not None and full.kv_cache.end_bytes > 0
    assert fast.kv_cache == full.kv_cache
    key = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "by_category",
           "by_module")
    assert [getattr(fast, k) for k in key] == [getattr(full, k) for k in key]


def test_extrapolated_decode_finds_the_same_out_of_memory_verdict():
    build = make_build(load_config(CONFIGS["llama"]), "generate", torch.float16, None, 64, 12,
                       "dynamic")
    from torchmem.fit import GPU

    # cards this small have no room for a CUDA context: the whole size is the allocator's
    for gpu in (GPU(f"{m} MiB", m << 20, (9, 0), "test", context_override=0) for m in (20, 24, 40)):
        full = run_once(build, 1, gpu, steps=1, default_device="cuda")
        fast = run_once(build, 1, gpu, steps=1, extrapolate_decode=True, default_device="cuda")
        assert (fast.fits, fast.peak_reserved_bytes) == (full.fits, full.peak_reserved_bytes)


def test_a_search_with_extrapolated_probes_is_a_true_boundary():
    """The probes and the answer extrapolate (no rerun); judged by full runs."""
    import torchmem
    from torchmem.fit import GPU

    cfg = CONFIGS["llama"]
    kw = dict(task="generate", max_new_tokens=12, dtype="float16", attn="eager", margin=0)
    small = torchmem.estimate_hf(cfg, gpu="H100-80GB", seq_len=64, **kw)
    card = GPU("test", small.peak_reserved_bytes + (4 << 20), (9, 0), "test",
               context_override=0)
    est = torchmem.estimate_hf(cfg, gpu=card, maximize="seq_len", search_range=(64, 4096), **kw)
    best = est.max_value
    assert best is not None and best > 64 and est.decode_replayed > 0
    assert est.kv_cache is not None and est.kv_cache.tokens == best + 11
    full = torchmem.estimate_hf(cfg, gpu=card, seq_len=best, **kw)   # every step run
    assert full.fits and full.decode_replayed == 0
    key = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "by_category",
           "by_module", "kv_cache")
    assert [getattr(est, k) for k in key] == [getattr(full, k) for k in key]
    assert not torchmem.estimate_hf(cfg, gpu=card, seq_len=best + 1, **kw).fits


def test_an_answer_whose_split_cannot_follow_the_replay_is_rerun_in_full(monkeypatch):
    """Where the labels or the cache's figures do not repeat, the run says so and the search
    runs its answer again with every step (as every answer was before)."""
    import torchmem
    import torchmem.fit.run._engine as engine
    from torchmem.fit import GPU

    start = engine._DecodeFeed._start_split

    def not_repeating(self):
        start(self)
        self.exact = False

    cfg = CONFIGS["llama"]
    kw = dict(task="generate", max_new_tokens=12, dtype="float16", margin=0)
    build = make_build(load_config(cfg), "generate", torch.float16, None, 40, 12, "dynamic")
    small = torchmem.estimate_hf(cfg, gpu="H100-80GB", seq_len=40, **kw)
    card = GPU("test", small.peak_reserved_bytes + (4 << 20), (9, 0), "test",
               context_override=0)
    monkeypatch.setattr(engine._DecodeFeed, "_start_split", not_repeating)
    fast = run_once(build, 1, card, steps=1, extrapolate_decode=True, default_device="cuda")
    assert fast.decode_replayed > 0 and not fast.decode_split_exact
    assert fast.kv_cache is not None and fast.kv_cache.tokens < 40 + 11   # the steps that ran
    est = torchmem.estimate_hf(cfg, gpu=card, maximize="seq_len", search_range=(40, 4096), **kw)
    assert est.decode_replayed == 0                                       # rerun in full
    assert est.kv_cache is not None and est.kv_cache.tokens == est.max_value + 11
