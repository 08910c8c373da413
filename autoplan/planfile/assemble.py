"""Turn a solved intra-op result into a `Plan` document."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import PipelinePlan, SolverStats, own_decisions
from autoplan.costmodel.step_price import PricedStep
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import FUSED_ATTENTION, NO_RECOMPUTE, Recompute
from autoplan.modes import NodeKind
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import (
    CollectivePlan,
    Mesh,
    NodePlan,
    ParamPlan,
    Pipeline,
    Placements,
    Predicted,
    Provenance,
    RecomputedLayer,
    SolverInfo,
    Stage,
    StagePredicted,
)
from autoplan.search.intra_op import IntraOpResult
from autoplan.strategies.attention import context_axes
from autoplan.strategies.placement import Spec, shard_dim
from autoplan.strategies.space import Strategy
from autoplan.version import __version__, torch_release


def axis_names(
    graph: Graph, assignment: Mapping[str, Strategy], mesh_shape: tuple[int, ...]
) -> tuple[str, ...]:
    """Name each mesh axis by its role: "cp" if an attention splits its queries along the
    sequence on it (context parallelism), else "dp" if the most expensive op splits its batch
    (dim 0) on that axis, else "tp"; repeated names get their axis index ("dp0", "dp1")."""
    ops = [n for n in graph if n.kind == NodeKind.OP and n.name in assignment]
    heaviest = max(ops, key=lambda n: n.flops, default=None)
    spec = assignment[heaviest.name].output if heaviest else ()
    context = {
        axis
        for n in ops
        if n.op.startswith(FUSED_ATTENTION)
        for axis in context_axes(assignment[n.name].inputs, len(n.outputs[0].shape))
    }
    names = [
        "cp" if axis in context else "dp" if spec and shard_dim(spec[axis]) == 0 else "tp"
        for axis in range(len(mesh_shape))
    ]
    if len(set(names)) < len(names):
        names = [f"{n}{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return tuple(names)


def _named(spec: Spec, axes: tuple[str, ...]) -> Placements:
    return dict(zip(axes, spec, strict=True))


def provenance(graph: Graph, cluster: Cluster) -> Provenance:
    return Provenance(
        autoplan=__version__,
        torch=torch_release(),
        graph_fingerprint=graph.fingerprint,
        cluster_fingerprint=cluster.fingerprint(),
        cluster=cluster.name,
    )


def collective_plans(step: PricedStep, axes: tuple[str, ...]) -> tuple[CollectivePlan, ...]:
    return tuple(
        CollectivePlan(
            kind=p.collective.kind,
            bytes=p.collective.nbytes,
            axes=tuple(axes[a] for a in p.collective.axes),
            phase=p.phase,
            node=consumer,
            tensor=producer,
            params=p.params,
        )
        for consumer, producer, p in step.collectives
    )


def predicted(step: PricedStep, memory_limit: float, allocator_margin: float) -> Predicted:
    return Predicted(
        step_time_s=step.time_s,
        compute_s=step.compute_s,
        comm_s=step.comm_s,
        peak_memory_bytes=step.peak_bytes,
        memory_limit_bytes=memory_limit,
        allocator_margin=allocator_margin,
    )


def recomputed_layers(recompute: Recompute) -> tuple[RecomputedLayer, ...]:
    return tuple(
        RecomputedLayer(name, mode, ops, tuple(n for n in ops if n in recompute.saved))
        for name, mode, ops in recompute.layers
    )


def solver_info(result: IntraOpResult, meshes_tried: tuple[tuple[int, ...], ...]) -> SolverInfo:
    """The solver section of a one-stage plan the ILP found."""
    solution = result.solution
    return SolverInfo(
        status=solution.status,
        objective=solution.objective,
        solve_time_s=solution.solve_time_s,
        num_variables=solution.num_variables,
        num_constraints=solution.num_constraints,
        num_groups=result.problem.num_groups,
        meshes_tried=meshes_tried,
    )


def assemble_plan(
    graph: Graph,
    cluster: Cluster,
    mesh_shape: tuple[int, ...],
    assignment: Mapping[str, Strategy],
    step: PricedStep,
    rules: Mapping[str, str],
    solver: SolverInfo,
    memory_limit: float,
    recompute: Recompute = NO_RECOMPUTE,
) -> Plan:
    """The one-stage plan of ``assignment`` on ``mesh_shape``, priced as ``step``; ``rules``
    says where each node's strategy came from."""
    axes = axis_names(graph, assignment, mesh_shape)
    mesh = Mesh(axes=axes, shape=mesh_shape, ranks=tuple(range(cluster.num_devices)))
    params = _params(graph, assignment, axes)
    nodes = _nodes(graph, assignment, rules, axes)
    collectives = collective_plans(step, axes)
    return Plan(
        provenance=provenance(graph, cluster),
        mesh=mesh,
        stages=(Stage(ranks=mesh.ranks, nodes=tuple(n.name for n in graph)),),
        params=params,
        nodes=nodes,
        collectives=collectives,
        predicted=predicted(step, memory_limit, cluster.device.allocator_margin),
        solver=solver,
        mixed_precision=graph.precision,
        recompute=recomputed_layers(recompute),
    )


def _params(
    graph: Graph, assignment: Mapping[str, Strategy], axes: tuple[str, ...]
) -> dict[str, ParamPlan]:
    params: dict[str, ParamPlan] = {}
    for node in graph:
        if node.kind != NodeKind.PARAM:
            continue
        storage = assignment[node.name].output
        users = graph.users(node.name)
        use = storage
        if users:
            consumer = graph.node(users[0])
            index = [r.name for r in consumer.refs].index(node.name)
            use = assignment[consumer.name].inputs[index]
        chosen = assignment[node.name]  # ZeRO-1/2: its state split, its gradient maybe
        params[node.target] = ParamPlan(
            placements=_named(use, axes),
            storage=_named(storage, axes),
            shape=node.output.shape,
            dtype=node.output.dtype,
            grad=_named(chosen.grad, axes) if chosen.grad else {},
            state=_named(chosen.state, axes) if chosen.state else {},
        )
    return params


def _nodes(
    graph: Graph,
    assignment: Mapping[str, Strategy],
    rules: Mapping[str, str],
    axes: tuple[str, ...],
) -> dict[str, NodePlan]:
    return {
        node.name: NodePlan(
            op=node.op,
            module=node.module_path if node.kind != NodeKind.PARAM else node.target,
            output=_named(assignment[node.name].output, axes) if node.outputs else {},
            inputs=tuple(_named(s, axes) for s in assignment[node.name].inputs),
            rule=rules[node.name],
            # a parameter's gradient placement (ZeRO-2) is its params entry's
            grad=_named(grad, axes)
            if (grad := assignment[node.name].grad) and node.kind != NodeKind.PARAM
            else {},
        )
        for node in graph
    }


def assemble_pipeline_plan(
    pipe: PipelinePlan,
    cluster: Cluster,
    meshes_tried: tuple[tuple[int, ...], ...],
    axes: tuple[str, ...] | None = None,
) -> Plan:
    """A plan whose mesh is ("pp", *stage axes): stage ``s`` runs on row ``s`` (interleaved:
    row ``s mod p`` of ``p``; ZBV: in a V, `autoplan.schedules.stage_group`). The stage axes
    are named by role unless ``axes`` gives their names."""
    graph = pipe.graph
    assignment, rules = own_decisions(pipe.stages)
    final = next(n.name for n in graph if n.kind == NodeKind.OUTPUT)
    last = pipe.stages[-1]
    out = last.assignment[final]
    # the original output reads only the loss: drop the placements of tensors sent on
    assignment[final] = Strategy(out.output, out.inputs[len(last.stage.sent) :])
    axes = axes or axis_names(graph, assignment, pipe.mesh_shape)
    num_stages, groups = len(pipe.stages), pipe.num_groups
    size = math.prod(pipe.mesh_shape)
    mesh = Mesh(
        axes=("pp", *axes),
        shape=(groups, *pipe.mesh_shape),
        ranks=tuple(range(cluster.num_devices)),
    )
    stages = tuple(
        Stage(
            ranks=tuple(range(pipe.group(s) * size, (pipe.group(s) + 1) * size)),
            nodes=st.stage.nodes,
            layers=tuple(layer.name for layer in pipe.layers[st.start : st.stop]),
            received=st.stage.received,
            sent=st.stage.sent,
            boundary=_named(pipe.boundary, axes),
            predicted=StagePredicted(
                time_s=st.time_s + st.send_s,
                forward_s=st.forward_s,
                backward_s=st.time_s - st.forward_s,
                memory_bytes=pipe.stage_memory(s),
            ),
        )
        for s, st in enumerate(pipe.stages)
    )
    collectives = tuple(
        replace(c, stage=s)
        for s, st in enumerate(pipe.stages)
        for c in collective_plans(st.step, axes)
    )
    compute = sum(st.step.compute_s for st in pipe.stages)
    solver = SolverStats.total(st.solver for st in pipe.stages)
    return Plan(
        provenance=provenance(graph, cluster),
        mesh=mesh,
        stages=stages,
        params=_params(graph, assignment, axes),
        nodes=_nodes(graph, assignment, rules, axes),
        collectives=collectives,
        predicted=Predicted(
            step_time_s=pipe.step_time_s,
            compute_s=compute,
            comm_s=sum(st.step.comm_s for st in pipe.stages),
            peak_memory_bytes=max(pipe.stage_memory(s) for s in range(num_stages)),
            memory_limit_bytes=pipe.memory_limit,
            allocator_margin=cluster.device.allocator_margin,
        ),
        solver=SolverInfo(
            status="optimal",
            objective=pipe.step_time_s,
            solve_time_s=solver.solve_time_s,
            num_variables=solver.num_variables,
            num_constraints=solver.num_constraints,
            num_groups=solver.num_groups,
            meshes_tried=meshes_tried,
        ),
        pipeline=Pipeline(pipe.schedule, pipe.num_microbatches, pipe.bubble_fraction),
        mixed_precision=graph.precision,
        recompute=recomputed_layers(pipe.recompute),
    )
