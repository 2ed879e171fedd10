"""``python -m mypkg.train``: the guides' module, the same build and script as ``train.py``."""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch


def build(batch_size: int, seq_len: int = 16, width: int = 64) -> Callable[[], None]:
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width))
    if torch.cuda.is_available():
        model = model.cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(batch_size, seq_len, width, device=next(model.parameters()).device)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:  # one rank of `torchmem run --nproc-per-node N`
        torch.distributed.init_process_group("gloo")
    step = build(2, width=args.width)
    for _ in range(2 * args.epochs):
        step()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
