from __future__ import annotations

import subprocess
import sys

from torchmem import __version__
from torchmem.cli import main


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"torchmem {__version__}"


def test_unknown_subcommand(capsys) -> None:
    assert main(["definitely-not-a-command"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand" in err and "expected one of" in err


def test_python_dash_m() -> None:
    out = subprocess.run([sys.executable, "-m", "torchmem", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"torchmem {__version__}"


def test_unwritable_output_is_a_user_error_not_a_bug(tmp_path, capsys) -> None:
    import torchmem

    with torchmem.track() as tr:
        import torch

        keep = torch.zeros(4)
    trace_path = tmp_path / "t.tmtrace"
    tr.save(trace_path)
    assert keep.numel() == 4
    out = tmp_path / "missing-dir" / "x.png"
    assert main(["plot", str(trace_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No such file or directory" in err and str(out) in err and "bug" not in err
    assert not out.exists()
