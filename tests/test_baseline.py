"""Baselines: Megatron's column/row linears are found from the graph alone, data parallelism
and ZeRO-3 are placed as written, pipelines split the blocks evenly into stages placed the
same way, bad degrees are refused, and the plan prices like any plan."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import autoplan
from autoplan import PlanOptions
from autoplan.baselines.regions import find_regions
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.graph.capture import capture, microbatch
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import CollectivePlan
from autoplan.strategies.placement import Collective, fitted
from autoplan.workload import Workload, load_workload
from tests.conftest import ROOT, example
from tests.distributed.cases import (
    GPT,
    MLP_LARGE_BATCH,
    MLP_SMALL_BATCH,
    gpt_vocab_parallel,
    mlp_megatron,
    zero3,
)


def _estimate(plan: Plan, w: Workload, cluster: autoplan.Cluster) -> Plan:
    return autoplan.estimate(
        plan, cluster, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
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
    # the head: a column linear whose logits the loss reads split along the vocabulary
    expected += [(["head"], [])]
    assert _regions_by_module(w) == expected


def test_gpt_tensor_parallel_matches_the_hand_written_megatron_pins(
    cpu4: autoplan.Cluster,
) -> None:
    w = example("gpt", **GPT)
    plan = w.baseline(cpu4, dp=1, tp=4)
    assert plan.mesh.axes == ("tp",) and plan.mesh.shape == (4,)
    storage = {name: p.storage["tp"] for name, p in plan.params.items()}
    assert storage == _storage(gpt_vocab_parallel(w).pin)
    # row biases are read as partial sums (added on one rank), everything else as stored
    for name, p in plan.params.items():
        read = "P" if name.endswith("proj.bias") else storage[name]
        assert p.placements == {"tp": read}, name
    ops = {n.op.split(".")[1]: n for n in plan.nodes.values() if n.op.startswith("aten.")}
    assert ops["scaled_dot_product_attention"].output == {"tp": "S(1)"}  # heads split
    for name, n in plan.nodes.items():
        if n.op == "aten.layer_norm.default":
            assert n.output == {"tp": "R"} and all(i == {"tp": "R"} for i in n.inputs), name
    # the vocabulary split: the token embedding's lookup a partial sum, the loss on the
    # logits' shards (Megatron's VocabParallelEmbedding and parallel cross-entropy)
    assert plan.nodes["embedding"].output == {"tp": "P"}  # the token embedding
    assert ops["cross_entropy_loss"].inputs == ({"tp": "S(1)"}, {"tp": "R"})
    assert ops["cross_entropy_loss"].output == {"tp": "R"}
    # per block: one all-reduce of each row linear's output in forward, and of each region's
    # input gradient in backward; the embedding's in forward, the head's input gradient in
    # backward, the loss's max and sums of exponentials of its 256 tokens, in float32
    activations = [c for c in plan.collectives if c.phase != "grad_sync"]
    assert len(activations) == 4 * GPT["num_layers"] + 4
    assert {(c.kind, c.axes) for c in activations} == {("all_reduce", ("tp",))}
    tokens = GPT["batch_size"] * GPT["seq_len"]
    loss = [c.bytes for c in activations if c.node == "cross_entropy_loss"]
    assert sorted(loss) == [4 * tokens, 8 * tokens]


def test_mlp_alternates_column_and_row_and_leaves_an_unpaired_last_layer() -> None:
    six = _regions_by_module(example("mlp", **MLP_SMALL_BATCH))
    assert six == [([f"layers.{i}"], [f"layers.{i + 1}"]) for i in (0, 2, 4)]
    five = _regions_by_module(example("mlp", **MLP_SMALL_BATCH, num_layers=5))
    assert five == [([f"layers.{i}"], [f"layers.{i + 1}"]) for i in (0, 2)]  # 4 feeds the loss


def test_mlp_tensor_parallel_matches_the_hand_written_pins(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", **MLP_SMALL_BATCH)
    plan = w.baseline(cpu4, dp=1, tp=4)
    storage = {name: p.storage["tp"] for name, p in plan.params.items()}
    assert storage == _storage(mlp_megatron(w).pin)


def test_data_parallel_splits_the_batch_and_zero3_stores_params_split(
    cpu4: autoplan.Cluster,
) -> None:
    w = example("mlp", batch_size=64, hidden=32)
    plan = w.baseline(cpu4, dp=4, tp=1, zero_stage=3)
    assert plan.mesh.axes == ("dp",)
    pins = _storage(zero3(w).pin)
    assert pins.pop("input:0") == pins.pop("target") == "S(0)"
    assert {n: p.storage["dp"] for n, p in plan.params.items()} == pins
    assert all(p.placements == {"dp": "R"} for p in plan.params.values())
    inputs = [n for n in plan.nodes.values() if n.op == "input"]
    assert len(inputs) == 2 and all(n.output == {"dp": "S(0)"} for n in inputs)
    kinds = {(c.kind, c.phase) for c in plan.collectives if c.axes == ("dp",)}
    assert ("all_gather", "forward") in kinds and ("reduce_scatter", "grad_sync") in kinds
    assert ("all_reduce", "grad_sync") not in kinds

    plain = w.baseline(cpu4, dp=4, tp=1)
    assert all(p.storage == {"dp": "R"} for p in plain.params.values())
    assert plain.predicted.peak_memory_bytes > plan.predicted.peak_memory_bytes


def test_zero1_and_zero2_split_the_optimizer_state_along_dp(a100: autoplan.Cluster) -> None:
    w = example("gpt", **{**GPT, "batch_size": 8})
    plain = w.baseline(a100, dp=2, tp=4)
    plans = {stage: w.baseline(a100, dp=2, tp=4, zero_stage=stage) for stage in (1, 2)}
    for stage, plan in plans.items():
        q = plan.params["blocks.0.attn.q.weight"]  # column split: dim 0 on tp, dim 1 on dp
        assert q.storage == q.placements == {"dp": "R", "tp": "S(0)"}
        assert q.state == {"dp": "S(1)", "tp": "S(0)"}
        assert q.grad == (q.state if stage == 2 else {})
        # a 1-D bias split by tp has no dim left for dp: kept whole, as data parallelism does
        assert not plan.params["blocks.0.mlp.fc.bias"].state
        gathered = [c for c in plan.collectives if c.phase == "update"]
        assert gathered and all(c.kind == "all_gather" and c.axes == ("dp",) for c in gathered)
        scattered = {c.tensor for c in plan.collectives if c.kind == "reduce_scatter"}
        assert bool(scattered) == (stage == 2)
    # each stage keeps less per device than the one before
    memory = [p.predicted.peak_memory_bytes for p in (plain, plans[1], plans[2])]
    assert memory[0] > memory[1] > memory[2], memory


def test_2d_mesh_is_dp_outside_tp_inside(cpu4: autoplan.Cluster, a100: autoplan.Cluster) -> None:
    w = example("gpt", **{**GPT, "batch_size": 8})
    for cluster, dp, tp in ((cpu4, 2, 2), (a100, 2, 4)):
        plan = w.baseline(cluster, dp=dp, tp=tp)
        assert plan.mesh.axes == ("dp", "tp") and plan.mesh.shape == (dp, tp)
        megatron = _storage(gpt_vocab_parallel(w).pin)
        for name, p in plan.params.items():
            assert p.storage == {"dp": "R", "tp": megatron[name]}, name
        for n in plan.nodes.values():
            if n.op in ("aten.linear.default", "aten.scaled_dot_product_attention.default"):
                assert n.output["dp"] == "S(0)"  # every rank of a tp group: its own batch slice
        assert {c.axes for c in plan.collectives if c.phase == "grad_sync"} == {("dp",)}


def test_zero3_on_2d_keeps_the_dp_shard_off_the_tp_split_dim(a100: autoplan.Cluster) -> None:
    w = example("gpt", **{**GPT, "batch_size": 8})
    plan = w.baseline(a100, dp=2, tp=4, zero_stage=3)
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


class TiedLM(nn.Module):
    """A residual MLP between an embedding and a head that share their weight."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.down(F.relu(self.up(x)))
        return self.head(self.norm(x))


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


def test_a_head_tied_to_its_embedding_splits_the_vocabulary_of_both(
    cpu4: autoplan.Cluster,
) -> None:
    w = _workload(TiedLM(32, 16), torch.randint(0, 32, (8, 4)), torch.randint(0, 32, (8, 4)))
    assert _regions_by_module(w) == [(["up"], ["down"]), (["head"], [])]
    plan = w.baseline(cpu4, dp=1, tp=4)
    assert plan.params["emb.weight"].storage == {"tp": "S(0)"}  # the head's weight too
    assert plan.nodes["embedding"].output == {"tp": "P"}
    assert plan.nodes["cross_entropy_loss"].inputs == ({"tp": "S(1)"}, {"tp": "R"})


def test_two_columns_meeting_at_a_product_are_one_region(cpu4: autoplan.Cluster) -> None:
    w = _workload(SwiGLU(16), torch.randn(8, 4, 16), torch.randn(8, 4, 16))
    assert _regions_by_module(w) == [(["w1", "w3"], ["w2"])]
    plan = w.baseline(cpu4, dp=2, tp=2)
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
        w.baseline(cpu4, dp=1, tp=4)
    plan = w.baseline(cpu4, dp=4, tp=1)  # data parallel needs no split linears
    assert all(p.storage == {"dp": "R"} for p in plan.params.values())
    skip = _workload(Skip(16), torch.randn(8, 16), torch.randn(8, 16))
    assert _regions_by_module(skip) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp": 2, "tp": 1}, r"dp \* tp \* pp = 2 \* 1 \* 1 = 2, but cluster 'cpu-gloo-4' has 4"),
        ({"dp": 1, "tp": 2, "pp": 2, "num_microbatches": 0}, "must be a positive integer"),
        (
            {"dp": 1, "tp": 2, "pp": 2, "num_microbatches": 3},
            r"=3 does not divide .* size 8\) of input 0",
        ),
        (
            {"dp": 2, "tp": 1, "pp": 2, "num_microbatches": 8},
            "dp=2 does not divide the microbatches",
        ),
        ({"dp": 1, "tp": 2, "pp": 2, "num_microbatches": 1}, "1F1B needs at least as many"),
        ({"dp": 1, "tp": 2, "pp": 2, "schedule": "zb"}, "schedule 'zb' is not known"),
        ({"dp": 0, "tp": 4}, "dp must be a positive integer"),
        ({"dp": 1, "tp": 4, "zero_stage": 1}, "zero_stage=1 splits the optimizer .* needs dp > 1"),
        ({"dp": 4, "tp": 1, "zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
        ({"dp": 1, "tp": 4, "zero_stage": 3}, "needs dp > 1"),
        ({"dp": 4, "tp": 1, "num_microbatches": 4}, "applies to pipeline stages"),
        ({"dp": 4, "tp": 1, "optimizer": "lion"}, "optimizer 'lion' is not known"),
    ],
)
def test_bad_degrees_are_refused(
    cpu4: autoplan.Cluster, options: dict[str, Any], message: str
) -> None:
    moved = ("num_microbatches", "optimizer", "schedule")
    planning = {k: options.pop(k) for k in moved if k in options}
    with pytest.raises(AutoplanError, match=message):
        w = example("mlp", batch_size=8, hidden=32)
        w.baseline(cpu4, **options, options=PlanOptions(**planning))


def test_splits_that_do_not_divide_name_what_they_cut(
    cpu4: autoplan.Cluster, a100: autoplan.Cluster
) -> None:
    cut = r"tp=4 does not divide dim 0 \(size 30\) of parameter 'layers\.0\.weight'"
    with pytest.raises(AutoplanError, match=cut):
        example("mlp", batch_size=8, hidden=30).baseline(cpu4, dp=1, tp=4)
    # tiny GPT: 64 features split by 8, but only 4 heads
    with pytest.raises(AutoplanError, match=r"tp=8 does not divide dim 2 \(size 4\) of aten.view"):
        example("gpt", size="tiny", batch_size=8).baseline(a100, dp=1, tp=8)
    with pytest.raises(AutoplanError, match=r"dp=4 does not divide the batch \(dim 0\) of input 0"):
        example("mlp", batch_size=6, hidden=32).baseline(cpu4, dp=4, tp=1)
    # a vocabulary tp does not divide: the embedding, the head and the loss stay whole
    plan = example("gpt", size="tiny", batch_size=8, vocab_size=130).baseline(cpu4, dp=1, tp=4)
    assert plan.params["tok_emb.weight"].storage == plan.params["head.weight"].storage
    assert plan.params["head.weight"].storage == {"tp": "R"}
    assert plan.params["blocks.0.mlp.fc.weight"].storage == {"tp": "S(0)"}


def test_a_baseline_is_priced_like_any_plan(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", **GPT)
    plan = w.baseline(cpu4, dp=2, tp=2)
    assert plan.solver.status == "baseline" and plan.solver.num_variables == 0
    again = _estimate(plan, w, cpu4)
    assert again.predicted == plan.predicted and again.collectives == plan.collectives
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.predicted.comm_s > 0 and plan.predicted.compute_s > 0


def test_a_baseline_that_does_not_fit_is_refused(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=8, hidden=32)
    with pytest.raises(InfeasiblePlanError, match=r"the baseline dp=4 tp=1 zero_stage=0 needs"):
        w.baseline(cpu4, dp=4, tp=1, options=PlanOptions(memory_fraction=1e-6))


def test_a_large_gpt_on_meta_tensor_parallel_needs_less_memory_than_data_parallel(
    a100: autoplan.Cluster,
) -> None:
    w = example("gpt", size="1.3b", device="meta", dtype="bfloat16", batch_size=8)
    megatron = w.baseline(a100, dp=2, tp=4)
    replicas = w.baseline(a100, dp=8, tp=1)
    assert megatron.params["blocks.0.mlp.fc.weight"].storage == {"dp": "R", "tp": "S(0)"}
    # each device keeps a quarter of every block's linears (with gradients and Adam state),
    # which outweighs its 4x larger batch slice of the activations outside the split linears
    assert megatron.predicted.peak_memory_bytes < replicas.predicted.peak_memory_bytes


# ---------------------------------------------------------------- pipelines (pp > 1)


def _half(cluster: autoplan.Cluster) -> autoplan.Cluster:
    return dataclasses.replace(cluster, devices_per_node=cluster.num_devices // 2)


def _one_microbatch(
    w: Workload, cluster: autoplan.Cluster, num_microbatches: int, **degrees: int
) -> Plan:
    """The one-stage baseline of one microbatch on half of ``cluster`` (one of two stages)."""
    return autoplan.baseline(
        w.model,
        microbatch(w.example_inputs, num_microbatches),
        _half(cluster),
        loss_fn=w.loss_fn,
        example_target=microbatch(w.example_target, num_microbatches),
        **degrees,
    )


def _bucket_s(plan: Plan, cluster: autoplan.Cluster) -> float:
    """Seconds of the plan's gradient buckets (all on a stage's mesh)."""
    axes = plan.stage_axes
    pricer = Pricer(cluster, plan.mesh.shape[-len(axes) :], "adamw")
    return sum(
        pricer.collective_s(Collective(c.kind, tuple(axes.index(a) for a in c.axes), c.bytes))
        for c in plan.collectives
        if c.params
    )


def _check_stages_price_as_one_microbatch(
    plan: Plan, one: Plan, cluster: autoplan.Cluster, half: autoplan.Cluster
) -> None:
    """Two stages whose boundary costs nothing (it is laid out as the step keeps it there)
    add up to the one-stage baseline of their microbatch, except that each stage buckets its
    own gradients; the pipeline then adds the send to stage 0, the bubble and, once per step,
    gradient sync and optimizer update."""
    assert plan.predicted.compute_s == pytest.approx(one.predicted.compute_s, rel=1e-12)
    assert plan.predicted.comm_s - _bucket_s(plan, cluster) == pytest.approx(
        one.predicted.comm_s - _bucket_s(one, half), rel=1e-12
    )

    def key(c: CollectivePlan) -> tuple[str, tuple[str, ...], str, int]:
        return (c.kind, c.axes, c.phase, c.bytes)

    def unbucketed(p: Plan) -> list[tuple[str, tuple[str, ...], str, int]]:
        return sorted(key(c) for c in p.collectives if not c.params)

    def bucketed(p: Plan) -> list[tuple[tuple[str, ...], str]]:
        return sorted((c.axes, name) for c in p.collectives for name in c.params)

    assert unbucketed(plan) == unbucketed(one)
    assert bucketed(plan) == bucketed(one)
    first, last = (s.predicted for s in plan.stages)
    assert first is not None and last is not None
    assert first.time_s > first.forward_s + first.backward_s  # the send to stage 1
    assert last.time_s == pytest.approx(last.forward_s + last.backward_s)  # sends nothing
    assert plan.pipeline is not None
    times = [first.time_s, last.time_s]
    bubble = sum(times) + (plan.pipeline.num_microbatches - 1) * max(times)
    assert plan.predicted.step_time_s > bubble


def test_llama_pipeline_sends_its_rotary_tables_whole_on_dp(cpu4: autoplan.Cluster) -> None:
    """transformers' Llama computes its rotary tables (cos, sin) once, shaped (1, seq,
    head_dim) and broadcast against the batch, and every decoder layer reads them: they cross
    the stage boundary beside the batch split on dp. With no batch to split, they cross whole,
    the same on each dp rank, and stage 1 reads them whole; the stages still add up to the
    one-stage baseline of their microbatch (whose ops read the tables whole alike)."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="llama", batch_size=8, seq_len=16)
    plan = w.baseline(cpu4, dp=2, tp=1, pp=2)
    first, last = plan.stages
    assert first.boundary == last.boundary == {"dp": "S(0)"}
    assert plan.pipeline is not None and plan.pipeline.num_microbatches == 2
    graph = w.trace(2)
    batch_one = [n for n in last.received if graph.node(n).output.shape[0] == 1]
    assert [graph.node(n).output.shape for n in batch_one] == [(1, 16, 16)] * 2
    assert {plan.nodes[n].module for n in batch_one} == {"model.rotary_emb"}
    for name in last.received:  # the batch (4 a microbatch) split, the tables whole
        whole = name in batch_one
        assert fitted(("S(0)",), graph.node(name).output.shape) == ("R" if whole else "S(0)",)
        reads = {
            plan.nodes[u].inputs[i]["dp"]
            for u in graph.users(name)
            if u in last.nodes
            for i, r in enumerate(graph.node(u).refs)
            if r.name == name
        }
        assert reads == {"R"} if whole else "R" not in reads, (name, reads)
    _check_stages_price_as_one_microbatch(
        plan, _one_microbatch(w, cpu4, 2, dp=2, tp=1), cpu4, _half(cpu4)
    )
    assert _estimate(plan, w, cpu4) == plan
    assert Plan.from_json(plan.to_json()) == plan


def test_gpt_pipeline_of_tensor_parallel_stages(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", **GPT)
    plan = w.baseline(cpu4, dp=1, tp=2, pp=2)
    assert plan.mesh.axes == ("pp", "tp") and plan.mesh.shape == (2, 2)
    assert plan.pipeline is not None and plan.solver.status == "baseline"
    assert (plan.pipeline.schedule, plan.pipeline.num_microbatches) == ("1F1B", 2)  # pp
    first, last = plan.stages
    assert (first.ranks, last.ranks) == ((0, 1), (2, 3))
    assert (first.layers, last.layers) == (("blocks.0",), ("blocks.1",))
    assert first.received == () and first.sent == last.received and last.sent == ()
    assert first.boundary == last.boundary == {"tp": "R"}
    module = {plan.nodes[n].module: s for s, st in enumerate(plan.stages) for n in st.nodes}
    assert module["tok_emb.weight"] == module["blocks.0.mlp.fc.weight"] == 0
    assert module["blocks.1.attn.q.weight"] == module["head.weight"] == 1
    # the stage boundary is between blocks: every block keeps its Megatron split
    megatron = _storage(gpt_vocab_parallel(w).pin)
    assert {name: p.storage["tp"] for name, p in plan.params.items()} == megatron
    # a block's four all-reduces a stage; the embedding's in the first, the head's input
    # gradient and the loss's two in the last
    for s, count in ((0, 4 + 1), (1, 4 + 3)):
        activations = [c for c in plan.collectives if c.stage == s and c.phase != "grad_sync"]
        assert len(activations) == count and {(c.kind, c.axes) for c in activations} == {
            ("all_reduce", ("tp",))
        }
    _check_stages_price_as_one_microbatch(
        plan, _one_microbatch(w, cpu4, 2, dp=1, tp=2), cpu4, _half(cpu4)
    )
    assert _estimate(plan, w, cpu4) == plan  # re-priced from the document: the same numbers
    assert Plan.from_json(plan.to_json()) == plan


def test_gpt_pipeline_on_8_a100s_is_pp_outside_dp_outside_tp(a100: autoplan.Cluster) -> None:
    w = example("gpt", **{**GPT, "batch_size": 8})
    plan = w.baseline(a100, dp=2, tp=2, pp=2)
    assert plan.mesh.axes == ("pp", "dp", "tp") and plan.mesh.shape == (2, 2, 2)
    assert [st.ranks for st in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(st.boundary == {"dp": "S(0)", "tp": "R"} for st in plan.stages)
    megatron = _storage(gpt_vocab_parallel(w).pin)
    for name, p in plan.params.items():
        assert p.storage == {"dp": "R", "tp": megatron[name]}, name
    for n in plan.nodes.values():
        if n.op in ("aten.linear.default", "aten.scaled_dot_product_attention.default"):
            assert n.output["dp"] == "S(0)"  # each dp group: its slice of the microbatch
    for s in (0, 1):  # each stage synchronizes its own parameters' gradients, on dp
        assert {c.axes for c in plan.collectives if c.stage == s and c.phase == "grad_sync"} == {
            ("dp",)
        }
    _check_stages_price_as_one_microbatch(
        plan, _one_microbatch(w, a100, 2, dp=2, tp=2), a100, _half(a100)
    )
    assert _estimate(plan, w, a100) == plan
    assert Plan.from_json(plan.to_json()) == plan


def test_layers_split_evenly_and_regions_stay_inside_stages(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", **MLP_SMALL_BATCH)  # layers.0 ... layers.5, one layer each
    four = w.baseline(
        cpu4, dp=1, tp=1, pp=4, options=PlanOptions(num_microbatches=8, schedule="gpipe")
    )
    assert four.pipeline is not None and four.pipeline.schedule == "GPipe"
    assert [st.layers for st in four.stages] == [
        ("layers.0", "layers.1"),
        ("layers.2", "layers.3"),
        ("layers.4",),
        ("layers.5",),
    ]
    # one model-wide split pairs (0, 1), (2, 3), (4, 5); stages of 0-2 and 3-5 cut the
    # middle pair, whose halves stay replicated
    two = w.baseline(cpu4, dp=1, tp=2, pp=2)
    storage = {name: p.storage["tp"] for name, p in two.params.items()}
    split = {"layers.0.weight": "S(0)", "layers.1.weight": "S(1)", "layers.2.weight": "R"}
    split |= {"layers.3.weight": "S(0)", "layers.4.weight": "S(1)", "layers.5.weight": "R"}
    assert {k: v for k, v in storage.items() if k.endswith("weight")} == split


def test_pipeline_schedule_sets_the_activations_in_flight(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", **MLP_LARGE_BATCH)
    one_f_one_b = w.baseline(
        cpu4, dp=2, tp=1, pp=2, zero_stage=3, options=PlanOptions(num_microbatches=4)
    )
    gpipe = w.baseline(
        cpu4,
        dp=2,
        tp=1,
        pp=2,
        zero_stage=3,
        options=PlanOptions(num_microbatches=4, schedule="GPipe"),
    )
    assert all(p.storage == {"dp": "S(0)"} for p in gpipe.params.values())
    assert gpipe.predicted.step_time_s == one_f_one_b.predicted.step_time_s
    for a, b in zip(gpipe.stages, one_f_one_b.stages, strict=True):
        assert a.predicted is not None and b.predicted is not None
        assert a.predicted.memory_bytes > b.predicted.memory_bytes  # 4 microbatches, not 2 or 1


def test_pipeline_refusals(cpu4: autoplan.Cluster) -> None:
    with pytest.raises(AutoplanError, match=r"pp=4, but the model has 2 layer\(s\)"):
        example("gpt", **GPT).baseline(cpu4, dp=1, tp=1, pp=4)
    three = example("mlp", **MLP_SMALL_BATCH, num_layers=3)  # stage 1 is the last linear
    with pytest.raises(AutoplanError, match=r"stage 1 \(layers.2\): tp=2, but .* no linears"):
        three.baseline(cpu4, dp=1, tp=2, pp=2)
    tied = _workload(Tied(32, 16), torch.randint(0, 32, (8, 4)), torch.randint(0, 32, (8, 4)))
    with pytest.raises(AutoplanError, match=r"read by pipeline stages \[0, 1\] \(tied weights\)"):
        tied.baseline(cpu4, dp=2, tp=1, pp=2)
    straddling = dataclasses.replace(cpu4, num_nodes=2, devices_per_node=3)
    with pytest.raises(AutoplanError, match="stage of dp \\* tp = 2 devices would straddle"):
        example("gpt", **{**GPT, "batch_size": 6}).baseline(straddling, dp=2, tp=1, pp=3)
    with pytest.raises(InfeasiblePlanError, match="dp=1 tp=2 pp=2 num_microbatches=2 zero_stage"):
        example("gpt", **GPT).baseline(
            cpu4, dp=1, tp=2, pp=2, options=PlanOptions(memory_fraction=1e-6)
        )


def _kinds(plan: Plan, phase: str) -> dict[str, int]:
    """How many collectives of each kind ``plan`` has in ``phase``, scalars (a loss) aside."""
    found: dict[str, int] = {}
    for c in plan.collectives:
        if c.phase == phase and c.bytes > 8:
            found[c.kind] = found.get(c.kind, 0) + 1
    return found


def _block_norms(plan: Plan) -> list[str]:
    """The placements of the layer norms inside the blocks (past the first)."""
    norms = [n for n in plan.nodes.values() if n.op == "aten.layer_norm.default"]
    return [placement for n in norms[1:-1] for placement in n.output.values()]


def test_sequence_parallel_baseline_splits_the_sequence_between_regions(
    cpu4: autoplan.Cluster,
) -> None:
    w = example("gpt", size="small", batch_size=8, num_layers=2)
    megatron = w.baseline(cpu4, dp=1, tp=4)
    sequence = w.baseline(cpu4, dp=1, tp=4, sequence_parallel=True)
    # each row linear's all-reduce becomes a reduce-scatter, gathered before the next column
    # (the embedding's too, gathered before the head); the loss's two stay
    assert _kinds(megatron, "forward") == {"all_reduce": 4 + 1 + 2}
    assert _kinds(sequence, "forward") == {"reduce_scatter": 5, "all_gather": 5, "all_reduce": 2}
    assert set(_block_norms(megatron)) == {"R"} and set(_block_norms(sequence)) == {"S(1)"}
    assert sequence.predicted.peak_memory_bytes < megatron.predicted.peak_memory_bytes


def test_fused_qkv_gpt_baseline_splits_strided_as_megatron(cpu4: autoplan.Cluster) -> None:
    """One qkv linear, then split: Megatron interleaves its weight so that each rank holds
    its heads of q, k and v. Counted by hand, per block: two all-reduces of the (batch, seq,
    dim) float32 activations forward (after each row linear) and two backward (each region's
    input gradient); besides, the embedding's forward and the head's input gradient, and the
    loss's two; with sequence parallelism each becomes a reduce-scatter / all-gather pair. The
    same as the separate projections', collective for collective."""
    layers, tokens = GPT["num_layers"], GPT["batch_size"] * GPT["seq_len"]
    activation = tokens * 256 * 4  # "small": dim 256, float32
    fused = example("gpt", **GPT, qkv="fused")
    assert _regions_by_module(fused)[0] == (["blocks.0.attn.qkv"], ["blocks.0.attn.proj"])
    for sequence in (False, True):
        plans = {
            qkv: example("gpt", **GPT, qkv=qkv).baseline(
                cpu4, dp=1, tp=4, sequence_parallel=sequence
            )
            for qkv in ("separate", "fused")
        }
        plan = plans["fused"]
        assert plan.params["blocks.0.attn.qkv.weight"].storage == {"tp": "S(0)x3"}
        qkv_linear = next(n for n in plan.nodes.values() if n.module == "blocks.0.attn.qkv")
        assert qkv_linear.output == {"tp": "S(2)x3"}
        counted = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives)
        # the vocabulary-parallel loss: its logits' max and sum of exponentials per token
        loss = {("forward", "all_reduce", 4 * tokens): 1, ("forward", "all_reduce", 8 * tokens): 1}
        if sequence:
            assert counted == {
                ("forward", "reduce_scatter", activation): 2 * layers + 1,
                ("forward", "all_gather", activation): 2 * layers + 1,
                ("backward", "reduce_scatter", activation): 2 * layers + 1,
                ("backward", "all_gather", activation): 2 * layers + 1,
                ("backward", "all_gather", activation // 4): 1,  # the loss's token split
                ("grad_sync", "all_reduce", 10 * 256 * 4): 1,  # the norms' weights and biases
                **loss,
            }
        else:
            assert counted == {
                ("forward", "all_reduce", activation): 2 * layers + 1,
                ("backward", "all_reduce", activation): 2 * layers + 1,
                **loss,
            }
        separate = plans["separate"].collectives
        assert Counter((c.phase, c.kind, c.bytes) for c in separate) == counted


@pytest.mark.parametrize("model", ["llama", "llama-gqa", "gpt2"])
def test_megatron_baseline_of_transformers_models_counted_by_hand(
    cpu4: autoplan.Cluster, model: str
) -> None:
    """Megatron on dp=2 x tp=2 of transformers' Llama (separate q, k, v of 4 heads and 2
    key-value heads, a mask given to attention, SwiGLU; or, llama-gqa, attention without a mask,
    given the 2 key-value heads unrepeated) and GPT-2 (Conv1D ``addmm``
    projections, q|k|v fused: split strided). On the tp axis, per block: two all-reduces of
    the (batch, seq, 64) float32 activations forward and two backward; besides, the word
    embedding's forward, the head's input gradient, the loss's max and sum of exponentials;
    with sequence parallelism, each all-reduce a reduce-scatter and an all-gather."""
    w = load_workload(ROOT / "tests/models/zoo.py", model=model, batch_size=8, seq_len=32)
    layers, tokens = 2, 4 * 32  # a dp group's half of the batch
    activation = tokens * 64 * 4
    loss = {("forward", "all_reduce", 4 * tokens): 1, ("forward", "all_reduce", 8 * tokens): 1}
    regions = _regions_by_module(w)
    assert len(regions) == 2 * layers + 1  # attention and MLP of each block, the head
    plan = w.baseline(cpu4, dp=2, tp=2)
    if model == "gpt2":
        c_attn = "transformer.h.0.attn.c_attn"
        assert regions[0] == ([c_attn], ["transformer.h.0.attn.c_proj"])
        assert plan.params[f"{c_attn}.weight"].storage == {"dp": "R", "tp": "S(1)x3"}
        assert plan.params[f"{c_attn}.bias"].storage == {"dp": "R", "tp": "S(0)x3"}
        # ZeRO-3 splits the strided weight along its other dim; the bias, strided along its
        # only dim, stays whole on dp
        zero3 = w.baseline(cpu4, dp=2, tp=2, zero_stage=3).params
        assert zero3[f"{c_attn}.weight"].storage == {"dp": "S(0)", "tp": "S(1)x3"}
        assert zero3[f"{c_attn}.bias"].storage == {"dp": "R", "tp": "S(0)x3"}
    else:
        assert regions[0][1] == ["model.layers.0.self_attn.o_proj"]
    on_tp = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives if c.axes == ("tp",))
    assert on_tp == {
        ("forward", "all_reduce", activation): 2 * layers + 1,
        ("backward", "all_reduce", activation): 2 * layers + 1,
        **loss,
    }
    sequence = w.baseline(cpu4, dp=2, tp=2, sequence_parallel=True)
    on_tp = Counter((c.phase, c.kind, c.bytes) for c in sequence.collectives if c.axes == ("tp",))
    forward = {
        ("forward", "reduce_scatter", activation): 2 * layers + 1,
        ("forward", "all_gather", activation): 2 * layers + 1,
        **loss,
    }
    # backward, each all-gather's gradient reduce-scattered (a Conv1D's too, through the
    # flattening view that reads the sequence gathered) and each reduce-scatter's gathered
    backward = {
        ("backward", "all_gather", activation): 2 * layers + 1,
        ("backward", "reduce_scatter", activation): 2 * layers + 1,
    }
    if model == "gpt2":  # and the learned positions' gradient (32 x 64), gathered whole
        backward[("backward", "all_gather", 32 * 64 * 4)] = 1
        # the views that flatten the gathered sequence for c_attn and c_fc keep the partial
        # gradient partial; the plan so written is checked and priced again alike
        kept = {n.module: n.grad for n in sequence.nodes.values() if n.grad}
        blocks = ("transformer.h.0", "transformer.h.1")
        modules = [f"{b}.{m}" for b in blocks for m in ("attn.c_attn", "mlp.c_fc")]
        assert kept == {module: {"dp": "S(0)", "tp": "P"} for module in modules}
        assert _estimate(sequence, w, cpu4) == sequence
    assert on_tp == {**forward, **backward}


@pytest.mark.parametrize("model", ["llama", "llama-gqa"])
def test_fewer_key_value_heads_than_tp_ranks_are_computed_whole(
    cpu4: autoplan.Cluster, model: str
) -> None:
    """Megatron on tp=4 of transformers' Llama, 4 query heads and 2 key-value heads: the
    query heads split, one a rank; k and v computed whole on every rank (vLLM's replicated
    key-value heads), each rank attending with the head its query head reads. Per block on
    tp: two all-reduces forward and two backward of the (batch, seq, 64) activations, as
    always; besides, the gradients of k and v, partial sums: all-reduced as (batch, seq, 32)
    where attention reads them unrepeated (llama-gqa), or, repeated to the 4 query heads and
    sliced by heads (llama), gathered from the ranks' heads (batch, 4, seq, 16)."""
    w = load_workload(ROOT / "tests/models/zoo.py", model=model, batch_size=8, seq_len=32)
    layers, tokens = 2, 8 * 32
    activation = tokens * 64 * 4
    plan = w.baseline(cpu4, dp=1, tp=4)
    storage = {n.split(".")[-2]: p.storage["tp"] for n, p in plan.params.items() if ".0." in n}
    assert storage["q_proj"] == "S(0)" and storage["o_proj"] == "S(1)"
    assert storage["k_proj"] == storage["v_proj"] == "R"
    on_tp = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives)
    keys = (
        ("backward", "all_reduce", tokens * 32 * 4)
        if model == "llama-gqa"
        else ("backward", "all_gather", tokens * 64 * 4)
    )
    expected = Counter(
        {
            ("forward", "all_reduce", activation): 2 * layers + 1,
            ("backward", "all_reduce", activation): 2 * layers + 1,
            ("forward", "all_reduce", 4 * tokens): 1,  # the loss's max
            ("forward", "all_reduce", 8 * tokens): 1,  # and its sum of exponentials
        }
    )
    expected[keys] += 2 * layers  # k's and v's of each block
    assert on_tp == expected


def test_the_planner_splits_tokens_between_regions_where_only_that_fits() -> None:
    # a 1.3B GPT's blocks, tensor parallel over 8 A100s: under a budget that Megatron's plan
    # (layer norms and residuals whole on every GPU) exceeds, the planner's fits by splitting
    # them (along the sequence or the batch: the same collectives, a reduce-scatter after each
    # row linear and an all-gather before each column linear)
    cluster = autoplan.Cluster.load(ROOT / "costmodels" / "dgx-a100-80gb.json")
    w = example("gpt", size="1.3b", batch_size=8, num_layers=2, device="meta", dtype="bfloat16")
    # 1.4 GiB for the tensors, the allocator's margin aside
    budget = PlanOptions(memory_fraction=1.4 * 2**30 / cluster.device.tensor_bytes(1.0))
    with pytest.raises(InfeasiblePlanError, match=r"needs 1\.64 GiB"):
        w.baseline(cluster, dp=1, tp=8, options=budget)
    pins = gpt_vocab_parallel(w).pin
    plan = w.plan(cluster, dataclasses.replace(budget, mesh_shape=(8,), pin=pins))
    assert plan.predicted.peak_memory_bytes < 1.4 * 2**30
    assert set(_block_norms(plan)) <= {"S(0)", "S(1)"}
    forward = _kinds(plan, "forward")
    assert forward["reduce_scatter"] >= 4 and forward["all_gather"] >= 4


# every op of a transformer that reads the batch: under data parallelism each runs on its
# rank's share of the batch, as DDP runs it
BATCH_OPS = (
    "aten.linear.default",
    "aten.addmm.default",
    "aten.scaled_dot_product_attention.default",
    "aten.layer_norm.default",
    "aten.rms_norm.default",
    "aten.cross_entropy_loss.default",  # its output: the partial sum of a quarter's losses
)


@pytest.mark.parametrize(
    ("model", "backward"),
    [
        ("llama", 0),  # rotary positions enter by a product: nothing to reduce
        ("gpt2", 1),  # the learned positions' gradient, summed over the ranks' batches
    ],
)
def test_data_parallel_baseline_of_a_transformers_model_is_ddp(
    cpu4: autoplan.Cluster, model: str, backward: int
) -> None:
    """What DDP does, counted by hand: every op that reads the batch runs on a quarter of it
    (the attention mask, made whole, sliced for free), and the only collectives are the
    gradients' bucketed all-reduce, the loss's two scalars (its sum and its count), and for
    learned position embeddings the all-reduce of their gradient in backward."""
    w = load_workload(ROOT / "tests/models/zoo.py", model=model, batch_size=16, seq_len=64)
    plan = w.baseline(cpu4, dp=4, tp=1)
    assert plan.mesh.axes == ("dp",)
    batch_ops = [n for n in plan.nodes.values() if n.op in BATCH_OPS]
    # the loss of a quarter of the batch: a partial sum
    want = {n.op: "S(0)" for n in batch_ops} | {"aten.cross_entropy_loss.default": "P"}
    assert len(batch_ops) > 10 and all(n.output["dp"] == want[n.op] for n in batch_ops), [
        (n.op, n.module) for n in batch_ops if n.output["dp"] != want[n.op]
    ]
    counted = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives)
    assert counted[("forward", "all_reduce", 4)] == 2
    assert sum(k for (phase, *_), k in counted.items() if phase == "grad_sync") >= 1
    assert all(kind == "all_reduce" for (_, kind, _) in counted)
    assert sum(k for (phase, *_), k in counted.items() if phase == "backward") == backward


def test_data_parallel_baseline_splits_gpt2s_padding_mask_by_batch_position(
    cpu4: autoplan.Cluster,
) -> None:
    """transformers' GPT-2 given a left-padded attention mask gathers the mask's rows by a
    batch-long arange (global positions): the mask kept whole (every rank is given the whole
    batch), the positions sliced, so the mask's rows, and attention, follow the batch; the
    collectives stay DDP's (the loss's two scalars, the gradients' buckets, the learned
    positions' gradient)."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 128, (16, 32))
    mask = torch.ones(16, 32, dtype=torch.long)
    mask[:, :5] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    w = Workload(transformers.GPT2LMHeadModel(config), batch)
    plan = w.baseline(cpu4, dp=4, tp=1)
    ops = {n.op: n.output["dp"] for n in plan.nodes.values() if n.module == "transformer"}
    assert ops["aten.index.Tensor"] == ops["aten.__and__.Tensor"] == "S(0)"
    batch_ops = [n for n in plan.nodes.values() if n.op in BATCH_OPS]
    assert all(n.output["dp"] in ("S(0)", "P") for n in batch_ops)
    kinds = Counter((c.phase, c.kind) for c in plan.collectives)
    assert set(kinds) <= {
        ("forward", "all_reduce"),
        ("backward", "all_reduce"),
        ("grad_sync", "all_reduce"),
    }
    assert kinds[("forward", "all_reduce")] == 2 and kinds[("backward", "all_reduce")] == 1


def test_torchtitan_llama_plan_counted_by_hand(cpu4: autoplan.Cluster) -> None:
    """torchtitan's ``parallelize_llama`` on dp=2 x tp=2 of transformers' Llama (2 blocks,
    dim 64, 4 heads of 16 and 2 key-value heads, MLP 128, vocabulary 128), counted by hand.
    On tp (``apply_tp``, sequence parallel): per block, the attention's and the MLP's
    inputs all-gathered along the sequence and their row linears' outputs reduce-scattered;
    the embedding's lookup (RowwiseParallel: along the vocabulary) reduce-scattered, the
    head's input gathered; backward the mirror image; the loss on the vocabulary's shards
    (``loss_parallel``): its max and sum of exponentials; and each RMSNorm weight's gradient,
    partial over the sequence's parts, all-reduced. On dp (``fully_shard``): every weight
    gathered once, before use, from its dp shard, and its gradient reduce-scattered."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="llama", batch_size=8, seq_len=32)
    plan = w.baseline(cpu4, dp=2, tp=2, style="torchtitan")
    tokens = 4 * 32  # a dp group's half of the batch
    activation = tokens * 64 * 4
    on_tp = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives if c.axes == ("tp",))
    assert on_tp == {
        ("forward", "all_gather", activation): 5,
        ("forward", "reduce_scatter", activation): 5,
        ("backward", "all_gather", activation): 5,
        ("backward", "reduce_scatter", activation): 5,
        ("forward", "all_reduce", 4 * tokens): 1,
        ("forward", "all_reduce", 8 * tokens): 1,
        ("grad_sync", "all_reduce", 64 // 2 * 4): 5,  # 5 norms' weights, each a dp half
    }
    # each weight's tp share, gathered whole on dp: q, o (64, 64) and k, v (32, 64) split by
    # heads; gate, up, down (128, 64); embedding and head (128, 64); the five norms (64,)
    layers, half = 2, 4 // 2
    shares = Counter(
        {64 * 64 * half: 2 * layers, 32 * 64 * half: 2 * layers, 128 * 64 * half: 3 * layers + 2}
    ) + Counter({64 * 4: 2 * layers + 1})
    on_dp = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives if c.axes == ("dp",))
    gathered = {("forward", "all_gather", b): n for b, n in shares.items()}
    scattered = {("grad_sync", "reduce_scatter", b): n for b, n in shares.items()}
    assert on_dp == {**gathered, **scattered, ("forward", "all_reduce", 4): 2}  # loss, count
    params = plan.params
    assert params["model.embed_tokens.weight"].placements == {"dp": "R", "tp": "S(0)"}
    assert params["lm_head.weight"].placements == {"dp": "R", "tp": "S(0)"}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        read = "S(1)" if name == "o_proj" else "S(0)"
        p = params[f"model.layers.0.self_attn.{name}.weight"]
        assert p.placements == {"dp": "R", "tp": read} and p.storage["dp"] != "R", name
    norms = [n for n in plan.nodes.values() if n.module.endswith(("layernorm", "model.norm"))]
    assert len(norms) == 8 * (2 * layers + 1)  # RMSNorm's 8 ops, each split along the sequence
    assert all(n.output == {"dp": "S(0)", "tp": "S(1)"} for n in norms)
    # the same plan as Megatron's with sequence parallelism and ZeRO-3
    same = w.baseline(cpu4, dp=2, tp=2, zero_stage=3, sequence_parallel=True)
    assert same.collectives == plan.collectives and same.predicted == plan.predicted
    with pytest.raises(AutoplanError, match=r"style='torchtitan' sets FSDP .* zero_stage \(3\)"):
        w.baseline(cpu4, dp=2, tp=2, zero_stage=3, style="torchtitan")
    with pytest.raises(AutoplanError, match="style 'deepspeed' is not known"):
        w.baseline(cpu4, dp=2, tp=2, style="deepspeed")


class FusedGQA(nn.Module):
    """One q|k|v linear of 8 query heads and 2 key-value heads, split into unequal pieces."""

    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 2, mlp: bool = True) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = SwiGLU(dim) if mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=2)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return self.mlp(x) if self.mlp is not None else x


def test_a_fused_projection_of_unequal_pieces_splits_strided_as_megatron(
    cpu4: autoplan.Cluster,
) -> None:
    """Grouped-query attention's fused q|k|v (8 query heads, 2 key-value heads: widths 64,
    16, 16) is stored "S(0)x4:1:1", each tp rank's share of each piece, split into plainly
    split q, k and v: Megatron's two all-reduces a block forward (the attention's and the
    MLP's row linears) and, backward, the MLP's column input's (the attention's input is the
    model's input: no gradient). With more ranks than key-value heads, refused by name."""
    x, target = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
    w = _workload(FusedGQA(), x, target)
    plan = w.baseline(cpu4, dp=2, tp=2)
    storage = {n: p.storage["tp"] for n, p in plan.params.items() if n.endswith("weight")}
    assert storage == {
        "qkv.weight": "S(0)x4:1:1",
        "proj.weight": "S(1)",
        "mlp.norm.weight": "R",
        "mlp.w1.weight": "S(0)",
        "mlp.w3.weight": "S(0)",
        "mlp.w2.weight": "S(1)",
    }
    split = plan.nodes["split_with_sizes"]
    assert (split.inputs[0]["tp"], split.output["tp"]) == ("S(2)x4:1:1", "S(2)")
    activation = 4 * 16 * 64 * 4  # a dp group's half of the batch, float32
    on_tp = Counter((c.phase, c.kind, c.bytes) for c in plan.collectives if c.axes == ("tp",))
    assert on_tp == {
        ("forward", "all_reduce", activation): 2,
        ("backward", "all_reduce", activation): 1,
    }
    with pytest.raises(AutoplanError, match=r"tp=4 does not divide"):
        w.baseline(cpu4, dp=1, tp=4)
