"""Baselines: Megatron's column/row linears are found from the graph alone, data parallelism
and ZeRO-3 are placed as written, bad degrees are refused, and the plan prices like any plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplan
from autoplan.baseline import find_regions
from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.graph.capture import capture
from autoplan.plan.schema import Plan
from autoplan.workload import Workload
from tests.conftest import example
from tests.distributed.cases import GPT, MLP_SMALL_BATCH, gpt_megatron, mlp_megatron, zero3


def _baseline(w: Workload, cluster: autoplan.Cluster, **options: Any) -> Plan:
    return autoplan.baseline(
        w.model,
        w.example_inputs,
        cluster,
        loss_fn=w.loss_fn,
        example_target=w.example_target,
        **options,
    )


def _storage(pins: dict[str, Any]) -> dict[str, str]:
    """The storage each hand-written 1-D pin asks for."""
    return {k: v if isinstance(v, str) else v["storage"] for k, v in pins.items()}


def _regions_by_module(w: Workload) -> list[tuple[list[str], list[str]]]:
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    return [
        (
            [graph.node(c).module_path for c in region.columns],
            [graph.node(r).module_path for r in region.rows],
        )
        for region in find_regions(graph)
    ]


def test_gpt_regions_are_attention_and_mlp_of_each_block() -> None:
    w = example("gpt", **GPT)
    expected = []
    for b in range(GPT["num_layers"]):
        attn, mlp = f"blocks.{b}.attn", f"blocks.{b}.mlp"
        expected += [([f"{attn}.q", f"{attn}.k", f"{attn}.v"], [f"{attn}.proj"])]
        expected += [([f"{mlp}.fc"], [f"{mlp}.proj"])]
    assert _regions_by_module(w) == expected  # the head feeds the loss: not split


def test_gpt_tensor_parallel_matches_the_hand_written_megatron_pins(
    cpu4: autoplan.Cluster,
) -> None:
    w = example("gpt", **GPT)
    plan = _baseline(w, cpu4, dp=1, tp=4)
    assert plan.mesh.axes == ("tp",) and plan.mesh.shape == (4,)
    storage = {name: p.storage["tp"] for name, p in plan.params.items()}
    assert storage == _storage(gpt_megatron(w)["pin"])
    # row biases are read as partial sums (added on one rank), everything else as stored
    for name, p in plan.params.items():
        read = "P" if name.endswith("proj.bias") else storage[name]
        assert p.placements == {"tp": read}, name
    ops = {n.op.split(".")[1]: n for n in plan.nodes.values() if n.op.startswith("aten.")}
    assert ops["scaled_dot_product_attention"].output == {"tp": "S(1)"}  # heads split
    for name, n in plan.nodes.items():
        if n.op in ("aten.layer_norm.default", "aten.cross_entropy_loss.default"):
            assert n.output == {"tp": "R"} and all(i == {"tp": "R"} for i in n.inputs), name
    # per block: one all-reduce of each row linear's output in forward, and of each region's
    # input gradient in backward
    activations = [c for c in plan.collectives if c.phase != "grad_sync"]
    assert len(activations) == 4 * GPT["num_layers"]
    assert {(c.kind, c.axis) for c in activations} == {("all_reduce", "tp")}


def test_mlp_alternates_column_and_row_and_leaves_an_unpaired_last_layer() -> None:
    six = _regions_by_module(example("mlp", **MLP_SMALL_BATCH))
    assert six == [([f"layers.{i}"], [f"layers.{i + 1}"]) for i in (0, 2, 4)]
    five = _regions_by_module(example("mlp", **MLP_SMALL_BATCH, num_layers=5))
    assert five == [([f"layers.{i}"], [f"layers.{i + 1}"]) for i in (0, 2)]  # 4 feeds the loss


def test_mlp_tensor_parallel_matches_the_hand_written_pins(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", **MLP_SMALL_BATCH)
    plan = _baseline(w, cpu4, dp=1, tp=4)
    storage = {name: p.storage["tp"] for name, p in plan.params.items()}
    assert storage == _storage(mlp_megatron(w)["pin"])


def test_data_parallel_splits_the_batch_and_zero3_stores_params_split(
    cpu4: autoplan.Cluster,
) -> None:
    w = example("mlp", batch_size=64, hidden=32)
    plan = _baseline(w, cpu4, dp=4, tp=1, zero_stage=3)
    assert plan.mesh.axes == ("dp",)
    pins = _storage(zero3(w)["pin"])
    assert pins.pop("input:0") == pins.pop("target") == "S(0)"
    assert {n: p.storage["dp"] for n, p in plan.params.items()} == pins
    assert all(p.placements == {"dp": "R"} for p in plan.params.values())
    inputs = [n for n in plan.nodes.values() if n.op == "input"]
    assert len(inputs) == 2 and all(n.output == {"dp": "S(0)"} for n in inputs)
    kinds = {(c.kind, c.phase) for c in plan.collectives if c.axis == "dp"}
    assert ("all_gather", "forward") in kinds and ("reduce_scatter", "grad_sync") in kinds
    assert ("all_reduce", "grad_sync") not in kinds

    plain = _baseline(w, cpu4, dp=4, tp=1)
    assert all(p.storage == {"dp": "R"} for p in plain.params.values())
    assert plain.predicted.peak_memory_bytes > plan.predicted.peak_memory_bytes


def test_2d_mesh_is_dp_outside_tp_inside(cpu4: autoplan.Cluster, a100: autoplan.Cluster) -> None:
    w = example("gpt", **{**GPT, "batch_size": 8})
    for cluster, dp, tp in ((cpu4, 2, 2), (a100, 2, 4)):
        plan = _baseline(w, cluster, dp=dp, tp=tp)
        assert plan.mesh.axes == ("dp", "tp") and plan.mesh.shape == (dp, tp)
        megatron = _storage(gpt_megatron(w)["pin"])
        for name, p in plan.params.items():
            assert p.storage == {"dp": "R", "tp": megatron[name]}, name
        for n in plan.nodes.values():
            if n.op in ("aten.linear.default", "aten.scaled_dot_product_attention.default"):
                assert n.output["dp"] == "S(0)"  # every rank of a tp group: its own batch slice
        assert {c.axis for c in plan.collectives if c.phase == "grad_sync"} == {"dp"}


def test_zero3_on_2d_keeps_the_dp_shard_off_the_tp_split_dim(a100: autoplan.Cluster) -> None:
    w = example("gpt", **{**GPT, "batch_size": 8})
    plan = _baseline(w, a100, dp=2, tp=4, zero_stage=3)
    q, proj = plan.params["blocks.0.attn.q.weight"], plan.params["blocks.0.attn.proj.weight"]
    assert q.storage == {"dp": "S(1)", "tp": "S(0)"} and q.placements == {"dp": "R", "tp": "S(0)"}
    assert proj.storage == {"dp": "S(0)", "tp": "S(1)"}
    fc_bias = plan.params["blocks.0.mlp.fc.bias"]  # 1-D and split by tp: both split dim 0
    assert fc_bias.storage == {"dp": "S(0)", "tp": "S(0)"}


class SwiGLU(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w3 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Tied(nn.Module):
    """An embedding whose weight the head reuses; a normalization between two linears."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.norm(self.up(self.emb(idx)))))


class Skip(nn.Module):
    """A linear pair whose split middle also feeds a residual add: not a Megatron pair."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(F.relu(h)) + h


def _workload(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Workload:
    return Workload(model, (x,), F.mse_loss if target.is_floating_point() else _ce, target)


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_two_columns_meeting_at_a_product_are_one_region(cpu4: autoplan.Cluster) -> None:
    w = _workload(SwiGLU(16), torch.randn(8, 4, 16), torch.randn(8, 4, 16))
    assert _regions_by_module(w) == [(["w1", "w3"], ["w2"])]
    plan = _baseline(w, cpu4, dp=2, tp=2)
    assert {n: p.storage["tp"] for n, p in plan.params.items()} == {
        "norm.weight": "R",
        "norm.bias": "R",
        "w1.weight": "S(0)",
        "w3.weight": "S(0)",
        "w2.weight": "S(1)",
    }


def test_normalized_tied_or_bypassed_linears_are_not_split(cpu4: autoplan.Cluster) -> None:
    w = _workload(Tied(32, 16), torch.randint(0, 32, (8, 4)), torch.randint(0, 32, (8, 4)))
    assert _regions_by_module(w) == []  # up -> norm breaks the pair; the head shares its weight
    with pytest.raises(AutoplanError, match="no linears Megatron would split"):
        _baseline(w, cpu4, dp=1, tp=4)
    plan = _baseline(w, cpu4, dp=4, tp=1)  # data parallel needs no split linears
    assert all(p.storage == {"dp": "R"} for p in plan.params.values())
    skip = _workload(Skip(16), torch.randn(8, 16), torch.randn(8, 16))
    assert _regions_by_module(skip) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp": 2, "tp": 1}, r"dp \* tp \* pp = 2 \* 1 \* 1 = 2, but cluster 'cpu-gloo-4' has 4"),
        ({"dp": 1, "tp": 2, "pp": 2}, "pipeline baselines need the pipeline planner"),
        ({"dp": 0, "tp": 4}, "dp must be a positive integer"),
        ({"dp": 4, "tp": 1, "zero_stage": 1}, "zero_stage=1 cannot be written in a plan"),
        ({"dp": 4, "tp": 1, "zero_stage": 2}, "zero_stage=2 cannot be written in a plan"),
        ({"dp": 1, "tp": 4, "zero_stage": 3}, "needs dp > 1"),
        ({"dp": 4, "tp": 1, "num_microbatches": 4}, "applies to pipeline stages"),
        ({"dp": 4, "tp": 1, "optimizer": "lion"}, "optimizer 'lion' is not known"),
    ],
)
def test_bad_degrees_are_refused(
    cpu4: autoplan.Cluster, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(AutoplanError, match=message):
        _baseline(example("mlp", batch_size=8, hidden=32), cpu4, **options)


def test_splits_that_do_not_divide_name_what_they_cut(
    cpu4: autoplan.Cluster, a100: autoplan.Cluster
) -> None:
    cut = r"tp=4 does not divide dim 0 \(size 30\) of parameter 'layers\.0\.weight'"
    with pytest.raises(AutoplanError, match=cut):
        _baseline(example("mlp", batch_size=8, hidden=30), cpu4, dp=1, tp=4)
    # tiny GPT: 64 features split by 8, but only 4 heads
    with pytest.raises(AutoplanError, match=r"tp=8 does not divide dim 2 \(size 4\) of aten.view"):
        _baseline(example("gpt", size="tiny", batch_size=8), a100, dp=1, tp=8)
    with pytest.raises(AutoplanError, match=r"dp=4 does not divide the batch \(dim 0\) of input 0"):
        _baseline(example("mlp", batch_size=6, hidden=32), cpu4, dp=4, tp=1)


def test_a_baseline_is_priced_like_any_plan(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", **GPT)
    plan = _baseline(w, cpu4, dp=2, tp=2)
    assert plan.solver.status == "baseline" and plan.solver.num_variables == 0
    again = autoplan.estimate(
        plan, cpu4, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
    )
    assert again.predicted == plan.predicted and again.collectives == plan.collectives
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.predicted.comm_s > 0 and plan.predicted.compute_s > 0


def test_a_baseline_that_does_not_fit_is_refused(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=8, hidden=32)
    with pytest.raises(InfeasiblePlanError, match=r"the baseline dp=4 tp=1 zero_stage=0 needs"):
        _baseline(w, cpu4, dp=4, tp=1, memory_fraction=1e-6)


def test_a_large_gpt_on_meta_tensor_parallel_needs_less_memory_than_data_parallel(
    a100: autoplan.Cluster,
) -> None:
    w = example("gpt", size="1.3b", device="meta", dtype="bfloat16", batch_size=8)
    megatron = _baseline(w, a100, dp=2, tp=4)
    replicas = _baseline(w, a100, dp=8, tp=1)
    assert megatron.params["blocks.0.mlp.fc.weight"].storage == {"dp": "R", "tp": "S(0)"}
    # each device keeps a quarter of every block's linears (with gradients and Adam state),
    # which outweighs its 4x larger batch slice of the activations outside the split linears
    assert megatron.predicted.peak_memory_bytes < replicas.predicted.peak_memory_bytes
