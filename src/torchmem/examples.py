"""Small built-in example models (no downloads), shared by the CLI, tests and benchmarks.

- ``mlp``: 8 x ``Linear(256, 256)`` with ReLU, 2,105,344 bytes of float32 parameters;
- ``transformer``: a 2-layer ``TransformerEncoder`` (d_model 64) under ``encoder.``, so names
  look like ``encoder.layers.0.linear1.weight``;
- ``tied-lm``: a tiny language model whose output head is tied to the embedding, with a buffer
  ``embed_t`` that is a transposed *view* of the embedding weight and a buffer ``pos_slice``
  that views part of another buffer: shared storage everywhere.

Example:
    >>> import torchmem
    >>> [name for name, _ in list_examples()]
    ['mlp', 'transformer', 'tied-lm']
    >>> m = build_example("tied-lm")
    >>> m.head.weight is m.embed.weight, torchmem.same_storage(m.embed_t, m.embed.weight)
    (True, True)
"""

from __future__ import annotations

import torch
from torch import nn

from torchmem.errors import InvalidInputError

__all__ = ["build_example", "list_examples", "example_input", "train_step", "TiedLM"]


class TiedLM(nn.Module):
    """Embedding -> Linear -> output head tied to the embedding; buffers that view parameters.

    Example:
        >>> import torch
        >>> m = TiedLM(vocab=50, dim=8, context=4)
        >>> m(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 50])
    """

    def __init__(self, vocab: int = 1000, dim: int = 64, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied weights: one Parameter, two names
        pos = torch.randn(context, dim) * 0.02
        self.register_buffer("pos", pos)
        self.register_buffer("pos_slice", pos[: context // 2])  # a buffer viewing a buffer
        self.register_buffer("embed_t", self.embed.weight.detach().t())  # views a parameter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = self.get_buffer("pos")
        x = self.embed(tokens) + pos[: tokens.shape[-1]]
        return self.head(self.body(x))


class _Transformer(nn.Module):
    def __init__(self, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=2 * d_model,
                                           batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


_EXAMPLES = {
    "mlp": "8 x Linear(256, 256) with ReLU (2 MiB of float32 parameters)",
    "transformer": "2-layer TransformerEncoder, d_model 64 (names like encoder.layers.0.linear1.weight)",
    "tied-lm": "tiny LM: head tied to the embedding, buffers that view parameters and buffers",
}


def list_examples() -> list[tuple[str, str]]:
    """``(name, description)`` of each built-in example.

    Example:
        >>> dict(list_examples())["mlp"]
        '8 x Linear(256, 256) with ReLU (2 MiB of float32 parameters)'
    """
    return list(_EXAMPLES.items())


def build_example(name: str = "tied-lm", *, seed: int = 0) -> nn.Module:
    """Build a built-in example model by name (deterministic for a given ``seed``).

    Example:
        >>> m = build_example("mlp")
        >>> sum(p.numel() * p.element_size() for p in m.parameters())
        2105344
    """
    if name not in _EXAMPLES:
        raise InvalidInputError(
            f"unknown example {name!r}; expected one of: {', '.join(_EXAMPLES)}"
        )
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        if name == "mlp":
            layers: list[nn.Module] = []
            for i in range(8):
                layers.append(nn.Linear(256, 256))
                if i < 7:
                    layers.append(nn.ReLU())
            return nn.Sequential(*layers)
        if name == "transformer":
            return _Transformer()
        return TiedLM()
    finally:
        torch.random.set_rng_state(gen_state)


def example_input(name: str, batch: int = 2) -> torch.Tensor:
    """An input batch for example ``name``.

    Example:
        >>> example_input("mlp").shape
        torch.Size([2, 256])
    """
    if name == "mlp":
        return torch.randn(batch, 256)
    if name == "transformer":
        return torch.randn(batch, 8, 64)
    if name == "tied-lm":
        return torch.randint(0, 1000, (batch, 16))
    raise InvalidInputError(f"unknown example {name!r}; expected one of: {', '.join(_EXAMPLES)}")


def train_step(name: str, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One forward/backward/step on ``example_input(name)``: fills ``.grad`` and optimizer state.

    Example:
        >>> import torch
        >>> m = build_example("mlp"); opt = torch.optim.Adam(m.parameters())
        >>> train_step("mlp", m, opt)
        >>> sorted(opt.state[m[0].weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    out = module(example_input(name))
    out.float().pow(2).mean().backward()
    optimizer.step()
