"""Predicted memory against torch's own accounting: a plan on one device against one training
step's peak of live tensors under MemTracker (benchmarks/memory_truth.py; its results file
has every model)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autoplan
from autoplan import Cluster, Workload
from autoplan.costmodel.held import saved_copies
from autoplan.costmodel.peak import peak_bytes
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import ClusterFormatError
from autoplan.modes import NodeKind
from autoplan.planfile.show import summary
from autoplan.strategies.buckets import Bucket
from autoplan.strategies.placement import R, shard
from autoplan.strategies.space import Strategy
from benchmarks.memory_truth import CPU4, MODELS, ROOT, measured_peak, one_device, predicted_peak

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


class _Two(torch.nn.Module):
    """Two linears: the second's backward saves its input and its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x)).sum()


def _two(specs: dict[str, tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]]) -> Any:
    """The traced `_Two`, a `Pricer` on two CPU ranks and an assignment: every node
    replicated but those ``specs`` place (output, inputs)."""
    graph = Workload(_Two(), (torch.randn(4, 8),)).trace()
    pricer = Pricer(Cluster.load(CPU4), (2,), "adamw")
    whole = {n.name: ((R,), ((R,),) * len(n.refs)) for n in graph}
    assignment = {name: Strategy(*specs.get(name, spec)) for name, spec in whole.items()}
    return graph, assignment, pricer


def test_a_gathered_weight_that_backward_saves_is_held() -> None:
    """ZeRO-3: the second linear reads its weight, stored split, gathered, and saves it: the
    gathered copy (16 x 8 floats) is held from its forward to its backward."""
    split = {"p_model_down_weight": ((shard(0),), ())}
    graph, assignment, pricer = _two(split)
    copies = saved_copies(graph, assignment, pricer)
    assert copies.made == {"linear_1": 16 * 8 * 4}
    assert copies.unkept == {}
    # read as stored, the weight moves nothing and backward keeps the stored shard
    stored = {**split, "linear_1": ((R,), ((R,), (shard(0),)))}
    graph, assignment, pricer = _two(stored)
    assert saved_copies(graph, assignment, pricer).made == {}


def test_a_gathered_activation_is_held_in_place_of_its_shard() -> None:
    """Tensor parallelism: the first linear's output is split by features and the second
    reads it gathered: backward keeps the gathered 4 x 16 floats, not the shard (which only
    the second linear saved)."""
    specs = {
        "p_model_up_weight": ((shard(0),), ()),
        "linear": ((shard(1),), ((R,), (shard(0),))),
    }
    graph, assignment, pricer = _two(specs)
    copies = saved_copies(graph, assignment, pricer)
    assert copies.made == {"linear_1": 4 * 16 * 4}
    assert copies.unkept == {"linear": 4 * 8 * 4}


def test_gradient_buckets_are_held_throughout() -> None:
    """A bucket's buffer is held from forward on; its gradients leave backward's count when
    it is copied in. Both weights in one bucket: forward holds the buffer beside the
    activations, and the optimizer step holds the buffer in place of the gradients."""
    graph, assignment, pricer = _two({})
    grads = 8 * 16 * 4 * 2
    bucket = Bucket(("p_model_down_weight", "p_model_up_weight"), (0,), grads)
    unbucketed = peak_bytes(graph, assignment, pricer)
    bucketed = peak_bytes(graph, assignment, pricer, [bucket])
    # the peak is backward's last op, with every gradient made: the buffer comes on top
    assert bucketed == unbucketed + grads


def test_the_allocator_margin_is_taken_off_the_limit() -> None:
    """A device's allocator margin shrinks what a plan's tensors may hold; the plan records
    it, reads it back and shows it; a margin of the whole memory is refused."""
    cpu = one_device()
    assert cpu.device.allocator_margin == 0.0  # the CPU files have none
    device = dataclasses.replace(cpu.device, allocator_margin=0.25)
    cluster = dataclasses.replace(cpu, device=device)
    w = MODELS["mlp"]()
    plan = w.plan(cluster, autoplan.PlanOptions(memory_fraction=0.5))
    assert plan.predicted.memory_limit_bytes == cpu.device.memory_bytes * 0.5 * 0.75
    assert plan.predicted.allocator_margin == 0.25
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    assert "the allocator's margin of 25% taken off" in summary(plan)
    assert "allocator_margin" not in w.plan(cpu).to_json()  # plans without one read as before
    data = cluster.to_dict()
    data["device"]["allocator_margin"] = 1.0
    with pytest.raises(ClusterFormatError, match=r"allocator_margin must be a number in \[0, 1\)"):
        Cluster.from_dict(data)
    a100 = Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    assert a100.device.allocator_margin == 0.15  # its source: costmodels/README.md


class _GatedAttention(torch.nn.Module):
    """A softmax through a dropout that drops nothing (transformers' attention dropout at
    its default 0) into a product; a fused projection split into a gate and its value."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.dropout(torch.softmax(x @ x.transpose(-1, -2), -1), 0.0, training=True)
        gate, up = self.gate_up(weights @ x).split(32, -1)
        return (F.silu(gate) * up).sum()


def test_a_dropout_dropping_nothing_and_split_pieces_are_counted_as_torch_holds_them() -> None:
    """ATen returns such a dropout's input itself: a view, its output kept as the softmax's
    (once); the split's pieces get their gradients one by one (the product's backward makes
    its up's, not the gate's too). The predicted peak is the measured one."""
    w = Workload(_GatedAttention(), (torch.randn(8, 64, 16),))
    graph = w.trace()
    (dropout,) = [n for n in graph if n.op == "aten.dropout.default"]
    assert dropout.is_view and dropout.kept == ()
    predicted, measured = predicted_peak(w), measured_peak(w)["Total"]
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)
