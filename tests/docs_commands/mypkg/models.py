"""``mypkg.models:make_model``: a model factory for ``torchmem inspect``."""

import torch


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
