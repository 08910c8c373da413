"""Expert parallelism of index-routed mixtures of experts (transformers' Mixtral, Qwen3-MoE,
DeepSeek-V3): the grouped matmul's expert split (strategies/grouped_mm.py, execute/experts.py).

Training under it is checked against one process on 4 gloo ranks in tests/test_distributed.py
(zoo-mixtral-baseline-ep, zoo-qwen3-moe-baseline-ep, zoo-deepseek-v3-baseline-ep,
zoo-mixtral-baseline-ep-2x2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import transformers.integrations.moe  # registers transformers' grouped matmul op

import autoplan
from autoplan import PlanOptions
from autoplan.execute.experts import local_grouped_mm
from autoplan.graph.flops import GROUPED_MMS
from autoplan.planfile.show import summary
from autoplan.strategies.rules import own_rule
from tests.distributed.cases import cluster
from tests.models.zoo import workload

ROOT = Path(__file__).resolve().parents[1]
FALLBACK = torch.ops.transformers.grouped_mm_fallback.default
GROUPED = torch.ops.aten._grouped_mm.default


def test_grouped_matmuls_split_their_experts_into_partial_sums() -> None:
    for op in GROUPED_MMS:
        rule = own_rule(op)
        assert rule is not None, op
        assert rule(None, []) == [("P", "R", "S(0)", "R")]  # type: ignore[arg-type]


@pytest.mark.parametrize("op", [FALLBACK, GROUPED], ids=["fallback", "aten"])
def test_ranks_experts_sum_to_the_whole_grouped_matmul(op: torch._ops.OpOverload) -> None:
    """4 ranks of 2 experts each: the sum of their outputs is the whole product, and their
    weights' gradients are the whole weight's, rank 1's experts routed no rows at all."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 5, 0, 0, 7, 1, 4, 4])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    w = torch.randn(8, 16, 8, requires_grad=True)
    g = torch.randn(x.shape[0], 8)
    whole = op(x, w, offs=offs)
    (whole * g).sum().backward()
    want_x, want_w = x.grad, w.grad
    x.grad = None
    shards = [w.detach()[r * 2 : r * 2 + 2].clone().requires_grad_() for r in range(4)]
    parts = [local_grouped_mm(op, (x, s), {"offs": offs}, r * 2) for r, s in enumerate(shards)]
    assert all(p.shape == whole.shape for p in parts)
    assert not parts[1].any()  # its experts got no rows: its part is all zeros
    torch.testing.assert_close(sum(parts), whole)
    (sum(parts) * g).sum().backward()
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(torch.cat([s.grad for s in shards]), want_w)


def test_baseline_ep_splits_index_routed_experts() -> None:
    """`baseline(ep=4)` of a tiny Mixtral: its 3-dim experts stored and used split, each
    grouped matmul's partial sums reduced in the plan's collectives, and said in show."""
    w = workload("mixtral", batch_size=16, seq_len=16)
    plan = w.baseline(cluster(4), dp=4, tp=1, ep=4)
    experts = {n: p for n, p in plan.params.items() if n.endswith(("gate_up_proj", "down_proj"))}
    assert len(experts) == 4
    assert all(p.storage == p.placements == {"tp": "S(0)"} for p in experts.values())
    grouped = {n: p for n, p in plan.nodes.items() if p.op in GROUPED_MMS}
    assert len(grouped) == 4
    assert all(p.output == {"tp": "P"} and p.inputs[1] == {"tp": "S(0)"} for p in grouped.values())
    # the partial sums reduced in forward: whole for the activation, split for the residual
    reduced = {c.tensor: c.kind for c in plan.collectives if c.phase == "forward"}
    assert {reduced.get(n) for n in grouped} == {"all_reduce", "reduce_scatter"}
    assert "experts split 4 ways on tp (each rank multiplies the rows routed to its experts" in (
        summary(plan)
    )


def test_planner_splits_the_experts_of_a_large_moe() -> None:
    """A Qwen3-MoE layer of 128 experts (top 8, in bfloat16: torch's grouped matmul) on one
    8-GPU H100 node: the planner stores and multiplies the experts split 8 ways, and its
    step is faster than data parallelism's and ZeRO-3's under the same cost model."""
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=1, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, vocab_size=4096, max_position_embeddings=512,
        attention_dropout=0.0,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        ids = torch.randint(0, 4096, (8, 512))
    w = autoplan.Workload(model, {"input_ids": ids, "labels": ids})
    h100 = autoplan.Cluster.load(ROOT / "costmodels/h100-sxm-8.json")
    plan = w.plan(h100, PlanOptions(pipeline=False, mesh_shape=(8,)))
    experts = [p for n, p in plan.params.items() if ".experts." in n]
    assert len(experts) == 2 and all(p.storage == {"tp": "S(0)"} for p in experts)
    grouped = [p for p in plan.nodes.values() if p.op == "aten._grouped_mm.default"]
    assert len(grouped) == 2 and all(p.output == {"tp": "P"} for p in grouped)
    step = plan.predicted.step_time_s
    for degrees in ({"dp": 8, "tp": 1}, {"dp": 8, "tp": 1, "zero_stage": 3}):
        assert step < w.baseline(h100, **degrees).predicted.step_time_s, degrees
