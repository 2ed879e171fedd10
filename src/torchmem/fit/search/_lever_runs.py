"""The levers tried on a build function's step: each lever is one more fake run of the step
(:func:`what_if_runs`, in forked workers), and ``--max`` searched again under the best levers
(:func:`_lever_max`); the table itself is :mod:`torchmem.fit.levers._whatif`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchmem.fit.run._engine import BuildFn, run_once
from torchmem.fit.search._bracket import _search
from torchmem.fit.search._checks import _apply_margin, _check_range
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._estimate import Estimate
from torchmem.fit.verdict._margin import MarginSpec, margin_for
from torchmem.units import format_bytes


def _what_if(build: BuildFn, card: GPU, batch: int, kw: dict[str, Any], levers: list[Any],
             maximize: str | None, margin: MarginSpec, progress: Callable[[str], None] | None,
             opts: dict[str, Any], keep_snapshot: bool,
             search_range: tuple[int, ...] | None) -> Estimate:
    """``estimate(..., what_if=...)``: the step as written, then each lever (see
    :mod:`torchmem.fit.levers._whatif`)."""

    def one(on: GPU, lr: Any, b: int | None, extra: Mapping[str, Any] | None, snap: bool,
            stacks: bool, world_size: int | None, alloc_conf: str | None) -> Estimate:
        o = dict(opts)
        if world_size is not None:
            o["world_size"] = world_size
        if alloc_conf is not None:
            o["alloc_conf"] = alloc_conf
        return run_once(build, batch if b is None else b, on, keep_snapshot=snap,
                        params={**kw, **(extra or {})}, levers=lr, stacks=stacks, lower=False,
                        **o)

    return what_if_runs(one, card, batch, levers, maximize, margin, progress, keep_snapshot,
                        search_range)


def what_if_runs(one: Callable[..., Estimate], card: GPU, batch: int, levers: list[Any],
                 maximize: str | None, margin: MarginSpec,
                 progress: Callable[[str], None] | None, keep_snapshot: bool,
                 search_range: tuple[int, ...] | None, script: bool | str = False,
                 start: int | None = None) -> Estimate:
    """The what-if of a step that ``one(card, lever_run, batch, extra_params, keep_snapshot,
    stacks, world_size, alloc_conf)`` estimates once (a build function's, or a script's with
    ``script=True``, or the flag of the script's batch option, which accumulation divides):
    the step as written (returned, with ``what_if`` and ``what_if_best``
    set), each lever, the best combination, the largest value with ``maximize``."""
    from torchmem.fit.levers._whatif import _lever_run, what_if

    # Each run is made on the card with unbounded memory first (the peaks the step needs, not
    # those at an out-of-memory point); a run whose peak reserved passes the card's usable
    # memory is made again on the card itself, which decides (the allocator frees its cache
    # and retries before it runs out): the same run where it never reached the limit.
    big = dataclasses.replace(card, total_bytes=card.total_bytes + (1 << 50),
                              context_override=card.context_bytes)

    def once(chosen: Sequence[Any], on: GPU, stacks: bool, world_size: int | None = None,
             alloc_conf: str | None = None, snap: bool = False, b: int | None = None,
             extra: Mapping[str, Any] | None = None) -> tuple[Estimate, Any]:
        lr = _lever_run(chosen)
        with warnings.catch_warnings():  # FSDP2 on a user's model may warn of views
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            e = one(on, lr, b, extra, snap, stacks, world_size, alloc_conf)
        return e, lr

    def settle(e: Estimate, lr: Any, real: tuple[Estimate, Any] | None) -> tuple[Estimate, Any]:
        # ``e``: a run on the unbounded card; ``real``: the same run on the card, made where
        # ``e``'s blocks passed the usable memory (the card decides; None: not made)
        if real is not None:
            if real[0].oom is None:
                return _apply_margin(real[0], margin, card), real[1]
            e.oom = real[0].oom
        e.gpu, e.capacity_bytes = card.name, card.total_bytes
        e.fits = e.oom is None and e.peak_reserved_bytes <= card.usable_bytes
        return _apply_margin(e, margin, card), lr

    def run(chosen: Sequence[Any], world_size: int | None = None, alloc_conf: str | None = None,
            snap: bool = False, b: int | None = None,
            extra: Mapping[str, Any] | None = None) -> tuple[Estimate, Any]:
        # without Python stacks (a quarter of a run's time): they are shown only for the step
        # as written's out-of-memory site and a snapshot the caller keeps
        e, lr = once(chosen, big, False, world_size, alloc_conf, snap, b, extra)
        real = None
        if e.peak_reserved_bytes > card.usable_bytes:
            if e.peak_allocated_bytes <= card.usable_bytes:
                # the cache passed the usable memory, not the blocks: the allocator frees its
                # cache and retries before it runs out, so the card itself decides
                real = once(chosen, card, False, world_size, alloc_conf, snap, b, extra)
            else:
                e.notes.append(
                    f"needs {format_bytes(e.peak_allocated_bytes)} of blocks at its peak, more "
                    f"than the {format_bytes(card.usable_bytes)} usable: out of memory on the "
                    f"{card.name}")
        return settle(e, lr, real)

    say = progress or (lambda m: None)
    say("what-if: the step as written ...")
    want_snap = keep_snapshot or any(lv.name == "allocator" for lv in levers)
    # The step as written on the unbounded card. Where its blocks or cache pass the usable
    # memory, its rerun on the card (which finds the out-of-memory site, with stacks) runs in
    # the pool beside the levers: they need only this run's figures.
    first, first_lr = once([], big, keep_snapshot, snap=want_snap)
    base, base_lr = settle(first, first_lr, None)  # provisional while the rerun is pending
    site: Callable[[], Any] | None = None
    if first.peak_reserved_bytes > card.usable_bytes:
        def site() -> Any:
            return once([], card, True, snap=want_snap)

    def on_site(real: tuple[Estimate, Any]) -> tuple[Estimate, Any]:
        nonlocal base, base_lr
        base, base_lr = settle(first, first_lr, real)
        return base, base_lr

    def suggest(e: Estimate) -> str | None:
        from torchmem.sim import suggest as _suggest

        if e.snapshot is None:
            return None
        dev = _suggest(e).devices[0]
        return None if dev.best is None else dev.best.alloc_conf

    rows, best = what_if(run, base, base_lr, card, levers, batch, progress, suggest,
                         workers=None, script=script, site=site, on_site=on_site)
    if maximize is not None:
        _lever_max(run, rows, maximize, batch, card, margin, say, search_range, base, start)
    base.what_if = rows
    base.what_if_best = best
    if not keep_snapshot:
        base.snapshot = None
    return base


def _lever_max(run: Callable[..., tuple[Estimate, Any]], rows: Sequence[Any], maximize: str,
               batch: int, card: GPU, margin: MarginSpec, say: Callable[[str], None],
               search_range: tuple[int, ...] | None, base: Estimate,
               first: int | None = None) -> None:
    """The largest value of ``maximize`` the step as written allows (``base``'s search
    figures) and each of the three levers with the lowest peak reserved (their row's
    ``cost["max_value"]``); each search starts at ``first`` when given (a script's own value
    of the option), else at the batch (``batch_size``) or 1."""
    from torchmem.fit.levers._choices import _BY_NAME

    top = [r for r in rows if r.skipped is None and r.lever in _BY_NAME
           and "accumulate" not in _BY_NAME[r.lever].settings and r.lever != "allocator"][:3]
    lo, hi, step = _check_range(search_range, maximize)

    def fits_at(reserved: float) -> bool:
        n = max(0, int(reserved))
        return n + margin_for(margin, card, n) <= card.usable_bytes

    for r in [None, *top]:
        levers = [] if r is None else [_BY_NAME[r.lever]]
        ws = None if r is None else levers[0].world_size

        def probe(v: int, levers: list[Any] = levers, ws: int | None = ws) -> Estimate:
            if maximize == "batch_size":
                return run(levers, world_size=ws, b=v)[0]
            return run(levers, world_size=ws, extra={maximize: v})[0]

        say(f"what-if {'as written' if r is None else r.lever}: largest {maximize} ...")
        start = lo if lo is not None else first or (batch if maximize == "batch_size" else 1)
        e = _search(maximize, probe, start, lo, hi, card, None, False, probe, fits_at, step)
        found = e.max_value if maximize != "batch_size" else e.max_batch_size
        if r is None:
            base.searched, base.maximized, base.probes = True, maximize, e.probes
            base.max_value = found
            if maximize == "batch_size":
                base.maximized, base.max_batch_size = None, found
        else:
            r.cost["max_value"] = found
            r.cost["maximized"] = maximize
