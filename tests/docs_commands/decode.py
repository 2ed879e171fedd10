"""The guides' ``decode.py:build``: a decoding loop whose KV cache is ``k_cache``/``v_cache``."""

from __future__ import annotations

from typing import Callable

import torch


class Decoder(torch.nn.Module):
    def __init__(self, width: int = 64, max_len: int = 32, batch: int = 2) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, 3 * width)
        self.register_buffer("k_cache", torch.zeros(batch, max_len, width))
        self.register_buffer("v_cache", torch.zeros(batch, max_len, width))

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        q, k, v = self.proj(x).chunk(3, dim=-1)
        self.k_cache[:, pos] = k
        self.v_cache[:, pos] = v
        att = torch.softmax(q[:, None] @ self.k_cache[:, :pos + 1].transpose(1, 2), dim=-1)
        return (att @ self.v_cache[:, :pos + 1])[:, 0]


def build(batch_size: int = 2) -> Callable[[], None]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = Decoder(batch=batch_size).to(dev)

    @torch.no_grad()
    def step() -> None:
        x = torch.randn(batch_size, 64, device=dev)
        for pos in range(8):
            x = model(x, pos)

    return step
