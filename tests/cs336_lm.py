"""The Stanford CS336 "basics" Transformer LM, written from ../shared/data/gpu-truth.md.

Not a test module: ``tests/test_gpu_truth.py`` rebuilds the two recorded GPU runs with it. Every
operation is written the way the description says (einsum linears, float32 RMSNorm, RoPE on the
two halves, a boolean causal mask applied with ``torch.where``, hand-written softmax and
cross-entropy, SwiGLU with ``x * sigmoid(x)``), because each operation's allocations are what
the recorded allocator traces show, one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    """Model sizes; :data:`SMALL` (MAGMA27's run) and :data:`XL` (notHanmin's)."""

    vocab_size: int
    context_length: int
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    rope_theta: float = 10000.0

    @property
    def parameters(self) -> int:
        """Number of parameters (embedding + LM head + per layer 4 d^2 + 3 d d_ff + 2 d + d)."""
        d, f = self.d_model, self.d_ff
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        return 2 * self.vocab_size * d + self.num_layers * per_layer + d


SMALL = Config(10000, 256, 768, 3072, 12, 12)
XL = Config(10000, 256, 1600, 6400, 48, 25)


class Linear(nn.Module):
    """``x @ W.T`` with ``W`` of shape (d_out, d_in), applied with einsum; no bias."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        with torch.no_grad():  # truncated normal (trunc_normal_ reads values: not under fakes)
            self.weight.normal_(0.0, std).clamp_(-3 * std, 3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    """Token embedding: a (vocab, d_model) table indexed by the ids."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d))
        with torch.no_grad():
            self.weight.normal_(0.0, 1.0).clamp_(-3.0, 3.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2, -1, keepdim) + eps) * weight``, computed in float32."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = x * rms
        return (out * self.weight).to(in_dtype)


class RoPE(nn.Module):
    """Rotary embedding on the two halves of each head, cos/sin cache (context, head_dim/2)."""

    def __init__(self, theta: float, head_dim: int, context: int) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, half = x.size(-2), x.size(-1) // 2
        cos, sin = self.cos[:t], self.sin[:t]
        x1, x2 = x[..., :half], x[..., half:]
        r1 = x1 * cos - x2 * sin
        r2 = x1 * sin + x2 * cos
        return torch.cat([r1, r2], dim=-1)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Subtract the max, ``exp``, divide by the sum."""
    x = x - x.max(dim=dim, keepdim=True).values
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``softmax(where(mask, q k^T / sqrt(d), -inf)) @ v``."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = torch.where(mask, scores, float("-inf"))
    return softmax(scores, dim=-1) @ v


class MultiHeadSelfAttention(nn.Module):
    """Causal self-attention with RoPE on q and k; ``rope=None`` builds one per call."""

    def __init__(self, cfg: Config, rope: RoPE | None) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.q_proj, self.k_proj, self.v_proj = Linear(d, d), Linear(d, d), Linear(d, d)
        self.output_proj = Linear(d, d)
        self.rope = rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.cfg.num_heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        rope = self.rope
        if rope is None:  # notHanmin: a RoPE module built anew in every attention forward
            rope = RoPE(self.cfg.rope_theta, d // h, self.cfg.context_length).to(x.device)
        q = rope(q)  # q's projection is dropped here, before k's rotation
        k = rope(k)
        pos = torch.arange(t, device=x.device)
        mask = pos[:, None] >= pos[None, :]
        out = attention(q, k, v, mask)
        out = out.transpose(1, 2).contiguous().view(b, t, d)
        return self.output_proj(out)


class SwiGLU(nn.Module):
    """``W2(silu(W1 x) * W3 x)`` with ``silu(x) = x * sigmoid(x)``."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(d, d_ff), Linear(d_ff, d), Linear(d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``."""

    def __init__(self, cfg: Config, rope: RoPE | None) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model)
        self.attn = MultiHeadSelfAttention(cfg, rope)
        self.ln2 = RMSNorm(cfg.d_model)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn_out = self.attn(self.ln1(x))  # kept until the block returns
        x = x + attn_out
        ffn_out = self.ffn(self.ln2(x))
        return x + ffn_out


class TransformerLM(nn.Module):
    """Embedding, ``num_layers`` blocks, final RMSNorm, untied LM head.

    ``shared_rope=True``: one RoPE cache shared by all layers (MAGMA27); ``False``: each
    attention forward builds its own (notHanmin).
    """

    def __init__(self, cfg: Config, shared_rope: bool = True) -> None:
        super().__init__()
        self.token_embeddings = Embedding(cfg.vocab_size, cfg.d_model)
        rope = RoPE(cfg.rope_theta, cfg.d_model // cfg.num_heads, cfg.context_length)
        self.rope = rope if shared_rope else None
        self.layers = nn.ModuleList(
            Block(cfg, rope if shared_rope else None) for _ in range(cfg.num_layers)
        )
        self.ln_final = RMSNorm(cfg.d_model)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Subtract the max, then the log of the sum of exps."""
    m = x.max(dim=dim, keepdim=True).values
    x = x - m  # the shifted logits reuse the argument's name: freed before m at return
    return x - torch.log(torch.exp(x).sum(dim=dim, keepdim=True))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Hand-written cross-entropy: ``-log_softmax``, gather the target, mean."""
    nll = -log_softmax(logits, dim=-1)
    return nll.gather(-1, targets.unsqueeze(-1)).mean()


class AdamW(torch.optim.Optimizer):
    """AdamW written by hand with ``exp_avg`` and ``exp_avg_sq`` per parameter (notHanmin's)."""

    def __init__(
        self,
        params: object,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["t"] += 1
                t = state["t"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                step = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-step)
                p.mul_(1 - lr * wd)


def build_magma27(batch: int) -> Any:
    """MAGMA27's recorded step (gpu-truth.md): fp32 forward, hand-written cross-entropy and
    backward, no zero_grad and no optimizer; ``torchmem.estimate``'s ``build`` protocol."""
    model = TransformerLM(SMALL).to("cuda")
    data = torch.randint(0, 10000, (batch, 256), device="cuda")
    targets = torch.randint(0, 10000, (batch, 256), device="cuda")
    g: dict[str, torch.Tensor] = {}

    def step() -> None:
        g["logits"] = model(data)
        g["loss"] = cross_entropy(g["logits"], targets)
        g["loss"].backward()

    return step


def nothanmin_step(model: TransformerLM, opt: AdamW, ids: torch.Tensor, g: dict) -> None:
    """notHanmin's training iteration (gpu-truth.md): a bf16-autocast forward, ``logits.sum()``
    outside autocast, ``zero_grad``, backward, the AdamW step."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        g["logits"] = model(ids)
    g["loss"] = g["logits"].sum()
    opt.zero_grad()
    g["loss"].backward()
    opt.step()


def build_nothanmin(batch: int) -> Any:
    """notHanmin's "xl" LM, AdamW and ids; ``torchmem.estimate``'s ``build`` protocol."""
    model = TransformerLM(XL, shared_rope=False).to("cuda")
    opt = AdamW(model.parameters())
    ids = torch.randint(0, 10000, (batch, 256), device="cuda")
    g: dict[str, torch.Tensor] = {}
    return lambda: nothanmin_step(model, opt, ids, g)
