"""A decoder-only transformer: token embedding, N blocks of causal attention + MLP, final norm and head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mbtune.workloads import Workload


class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def gpt(layers: int = 4, d_model: int = 128, heads: int = 4, seq_len: int = 64, vocab: int = 4096) -> Workload:
    """The built-in GPT-like workload; the defaults are sized for a quick CPU probe."""
    for key, value in {"layers": layers, "d_model": d_model, "heads": heads, "seq_len": seq_len, "vocab": vocab}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")

    def make_batch(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    # Matmul FLOPs per token, forward: 2 x (12 d^2 per layer + d x vocab) plus attention scores 2 x 2 x s x d
    # per layer (halved by the causal mask); training is 3x forward.
    forward_per_token = 2 * (12 * d_model**2 * layers + d_model * vocab) + 2 * seq_len * d_model * layers
    blocks: list[Callable[[], nn.Module]] = [lambda: Embedding(vocab, d_model, seq_len)]
    blocks += [lambda: Block(d_model, heads) for _ in range(layers)]
    blocks += [lambda: Head(d_model, vocab)]
    return Workload(
        name="gpt", blocks=blocks, make_batch=make_batch, loss=loss,
        flops_per_sample=3.0 * forward_per_token * seq_len, tokens_per_sample=seq_len,
        description=f"decoder-only transformer, {layers} layers, d_model {d_model}, {heads} heads, "
        f"seq {seq_len}, vocab {vocab}",
    )
