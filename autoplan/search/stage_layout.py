"""Where a pipeline stage runs and how it meets its neighbours: the devices of a stage, the
logical meshes over them, and the boundary placement (how the tensors passed between stages
are laid out on a stage's mesh).

Stages are uniform: every stage gets the same submesh and logical mesh, because
torch.distributed.pipelining pairs rank ``i`` of one stage with rank ``i`` of the next, and a
stage's tensors go from each rank to its peer as they are laid out (the boundary placement).
A stage's size is a power of two inside a node or whole nodes (`stage_sizes`), as Alpa's
submeshes are (`autoplan.solvers.stage_problem.submesh_choices`).
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.cluster.model import Cluster
from autoplan.graph.cut import StageGraph
from autoplan.solvers.stage_problem import Submesh
from autoplan.strategies.placement import R, Spec, fitted, on_mesh
from autoplan.strategies.space import NodeStrategies, Strategy


def stage_sizes(cluster: Cluster) -> list[int]:
    """Devices per stage for two or more uniform stages: powers of two inside a node, then
    whole nodes, dividing the cluster."""
    d, m = cluster.num_devices, cluster.devices_per_node
    sizes = [w for w in (2**i for i in range(m.bit_length())) if w <= m and m % w == 0]
    sizes += [n * m for n in range(2, cluster.num_nodes + 1)]
    return [s for s in sizes if d % s == 0 and d // s >= 2]


def stage_submesh(cluster: Cluster, size: int) -> Submesh:
    """The submesh of a stage of ``size`` devices, as the stage DP names it."""
    m = cluster.devices_per_node
    return Submesh(1, size) if size <= m else Submesh(size // m, m)


def stage_meshes(stage_cluster: Cluster) -> list[tuple[int, ...]]:
    """Alpa's logical views of a stage's submesh: flat, and nodes x devices when it spans
    nodes."""
    n = stage_cluster.num_devices
    meshes: list[tuple[int, ...]] = [(n,)]
    if stage_cluster.num_nodes > 1:
        meshes.append((stage_cluster.num_nodes, stage_cluster.devices_per_node))
    return meshes


def boundary_specs(mesh_shape: tuple[int, ...], spans_nodes: bool = False) -> list[Spec]:
    """How tensors between stages may be laid out on a stage's mesh: batch-split on the outer
    axes (data parallel across nodes first), or replicated (a tensor-parallel stage) unless
    the outer axis spans nodes, where slow links leave only data parallelism."""
    first = 1 if spans_nodes else 0
    specs = (
        on_mesh(tuple("S(0)" if a < split else R for a in range(len(mesh_shape))), mesh_shape)
        for split in range(first, len(mesh_shape) + 1)
    )
    return list(dict.fromkeys(specs))


def boundary_assignment(
    stage: StageGraph, boundary: Spec, loss_inputs: tuple[Spec, ...]
) -> dict[str, Strategy]:
    """The strategies of a stage graph's own nodes: what it receives arrives in the boundary
    placement, and its output reads what it sends in that placement, then the loss (the last
    stage) as ``loss_inputs``."""
    graph = stage.graph
    found = {
        name: Strategy(fitted(boundary, graph.node(name).output.shape), ())
        for name in stage.received
    }
    output = graph.nodes[-1]
    sent = tuple(fitted(boundary, graph.node(name).output.shape) for name in stage.sent)
    found[output.name] = Strategy((), sent + loss_inputs)
    return found


def pin_boundary(
    space: dict[str, NodeStrategies], stage: StageGraph, boundary: Spec
) -> dict[str, NodeStrategies]:
    """``space`` with the stage graph's own nodes held to their `boundary_assignment` (for
    its ILP), the loss read as its one candidate reads it."""
    output = stage.graph.nodes[-1]
    loss_inputs = space[output.name].strategies[0].inputs[len(stage.sent) :]
    pinned = boundary_assignment(stage, boundary, loss_inputs)
    out = dict(space)
    for name in stage.received:
        if name in out:  # else a copy of another received tensor (graph/blocks): pinned alike
            out[name] = replace(out[name], strategies=(pinned[name],), source="boundary")
    out[output.name] = replace(out[output.name], strategies=(pinned[output.name],))
    return out
