"""Shared pytest fixtures and GPU/browser skip logic."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    no_browser = pytest.mark.skip(reason="needs Debian's chromium (run scripts/test.sh to install)")
    have_chromium = shutil.which("chromium") is not None
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "browser" in item.keywords and not have_chromium:
            item.add_marker(no_browser)


@pytest.fixture
def data_dir() -> Path:
    return DATA
