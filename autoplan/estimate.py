"""Re-price a plan: the same decisions, their collectives and predicted cost recomputed for a
cluster (another cluster, or the same after the plan was edited by hand)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.cluster import Cluster
from autoplan.errors import PlanFormatError
from autoplan.graph.capture import capture
from autoplan.graph.ir import Graph
from autoplan.intra_op import step_cost
from autoplan.plan.assemble import collective_plans, predicted, provenance
from autoplan.plan.schema import Placements, Plan
from autoplan.strategies.costs import StepCosts
from autoplan.strategies.space import Strategy


def _spec(placements: Placements, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(placements[a] for a in axes)


def assignment_of(plan: Plan, graph: Graph) -> dict[str, Strategy]:
    """Each node's strategy as the plan writes it."""
    axes = plan.mesh.axes
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
        )
        for n in graph
    }


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
    graph = capture(model, example_inputs, loss_fn, example_target)
    if plan.provenance.graph_fingerprint != graph.fingerprint:
        raise PlanFormatError(
            f"plan field provenance.graph_fingerprint is {plan.provenance.graph_fingerprint} "
            f"but this model has {graph.fingerprint}: estimate the model the plan was made for"
        )
    cluster.check_mesh_shape(plan.mesh.shape)
    step = step_cost(
        graph, assignment_of(plan, graph), StepCosts(cluster, plan.mesh.shape, optimizer)
    )
    limit = cluster.device.memory_bytes * memory_fraction
    return dataclasses.replace(
        plan,
        provenance=provenance(graph, cluster),
        collectives=collective_plans(step, plan.mesh.axes),
        predicted=predicted(step, limit),
    )
