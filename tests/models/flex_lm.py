"""A small causal transformer whose attention is FlexAttention, as torchtitan and transformers'
``attn_implementation="flex_attention"`` write it: a block mask made in forward by
``create_block_mask`` from a ``mask_mod`` (causal within a sliding window), a ``score_mod``
that reads the head index (ALiBi's slope per head), and grouped-query attention (fewer
key-value heads). ``autoplan run tests/models/flex_lm.py --cluster ... --check``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from autoplan import Workload

VOCAB, WINDOW = 64, 6


class FlexBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        heads = self.heads

        def alibi(score: torch.Tensor, bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor,
                  ki: torch.Tensor) -> torch.Tensor:  # fmt: skip
            return score - (hi + 1) / heads * (qi - ki)

        def sliding_window(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor,
                           ki: torch.Tensor) -> torch.Tensor:  # fmt: skip
            return (qi >= ki) & (qi - ki < WINDOW)

        mask = create_block_mask(sliding_window, None, None, s, s, device=x.device)
        a = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class FlexLM(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(FlexBlock(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def workload(batch_size: int = 8, seq_len: int = 16, kv_heads: int = 2) -> Workload:
    """Token ids, and the next tokens as targets."""
    torch.manual_seed(0)
    model = FlexLM(kv_heads=kv_heads)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return Workload(model, (tokens[:, :-1].clone(),), loss, tokens[:, 1:].clone())
