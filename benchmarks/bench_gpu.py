"""torchmem's CUDA paths measured on a real GPU, side by side with what users would write instead.

Needs a CUDA GPU: without one it says so (``SKIP bench_gpu: ...``) and exits 0, measuring
nothing. All in one process; every time is the minimum over ``--repeats`` runs, methods
interleaved round by round.

Transfers (a ``--mb`` MiB float32 tensor):
  host -> GPU   ``x.to("cuda")`` from pageable memory; ``x.pin_memory().to("cuda")`` (pinning
                counted); ``.to("cuda", non_blocking=True)`` from an already pinned tensor (the
                DMA ceiling); ``ToDevice("cpu", "cuda")`` (pageable source staged through its
                reusable pinned pair); ``chunked_transfer`` at two chunk sizes
  GPU -> host   ``x.to("cpu")``; ``ToDevice(...).H``; ``chunked_transfer(x, "cpu")``
  overlap       ``offload_forward`` of a stack of Linear layers kept on the host (weights
                fetched layer by layer while the previous layer computes) with ``overlap=True``
                and ``False``, against the model resident on the GPU; peak GPU bytes of each
Tracker (a GPT training step, AdamW, batch ``--batch``):
  untracked, ``torchmem.track(model, opt)``, PyTorch's ``MemTracker`` (reset every step): ms per
  step (synchronised); and each tool's peak beside ``torch.cuda.max_memory_allocated()`` of the
  same step (the ground truth), measured from the same starting point.

Run:  python benchmarks/bench_gpu.py [--mb 1024] [--repeats 5] [--json FILE] [--sections overlap]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torchmem  # noqa: E402
from torchmem import ToDevice, chunked_transfer, offload_forward  # noqa: E402

MiB = 1 << 20


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def best(methods: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    out = {k: float("inf") for k in methods}
    for _ in range(repeats):
        for k, fn in methods.items():
            out[k] = min(out[k], timed(fn))
    return out


def transfers(mb: int, repeats: int) -> dict[str, Any]:
    n = mb * MiB // 4
    host = torch.randn(n)
    pinned = host.pin_memory()
    dev = torch.randn(n, device="cuda")
    up, down = ToDevice("cpu", "cuda"), None
    down = up.H
    chunk_a, chunk_b = 16 * MiB, 64 * MiB
    h2d = {
        "x.to('cuda') pageable": lambda: host.to("cuda"),
        "x.pin_memory().to('cuda')": lambda: host.pin_memory().to("cuda", non_blocking=True),
        "pinned x.to('cuda', non_blocking)": lambda: pinned.to("cuda", non_blocking=True),
        "ToDevice('cpu','cuda') pageable": lambda: up(host),
        "chunked_transfer 16 MiB": lambda: chunked_transfer(host, "cuda", chunk_bytes=chunk_a),
        "chunked_transfer 64 MiB": lambda: chunked_transfer(host, "cuda", chunk_bytes=chunk_b),
    }
    d2h = {
        "x.to('cpu')": lambda: dev.to("cpu"),
        "ToDevice(...).H": lambda: down(dev),
        "chunked_transfer 64 MiB": lambda: chunked_transfer(dev, "cpu", chunk_bytes=chunk_b),
    }
    for fn in (*h2d.values(), *d2h.values()):  # warm-up: streams, staging buffers, kernels
        fn()
    res: dict[str, Any] = {"mb": mb}
    for label, group in (("host_to_gpu", h2d), ("gpu_to_host", d2h)):
        t = best(group, repeats)
        base = next(iter(t.values()))
        res[label] = {k: {"seconds": v, "GB/s": mb * MiB / v / 1e9, "vs_first": base / v}
                      for k, v in t.items()}
    # correctness on the way: every method returns the same bytes
    assert torch.equal(up(host).cpu(), host) and torch.equal(down(dev), dev.cpu())
    return res


def overlap(layers: int, width: int, batch: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))
    x = torch.randn(batch, width)
    resident = [m for m in copy.deepcopy(model).to("cuda")]  # its own copy: model stays on the host
    xd = x.to("cuda")

    def run_resident() -> Any:
        with torch.no_grad():
            y = xd
            for m in resident:
                y = m(y)
        return y
    ref = run_resident()
    # offloaded weights live on the host (pinned, as offload users keep them)
    for p in model.parameters():
        p.data = p.data.pin_memory()
    methods = {
        "resident on the GPU": run_resident,
        "offload_forward overlap=True": lambda: offload_forward(model, x, "cuda", overlap=True),
        "offload_forward overlap=False": lambda: offload_forward(model, x, "cuda", overlap=False),
    }
    for fn in methods.values():
        fn()
    t = best(methods, repeats)
    peaks = {}
    for k, fn in methods.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peaks[k] = torch.cuda.max_memory_allocated() - base
        y = out if isinstance(out, torch.Tensor) else out.output
        assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), k
    weights = sum(p.numel() * 4 for p in model.parameters())
    return {"layers": layers, "width": width, "batch": batch, "weight_bytes": weights,
            "seconds": t, "peak_gpu_bytes_above_start": peaks,
            "overlap_speedup": t["offload_forward overlap=False"] / t["offload_forward overlap=True"]}


def tracker(batch: int, repeats: int, steps: int) -> dict[str, Any]:
    import gpu_cases
    cfg = gpu_cases.GPTConfig(vocab=8192, context=256, d_model=512, layers=6, heads=8)

    def fresh() -> tuple[Callable[[], None], Any, Any]:
        step = gpu_cases.gpt_train(batch, cfg=cfg)
        cl = step.__closure__ or ()
        objs = [c.cell_contents for c in cl]
        model = next(o for o in objs if isinstance(o, nn.Module))
        opt = next(o for o in objs if isinstance(o, torch.optim.Optimizer))
        return step, model, opt

    step, model, opt = fresh()
    step()  # optimizer state exists from here on

    def untracked() -> None:
        for _ in range(steps):
            step()

    def tracked() -> None:
        with torchmem.track(model, opt):
            for _ in range(steps):
                step()

    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception:  # pragma: no cover - older torch
        MemTracker = None  # type: ignore[assignment,misc]

    def memtracker() -> None:
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for _ in range(steps):
                step()
                mt.reset_mod_stats()

    methods: dict[str, Callable[[], None]] = {"untracked": untracked, "torchmem.track": tracked}
    if MemTracker is not None:
        methods["MemTracker"] = memtracker
    for fn in methods.values():
        fn()
    t = best(methods, repeats)
    ms = {k: v / steps * 1e3 for k, v in t.items()}
    ratios = {k: v / ms["untracked"] for k, v in ms.items()}

    # peaks: each tool on the same state, against the allocator's own peak for the same step
    peaks: dict[str, Any] = {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torchmem.track(model, opt) as tr:
        step()
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated()
    tm_peak = tr.peak().get("cuda:0", 0)
    peaks["cuda.max_memory_allocated"] = real
    peaks["torchmem.track peak"] = tm_peak
    peaks["start_allocated"] = base
    if MemTracker is not None:
        try:
            torch.cuda.reset_peak_memory_stats()
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                step()
            torch.cuda.synchronize()
            snap = mt.get_tracker_snapshot("peak")
            peaks["MemTracker peak (raw)"] = {str(d): {str(k): int(v) for k, v in m.items()}
                                              for d, m in snap.items()}
            peaks["cuda.max_memory_allocated (MemTracker run)"] = torch.cuda.max_memory_allocated()
        except Exception as e:
            peaks["MemTracker peak (raw)"] = f"{type(e).__name__}: {e}"
    return {"batch": batch, "config": cfg.__dict__, "steps_per_round": steps, "ms_per_step": ms,
            "ratio_to_untracked": ratios, "peaks": peaks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--sections", default="transfers,overlap,tracker",
                    help="comma-separated: transfers, overlap, tracker (default all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        why = "needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured"
        print(f"SKIP bench_gpu: {why}", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"skipped": why}) + "\n")
        return 0
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"GPU: {res['gpu']}, torch {res['torch']}", flush=True)
    wanted = [w for w in a.sections.split(",") if w]
    for name, fn in (("transfers", lambda: transfers(a.mb, a.repeats)),
                     ("overlap", lambda: overlap(16, 4096, 2048, a.repeats)),
                     ("tracker", lambda: tracker(a.batch, a.repeats, 3))):
        if name not in wanted:
            continue
        try:
            res[name] = fn()
        except Exception as e:  # keep the other sections' figures
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({name: res[name]}, indent=1, default=str), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
