"""``torchmem ledger``: one reading, polling with --json, and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from torchmem.cli import main


def test_one_reading_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ledger", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cpu = next(r for r in data["readings"] if r["device"] == "cpu")
    assert cpu["total"] == psutil.virtual_memory().total
    assert cpu["free"] == cpu["total"] - cpu["used"] and cpu["source"] == "psutil"


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ledger", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["device", "total", "used", "used"]
    assert out[1].startswith("cpu ") and "psutil" in out[1]


def test_poll_json_gives_distinct_background_readings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ledger", "--poll", "0.6", "--interval", "0.1", "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    times = [r["time"] for r in data["readings"]]
    assert len(times) >= 2 and len(set(times)) == len(times)  # each reading is a new one
    assert times == sorted(times)
    assert data["interval"] == 0.1 and data["seconds"] == 0.6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "expected a device such as"),
        (["--device", "cuda:5"], "not available here"),
        (["--interval", "0", "--poll", "1"], "--interval > 0"),
    ],
)
def test_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ledger", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("torchmem ledger: error:")


def test_error_in_a_real_process_has_no_traceback() -> None:
    out = subprocess.run([sys.executable, "-m", "torchmem", "ledger", "--device", "cuda:5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "not available here" in out.stderr and "Traceback" not in out.stderr
