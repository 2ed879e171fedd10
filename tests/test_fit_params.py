"""``estimate`` with any parameter: ``params`` reach ``build``, ``maximize``/``--max NAME`` finds a
true boundary with the error margin kept free, the JSON keys, the monotonicity check, the
attention kernel CUDA would pick, and clear errors for bad input.

Expected figures come from the allocator's rules, by hand, not from the estimator: a request of
10 MiB or more gets its own segment rounded up to 2 MiB, so a build holding ``x`` of ``s`` MiB
and computing ``x * 2`` peaks at ``2 * ceil2(s)`` MiB reserved; the default margin is 1 % of the
peak reserved bytes (rounded up) plus 256 MiB unless the GPU's context was measured
(``torchmem.fit.verdict._margin``).
"""

from __future__ import annotations

import json
import math
import textwrap
import warnings

import pytest
import torch

from torchmem.cli import main
from torchmem.errors import InvalidInputError
from torchmem.fit import GPU, estimate, gpu

MiB = 1 << 20


def exact_gpu(total: int) -> GPU:
    """A GPU whose whole memory is usable, with a measured (zero) context: margin = 1 %."""
    return GPU("test", total, (9, 0), "test", context_override=0)


def tokens(batch: int, seq_len: int = 16):
    """1 MiB per token (per batch row); the step makes a second tensor of the same size."""
    x = torch.zeros(batch * seq_len, 1 << 18)
    return lambda: x * 2


def reserved(mib: int) -> int:
    """Peak reserved bytes of ``tokens`` holding ``mib`` MiB (>= 10): two segments of the size
    rounded up to 2 MiB."""
    return 2 * (mib + mib % 2) * MiB


def largest(usable: int, context_term: int, hi: int = 5000, margin: bool = True) -> int:
    """The largest size (MiB) whose peak reserved + margin fits ``usable``, by the rules."""
    best = 0
    for s in range(10, hi):
        r = reserved(s)
        if r + (math.ceil(r / 100) + context_term if margin else 0) <= usable:
            best = s
    return best


def test_params_reach_build_and_size_the_run():
    seen = []

    def build(batch, seq_len=8, mode="train"):
        seen.append((batch, seq_len, mode))
        return tokens(batch, seq_len)

    e = estimate(build, gpu="H100-80GB", batch_size=2, params={"seq_len": 12, "mode": "eval"},
                 steps=1, default_device="cuda")
    assert seen == [(2, 12, "eval")]
    assert e.params == {"seq_len": 12, "mode": "eval"} and e.batch_size == 2
    assert e.peak_requested_bytes == 2 * 24 * MiB  # x and x * 2, 24 tokens of 1 MiB
    # params["batch_size"] is the batch size
    assert estimate(build, params={"batch_size": 3, "seq_len": 10}, steps=1, default_device="cuda").batch_size == 3
    assert seen[-1] == (3, 10, "train")


def test_max_seq_len_is_a_true_boundary_with_the_margin():
    card = exact_gpu(1 << 30)
    expected = largest(card.usable_bytes, 0)
    assert expected == 506  # 1012 MiB + 10.12 MiB of margin <= 1024 MiB; 1016 + 10.16 is not
    e = estimate(tokens, gpu=card, maximize="seq_len", steps=1, default_device="cuda")
    assert e.max_value == expected and e.maximized == "seq_len" and e.fits
    assert e.params == {"seq_len": expected} and e.batch_size == 1
    assert e.peak_reserved_bytes == reserved(expected)
    assert e.margin_bytes == math.ceil(reserved(expected) / 100)
    # independent runs on both sides of the answer
    at = estimate(tokens, gpu=card, params={"seq_len": expected}, steps=1, default_device="cuda")
    above = estimate(tokens, gpu=card, params={"seq_len": expected + 1}, steps=1, default_device="cuda")
    assert at.fits and at.headroom_after_margin_bytes >= 0
    assert not above.fits and above.fits_without_margin and above.oom is None
    assert above.headroom_after_margin_bytes < 0 <= above.headroom_bytes
    assert any("less than the error margin" in n for n in above.notes)
    # with no margin the boundary is the simulator's own: 2 * ceil2(s) <= 1024 MiB
    assert estimate(tokens, gpu=card, maximize="seq_len", steps=1, margin=0, default_device="cuda").max_value == 512


def test_the_memory_curve_pins_the_boundary_in_few_probes():
    """After doubling brackets the answer, the probes that ran to the end give the memory curve;
    its prediction is probed, then the value above it: two probes here instead of bisection's
    eight."""
    e = estimate(tokens, gpu=exact_gpu(1 << 30), maximize="seq_len", steps=1, default_device="cuda")
    assert e.probes == [(16, True), (32, True), (64, True), (128, True), (256, True),
                        (512, False), (506, True), (507, False)]


def test_a_curve_that_mispredicts_still_gives_the_true_boundary():
    """Memory jumps by 200 MiB above seq_len 300: the straight line through the small probes
    predicts 506, which does not fit; bisection takes over and the boundary is exact."""
    def build(batch, seq_len=16):
        x = torch.zeros(seq_len + (200 if seq_len > 300 else 0), 1 << 18)
        return lambda: x * 2

    card = exact_gpu(1 << 30)

    def fits(s):
        r = reserved(s + (200 if s > 300 else 0))
        return r + math.ceil(r / 100) <= card.usable_bytes

    expected = max(s for s in range(10, 2000) if fits(s))
    assert expected == 306
    e = estimate(build, gpu=card, maximize="seq_len", steps=1, default_device="cuda")
    assert e.max_value == expected
    fit = dict(e.probes)
    assert fit[expected] and not fit[expected + 1] and (506, False) in e.probes


def test_search_starts_at_the_builds_default_and_halves_when_it_does_not_fit():
    def build(batch, seq_len=4096):
        return tokens(batch, seq_len)

    seen = []
    e = estimate(build, gpu=exact_gpu(1 << 30), maximize="seq_len", steps=1,
                 progress=seen.append, default_device="cuda")
    assert [v for v, _ in e.probes[:4]] == [4096, 2048, 1024, 512]
    assert [f for _, f in e.probes[:4]] == [False, False, False, False]
    assert e.max_value == 506 and "seq_len 4096: does not fit" in seen[0]
    # a batch of 2 halves the longest sequence (2 MiB per token)
    two = estimate(build, gpu=exact_gpu(1 << 30), batch_size=2, maximize="seq_len", steps=1, default_device="cuda")
    assert two.max_value == 253 and two.batch_size == 2


def test_search_range_bounds_the_probes():
    card = exact_gpu(1 << 30)
    e = estimate(tokens, gpu=card, maximize="seq_len", search_range=(100, 300), steps=1, default_device="cuda")
    assert e.max_value == 300 and min(v for v, _ in e.probes) == 100
    assert max(v for v, _ in e.probes) == 300
    assert any("the whole search range fits" in n for n in e.notes)
    e = estimate(tokens, gpu=card, maximize="seq_len", search_range=(300, 5000), steps=1, default_device="cuda")
    assert e.max_value == 506 and min(v for v, _ in e.probes) == 300
    with pytest.raises(InvalidInputError) as ex:
        estimate(tokens, gpu=card, maximize="seq_len", search_range=(600, 900), steps=1, default_device="cuda")
    msg = str(ex.value)
    assert "nothing fits on test for seq_len in 600..900: tried seq_len 600: does not fit" in msg
    assert "fix:" in msg


def test_a_step_searches_its_multiples_only():
    card = exact_gpu(1 << 30)
    e = estimate(tokens, gpu=card, maximize="seq_len", search_range=(64, 4096, 64), steps=1, default_device="cuda")
    # multiples of 64 only: 448 fits (506 would), 512 does not
    assert e.max_value == 448 and all(v % 64 == 0 for v, _ in e.probes)
    fit = dict(e.probes)
    assert fit[448] and not fit[512]
    assert "searched in steps of 64: seq_len 448 fits, 512 does not" in e.notes
    with pytest.raises(InvalidInputError, match="a multiple of step between them"):
        estimate(tokens, gpu=card, maximize="seq_len", search_range=(65, 127, 64), default_device="cuda")


def test_max_batch_size_is_maximize_batch_size():
    card = exact_gpu(1 << 30)
    a = estimate(tokens, gpu=card, max_batch_size=True, params={"seq_len": 2}, steps=1, default_device="cuda")
    b = estimate(tokens, gpu=card, maximize="batch_size", params={"seq_len": 2}, steps=1, default_device="cuda")
    assert a.max_batch_size == b.max_batch_size == b.max_value == 253
    d = b.to_dict()
    assert d["max_batch_size"] == 253 and d["maximized"] == "batch_size"
    assert d["probes"][0] == {"batch_size": 1, "fits": True}


def test_memory_that_does_not_grow_is_reported():
    def build(batch, seq_len=1):
        x = torch.zeros(64, 1 << 18)  # ignores seq_len
        return lambda: x * 2

    with pytest.warns(RuntimeWarning, match="memory does not grow with seq_len"):
        e = estimate(build, gpu=exact_gpu(1 << 30), maximize="seq_len", steps=1, default_device="cuda")
    # doubling from 1 to the search's cap, 2 ** 24, with the same peak (x and x * 2) each time
    assert [v for v, _ in e.probes] == [1 << i for i in range(25)]
    assert e.max_value == 1 << 24
    assert f"the same peak ({128 * MiB:,} B requested) at every probe from seq_len 1 to " \
           f"seq_len {1 << 24}" in " ".join(e.notes)
    assert any("does build use seq_len?" in n for n in e.notes)


def test_a_peak_that_does_not_move_at_first_does_not_stop_the_search():
    """The peak is a build-time buffer (600 MiB, freed and its segment released before the
    step) until the step's own tensors outgrow it: the search goes on doubling and finds the
    true boundary."""
    def build(batch, seq_len=16):
        scratch = torch.zeros(600, 1 << 18, device="cuda")
        del scratch
        torch.cuda.empty_cache()
        x = torch.zeros(seq_len, 1 << 18)
        return lambda: x * 2

    e = estimate(build, gpu=exact_gpu(1 << 30), maximize="seq_len", steps=1, default_device="cuda")
    assert e.max_value == 506 and not any("does not grow" in n for n in e.notes)


def test_memory_that_shrinks_is_reported():
    def build(batch, seq_len=1):
        x = torch.zeros(60 if seq_len == 1 else 20 * seq_len, 1 << 18)
        return lambda: x * 2

    with pytest.warns(RuntimeWarning, match="memory is not monotone in seq_len"):
        e = estimate(build, gpu=exact_gpu(1 << 30), maximize="seq_len", steps=1, default_device="cuda")
    assert any(f"seq_len 1 peaks at {120 * MiB:,} B requested (fits), seq_len 2 at "
               f"{80 * MiB:,} B (fits)" in n for n in e.notes)
    # 20 MiB per step of seq_len: 2 * 20 s MiB + 1 % <= 1024 MiB -> 25
    assert e.max_value == 25


def test_default_margin_on_a_catalog_gpu_includes_the_context_term():
    card = gpu("T4")
    e = estimate(tokens, gpu=card, params={"seq_len": 20}, steps=1, default_device="cuda")
    assert e.margin_bytes == math.ceil(reserved(20) / 100) + 256 * MiB
    assert e.margin_rule.startswith("default: 1% of peak reserved + 256 MiB")
    d = e.to_dict()
    assert d["margin_bytes"] == e.margin_bytes and d["fits_without_margin"] is True
    assert d["headroom_after_margin_bytes"] == d["headroom_bytes"] - d["margin_bytes"]
    assert estimate(tokens, gpu=card, params={"seq_len": 20}, steps=1,
                    margin="2%", default_device="cuda").margin_bytes == math.ceil(reserved(20) * 2 / 100)
    assert estimate(tokens, gpu=card, params={"seq_len": 20}, steps=1,
                    margin="64 MiB", default_device="cuda").margin_bytes == 64 * MiB


@pytest.mark.parametrize("kwargs,needle", [
    ({"params": {"seq_lenn": 5}}, "takes no parameter 'seq_lenn'; its keyword parameters: "
                                  "seq_len, dtype, cache"),
    ({"maximize": "heads"}, "takes no parameter 'heads'"),
    ({"maximize": "dtype"}, "cannot maximize 'dtype': build's default for it is str 'float32'"),
    ({"maximize": "seq_len", "params": {"seq_len": 8}}, "is both set (params) and maximized"),
    ({"params": {"seq_len": "long"}}, "seq_len='long' (str) does not fit the parameter: its "
                                      "default is int 16"),
    ({"params": {"cache": 3}}, "cache=3 (int) does not fit the parameter: its default is bool"),
    ({"search_range": (5, 2), "maximize": "seq_len"}, "1 <= low <= high"),
    ({"search_range": (1, 8)}, "search_range is only used by a search"),
    ({"margin": -1}, "margin must be >= 0"),
    ({"margin": "lots"}, "margin 'lots'"),
    ({"margin": 0.5}, "margin must be None"),
    ({"batch_size": 2, "params": {"batch_size": 2}}, "the batch size was given twice"),
])
def test_bad_input_says_what_and_how_to_fix(kwargs, needle):
    def build(batch, seq_len=16, dtype="float32", cache=False):
        return tokens(batch, seq_len)

    with pytest.raises(InvalidInputError) as ex:
        estimate(build, gpu="T4", steps=1, **kwargs, default_device="cuda")
    assert needle in str(ex.value)


def test_builds_with_kwargs_take_any_parameter():
    def build(batch, **options):
        return tokens(batch, options.get("seq_len", 16))

    e = estimate(build, gpu=exact_gpu(1 << 30), maximize="seq_len", steps=1, default_device="cuda")
    assert e.max_value == 506


# -- the attention kernel -----------------------------------------------------------------------

def attention(dtype: torch.dtype, head: int = 64, L: int = 1024, mask: bool = False):
    def build(batch):
        q, k, v = (torch.randn(batch, 8, L, head, dtype=dtype, device="cuda") for _ in range(3))
        m = torch.ones(L, L, dtype=torch.bool, device="cuda").tril() if mask else None

        def step():
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, is_causal=not mask)
        return step
    return build


@pytest.mark.parametrize("card,dtype,kw,kernel,why", [
    ("H100-80GB", torch.bfloat16, {}, "cudnn", "bfloat16, head dim 64, causal"),
    ("H100-80GB", torch.bfloat16, {"mask": True}, "cudnn", "explicit attn_mask"),
    ("A100-80GB", torch.bfloat16, {}, "flash", "CUDA's choice on sm_80"),
    ("A100-80GB", torch.bfloat16, {"mask": True}, "efficient", "flash takes no attn_mask"),
    ("H100-80GB", torch.float32, {}, "efficient", "cuDNN needs float16/bfloat16"),
    ("T4", torch.float16, {}, "efficient", "flash needs compute capability 8.0-12.1"),
    ("T4", torch.bfloat16, {}, "math", "memory-efficient needs"),
])
def test_attention_kernel_is_cudas_choice_and_reported(card, dtype, kw, kernel, why):
    e = estimate(attention(dtype, **kw), gpu=card, batch_size=1, steps=1, default_device="cuda")
    assert e.attention_kernel == kernel and e.to_dict()["attention_kernel"] == kernel
    note = [n for n in e.notes if n.startswith("attention:")]
    assert len(note) == 1 and why in note[0] and "1 scaled_dot_product_attention call" in note[0]


def test_attention_kernel_follows_the_deprioritize_switch(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    e = estimate(attention(torch.bfloat16), gpu="H100-80GB", batch_size=1, steps=1, default_device="cuda")
    assert e.attention_kernel == "flash"


def test_fused_kernels_keep_no_score_matrix_and_math_does():
    b, h, L, d = 1, 8, 1024, 64
    qkv = 3 * b * h * L * d * 2  # bf16 / fp16 inputs
    out = b * h * L * d * 2
    scores = b * h * L * L  # elements of one S x S matrix
    fused = estimate(attention(torch.bfloat16), gpu="H100-80GB", batch_size=b, steps=1, default_device="cuda")
    # inputs + output: cuDNN's forward keeps no softmax stats without grad (MHA.cpp)
    assert fused.attention_kernel == "cudnn" and fused.peak_requested_bytes == qkv + out
    math_run = estimate(attention(torch.bfloat16), gpu="T4", batch_size=b, steps=1, default_device="cuda")
    assert math_run.attention_kernel == "math"
    assert math_run.peak_requested_bytes >= qkv + scores * 2


# -- the CLI ------------------------------------------------------------------------------------

TRAIN = textwrap.dedent("""
    import torch
    def build(batch, seq_len=16, label="x", scale=1.0, flag=False):
        x = torch.zeros(batch * seq_len, 1 << 18, device="cuda")
        def step():
            assert isinstance(label, str) and isinstance(scale, float) and isinstance(flag, bool)
            return x * 2
        return step
    def seen(batch, **kw):
        print("KW", sorted(kw.items()))
        x = torch.zeros(batch, 8, device="cuda")
        return lambda: x + 1
""")


def _file(folder, name: str, text: str):
    """``text`` written to ``folder / name``; its path."""
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture()
def train(tmp_path):
    return _file(tmp_path, "train.py", TRAIN)


def test_cli_max_seq_len_json(train, capsys):
    # "2 GiB": 2048 MiB less the Hopper context (530 MiB) = 1518 MiB usable; default margin
    # 1 % + 256 MiB (the catalog context is not measured)
    code = main(["estimate", f"{train}:build", "--gpu", "2 GiB", "--max", "seq_len",
                 "--steps", "1", "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    d = json.loads(cap.out)
    card = gpu("2 GiB")
    expected = largest(card.usable_bytes, 256 * MiB)
    assert d["max_seq_len"] == expected == 624
    assert "max_batch_size" not in d and d["maximized"] == "seq_len"
    assert d["params"] == {"seq_len": expected} and d["fits"] is True
    assert d["margin_bytes"] == math.ceil(reserved(expected) / 100) + 256 * MiB
    assert d["fits_without_margin"] is True and d["headroom_after_margin_bytes"] >= 0
    assert d["probes"][0] == {"seq_len": 16, "fits": True}   # the build's default
    assert f"seq_len {expected + 1}: does not fit with the margin" in cap.err
    # the text report names the answer
    assert main(["estimate", f"{train}:build", "--gpu", "2 GiB", "--max", "seq_len",
                 "--steps", "1", "--range", "600:700"]) == 0
    out = capsys.readouterr().out
    assert f"largest seq_len that fits: {expected}" in out and "error margin" in out


def test_cli_set_parses_values(train, capsys):
    assert main(["estimate", f"{train}:seen", "--set", "seq_len=32_768", "--set", "scale=0.5",
                 "--set", "flag=true", "--set", "name=static", "--set", "batch_size=3",
                 "--steps", "1", "--json"]) == 0
    cap = capsys.readouterr()
    # with --json, stdout is the JSON alone: what the build prints goes to stderr
    assert "KW [('flag', True), ('name', 'static'), ('scale', 0.5), ('seq_len', 32768)]" in cap.err
    d = json.loads(cap.out)
    assert d["batch_size"] == 3
    assert d["params"] == {"seq_len": 32768, "scale": 0.5, "flag": True, "name": "static"}


def test_cli_max_batch_size_alias(train, capsys):
    args = ["estimate", f"{train}:build", "--gpu", "1 GiB", "--set", "seq_len=1", "--steps",
            "1", "--json", "--margin", "0"]
    assert main([*args, "--max-batch-size"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*args, "--max", "batch_size"]) == 0
    b = json.loads(capsys.readouterr().out)
    # 1 GiB less the 530 MiB context: 2 * ceil2(b) MiB <= 494 MiB, no margin
    expected = largest(gpu("1 GiB").usable_bytes, 0, margin=False)
    assert a["max_batch_size"] == b["max_batch_size"] == expected == 246


def test_cli_nothing_fits_exits_3(train, capsys):
    code = main(["estimate", f"{train}:build", "--gpu", "1 GiB", "--max", "seq_len", "--set",
                 "batch_size=1000", "--steps", "1", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 3 and d["max_seq_len"] == 0 and d["fits"] is False
    assert "not even seq_len 1 fits" in d["notes"]


@pytest.mark.parametrize("args,needle", [
    (["--set", "seq_len"], "--set 'seq_len': expected NAME=VALUE"),
    (["--set", "1x=3"], "expected NAME=VALUE with NAME a Python identifier"),
    (["--set", "seq_len=long"], "seq_len='long' (str) does not fit the parameter"),
    (["--set", "heads=4"], "takes no parameter 'heads'; its keyword parameters: seq_len, "
                           "label, scale, flag"),
    (["--max", "label"], "cannot maximize 'label'"),
    (["--max", "seq_len", "--range", "10"], "--range '10': expected LO:HI or LO:HI:STEP"),
    (["--max", "seq_len", "--range", "10:20:0"], "STEP >= 1"),
    (["--max", "seq_len", "--range", "9:3"], "1 <= LO <= HI"),
    (["--range", "1:9"], "--range bounds a search"),
    (["--max", "seq_len", "--set", "seq_len=4"], "a parameter is either set or searched"),
    (["--max", "batch_size", "--batch-size", "4"], "the batch size is either set or searched"),
    (["--max-batch-size", "--max", "seq_len"], "one parameter is maximized at a time"),
    (["--margin", "x%"], "is not a percentage"),
    (["--gpu", "1 GiB", "--max", "seq_len", "--range", "400:800"],
     "nothing fits on 1.00 GiB for seq_len in 400..800: tried seq_len 400: does not fit"),
])
def test_cli_bad_input(train, capsys, args, needle):
    code = main(["estimate", f"{train}:build", "--steps", "1", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and "Traceback" not in err


def test_no_stray_warnings_without_a_search():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = estimate(tokens, gpu=exact_gpu(1 << 30), params={"seq_len": 12}, steps=1, default_device="cuda")
    assert e.maximized is None and "max_seq_len" not in e.to_dict()


# -- --max seq_len on --hf-config -----------------------------------------------------------------

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 1 << 20}


@pytest.fixture()
def tiny_config(tmp_path):
    return _file(tmp_path, "config.json", json.dumps(TINY_LLAMA))


def test_hf_config_max_seq_len_is_a_true_boundary(tiny_config, capsys):
    """The longest context of a transformers model from its config alone (eager attention:
    batch x heads x S x S scores), then the answer and the answer + 1 estimated on their own."""
    common = ["estimate", "--hf-config", str(tiny_config), "--task", "forward", "--attn",
              "eager", "--gpu", "1 GiB", "--margin", "2%", "--json"]
    assert main([*common, "--max", "seq_len", "--range", "1024:65536"]) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    answer = d["max_seq_len"]
    assert 1024 < answer < 65536 and d["maximized"] == "seq_len" and d["fits"] is True
    assert d["params"]["seq_len"] == answer and d["attention_kernel"] is None  # eager: no SDPA
    assert d["margin_rule"] == "2% of peak reserved"
    assert d["margin_bytes"] == math.ceil(d["peak_reserved_bytes"] * 2 / 100)
    assert f"seq_len {answer + 1}: does not fit" in cap.err
    assert main([*common, "--set", f"seq_len={answer}"]) == 0
    at = json.loads(capsys.readouterr().out)
    assert at["fits"] and at["peak_reserved_bytes"] == d["peak_reserved_bytes"]
    assert main([*common, "--set", f"seq_len={answer + 1}"]) == 3
    above = json.loads(capsys.readouterr().out)
    assert not above["fits"] and above["headroom_after_margin_bytes"] < 0


def test_hf_config_reports_the_attention_kernel(tiny_config, capsys):
    args = ["estimate", "--hf-config", str(tiny_config), "--task", "forward", "--dtype",
            "bfloat16", "--set", "seq_len=256", "--json"]
    kernels = {}
    for card in ("H100-80GB", "A100-80GB", "T4"):
        assert main([*args, "--gpu", card]) == 0
        d = json.loads(capsys.readouterr().out)
        kernels[card] = d["attention_kernel"]
        assert any(n.startswith("attention: ") and "head dim 16" in n for n in d["notes"])
    # head dim 16, bf16, causal, no grad: cuDNN on sm90, flash on sm80, math on sm75 (no bf16
    # fused kernel before Ampere)
    assert kernels == {"H100-80GB": "cudnn", "A100-80GB": "flash", "T4": "math"}


def test_a_search_where_nothing_fits_names_the_out_of_memory_sites_stack():
    # the probes record no Python stacks; the answer, an out-of-memory point, is rerun with them
    import torchmem

    def build(batch):
        x = torch.empty(batch * (20 << 30), dtype=torch.uint8, device="cuda")  # 20 GiB a row
        return lambda: x + 1

    e = torchmem.estimate(build, gpu="T4", max_batch_size=True)
    assert not e.fits and e.max_batch_size == 0 and e.probes == [(1, False)]
    assert e.oom is not None and e.oom.requested_bytes == 20 << 30
    assert any(__file__ in line and ":build" in line for line in e.oom.stack), e.oom.stack
