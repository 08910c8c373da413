"""Turn a solved intra-op result into a `Plan` document."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import autoplan
from autoplan.cluster import Cluster
from autoplan.graph.ir import OP, PARAM, Graph
from autoplan.intra_op import IntraOpResult, StepCost
from autoplan.plan.schema import (
    CollectivePlan,
    Mesh,
    NodePlan,
    ParamPlan,
    Placements,
    Plan,
    Predicted,
    Provenance,
    SolverInfo,
    Stage,
)
from autoplan.strategies.placement import Spec, shard_dim


def axis_names(graph: Graph, result: IntraOpResult) -> tuple[str, ...]:
    """Name each mesh axis by its role: "dp" if the most expensive op splits its batch (dim 0)
    on that axis, else "tp"; repeated names get their axis index ("dp0", "dp1")."""
    heaviest = max((n for n in graph if n.kind == OP), key=lambda n: n.flops, default=None)
    spec = result.assignment[heaviest.name].output if heaviest else ()
    names = [
        "dp" if spec and shard_dim(spec[axis]) == 0 else "tp"
        for axis in range(len(result.mesh_shape))
    ]
    if len(set(names)) < len(names):
        names = [f"{n}{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return tuple(names)


def _named(spec: Spec, axes: tuple[str, ...]) -> Placements:
    return dict(zip(axes, spec, strict=True))


def provenance(graph: Graph, cluster: Cluster) -> Provenance:
    return Provenance(
        autoplan=autoplan.__version__,
        torch=torch.__version__.split("+")[0],
        graph_fingerprint=graph.fingerprint,
        cluster_fingerprint=cluster.fingerprint(),
        cluster=cluster.name,
    )


def collective_plans(step: StepCost, axes: tuple[str, ...]) -> tuple[CollectivePlan, ...]:
    return tuple(
        CollectivePlan(
            kind=p.collective.kind,
            bytes=p.collective.nbytes,
            axis=axes[p.collective.axis],
            phase=p.phase,
            node=consumer,
            tensor=producer,
        )
        for consumer, producer, p in step.collectives
    )


def predicted(step: StepCost, memory_limit: float) -> Predicted:
    return Predicted(
        step_time_s=step.compute_s + step.comm_s,
        compute_s=step.compute_s,
        comm_s=step.comm_s,
        peak_memory_bytes=step.memory_bytes,
        memory_limit_bytes=memory_limit,
    )


def make_plan(
    graph: Graph,
    cluster: Cluster,
    result: IntraOpResult,
    step: StepCost,
    rules: Mapping[str, str],
    meshes_tried: tuple[tuple[int, ...], ...],
) -> Plan:
    axes = axis_names(graph, result)
    mesh = Mesh(axes=axes, shape=result.mesh_shape, ranks=tuple(range(cluster.num_devices)))
    assignment = result.assignment

    params: dict[str, ParamPlan] = {}
    for node in graph:
        if node.kind != PARAM:
            continue
        storage = assignment[node.name].output
        users = graph.users(node.name)
        use = storage
        if users:
            consumer = graph.node(users[0])
            index = [r.name for r in consumer.refs].index(node.name)
            use = assignment[consumer.name].inputs[index]
        params[node.target] = ParamPlan(
            placements=_named(use, axes),
            storage=_named(storage, axes),
            shape=node.output.shape,
            dtype=node.output.dtype,
        )

    nodes = {
        node.name: NodePlan(
            op=node.op,
            module=node.module_path if node.kind != PARAM else node.target,
            output=_named(assignment[node.name].output, axes) if node.outputs else {},
            inputs=tuple(_named(s, axes) for s in assignment[node.name].inputs),
            rule=rules[node.name],
        )
        for node in graph
    }
    collectives = collective_plans(step, axes)
    solution = result.solution
    return Plan(
        provenance=provenance(graph, cluster),
        mesh=mesh,
        stages=(Stage(ranks=mesh.ranks, nodes=tuple(n.name for n in graph)),),
        params=params,
        nodes=nodes,
        collectives=collectives,
        predicted=predicted(step, result.problem.memory_limit),
        solver=SolverInfo(
            status=solution.status,
            objective=solution.objective,
            solve_time_s=solution.solve_time_s,
            num_variables=solution.num_variables,
            num_constraints=solution.num_constraints,
            num_groups=result.problem.num_groups,
            meshes_tried=meshes_tried,
        ),
    )
