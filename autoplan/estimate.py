"""Re-price a plan: the same decisions, their collectives and predicted cost recomputed for a
cluster (another cluster, or the same after the plan was edited by hand)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.cluster.model import Cluster
from autoplan.errors import PlanFormatError
from autoplan.graph.capture import capture, microbatch
from autoplan.graph.cut import Layer, StageGraph, stage_graph
from autoplan.graph.ir import Graph
from autoplan.planfile.assemble import (
    collective_plans,
    make_pipeline_plan,
    predicted,
    provenance,
)
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import Placements
from autoplan.search.pipeline_price import price_pipeline
from autoplan.search.stage_layout import boundary_assignment
from autoplan.search.step_price import price_step
from autoplan.strategies.pricing import Pricer
from autoplan.strategies.space import Strategy
from autoplan.version import torch_release


def _spec(placements: Placements, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(placements[a] for a in axes)


def assignment_of(plan: Plan, graph: Graph) -> dict[str, Strategy]:
    """Each node's strategy as the plan writes it."""
    axes = plan.stage_axes
    missing = [n.name for n in graph if n.name not in plan.nodes]
    if missing:
        raise PlanFormatError(
            f"plan field nodes has no entry for {', '.join(missing[:5])}: it was made for "
            "another model"
        )
    return {
        n.name: Strategy(
            output=_spec(plan.nodes[n.name].output, axes) if n.outputs else (),
            inputs=tuple(_spec(p, axes) for p in plan.nodes[n.name].inputs),
            grad=_spec(plan.nodes[n.name].grad, axes) if plan.nodes[n.name].grad else None,
        )
        for n in graph
    }


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
    """``plan`` with its collectives, predicted time and memory recomputed on ``cluster``.

    The model is traced again (on meta/fake tensors) for the shapes and FLOPs the costs need;
    it must be the model the plan was made for. The cluster must have the plan's device count.
    """
    if not isinstance(plan, Plan):
        plan = Plan.from_json(str(plan))
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    count = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
    graph = capture(model, inputs, loss_fn, target)
    refusal = plan.provenance.graph_refusal(graph.fingerprint, torch_release())
    if refusal is not None:
        raise PlanFormatError(refusal)
    cluster.check_mesh_shape(plan.mesh.shape)
    limit = cluster.device.memory_bytes * memory_fraction
    if plan.pipeline is not None:
        return _estimate_pipeline(plan, graph, cluster, optimizer, limit)
    step = price_step(
        graph, assignment_of(plan, graph), Pricer(cluster, plan.mesh.shape, optimizer)
    )
    return dataclasses.replace(
        plan,
        provenance=provenance(graph, cluster),
        collectives=collective_plans(step, plan.mesh.axes),
        predicted=predicted(step, limit),
    )


def _estimate_pipeline(
    plan: Plan, graph: Graph, cluster: Cluster, optimizer: str, limit: float
) -> Plan:
    assert plan.pipeline is not None
    layers = tuple(Layer(f"stage {s}", stage.nodes) for s, stage in enumerate(plan.stages))
    axes = plan.stage_axes
    boundary = _spec(plan.stages[0].boundary, axes) if plan.stages[0].boundary else ()
    pipe = price_pipeline(
        graph,
        layers,
        cluster,
        mesh_shape=tuple(plan.mesh.shape[1:]),
        boundary=boundary,
        assignments=[
            _stage_assignment(plan, s, stage_graph(graph, layers, s, s + 1))
            for s in range(len(layers))
        ],
        num_microbatches=plan.pipeline.num_microbatches,
        schedule=plan.pipeline.schedule,
        optimizer=optimizer,
        memory_limit=limit,
    )
    priced = make_pipeline_plan(pipe, cluster, plan.solver.meshes_tried, axes=axes)
    stages = tuple(
        dataclasses.replace(old, predicted=new.predicted)
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
