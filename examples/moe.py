"""A GPT whose feed-forward layers are mixtures of experts, written as GShard writes them
(Lepikhin et al. 2020): each sequence is a group of tokens; a softmax gate picks each token's
top-k experts; a token takes the next free slot of its expert's capacity (a cumulative sum)
or is dropped; dense one-hot dispatch and combine tensors move tokens to their experts' slots
and back with einsums, so the model traces with static shapes. Each layer adds Switch's
load-balancing loss (Fedus et al. 2021) to the language-model loss.

    autoplan run examples/moe.py --cluster costmodels/cpu-gloo-4.json --steps 3 --check

The 64-expert size is built on the meta device, for planning:

    autoplan plan examples/moe.py --cluster costmodels/dgx-a100-80gb.json --nodes 8 \\
        --set size=64e --set device=meta --set dtype=bfloat16 --set batch_size=64
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.gpt, from any directory

from autoplan import Workload
from examples.gpt import GPT, GPTConfig, gpt_loss

AUX_WEIGHT = 0.01  # of the load-balancing loss, as Switch Transformer


@dataclass(frozen=True)
class MoEConfig:
    gpt: GPTConfig
    experts: int
    hidden: int  # each expert's inner width
    top_k: int = 1
    capacity_factor: float = 1.25


SIZES = {
    "tiny": MoEConfig(GPTConfig(2, 64, 4, 128, 16), experts=4, hidden=128),
    "tiny-top2": MoEConfig(GPTConfig(2, 64, 4, 128, 16), experts=4, hidden=128, top_k=2),
    "small": MoEConfig(GPTConfig(4, 256, 8, 1024, 64), experts=8, hidden=1024, top_k=2),
    # GShard's 64-expert layers on a 1.3B-parameter GPT: 64 x 2 x 2048 x 8192 expert weights
    # a layer, 52B parameters in all
    "64e": MoEConfig(GPTConfig(24, 2048, 16, 50304, 2048), experts=64, hidden=8192, top_k=2),
}


class MoE(nn.Module):
    """Top-k routed experts over ``(groups, tokens, dim)`` inputs; returns the output and the
    layer's load-balancing loss."""

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(cfg.experts, dim, cfg.hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(cfg.experts, cfg.hidden, dim) / math.sqrt(cfg.hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, k = self.cfg.experts, self.cfg.top_k
        capacity = max(1, math.ceil(self.cfg.capacity_factor * k * x.shape[1] / experts))
        probs = torch.softmax(self.gate(x), dim=-1)  # (g, s, e)
        dispatch, combine, first = self._route(probs, capacity)
        # Switch: experts x sum over experts of (share of tokens sent) x (mean probability)
        aux = (probs.mean(dim=1) * first.mean(dim=1)).mean() * experts * experts
        tokens = torch.einsum("gsec,gsm->egcm", dispatch, x)  # to the experts' slots
        h = F.gelu(torch.einsum("egcm,emh->egch", tokens, self.w_in))
        out = torch.einsum("egch,ehm->egcm", h, self.w_out)
        return torch.einsum("gsec,egcm->gsm", combine, out), aux  # back, weighted by the gate

    def _route(
        self, probs: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch and combine tensors (g, s, e, capacity) and each token's first choice."""
        experts = self.cfg.experts
        remaining, used = probs, torch.zeros_like(probs[:, :1, :])  # slots taken per expert
        dispatch = combine = first = None
        for _ in range(self.cfg.top_k):
            choice = F.one_hot(remaining.argmax(dim=-1), experts).to(probs.dtype)  # (g, s, e)
            position = torch.cumsum(choice, dim=1) - 1 + used  # the slot each token would take
            used = used + choice.sum(dim=1, keepdim=True)
            kept = choice * (position < capacity).to(probs.dtype)  # past capacity: dropped
            slot = F.one_hot(position.clamp(0, capacity - 1).long(), capacity).to(probs.dtype)
            sent = kept.unsqueeze(-1) * slot
            weighted = (probs * kept).unsqueeze(-1) * slot
            dispatch = sent if dispatch is None else dispatch + sent
            combine = weighted if combine is None else combine + weighted
            first = choice if first is None else first
            remaining = remaining * (1 - choice)
        assert dispatch is not None and combine is not None and first is not None
        return dispatch, combine, first


class MoEGPT(GPT):
    """The GPT of examples/gpt.py with experts for MLPs; returns the logits and the mean of
    its layers' load-balancing losses."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg.gpt, lambda gpt: MoE(gpt.dim, cfg))

    def forward(self, idx: torch.Tensor) -> Any:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        aux = []
        for block in self.blocks:
            x = x + block.attn(block.ln1(x))
            y, balance = block.mlp(block.ln2(x))
            x = x + y
            aux.append(balance)
        return {"logits": self.head(self.ln_f(x)), "aux": torch.stack(aux).mean()}


def moe_loss(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return gpt_loss(output["logits"], target) + AUX_WEIGHT * output["aux"]


def workload(
    size: str = "tiny",
    batch_size: int = 8,
    seq_len: int | None = None,
    num_layers: int | None = None,
    experts: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
) -> Workload:
    if size not in SIZES:
        raise ValueError(f"unknown MoE size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = SIZES[size]
    gpt = GPTConfig(
        num_layers=num_layers or cfg.gpt.num_layers,
        dim=cfg.gpt.dim,
        num_heads=cfg.gpt.num_heads,
        vocab_size=cfg.gpt.vocab_size,
        seq_len=seq_len or cfg.gpt.seq_len,
    )
    cfg = MoEConfig(gpt, experts or cfg.experts, cfg.hidden, cfg.top_k, cfg.capacity_factor)
    torch.manual_seed(seed)
    with torch.device(device):
        model = MoEGPT(cfg).to(getattr(torch, dtype))
        idx = torch.randint(0, gpt.vocab_size, (batch_size, gpt.seq_len))
        target = torch.randint(0, gpt.vocab_size, (batch_size, gpt.seq_len))
    return Workload(model, (idx,), moe_loss, target)
