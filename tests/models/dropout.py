"""Randomness in forward: noise on a weight drawn with `torch.rand_like` (planned whole on
every rank under data parallelism) and dropout with p > 0 on the activations (planned split).

The loss is the mean square of the dropped-out activations, whose expectation is
``mean(h**2) / (1 - p)``: the rate shows in the loss, whatever the masks drawn."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


class Dropping(nn.Module):
    def __init__(self, hidden: int, p: float, noise: float) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.p = p
        self.noise = noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.up.weight
        if self.noise:  # weight noise: uniform in [1 - noise, 1 + noise)
            weight = weight * (1 + self.noise * (2 * torch.rand_like(weight) - 1))
        return F.dropout(F.linear(x, weight, self.up.bias), self.p, self.training)


def squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def workload(
    batch_size: int = 64, hidden: int = 256, p: float = 0.25, noise: float = 0.0, seed: int = 0
) -> Workload:
    torch.manual_seed(seed)
    model = Dropping(hidden, p, noise)
    x = torch.randn(batch_size, hidden)
    return Workload(model, (x,), squared, torch.zeros(batch_size, hidden))
