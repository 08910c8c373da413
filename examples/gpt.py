"""A GPT-2 style decoder, sizes from a toy up to GPT-3 175B.

Attention is F.scaled_dot_product_attention; ``attention="eager"`` computes it as separate ops
instead, softmax(Q K^T / sqrt(d), causally masked) V, as Megatron-LM's core attention (what
selective recomputation recomputes).

Large sizes are built on the meta device (no memory) and are meant for planning:

    autoplan plan examples/gpt.py --cluster costmodels/dgx-a100-80gb.json --nodes 8 \
        --set size=175b --set device=meta
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    dim: int
    num_heads: int
    vocab_size: int
    seq_len: int
    eager_attention: bool = False  # separate ops, not F.scaled_dot_product_attention
    fused_qkv: bool = False  # one qkv projection, then split (nanoGPT, HF GPT-2)
    # grouped-query attention's key-value heads (None: one per query head); fused, its q|k|v
    # are pieces of unequal widths
    num_kv_heads: int | None = None


# GPT-3 paper sizes (Brown et al. 2020, table 2.1); vocabulary padded to a multiple of 64
SIZES = {
    "tiny": GPTConfig(num_layers=2, dim=64, num_heads=4, vocab_size=128, seq_len=16),
    "small": GPTConfig(num_layers=4, dim=256, num_heads=8, vocab_size=1024, seq_len=64),
    "125m": GPTConfig(num_layers=12, dim=768, num_heads=12, vocab_size=50304, seq_len=2048),
    "350m": GPTConfig(num_layers=24, dim=1024, num_heads=16, vocab_size=50304, seq_len=2048),
    "1.3b": GPTConfig(num_layers=24, dim=2048, num_heads=16, vocab_size=50304, seq_len=2048),
    # Megatron-LM's 1.7B, 3.6B and 7.5B (Narayanan et al. 2021, table 1)
    "1.7b": GPTConfig(num_layers=24, dim=2304, num_heads=24, vocab_size=51200, seq_len=2048),
    "3.6b": GPTConfig(num_layers=30, dim=3072, num_heads=32, vocab_size=51200, seq_len=2048),
    "7.5b": GPTConfig(num_layers=36, dim=4096, num_heads=32, vocab_size=51200, seq_len=2048),
    "2.7b": GPTConfig(num_layers=32, dim=2560, num_heads=32, vocab_size=50304, seq_len=2048),
    "7b": GPTConfig(num_layers=32, dim=4096, num_heads=32, vocab_size=50304, seq_len=2048),
    "13b": GPTConfig(num_layers=40, dim=5120, num_heads=40, vocab_size=50304, seq_len=2048),
    "175b": GPTConfig(num_layers=96, dim=12288, num_heads=96, vocab_size=50304, seq_len=2048),
    # Megatron-LM's largest (Narayanan et al. 2021, table 1): 1.0T parameters
    "1t": GPTConfig(num_layers=128, dim=25600, num_heads=160, vocab_size=51200, seq_len=2048),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.eager = cfg.eager_attention
        # separate projections (as in torchtitan's Llama), or one fused as nanoGPT writes it
        # (``qkv="fused"``: split by heads only as a strided split, docs/parallelisms.md);
        # no biases: the key bias has an exactly zero gradient (softmax ignores a constant
        # added to every key), whose rounding noise Adam would amplify into real updates
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        kv = cfg.dim // cfg.num_heads * self.num_kv_heads
        self.pieces: int | list[int] = cfg.dim if kv == cfg.dim else [cfg.dim, kv, kv]
        self.qkv = nn.Linear(cfg.dim, cfg.dim + 2 * kv, bias=False) if cfg.fused_qkv else None
        if self.qkv is None:
            self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.k = nn.Linear(cfg.dim, kv, bias=False)
            self.v = nn.Linear(cfg.dim, kv, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = (
            self.qkv(x).split(self.pieces, dim=2) if self.qkv else (self.q(x), self.k(x), self.v(x))
        )
        q, k, v = (p.view(b, t, -1, c // self.num_heads).transpose(1, 2) for p in qkv)
        if self.num_kv_heads != self.num_heads:  # each key-value head read by a group
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.eager:
            scores = q @ k.transpose(-2, -1) * (c // self.num_heads) ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``make_mlp(cfg)`` builds each block's feed-forward layer (examples/moe.py passes a
    mixture of experts)."""

    def __init__(self, cfg: GPTConfig, make_mlp: Callable[[GPTConfig], nn.Module] = MLP) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, make_mlp(cfg)) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))


def workload(
    size: str = "tiny",
    batch_size: int = 8,
    seq_len: int | None = None,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    num_heads: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    attention: str = "fused",
    qkv: str = "separate",
    num_kv_heads: int | None = None,
) -> Workload:
    if size not in SIZES:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {', '.join(SIZES)}")
    if attention not in ("fused", "eager"):
        raise ValueError(f"attention must be 'fused' or 'eager', got {attention!r}")
    if qkv not in ("separate", "fused"):
        raise ValueError(f"qkv must be 'separate' or 'fused', got {qkv!r}")
    if num_kv_heads is not None and attention == "eager":
        raise ValueError("num_kv_heads is for attention='fused' (grouped-query attention)")
    cfg = SIZES[size]
    cfg = GPTConfig(
        num_layers=num_layers or cfg.num_layers,
        dim=cfg.dim,
        num_heads=num_heads or cfg.num_heads,
        vocab_size=vocab_size or cfg.vocab_size,
        seq_len=seq_len or cfg.seq_len,
        eager_attention=attention == "eager",
        fused_qkv=qkv == "fused",
        num_kv_heads=num_kv_heads,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg).to(getattr(torch, dtype))
        idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
        target = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
    return Workload(model, (idx,), gpt_loss, target)
