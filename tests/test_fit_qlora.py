"""4-bit and 8-bit loading under an estimate (issue 40, QLoRA): bitsandbytes runs as its own
fake kernels, with what its CUDA kernels allocate besides (``torchmem.fit.fakegpu._bnb``).

Ground truth, computed another way:
- the bytes a quantized weight keeps on the GPU, from bitsandbytes' packing rules (two 4-bit
  values per byte, one absmax per block, double quantization's 8-bit absmax with its own
  float32 absmax per 256 blocks, the offset, the 16-entry code and the 256-entry dynamic map);
- a QLoRA step written by hand with the same tensors (plain PyTorch: the dequantized weight as
  an empty tensor) has the same peaks, to the byte;
- paged optimizer state is the optimizer state of the unpaged optimizer, moved out of the
  allocator (CUDA managed memory) and listed in a note.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from torchmem.fit.run._engine import run_once
from torchmem.fit.targets._script import estimate_script

bnb = pytest.importorskip("bitsandbytes")

sys.path.insert(0, str(Path(__file__).parent))
from _sparse_checkpoint import llama_config, llama_tensors, write_sparse_checkpoint  # noqa: E402

DYNAMIC_MAP = 256 * 4  # create_dynamic_map(): 256 float32 (cached once per device, and copied)


def _requested() -> int:
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def _packed_bytes(n: int, blocksize: int = 64, double: bool = True) -> int:
    """What one 4-bit weight of ``n`` elements keeps on the GPU (bitsandbytes 0.50's
    ``quantize_4bit``): the packed weight (two values per byte), its absmax per block
    (float32, or with double quantization uint8 plus one float32 per 256 blocks, the float32
    offset and a copy of the 256-entry dynamic map: ``code.to(A.device, copy=True)`` in
    ``quantize_blockwise``), and the 16-entry float32 code of nf4/fp4."""
    blocks = -(-n // blocksize)
    absmax = blocks + 4 * -(-blocks // 256) + 4 + DYNAMIC_MAP if double else 4 * blocks
    return -(-n // 2) + absmax + 16 * 4


@pytest.mark.parametrize("quant_type,double,blocksize", [("nf4", True, 64), ("fp4", False, 64),
                                                         ("nf4", True, 128)])
def test_a_4bit_weight_keeps_what_bitsandbytes_packs(quant_type: str, double: bool,
                                                     blocksize: int) -> None:
    seen: dict[str, int] = {}

    def build(batch: int) -> Any:
        lin = _linear4bit(384, 640, blocksize, double, quant_type)
        seen["before"] = _requested()
        torch.cuda.reset_peak_memory_stats()
        lin = lin.to("cuda")
        seen["after"] = _requested()
        seen["peak"] = torch.cuda.memory_stats()["requested_bytes.all.peak"]
        seen["packed"] = lin.weight.numel()
        assert lin.weight.device.type == "cuda" and lin.weight.dtype == torch.uint8
        x = torch.zeros(batch, 384, device="cuda", dtype=torch.bfloat16)
        return lambda: lin(x)

    run_once(build, 8, "A100-40GB", steps=1)
    n = 384 * 640
    assert seen["packed"] == n // 2
    want = _packed_bytes(n, blocksize, double) + (DYNAMIC_MAP if double else 0)
    assert seen["after"] - seen["before"] == want
    # the moment of the move: the bf16 weight on the GPU, then quantize_4bit's output and
    # float32 absmax, the code (``get_4bit_type`` normalizes it: ``data.abs().max()``, 16 + 1
    # float32 for a moment); with double quantization then the offset, ``absmax - offset``,
    # the dynamic map, quantize_blockwise's uint8 output and float32 absmax, and the map's copy
    blocks = n // blocksize
    during = 2 * n + n // 2 + 4 * blocks + 16 * 4
    if double:
        during += 4 + 4 * blocks + DYNAMIC_MAP + blocks + 4 * -(-blocks // 256) + DYNAMIC_MAP
    else:
        during += 16 * 4 + 4
    assert seen["peak"] - seen["before"] == during


def _linear4bit(k: int, n: int, blocksize: int = 64, double: bool = True,
                quant_type: str = "nf4") -> Any:
    """A ``Linear4bit`` whose weight is bf16 before quantization, as transformers makes it from
    a bf16 checkpoint (the weight's dtype is what ``dequantize_4bit`` gives back)."""
    lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16)
    lin.weight = bnb.nn.Params4bit(torch.zeros(n, k, dtype=torch.bfloat16), requires_grad=False,
                                   blocksize=blocksize, compress_statistics=double,
                                   quant_type=quant_type)
    return lin


class _Dequant4bit(torch.autograd.Function):
    """A 4-bit matmul written by hand: the tensors bitsandbytes' CUDA path makes (double
    quantization's absmax dequantized and offset, the weight dequantized to the compute dtype,
    ``x @ w.t()``), as empty tensors."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int, k: int, blocks: int) -> torch.Tensor:
        ctx.shape = (n, k, blocks)
        absmax_dq = torch.empty(blocks, dtype=torch.float32, device=x.device)
        absmax = absmax_dq + torch.zeros((), device=x.device)
        w = torch.empty(n, k, dtype=x.dtype, device=x.device)
        out = x.reshape(-1, k) @ w.t()
        del absmax_dq, absmax, w
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        n, k, blocks = ctx.shape
        absmax = torch.empty(blocks, dtype=torch.float32, device=grad.device)  # dequantize_blockwise
        absmax += 1.0
        w = torch.empty(n, k, dtype=grad.dtype, device=grad.device)  # dequantize_4bit
        del absmax
        return grad @ w, None, None, None


def _qlora_build(by_hand: bool) -> Any:
    def build(batch: int) -> Any:
        torch.manual_seed(0)
        shapes = [(512, 256), (256, 512)]
        layers: list[Any] = []
        if by_hand:
            # the same tensors a 4-bit layer keeps (see test_a_4bit_weight_keeps_...)
            torch.empty(256, dtype=torch.float32, device="cuda")  # the dynamic map, freed
            kept = []
            dyn = torch.empty(256, dtype=torch.float32, device="cuda")
            for n, k in shapes:
                blocks = n * k // 64
                kept.append([torch.empty(n * k // 2, 1, dtype=torch.uint8, device="cuda"),
                             torch.empty(blocks, dtype=torch.uint8, device="cuda"),
                             torch.empty(-(-blocks // 256), device="cuda"),
                             torch.empty((), device="cuda"), torch.empty(16, device="cuda"),
                             torch.empty(256, device="cuda")])  # state2's copy of the map
                layers.append(lambda x, n=n, k=k, b=blocks: _Dequant4bit.apply(x, n, k, b))
            layers.append(kept + [dyn])
        else:
            mods = [_linear4bit(k, n) for n, k in shapes]
            mods = [m.to("cuda") for m in mods]
            layers.extend(mods)
            layers.append(mods)
        # a trainable LoRA pair on the first layer (bf16), AdamW on it
        a = torch.nn.Parameter(torch.zeros(8, 256, device="cuda", dtype=torch.bfloat16))
        b = torch.nn.Parameter(torch.zeros(512, 8, device="cuda", dtype=torch.bfloat16))
        opt = torch.optim.AdamW([a, b], lr=1e-4)
        x = torch.zeros(batch, 64, 256, device="cuda", dtype=torch.bfloat16)

        def step() -> None:
            torch.cuda.reset_peak_memory_stats()
            h = layers[0](x) + (x @ a.t()) @ b.t()
            y = layers[1](torch.relu(h))
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            stats = torch.cuda.memory_stats()
            peaks.append(tuple(stats[f"{k}_bytes.all.{w}"] for k in
                               ("requested", "allocated", "reserved") for w in ("peak", "current")))

        return step

    peaks: list[tuple[int, ...]] = []
    build.peaks = peaks  # type: ignore[attr-defined]
    return build


@pytest.mark.parametrize("batch", [2, 32])  # 128 and 2,048 rows: both take the dequantized path
def test_a_qlora_step_has_the_peaks_of_the_same_step_written_by_hand(batch: int) -> None:
    built = _qlora_build(False), _qlora_build(True)
    q = run_once(built[0], batch, "A100-40GB", steps=2)
    h = run_once(built[1], batch, "A100-40GB", steps=2)
    # each step's peaks and what it leaves (requested, allocated, reserved), to the byte; the
    # loads differ (quantizing moves the bf16 weight through the GPU first: tested above)
    assert built[0].peaks == built[1].peaks and len(built[0].peaks) == 2
    assert q.peak_allocated_bytes == h.peak_allocated_bytes
    assert q.assumed_values == []
    # the dequantized weight (512 x 256 bf16) is in the peak: without it the step is smaller
    assert q.peak_requested_bytes > batch * 64 * 512 * 2 + 512 * 256 * 2


def test_a_single_row_takes_the_fused_kernel_with_no_dequantized_weight() -> None:
    seen: dict[str, int] = {}

    def build(batch: int) -> Any:
        lin = _linear4bit(1024, 2048).to("cuda")
        x = torch.zeros(batch, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step() -> None:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = lin(x)
            seen["rise"] = torch.cuda.max_memory_allocated() - before
            seen["shape"] = tuple(y.shape)

        return step

    run_once(build, 1, "A100-40GB", steps=1)
    # one row: the output alone (2048 bf16, 4 KiB), no 4 MiB dequantized weight, no GEMM
    assert seen == {"rise": 2048 * 2, "shape": (1, 2048)}


def _adamw8bit_step(paged: bool = False, override: bool = False) -> Any:
    """A build: a 1024 x 1024 linear layer trained by bitsandbytes' (paged) AdamW8bit, its
    weight overridden to 32-bit state with ``override``."""

    def build(batch: int) -> Any:
        lin = torch.nn.Linear(1024, 1024, device="cuda")
        if override:
            bnb.optim.GlobalOptimManager.get_instance().override_config(
                lin.weight, "optim_bits", 32)
        kind = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        opt = kind(lin.parameters(), lr=1e-4)
        x = torch.zeros(batch, 1024, device="cuda")

        def step() -> None:
            lin(x).sum().backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def test_a_32_bit_override_in_one_estimate_does_not_reach_the_next() -> None:
    """bitsandbytes' ``GlobalOptimManager`` is one per process, keyed by ``id(parameter)``
    (transformers' ``optim="adamw_bnb_8bit"`` asks it for 32-bit state of the embeddings).
    A run that overrides its linear layer's weight to 32 bits keeps the 32-bit state (8 B an
    element), the next run of the same step without the override has 8-bit state again (the
    first run's parameter ids, reused, carried the override into it: 8,396,800 B instead of
    2,140,160 B), and the caller's own manager is the one it had before, holding none of the
    runs' parameter ids."""
    before = bnb.optim.GlobalOptimManager.get_instance()
    overrides = dict(before.pid2config)

    n = 1024 * 1024
    state32 = run_once(_adamw8bit_step(override=True), 8, "A100-40GB",
                       steps=2).by_category["optimizer_state"]
    state8 = run_once(_adamw8bit_step(), 8, "A100-40GB", steps=2).by_category["optimizer_state"]
    assert state32 == 2 * 4 * n + 2 * 4 * 1024  # two float32 buffers each, weight and bias
    assert state8 == 2 * n + 2 * 4 * (n // 256) + 2 * DYNAMIC_MAP + 2 * 4 * 1024
    assert bnb.optim.GlobalOptimManager.get_instance() is before
    assert before.pid2config == overrides  # nothing of the runs' parameters is left in it


def test_8bit_paged_optimizer_state_is_managed_memory_listed_apart() -> None:
    plain = run_once(_adamw8bit_step(), 8, "A100-40GB", steps=2)
    paged = run_once(_adamw8bit_step(paged=True), 8, "A100-40GB", steps=2)
    n = 1024 * 1024
    # bitsandbytes' 8-bit state of the weight (two uint8 buffers, two absmax vectors of n/256,
    # the two 256-entry maps) and of the bias (1024 elements: two float32 buffers)
    assert plain.by_category["optimizer_state"] == (2 * n + 2 * 4 * (n // 256) + 2 * DYNAMIC_MAP
                                                   + 2 * 4 * 1024)
    # paged: the two uint8 buffers are CUDA managed memory, outside the allocator
    assert plain.by_category["optimizer_state"] - paged.by_category["optimizer_state"] == 2 * n
    assert [x for x in paged.notes if "paged" in x] == [
        "bitsandbytes paged optimizer state: 2.00 MiB in 2 tensors of CUDA managed memory "
        "(get_paged, for parameters of 100,000 elements or more): outside PyTorch's allocator, "
        "so not in the peaks above; it stays on the GPU while there is room (nvidia-smi counts "
        "it) and the driver pages it out to host memory when PyTorch needs the space"]
    assert not [x for x in plain.notes if "paged" in x]


QLORA = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    path, how = sys.argv[1], sys.argv[2]
    quant = {"4bit": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.bfloat16),
             "8bit": BitsAndBytesConfig(load_in_8bit=True), "bf16": None}[how]
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant,
                                                 dtype=torch.bfloat16, device_map={"": 0})
    if how == "bf16":
        model.to("cuda")
    import builtins
    builtins.LOADED = torch.cuda.memory_stats()["requested_bytes.all.current"]
    if how != "bf16":
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model)
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(2):
        x = torch.randint(0, 1000, (2, 64), device="cuda")
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
""")

TINY = dict(hidden=256, intermediate=640, layers=2, heads=4, kv_heads=4, vocab=1000)


@pytest.mark.slow
def test_from_pretrained_in_4bit_and_8bit_loads_what_bitsandbytes_keeps(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import builtins

    write_sparse_checkpoint(tmp_path / "tiny", llama_config(**TINY), llama_tensors(**TINY))
    script = tmp_path / "qlora.py"
    script.write_text(QLORA)
    loaded = {}
    for how in ("bf16", "4bit", "8bit"):
        e = estimate_script(str(script), [str(tmp_path / "tiny"), how], "A100-40GB", steps=2)
        assert e.script.steps_run == 2, how
        loaded[how] = builtins.LOADED
    del builtins.LOADED
    # the seven linear layers of each decoder layer are quantized (lm_head is not)
    h, i = TINY["hidden"], TINY["intermediate"]
    linears = [h * h] * 4 + [h * i] * 3
    n_layers = TINY["layers"]
    bf16 = 2 * sum(linears) * n_layers
    four = sum(_packed_bytes(n) for n in linears) * n_layers + DYNAMIC_MAP
    # LLM.int8: one int8 byte per weight and a float32 scale per output row (Int8Params.SCB)
    rows = [h] * 4 + [i, i, h]
    eight = sum(n + 4 * r for n, r in zip(linears, rows)) * n_layers
    assert loaded["bf16"] - loaded["4bit"] == bf16 - four
    assert loaded["bf16"] - loaded["8bit"] == bf16 - eight


def test_adam8bit_stand_in_allocates_what_bitsandbytes_adam8bit_allocates() -> None:
    """torchmem.fit.Adam8bitStandIn (for builds without bitsandbytes) against bitsandbytes'
    own Adam8bit run under the estimate: the same state, the same peaks."""
    from torchmem.fit import Adam8bitStandIn

    def build(kind: Any) -> Any:
        def b(batch: int) -> Any:
            model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                        torch.nn.Linear(2048, 512), torch.nn.LayerNorm(512))
            model.to("cuda")
            opt = kind(model.parameters(), lr=1e-4)
            x = torch.zeros(batch, 512, device="cuda")

            def step() -> None:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()

            return step

        return b

    real = run_once(build(bnb.optim.Adam8bit), 16, "T4", steps=2)
    stand_in = run_once(build(Adam8bitStandIn), 16, "T4", steps=2)
    assert real.by_category["optimizer_state"] == stand_in.by_category["optimizer_state"]
    for key in ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes"):
        assert getattr(real, key) == getattr(stand_in, key), key
    n = 2 * 512 * 2048  # the two weights: 8-bit; the biases and the norm: 32-bit
    small = 2048 + 512 + 512 + 512
    assert real.by_category["optimizer_state"] == (
        Adam8bitStandIn.state_bytes(n // 2) * 2 + 2 * DYNAMIC_MAP + 2 * 4 * small)
