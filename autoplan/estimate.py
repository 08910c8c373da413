"""Re-price a plan: the same decisions, checked against the model and the cluster, with their
collectives, gradient buckets and predicted cost derived again for a cluster (another cluster,
or the same after the plan was edited by hand). `derive` is what `autoplan.parallelize` does
with a plan it is given, too: a plan's collectives are never taken from its file."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import price_pipeline
from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import PricedStep, price_step
from autoplan.errors import BatchSplitError, PlanFormatError
from autoplan.graph.capture import capture_microbatches
from autoplan.graph.cut import Layer, StageGraph, stage_graph
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import Recompute
from autoplan.planfile.assemble import (
    assemble_pipeline_plan,
    collective_plans,
    predicted,
    provenance,
)
from autoplan.planfile.check import assignment_of, check_plan
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import Placements
from autoplan.search.pipeline_search import GraphForMicrobatches
from autoplan.search.stage_layout import boundary_assignment
from autoplan.strategies.space import Strategy

log = logging.getLogger(__name__)


def _spec(placements: Placements, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(placements[a] for a in axes)


def _stage_assignment(plan: Plan, s: int, stage: StageGraph) -> dict[str, Strategy]:
    """Stage ``s``'s strategies: its nodes as the plan writes them, what it receives and sends
    in the boundary placement."""
    axes = plan.stage_axes
    boundary = _spec(plan.stages[s].boundary, axes) if plan.stages[s].boundary else ()
    whole = assignment_of(plan, Graph(tuple(n for n in stage.graph if n.name in stage.nodes), ""))
    final = whole.get(stage.graph.nodes[-1].name)
    whole.update(boundary_assignment(stage, boundary, final.inputs if final else ()))
    return whole


def estimate(
    plan: Plan | str | Path,
    cluster: Cluster | str | Path,
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    optimizer: str = "adamw",
    memory_fraction: float = 0.9,
) -> Plan:
    """``plan`` checked against ``model`` and ``cluster`` and priced on ``cluster``: its
    collectives, gradient buckets, predicted time and memory derived again (`derive`).

    The model is traced again (on meta/fake tensors) for the shapes and FLOPs the costs need;
    it must be the model the plan was made for. The cluster must have the plan's device count.
    """
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    if not isinstance(plan, Plan):
        plan = Plan.from_json(str(plan))
    precision = plan.mixed_precision  # the step traced as the plan computes it
    graph_for = capture_microbatches(model, example_inputs, loss_fn, example_target, precision)
    return derive(plan, graph_for, cluster, optimizer=optimizer, memory_fraction=memory_fraction)


def derive(
    plan: Plan | str | Path,
    graph_for: GraphForMicrobatches,
    cluster: Cluster,
    *,
    optimizer: str = "adamw",
    memory_fraction: float = 0.9,
) -> Plan:
    """``plan`` (a `Plan`, or a JSON path) checked against the traced step and ``cluster``
    (`autoplan.planfile.check.check_plan`), with everything derivable from its placements
    derived again on ``cluster``: the collectives and gradient buckets, what each pipeline
    stage receives and sends, the predicted time and memory. What the file says of these is
    never used (a hand edit need not update them); where it differs, a warning says so.
    ``graph_for(count)``: the step traced at ``count`` microbatches."""
    if not isinstance(plan, Plan):
        plan = Plan.from_json(str(plan))
    graph, checked, recompute = _checked(plan, graph_for, cluster)
    limit = cluster.device.tensor_bytes(memory_fraction)
    if checked.pipeline is not None:
        derived = _derive_pipeline(checked, graph, cluster, optimizer, limit, recompute)
    else:
        pricer = Pricer(cluster, checked.mesh.shape, optimizer, recompute)
        step = price_step(graph, assignment_of(checked, graph), pricer)
        derived = dataclasses.replace(
            checked,
            provenance=provenance(graph, cluster),
            collectives=collective_plans(step, checked.mesh.axes),
            predicted=predicted(step, limit, cluster.device.allocator_margin),
        )
    if derived.collectives != plan.collectives:
        log.warning(
            "the plan's collectives were derived from its placements: %d listed in the file, "
            "%d derived (the file's are not used; autoplan estimate ... -o writes them)",
            len(plan.collectives),
            len(derived.collectives),
        )
    return derived


def _checked(
    plan: Plan, graph_for: GraphForMicrobatches, cluster: Cluster
) -> tuple[Graph, Plan, Recompute]:
    """The step traced at ``plan``'s microbatch count, ``plan`` checked against it and
    ``cluster`` (`check_plan`), and the recomputation it lists."""
    count = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    try:
        graph = graph_for(count)
    except BatchSplitError as e:
        raise PlanFormatError(
            f"pipeline.num_microbatches is {count}, but {e}; edit the plan's "
            "pipeline.num_microbatches, or plan again"
        ) from None
    checked = check_plan(plan, graph, cluster)
    recompute = Recompute.mixed(graph, ((r.layer, r.mode, r.nodes) for r in checked.recompute))
    return graph, checked, recompute


def _stages(plan: Plan, graph: Graph) -> tuple[tuple[Layer, ...], list[StageGraph]]:
    """A pipelined plan's stages as layers of ``graph``, and each stage's own graph."""
    layers = tuple(Layer(f"stage {s}", stage.nodes) for s, stage in enumerate(plan.stages))
    return layers, [stage_graph(graph, layers, s, s + 1) for s in range(len(layers))]


def _derive_pipeline(
    plan: Plan, graph: Graph, cluster: Cluster, optimizer: str, limit: float, recompute: Recompute
) -> Plan:
    assert plan.pipeline is not None
    layers, stage_graphs = _stages(plan, graph)
    axes = plan.stage_axes
    boundary = _spec(plan.stages[0].boundary, axes) if plan.stages[0].boundary else ()
    pipe = price_pipeline(
        graph,
        layers,
        cluster,
        stage_graphs=stage_graphs,
        mesh_shape=tuple(plan.mesh.shape[1:]),
        boundary=boundary,
        assignments=[_stage_assignment(plan, s, st) for s, st in enumerate(stage_graphs)],
        num_microbatches=plan.pipeline.num_microbatches,
        schedule=plan.pipeline.schedule,
        optimizer=optimizer,
        memory_limit=limit,
        virtual_stages=plan.virtual_stages,
        recompute=recompute,
    )
    priced = assemble_pipeline_plan(pipe, cluster, plan.solver.meshes_tried, axes=axes)
    stages = tuple(
        dataclasses.replace(old, received=new.received, sent=new.sent, predicted=new.predicted)
        for old, new in zip(plan.stages, priced.stages, strict=True)
    )
    return dataclasses.replace(
        plan,
        provenance=priced.provenance,
        stages=stages,
        collectives=priced.collectives,
        predicted=priced.predicted,
        pipeline=priced.pipeline,
    )


def price_stages_ops(
    plan: Plan, graph_for: GraphForMicrobatches, cluster: Cluster, *, optimizer: str = "adamw"
) -> tuple[PricedStep, ...]:
    """``plan``'s price op by op (`PricedStep.ops`), one `PricedStep` per stage (a plan
    without pipelining has one): what its predicted compute, communication and memory are
    the sums of (`autoplan.planfile.breakdown`). A pipeline stage's is one microbatch's."""
    graph, checked, recompute = _checked(plan, graph_for, cluster)
    if checked.pipeline is None:
        pricer = Pricer(cluster, checked.mesh.shape, optimizer, recompute)
        return (price_step(graph, assignment_of(checked, graph), pricer),)
    _, stage_graphs = _stages(checked, graph)
    mesh_shape = tuple(checked.mesh.shape[1:])
    pricer = Pricer(cluster.stage(math.prod(mesh_shape)), mesh_shape, optimizer, recompute)
    return tuple(
        price_step(st.graph, _stage_assignment(checked, s, st), pricer)
        for s, st in enumerate(stage_graphs)
    )
