"""What would make it fit: the memory levers tried on the user's own step (``--what-if``).

:func:`what_if` estimates the step as written, then once per lever, each applied by torchmem to
the user's own model and optimizer as they are made (:mod:`torchmem.fit.levers._levers`; no code
changes), and returns one :class:`WhatIfRow` per lever, sorted by peak reserved bytes, plus the
cheapest combination that fits, found greedily (:func:`best_combination`).

The levers (:data:`LEVERS`), each equal to the same change written by hand:

==========================  ===============================================================
``activation_checkpointing``  each repeated block (children of a ``ModuleList``/``Sequential``
                              of one class) under non-reentrant ``checkpoint``
``grad_accumulation_2``/``4`` the batch as 2 (4) micro-batches, one optimizer step after them
``bf16_autocast``             the model's calls under ``torch.autocast("cuda", bfloat16)``
                              (``fp16_autocast`` instead on GPUs without bf16: compute
                              capability below 8.0, with ``torch.amp.GradScaler("cuda")``:
                              ``scaler.scale(loss).backward()``, ``scaler.step(opt)``,
                              ``scaler.update()``)
``bf16_weights``              the model's weights (and so gradients and optimizer state) in
                              bfloat16, its floating-point inputs cast to it
``optimizer_fused``           the same optimizer with ``fused=True``
``optimizer_foreach``         ``foreach=True``
``optimizer_per_parameter``   ``foreach=False, fused=False``
``optimizer_8bit``            bitsandbytes' 8-bit Adam (:class:`~torchmem.fit.Adam8bitStandIn`:
                              what it allocates; its CUDA kernels cannot run in an estimate)
``adafactor``                 ``torch.optim.Adafactor`` (factored second moments)
``fsdp_2``/``4``/``8``        FSDP2 ``fully_shard`` of each block and the model, per rank of
                              2/4/8 GPUs (PyTorch's fake process group)
``cpu_offload``               FSDP2 on one GPU with ``CPUOffloadPolicy``: parameters, gradients
                              and optimizer state on the host, each block gathered in turn
``cpu_offload_optimizer``     ZeRO-Offload's optimizer written out (the scheme of DeepSpeed
                              and torchao's ``CPUOffloadOptimizer``, not their code; torchao
                              keeps tensors under 4096 elements on the GPU and copies
                              gradients during backward): the optimizer made on
                              pinned host copies of the parameters (each with a pinned host
                              gradient); its ``step()`` copies the GPU gradients to the host,
                              steps there and copies the parameters back; ``zero_grad()``
                              drops the GPU gradients
``lora``                      peft's ``get_peft_model`` with ``LoraConfig(r=8,
                              lora_alpha=16, lora_dropout=0.0)`` on the model's attention
                              projections (``q_proj``/``k_proj``/``v_proj``/``o_proj``,
                              ``query``/``key``/``value``, ``c_attn``, ...), the optimizer
                              given the trainable (adapter) parameters
``allocator``                 the best ``PYTORCH_CUDA_ALLOC_CONF`` of ``--suggest``
==========================  ===============================================================

``lora`` is listed as not available when peft is missing, and when the model has no
attention projections (``Linear`` layers inside a module named ``attn``/``attention``); it
combines with every lever but the sharding ones (FSDP, CPU offload).
``cpu_offload_optimizer`` does not combine with the sharding levers (FSDP's parameters are
DTensors; ``cpu_offload`` already keeps the state on the host), with the other optimizer
levers (fused/foreach pick GPU kernels; another optimizer would be offloaded instead of the
user's) or with ``fp16_autocast`` (its scaler would unscale the host gradients, an order
torchmem does not guess).
A lever the step cannot take is listed with the reason (``skipped``), never hidden.

Costs (``WhatIfRow.cost``): ``recompute_flops_share`` (extra floating-point operations over
the step's own, ``torch.utils.flop_counter``'s formulas), ``micro_batches`` (forward and
backward passes per optimizer step), ``communication_bytes_per_step`` (per rank: FSDP's
all-gathers in forward and backward and its gradient reduce-scatter, 3 x (N-1)/N of the
parameters' bytes), ``host_peak_bytes``, ``host_transfer_bytes_per_step``
(``cpu_offload_optimizer``: the gradients to the host and the parameters back), and ``changes`` (what else the lever changes: the
numerics, the optimizer's maths), ``trainable_share`` (``lora``: the share of the model's
parameters that train).

Example:
    >>> [lv.name for lv in LEVERS][:3]
    ['activation_checkpointing', 'grad_accumulation_2', 'grad_accumulation_4']
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchmem.errors import InvalidInputError
from torchmem.fit.levers._choices import _BY_NAME, LEVERS, Lever, _exclusion, check_levers, combine
from torchmem.fit.levers._levers import LeverRun
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._estimate import Estimate

__all__ = ["LEVERS", "Lever", "WhatIfRow", "best_combination", "check_levers", "what_if",
           "what_if_lines", "combine"]


@dataclass
class WhatIfRow:
    """One memory lever tried on the step (a row of ``Estimate.what_if``, or the recommended
    combination ``Estimate.what_if_best``), from ``estimate(..., what_if=True)`` or
    ``torchmem estimate --what-if``.

    ``lever``: its name (``"a + b"`` for a combination; ``"as_written"`` for a best that needs
    no lever); ``applied``: what torchmem changed, in words; the three peaks (bytes) of the step
    with the lever applied; ``fits`` and ``headroom_bytes`` on the estimate's GPU; ``cost``:
    what the saving costs (``changes``, ``recompute_flops_share``, ``micro_batches``,
    ``communication_bytes_per_step``, ``host_peak_bytes``, ``trainable_share``, and with
    ``maximize`` ``max_value``); ``skipped``: why the lever could not be applied (then the
    figures are ``None``); ``estimate``: that run's full :class:`~torchmem.fit.Estimate`.

    Example:
        >>> import torch, torchmem
        >>> def build(batch):
        ...     net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
        ...     opt = torch.optim.AdamW(net.parameters())
        ...     x = torch.randn(batch, 256, device="cuda")
        ...     return lambda: (net(x).sum().backward(), opt.step(), opt.zero_grad())
        >>> e = torchmem.estimate(build, gpu="T4", batch_size=64,
        ...                       what_if=["adafactor", "activation_checkpointing"])
        >>> row = e.what_if[0]
        >>> row.lever, row.applied, row.fits
        ('adafactor', 'AdamW -> torch.optim.Adafactor', True)
        >>> row.peak_reserved_bytes < e.peak_reserved_bytes
        True
        >>> row.to_dict()["lever"], e.what_if_best.lever   # it fits as written
        ('adafactor', 'as_written')
    """

    lever: str
    applied: str
    peak_requested_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    fits: bool | None
    headroom_bytes: int | None
    cost: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    estimate: Estimate | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``estimate`` left out).

        Example:
            >>> sorted(WhatIfRow("x", "", None, None, None, None, None, skipped="why").to_dict())[:3]
            ['applied', 'cost', 'fits']
        """
        d: dict[str, Any] = {
            "lever": self.lever, "applied": self.applied,
            "peak_requested_bytes": self.peak_requested_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fits": self.fits, "headroom_bytes": self.headroom_bytes, "cost": dict(self.cost),
        }
        if self.skipped is not None:
            d["skipped"] = self.skipped
        return d

    def cost_words(self) -> str:
        """The cost in a few words, as the report's table gives it.

        Example:
            >>> WhatIfRow("grad_accumulation_2", "", 1, 2, 3, True, 4,
            ...           {"micro_batches": 2, "host_peak_bytes": 0}).cost_words()
            '2 micro-batches/step'
        """
        return _cost_words(self.cost)


def _row(lever: str, applied: str, e: Estimate, cost: dict[str, Any]) -> WhatIfRow:
    return WhatIfRow(lever, applied, e.peak_requested_bytes, e.peak_allocated_bytes,
                     e.peak_reserved_bytes, e.fits, e.headroom_bytes, cost, estimate=e)


def _skip(lever: str, why: str) -> WhatIfRow:
    return WhatIfRow(lever, "", None, None, None, None, None, skipped=why)


# A function (levers, world_size, alloc_conf, count_flops) -> (Estimate, LeverRun)
RunFn = Callable[[Sequence[Lever], "int | None", "str | None"], "tuple[Estimate, LeverRun]"]


def _lever_run(levers: Sequence[Lever]) -> LeverRun:
    from torchmem.fit.fakegpu._bnb import Adam8bitStandIn

    kw: dict[str, Any] = {"count_flops": True}
    for lv in levers:
        for k, v in lv.settings.items():
            if k == "replace_optimizer":
                v = Adam8bitStandIn if v == "adam8bit" else torch.optim.Adafactor
            kw[k] = v
    return LeverRun(**kw)


def _applied(lv: Lever, lr: LeverRun, base_opts: list[str]) -> str | None:
    """What ``lv`` changed, in words, or ``None`` when it changed nothing (not applicable)."""
    if lv.parts:
        said = [_applied(p, lr, base_opts) for p in lv.parts]
        return None if any(x is None for x in said) else "; ".join(x or "" for x in said)
    s = lv.settings
    if lv.name == "activation_checkpointing":
        if lr.trainer_checkpoints:
            return f"checkpointed {lr.trainer_checkpoints}"
        if not lr.wrapped:
            return None
        return f"checkpointed {len(lr.wrapped)} blocks: {_names(lr.wrapped)}"
    if "accumulate" in s:
        if lr.accumulated_by:
            return f"batch as {s['accumulate']} micro-batches, accumulated {lr.accumulated_by}"
        return f"batch as {s['accumulate']} micro-batches, gradients accumulated"
    if "autocast" in s:
        if lr.trainer_precision:
            return f"mixed precision {lr.trainer_precision}"
        words = (f"autocast to {str(s['autocast']).removeprefix('torch.')} around "
                 f"{_names(sorted(set(lr.roots)))}")
        if lr.scaled:
            words += f"; a GradScaler scales the loss and steps {_names(lr.scaled)}"
        return words
    if "weights_dtype" in s:
        if not lr.converted:
            return None
        return f"{_names(lr.converted)} .to(bfloat16), floating inputs cast"
    if "optimizer" in s:
        if lr.optimizer_refused:
            return None
        kw = ", ".join(f"{k}={v}" for k, v in s["optimizer"].items())
        return f"{_names(base_opts)}({kw})"
    if "replace_optimizer" in s:
        if lr.trainer_optimizer:
            return f"{_names(base_opts)} -> {lr.trainer_optimizer}"
        to = ("torchmem.fit.Adam8bitStandIn (bitsandbytes' Adam8bit)"
              if s["replace_optimizer"] == "adam8bit" else "torch.optim.Adafactor")
        return f"{_names(base_opts)} -> {to}"
    if "lora" in s:
        if not lr.adapted:
            return None
        if lr.lora_by:
            return "; ".join(f"LoRA r={s['lora']} {lr.lora_by} ({n} layers of {cls}): {k:,} of "
                             f"{tot:,} parameters trainable" for cls, _, n, k, tot in lr.adapted)
        return "; ".join(
            f"LoRA r={s['lora']} on {', '.join(t)} ({n} layers) of {cls}: {k:,} of {tot:,} "
            "parameters trainable" for cls, t, n, k, tot in lr.adapted)
    if "offload_optimizer" in s:
        if not lr.offloaded:
            return None
        from torchmem.units import format_bytes

        return "; ".join(
            f"{cls} on pinned host copies of {n} parameters ({format_bytes(b)}): gradients "
            "copied to the host after backward, the step on the host, parameters copied back"
            for cls, n, b in lr.offloaded)
    if "fsdp" in s:
        if lr.trainer_shards:
            gpus = "1 GPU" if s["fsdp"] == "offload" else f"{lv.world_size} GPUs"
            return f"sharded over {gpus} {lr.trainer_shards}"
        if not lr.sharded:
            return None
        how = ("fully_shard(offload_policy=CPUOffloadPolicy()) on 1 GPU"
               if s["fsdp"] == "offload" else f"fully_shard over {lv.world_size} GPUs")
        return f"{how}: {_names(lr.sharded)}"
    return None


def _names(xs: Sequence[str], n: int = 3) -> str:
    xs = list(xs)
    return ", ".join(xs[:n]) + (f" (+{len(xs) - n} more)" if len(xs) > n else "")


def what_if(
    run: Callable[..., tuple[Estimate, LeverRun]],
    base: Estimate,
    base_lr: LeverRun,
    card: GPU,
    levers: Sequence[Lever],
    batch_size: int,
    progress: Callable[[str], None] | None = None,
    suggest: Callable[[Estimate], str | None] | None = None,
    workers: int | None = 1,
    script: bool | str = False,
    site: Callable[[], Any] | None = None,
    on_site: Callable[[Any], tuple[Estimate, LeverRun]] | None = None,
) -> tuple[list[WhatIfRow], WhatIfRow | None]:
    """Try each of ``levers`` with ``run(levers, world_size=, alloc_conf=)`` (one estimate of
    the user's step with those levers applied; ``base`` and ``base_lr`` are the step as
    written) and find the cheapest combination that fits; returns the rows sorted by peak
    reserved bytes (skipped levers last) and the recommended combination (``None`` when
    nothing tried fits; a row named ``as_written`` when the step fits without a lever). The
    levers run in ``workers`` forked processes (:mod:`torchmem.fit.levers._pool`; ``None``: one per
    core). ``site``, when given, is one more job for the pool (the step as written rerun on
    the card to find where it runs out of memory); ``on_site(result)`` gives the final
    ``base`` and ``base_lr`` from its result (``base`` is provisional until then).

    Example:
        >>> from torchmem.fit.run._engine import run_once
        >>> def build(batch):
        ...     net = torch.nn.Linear(64, 64).cuda()
        ...     opt = torch.optim.AdamW(net.parameters())
        ...     x = torch.randn(batch, 64, device="cuda")
        ...     return lambda: (net(x).sum().backward(), opt.step(), opt.zero_grad())
        >>> def run(levers, world_size=None, alloc_conf=None):
        ...     lr = _lever_run(levers)
        ...     return run_once(build, 8, "T4", levers=lr, world_size=world_size), lr
        >>> base, lr = run([])
        >>> from torchmem.fit import gpu
        >>> rows, best = what_if(run, base, lr, gpu("T4"), check_levers(["adafactor"]), 8)
        >>> rows[0].lever, rows[0].applied
        ('adafactor', 'AdamW -> torch.optim.Adafactor')
    """
    say = progress or (lambda m: None)
    base_opts = list(dict.fromkeys(base_lr.optimizers))
    base_flops = base_lr.flops
    param_bytes = base.by_category.get("parameter", 0)
    rows: list[WhatIfRow | None] = []
    bf16_ok = card.compute_capability >= (8, 0)
    jobs: list[tuple[int, Lever]] = []
    for lv in levers:
        why = _not_for_scripts(lv, script if isinstance(script, str) else None) \
            if script is not False else None
        if why is None:
            why = _not_applicable(lv, base, base_opts,
                                  None if script == TRAINER_BATCH else batch_size, bf16_ok)
        if why is not None:
            rows.append(_skip(lv.name, why))
        else:  # the allocator's replays run beside the levers' estimates, in the pool too
            jobs.append((len(rows), lv))
            rows.append(None)
    # the longest runs first: each worker takes the next job when it is free, so a long run
    # started last would leave the other workers idle at the end (longest-first scheduling)
    jobs.sort(key=lambda job: -_relative_time(job[1]))
    n_levers = len(jobs)
    if site is not None:  # a run of the step as written: about a lever's time
        jobs.insert(next((k for k, j in enumerate(jobs) if _relative_time(j[1]) <= 1.0),
                         len(jobs)), (-1, _SITE))
    count = [0]

    def done(i: int, result: Any) -> None:
        count[0] += 1
        what = jobs[i][1].name if jobs[i][1] is not _SITE else "the step as written on the card"
        say(f"what-if {count[0]}/{len(jobs)}: {what} done")

    from torchmem.fit.levers._pool import WorkerLost, run_all

    say(f"what-if: {n_levers} levers to run"
        + (", and the step as written on the card (where it runs out of memory)"
           if site is not None else "") + " ...")

    def one(job: tuple[int, Lever]) -> Any:
        if job[1] is _SITE:
            assert site is not None
            return site()
        if job[1].name == "allocator":
            return _allocator_row(run, base, suggest)
        return run([job[1]], world_size=job[1].world_size)

    # the step as written ran in this process, with its output shown; the reruns are quiet
    # (with TORCHMEM_DEBUG set, their output and tracebacks are shown too)
    from torchmem._log import debug_requested

    results = run_all(one, jobs, workers, done,
                      quiet=script is not False and not debug_requested())
    if site is not None:
        k = next(k for k, j in enumerate(jobs) if j[1] is _SITE)
        res = results[k]
        if isinstance(res, BaseException):
            raise res
        assert on_site is not None
        base, base_lr = on_site(res)
        del jobs[k], results[k]
        alloc = [j for j, (_, lv) in enumerate(jobs) if lv.name == "allocator"]
        if base.fits and alloc:
            # the card's own run fits (its cache freed and retried; the provisional base did
            # not fit): the allocator's replays start from that run's snapshot instead
            results[alloc[0]] = _allocator_row(run, base, suggest)
    for (at, lv), res in zip(jobs, results):
        if isinstance(res, WhatIfRow):  # the allocator's
            rows[at] = res
            continue
        if isinstance(res, InvalidInputError):
            why = _DEBUG_HINT.sub("", str(res).splitlines()[0])  # said once under the table
            rows[at] = _skip(lv.name, f"{_FAILED}{why}")
            continue
        if isinstance(res, WorkerLost):  # a crash in native code: the other rows stand
            rows[at] = _skip(lv.name, f"failed: {res}")
            continue
        if isinstance(res, BaseException):
            raise res
        e, lr = res
        applied = _applied(lv, lr, base_opts)
        if applied is not None and lv.name in _ALREADY and _peaks(e) == _peaks(base):
            rows[at] = _skip(lv.name, f"no change: {applied}, and its peaks equal the step "
                             f"as written's to the byte{_ALREADY.get(lv.name, '')}")
            continue
        if (applied is not None and lv.name == "activation_checkpointing"
                and _peaks(e)[:3] == _peaks(base)[:3]):  # TRL's SFTConfig checkpoints already
            rows[at] = _skip(lv.name, f"no change: {applied}, and its GPU peaks equal the step "
                             "as written's to the byte (the step checkpoints them already, or "
                             "its peaks are outside their forward and backward)")
            continue
        if (applied is not None and "optimizer" in lv.settings and lr.optimizer_already
                and len(lr.optimizer_already) == len(lr.optimizers)
                and _peaks(e)[:3] == _peaks(base)[:3]):  # nanoGPT's AdamW(fused=True) and fused
            # (the GPU's peaks: the kernels run there; the host peak of a run in a forked
            # worker can miss what a library makes once per process, 144 bytes for a Trainer)
            rows[at] = _skip(lv.name, f"no change: the step already makes "
                             f"{_names(lr.optimizer_already)}, and its GPU peaks equal the step "
                             "as written's to the byte")
            continue
        rows[at] = (_skip(lv.name, _why_unchanged(lv, lr)) if applied is None
                    else _row(lv.name, applied, e, _cost(lv, e, lr, base_flops, param_bytes)))
    done_rows: list[WhatIfRow] = [r for r in rows if r is not None]
    done_rows.sort(key=lambda r: (r.peak_reserved_bytes is None, r.peak_reserved_bytes or 0))
    rows_out = done_rows
    if base.fits:  # nothing needed: the cheapest combination is none
        return rows_out, _row("as_written", "nothing: the step fits as written", base,
                          {"changes": "none", "micro_batches": 1,
                           "communication_bytes_per_step": 0,
                           "host_peak_bytes": base.host_peak_bytes})
    best = best_combination(run, base, rows_out, say)
    return rows_out, best


#: The pool job that reruns the step as written on the card (see :func:`what_if`'s ``site``).
_SITE = Lever("as_written_on_card", {}, 0, "none", changes="none: the step as written, on the card")


def _relative_time(lv: Lever) -> float:
    """About how long ``lv``'s estimate takes against the step as written's (the forward and
    backward passes it adds), to start the longest first: accumulation runs each pass k
    times; a per-rank run adds the collectives and DTensor bookkeeping; checkpointing runs
    each block's forward again; LoRA adds adapter layers; the allocator replays the step's
    snapshot before its run (measured on the 7B Llama of benchmarks/bench_whatif_levers.py).

    Example:
        >>> [_relative_time(_BY_NAME[n]) for n in ("grad_accumulation_4", "fsdp_2", "adafactor")]
        [4.0, 1.8, 1.0]
    """
    t = 1.0
    for one in lv.singles:
        s = one.settings
        t *= (float(s.get("accumulate", 1)) * (1.8 if s.get("fsdp") else 1.0)
              * (1.4 if s.get("checkpoint") else 1.0) * (1.5 if s.get("lora") else 1.0)
              * (1.3 if one.name == "allocator" else 1.0))
    return t


#: the precision levers, and why one can leave every peak as it was: what the step already
#: does (its row then says "no change" instead of looking like a lever to take)
_ALREADY = {
    "fp16_autocast": " (the step already computes in float16 where autocast would)",
    "bf16_autocast": " (the step already computes in bfloat16 where autocast would)",
    "bf16_weights": " (its weights are already bfloat16)",
}


def _peaks(e: Estimate) -> tuple[int, int, int, int]:
    return (e.peak_requested_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes,
            e.host_peak_bytes)


def _not_applicable(lv: Lever, base: Estimate, opts: list[str], batch: int | None,
                    bf16_ok: bool) -> str | None:
    if lv.parts:
        for p in lv.parts:
            why = _not_applicable(p, base, opts, batch, bf16_ok)
            if why is not None:
                return f"{p.name}: {why}"
        return None
    name = lv.name
    if name == "lora":
        if importlib.util.find_spec("peft") is None:
            return "peft is not installed (pip install peft)"
        if not opts:
            return "the step makes no optimizer (LoRA adapters are added when it is made)"
    if name == "bf16_autocast" and not bf16_ok:
        return f"the {base.gpu} has no bfloat16 (compute capability below 8.0): fp16_autocast"
    if name == "fp16_autocast" and bf16_ok:
        return "bf16_autocast is the one tried on a GPU with bfloat16"
    if name == "bf16_weights" and not bf16_ok:
        return f"the {base.gpu} has no bfloat16 (compute capability below 8.0)"
    if "accumulate" in lv.settings:
        k = lv.settings["accumulate"]
        if not opts:
            return "the step makes no optimizer (nothing to accumulate for)"
        if batch is not None and batch % k:
            return f"batch {batch} is not a multiple of {k}"
    if ("optimizer" in lv.settings or "replace_optimizer" in lv.settings
            or "offload_optimizer" in lv.settings) and not opts:
        return "the step makes no torch.optim optimizer"
    if "fsdp" in lv.settings:
        if base.world_size is not None:
            return f"the step already runs as rank 0 of {base.world_size}"
        if not opts:
            return "the step makes no optimizer (FSDP is applied when it is made)"
    return None


#: the batch option of a script whose batch is set in code for a transformers ``Trainer``: the
#: accumulation levers divide the Trainer's own per_device_train_batch_size where it is made
#: (its value is known there, so no multiple is checked before)
TRAINER_BATCH = "the Trainer's per_device_train_batch_size (set in the script)"


def _not_for_scripts(lv: Lever, batch_option: str | None) -> str | None:
    for p in lv.singles:
        if "accumulate" in p.settings and batch_option is None:
            return ("no batch option in the script's arguments or defaults: give one (e.g. "
                    "--batch-size 16; a Trainer's --per_device_train_batch_size 16)")
    return None


def _why_unchanged(lv: Lever, lr: LeverRun) -> str:
    for p in lv.parts:
        if _applied(p, lr, []) is None:
            return f"{p.name}: {_why_unchanged(p, lr)}"
    if lv.name == "activation_checkpointing":
        return ("no repeated blocks (a ModuleList or Sequential of two or more modules of one "
                f"class) in {_names(sorted(set(lr.roots))) or 'the model'}")
    if lv.name == "bf16_weights":
        return "no module with floating-point weights was called"
    if lv.name == "lora":
        return "; ".join(lr.lora_refused) or "no model held the optimizer's parameters"
    if lv.name == "cpu_offload_optimizer":
        return "the optimizer was given no parameters that train"
    if lr.optimizer_refused:
        return "; ".join(lr.optimizer_refused)
    return "the lever found nothing to change in this step"


def _cost(lv: Lever, e: Estimate, lr: LeverRun, base_flops: int,
          param_bytes: int) -> dict[str, Any]:
    cost: dict[str, Any] = {"changes": lv.changes}
    if base_flops:
        cost["recompute_flops_share"] = round(max(0, lr.flops - base_flops) / base_flops, 4)
    cost["micro_batches"] = int(lv.settings.get("accumulate", 1))
    n = lv.world_size or 1
    cost["communication_bytes_per_step"] = (
        3 * param_bytes * (n - 1) // n if lv.settings.get("fsdp") is True else 0)
    cost["host_peak_bytes"] = e.host_peak_bytes
    if lr.offloaded:  # each step: the gradients to the host, the parameters back
        cost["host_transfer_bytes_per_step"] = 2 * sum(b for _, _, b in lr.offloaded)
    if lr.adapted:
        cost["trainable_share"] = _trainable_share(lr)
    return cost


def _trainable_share(lr: LeverRun) -> float:
    return round(sum(a[3] for a in lr.adapted) / max(1, sum(a[4] for a in lr.adapted)), 6)


def _allocator_row(run: Callable[..., tuple[Estimate, LeverRun]], base: Estimate,
                   suggest: Callable[[Estimate], str | None] | None) -> WhatIfRow:
    conf = suggest(base) if suggest is not None else None
    if conf is None:
        return _skip("allocator", "no PYTORCH_CUDA_ALLOC_CONF setting of --suggest lowers the "
                     "peak reserved memory of this step")
    e, _ = run([], alloc_conf=conf)
    return _row("allocator", f"PYTORCH_CUDA_ALLOC_CONF={conf}", e,
                {"changes": "none (allocator settings)", "micro_batches": 1,
                 "communication_bytes_per_step": 0, "host_peak_bytes": e.host_peak_bytes,
                 "alloc_conf": conf})


def best_combination(
    run: Callable[..., tuple[Estimate, LeverRun]],
    base: Estimate,
    rows: Sequence[WhatIfRow],
    say: Callable[[str], None] = lambda m: None,
    rounds: int = 3,
    tries: int = 4,
) -> WhatIfRow | None:
    """The cheapest combination of the rows' levers that fits, found greedily: the cheapest
    single lever that fits (by cost tier, then peak reserved); else, the lever saving the most
    is kept and each compatible lever is tried on top of it, cheapest first (``tries`` a
    round), for up to ``rounds`` levers. ``None`` when nothing found fits.

    Example:
        >>> best_combination(None, None, [WhatIfRow("adafactor", "x", 1, 2, 3, True, 9)]).lever
        'adafactor'
    """
    done = [r for r in rows if r.skipped is None and r.peak_reserved_bytes is not None]

    def levers_of(r: WhatIfRow) -> list[Lever]:
        return [_BY_NAME[n] for n in r.lever.split(" + ")]

    def key(r: WhatIfRow) -> tuple[int, int]:
        return (max(lv.tier for lv in levers_of(r)), r.peak_reserved_bytes or 0)

    fitting = sorted((r for r in done if r.fits), key=key)
    if fitting:
        return fitting[0]
    if not done:
        return None
    current = min(done, key=lambda r: r.peak_reserved_bytes or 0)
    chosen = levers_of(current)
    conf = current.cost.get("alloc_conf")
    for _ in range(rounds - 1):
        groups = {lv.group for lv in chosen}
        cands = sorted((r for r in done if r.lever in _BY_NAME
                        and _BY_NAME[r.lever].group not in groups
                        and not any(_exclusion(c, _BY_NAME[r.lever]) for c in chosen)
                        and not (_BY_NAME[r.lever].world_size and any(
                            lv.world_size for lv in chosen))
                        and not (r.lever == "allocator" and conf)), key=key)[:tries]
        if not cands:
            break
        tried: list[WhatIfRow] = []
        for r in cands:
            combo = [*chosen, _BY_NAME[r.lever]]
            name = " + ".join(lv.name for lv in combo)
            say(f"what-if best: {name} ...")
            ws = next((lv.world_size for lv in combo if lv.world_size), None)
            this_conf = conf or r.cost.get("alloc_conf")
            try:
                e, lr = run([lv for lv in combo if lv.name != "allocator"], world_size=ws,
                            alloc_conf=this_conf)
            except InvalidInputError:
                continue
            applied = "; ".join(x.applied for x in [current, r])
            row = _row(name, applied, e, {"changes": "; ".join(lv.changes for lv in combo),
                                          "micro_batches": max(
                                              int(lv.settings.get("accumulate", 1))
                                              for lv in combo),
                                          "host_peak_bytes": e.host_peak_bytes})
            if this_conf:
                row.cost["alloc_conf"] = this_conf
            if lr.adapted:
                row.cost["trainable_share"] = _trainable_share(lr)
            if e.fits:
                return row
            tried.append(row)
        if not tried:
            break
        current = min(tried, key=lambda r: r.peak_reserved_bytes or 0)
        chosen = levers_of(current)
        conf = current.cost.get("alloc_conf")
    return None


#: How a lever's row begins when the step failed with it.
_FAILED = "the step failed with it: "
#: The estimator's pointer to TORCHMEM_DEBUG at the end of a step's error: dropped from each
#: row, said once under the table.
_DEBUG_HINT = re.compile(r"\s*\(torchmem runs it under fake tensors; set TORCHMEM_DEBUG=1 for "
                         r"the full traceback\)")


def what_if_lines(rows: Sequence[WhatIfRow], best: WhatIfRow | None, base: Estimate) -> list[str]:
    """The report's what-if table: one line per lever (sorted by peak reserved), the skipped
    ones with their reasons, then the recommended combination.

    Example:
        >>> from torchmem.fit import Estimate
        >>> base = Estimate("T4", 8, False, 100, 10, 50, 60, 95)
        >>> rows = [WhatIfRow("adafactor", "AdamW -> Adafactor", 40, 50, 70, True, 20,
        ...                   {"host_peak_bytes": 8})]
        >>> print("\\n".join(what_if_lines(rows, rows[0], base)))
        what if (each lever alone, sorted by peak reserved; as written: 95 B reserved, DOES NOT FIT)
          lever                     peak reserved  peak allocated  fits  headroom  cost
          adafactor                          70 B            50 B  yes       20 B  host 8 B
        best: adafactor (fits, headroom 20 B): AdamW -> Adafactor
    """
    from torchmem.units import format_bytes as fb

    verdict = "FITS" if base.fits else "DOES NOT FIT"
    w = max([25, *(len(r.lever) for r in rows if r.skipped is None)])
    out = [f"what if (each lever alone, sorted by peak reserved; as written: "
           f"{fb(base.peak_reserved_bytes)} reserved, {verdict})",
           f"  {'lever':<{w}} {'peak reserved':>13} {'peak allocated':>15}  fits  "
           f"{'headroom':>8}  cost"]
    for r in rows:
        if r.skipped is not None:
            continue
        fits = "yes" if r.fits else "no"
        out.append(f"  {r.lever:<{w}} {fb(r.peak_reserved_bytes or 0):>13} "
                   f"{fb(r.peak_allocated_bytes or 0):>15}  {fits:<4}  "
                   f"{fb(r.headroom_bytes or 0):>8}  {_cost_words(r.cost)}".rstrip())
    skipped = [r for r in rows if r.skipped is not None]
    if skipped:
        out.append("  not applied:")
        out.extend(f"    {r.lever}: {r.skipped}" for r in skipped)
        if any(r.skipped and r.skipped.startswith(_FAILED) for r in skipped):
            out.append("    (the levers ran under fake tensors; set TORCHMEM_DEBUG=1 for a failed "
                       "one's full traceback)")
    if best is None:
        out.append("best: nothing tried fits (try a larger GPU or more GPUs)")
    elif best.lever == "as_written":
        out.append("best: as written (it fits; no lever needed)")
    else:
        out.append(f"best: {best.lever} (fits, headroom {fb(best.headroom_bytes or 0)}): "
                   f"{best.applied}")
    return out


def _cost_words(cost: Mapping[str, Any]) -> str:
    from torchmem.units import format_bytes as fb

    bits = []
    share = cost.get("recompute_flops_share")
    if share and share >= 0.005:
        bits.append(f"+{share:.0%} FLOPs")
    if cost.get("micro_batches", 1) > 1:
        bits.append(f"{cost['micro_batches']} micro-batches/step")
    if cost.get("communication_bytes_per_step"):
        bits.append(f"{fb(cost['communication_bytes_per_step'])} comm/step")
    if cost.get("host_peak_bytes"):
        bits.append(f"host {fb(cost['host_peak_bytes'])}")
    if cost.get("host_transfer_bytes_per_step"):
        bits.append(f"{fb(cost['host_transfer_bytes_per_step'])} GPU<->host/step")
    if cost.get("trainable_share") is not None:
        bits.append(f"trains {cost['trainable_share']:.2%} of the parameters")
    if cost.get("maximized"):
        label = "batch" if cost["maximized"] == "batch_size" else cost["maximized"]
        bits.append(f"largest {label} {cost['max_value']}")
    if not bits:
        bits.append(str(cost.get("changes", "")))
    return ", ".join(bits)
