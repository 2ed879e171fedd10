"""The pytest plugin's cost, side by side with pytest-memray (host memory, the closest tool).

One generated test file, 40 tests (``--tests``), each a small CPU forward/backward
(Linear(256, 256) x 4, batch 64). Each variant is a fresh ``pytest`` process; the figure is the
sum of the tests' own times from pytest's JUnit XML (setup + call + teardown: interpreter start
and collection are left out), the minimum over rounds, variants interleaved round by round:

  plain            no torchmem plugin, no memray
  torchmem-idle    the torchmem plugin loaded, no marker: must cost nothing (the tracker is
                   never started; tests/test_pytest_plugin.py checks that directly)
  torchmem-marked  every test carries @pytest.mark.limit_memory("1 GB") (tensor memory, the
                   tracker with call sites)
  memray-marked    pytest-memray ``--memray``, the same marker (host memory); skipped when
                   pytest-memray is not installed

Run:  python benchmarks/bench_pytest_plugin.py [--rounds 3] [--tests 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points
from importlib.util import find_spec

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")

BODY = """
def test_{i}():
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(64, 256)
    net(x).sum().backward()
"""


def _write(folder: str, marked: bool, tests: int) -> str:
    lines = ["import pytest, torch\n"]
    for i in range(tests):
        if marked:
            lines.append('\n@pytest.mark.limit_memory("1 GB")')
        lines.append(BODY.format(i=i))
    path = os.path.join(folder, f"test_{'marked' if marked else 'plain'}.py")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _torchmem_args(load: bool) -> list[str]:
    installed = any(ep.value == "torchmem.pytest_plugin" for ep in entry_points(group="pytest11"))
    if load:
        return [] if installed else ["-p", "torchmem.pytest_plugin"]
    return ["-p", "no:torchmem"] if installed else []


def _run(folder: str, test_file: str, args: list[str]) -> float:
    xml = os.path.join(folder, "junit.xml")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *args, test_file]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    root = ET.parse(xml).getroot()
    return sum(float(tc.get("time", "0")) for tc in root.iter("testcase"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tests", type=int, default=40, help="tests in the generated file (default 40)")
    opts = ap.parse_args()
    have_memray = find_spec("pytest_memray") is not None
    with tempfile.TemporaryDirectory() as folder:
        plain, marked = _write(folder, False, opts.tests), _write(folder, True, opts.tests)
        memray_off = ["-p", "no:memray"] if have_memray else []
        variants: dict[str, tuple[str, list[str]]] = {
            "plain": (plain, _torchmem_args(False) + memray_off),
            "torchmem-idle": (plain, _torchmem_args(True) + memray_off),
            "torchmem-marked": (marked, _torchmem_args(True) + memray_off),
        }
        if have_memray:
            variants["memray-marked"] = (marked, _torchmem_args(False) + ["--memray"])
        best: dict[str, float] = {}
        for r in range(opts.rounds):
            for name, (f, args) in variants.items():
                t = _run(folder, f, args)
                best[name] = min(best.get(name, t), t)
            print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)
    base = best["plain"]
    print(f"{opts.tests} tests (CPU forward/backward each), sum of test times, best of {opts.rounds}:")
    for name, t in best.items():
        print(f"  {name:<16} {t * 1000:8.1f} ms   x{t / base:5.2f} of plain")
    if "memray-marked" in best:
        print(f"  torchmem-marked / memray-marked: x{best['torchmem-marked'] / best['memray-marked']:.2f}")
    else:
        print("  (pytest-memray not installed: pip install pytest-memray for the side-by-side)")


if __name__ == "__main__":
    main()
