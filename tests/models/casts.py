"""What models from the wild do that our examples do not: dtype casts (each one leaves a
metadata check in the exported graph), a Python ``assert`` on values (Flaubert checks its
token counts so; it leaves ops on a symbolic scalar), a tensor made in forward from a Python
value (a lifted constant), and ops the sharding rules do not cover (planned replicated)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


class CastingClassifier(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert (x > -1e9).sum().item() <= x.numel()
        h = F.relu(self.up(x))
        h = h + torch.renorm(h, p=2, dim=1, maxnorm=1.0) * torch.tensor(0.01)  # no rule; a constant
        return self.head(h).double().float()  # casts, as `logits.float()` before a loss


def workload(batch_size: int = 8, hidden: int = 16, classes: int = 4, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = CastingClassifier(hidden, classes)
    x = torch.randn(batch_size, hidden)
    y = torch.randint(0, classes, (batch_size,))
    return Workload(model, (x,), F.cross_entropy, y)
