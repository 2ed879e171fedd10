"""CUDA streams in the estimate (:mod:`torchmem.fit.fakegpu._streams`): each stream its own
pool, ``record_stream``'s frees deferred until the program waits for the other stream's work.

Every expected figure is the arithmetic of the caching allocator's segments (a request between
1 MiB and 10 MiB gets a 20 MiB segment, a larger one a segment of its size rounded to 2 MiB;
``shared/docs/cuda-caching-allocator.md``), computed here, not read from the estimate.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import torchmem
from torchmem.fit import GPU

MiB = 1 << 20


def _mib(n: int) -> torch.Tensor:
    return torch.empty(n * MiB, dtype=torch.uint8, device="cuda")


def _est(build, **kw) -> torchmem.Estimate:
    kw.setdefault("gpu", "H100-80GB")
    return torchmem.estimate(build, batch_size=1, margin=0, steps=1, **kw)


def test_each_stream_has_its_own_pool():
    def build(batch: int, side_stream: bool):
        side = torch.cuda.Stream()

        def step() -> None:
            if side_stream:
                with torch.cuda.stream(side):
                    a = _mib(4)
            else:
                a = _mib(4)
            del a
            b = _mib(4)  # the default stream cannot take the side stream's free block
            del b
        return step

    one = _est(build, params={"side_stream": False})
    two = _est(build, params={"side_stream": True})
    assert one.peak_reserved_bytes == 20 * MiB
    assert two.peak_reserved_bytes == 2 * 20 * MiB
    assert one.peak_allocated_bytes == two.peak_allocated_bytes == 4 * MiB
    assert one.peak_reserved_lower_bytes is None and two.peak_reserved_lower_bytes is None


@pytest.mark.parametrize("wait, upper", [
    ("", 2 * 12),                                    # nothing waits: the block still waits
    ("torch.cuda.synchronize()", 12),
    ("torch.cuda.current_stream().synchronize()", 12),
    ("ev = torch.cuda.Event(); ev.record(); ev.synchronize()", 12),
    ("torch.cuda.current_stream().record_event().query()", 12),
    ("x.sum().item()", 12),                          # a value read waits for its stream
    ("side.synchronize()", 2 * 12),                  # the block waits for the default stream
    ("torch.cuda.empty_cache()", 12),
])
def test_record_stream_frees_wait_for_the_program_to_wait(wait: str, upper: int):
    def build(batch: int):
        side = torch.cuda.Stream()
        x = torch.ones(4, device="cuda")

        def step() -> None:
            with torch.cuda.stream(side):
                buf = _mib(12)
            torch.cuda.current_stream().wait_stream(side)
            buf.record_stream(torch.cuda.current_stream())
            del buf
            exec(wait, {"torch": torch, "side": side, "x": x})
            with torch.cuda.stream(side):
                again = _mib(12)
            del again
        return step

    e = _est(build)
    small = 2 * MiB  # x's 16 bytes (and a value read's) in a 2 MiB small segment
    assert e.peak_reserved_bytes == upper * MiB + small
    assert e.peak_allocated_bytes == 12 * MiB + 512
    assert e.peak_reserved_lower_bytes == 12 * MiB + small
    assert len(e.range_causes) == 1 and "record_stream marked 1 block for" in e.range_causes[0]


def test_the_allocators_out_of_memory_retry_waits_for_other_streams():
    # 10 buffers of 12 MiB record_stream-ed without a wait need 120 MiB; the GPU has 64: the
    # allocator's retry waits for the other stream and frees them, as PyTorch's
    # release_cached_blocks does (synchronize_and_free_events), so the run fits
    def build(batch: int):
        side = torch.cuda.Stream()

        def step() -> None:
            for _ in range(10):
                with torch.cuda.stream(side):
                    buf = _mib(12)
                buf.record_stream(torch.cuda.current_stream())
                del buf
        return step

    card = GPU("64 MiB", total_bytes=64 * MiB, compute_capability=(9, 0), source="test",
               context_override=0)
    e = _est(build, gpu=card)
    assert e.oom is None and e.fits
    assert e.peak_reserved_bytes == 5 * 12 * MiB  # the sixth does not fit: retry, then reuse
    assert e.peak_reserved_lower_bytes == 12 * MiB


def test_current_stream_set_stream_and_nesting():
    seen: list[object] = []

    def build(batch: int):
        a, b = torch.cuda.Stream(), torch.cuda.Stream()

        def step() -> None:
            default = torch.cuda.current_stream()
            with torch.cuda.stream(a):
                seen.append(torch.cuda.current_stream() == a)
                with b:
                    seen.append(torch.cuda.current_stream() == b)
                    t1 = _mib(4)  # on b
                seen.append(torch.cuda.current_stream() == a)
            seen.append(torch.cuda.current_stream() == default)
            torch.cuda.set_stream(a)
            t2 = _mib(4)  # on a
            torch.cuda.set_stream(default)
            t3 = _mib(4)  # on the default stream
            seen.append(default == torch.cuda.default_stream())
            del t1, t2, t3
        return step

    e = _est(build)
    assert seen == [True, True, True, True, True]
    assert e.peak_reserved_bytes == 3 * 20 * MiB  # three streams, three segments


def test_record_stream_refuses_what_is_not_a_stream():
    def build(batch: int):
        def step() -> None:
            _mib(1).record_stream("default")
        return step

    with pytest.raises(torchmem.errors.InvalidInputError, match="record_stream expects a stream, got str"):
        _est(build)


def test_repeated_calls_on_a_side_stream_are_run_not_replayed():
    class Producer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.side = torch.cuda.Stream()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.cuda.stream(self.side):
                y = x * 2
            torch.cuda.current_stream().wait_stream(self.side)
            y.record_stream(torch.cuda.current_stream())
            return y

    def build(batch: int):
        m = Producer()
        x = torch.ones(3 * MiB, device="cuda")  # 12 MiB

        def step() -> None:
            for _ in range(6):
                with torch.no_grad():
                    m(x)
        return step

    e = _est(build)
    plain = _est(build, replay_repeats=False)
    assert e.calls_replayed == 0
    # x on the default stream; the 6 outputs on the side stream wait (nothing waits for them)
    assert e.peak_reserved_bytes == plain.peak_reserved_bytes == 12 * MiB + 6 * 12 * MiB
    assert e.peak_reserved_lower_bytes == plain.peak_reserved_lower_bytes == 2 * 12 * MiB


def test_cli_reports_the_range(tmp_path):
    script = tmp_path / "prefetch.py"
    script.write_text(textwrap.dedent("""
        import torch
        side = torch.cuda.Stream()
        w = torch.randn(1024, 1024, device="cuda")
        for step in range(3):
            with torch.cuda.stream(side):
                batch = torch.randn(4096, 1024).pin_memory().to("cuda", non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
            batch.record_stream(torch.cuda.current_stream())
            loss = (batch @ w).square().mean()
            del batch
        print(loss.item())
    """))
    out = subprocess.run([sys.executable, "-m", "torchmem", "estimate", "--gpu", "H100-80GB",
                          str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "the lower figure: running the program again" in out.stdout + out.stderr
    assert "peak reserved, lower" in out.stdout
    assert "range: record_stream marked 3 blocks" in out.stdout.replace("\n", " ")
    js = subprocess.run([sys.executable, "-m", "torchmem", "estimate", "--json", "--gpu",
                         "H100-80GB", str(script)], capture_output=True, text=True, timeout=300)
    import json

    d = json.loads(js.stdout)
    low, high = d["peak_reserved_range"]
    assert high == d["peak_reserved_bytes"] and low < high
    # each batch is 16 MiB on the side stream and nothing waits before the last .item(): the
    # latest keeps all three, the earliest reuses one
    assert high - low == 2 * 16 * MiB


def test_a_notebook_shows_the_range():
    def build(batch: int):
        side = torch.cuda.Stream()

        def step() -> None:
            with torch.cuda.stream(side):
                buf = _mib(12)
            buf.record_stream(torch.cuda.current_stream())
            del buf
            with torch.cuda.stream(side):
                _mib(12)
        return step

    page = _est(build)._repr_html_()
    assert "peak reserved, lower" in page and "12.00 MiB" in page
    assert "range: record_stream marked 1 block for another stream" in page


def test_torch_accelerator_streams_are_the_same_streams():
    seen: list[bool] = []

    def build(batch: int):
        side = torch.cuda.Stream()

        def step() -> None:
            torch.accelerator.set_stream(side)
            seen.append(torch.accelerator.current_stream() == side == torch.cuda.current_stream())
            a = _mib(4)  # on the side stream
            torch.accelerator.set_stream(torch.cuda.default_stream())
            del a
            _mib(4)  # the default stream cannot take the side stream's block
        return step

    e = _est(build)
    assert seen == [True]
    assert e.peak_reserved_bytes == 2 * 20 * MiB


def test_a_prefetching_loader_that_names_its_stream_by_keyword():
    """timm's PrefetchLoader enters ``functools.partial(torch.cuda.stream, stream=s)``: the
    copies go to that stream's pool (they went to the default one)."""
    import functools

    def build(batch: int):
        side = torch.cuda.Stream()
        ctx = functools.partial(torch.cuda.stream, stream=side)
        host = [torch.randn(batch, 1024) for _ in range(3)]

        def step() -> None:
            held = None
            for x in host:
                with ctx():
                    nxt = x.to("cuda", non_blocking=True)  # 4 MiB in the side stream's pool
                torch.cuda.current_stream().wait_stream(side)
                held = nxt
                (held * 2).sum()  # on the default stream: its own 20 MiB segment
        return step

    e = torchmem.estimate(build, gpu="H100-80GB", batch_size=1024, margin=0, steps=1)
    assert e.peak_reserved_bytes == 20 * MiB + 20 * MiB + 2 * MiB  # side, default, the sums


def test_transformers_offloaded_cache_prefetches_on_its_own_stream():
    """``generate(..., cache_implementation="offloaded")`` makes its prefetch stream with the
    generic ``torch.Stream()`` (the current accelerator's): it failed under the estimate
    ("Unknown device"). Now the layers' caches go to the host and come back on that stream's
    pool: less allocated than the dynamic cache, a segment of its own stream."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)

    def build(batch: int, impl: str):
        model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16)
        ids = torch.randint(0, 1000, (batch, 512), device="cuda")
        mask = torch.ones_like(ids)
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=8,
                                      do_sample=False, pad_token_id=0,
                                      cache_implementation=impl)

    kw = dict(gpu="A100-40GB", batch_size=8, steps=1, margin=0)
    dynamic = torchmem.estimate(build, params={"impl": "dynamic"}, **kw)
    offloaded = torchmem.estimate(build, params={"impl": "offloaded"}, keep_snapshot=True, **kw)
    assert offloaded.peak_allocated_bytes < dynamic.peak_allocated_bytes
    assert {s.stream for s in offloaded.snapshot.segments} - {0}


def test_a_scripts_search_runs_no_lower_figure(tmp_path):
    """Only a plain estimate runs the program a second time for the lower figure; a search's
    probes (and its answer) keep the upper figures, which their verdicts take."""
    script = tmp_path / "prefetch_batch.py"
    script.write_text(textwrap.dedent("""
        import argparse, torch
        p = argparse.ArgumentParser(); p.add_argument("--batch-size", type=int, default=64)
        a = p.parse_args()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            batch = torch.randn(a.batch_size, 1 << 20, device="cuda")
        batch.record_stream(torch.cuda.current_stream())
        print(batch.sum().item())
    """))
    plain = torchmem.estimate_script(str(script), [], gpu="T4")
    assert plain.peak_reserved_lower_bytes is not None
    searched = torchmem.estimate_script(str(script), [], gpu="T4", maximize="batch_size",
                                        search_range=(1, 4096))
    assert searched.max_value and searched.peak_reserved_lower_bytes is None
