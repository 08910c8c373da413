"""Pipeline planning: layers, stage graphs, and the shape of plans on simulated clusters."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any

import networkx as nx
import pytest
import torch
from torch import nn

import autoplan
from autoplan import PlanOptions
from autoplan.costmodel.pipeline_price import sent_bytes
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import AutoplanError, InfeasiblePlanError, PlanFormatError
from autoplan.graph.capture import capture, capture_microbatches
from autoplan.graph.crossing import crossing_points
from autoplan.graph.cut import (
    DEFAULT_MAX_LAYERS,
    Layer,
    crossing_tuple,
    cut_layers,
    shared_params,
    stage_graph,
)
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import NO_RECOMPUTE, chosen
from autoplan.modes import NodeKind
from autoplan.search.layer_plans import LayerGraphs, StageSolver
from autoplan.search.partition import may_fit
from autoplan.search.stage_layout import boundary_specs, stage_sizes
from autoplan.strategies.space import node_strategies
from autoplan.workload import load_workload
from tests.conftest import ROOT, example
from tests.distributed.cases import data_parallel


def _gpt_graph(num_layers: int = 4) -> autoplan.graph.ir.Graph:
    w = example("gpt", size="small", num_layers=num_layers, batch_size=2, seq_len=32)
    return capture(w.model, w.example_inputs, w.loss_fn, w.example_target)


def test_layers_are_the_blocks_and_cover_every_node_once() -> None:
    graph = _gpt_graph(4)
    layers = cut_layers(graph)
    assert [layer.name for layer in layers] == [f"blocks.{i}" for i in range(4)]
    names = [n for layer in layers for n in layer.nodes]
    assert sorted(names) == sorted(n.name for n in graph)
    first, last = set(layers[0].nodes), set(layers[-1].nodes)
    assert {n.name for n in graph if n.kind == NodeKind.INPUT} <= first  # the batch enters first
    assert any(graph.node(n).module_path == "tok_emb" for n in first)
    assert any(graph.node(n).module_path == "head" for n in last)
    assert any(graph.node(n).kind == NodeKind.OUTPUT for n in last)
    for i, layer in enumerate(layers):  # a parameter sits with its readers
        for name in layer.nodes:
            if graph.node(name).kind == NodeKind.PARAM:
                assert all(u in layer.nodes for u in graph.users(name)), name
        assert all(  # and every node reads only its own or earlier layers
            any(r.name in earlier.nodes for earlier in layers[: i + 1])
            for name in layer.nodes
            for r in graph.node(name).refs
        )
    assert shared_params(graph, layers) == {}


def test_more_blocks_than_max_layers_are_merged_evenly() -> None:
    layers = cut_layers(_gpt_graph(4), max_layers=3)
    assert [layer.name for layer in layers] == ["blocks.0-1", "blocks.2", "blocks.3"]


def test_a_model_without_blocks_is_cut_by_flops() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    graph = capture(model, x, nn.functional.mse_loss, y)
    layers = cut_layers(graph, max_layers=4)
    assert len(layers) == 4
    flops = [sum(graph.node(n).flops for n in layer.nodes) for layer in layers]
    assert max(flops) <= 1.5 * min(flops), flops


class _Residual(nn.Module):
    """No repeated blocks (no ``name.<index>`` module paths): groups of three linears, each
    group skipped over by a residual add, so that inside a group two activations cross."""

    def __init__(self, width: int = 32, groups: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.names = [[f"g{g}_fc{k}" for k in range(3)] for g in range(groups)]
        for name in (n for group in self.names for n in group):
            self.add_module(name, nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for group in self.names:
            skipped = h
            for k, name in enumerate(group):
                h = getattr(self, name)(h)
                h = torch.relu(h) if k < 2 else h
            h = h + skipped
        return h


def _residual_graph() -> Graph:
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    return capture(_Residual(), x, nn.functional.mse_loss, y)


def _first_ops(graph: Graph, layers: tuple[Layer, ...]) -> list[int]:
    """Where each layer after the first starts, as a point of the graph's op order."""
    ops = [n.name for n in graph if n.kind == NodeKind.OP]
    return [ops.index(next(n for n in layer.nodes if n in ops)) for layer in layers[1:]]


@pytest.mark.parametrize("max_layers", [2, 3, 4])
def test_a_model_without_blocks_is_cut_where_one_tensor_crosses(max_layers: int) -> None:
    graph = _residual_graph()
    layers = cut_layers(graph, max_layers=max_layers)
    assert len(layers) == max_layers
    x, target = [n.name for n in graph if n.kind == NodeKind.INPUT]
    loss = next(n for n in graph if n.op == "aten.mse_loss.default").name
    for i in range(len(layers) - 1):
        sent = stage_graph(graph, layers, i, i + 1).sent
        (h,) = [name for name in sent if name != target]  # one tensor, besides the target
        assert graph.node(h).op == "aten.add.Tensor"  # the residual stream, after a group
        # an articulation of the dataflow: every path from the input to the loss runs through h
        dag = graph.dataflow.copy()
        dag.remove_node(h)
        assert not nx.has_path(dag, x, loss)
    flops = [sum(graph.node(n).flops for n in layer.nodes) for layer in layers]
    assert max(flops) <= 1.5 * sum(flops) / len(flops), flops  # and still about balanced


@pytest.mark.parametrize("model", ["residual", "gpt"])
def test_the_bytes_crossing_a_cut_are_what_the_stage_dp_charges(model: str) -> None:
    graph = _residual_graph() if model == "residual" else _gpt_graph(4)
    points = crossing_points(graph)
    layers = cut_layers(graph, max_layers=4)
    assert points.nbytes[0] == sum(n.output.nbytes for n in graph if n.kind == NodeKind.INPUT)
    for i, point in enumerate(_first_ops(graph, layers)):
        stage = stage_graph(graph, layers, i, i + 1)
        assert points.tensors[point] == len(stage.sent)
        assert points.nbytes[point] == sum(graph.node(n).output.nbytes for n in stage.sent)
        # what one rank sends on under a replicated boundary: the whole tensors
        assert points.nbytes[point] == sent_bytes(stage, (1,), ("R",))


class _Halves(nn.Module):
    """A chunk (an op with two outputs) whose halves are read far apart."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(width, width)
        self.c, self.d = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = self.a(x).chunk(2, dim=-1)
        return self.d(self.c(self.b(left))) + right


@pytest.mark.parametrize("max_layers", [2, 4, 8])
def test_a_model_without_blocks_is_not_cut_through_an_op_with_several_outputs(
    max_layers: int,
) -> None:
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    graph = capture(_Halves(), x, nn.functional.mse_loss, y)
    chunk = next(n for n in graph if len(n.outputs) > 1 and n.op == "aten.chunk.default")
    layers = cut_layers(graph, max_layers=max_layers)
    assert len(layers) > 1
    for i in range(len(layers) - 1):
        stage = stage_graph(graph, layers, i, i + 1)  # refuses a cut through a chunk
        assert chunk.name not in stage.sent


def test_a_stage_receives_what_it_reads_and_passes_the_target_on() -> None:
    graph = _gpt_graph(4)
    layers = cut_layers(graph)
    target = [n.name for n in graph if n.kind == NodeKind.INPUT][-1]
    middle = stage_graph(graph, layers, 1, 3)
    assert target in middle.received and target in middle.sent  # on its way to the loss
    assert len(middle.received) == 2 and len(middle.sent) == 2  # and the residual stream
    assert all(middle.graph.node(n).kind == NodeKind.INPUT for n in middle.received)
    last = stage_graph(graph, layers, 3, 4)
    assert last.sent == () and last.graph.nodes[-1].name == "output"
    whole = stage_graph(graph, layers, 0, 4)
    assert whole.received == () and whole.sent == () and len(whole.graph) == len(graph)


def test_stage_sizes_and_boundaries() -> None:
    a100 = autoplan.Cluster.load("costmodels/dgx-a100-80gb.json", num_nodes=4)
    assert stage_sizes(a100) == [1, 2, 4, 8, 16]  # 32 devices in 2 or more uniform stages
    assert boundary_specs((8,)) == [("R",), ("S(0)",)]
    assert boundary_specs((1,)) == [("R",)]  # one rank: a split is the whole tensor
    assert boundary_specs((32,), spans_nodes=True) == [("S(0)",)]
    assert boundary_specs((4, 8), spans_nodes=True) == [("S(0)", "R"), ("S(0)", "S(0)")]


def _intra_node_axes(plan: autoplan.Plan, cluster: autoplan.Cluster) -> set[str]:
    shape = tuple(plan.mesh.shape)
    return {
        axis
        for i, axis in enumerate(plan.mesh.axes)
        if cluster.axis_link(shape, i) == cluster.intra_node
    }


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2, 4])
def test_slow_links_keep_tensor_sharding_inside_nodes(nodes: int) -> None:
    cluster = autoplan.Cluster.load("costmodels/dgx-a100-80gb.json", num_nodes=nodes)
    w = example("gpt", size="1.3b", num_layers=8, batch_size=8 * nodes, device="meta")
    plan = w.plan(cluster)
    inside = _intra_node_axes(plan, cluster)
    # tensor parallelism (weights split where they are used) stays on NVLink; across nodes
    # every matmul splits its batch: data parallelism (or pipeline stages)
    linears = [n for n in plan.nodes.values() if n.op == "aten.linear.default"]
    across = set(plan.stage_axes) - inside
    for axis in across:
        assert all(n.output[axis] == "S(0)" and n.inputs[1][axis] == "R" for n in linears), axis
    # inside the nodes, tensor parallelism or more data parallelism, whichever prices faster:
    # a data-parallel ring across nodes runs one ring through each GPU's NIC, so it is
    # not slowed to one NIC's bandwidth; either way the check above saw an axis across nodes
    assert across


@pytest.mark.slow
def test_too_big_for_one_node_gets_stages_across_nodes() -> None:
    # A100-like nodes of 2 devices of 40 MiB: the activations of this small GPT need more
    # than one node has however it is sharded, unless recomputed
    base = autoplan.Cluster.load("costmodels/dgx-a100-80gb.json")
    # 40 MiB, of which 36 the plan may use (no allocator margin)
    device = dataclasses.replace(base.device, memory_bytes=40 * 2**20, allocator_margin=0.0)
    node = dataclasses.replace(base, device=device, devices_per_node=2, num_nodes=1, name="tiny")
    w = example("gpt", size="small", num_layers=4, batch_size=16, seq_len=64)
    keep = PlanOptions(recompute="none")
    with pytest.raises(autoplan.errors.InfeasiblePlanError, match="does not fit"):
        w.plan(node, keep)
    assert w.plan(node).recompute  # recomputation fits it on one node
    cluster = node.with_nodes(2)
    # under 1F1B, whose step the formula below says (ZeroBubble's is simulated). The one-stage
    # (2, 2) mesh's ILP, its memory tight, stopped at the 60 s default 1.8-2.4% from proven;
    # its plan is over the limit anyway, so 10 s serve as well
    tight = dataclasses.replace(keep, schedule="1F1B", time_limit_s=10.0)
    plan = w.plan(cluster, tight)
    assert plan.pipeline is not None and plan.mesh.axes[0] == "pp"
    assert len(plan.stages) == plan.mesh.shape[0] >= 2
    stage_size = math.prod(plan.mesh.shape[1:])
    assert all(len(s.ranks) == stage_size for s in plan.stages)
    assert sorted(r for s in plan.stages for r in s.ranks) == list(range(cluster.num_devices))
    limit = plan.predicted.memory_limit_bytes
    assert all(s.predicted is not None and s.predicted.memory_bytes <= limit for s in plan.stages)
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(plan.nodes)
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    times = [s.predicted.time_s for s in plan.stages if s.predicted is not None]
    count, stages = plan.pipeline.num_microbatches, len(times)
    assert count == 8  # across nodes one count serves: twice the deepest pipeline (4 stages)
    scheduled = sum(times) + (count - 1) * max(times)
    bubble = plan.pipeline.bubble_fraction
    assert bubble == pytest.approx(1 - count * sum(times) / stages / scheduled)
    assert bubble >= (stages - 1) / (stages + count - 1) - 1e-12  # equal stages idle least


def test_pipeline_options_are_checked(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="small", num_layers=2, batch_size=6, seq_len=32)
    with pytest.raises(AutoplanError, match="num_microbatches=4"):
        w.plan(cpu4, options=PlanOptions(pipeline=True, num_microbatches=4))
    with pytest.raises(AutoplanError, match="num_stages=3"):
        w.plan(cpu4, options=PlanOptions(num_stages=3))
    with pytest.raises(AutoplanError, match="only 2 layer"):
        w.plan(cpu4, options=PlanOptions(num_stages=4, num_microbatches=2))
    with pytest.raises(AutoplanError, match="schedule"):
        w.plan(cpu4, options=PlanOptions(pipeline=True, schedule="zigzag"))


def test_stages_of_one_rank_are_planned_replicated(cpu4: autoplan.Cluster) -> None:
    # On one rank every placement is the whole tensor, and the ILP would pick among them at
    # no cost; the executor would then run the ops it picked "P" or "S" through DTensor, for
    # nothing. Only "R" is offered there, so the plan says what runs: plain local ops.
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    plan = w.plan(cpu4, options=PlanOptions(pipeline=True, num_stages=4, num_microbatches=4))
    assert len(plan.stages) == 4 and plan.mesh.shape[1:] == (1,)
    specs = [n.output for n in plan.nodes.values()] + [
        spec for n in plan.nodes.values() for spec in n.inputs
    ]
    specs += [s.boundary for s in plan.stages if s.boundary]
    assert all(set(spec.values()) <= {"R"} for spec in specs)


def test_a_batch_of_one_crosses_stages_whole_beside_the_split_batch(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' Llama's rotary tables, (1, seq, head_dim) broadcast against the batch,
    cross every stage boundary. A boundary splitting the batch sends them whole (`fitted`),
    so such a pipeline is planned (none was: they could not split) and sends them so. A
    microbatch of one sample is split by no boundary: only the replicated one is tried."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="llama", batch_size=16, seq_len=16)
    tried: list[tuple[str, ...]] = []  # the boundaries the stage DP plans layers at
    init = StageSolver.__init__

    def recording(self: StageSolver, *args: Any, **kwargs: Any) -> None:
        tried.append(args[3])
        init(self, *args, **kwargs)

    monkeypatch.setattr(StageSolver, "__init__", recording)
    options = PlanOptions(num_stages=2, num_microbatches=2, mesh_shape=(2,), schedule="1F1B")
    plan = w.plan(cpu4, options)
    assert tried == [("R",), ("S(0)",)]
    first, last = plan.stages
    assert first.boundary == last.boundary == {"dp": "S(0)"}
    graph = w.trace(2)
    layers = cut_layers(graph)
    stage = stage_graph(graph, layers, 0, len(layers) // 2)
    assert stage.sent == last.received
    shapes = [graph.node(n).output for n in stage.sent]
    assert sorted(t.shape for t in shapes if t.shape[0] == 1) == [(1, 16, 16)] * 2
    # a rank sends its half of the batch's tensors and the whole tables
    halves = sum(t.nbytes if t.shape[0] == 1 else t.nbytes // 2 for t in shapes)
    assert sent_bytes(stage, (2,), ("S(0)",)) == halves
    tried.clear()
    w.plan(cpu4, dataclasses.replace(options, num_microbatches=16))
    assert tried == [("R",)]


def test_stages_sharing_cores_fill_each_others_bubbles(cpu4: autoplan.Cluster) -> None:
    # 4 one-rank stages on 2 cores: a rank waiting in the bubble leaves its core to the others
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    options = PlanOptions(pipeline=True, num_stages=4, num_microbatches=4)
    alone = w.plan(cpu4, options)
    shared = w.plan(dataclasses.replace(cpu4, cores_per_node=2), options)
    assert shared.nodes == alone.nodes  # the same decisions, priced otherwise
    stages = [s.predicted for s in alone.stages]
    assert all(s is not None for s in stages)
    times = [s.time_s for s in stages if s is not None]
    count = options.num_microbatches
    assert count is not None
    # each stage's work at a whole core (twice its profiled speed), over the 2 cores
    work = count * sum(times) / 2 / 2
    assert work < shared.predicted.step_time_s < alone.predicted.step_time_s
    every_core = w.plan(dataclasses.replace(cpu4, cores_per_node=4), options)
    assert every_core.predicted.step_time_s == pytest.approx(alone.predicted.step_time_s)


@pytest.mark.slow
def test_microbatches_and_schedule_are_searched(cpu4: autoplan.Cluster) -> None:
    # from twice the stages (8), the count halves while that is faster; each count is priced
    # under every schedule (1F1B only with a microbatch a stage at least, as torch requires)
    shared = dataclasses.replace(cpu4, cores_per_node=2)
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    options = PlanOptions(pipeline=True, num_stages=4)
    plan = w.plan(shared, options)
    assert plan.pipeline is not None
    count, schedule = plan.pipeline.num_microbatches, plan.pipeline.schedule
    assert count < 8  # here fewer, larger microbatches win: the search moved

    def forced(count: int, schedule: str) -> float:
        forcing = dataclasses.replace(options, num_microbatches=count, schedule=schedule)
        return w.plan(shared, forcing).predicted.step_time_s

    step = plan.predicted.step_time_s
    assert step == pytest.approx(forced(count, schedule))
    schedules = ("1F1B", "GPipe", "ZeroBubble")
    neighbours = [(c, s) for c in (count // 2, count, 2 * count) for s in schedules]
    for c, s in neighbours:
        if c >= 1 and (c, s) != (count, schedule) and not (s == "1F1B" and c < 4):
            assert step <= forced(c, s) + 1e-12, (c, s)
    if count < 4:
        assert schedule in ("GPipe", "ZeroBubble")
        with pytest.raises(AutoplanError, match="1F1B needs at least as many microbatches"):
            forced(count, "1F1B")


def test_a_plan_torch_would_refuse_is_refused_on_load(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    plan = w.plan(cpu4, options=PlanOptions(num_stages=4, num_microbatches=4, schedule="1F1B"))
    doc = json.loads(plan.to_json())
    doc["pipeline"]["num_microbatches"] = 2  # fewer than the 4 stages
    with pytest.raises(PlanFormatError, match="pipeline: schedule 1F1B needs"):
        autoplan.Plan.from_json(json.dumps(doc))
    doc["pipeline"]["schedule"] = "GPipe"
    assert autoplan.Plan.from_json(json.dumps(doc)).pipeline == dataclasses.replace(
        plan.pipeline, num_microbatches=2, schedule="GPipe"
    )


def test_ranks_sharing_cores_weigh_pipelines_by_default(cpu4: autoplan.Cluster) -> None:
    # a rank waiting in a pipeline's bubble leaves its core to the others, so on CPU ranks
    # sharing cores a pipeline can beat one stage: the planner weighs both, unasked
    shared = dataclasses.replace(cpu4, cores_per_node=2)
    w = example("mlp", batch_size=256, hidden=256)
    own = w.plan(shared)
    one_stage = w.plan(shared, options=PlanOptions(pipeline=False)).predicted.step_time_s
    piped = w.plan(shared, options=PlanOptions(pipeline=True)).predicted.step_time_s
    assert own.predicted.step_time_s == min(one_stage, piped)
    assert own.pipeline is not None and piped < one_stage
    # pins hold for one stage only: never silently dropped for a pipeline
    pinned = w.plan(shared, data_parallel(w, (4,)))
    assert pinned.pipeline is None


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
@pytest.mark.parametrize("recomputed", [False, True])
def test_memory_floor_is_under_every_strategy(mesh: tuple[int, ...], recomputed: bool) -> None:
    # the pipeline search skips stage sizes on these floors: a floor above what some strategy
    # needs would skip plans that fit
    graph = _gpt_graph(num_layers=2)
    cluster = autoplan.Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")
    pricer = Pricer(cluster, mesh, "adam", chosen(graph, DEFAULT_MAX_LAYERS, recomputed))
    checked = 0
    for node in graph:
        for strategy in node_strategies(node, graph, mesh).strategies:
            assert pricer.memory_floor(node) <= pricer.node_memory(node, strategy) + 1e-6, node.name
            checked += 1
    assert checked > len(graph)
    assert sum(pricer.memory_floor(n) for n in graph) > 0


def test_stage_sizes_that_cannot_fit_are_not_planned(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    options = PlanOptions(pipeline=True, num_stages=2, num_microbatches=4)
    plan = w.plan(cpu4, options)
    assert plan.pipeline is not None
    # the floors let the plan found through, and rule it out in a 1000th of its memory
    graph = capture_microbatches(w.model, w.example_inputs, w.loss_fn, w.example_target)(4)
    parts = LayerGraphs.of(graph, cut_layers(graph, DEFAULT_MAX_LAYERS))
    pricer = Pricer(cpu4.stage(2), plan.mesh.shape[1:], "adam", NO_RECOMPUTE)
    need = plan.predicted.peak_memory_bytes
    assert may_fit(parts, pricer, [2], 4, need)
    assert not may_fit(parts, pricer, [2], 4, need / 1000)

    def unplanned(*args: object) -> None:
        raise AssertionError("a layer was planned for stages that cannot fit")

    monkeypatch.setattr(StageSolver, "_solve", unplanned)
    fraction = need / 1000 / cpu4.device.memory_bytes
    with pytest.raises(InfeasiblePlanError, match="no pipeline fits"):
        w.plan(cpu4, dataclasses.replace(options, memory_fraction=fraction, recompute="none"))


class _SplitOnce(nn.Module):
    """Its first block splits a tensor in two, and every later block reads both halves (as
    GPT-J's layers read one rotary table split into sines and cosines)."""

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.lin(x)
            a, b = torch.split(h, 8, dim=-1)
            return h, a, b

    class Later(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(h) * torch.cat([b, a], dim=-1)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([self.First(), *(self.Later() for _ in range(3))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, a, b = self.blocks[0](x)
        for block in self.blocks[1:]:
            h = block(h, a, b)
        return h


def test_a_tuple_read_across_layers_leaves_the_plan_unpipelined(
    cpu4: autoplan.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    model = _SplitOnce()
    graph = capture(model, x, nn.functional.mse_loss, y)
    layers = cut_layers(graph)
    found = crossing_tuple(graph, layers)
    assert found is not None and graph.node(found[0]).op == "aten.split.Tensor" and found[1] == 0
    with caplog.at_level(logging.INFO, logger="autoplan.search.pipeline_search"):
        plan = autoplan.plan(model, x, cpu4, loss_fn=nn.functional.mse_loss, example_target=y)
    assert plan.pipeline is None  # planned, as one stage, where it had failed
    assert "no pipeline: " in caplog.text and "several outputs" in caplog.text
