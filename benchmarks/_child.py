"""Run a benchmark method in a fresh Python process (its own peak RSS) and read its result.

The child is Python source run with ``python -c`` and this checkout's ``src`` on the path; it
prints one line ``RESULT {json}``. Shared by ``bench_estimate.py`` and ``bench_fit_dist.py``.

Example:
    >>> run_child('import json; print("RESULT " + json.dumps({"x": 1}))')
    {'x': 1}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


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
