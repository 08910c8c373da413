"""A language model whose head shares the embedding's weight (tied): under mixed precision
the weight is read whole by the embedding (float32) and by the head's cast (bf16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


class TiedLM(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.mix(self.embed(idx)))
        return F.linear(h, self.embed.weight)  # the tied head


def workload(batch_size: int = 8, vocab: int = 32, hidden: int = 16, seq_len: int = 4) -> Workload:
    torch.manual_seed(0)
    model = TiedLM(vocab, hidden)
    idx = torch.randint(0, vocab, (batch_size, seq_len))
    target = torch.randint(0, vocab, (batch_size, seq_len))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return Workload(model, (idx,), loss_fn=loss_fn, example_target=target)
