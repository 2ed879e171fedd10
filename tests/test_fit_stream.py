"""Probes predicted from earlier probes' requests (:mod:`torchmem.fit.run._stream`) are the real runs.

Ground truth: each value is also run for real (a fake run through the model); its record of
requests and its peaks must equal the prediction's, event for event and byte for byte, and a
search on predicted probes must give the all-real search's answer.
"""

from __future__ import annotations

import pytest
import torch

from torchmem.fit import GPU
from torchmem.fit.fakegpu._memory import _make_sim
from torchmem.fit.run._engine import run_once
from torchmem.fit.run._stream import StreamModel, replay

pytest.importorskip("transformers")

from torchmem.fit.targets._hf import load_config, make_build  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 8192}


def _run(build, v, card="T4"):
    events: list = []
    e = run_once(build, 1, card, steps=1, extrapolate_decode=True, default_device="cuda",
                 params={"seq_len": v}, stream=events)
    return e, events


@pytest.mark.parametrize("attn", [None, "eager"])   # eager: an N x N score matrix (a parabola)
def test_predicted_records_and_peaks_are_the_real_runs(attn):
    # a dynamic cache; a static one pads its mask to a multiple of 64 tokens, so its records
    # are lines only piece by piece: a search on them is saved by its check of the answer
    build = make_build(load_config(LLAMA), "generate", torch.float16, attn, 64, 12, "dynamic")
    model = StreamModel()
    for v in (100, 300, 1000):
        model.add(v, _run(build, v)[1])
    for v in (101, 999, 1001, 4000):
        real, events = _run(build, v)
        predicted = model.predict(v)
        assert predicted == events
        got = replay(predicted, _make_sim(real.usable_bytes, None))
        assert got == (real.peak_requested_bytes, real.peak_allocated_bytes,
                       real.peak_reserved_bytes, real.fragmentation_bytes, None)


def test_a_predicted_out_of_memory_is_the_real_one():
    build = make_build(load_config(LLAMA), "generate", torch.float16, "eager", 64, 12, "dynamic")
    model = StreamModel()
    big = GPU("64 GiB", 64 << 30, (9, 0), "test", context_override=0)   # the same kernels
    for v in (100, 300, 1000):
        model.add(v, _run(build, v, big)[1])
    card = GPU("64 MiB", 64 << 20, (9, 0), "test", context_override=0)
    for v in (1500, 2500, 4000):
        real, _ = _run(build, v, card)
        got = replay(model.predict(v), _make_sim(card.usable_bytes, None))
        assert (got[4] is None) == real.fits
        if not real.fits:
            assert got[4] == real.oom.requested_bytes and got[2] == real.peak_reserved_bytes


def test_two_records_of_different_sequences_predict_nothing():
    m = StreamModel()
    m.add(1, [("m", 10, -1), ("f", 0, 0)])
    m.add(2, [("m", 20, -1), ("m", 5, -1)])
    assert m.ready and m.predict(3) is None
    m = StreamModel()
    m.add(1, [("m", 10, -1)])
    m.add(3, [("m", 11, -1)])      # one byte per two tokens: not whole at 2
    assert m.predict(2) is None and m.predict(5) == [("m", 12, -1)]


@pytest.mark.parametrize("attn", [None, "eager"])
def test_a_search_on_predicted_probes_gives_the_all_real_answer(attn, monkeypatch):
    import torchmem
    import torchmem.fit.search._bracket as search

    kw = dict(task="generate", max_new_tokens=12, dtype="float16", attn=attn, margin=0)
    small = torchmem.estimate_hf(LLAMA, gpu="H100-80GB", seq_len=64, **kw)
    card = GPU("test", small.peak_reserved_bytes + (6 << 20), (9, 0), "test",
               context_override=0)
    fast = torchmem.estimate_hf(LLAMA, gpu=card, maximize="seq_len", search_range=(64, 8192),
                                **kw)
    # eager attention's records are parabolas, which two records do not show: the check of
    # the answer finds the prediction wrong, and the search ends with every probe real
    assert (len(fast.predicted_probes) > 0) == (attn is None)
    monkeypatch.setattr(search, "STREAM_ROUNDS", 0)
    slow = torchmem.estimate_hf(LLAMA, gpu=card, maximize="seq_len", search_range=(64, 8192),
                                **kw)
    assert slow.predicted_probes == []
    best = fast.max_value
    assert best == slow.max_value and best is not None and 64 < best < 8192
    assert (fast.peak_reserved_bytes, fast.fits) == (slow.peak_reserved_bytes, True)
    assert [p for p in fast.probes if p[0] in dict(slow.probes)] == [
        (v, ok) for v, ok in fast.probes if dict(slow.probes).get(v) == ok]
    assert not torchmem.estimate_hf(LLAMA, gpu=card, seq_len=best + 1, **kw).fits


def test_a_run_stopped_over_a_reserved_count_has_the_full_runs_verdict():
    build = make_build(load_config(LLAMA), "generate", torch.float16, None, 64, 12, "dynamic")
    full, _ = _run(build, 512)
    assert full.fits and full.stopped_over is None and full.decode_replayed > 0
    below = full.peak_reserved_bytes - 1
    stopped = run_once(build, 1, "T4", steps=1, extrapolate_decode=True, default_device="cuda",
                       params={"seq_len": 512}, stop_over=below)
    # the run stopped at the first segment past the limit: no OOM, does not fit, a lower peak
    assert (stopped.fits, stopped.oom, stopped.stopped_over) == (False, None, below)
    assert below < stopped.peak_reserved_bytes <= full.peak_reserved_bytes
    assert stopped.peak_requested_bytes <= full.peak_requested_bytes
    # at the full run's own peak nothing passes the limit: the same run, to the byte
    same = run_once(build, 1, "T4", steps=1, extrapolate_decode=True, default_device="cuda",
                    params={"seq_len": 512}, stop_over=full.peak_reserved_bytes)
    assert same.stopped_over is None and same.fits
    assert (same.peak_requested_bytes, same.peak_allocated_bytes, same.peak_reserved_bytes) == (
        full.peak_requested_bytes, full.peak_allocated_bytes, full.peak_reserved_bytes)


def test_the_check_above_the_answer_stops_early_and_keeps_the_verdict():
    import torchmem

    kw = dict(task="generate", max_new_tokens=12, dtype="float16", margin="2%")
    small = torchmem.estimate_hf(LLAMA, gpu="H100-80GB", seq_len=64, **kw)
    card = GPU("test", small.peak_reserved_bytes + (6 << 20), (9, 0), "test",
               context_override=0)
    said: list[str] = []
    best = torchmem.estimate_hf(LLAMA, gpu=card, maximize="seq_len", search_range=(64, 8192),
                                progress=said.append, **kw)
    v = best.max_value
    assert best.fits and best.predicted_probes and v is not None and 64 < v < 8192
    stops = [s for s in said if f"seq_len {v + 1}: does not fit with the margin (stopped" in s]
    assert len(stops) == 1, said
    # ground truth: the value above the answer, run in full on its own, does not fit either
    above = torchmem.estimate_hf(LLAMA, gpu=card, seq_len=v + 1, **kw)
    assert not above.fits and above.oom is None and above.stopped_over is None
    limit = int(stops[0].split("passed ")[1].split("(")[1].split(" B)")[0].replace(",", ""))
    assert above.peak_reserved_bytes > limit
    assert above.peak_reserved_bytes + above.margin_bytes > card.usable_bytes
