"""Predicted memory against torch's own accounting: a plan on one device against one training
step's peak of live tensors under MemTracker (benchmarks/memory_truth.py; its results file
has every model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoplan import Workload
from autoplan.modes import NodeKind
from benchmarks.memory_truth import MODELS, measured_peak, predicted_peak

TOLERANCE = 0.05  # benchmarks/results/memory_truth.md: every model measured is within it


@pytest.mark.parametrize("model", ["mlp", "gpt-tiny", "zoo-cnn"])
def test_predicted_peak_is_measured_peak(model: str) -> None:
    w = MODELS[model]()
    predicted = predicted_peak(w)
    measured = measured_peak(w)["Total"]
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.gelu(self.up(x))
        return torch.softmax(self.down(g), -1).sum() + g.sum()


def test_saved_tensors_are_what_autograd_saves() -> None:
    """GELU keeps its input (freed by its backward), the linear after it GELU's output; a
    softmax keeps its output; the last linear's output, the sums and the add keep nothing."""
    graph = Workload(_Block(), (torch.randn(4, 8),)).trace()
    kept = {n.name: (n.kept, n.kept_by) for n in graph if n.kind == NodeKind.OP}
    assert kept == {
        "linear": ((0,), "gelu"),
        "gelu": ((0,), "linear_1"),
        "linear_1": ((), ""),
        "softmax": ((0,), "softmax"),
        "sum_1": ((), ""),
        "sum_2": ((), ""),
        "add": ((), ""),
    }
