"""Every GPU reference case (tests/data/gpu/, recorded on a real H100) estimated on this CPU-only
machine, beside the real allocator's peaks, with the error in percent.

For each case of tests/gpu_cases.py: ``torchmem.estimate`` of the same build (fake tensors, the
allocator simulator, the recorded GPU's capacity and compute capability, the case's allocator
settings, no margin) against ``torch.cuda.memory_stats()`` of the real run: peak allocated and
peak reserved. Also the replay of the real trace (``torchmem.sim.replay``: allocations at their
real address) and the time each estimate took. Goals: allocated within 1%, reserved within 5%;
the "goals" column says which goals a case meets. tests/test_gpu_reference.py asserts the cases
that meet both. The "verdict" column is the estimate's answer with the default margin (1% of its
peak reserved + 256 MiB) against what the real run did: "fits/ran", "OOM/OOM", or "FALSE FITS"
where it says fits for a run that ran out of memory or its peak is below the real one by more
than the margin (issue 43: never a false "fits"); the run exits 1 on a false fits. The
estimated figures are the verdict's: where the GPU chooses at run time (``record_stream``'s
frees, cuDNN's workspaces) the upper end of the estimate's range; the "lower" column is the
other end (``Estimate.peak_reserved_lower_bytes``; "-": a single figure) and says whether the
real reserved peak lies inside the range.

Run:  python benchmarks/bench_gpu_truth.py [CASE ...]     (about a minute on our 2 cores)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gpu_cases  # noqa: E402
import torchmem  # noqa: E402
from torchmem.sim import replay  # noqa: E402


def main(argv: list[str]) -> int:
    names = argv or list(gpu_cases.CASES)
    unknown = [n for n in names if n not in gpu_cases.CASES]
    if unknown:
        print(f"bench_gpu_truth: unknown case(s) {unknown}; the cases are {', '.join(gpu_cases.CASES)}",
              file=sys.stderr)
        return 2
    first = gpu_cases.recorded(names[0])["versions"]
    print(f"real: {first['gpu']}, torch {first['torch']}; estimates: torch {__import__('torch').__version__} "
          f"on this CPU")
    head = (f"{'case':22s} {'real alloc':>15s} {'estimate':>15s} {'err':>7s}  {'real reserved':>15s} "
            f"{'estimate':>15s} {'err':>7s}  {'lower':>15s} {'':4s} {'replay':>11s} {'est s':>6s}  "
            f"{'verdict':<10s} goals")
    print(head)
    print("-" * len(head))
    met = false = ranged = inside = 0
    for name in names:
        rec = gpu_cases.recorded(name)
        st = rec["stats"]
        ra, rr = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
        r = replay(torchmem.load_snapshot(gpu_cases.DATA / f"{name}.pickle"))
        rep = f"{r.allocs_matched}/{r.allocs_expected}"
        t = time.perf_counter()
        try:
            e = gpu_cases.estimate_case(name)
        except Exception as ex:  # a case the estimator cannot run yet: say so, keep going
            print(f"{name:22s} {ra:>15,} {'-':>15s} {'':>7s}  {rr:>15,} {'-':>15s} {'':>7s}  "
                  f"{'-':>15s} {'':4s} {rep:>11s} "
                  f"{time.perf_counter() - t:6.1f}  estimate failed: {type(ex).__name__}: "
                  f"{str(ex).splitlines()[0][:90]}")
            continue
        secs = time.perf_counter() - t
        ea, er = e.peak_allocated_bytes, e.peak_reserved_bytes
        da, dr = (ea - ra) / ra * 100, (er - rr) / rr * 100
        ok_a, ok_r = abs(da) <= 1, abs(dr) <= 5
        met += ok_a and ok_r
        goals = "both" if ok_a and ok_r else "allocated" if ok_a else "reserved" if ok_r else "neither"
        if rec["oom"]:
            goals += " (real run hit OOM)"
        wrong = gpu_cases.case_false_fits(name, e)
        false += wrong is not None
        says = "OOM" if e.oom is not None else "fits"
        verdict = "FALSE FITS" if wrong else f"{says}/{'OOM' if rec['oom'] else 'ran'}"
        low = e.peak_reserved_lower_bytes
        if low is not None:
            ranged += 1
            inside += low <= rr <= er
        lower = "-" if low is None else f"{low:,}"
        where = "" if low is None else "in" if low <= rr <= er else "OUT"
        print(f"{name:22s} {ra:>15,} {ea:>15,} {da:+6.2f}%  {rr:>15,} {er:>15,} {dr:+6.2f}%  "
              f"{lower:>15s} {where:4s} {rep:>11s} {secs:6.1f}  {verdict:<10s} {goals}"
              + (f": {wrong}" if wrong else ""))
    print(f"\n{met} of {len(names)} cases meet both goals (allocated within 1%, reserved within 5%)")
    print(f"{ranged} cases with a range (the GPU's run-time choices): the real reserved peak "
          f"inside it in {inside}")
    print(f"verdicts with the default margin: {len(names) - false} of {len(names)} right, "
          f"{false} false fits")
    return 1 if false else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
