#!/usr/bin/env bash
# The README's test command: installs everything the tests need, then runs lint, types and tests
# (the tests build the documentation site and run its examples: tests/test_docs_*.py).
# Usage: bash scripts/test.sh [extra pytest args]   (e.g. -n 0 to run the tests in one process)
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== installing torchmem with its test extras (torch 2.13.0 CPU build)"
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test]"
# torchlinops' own functions are the ground truth of the compatibility tests (pure Python, tiny).
# It goes into a folder of its own, never into this environment: installed here without its
# dependencies it would leave `pip check` failing for every later install. tests/test_compat.py
# loads torchlinops/utils/_device.py from that folder by path.
LINOPS_DIR=".cache/linops"
python -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$LINOPS_DIR" "torch-named-linops==0.8.3"
pip_check="$(python -m pip check 2>/dev/null || true)"
if grep -q "^torch-named-linops " <<<"$pip_check"; then
    echo "!! torch-named-linops is installed in this environment without its dependencies (an older"
    echo "   scripts/test.sh put it there); the tests no longer need it there:"
    echo "   'python -m pip uninstall torch-named-linops' makes 'pip check' pass again"
fi

# The HTML viewer is tested in a real headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing Debian's chromium for the browser tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "!! chromium not found and cannot be installed here: browser tests will be skipped"
    fi
fi

# track(mode="fast") builds a small C++ part with PyTorch's extension builder (ninja comes with
# the test extras; the compiler is Debian's g++).
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing Debian's g++ for track(mode='fast')"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
        echo "!! no C++ compiler and none can be installed here: mode='fast' tests will be skipped"
    fi
fi
# build it once before the tests run in parallel (they would all wait on the first build); the
# compiler runs on one core while ruff, import-linter and mypy run on the other (about 30 s saved
# on a 2-core machine), and its messages are printed once it is done
build_log="$(mktemp)"
python -c "from torchmem.capture.fast import native_available; from torchmem.capture.fast._build import load_native; native_available() and load_native()" \
    >"$build_log" 2>&1 &
build_pid=$!

echo "== ruff"
python -m ruff check src tests benchmarks scripts
echo "== import-linter (layers, torch-free core, producers never render, no cycles, torchmem.fit's rooms; see pyproject.toml)"
lint-imports --no-logo
echo "== mypy"
python -m mypy
echo "== the fast tracker's C++ part (built beside the checks above)"
if wait "$build_pid"; then
    cat "$build_log"
else
    cat "$build_log"
    echo "!! the fast tracker's C++ part did not build: mode='fast' tests will fail"
fi
rm -f "$build_log"
echo "== pytest (one worker per core; the ten slowest tests are listed at the end)"
# -n auto: pytest-xdist, one worker per core; --dist loadgroup keeps each file marked
# xdist_group on one worker (its module fixtures are built once). Pass -n 0 to run serially.
python -m pytest -n auto --dist loadgroup "$@"
