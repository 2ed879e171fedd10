"""The profiler's own start/stop lines never reach the user's stderr (issue 12)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torchmem.capture._quiet import is_profiler_noise


def _stderr_of(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_plain_profiler_prints_the_lines_track_lite_hides() -> None:
    # ground truth: PyTorch's own profiler writes the session lines to fd 2 ...
    raw = _stderr_of("""
        import torch
        with torch.profiler.profile(profile_memory=True):
            torch.ones(10)
    """)
    noise = [ln for ln in raw.splitlines() if is_profiler_noise(ln)]
    if not noise:
        pytest.skip("this torch build's profiler prints no session lines: nothing to hide")
    assert any("profiler_start" in ln for ln in noise)
    # ... and under track_lite none of them reaches stderr, while the user's own lines do
    quiet = _stderr_of("""
        import sys, torch, torchmem
        print("before", file=sys.stderr, flush=True)
        with torchmem.track_lite() as tr:
            x = torch.ones(1000)
            print("inside", file=sys.stderr, flush=True)
        print("after", tr.peak()["cpu"], file=sys.stderr, flush=True)
    """)
    assert "profiler_start" not in quiet and "profiler_stop" not in quiet
    assert [ln for ln in quiet.splitlines() if ln in ("before", "inside", "after 4000")] == [
        "before", "inside", "after 4000"]


def test_lines_written_while_quiet_are_kept_in_order() -> None:
    err = _stderr_of("""
        import os
        from torchmem.capture._quiet import quiet_profiler
        with quiet_profiler():
            os.write(2, b"first\\n")
            os.write(2, b"USDT:2026-11-23 09:15:12 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\\n")
            os.write(2, b"second\\n")
        os.write(2, b"third\\n")
    """)
    assert err.splitlines() == ["first", "second", "third"]


@pytest.mark.parametrize(
    ("line", "noise"),
    [
        ("USDT:2026-11-23 09:15:12 13231:13231 SyncActivityProfilerHandler.cpp:59] profiler_stop", True),
        ("INFO:2026-11-23 09:15:12 1:1 CuptiActivityProfiler.cpp:241] CUDA versions", True),
        ("UserWarning: profiler_start is a word in my message", False),
        ("[W1123 CPUAllocator.cpp:245] Memory block of unknown size", False),
    ],
)
def test_noise_pattern(line: str, noise: bool) -> None:
    assert is_profiler_noise(line) is noise
