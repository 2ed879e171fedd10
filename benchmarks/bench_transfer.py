"""Chunked, double-buffered transfer versus a plain ``Tensor.to`` for a large tensor.

Run:  python benchmarks/bench_transfer.py            (512 MiB float32, 5 repeats)
      python benchmarks/bench_transfer.py --mb 128 --repeats 3   (quicker)
      python benchmarks/bench_transfer.py --mb 2 --repeats 1 --chunks 1 --views plain \
          --offload-layers 2 --offload-width 64 --offload-batch 8   (a smoke run: it runs)

What is compared, side by side in one process (time: min of several repeats, methods
interleaved so they share the machine's noise), and each once more in its own subprocess for
memory (peak RSS growth, VmHWM from /proc, after the source tensor is allocated):

* ``x.to('cpu', copy=True)``: the plain copy users write.
* ``full-size staging``: ``x.clone()`` then a copy from that clone -- the host-side memory pattern
  of ``x.pin_memory().to(device)``, which stages the *whole* tensor before a device copy.
* ``chunked_transfer(x, 'cpu', chunk_bytes=C)`` for a few chunk sizes, with fresh staging buffers
  and with a reused :class:`torchmem.transfer.StagingBuffers` pair.
* offloaded inference (``offload_forward``) of a stack of Linear layers, with fetches done
  one after the other and overlapped with compute on a worker thread, against the model run with
  all weights resident: time, and the weights resident at the peak (measured).
* the same for a transposed source ``x.t()`` (dense: copied in memory order, strides kept) and a
  stepped slice ``x[:, ::2]`` (gaps: read block by block), against ``.to(copy=True)`` and
  ``.contiguous()`` of the same view.

On this CPU-only machine every copy is host memory to host memory. That shows the cost of the
chunk loop itself (per-chunk overhead, the extra pass through the staging buffer) and that its
staging memory is bounded by two chunks whatever the tensor size. It cannot show what chunking is
for on a GPU machine -- copy/compute overlap on a transfer stream and pinned-memory DMA without
pinning the whole tensor -- and no GPU figure is claimed here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchmem import chunked_transfer, format_bytes, offload_forward, storage_bytes  # noqa: E402
from torchmem.transfer import StagingBuffers  # noqa: E402

MiB = 1 << 20


def methods(chunks: list[int]) -> dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, int]]]:
    """name -> fn(x) returning (result, staging bytes measured by torchmem or -1)."""
    out: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, int]]] = {
        "x.to('cpu', copy=True)": lambda x: (x.to("cpu", copy=True), -1),
        "full-size staging (clone, copy)": lambda x: (x.clone().clone(), -1),
    }
    for c in chunks:
        def fresh(x: torch.Tensor, c: int = c) -> tuple[torch.Tensor, int]:
            r = chunked_transfer(x, "cpu", chunk_bytes=c)
            return r.tensor, r.peak_staging_bytes

        out[f"chunked_transfer, {format_bytes(c)} chunks"] = fresh
    pools: dict[int, StagingBuffers] = {}
    c = chunks[-1]

    def reused(x: torch.Tensor, c: int = c) -> tuple[torch.Tensor, int]:
        pool = pools.setdefault(c, StagingBuffers(c))
        r = chunked_transfer(x, "cpu", chunk_bytes=c, staging=pool)
        return r.tensor, r.peak_staging_bytes

    out[f"chunked_transfer, {format_bytes(c)} chunks, reused staging"] = reused
    return out


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "plain": lambda x: x,
    "transposed": lambda x: x.t(),  # dense permutation: strides kept, copied in memory order
    "sliced": lambda x: x[:, ::2],  # gaps: read block by block, contiguous result
}


def methods_view(view: str, chunks: list[int]) -> dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, int]]]:
    v = VIEWS[view]
    out: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, int]]] = {
        f"{_label(view)}.to('cpu', copy=True)": lambda x: (v(x).to("cpu", copy=True), -1),
        f"{_label(view)}.contiguous()": lambda x: (v(x).contiguous(), -1),
    }
    for c in chunks:
        def fresh(x: torch.Tensor, c: int = c) -> tuple[torch.Tensor, int]:
            r = chunked_transfer(v(x), "cpu", chunk_bytes=c)
            return r.tensor, r.peak_staging_bytes

        out[f"chunked_transfer({_label(view)}), {format_bytes(c)} chunks"] = fresh
    return out


def _label(view: str) -> str:
    return {"transposed": "x.t()", "sliced": "x[:, ::2]"}.get(view, "x")


def table_for(view: str, chunks: list[int]) -> dict:
    return methods(chunks) if view == "plain" else methods_view(view, chunks)


def make(mb: int, view: str) -> torch.Tensor:
    n = mb * MiB // 4
    if view != "plain":
        side = int(n**0.5)
        return torch.ones(side, n // side)
    return torch.ones(n)


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM of /proc/self/status (per address space, so not
    inherited from the parent the way ``ru_maxrss`` is across fork+exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(name: str, mb: int, view: str, chunks: list[int]) -> None:
    table = table_for(view, chunks)
    x = make(mb, view)
    gc.collect()
    before = peak_rss()
    y, staging = table[name](x)
    after = peak_rss()
    ok = bool(torch.equal(y, VIEWS[view](x)))
    print(json.dumps({"growth": after - before, "result": y.numel() * y.element_size(),
                      "staging": staging, "ok": ok}))


def measure_memory(name: str, mb: int, view: str, chunks: list[int]) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--mb", str(mb), "--view", view,
           "--chunks", ",".join(str(c // MiB) for c in chunks)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_table(title: str, table: dict, x: torch.Tensor, repeats: int, mb: int,
              view: str, chunks: list[int]) -> None:
    times: dict[str, float] = {k: float("inf") for k in table}
    staging: dict[str, int] = {}
    expected = VIEWS[view](x)
    for _ in range(repeats):
        for name, fn in table.items():
            gc.collect()
            t0 = time.perf_counter()
            y, st = fn(x)
            dt = time.perf_counter() - t0
            times[name] = min(times[name], dt)
            staging[name] = st
            assert torch.equal(y, expected), name
            del y
    base = next(iter(table))
    print(f"\n{title}")
    head = f"{'method':52s} {'time':>9s} {'x base':>7s} {'peak RSS growth':>16s} {'over result':>12s} {'staging (measured)':>19s}"
    print(head)
    print("-" * len(head))
    for name in table:
        mem = measure_memory(name, mb, view, chunks)
        assert mem["ok"], name
        extra = mem["growth"] - mem["result"]
        st = format_bytes(staging[name]) if staging[name] >= 0 else "-"
        print(f"{name:52s} {times[name] * 1e3:7.1f}ms {times[name] / times[base]:6.2f}x "
              f"{format_bytes(mem['growth']):>16s} {format_bytes(max(extra, 0)):>12s} {st:>19s}")


def bench_offload(layers: int, width: int, batch: int, repeats: int, chunk: int) -> None:
    """Layer-by-layer offloaded inference on CPU: sequential fetches vs fetches overlapped with
    compute on a worker thread, vs the model run with every weight resident."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(batch, width)
    total = storage_bytes(list(model.parameters()))["cpu"]
    runs: dict[str, Callable[[], tuple[torch.Tensor, int]]] = {
        "model(x), all weights resident": lambda: (model(x), total),
        "offload_forward(..., overlap=False)": lambda: _off(model, x, chunk, False),
        "offload_forward(..., overlap=True)": lambda: _off(model, x, chunk, True),
    }
    times = {k: float("inf") for k in runs}
    resident: dict[str, int] = {}
    with torch.no_grad():
        ref = model(x)
        for _ in range(repeats):
            for name, fn in runs.items():
                gc.collect()
                t0 = time.perf_counter()
                y, res = fn()
                times[name] = min(times[name], time.perf_counter() - t0)
                resident[name] = res
                assert torch.equal(y, ref), name
    print(f"\noffloaded inference, CPU -> CPU: {layers} x Linear({width}, {width}), batch {batch}, "
          f"{format_bytes(total)} of weights, chunks of {format_bytes(chunk)}")
    head = f"{'method':40s} {'time':>9s} {'x base':>7s} {'weights resident (measured peak)':>34s}"
    print(head)
    print("-" * len(head))
    base = next(iter(runs))
    for name in runs:
        print(f"{name:40s} {times[name] * 1e3:7.1f}ms {times[name] / times[base]:6.2f}x "
              f"{format_bytes(resident[name]):>34s}")


def _off(model: torch.nn.Module, x: torch.Tensor, chunk: int, overlap: bool) -> tuple[torch.Tensor, int]:
    r = offload_forward(model, x, "cpu", chunk_bytes=chunk, overlap=overlap)
    return r.output, r.peak_resident_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="tensor size in MiB (default 512)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", default="16,64", help="chunk sizes in MiB, comma separated")
    ap.add_argument("--offload-layers", type=int, default=8, help="layers of the offload model (0: skip)")
    ap.add_argument("--offload-width", type=int, default=2048)
    ap.add_argument("--offload-batch", type=int, default=256)
    ap.add_argument("--views", default="plain,transposed,sliced",
                    help="source layouts to compare, comma separated (default all three)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--view", default="plain", choices=sorted(VIEWS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    chunks = [int(c) * MiB for c in args.chunks.split(",")]
    if args.child:
        child(args.child, args.mb, args.view, chunks)
        return 0
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, threads={torch.get_num_threads()}, "
          f"tensor {args.mb} MiB float32, time = min of {args.repeats} repeats; memory = peak RSS "
          "growth in a fresh subprocess after the source exists (the result itself is "
          f"{args.mb} MiB of it).")
    titles = {
        "plain": "contiguous source, CPU -> CPU",
        "transposed": "transposed source x.t() (dense permutation; strides kept like Tensor.to)",
        "sliced": "stepped slice x[:, ::2] (half the elements, gaps; contiguous result)",
    }
    views = [v for v in args.views.split(",") if v]
    if unknown := [v for v in views if v not in titles]:
        ap.error(f"unknown view(s) {unknown}; the views are {', '.join(titles)}")
    for view, title in titles.items():
        if view not in views:
            continue
        x = make(args.mb, view)
        run_table(title, table_for(view, chunks), x, args.repeats, args.mb, view, chunks)
        del x
        gc.collect()
    if args.offload_layers:
        bench_offload(args.offload_layers, args.offload_width, args.offload_batch, args.repeats,
                      chunks[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
