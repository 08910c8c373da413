"""Expert parallelism of index-routed mixtures of experts (transformers' Mixtral, Qwen3-MoE,
DeepSeek-V3, torchtitan's MoE): the grouped matmul's expert split (strategies/grouped_mm.py,
strategies/routing.py, execute/experts.py).

Training under it is checked against one process on 4 gloo ranks in tests/test_distributed.py
(zoo-mixtral-baseline-ep, zoo-qwen3-moe-baseline-ep, zoo-deepseek-v3-baseline-ep,
zoo-torchtitan-deepseek-v3-baseline-ep, zoo-mixtral-baseline-ep-2x2)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
import transformers.integrations.moe  # registers transformers' grouped matmul op

import autoplan
from autoplan import PlanOptions
from autoplan.baselines.grid import Degrees, conventional_plans, shaped_degrees, with_experts
from autoplan.errors import PlanFormatError
from autoplan.execute.experts import by_expert, local_grouped_mm
from autoplan.graph.flops import GROUPED_MMS
from autoplan.planfile.check import check_plan
from autoplan.planfile.show import summary
from autoplan.strategies.routing import NO_REGION, RegionOp, keeps_rows, region
from autoplan.strategies.rules import own_rule
from tests.distributed.cases import cluster
from tests.models import titan
from tests.models.zoo import workload

ROOT = Path(__file__).resolve().parents[1]
FALLBACK = torch.ops.transformers.grouped_mm_fallback.default
GROUPED = torch.ops.aten._grouped_mm.default
SCATTER_ADD = "torchtitan.deterministic_scatter_add.default"


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


def test_baseline_ep_sends_each_ranks_tokens_to_their_experts() -> None:
    """`baseline(ep=4)` of a tiny Mixtral: its 3-dim experts stored and used split, each
    rank's tokens routed on it (sorted, counted, put back in order there), each grouped
    matmul's rows sent to their experts and back by all-to-alls, and said in show."""
    w = workload("mixtral", batch_size=16, seq_len=16)
    plan = w.baseline(cluster(4), dp=4, tp=1, ep=4)
    (axis,) = plan.mesh.axes
    experts = {n: p for n, p in plan.params.items() if n.endswith(("gate_up_proj", "down_proj"))}
    assert len(experts) == 4
    assert all(p.storage == p.placements == {axis: "S(0)"} for p in experts.values())
    grouped = {n: p for n, p in plan.nodes.items() if p.op in GROUPED_MMS}
    assert len(grouped) == 4
    rows, split, counts = {axis: "S(0)"}, {axis: "S(0)"}, {axis: "P"}
    assert all(p.inputs == (rows, split, counts) and p.output == rows for p in grouped.values())
    assert all(plan.nodes[n].inputs[0] == rows for n in plan.nodes if n.startswith("sort"))
    # the routed rows never gathered: each grouped matmul's five all-to-alls, nothing else
    moved = [c for c in plan.collectives if c.phase in ("forward", "backward")]
    routed = [c for c in moved if c.node in grouped]
    assert all(c.kind == "all_to_all" and c.axes == (axis,) for c in routed)
    assert len(routed) == 5 * len(grouped)
    assert {c.tensor for c in moved if c not in routed} == {"cross_entropy_loss"}  # the loss's
    # a hand-edited plan that reads the routed rows' positions whole is refused
    edited = replace(plan.nodes["floor_divide"], inputs=({axis: "R"},), output={axis: "R"})
    wrong = replace(plan, nodes={**plan.nodes, "floor_divide": edited})
    with pytest.raises(PlanFormatError, match=r"nodes\.floor_divide\.inputs\[0\] reads sort"):
        check_plan(wrong, w.trace())
    assert "experts split 4 ways on" in summary(plan)
    assert "each rank routes its own tokens, sent to their experts and back by all-to-alls" in (
        summary(plan)
    )


def test_the_conventional_plans_of_a_mixture_of_experts_split_its_experts_too() -> None:
    """The planner keeps the faster of its plan and the conventional plans of its shape: for
    a mixture of experts, those include every degree with dp > 1 again with its experts
    split along dp (``baseline(ep=dp)``), written as the baseline writes them; a dense
    model's are left as they are."""
    graph = workload("mixtral", batch_size=16, seq_len=16).trace()
    degrees = shaped_degrees(4, 16)
    found = with_experts(graph, degrees)
    assert found[: len(degrees)] == degrees
    assert found[len(degrees) :] == [replace(d, ep=d.dp) for d in degrees if d.dp > 1]
    assert with_experts(workload("llama", batch_size=16, seq_len=16).trace(), degrees) == degrees
    ((d, plan),) = conventional_plans(lambda _: graph, cluster(4), [Degrees(4, 1, ep=4)])
    assert str(d) == "dp=4 tp=1 pp=1 ep=4"
    experts = [p for n, p in plan.params.items() if n.endswith(("gate_up_proj", "down_proj"))]
    assert experts and all(p.storage == {plan.mesh.axes[0]: "S(0)"} for p in experts)


def _qwen3_moe(experts: int, width: int, batch: int, top_k: int) -> autoplan.Workload:
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=1, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=width,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=experts,
        num_experts_per_tok=top_k, vocab_size=4096, max_position_embeddings=256,
        attention_dropout=0.0,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        ids = torch.randint(0, 4096, (batch, 256))
    return autoplan.Workload(model, {"input_ids": ids, "labels": ids})


@pytest.mark.parametrize(
    ("experts", "width", "batch", "top_k", "sent"),
    [(128, 512, 8, 8, True), (8, 64, 64, 2, False)],
    ids=["many-large-experts", "few-small-experts"],
)
def test_planner_sends_tokens_to_their_experts_where_it_pays(
    experts: int, width: int, batch: int, top_k: int, sent: bool
) -> None:
    """A Qwen3-MoE layer (bfloat16: torch's grouped matmul) on one 8-GPU H100 node. 128
    experts of width 512, top 8 of 2048 tokens: the experts' gradients (and DDP's all-reduce
    of them) outweigh the routed rows, so the planner splits the experts and sends each
    rank's rows to them by all-to-all, faster than data parallelism. 8 experts of width 64,
    top 2 of 16384 tokens: the rows outweigh the experts, so each rank multiplies its own
    rows with the experts whole (no exchange; they may be stored split, ZeRO-3, and gathered
    for use), faster than `baseline(ep=8)`."""
    w = _qwen3_moe(experts, width, batch, top_k)
    h100 = autoplan.Cluster.load(ROOT / "costmodels/h100-sxm-8.json")
    plan = w.plan(h100, PlanOptions(pipeline=False, mesh_shape=(8,)))
    (axis,) = plan.mesh.axes
    grouped = [p for p in plan.nodes.values() if p.op == "aten._grouped_mm.default"]
    assert len(grouped) == 2
    assert all(p.inputs[0] == {axis: "S(0)"} and p.output == {axis: "S(0)"} for p in grouped)
    used = {p.placements[axis] for n, p in plan.params.items() if ".experts." in n}
    assert used == ({"S(0)"} if sent else {"R"})
    kinds = {
        c.kind for c in plan.collectives if c.node in {n for n in plan.nodes if "grouped" in n}
    }
    assert kinds == {"all_to_all"} if sent else "all_to_all" not in kinds
    other = w.baseline(h100, dp=8, tp=1) if sent else w.baseline(h100, dp=8, tp=1, ep=8)
    assert plan.predicted.step_time_s < other.predicted.step_time_s


def test_planner_sends_torchtitans_tokens_to_their_experts_where_it_pays() -> None:
    """torchtitan's Qwen3-MoE layer (its experts cast to bfloat16 for torch's grouped matmul)
    at the sizes of the test above where sending pays: 128 experts of width 512, top 8 of
    2048 tokens, on one 8-GPU H100 node. The planner splits the experts of all three grouped
    matmuls and sends each rank's rows to them by all-to-all, its counts each rank's own,
    faster than data parallelism and than `baseline(ep=8)`, and `autoplan show` says so."""
    model = titan.qwen3_moe_model(256, 1, dim=1024, experts=128, width=512, top_k=8)
    ids = torch.randint(0, titan.VOCAB, (8, 257))
    w = autoplan.Workload(model, (ids[:, :-1],), titan.loss, ids[:, 1:])
    h100 = autoplan.Cluster.load(ROOT / "costmodels/h100-sxm-8.json")
    plan = w.plan(h100, PlanOptions(pipeline=False, mesh_shape=(8,)))
    (axis,) = plan.mesh.axes
    rows, counts = {axis: "S(0)"}, {axis: "P"}
    grouped = {n: p for n, p in plan.nodes.items() if p.op == "aten._grouped_mm.default"}
    assert len(grouped) == 3
    assert all(p.inputs == (rows, rows, counts) and p.output == rows for p in grouped.values())
    assert {p.storage[axis] for n, p in plan.params.items() if "experts" in n} == {"S(0)"}
    assert {c.kind for c in plan.collectives if c.node in grouped} == {"all_to_all"}
    for other in (w.baseline(h100, dp=8, tp=1), w.baseline(h100, dp=8, tp=1, ep=8)):
        assert plan.predicted.step_time_s < other.predicted.step_time_s
    # `autoplan show` says so, and calls no batch-split norm sequence parallelism: no weight
    # but the experts' is split
    words = summary(plan)
    assert "each rank routes its own tokens, sent to their experts and back by all-to-alls" in (
        words
    )
    assert "norms split along" not in words


def test_planner_is_no_slower_than_baseline_ep_where_its_ilps_plans_do_not_fit() -> None:
    """8 experts of width 2048 on one 8-GPU H100 node, memory just above what
    `baseline(ep=8)` needs: the ILP's plans fit by its sum of the ops' memory, but their
    priced peak holds the inputs they save moved (copies the sum does not count), over the
    limit even when solved again within the limit less those bytes. That is no proof that
    no plan of the mesh fits: the planner keeps its conventional plans in the running and
    plans the experts split, as fast as `baseline(ep=8)` (it raised "does not fit" before)."""
    w = _qwen3_moe(8, 2048, 64, 2)
    h100 = autoplan.Cluster.load(ROOT / "costmodels/h100-sxm-8.json")
    ep = w.baseline(h100, dp=8, tp=1, ep=8)
    device = h100.device
    limit = ep.predicted.peak_memory_bytes * 1.1
    fraction = limit / (device.memory_bytes * (1.0 - device.allocator_margin))
    options = PlanOptions(pipeline=False, mesh_shape=(8,), memory_fraction=fraction)
    plan = w.plan(h100, options)
    assert plan.predicted.peak_memory_bytes <= plan.predicted.memory_limit_bytes
    assert plan.predicted.step_time_s <= ep.predicted.step_time_s
    (axis,) = plan.mesh.axes
    assert {p.storage[axis] for n, p in plan.params.items() if ".experts." in n} == {"S(0)"}
    assert "each rank routes its own tokens, sent to their experts and back by all-to-alls" in (
        summary(plan)
    )


def _routed(*tail: RegionOp) -> list[RegionOp]:
    """transformers' grouped experts as the planner's graph has them (one grouped matmul),
    then ``tail``."""
    return [
        RegionOp("sort", "aten.sort.default", ("ids",)),
        RegionOp("token", "aten.floor_divide.default", ("sort",)),
        RegionOp("rows", "aten.index.Tensor", ("hidden", "token")),
        RegionOp("counts", "aten.histc.default", ("sort",)),
        RegionOp("offs", "aten.cumsum.default", ("counts",)),
        RegionOp("mm", GROUPED_MMS[0], ("rows", "w", "offs")),
        RegionOp("empty", "aten.empty_like.default", ("sort",)),
        RegionOp("positions", "aten.arange.default", ()),
        RegionOp("inverse", "aten.index_put.default", ("empty", "sort", "positions")),
        RegionOp("back", "aten.index.Tensor", ("mm", "inverse")),
        *tail,
    ]


def test_routed_region_runs_from_the_sort_to_the_inverse_permutation() -> None:
    found = region(_routed(RegionOp("out", "aten.view.default", ("back",))))
    assert found.inside == {"sort", "token", "rows", "counts", "offs", "mm", "empty"} | {
        "positions",
        "inverse",
    }
    assert found.exits == {"back"}


@pytest.mark.parametrize(
    "tail",
    [
        RegionOp("leak", "aten.sum.default", ("rows",)),  # the sorted rows read outside
        RegionOp("mix", "aten.mul.Tensor", ("mm", "hidden")),  # mixed with tokens in their order
    ],
    ids=["read-outside", "mixed-with-tokens"],
)
def test_a_region_that_is_not_closed_routes_nothing(tail: RegionOp) -> None:
    assert region(_routed(tail)) == NO_REGION


def test_received_rows_are_regrouped_by_expert() -> None:
    """Rows received from 3 ranks for this rank's 2 experts, in blocks by source rank:
    regrouped by expert, each expert's rows by source."""
    got = torch.tensor([[2, 1], [0, 3], [1, 0]])  # got[s, j]: from rank s for expert j
    # received: s0 e0 e0 e1 | s1 e1 e1 e1 | s2 e0
    order = by_expert(got)
    assert order.tolist() == [0, 1, 6, 2, 3, 4, 5]


def _titan(*tail: RegionOp, kept: bool = True) -> list[RegionOp]:
    """torchtitan's MoE as the planner's graph has it (one grouped matmul): its routed ids
    sorted by ``argsort``, the offsets counted from the routing map outside, the products
    scaled by their scores and scatter-added into zeros at their tokens (``kept``: whether
    its views keep dim 0), then ``tail``."""
    return [
        RegionOp("flat", "aten.view.default", ("topk",)),
        RegionOp("argsort", "aten.argsort.stable", ("flat",)),
        RegionOp("scores", "aten.index.Tensor", ("top_scores", "argsort")),
        RegionOp("token", "aten.floor_divide.default", ("argsort",)),
        RegionOp("rows", "aten.index.Tensor", ("hidden", "token")),
        RegionOp("counts", "aten.sum.dim_IntList", ("routing_map",)),
        RegionOp("offs", "aten.cumsum.default", ("counts",)),
        RegionOp("mm", GROUPED_MMS[0], ("rows", "w", "offs")),
        RegionOp("cast", "aten.type_as.default", ("mm", "rows")),
        RegionOp("column", "aten.view.default", ("scores",), rows_kept=kept),
        RegionOp("scaled", "aten.mul.Tensor", ("cast", "column")),
        RegionOp("at", "aten.view.default", ("token",), rows_kept=kept),
        RegionOp("wide", "aten.expand.default", ("at",), rows_kept=kept),
        RegionOp("zeros", "aten.zeros_like.default", ("hidden",)),
        RegionOp("combined", SCATTER_ADD, ("zeros", "wide", "scaled")),
        *tail,
    ]


def test_torchtitans_routed_region_runs_from_argsort_to_its_scatter_add() -> None:
    """Its offsets come in as counts from outside (partial over a split batch), its views
    and expand keep dim 0, and its products leave added into the tokens' zeros."""
    found = region(_titan(RegionOp("out", "aten.view.default", ("combined",))))
    assert found.inside == {"argsort", "scores", "token", "rows", "offs", "mm", "cast"} | {
        "column",
        "scaled",
        "at",
        "wide",
    }
    assert found.exits == {"combined"}


@pytest.mark.parametrize(
    "ops",
    [
        _titan(kept=False),  # a view or expand that may mix rows
        _titan(RegionOp("leak", "aten.sum.default", ("offs",))),  # its offsets read outside
        [  # the products added into the scores (outside) rather than zeros
            *_titan()[:-1],
            RegionOp("combined", SCATTER_ADD, ("top_scores", "wide", "scaled")),
        ],
    ],
    ids=["rows-mixed", "offsets-read-outside", "not-into-zeros"],
)
def test_torchtitans_region_that_is_not_closed_routes_nothing(ops: list[RegionOp]) -> None:
    assert region(ops) == NO_REGION


@pytest.mark.parametrize(
    ("op", "shape_in", "shape_out", "kept"),
    [
        ("aten.view.default", (12,), (12, 1), True),
        ("aten.view.default", (12, 4), (6, 8), False),
        ("aten.expand.default", (12, 1), (12, 8), True),
        ("aten.expand.default", (12, 1), (3, 12, 1), False),
        ("aten.mul.Tensor", (12,), (12,), False),
    ],
)
def test_views_and_expands_that_keep_dim_0_are_row_wise(
    op: str, shape_in: tuple[int, ...], shape_out: tuple[int, ...], kept: bool
) -> None:
    assert keeps_rows(op, shape_in, shape_out) == kept


def test_baseline_ep_routes_torchtitans_tokens_with_their_counts_partial() -> None:
    """`baseline(ep=4)` of torchtitan's DeepSeek-V3: its experts split, each rank's tokens
    routed on it with its own counts (the routing map's sum, partial, into the offsets),
    its products scatter-added into its own tokens; a plan that reads those counts made
    partial from whole ones is refused."""
    w = workload("torchtitan-deepseek-v3", batch_size=16, seq_len=16)
    plan = w.baseline(cluster(4), dp=4, tp=1, ep=4)
    (axis,) = plan.mesh.axes
    rows, counts = {axis: "S(0)"}, {axis: "P"}
    grouped = {n: p for n, p in plan.nodes.items() if p.op in GROUPED_MMS}
    assert len(grouped) == 3
    assert all(p.inputs == (rows, rows, counts) and p.output == rows for p in grouped.values())
    (cumsum,) = [p for p in plan.nodes.values() if p.op == "aten.cumsum.default"]
    assert cumsum.inputs == (counts,) and cumsum.output == counts
    (combine,) = [p for n, p in plan.nodes.items() if p.op == SCATTER_ADD]
    assert combine.inputs == (rows, rows, rows) and combine.output == rows
    routed = [c for c in plan.collectives if c.node in grouped]
    assert len(routed) == 5 * len(grouped) and all(c.kind == "all_to_all" for c in routed)
    (name,) = [n for n, p in plan.nodes.items() if p.op == "aten.cumsum.default"]
    source = w.trace().node(name).refs[0].name
    whole = replace(plan.nodes[source], inputs=({axis: "R"},), output={axis: "R"})
    wrong = replace(plan, nodes={**plan.nodes, source: whole})
    with pytest.raises(PlanFormatError, match=rf"nodes\.{name}\.inputs\[0\] reads {source}"):
        check_plan(wrong, w.trace())
