"""``path/to/model.py:build``: a (module, optimizer) pair for ``torchmem inspect``."""

from __future__ import annotations

import torch


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.Adam(model.parameters())
