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
from autoplan.costmodel.step_price import summed_gradient
from autoplan.errors import AutoplanError
from autoplan.graph.capture import capture
from autoplan.strategies.rules import own_rule
from examples.gpt import GPTConfig
from examples.moe import MoE, MoEConfig

ROOT = Path(__file__).resolve().parents[1]


class _Layer(torch.nn.Module):
    """A projection (so that the tokens carry gradients, as inside a model), then experts."""

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.moe = MoE(dim, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.proj(x))[0]


# 8 sequences: the experts' weights outweigh the tokens' all-to-alls (at 32, data parallelism
# with ZeRO-2, its gathers hidden behind forward, is priced faster than GShard's plan)
def _layer(batch: int = 8, seq: int = 1024, dim: int = 1024) -> autoplan.Workload:
    cfg = MoEConfig(GPTConfig(1, dim, 16, 128, seq), experts=8, hidden=4 * dim, top_k=1)
    with torch.device("meta"):
        layer = _Layer(dim, cfg)
        x, y = torch.randn(batch, seq, dim), torch.randn(batch, seq, dim)
    return autoplan.Workload(layer, (x,), F.mse_loss, y)


@pytest.fixture(scope="module")
def a100x8() -> autoplan.Cluster:
    return autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")


@pytest.fixture(scope="module")
def expert_plan(a100x8: autoplan.Cluster) -> autoplan.Plan:
    return _layer().plan(a100x8, PlanOptions(mesh_shape=(8,)))


EXPERTS = {"moe.w_in", "moe.w_out"}


def _storage(plan: autoplan.Plan) -> dict[str, str]:
    (axis,) = plan.mesh.axes  # named by its role: dp, or tp where the experts split most
    return {name: p.storage[axis] for name, p in plan.params.items()}


@pytest.mark.slow
def test_experts_are_split_across_the_gpus(expert_plan: autoplan.Plan) -> None:
    storage = _storage(expert_plan)
    assert {storage[n] for n in EXPERTS} == {"S(0)"}
    assert storage["moe.gate.weight"] == "R"


def _tokens_move_by_all_to_all(plan: autoplan.Plan) -> None:
    """Experts split by expert, the tokens moved by the dispatch and combine all-to-alls in
    forward and backward (4 in all), and no other activation moved: only parameters and
    their gradients, and scalars (the loss)."""
    assert {storage for n, storage in _storage(plan).items() if n in EXPERTS} == {"S(0)"}
    moved = [c for c in plan.collectives if c.bytes > 8]
    dispatch, combine = "einsum_1", "einsum_3"  # the einsums that read the moved tokens
    assert sorted((c.kind, c.phase, c.node) for c in moved if c.kind == "all_to_all") == [
        ("all_to_all", "backward", dispatch),
        ("all_to_all", "backward", combine),
        ("all_to_all", "forward", dispatch),
        ("all_to_all", "forward", combine),
    ]
    params = {name for name, node in plan.nodes.items() if node.op == "param"}
    assert all(c.kind == "all_to_all" or c.params or c.tensor in params for c in moved)


def _gshard(plan: autoplan.Plan) -> None:
    """As Alpa's MoE layer test expects on a data x expert mesh: the tokens moved by
    all-to-all (`_tokens_move_by_all_to_all`), all-reduces of the other weights' gradients
    (in buckets), and nothing else but scalars (the loss)."""
    _tokens_move_by_all_to_all(plan)
    moved = [c for c in plan.collectives if c.bytes > 8]
    synced = [c for c in plan.collectives if c.phase == "grad_sync"]
    assert {c.kind for c in synced} == {"all_reduce"}
    assert sorted(p for c in synced for p in c.params) == [
        "p_model_moe_gate_weight",
        "p_model_proj_bias",
        "p_model_proj_weight",
    ]
    assert len(moved) == 4 + len(synced)


def test_tokens_reach_their_experts_by_all_to_all(expert_plan: autoplan.Plan) -> None:
    """The planner's plan moves the tokens to their experts and back by GShard's dispatch
    and combine all-to-alls, forward and backward, and moves no activation otherwise than
    by all-to-all (it may split the router's tokens another way than GShard, and store the
    projection split: ZeRO-3, gathered in forward, its gradient reduce-scattered)."""
    assert {s for n, s in _storage(expert_plan).items() if n in EXPERTS} == {"S(0)"}
    moved = [c for c in expert_plan.collectives if c.bytes > 8]
    sent = {(c.phase, c.node) for c in moved if c.kind == "all_to_all"}
    assert {(p, n) for p in ("forward", "backward") for n in ("einsum_1", "einsum_3")} <= sent
    params = {name for name, node in expert_plan.nodes.items() if node.op == "param"}
    assert all(c.kind == "all_to_all" or c.params or c.tensor in params for c in moved)


def test_gshard_baseline_is_what_alpa_expects(a100x8: autoplan.Cluster) -> None:
    _gshard(_layer().baseline(a100x8, dp=8, tp=1, ep=8))


def test_the_planner_is_as_fast_as_gshard_and_beats_replicated_experts(
    a100x8: autoplan.Cluster, expert_plan: autoplan.Plan
) -> None:
    gshard = _layer().baseline(a100x8, dp=8, tp=1, ep=8)
    replicated = _layer().baseline(a100x8, dp=8, tp=1)
    assert expert_plan.predicted.step_time_s <= gshard.predicted.step_time_s * 1.001
    assert gshard.predicted.step_time_s < replicated.predicted.step_time_s


def test_ep_is_refused_without_experts_or_when_it_does_not_divide(
    a100x8: autoplan.Cluster,
) -> None:
    with pytest.raises(AutoplanError, match="ep must be 1 or dp=8"):
        _layer().baseline(a100x8, dp=8, tp=1, ep=4)
    w = autoplan.Workload(
        torch.nn.Linear(8, 8), (torch.randn(8, 8),), F.mse_loss, torch.randn(8, 8)
    )
    with pytest.raises(AutoplanError, match="the model has none"):
        w.baseline(a100x8, dp=8, tp=1, ep=8)


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


def test_show_names_expert_and_sequence_splits_in_words(a100x8: autoplan.Cluster) -> None:
    from autoplan.planfile.show import summary
    from tests.conftest import example

    experts = summary(_layer().baseline(a100x8, dp=8, tp=1, ep=8))
    assert "experts split 8 ways on dp (all-to-alls carry the tokens): moe.w_in, moe.w_out" in (
        experts
    )
    cpu4 = autoplan.Cluster.load(ROOT / "costmodels/cpu-gloo-4.json")
    gpt = example("gpt", size="small", batch_size=8, num_layers=2)
    sequence = summary(gpt.baseline(cpu4, dp=1, tp=4, sequence_parallel=True))
    # the final norm too: the head is a column linear (the vocabulary split), gathered for
    assert "5 of 5 norms split along the sequence on tp" in sequence
    assert "vocabulary split 4 ways on tp: 1 embedding(s) looked up by rows, 1 loss(es)" in (
        sequence
    )
    assert "in words" not in summary(gpt.baseline(cpu4, dp=4, tp=1))  # nothing to say
