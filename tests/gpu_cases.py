"""The workloads of the GPU reference data (``tests/data/gpu/``), as device-agnostic builds.

Not a test module. ``scripts/record_gpu_reference.py`` runs each case on a real GPU under the
caching allocator with its history recorded from an empty allocator; ``tests/test_gpu_reference.py``
and ``benchmarks/bench_gpu_truth.py`` run the same builds on this CPU-only machine through
:func:`torchmem.estimate` (fake tensors, the allocator simulator) and compare.

Every build follows :func:`torchmem.estimate`'s contract: ``build(batch_size, **params)`` creates
the model, optimizer and data on ``"cuda"`` and returns a zero-argument ``step()`` that runs one
training (or forward/backward) iteration. The recorder calls ``step()`` :data:`STEPS` times, as
``estimate(..., steps=2)`` does.

Example:
    >>> sorted(CASES)[:3]
    ['accum2_fp32', 'alloc_expandable', 'alloc_gc0.6_fraction']
    >>> GPT_SMALL.parameters
    168466432
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 2
DEVICE = "cuda"


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2-style decoder: learned positions, pre-LayerNorm blocks, SDPA causal attention,
    GELU MLP, untied LM head, biases in every linear."""

    vocab: int = 8192
    context: int = 512
    d_model: int = 1024
    layers: int = 12
    heads: int = 16

    @property
    def parameters(self) -> int:
        """Number of parameters.

        Example:
            >>> GPTConfig(vocab=10, context=4, d_model=8, layers=1, heads=2).parameters
            1090
        """
        d, v = self.d_model, self.vocab
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return v * d + self.context * d + self.layers * block + 2 * d + (v * d + v)


GPT_SMALL = GPTConfig()


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig, checkpoint: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for blk in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.ln_f(x))


def _gpt_parts(batch: int, cfg: GPTConfig, checkpoint: bool = False, optimizer: str = "default",
               weights_bf16: bool = False, host: bool = False) -> tuple[GPT, Any, Any, Any]:
    torch.manual_seed(0)
    if host:  # built on the host and moved, as from_pretrained users do
        model = GPT(cfg, checkpoint)
        if weights_bf16:
            model = model.to(torch.bfloat16)
        model = model.to(DEVICE)
    else:
        model = GPT(cfg, checkpoint).to(DEVICE)
        if weights_bf16:
            model = model.to(torch.bfloat16)
    kw = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True},
          "per_parameter": {"foreach": False}}[optimizer]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    where = "cpu" if host else DEVICE
    ids = torch.randint(0, cfg.vocab, (batch, cfg.context), device=where)
    targets = torch.randint(0, cfg.vocab, (batch, cfg.context), device=where)
    if host and torch.cuda.is_available():
        ids, targets = ids.pin_memory(), targets.pin_memory()
    return model, opt, ids, targets


def gpt_train(batch_size: int, bf16: bool = False, checkpoint: bool = False, micro_batches: int = 1,
              cfg: GPTConfig = GPT_SMALL, optimizer: str = "default", weights_bf16: bool = False,
              host: bool = False, readings: list[dict[str, int]] | None = None,
) -> Callable[[], None]:
    """One AdamW step of :class:`GPT`: forward (under bf16 autocast when ``bf16``), cross-entropy,
    backward, ``opt.step()``, ``opt.zero_grad()``; ``checkpoint`` wraps each block in
    non-reentrant activation checkpointing; ``micro_batches`` splits the batch and accumulates
    gradients (each loss divided by their number). ``optimizer``: ``"default"`` (PyTorch picks),
    ``"fused"``, ``"foreach"`` or ``"per_parameter"`` AdamW; ``weights_bf16`` keeps the weights
    (and so gradients and optimizer state) in bf16; ``host`` builds the model on the host and
    moves it with ``.to("cuda")``, keeps the batch on the host (pinned) and copies it each step
    with ``non_blocking=True``. ``readings``: a list that gets, after each step, what the script
    itself would read from ``torch.cuda`` (the peaks of forward and of backward+step apart, reset
    with ``torch.cuda.reset_peak_memory_stats()`` between them; the loss read with ``.item()``,
    which an estimate answers and lists).

    Example:
        >>> import torchmem
        >>> tiny = GPTConfig(vocab=64, context=16, d_model=32, layers=2, heads=2)
        >>> e = torchmem.estimate(lambda b: gpt_train(b, cfg=tiny), gpu="T4", batch_size=2)
        >>> e.by_category["parameter"] == tiny.parameters * 4
        True
    """
    model, opt, ids, targets = _gpt_parts(batch_size, cfg, checkpoint, optimizer, weights_bf16, host)
    if batch_size % micro_batches:
        raise ValueError(f"batch_size {batch_size} is not a multiple of micro_batches {micro_batches}")

    def step() -> None:
        if readings is not None:
            torch.cuda.reset_peak_memory_stats()
        x_all, y_all = ids, targets
        if host:
            x_all = ids.to(DEVICE, non_blocking=True)
            y_all = targets.to(DEVICE, non_blocking=True)
        for i, t in zip(x_all.chunk(micro_batches), y_all.chunk(micro_batches)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                logits = model(i)
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab), t.reshape(-1))
            if readings is not None:
                fwd = {"forward_max_allocated": torch.cuda.max_memory_allocated(),
                       "forward_max_reserved": torch.cuda.max_memory_reserved()}
                torch.cuda.reset_peak_memory_stats()
            (loss / micro_batches).backward()
            value = loss.item() if readings is not None else 0.0
            del logits, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        if readings is not None:
            readings.append({**fwd, "loss_is_finite": int(math.isfinite(value)),
                             "backward_step_max_allocated": torch.cuda.max_memory_allocated(),
                             "backward_step_max_reserved": torch.cuda.max_memory_reserved(),
                             "allocated": torch.cuda.memory_allocated(),
                             "reserved": torch.cuda.memory_reserved()})
    step.readings = readings  # type: ignore[attr-defined]
    return step


def gpt_phase_readings(batch_size: int) -> Callable[[], None]:
    """:func:`gpt_train` that records the script's own ``torch.cuda`` readings (``readings``):
    the numbers an unmodified script prints, which an estimate must answer the same way."""
    return gpt_train(batch_size, readings=[])


def hf_trainer(batch_size: int, seq_len: int = 256, max_steps: int = 3) -> Callable[[], None]:
    """transformers' ``Trainer.train()``, unmodified, on :data:`HF_LLAMA` (random weights from its
    config, fp32, AdamW, a synthetic dataset of random token ids; logging every step reads the
    loss and the gradient norm from tensors). ``readings`` gets the Trainer's own
    ``max_memory_allocated`` after training."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in HF_LLAMA.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(cfg)
    rows = [{"input_ids": torch.randint(0, cfg.vocab_size, (seq_len,)),
             "labels": torch.randint(0, cfg.vocab_size, (seq_len,))} for _ in range(batch_size * max_steps)]
    import tempfile
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch_size,
                             max_steps=max_steps, logging_steps=1, report_to=[], save_strategy="no",
                             optim="adamw_torch", dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    readings: list[dict[str, int]] = []

    def step() -> None:
        trainer.train()
        readings.append({"max_allocated": torch.cuda.max_memory_allocated(),
                         "allocated": torch.cuda.memory_allocated()})
    step.readings = readings  # type: ignore[attr-defined]
    return step


def sdpa(batch_size: int, backend: str = "flash", heads: int = 16, seq: int = 2048,
         head_dim: int = 64) -> Callable[[], None]:
    """``scaled_dot_product_attention`` forward and backward in bf16 with one kernel forced
    (``"flash"`` or ``"efficient"``), causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch_size, heads, seq, head_dim, device=DEVICE, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))

    def step() -> None:
        with sdpa_kernel(kernel):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().square().mean().backward()
        for t in (q, k, v):
            t.grad = None
    return step


def convnet(batch_size: int) -> Callable[[], None]:
    """A small conv net (3 conv-BN-ReLU stages with max pooling, global pooling, a linear
    classifier) on 3 x 64 x 64 images, SGD with momentum."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c = 3
    for w in (64, 128, 256):
        layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                   nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c = w
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 100)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch_size, 3, 64, 64, device=DEVICE)
    y = torch.randint(0, 100, (batch_size,), device=DEVICE)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def two_streams(batch_size: int) -> Callable[[], None]:
    """Producer/consumer on two streams: a side stream fills buffers that the default stream
    consumes; each buffer is handed over with ``record_stream`` and freed at once, so the
    allocator must keep its block until the consumer's work is done."""
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    w = torch.randn(1024, 1024, device=DEVICE)

    def step() -> None:
        acc = torch.zeros(batch_size, 1024, device=DEVICE)
        for _ in range(8):
            with torch.cuda.stream(side):
                buf = torch.randn(batch_size, 1024, device=DEVICE) @ w
            main.wait_stream(side)
            buf.record_stream(main)
            acc += buf.relu()
            del buf
        acc.sum().item()
    return step


def empty_cache_midway(batch_size: int) -> Callable[[], None]:
    """:func:`gpt_train` with ``torch.cuda.empty_cache()`` after every step: the next step maps
    its segments anew."""
    inner = gpt_train(batch_size)

    def step() -> None:
        inner()
        torch.cuda.empty_cache()
    return step


# tests/test_fit_hf.py's tiny Llama (random weights: nothing is downloaded)
HF_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "max_position_embeddings": 4096}


def hf_generate(batch_size: int, seq_len: int = 512, max_new_tokens: int = 16) -> Callable[[], None]:
    """transformers' ``generate()`` of :data:`HF_LLAMA` built from its config (bf16, SDPA, dynamic
    cache): a prompt of ``seq_len`` tokens and ``max_new_tokens`` new ones, as
    :func:`torchmem.estimate_hf` builds it (``task="generate"``)."""
    from torchmem.fit.targets._hf import load_config, make_build

    return make_build(load_config(HF_LLAMA), "generate", torch.bfloat16, "sdpa", seq_len,
                      max_new_tokens, "dynamic")(batch_size)


@dataclass(frozen=True)
class Case:
    """One reference run: the build, its batch, the allocator settings and limits."""

    build: Callable[..., Callable[[], None]]
    batch_size: int
    params: dict[str, Any] = field(default_factory=dict)
    alloc_conf: str = ""
    memory_fraction: float | None = None   # torch.cuda.set_per_process_memory_fraction
    expect_oom: bool = False
    note: str = ""
    steps: int = STEPS


# Batch sizes: 8 and 32 everywhere; the "near the limit" batches were chosen with
# torchmem.estimate on this CPU machine for an H100-80GB (the largest batch whose estimate fits
# with about 10% to spare); the recorder reports what really happened.
NEAR_LIMIT_FP32 = 156
NEAR_LIMIT_BF16 = 256

CASES: dict[str, Case] = {
    "gpt_fp32_b8": Case(gpt_train, 8),
    "gpt_fp32_b32": Case(gpt_train, 32),
    "gpt_fp32_near_limit": Case(gpt_train, NEAR_LIMIT_FP32, note="close to an H100-80GB's limit"),
    "gpt_bf16_b8": Case(gpt_train, 8, {"bf16": True}),
    "gpt_bf16_b32": Case(gpt_train, 32, {"bf16": True}),
    "gpt_bf16_near_limit": Case(gpt_train, NEAR_LIMIT_BF16, {"bf16": True},
                                note="close to an H100-80GB's limit"),
    "checkpoint_fp32": Case(gpt_train, 32, {"checkpoint": True}),
    "accum2_fp32": Case(gpt_train, 32, {"micro_batches": 2}),
    "sdpa_flash": Case(sdpa, 8, {"backend": "flash"}),
    "sdpa_efficient": Case(sdpa, 8, {"backend": "efficient"}),
    "convnet": Case(convnet, 64),
    "alloc_expandable": Case(gpt_train, 32, alloc_conf="expandable_segments:True"),
    "alloc_max_split_64": Case(gpt_train, 32, alloc_conf="max_split_size_mb:64"),
    "alloc_roundup4": Case(gpt_train, 32, alloc_conf="roundup_power2_divisions:4"),
    "alloc_gc0.6_fraction": Case(gpt_train, 32, alloc_conf="garbage_collection_threshold:0.6",
                                 memory_fraction=0.25,
                                 note="fraction 0.25 of the GPU: the collector frees cached blocks "
                                      "once reserved passes 60% of that"),
    "oom_fraction": Case(gpt_train, 32, memory_fraction=0.08, expect_oom=True,
                         note="a real OOM: the step needs more than 8% of the GPU"),
    "two_streams": Case(two_streams, 4096),
    "empty_cache_midway": Case(empty_cache_midway, 8),
    "gpt_fp32_fused_adamw": Case(gpt_train, 32, {"optimizer": "fused"}),
    "gpt_fp32_per_parameter_adamw": Case(gpt_train, 32, {"optimizer": "per_parameter"}),
    "gpt_bf16_weights": Case(gpt_train, 32, {"weights_bf16": True}),
    "gpt_host_built_pinned_batches": Case(gpt_train, 32, {"host": True},
                                          note="model built on the host and moved; pinned batch copied each step"),
    "gpt_phase_readings": Case(gpt_phase_readings, 32,
                               note="the script's own torch.cuda readings per phase (json 'readings')"),
    "hf_trainer": Case(hf_trainer, 8, steps=1,
                       note="transformers Trainer.train(), unmodified, 3 optimizer steps"),
    "hf_generate_512": Case(hf_generate, 8, {"seq_len": 512}),
    "hf_generate_4096": Case(hf_generate, 8, {"seq_len": 4096}),
}


def cuda_graph(batch_size: int, warmup: int = 3) -> Callable[[], None]:
    """An MLP's forward captured once in a CUDA graph (after ``warmup`` runs on a side stream,
    as PyTorch's documentation does it), then replayed each step with a new input copied into
    the static one; ``empty_cache()`` after each step: the graph's private pool stays."""
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(DEVICE)
    static_x = torch.randn(batch_size, 1024, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(warmup):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = model(static_x)

    def step() -> None:
        static_x.copy_(torch.randn(batch_size, 1024, device=DEVICE))
        graph.replay()
        static_y.sum().item()
        torch.cuda.empty_cache()
    return step


def prefetch_stream(batch_size: int, batches: int = 8) -> Callable[[], None]:
    """A training loop's batch prefetcher: pinned host batches copied on a side stream, handed
    over with ``record_stream``, one ``loss.item()`` per step (the estimate's range: how long a
    batch waits is the GPU's timing)."""
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    host = [torch.randn(batch_size, 1024).pin_memory() for _ in range(batches)]
    side = torch.cuda.Stream()

    def step() -> None:
        for x in host:
            with torch.cuda.stream(side):
                batch = x.to(DEVICE, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
            batch.record_stream(torch.cuda.current_stream())
            loss = model(batch).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del batch
        loss.item()
    return step


#: Cases written for the next GPU session, not recorded yet (``record_gpu_reference.py
#: --cases cuda_graph,prefetch_stream`` records them; with their data they move to CASES).
PENDING: dict[str, Case] = {
    "cuda_graph": Case(cuda_graph, 256, note="a CUDA graph's private pool kept through empty_cache"),
    "prefetch_stream": Case(prefetch_stream, 4096,
                            note="record_stream prefetching: the estimate gives a range"),
}


DATA = Path(__file__).resolve().parent / "data" / "gpu"


def recorded(name: str) -> dict[str, Any]:
    """The JSON record of case ``name`` in ``tests/data/gpu``; a missing or truncated file is an
    error that names it.

    Example:
        >>> recorded("convnet")["batch_size"]
        64
    """
    path = DATA / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"reference file {path} is missing: record it with "
                                "scripts/record_gpu_reference.py on a GPU") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"reference file {path} is not valid JSON (truncated?): {e}") from None


def recorded_gpu(name: str) -> Any:
    """The GPU case ``name`` was recorded on, as an estimate target: its name, memory and
    compute capability (a case's memory fraction is the program's own call: :func:`estimate_case`).

    Example:
        >>> g = recorded_gpu("oom_fraction")
        >>> g.name, g.total_bytes == recorded("oom_fraction")["versions"]["total_memory"]
        ('NVIDIA H100 80GB HBM3', True)
    """
    from torchmem.fit import GPU

    v = recorded(name)["versions"]
    return GPU(v["gpu"], v["total_memory"], tuple(v["capability"]), "tests/data/gpu (recorded)",
               multiprocessors=v.get("multiprocessors"))


def estimate_case(name: str) -> Any:
    """``torchmem.estimate`` of case ``name`` with its recorded batch, steps and allocator
    settings on its recorded GPU, no margin.

    Example:
        >>> e = estimate_case("sdpa_flash")
        >>> e.peak_allocated_bytes == recorded("sdpa_flash")["stats"]["allocated_bytes.all.peak"]
        True
    """
    import torchmem

    c = CASES[name]
    rec = recorded(name)
    if c.build is hf_generate:
        return torchmem.estimate_hf(HF_LLAMA, task="generate", gpu=recorded_gpu(name),
                                    batch_size=rec["batch_size"], dtype="bfloat16", attn="sdpa",
                                    steps=rec["steps"], margin=0, **c.params)
    def build(bs: int) -> Callable[[], None]:
        if c.memory_fraction is not None:  # as scripts/record_gpu_reference.py ran it
            import torch

            torch.cuda.set_per_process_memory_fraction(c.memory_fraction)
        return c.build(bs, **c.params)

    return torchmem.estimate(build, gpu=recorded_gpu(name), batch_size=rec["batch_size"],
                             alloc_conf=c.alloc_conf or None, steps=rec["steps"], margin=0)


def false_fits(est: Any, card: Any, real_reserved: int, real_oom: bool) -> str | None:
    """Why the estimate ``est`` (made with ``margin=0``) would mislead on a real run whose peak
    reserved was ``real_reserved`` bytes and which did (``real_oom``) or did not run out of
    memory on ``card``: its verdict with the default margin says "fits" for a run that ran out
    of memory, or its peak is below the real one by more than that margin (the margin would not
    cover the gap). ``None`` when neither. The rule of issue 43: never a false "fits".

    Example:
        >>> from torchmem.fit import GPU, Estimate
        >>> card = GPU("x", 10 << 30, (9, 0), "test", context_override=0)
        >>> e = Estimate("x", 1, True, capacity_bytes=card.usable_bytes, overhead_bytes=0,
        ...              peak_requested_bytes=0, peak_allocated_bytes=0,
        ...              peak_reserved_bytes=4 << 30)
        >>> false_fits(e, card, 4 << 30, real_oom=False) is None
        True
        >>> false_fits(e, card, 5 << 30, real_oom=False)
        'peak reserved 4,294,967,296 B is 1,073,741,824 B below the real 5,368,709,120 B, more than the margin (42,949,673 B)'
        >>> false_fits(e, card, 4 << 30, real_oom=True)
        'says fits (headroom 6,442,450,944 B, margin 42,949,673 B) for a run that ran out of memory'
    """
    from torchmem.fit.verdict._margin import margin_for

    margin = margin_for(None, card, est.peak_reserved_bytes)
    says_fits = est.oom is None and est.headroom_bytes >= margin
    if says_fits and real_oom:
        return (f"says fits (headroom {est.headroom_bytes:,} B, margin {margin:,} B) for a run "
                "that ran out of memory")
    gap = real_reserved - est.peak_reserved_bytes
    if not real_oom and gap > margin:
        return (f"peak reserved {est.peak_reserved_bytes:,} B is {gap:,} B below the real "
                f"{real_reserved:,} B, more than the margin ({margin:,} B)")
    return None


def case_false_fits(name: str, est: Any) -> str | None:
    """:func:`false_fits` of case ``name``'s estimate against its recorded run.

    Example:
        >>> case_false_fits("sdpa_flash", estimate_case("sdpa_flash")) is None
        True
    """
    rec = recorded(name)
    return false_fits(est, recorded_gpu(name), rec["stats"]["reserved_bytes.all.peak"],
                      rec["oom"] is not None)


def make(name: str) -> Callable[[], None]:
    """Build case ``name`` on ``"cuda"`` (or under :func:`torchmem.estimate`'s fake GPU).

    Example:
        >>> make("no such case")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        KeyError: "no case 'no such case'; the cases are: accum2_fp32, alloc_expandable, ..."
    """
    if name not in CASES:
        raise KeyError(f"no case {name!r}; the cases are: {', '.join(sorted(CASES))}")
    c = CASES[name]
    return c.build(c.batch_size, **c.params)
