"""Run a benchmark method in a fresh Python process (its own peak RSS) and read its result.

The child is Python source run with ``python -c`` and this checkout's ``src`` on the path; it
prints one line ``RESULT {json}``. Shared by ``bench_estimate.py`` and ``bench_fit_dist.py``.
:func:`measured` runs a command and measures its wall time and peak RSS (``ru_maxrss``), for
``bench_checkpoint_load.py`` and ``bench_qlora.py``.

Example:
    >>> run_child('import json; print("RESULT " + json.dumps({"x": 1}))')
    {'x': 1}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

#: runs the command as a grandchild and prints its peak RSS (KiB) on stderr
WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print('RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
        "sys.exit(r.returncode)")


def run_child(code: str, *args: str) -> dict[str, Any]:
    """``{"error": last stderr line}`` when the child printed no result."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                         env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1]}


def measured(cmd: list[str], timeout: float = 1800) -> tuple[float, int, str, list[str]]:
    """(wall s, peak RSS bytes, stdout, stderr lines) of ``cmd``, run with this checkout's
    ``src`` on the path and transformers quiet; a failure ends the benchmark with the command's
    last lines of stderr."""
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src"),
           "TRANSFORMERS_VERBOSITY": "error"}
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", WRAP, *cmd], capture_output=True, text=True,
                         env=env, timeout=timeout)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[-4:])} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    lines = res.stderr.splitlines()
    rss = int(next(ln for ln in lines if ln.startswith("RSS")).split()[1]) * 1024
    return wall, rss, res.stdout, lines


def figure(lines: list[str], name: str) -> int:
    """The integer a child printed on stderr as ``NAME <int>``.

    Example:
        >>> figure(["x", "PARAMS 12"], "PARAMS")
        12
    """
    return int(next(ln for ln in lines if ln.startswith(name + " ")).split()[1])


def chosen(ap: Any, value: str, known: dict[str, Any]) -> list[str]:
    """The comma-separated names of ``value``, each one of ``known`` (else ``ap.error``)."""
    names = value.split(",")
    bad = [n for n in names if n not in known]
    if bad:
        ap.error(f"unknown model {bad[0]!r}; expected some of {', '.join(known)}")
    return names
