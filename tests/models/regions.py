"""Regions of forward under context managers, which export wraps in submodules of their own:
``torch.autocast(enabled=False)`` (as Llama computes its rotary embedding) and
``torch.no_grad()`` (a statistic that must not train)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


class Regions(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            h = F.relu(self.up(x.float()))
        with torch.no_grad():
            scale = h.abs().mean(dim=-1, keepdim=True) + 1.0  # no gradient flows through it
        return self.down(h / scale)


def workload(batch_size: int = 64, hidden: int = 32, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = Regions(hidden)
    return Workload(
        model, (torch.randn(batch_size, hidden),), F.mse_loss, torch.randn(batch_size, hidden)
    )
