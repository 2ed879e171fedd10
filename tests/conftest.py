"""Shared pytest fixtures and GPU/browser skip logic."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
# the stand-ins of the documented command lines are scripts, not tests (test_docs_examples.py)
collect_ignore = ["docs_commands"]


#: tests that walk the whole Python heap (why_alive's searches): they run first, while each
#: worker's heap is small; late in a run, after the other tests imported transformers and the
#: rest, the same searches take about four times as long (test_why_alive.py: 29 s alone, 131 s
#: at the end of a full run)
_HEAP_WALKERS = ("tests/test_why_alive.py", "src/torchmem/capture/retention.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = [it for it in items if it.nodeid.startswith(_HEAP_WALKERS)]
    if first:  # the same order on every xdist worker: each sorts the same collected list
        items[:] = first + [it for it in items if not it.nodeid.startswith(_HEAP_WALKERS)]
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    no_browser = pytest.mark.skip(reason="needs Debian's chromium (run scripts/test.sh to install)")
    have_chromium = shutil.which("chromium") is not None
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "browser" in item.keywords and not have_chromium:
            item.add_marker(no_browser)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Debian chromium driven by Playwright; skips without either."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from test_viewer_browser import ARGS, CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def data_dir() -> Path:
    return DATA
