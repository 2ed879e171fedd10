"""The CLI never misleads (issue 13): `run -m`, `run --json` with a printing script, a script
that does not compile, `--example` with a script, a folder or a renamed PNG given as a file,
`ledger --pid`, and long call sites that are shortened, never split."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import torchmem
from torchmem.cli import main

SRC = str(Path(torchmem.__file__).resolve().parents[1])

TRAIN = textwrap.dedent(
    """
    import sys
    import torch
    print("script says hello", sys.argv[1:], __name__)
    print("{not json")
    keep = torch.zeros(1000)             # 4000 bytes alive at the end
    """
)


def _torchmem(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torchmem", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_run_dash_m_runs_a_module_like_python(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(TRAIN)
    res = _torchmem("run", "--no-host", "-o", "m.tmtrace", "-m", "mypkg.train", "--lr", "1",
                    "-o", "x", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # everything after the module name is the module's, as with python -m
    assert "script says hello ['--lr', '1', '-o', 'x'] __main__" in res.stdout
    tr = torchmem.load_trace(tmp_path / "m.tmtrace")
    assert tr.live_bytes("cpu") == 4000
    missing = _torchmem("run", "-m", "mypkg.nope", cwd=tmp_path)
    assert missing.returncode == 2 and "no module named 'mypkg.nope'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_run_json_stays_parseable_when_the_script_prints(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN + "import os\nos.system('echo from a child process')\n")
    res = _torchmem("run", "--json", "--no-host", "-o", "j.tmtrace", "train.py", "a", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)  # stdout holds the JSON document and nothing else
    assert data["final_live"] == {"cpu": 4000} and data["peak"] == {"cpu": 4000}
    # the script's output (Python's print and a child process's) went to stderr
    assert "script says hello ['a'] __main__" in res.stderr and "{not json" in res.stderr
    assert "from a child process" in res.stderr


def test_a_script_that_does_not_compile_gets_pythons_error_and_no_trace(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("import torch\nx = (\nprint(x)\n")
    res = _torchmem("run", "-o", "bad.tmtrace", "bad.py", cwd=tmp_path)
    assert res.returncode == 1
    assert "SyntaxError: '(' was never closed" in res.stderr and 'bad.py", line 2' in res.stderr
    assert not (tmp_path / "bad.tmtrace").exists()
    assert "next:" not in res.stdout + res.stderr and "trace written" not in res.stdout + res.stderr
    assert "Traceback" not in res.stderr  # Python's own message for a syntax error has none


def test_run_refuses_ambiguous_or_wrong_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "t.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    assert main(["run", "--example", str(script)]) == 2
    err = capsys.readouterr().err
    assert "pass either --example or a script to run, not both" in err
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main(["run", str(folder)]) == 2
    assert "is a directory with no __main__.py" in capsys.readouterr().err
    assert main(["run", "-m"]) == 2 and "expected a module name after -m" in capsys.readouterr().err
    assert not marker.exists()
    # a folder with a __main__.py runs it, as python does
    (folder / "__main__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    out = tmp_path / "f.tmtrace"
    assert main(["run", "--quiet", "--no-host", "-o", str(out), str(folder)]) == 0
    assert marker.exists() and out.exists()


@pytest.mark.parametrize("cmd", ["stats", "peak", "trace", "flame", "view", "summary", "diff"])
def test_a_directory_or_a_png_given_as_a_file_says_what_it_is(
    cmd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "snaps"
    folder.mkdir()
    extra = [str(folder)] if cmd == "diff" else []
    assert main([cmd, str(folder), *extra]) == 2
    err = capsys.readouterr().err
    assert f"{folder}: is a directory" in err and "Traceback" not in err
    # a real PNG (torchmem's own timeline plot) renamed .pickle
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    fake = tmp_path / "memory.pickle"
    fake.write_bytes(png)
    if cmd == "summary":  # summary reads traces only: it says so for a pickle too
        return
    assert main([cmd, str(fake), *([str(fake)] if cmd == "diff" else [])]) == 2
    err = capsys.readouterr().err
    assert f"{fake}: not a pickle (a PNG image" in err and "persistent" not in err


def test_ledger_shows_a_target_process_not_itself(capsys: pytest.CaptureFixture[str]) -> None:
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 * 2**20); input()"],
                             stdin=subprocess.PIPE)
    try:
        proc = psutil.Process(child.pid)
        for _ in range(100):  # until the child has touched its 64 MiB
            if proc.memory_info().rss > 64 * 2**20:
                break
            __import__("time").sleep(0.05)
        assert main(["ledger", "--device", "cpu", "--json", "--pid", str(child.pid)]) == 0
        r = json.loads(capsys.readouterr().out)["readings"][0]
        rss = proc.memory_info().rss
        assert r["pid"] == child.pid and r["pid_measure"] == "rss" and "process" not in r
        assert r["pid_bytes"] > 64 * 2**20 and abs(r["pid_bytes"] - rss) < 8 * 2**20
        assert main(["ledger", "--device", "cpu", "--pid", str(child.pid)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"pid {child.pid}" in out[0] and "MiB" in out[1]
    finally:
        child.kill()
        child.wait()
    # without --pid there is no column of this command's own memory
    assert main(["ledger", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "process" not in out and "pid" not in out
    assert main(["ledger", "--pid", str(2**22 + 12345)]) == 2
    assert "no such process" in capsys.readouterr().err


def test_long_call_sites_are_shortened_never_split() -> None:
    from torchmem.analysis.summary import summarize_trace
    from torchmem.model.events import EventKind
    from torchmem.model.trace import Trace
    from torchmem.render.summary import render_summary

    site = ("/opt/conda/envs/research/projects/some-very-long-project-name/src/models/"
            "transformer_blocks/multi_head_attention_layer.py:1234:scaled_dot_product_forward")
    tr = Trace()
    tr.append(EventKind.ALLOC, 0, "cpu", 4096, 1, op="aten::mm", stack=("train.py:1:main", site))
    buf = io.StringIO()
    render_summary(summarize_trace(tr), buf)
    text = buf.getvalue()
    rows = [ln for ln in text.splitlines() if "multi_head_attention_layer.py" in ln]
    assert len(rows) == 1  # one line: not wrapped
    # the file's last part, the line and the function, whole (":1234:" is no emoji code either)
    assert " .../multi_head_attention_layer.py:1234:scaled_dot_product_forward " in " " + rows[0]
    assert "4.00 KiB" in rows[0]
    # JSON keeps the whole path
    assert json.loads(json.dumps(summarize_trace(tr).to_dict()))["top_stacks_at_peak"][0]["name"] == site


def test_a_module_that_does_not_compile_gets_pythons_error_and_no_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("def f(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "-o", "b.tmtrace", "-m", "brokenpkg.train"]) == 1
    err = capsys.readouterr().err
    assert "SyntaxError" in err and "train.py" in err and "tracking" not in err
    assert not (tmp_path / "b.tmtrace").exists()
    other = tmp_path / "failingpkg"
    other.mkdir()
    (other / "__init__.py").write_text("raise RuntimeError('package init failed')\n")
    (other / "train.py").write_text("x = 1\n")
    assert main(["run", "-m", "failingpkg.train"]) == 2
    err = capsys.readouterr().err
    assert "importing its package failed: RuntimeError: package init failed" in err
    assert "internal error" not in err
