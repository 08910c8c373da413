"""Buffers that forward updates besides batch norm's: an MoE router's count of the tokens
routed to each expert (``histc`` over the batch, as load-balancing schemes such as
DeepSeek-V3's expert bias keep it) and a count of forward calls. Over a split batch each
rank counts its own tokens; the sum over the ranks is the count one process makes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


class Counting(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts)
        self.proj = nn.Linear(hidden, hidden)
        self.experts = experts
        self.register_buffer("tokens_per_expert", torch.zeros(experts))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x)
        chosen = scores.argmax(-1).float()
        self.tokens_per_expert += torch.histc(chosen, self.experts, 0, self.experts - 1)
        self.calls += 1
        return self.proj(x) * torch.sigmoid(scores).mean(-1, keepdim=True)


def workload(batch_size: int = 64, hidden: int = 32, experts: int = 4, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = Counting(hidden, experts)
    x = torch.randn(batch_size, hidden)
    return Workload(model, (x,), F.mse_loss, torch.randn(batch_size, hidden))
