#!/usr/bin/env bash
# One pass of every CUDA path on a GPU machine (issue "Ground truth from a real GPU"):
#   reference data (scripts/record_gpu_reference.py), the cuda-marked tests, every CLI command on
#   a CUDA workload, and benchmarks/bench_gpu.py. Results: gpu-check.tar.gz.part* in $OUT (default /tmp/gpu-check-out).
# Usage: bash scripts/gpu/check.sh [sections...]   sections: env record bench tests cli (default all)
#   CASES=a,b (record only these cases), BENCH=overlap (bench_gpu sections), TESTS="tests/x.py ..."
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL="${OUT:-/tmp/gpu-check-out}"
OUT=/tmp/gpu-check   # everything is written here, then packed into $FINAL (few files come back)
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
pack() { tar -C /tmp -czf - gpu-check | split -b 15M - "$FINAL/gpu-check.tar.gz.part"; }
trap pack EXIT
export PYTHONUNBUFFERED=1
sections="${*:-env record bench tests cli}"
has() { [[ " $sections " == *" $1 "* ]]; }
if has env; then
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
    python3 -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/env.txt"
fi
if has record; then
    echo "== record"
    timeout 240 python3 scripts/record_gpu_reference.py --out "$OUT/gpu" ${CASES:+--cases "$CASES"} 2>&1 | tee "$OUT/record.log"
fi
if has bench; then
    echo "== bench"
    timeout 90 python3 benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" ${BENCH:+--sections "$BENCH"} > "$OUT/bench.log" 2>&1
    tail -5 "$OUT/bench.log"
fi
if has tests; then
    echo "== cuda tests"
    timeout 150 python3 -m pytest -m cuda ${TESTS:-tests} -q -p no:cacheprovider --continue-on-collection-errors -o addopts="-ra --strict-markers" \
        --timeout 90 2>&1 | tee "$OUT/cuda-tests.log" | tail -40
fi
if has cli; then
    echo "== cli"
    W="$OUT/cli"; mkdir -p "$W"
    {
        set -x
        python3 scripts/gpu/cli_workload.py "$W/a.pickle"
        python3 scripts/gpu/cli_workload.py "$W/b.pickle"
        torchmem run -o "$W/run.tmtrace" --json scripts/gpu/cli_workload.py > "$W/run.json"
        torchmem summary "$W/run.tmtrace" | head -40
        torchmem plot -o "$W/run.png" "$W/run.tmtrace"
        torchmem stats "$W/a.pickle"
        torchmem peak --top 5 "$W/a.pickle"
        torchmem diff "$W/a.pickle" "$W/b.pickle" | head -30
        torchmem trace --tail 10 "$W/a.pickle"
        torchmem flame -o "$W/a.folded" "$W/a.pickle"; wc -l "$W/a.folded"
        torchmem oom "$W/a.pickle"
        torchmem replay "$W/a.pickle"
        torchmem whatif --alloc-conf expandable_segments:True "$W/a.pickle"
        torchmem view -o "$W/a.html" "$W/a.pickle"; ls -la "$W/a.html"
        torchmem view -o "$W/run.html" "$W/run.tmtrace"; ls -la "$W/run.html"
        torchmem ledger --device cuda
        torchmem ledger --device cuda --json
        torchmem gpu
        torchmem gpu --json
        torchmem inspect --device cuda | head -30
        torchmem estimate --help | head -5
        set +x
    } > "$OUT/cli.log" 2>&1
    grep -n -i -E "error|traceback" "$OUT/cli.log" | head -20
    rm -f "$W"/*.html
fi
