"""`torchmem run`, `torchmem summary` and `torchmem plot` end to end (in subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torchmem

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    print("argv", sys.argv[1:], __name__)
    net = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 16)).sum().backward()
        opt.step()
    keep = torch.zeros(1000)             # 4000 bytes alive at the end
    if "--fail" in sys.argv:
        def broken():
            raise RuntimeError("user failure")
        broken()
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[-1]))
    """
)


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchmem", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_run_script_writes_trace_and_summary(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    res = _run("run", "-o", "t.tmtrace", "train.py", "a", "--b", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "argv ['a', '--b'] __main__" in res.stdout
    assert "Peak" in res.stdout and "Iterations" in res.stdout
    tr = torchmem.load_trace(tmp_path / "t.tmtrace")
    assert sum(1 for e in tr.events() if e.op == "step") == 3
    # stacks point into the user's script
    assert any(e.stack and "train.py" in e.stack[-1] for e in tr.events())
    # module attribution without passing the module: found through the global hooks
    assert any(e.module == "Linear" and e.phase.label == "backward" for e in tr.events())
    # summary and plot read the file
    js = _run("summary", "t.tmtrace", "--json", cwd=tmp_path)
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["peak"] == tr.peak()
    pl = _run("plot", "t.tmtrace", "-o", "tl.png", cwd=tmp_path)
    assert pl.returncode == 0, pl.stderr
    assert (tmp_path / "tl.png").read_bytes()[:4] == b"\x89PNG"


def test_failing_script_still_writes_trace_and_passes_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    res = _run("run", "--no-stacks", "-o", "f.tmtrace", "train.py", "--fail", cwd=tmp_path)
    assert res.returncode == 1
    assert "RuntimeError: user failure" in res.stderr
    assert 'train.py", line' in res.stderr and "runpy" not in res.stderr
    tr = torchmem.load_trace(tmp_path / "f.tmtrace")
    assert all(e.stack is None for e in tr.events()) and len(tr) > 10
    res = _run("run", "--quiet", "-o", "e.tmtrace", "train.py", "--exit", "7", cwd=tmp_path)
    assert res.returncode == 7, res.stderr
    assert (tmp_path / "e.tmtrace").exists()


def test_example_and_bad_input(tmp_path: Path) -> None:
    res = _run("run", "--example", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "trace written to" in res.stdout and "timeline plot written to" in res.stdout
    assert (tmp_path / "torchmem-timeline.png").read_bytes()[:4] == b"\x89PNG"
    tr = torchmem.load_trace(tmp_path / "torchmem-trace.tmtrace")
    cats = {e.category.label for e in tr.events()}
    assert {"parameter", "gradient", "optimizer_state", "activation", "temporary", "input"} <= cats
    (tmp_path / "junk.tmtrace").write_text("not a trace")
    bad = _run("summary", "junk.tmtrace", cwd=tmp_path)
    assert bad.returncode == 2 and "junk.tmtrace: not a torchmem trace file" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = _run("run", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and "'nope.py' not found" in missing.stderr


def test_unwritable_output_is_refused_before_the_script_runs(tmp_path: Path) -> None:
    from torchmem.cli import main

    script = tmp_path / "touch.py"
    marker = tmp_path / "ran.txt"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    missing = tmp_path / "no" / "such" / "dir" / "t.tmtrace"
    assert main(["run", "-o", str(missing), str(script)]) == 2
    assert main(["run", "-o", str(tmp_path), str(script)]) == 2  # a folder, not a file
    assert not marker.exists() and not missing.parent.exists()
