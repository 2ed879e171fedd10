"""``python -m torchmem ARGS`` or ``python SCRIPT ARGS`` many times without paying for
``import torch`` each time.

tests/test_docs_examples.py runs every documented command line, tests/test_benchmarks_smoke.py
every benchmark. Started once, this process imports torch and torchmem's command modules, then
for each request on stdin (one JSON line: ``{"argv": [...], "cwd": ..., "stdout": PATH,
"stderr": PATH}``, plus ``"script": PATH`` to run a script instead of ``-m torchmem``) forks a
child that runs ``python -m torchmem ARGV`` or ``python SCRIPT ARGV`` (``runpy``, ``sys.argv``
and ``sys.path[0]`` as python sets them) in ``cwd`` with its output in those files, and answers
with ``pid N`` (the child's, at once: a caller's time limit kills it) and then the child's exit
code, one line each. Each command gets a fresh process, as from a shell: only the imports are
shared. :class:`WarmClient` is the tests' end of it.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any


class WarmClient:
    """Starts this file as a process (``env``, ``cwd``) and runs requests on it: :meth:`run`
    sends one and gives the child's exit code, or ``None`` when it ran over ``timeout`` seconds
    (then it is killed). Lines are read unbuffered, so a time limit never waits on a line that
    already came."""

    def __init__(self, env: Mapping[str, str], cwd: str | os.PathLike[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(env), cwd=cwd, bufsize=0)
        assert self._line(None) == "ready"

    def _line(self, deadline: float | None) -> str | None:
        assert self.proc.stdout is not None
        buf = b""
        while not buf.endswith(b"\n"):
            if deadline is not None:
                ready, _, _ = select.select([self.proc.stdout], [], [],
                                            max(0.0, deadline - time.monotonic()))
                if not ready:
                    return None
            byte = self.proc.stdout.read(1)
            if not byte:
                raise EOFError("the warm process ended")
            buf += byte
        return buf.decode().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: Mapping[str, Any], timeout: float | None = None) -> int | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(dict(request)) + "\n").encode())
        self.proc.stdin.flush()
        pid = int(str(self._line(None)).split()[1])
        code = self._line(None if timeout is None else time.monotonic() + timeout)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            self._line(None)  # its exit code, after the kill
            return None
        return int(code)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _child(req: dict[str, object]) -> None:
    os.chdir(str(req["cwd"]))
    for fd, key in ((1, "stdout"), (2, "stderr")):
        f = os.open(str(req[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the child's whole life
    script = req.get("script")
    if script is not None:  # python SCRIPT ARGV: the script's folder first on the path
        sys.argv = [str(script), *[str(a) for a in req["argv"]]]  # type: ignore[attr-defined]
        sys.path[0] = os.path.dirname(os.path.abspath(str(script)))
        runpy.run_path(str(script), run_name="__main__")
        return
    sys.argv = ["torchmem", *[str(a) for a in req["argv"]]]  # type: ignore[attr-defined]
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    runpy.run_module("torchmem", run_name="__main__", alter_sys=True)


def main() -> None:
    import torch  # noqa: F401 - the point: imported once

    import torchmem.cli

    # torch._dynamo: what FakeTensorMode imports when an estimate starts (about 2 s)
    for module in [m for m, _ in torchmem.cli.SUBCOMMANDS.values()] + [
            "torchmem.fit", "matplotlib.pyplot", "torch._dynamo", "torch.distributed.fsdp"]:
        try:
            importlib.import_module(module)
        except ImportError:  # an optional part: the command imports (and reports) it itself
            pass
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.stdout.flush()
            _child(req)
            sys.exit(0)  # leaves the loop: the interpreter ends as after `python -m torchmem`
        print(f"pid {pid}", flush=True)  # first the child's pid (a caller's time limit kills it)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
