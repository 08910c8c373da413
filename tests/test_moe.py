"""Mixtures of experts (examples/moe.py): the planner finds expert parallelism by itself.

A GShard MoE layer (8 experts, d 1024, hidden 4096, top-1) on one 8-GPU A100 node: splitting
the experts across the GPUs and moving tokens to them by all-to-all beats replicating them.
Training under such plans is checked against one process in tests/test_distributed.py
(moe-own, moe-top2-ep, moe-top2-2x2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autoplan
from autoplan import PlanOptions
from autoplan.graph.capture import capture
from autoplan.search.step_price import summed_gradient
from autoplan.strategies.rules import own_rule
from examples.gpt import GPTConfig
from examples.moe import MoE, MoEConfig

ROOT = Path(__file__).resolve().parents[1]


def _layer(batch: int = 32, seq: int = 1024, dim: int = 1024) -> autoplan.Workload:
    cfg = MoEConfig(GPTConfig(1, dim, 16, 128, seq), experts=8, hidden=4 * dim, top_k=1)
    with torch.device("meta"):
        layer = MoE(dim, cfg)
        x, y = torch.randn(batch, seq, dim), torch.randn(batch, seq, dim)
    return autoplan.Workload(layer, (x,), _output_loss, y)


def _output_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output[0], target)


@pytest.fixture(scope="module")
def expert_plan() -> autoplan.Plan:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    return _layer().plan(cluster, PlanOptions(mesh_shape=(8,)))


def test_experts_are_split_across_the_gpus(expert_plan: autoplan.Plan) -> None:
    storage = {name: p.storage["dp"] for name, p in expert_plan.params.items()}
    assert storage == {"w_in": "S(0)", "w_out": "S(0)", "gate.weight": "R"}


def test_tokens_reach_their_experts_by_all_to_all(expert_plan: autoplan.Plan) -> None:
    kinds = [(c.kind, c.phase) for c in expert_plan.collectives]
    assert ("all_to_all", "forward") in kinds and ("all_to_all", "backward") in kinds
    # one bucket of gradients, the gate's: each GPU's experts train on its own
    (bucket,) = [c for c in expert_plan.collectives if c.phase == "grad_sync"]
    assert bucket.kind == "all_reduce" and bucket.params == ("p_model_gate_weight",)


def test_replicating_the_experts_is_priced_slower(expert_plan: autoplan.Plan) -> None:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    data_parallel = _layer().baseline(cluster, dp=8, tp=1)
    assert expert_plan.predicted.step_time_s < data_parallel.predicted.step_time_s


def test_einsum_rules_follow_the_subscripts() -> None:
    class Dispatch(torch.nn.Module):
        def forward(self, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("gsec,gsm->egcm", d, x).sum()

    graph = capture(Dispatch(), (torch.randn(2, 4, 2, 3), torch.randn(2, 4, 5)))
    (node,) = [n for n in graph if n.op == "aten.einsum.default"]
    rule = own_rule(node.op)
    assert rule is not None
    # per letter: c, e, g, m, s (sorted); s is contracted: partial sums
    assert rule(node, [graph.tensor(r) for r in node.refs]) == [
        ("S(2)", "S(3)", "R"),
        ("S(0)", "S(2)", "R"),
        ("S(1)", "S(0)", "S(0)"),
        ("S(3)", "R", "S(2)"),
        ("P", "S(1)", "S(1)"),
    ]


def test_a_tensor_read_whole_by_two_users_sums_their_gradients() -> None:
    # a user whose output is split sends a partial gradient: the sum is reduced once
    assert summed_gradient(("R", "S(0)"), ("P", "S(0)")) == ("P", "S(0)")
    assert summed_gradient(None, ("R",)) == ("R",)
