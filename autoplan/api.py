"""The public entry points. Orchestration only: each step lives in its own module."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.graph.capture import capture
from autoplan.graph.ir import PARAM, Graph
from autoplan.graph.layers import find_layers
from autoplan.intra_op import MeshPlan, solve_mesh
from autoplan.pins import Pin, apply_pins, keep_sharing_consistent, parse_pins
from autoplan.plan.assemble import make_plan
from autoplan.plan.schema import Plan
from autoplan.strategies.costs import OPTIMIZER_STATE, StepCosts

log = logging.getLogger(__name__)

GiB = 2**30


def candidate_meshes(cluster: Cluster) -> list[tuple[int, ...]]:
    """The logical meshes tried when none is pinned: the flat mesh, and 2-D meshes whose
    inner axis stays inside a node (Alpa's choice of logical views of a physical mesh)."""
    n = cluster.num_devices
    meshes: list[tuple[int, ...]] = [(n,)]
    for inner in range(2, min(cluster.devices_per_node, n // 2) + 1):
        if cluster.devices_per_node % inner == 0 and n % inner == 0:
            meshes.append((n // inner, inner))
    return meshes


def plan(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster | str | Path,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    mesh_shape: tuple[int, ...] | None = None,
    pin: Mapping[str, Pin] | None = None,
    optimizer: str = "adamw",
    memory_fraction: float = 0.9,
    time_limit_s: float = 60.0,
) -> Plan:
    """Trace ``model`` and choose a sharding for every operator on ``cluster``.

    ``mesh_shape`` pins the logical mesh (else a few are tried and the fastest kept);
    ``pin`` maps parameter names to placements (see `autoplan.pins`); ``optimizer`` sets the
    optimizer state kept per parameter; ``memory_fraction`` of each device's memory may be
    used by the plan.
    """
    start = time.perf_counter()
    log.info("tracing %s ...", type(model).__name__)
    graph = capture(model, example_inputs, loss_fn, example_target)
    log.info(
        "traced %d nodes, %.3g M parameters (%.1f s)",
        len(graph),
        graph.num_params / 1e6,
        time.perf_counter() - start,
    )
    return plan_graph(
        graph,
        cluster,
        mesh_shape=mesh_shape,
        pin=pin,
        optimizer=optimizer,
        memory_fraction=memory_fraction,
        time_limit_s=time_limit_s,
    )


def plan_graph(
    graph: Graph,
    cluster: Cluster | str | Path,
    *,
    mesh_shape: tuple[int, ...] | None = None,
    pin: Mapping[str, Pin] | None = None,
    optimizer: str = "adamw",
    memory_fraction: float = 0.9,
    time_limit_s: float = 60.0,
) -> Plan:
    """`plan` for a graph already traced (`autoplan.graph.capture`)."""
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    if optimizer not in OPTIMIZER_STATE:
        raise AutoplanError(
            f"optimizer {optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE)}"
        )
    if not 0 < memory_fraction <= 1:
        raise AutoplanError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    meshes = [tuple(mesh_shape)] if mesh_shape is not None else candidate_meshes(cluster)
    for m in meshes:
        cluster.check_mesh_shape(m)

    layers = find_layers(graph)
    log.info("%d repeated-layer nodes share decisions", len(layers.canonical))
    pins = parse_pins(pin or {}, graph)
    layers = keep_sharing_consistent(layers, pins)
    memory_limit = cluster.device.memory_bytes * memory_fraction

    best: MeshPlan | None = None
    needs: dict[tuple[int, ...], float] = {}
    for m in meshes:
        log.info("mesh %s: solving ...", m)
        found = solve_mesh(
            graph,
            layers,
            StepCosts(cluster, m, optimizer),
            memory_limit,
            time_limit_s,
            lambda space: apply_pins(space, graph, pins),
        )
        if not isinstance(found, MeshPlan):
            needs[m] = found
            log.info("mesh %s: needs at least %.2f GiB per device, skipped", m, found / GiB)
            continue
        solution = found.result.solution
        log.info(
            "mesh %s: predicted %.4g s per step (%s, %.2f s)",
            m,
            solution.objective,
            solution.status,
            solution.solve_time_s,
        )
        if best is None or solution.objective < best.result.solution.objective:
            best = found
    if best is None:
        raise _infeasible(graph, cluster, needs, memory_limit, memory_fraction)
    return make_plan(graph, cluster, best.result, best.step, best.rules, tuple(meshes))


def _infeasible(
    graph: Graph,
    cluster: Cluster,
    needs: Mapping[tuple[int, ...], float],
    limit: float,
    fraction: float,
) -> InfeasiblePlanError:
    mesh, need = min(needs.items(), key=lambda kv: kv[1])
    param_bytes = sum(n.output.nbytes for n in graph if n.kind == PARAM)
    return InfeasiblePlanError(
        f"the model does not fit: even sharded as far as mesh {mesh} allows, each device needs "
        f"{need / GiB:.2f} GiB (parameters alone are {param_bytes / GiB:.2f} GiB unsharded, "
        f"plus gradients, optimizer state and activations), but a device of cluster "
        f"{cluster.name!r} offers {limit / GiB:.2f} GiB ({fraction:.0%} of "
        f"{cluster.device.memory_bytes / GiB:.0f} GiB). Use more devices (--nodes), a smaller "
        "batch, lower-precision parameters, or a lighter optimizer."
    )
