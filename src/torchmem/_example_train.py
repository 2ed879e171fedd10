"""A small, self-contained training run used by ``torchmem run --example`` (no downloads).

A two-layer MLP classifier trained for a few steps with Adam on random data. Run it under the
tracker to see parameters, gradients, Adam's optimizer state, activations and temporaries.

Example:
    >>> from torchmem._example_train import main
    >>> losses = main(steps=2, batch=8)
    >>> len(losses)
    2
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["main", "build_model"]


def build_model(width: int = 256, classes: int = 10) -> nn.Module:
    """The example's model: ``Linear -> GELU -> Linear -> GELU -> Linear``.

    Example:
        >>> sum(p.numel() for p in build_model(8, 2).parameters()) == (64*8+8) + (8*8+8) + (8*2+2)
        True
    """
    return nn.Sequential(
        nn.Linear(64, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, classes),
    )


def main(steps: int = 4, batch: int = 64, seed: int = 0) -> list[float]:
    """Train for ``steps`` steps with Adam; returns the losses.

    Example:
        >>> main(steps=1, batch=4)[0] > 0
        True
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    for _ in range(steps):
        x = torch.randn(batch, 64, generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


if __name__ == "__main__":
    print(main())
