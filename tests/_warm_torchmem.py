"""``python -m torchmem ARGS`` or ``python SCRIPT ARGS`` many times without paying for
``import torch`` each time.

tests/test_docs_examples.py runs every documented command line, tests/test_benchmarks_smoke.py
every benchmark. Started once, this process imports torch and torchmem's command modules, then
for each request on stdin (one JSON line: ``{"argv": [...], "cwd": ..., "stdout": PATH,
"stderr": PATH}``, plus ``"script": PATH`` to run a script instead of ``-m torchmem``) forks a
child that runs ``python -m torchmem ARGV`` or ``python SCRIPT ARGV`` (``runpy``, ``sys.argv``
and ``sys.path[0]`` as python sets them) in ``cwd`` with its output in those files, and answers
with the child's exit code (one line; before it ``pid N`` when the request has
``"report_pid": true``). Each command gets a fresh process, as from a shell: only
the imports are shared.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


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
        if req.get("report_pid"):  # first the child's pid (a caller's time limit kills it)
            print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
