"""A multi-layer perceptron: Linear + ReLU blocks, MSE loss.

autoplan plan examples/mlp.py --cluster costmodels/cpu-gloo-4.json --set hidden=1024
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import Workload


class MLP(nn.Module):
    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def workload(
    batch_size: int = 64, hidden: int = 32, num_layers: int = 6, device: str = "cpu", seed: int = 0
) -> Workload:
    torch.manual_seed(seed)
    with torch.device(device):
        model = MLP(hidden, num_layers)
        x = torch.randn(batch_size, hidden)
        y = torch.randn(batch_size, hidden)
    return Workload(model, (x,), F.mse_loss, y)
