"""The guides' ``train.py``: a build function and a script (``--epochs``, ``--batch-size``, ``--lr``)."""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch


def build(batch_size: int, seq_len: int = 16, width: int = 64) -> Callable[[], None]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, width)).to(dev)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, seq_len, width, device=dev)

    def step() -> None:
        model(x).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # one rank of `torchmem run --nproc-per-node N`
        torch.distributed.init_process_group("gloo")
    step = build(args.batch_size, width=args.width)
    for _ in range(2 * args.epochs):
        step()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
