"""Record the GPU reference data in ``tests/data/gpu/`` on a real CUDA GPU (any GPU, any torch >= 2.1).

Each case of ``tests/gpu_cases.py`` runs in a fresh process with its own
``PYTORCH_CUDA_ALLOC_CONF``: CUDA is initialised, the allocator is emptied and its peaks reset,
the allocator history is recorded from that empty state (``_record_memory_history`` with room for
every entry, Python stacks), the case's build and ``STEPS`` steps run, and then these are written:

  <case>.pickle   ``torch.cuda.memory._snapshot()`` at the end: segments, blocks and the whole
                  trace from the empty allocator (a real OOM leaves its ``oom`` entry in it)
  <case>.json     the case (build, batch, parameters, settings), ``torch.cuda.memory_stats()``
                  at the end, the peaks, cudaMalloc/cudaFree counts, the device memory the
                  allocator never sees (NVML before CUDA initialisation, ``mem_get_info`` after it
                  and at the end), the cuBLAS workspace bytes (allocated bytes released by
                  clearing cuBLAS's workspaces after the run), versions and timings
  index.json      the GPU, driver, CUDA and torch versions, and one line per case

Run on a GPU machine from the repository root:

    python scripts/record_gpu_reference.py                 # every case into tests/data/gpu/
    python scripts/record_gpu_reference.py --cases convnet,sdpa_flash --out /tmp/gpu

Without a CUDA GPU it exits 2 and says so: reference data is only ever recorded, never made up.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KEYS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
        "requested_bytes.all.peak", "allocated_bytes.all.current", "reserved_bytes.all.current",
        "active_bytes.all.current", "requested_bytes.all.current", "num_device_alloc",
        "num_device_free", "num_alloc_retries", "num_ooms", "num_sync_all_streams")


def _nvml_memory() -> tuple[int, int] | tuple[None, None]:
    """(used, total) of the whole device according to NVML, or (None, None) without NVML.

    NVML's total includes memory the driver keeps for itself, which ``cudaMemGetInfo``'s total
    leaves out (480 MiB on an H100 80GB); compare the two only through ``used - (nvml_total -
    total)``."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
        info = pynvml.nvmlDeviceGetMemoryInfo(h)
        return int(info.used), int(info.total)
    except Exception:
        return None, None


def _versions() -> dict[str, Any]:
    import torch
    p = torch.cuda.get_device_properties(0)
    driver = None
    try:
        import pynvml
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        pass
    return {"gpu": p.name, "total_memory": int(p.total_memory), "capability": [p.major, p.minor],
            "multiprocessors": p.multi_processor_count, "driver": driver,
            "cuda": torch.version.cuda, "torch": torch.__version__, "python": platform.python_version()}


def child(name: str, out: Path, batch: int | None) -> int:
    """Run one case in this (fresh) process and write its files; exit 3 on an unexpected OOM."""
    nvml_used, nvml_total = _nvml_memory()
    import torch

    import gpu_cases

    case = {**gpu_cases.CASES, **gpu_cases.PENDING}[name]
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    if case.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(case.memory_fraction)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.memory_reserved() == 0, "the allocator is not empty before recording"
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=4_000_000)
    bs = batch or case.batch_size
    t0 = time.perf_counter()
    oom: str | None = None
    try:
        step = case.build(bs, **case.params)
        for _ in range(case.steps):
            step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        oom = str(e).splitlines()[0]
        step = None  # type: ignore[assignment]
    elapsed = time.perf_counter() - t0
    snap = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled=None)
    free_end, _ = torch.cuda.mem_get_info()
    reserved_end = torch.cuda.memory_reserved()
    alloc_before_ws = torch.cuda.memory_allocated()
    try:
        torch._C._cuda_clearCublasWorkspaces()
        workspace = alloc_before_ws - torch.cuda.memory_allocated()
    except Exception:
        workspace = None
    entries = sum(len(t) for t in snap.get("device_traces", []))
    # in cudaMemGetInfo's terms (its total leaves out what the driver keeps)
    before = None if nvml_used is None or nvml_total is None else nvml_used - (nvml_total - int(total))
    record = {
        "case": name, "build": case.build.__name__, "batch_size": bs, "params": case.params,
        "steps": case.steps, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "memory_fraction": case.memory_fraction, "expect_oom": case.expect_oom, "oom": oom,
        "note": case.note, "seconds": round(elapsed, 3), "trace_entries": entries,
        "trace_complete": entries < 4_000_000,
        "stats": {k: int(stats.get(k, 0)) for k in KEYS},
        "memory_stats": {k: int(v) for k, v in stats.items()},
        "device": {
            "total": int(total),
            "nvml_total": nvml_total,
            "nvml_used_before_cuda_init": nvml_used,
            "used_before_cuda_init": before,
            "used_after_cuda_init": int(total - free0),
            "used_at_end": int(total - free_end),
            "reserved_at_end": int(reserved_end),
            "outside_allocator_at_end": int(total - free_end - reserved_end),
            "cuda_context": None if before is None else int(total - free0 - before),
        },
        "cublas_workspace_bytes": workspace,
        "readings": getattr(step, "readings", None),
        "versions": _versions(),
    }
    (out / f"{name}.pickle").write_bytes(pickle.dumps(snap, protocol=4))
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    peak = record["stats"]
    print(f"  {name}: batch {bs}, peak allocated {peak['allocated_bytes.all.peak']:,} B, reserved "
          f"{peak['reserved_bytes.all.peak']:,} B, {entries:,} trace entries, {elapsed:.1f} s"
          + (f", OOM: {oom[:80]}" if oom else ""), flush=True)
    return 3 if (oom and not case.expect_oom) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "gpu"), help="output folder")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--case-timeout", type=float, default=120, help="seconds per case (default 120)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.child:
        return child(a.child, out, a.batch)

    import torch

    import gpu_cases
    if not torch.cuda.is_available():
        print("record_gpu_reference: no CUDA GPU here (torch.cuda.is_available() is False). "
              "Reference data is recorded on a real GPU only; run this on a machine with one.",
              file=sys.stderr)
        return 2
    every = {**gpu_cases.CASES, **gpu_cases.PENDING}  # pending: written, not recorded yet
    names = [n for n in a.cases.split(",") if n] or list(every)
    unknown = [n for n in names if n not in every]
    if unknown:
        print(f"record_gpu_reference: unknown case(s) {unknown}; the cases are "
              f"{', '.join(every)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"versions": None, "cases": {}}
    if (out / "index.json").exists():  # recording some cases again keeps the others' lines
        index = json.loads((out / "index.json").read_text())
    for i, name in enumerate(names, 1):
        case = every[name]
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if case.alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = case.alloc_conf
        print(f"[{i}/{len(names)}] {name}", flush=True)
        batch = case.batch_size
        for _attempt in range(3):
            try:
                r = subprocess.run([sys.executable, __file__, "--child", name, "--out", str(out),
                                    "--batch", str(batch)], env=env, timeout=a.case_timeout)
            except subprocess.TimeoutExpired:
                r = subprocess.CompletedProcess([], returncode=-9)
                print(f"  {name}: more than {a.case_timeout} s, stopped", flush=True)
            if r.returncode != 3:
                break
            batch = int(batch * 0.85)
            print(f"  unexpected OOM: again with batch {batch}", flush=True)
        if r.returncode not in (0, 3):
            index["cases"][name] = {"error": f"exit code {r.returncode}"}
            continue
        rec = json.loads((out / f"{name}.json").read_text())
        index["versions"] = rec["versions"]
        index["cases"][name] = {k: rec[k] for k in ("batch_size", "alloc_conf", "oom", "seconds")}
        index["cases"][name].update(rec["stats"])
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
