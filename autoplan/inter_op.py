"""Inter-operator planning: pipeline stages on submeshes, by Alpa's stage DP over intra-op plans.

For each microbatch count ``B`` tried (`plan_pipeline`), the step is traced at the shape of one
microbatch and cut into layers (`autoplan.graph.cut`). For each stage size (a submesh of
``|m|`` devices: part of a node or whole nodes), each logical mesh of it and each boundary
placement (how the tensors passed between stages are laid out on a stage's mesh: replicated, or
split along the batch), `solve_stages` (`autoplan.solve.dp`) chooses the layer ranges; a range
costs the sum of its layers' intra-op ILP plans (`_StageSolver`), each layer solved once per
structure. The stages found are then priced under each schedule allowed (1F1B, GPipe) and the
fastest that fits kept.

Stages are uniform: every stage gets the same submesh and logical mesh, because
torch.distributed.pipelining pairs rank ``i`` of one stage with rank ``i`` of the next, and
a stage's tensors go from each rank to its peer as they are laid out (the boundary
placement). The DP itself allows mixed submeshes; the cost function rules the others out.

Times. A stage's time per microbatch covers its forward and backward, the collectives inside
them, and the send of its boundary tensors (and their gradients) to the next stage. The
gradient synchronization and optimizer update run once per step: the DP amortizes them as
``extra / B`` per microbatch; the predicted step time adds them once, after the last
microbatch: ``sum(t) + (B - 1) * max(t) + max(extra)``. Memory: a stage's parameters,
gradients and optimizer state once, plus the activations of each microbatch in flight
(1F1B: ``S - s`` for stage ``s``; GPipe: all ``B``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from autoplan.cluster.model import Cluster
from autoplan.cluster.timing import collective_time, sync_overhead
from autoplan.errors import AutoplanError
from autoplan.graph.blocks import find_sharing, signature
from autoplan.graph.cut import Layer, StageGraph, cut_layers, shared_params, stage_graph
from autoplan.graph.ir import INPUT, OUTPUT, PARAM, Graph, itemsize
from autoplan.schedules import schedule_refusal, simulate
from autoplan.search.intra_op import MeshPlan, solve_mesh
from autoplan.search.step_price import PricedStep, price_step
from autoplan.solve.dp import (
    InfeasibleStagesError,
    StageCost,
    StageProblem,
    Submesh,
    pipeline_time,
    solve_stages,
)
from autoplan.strategies.placement import R, Spec, is_valid, local_numel, on_mesh
from autoplan.strategies.pricing import Pricer
from autoplan.strategies.space import NodeStrategies, Strategy

log = logging.getLogger(__name__)

GraphForMicrobatches = Callable[[int], Graph]


@dataclass(frozen=True)
class SolvedStage:
    start: int  # layers [start, stop)
    stop: int
    stage: StageGraph
    assignment: dict[str, Strategy]  # by node name of ``stage.graph``
    step: PricedStep
    rules: dict[str, str]
    time_s: float  # one microbatch, forward + backward, without the send
    forward_s: float
    send_s: float  # the boundary tensors to the next stage and their gradients back
    extra_s: float  # gradient synchronization and optimizer update, once per step
    memory_bytes: float  # parameters, gradients, optimizer state
    activation_bytes: float  # one microbatch in flight
    solver: _SolverStats


@dataclass(frozen=True)
class PipelinePlan:
    graph: Graph  # the step at the microbatch's shape
    layers: tuple[Layer, ...]
    num_microbatches: int
    schedule: str
    mesh_shape: tuple[int, ...]  # each stage's logical mesh
    costs: Pricer
    boundary: Spec
    stages: tuple[SolvedStage, ...]
    step_time_s: float
    bubble_fraction: float
    memory_limit: float

    def stage_memory(self, s: int) -> float:
        """Peak bytes per device of stage ``s`` under the schedule."""
        in_flight = self.num_microbatches if self.schedule == "GPipe" else len(self.stages) - s
        stage = self.stages[s]
        return stage.memory_bytes + min(in_flight, self.num_microbatches) * stage.activation_bytes


def stage_sizes(cluster: Cluster) -> list[int]:
    """Devices per stage for two or more uniform stages: powers of two inside a node, then
    whole nodes, dividing the cluster."""
    d, m = cluster.num_devices, cluster.devices_per_node
    sizes = [w for w in (2**i for i in range(m.bit_length())) if w <= m and m % w == 0]
    sizes += [n * m for n in range(2, cluster.num_nodes + 1)]
    return [s for s in sizes if d % s == 0 and d // s >= 2]


def _submesh(cluster: Cluster, size: int) -> Submesh:
    m = cluster.devices_per_node
    return Submesh(1, size) if size <= m else Submesh(size // m, m)


def _stage_cluster(cluster: Cluster, size: int) -> Cluster:
    """The cluster one stage sees: its submesh, starting on a node boundary."""
    m = cluster.devices_per_node
    if size <= m:
        return replace(cluster, num_nodes=1, devices_per_node=size, name=f"{cluster.name}[:{size}]")
    return cluster.with_nodes(size // m)


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


@dataclass(frozen=True)
class _RangeCost:
    """A layer range priced as the sum of its layers (what the DP's cost table holds)."""

    time_s: float
    extra_s: float
    memory_bytes: float
    activation_bytes: float
    level: int  # each layer was planned within memory_limit / level


class _StageSolver:
    """Plans layers on one stage size, logical mesh and boundary placement.

    A layer range is priced by composition: each layer is planned as a stage graph of its own
    (the ILP, memoized by structure, so identical blocks are solved once) with the tensors
    between layers at the boundary placement, and a range costs the sum of its layers. The
    union of the layers' plans is a valid plan of the range (the placements agree where
    layers meet), so a range never costs less than its ILP would find; in exchange the DP's
    table costs one ILP per distinct layer instead of one per range. When the fastest layer
    plans do not fit together, each layer is planned again within ``memory_limit / level``
    for ``level`` = 2, 4, ... until the range fits.
    """

    def __init__(
        self,
        graph: Graph,
        layers: tuple[Layer, ...],
        cluster: Cluster,
        costs: Pricer,
        boundary: Spec,
        memory_limit: float,
        time_limit_s: float,
    ) -> None:
        self.graph = graph
        self.cluster = cluster
        self.layers = layers
        self.costs = costs
        self.boundary = boundary
        self.memory_limit = memory_limit
        self.time_limit_s = time_limit_s
        self._memo: dict[Hashable, SolvedStage | None] = {}
        self._stages = [stage_graph(graph, layers, i, i + 1) for i in range(len(layers))]
        self._keys = [
            signature(st.graph, tuple(n.name for n in st.graph), None) for st in self._stages
        ]

    def send_s(self, stop: int) -> float:
        """Sending what crosses the boundary after layer ``stop - 1`` (and gradients back)."""
        stage = self._stages[stop - 1]
        return _send_time(self.cluster, _sent_bytes(stage, self.costs.mesh_shape, self.boundary))

    def cost(self, start: int, stop: int) -> _RangeCost | None:
        level = 1
        while level <= 2 * (stop - start):
            parts = [self._layer(i, level) for i in range(start, stop)]
            if any(p is None for p in parts):
                return None  # a tighter budget cannot help
            done = [p for p in parts if p is not None]
            found = _RangeCost(
                time_s=sum(p.time_s for p in done),
                extra_s=sum(p.extra_s for p in done),
                memory_bytes=sum(p.memory_bytes for p in done),
                activation_bytes=sum(p.activation_bytes for p in done),
                level=level,
            )
            if found.memory_bytes + found.activation_bytes <= self.memory_limit:
                return found
            level *= 2
        return None

    def stage(self, start: int, stop: int) -> SolvedStage:
        """The plan of layers ``[start, stop)``: the union of its layers' plans, priced whole."""
        found = self.cost(start, stop)
        assert found is not None, "the DP chose a range it was told does not fit"
        stage = stage_graph(self.graph, self.layers, start, stop)
        assignment: dict[str, Strategy] = {}
        rules: dict[str, str] = {}
        parts = [self._renamed(i, found.level) for i in range(start, stop)]
        for part in parts:
            own = set(part.stage.nodes)
            assignment.update({k: v for k, v in part.assignment.items() if k in own})
            rules.update({k: v for k, v in part.rules.items() if k in own})
        output = stage.graph.nodes[-1]
        replicated = tuple(R for _ in self.costs.mesh_shape)
        loss = tuple(replicated for _ in output.refs[len(stage.sent) :])
        assignment.update(boundary_assignment(stage, self.boundary, loss))
        rules.update(dict.fromkeys(stage.received, "boundary"))
        rules[output.name] = "output"
        step = price_step(stage.graph, assignment, self.costs)
        stats = [p.solver for p in parts]
        solver = _SolverStats(*(sum(column) for column in zip(*stats, strict=True)))
        return _priced(
            start, stop, stage, assignment, step, rules, self.costs, self.send_s(stop), solver
        )

    def _layer(self, i: int, level: int) -> SolvedStage | None:
        key = (self._keys[i], self.costs.mesh_shape, self.boundary, level)
        if key not in self._memo:
            self._memo[key] = self._solve(i, level)
        return self._memo[key]

    def _renamed(self, i: int, level: int) -> SolvedStage:
        """Layer ``i``'s plan, possibly solved on another layer of the same structure."""
        found = self._layer(i, level)
        assert found is not None
        stage = self._stages[i]
        if found.stage is stage:
            return found
        names = (n.name for n in stage.graph)
        rename = dict(zip((n.name for n in found.stage.graph), names, strict=True))
        return replace(
            found,
            start=i,
            stop=i + 1,
            stage=stage,
            assignment={rename[k]: v for k, v in found.assignment.items()},
            rules={rename[k]: v for k, v in found.rules.items()},
        )

    def _solve(self, i: int, level: int) -> SolvedStage | None:
        stage = self._stages[i]
        graph = stage.graph
        mesh, boundary = self.costs.mesh_shape, self.boundary
        if not all(is_valid(boundary, graph.node(n).output.shape, mesh) for n in stage.received):
            return None
        if not all(is_valid(boundary, graph.node(n).output.shape, mesh) for n in stage.sent):
            return None

        def restrict(space: dict[str, NodeStrategies]) -> dict[str, NodeStrategies]:
            return _pin_boundary(space, stage, boundary)

        found = solve_mesh(
            graph,
            find_sharing(graph),
            self.costs,
            self.memory_limit / level,
            self.time_limit_s,
            restrict,
        )
        log.debug(
            "layer %d on %s, boundary %s, 1/%d of memory: %s",
            i,
            mesh,
            boundary,
            level,
            "does not fit" if not isinstance(found, MeshPlan) else "planned",
        )
        if not isinstance(found, MeshPlan):
            return None
        solution = found.result.solution
        solver = _SolverStats(
            solution.solve_time_s,
            solution.num_variables,
            solution.num_constraints,
            found.result.problem.num_groups,
        )
        return _priced(
            i, i + 1, stage, found.result.assignment, found.step, found.rules, self.costs,
            self.send_s(i + 1), solver,
        )  # fmt: skip


def boundary_assignment(
    stage: StageGraph, boundary: Spec, loss_inputs: tuple[Spec, ...]
) -> dict[str, Strategy]:
    """The strategies of a stage graph's own nodes: what it receives arrives in the boundary
    placement, and its output reads what it sends in that placement, then the loss (the last
    stage) as ``loss_inputs``."""
    found = {name: Strategy(boundary, ()) for name in stage.received}
    output = stage.graph.nodes[-1]
    found[output.name] = Strategy((), tuple(boundary for _ in stage.sent) + loss_inputs)
    return found


def _pin_boundary(
    space: dict[str, NodeStrategies], stage: StageGraph, boundary: Spec
) -> dict[str, NodeStrategies]:
    out = dict(space)
    for name in stage.received:
        out[name] = replace(out[name], strategies=(Strategy(boundary, ()),), source="boundary")
    output = next(n for n in stage.graph if n.kind == OUTPUT)
    ns = out[output.name]
    inputs = tuple(
        boundary if r.name in stage.sent else spec
        for r, spec in zip(output.refs, ns.strategies[0].inputs, strict=True)
    )
    out[output.name] = replace(ns, strategies=(Strategy((), inputs),))
    return out


class _SolverStats(NamedTuple):
    solve_time_s: float
    num_variables: int
    num_constraints: int
    num_groups: int


def _priced(
    start: int,
    stop: int,
    stage: StageGraph,
    assignment: dict[str, Strategy],
    step: PricedStep,
    rules: dict[str, str],
    costs: Pricer,
    send_s: float,
    solver: _SolverStats,
) -> SolvedStage:
    graph = stage.graph
    extra = sum(costs.node_time(n, assignment[n.name]) for n in graph if n.kind == PARAM)
    extra += costs.gradients_s([p for _, _, p in step.collectives if p.phase == "grad_sync"])
    static = sum(
        costs.node_memory(n, assignment[n.name]) for n in graph if n.kind in (PARAM, INPUT)
    )
    flops = sum(n.flops for n in graph)
    total_flops = flops + sum(n.bwd_flops for n in graph)
    time = step.compute_s + step.comm_s - extra
    return SolvedStage(
        start=start,
        stop=stop,
        stage=stage,
        assignment=dict(assignment),
        step=step,
        rules=rules,
        time_s=time,
        forward_s=time * flops / total_flops if total_flops else time / 3,
        send_s=send_s,
        extra_s=extra,
        memory_bytes=static,
        activation_bytes=step.memory_bytes - static,
        solver=solver,
    )


def _sent_bytes(stage: StageGraph, mesh: tuple[int, ...], boundary: Spec) -> int:
    """Bytes each rank sends to its peer in the next stage."""
    infos = [stage.graph.node(n).output for n in stage.sent]
    return sum(local_numel(boundary, t.shape, mesh) * itemsize(t.dtype) for t in infos)


def _send_time(cluster: Cluster, nbytes: float) -> float:
    """Activations forward and their gradients back, between peers of consecutive stages;
    priced on the inter-node link whenever the pipeline spans nodes (some boundary does). The
    receiver waits for each right after computing, as for a blocking collective: each pays
    the measured `sync_overhead`."""
    link = cluster.inter_node if cluster.num_nodes > 1 else cluster.intra_node
    message = collective_time(cluster, "send_recv", nbytes, 2, link)
    return 2 * (message + sync_overhead(cluster)) if message else 0.0


def default_microbatches(batch: int, max_stages: int) -> int:
    """Where the search for a microbatch count starts, as Alpa takes one: the fewest that keep
    the 1F1B bubble of the deepest pipeline tried at or below a third of the step
    (``B >= 2 S``) and divide the batch, or one sample per microbatch."""
    return next((b for b in range(2 * max_stages, batch + 1) if batch % b == 0), batch)


def plan_pipeline(
    graph_for: GraphForMicrobatches,
    cluster: Cluster,
    *,
    batch: int,
    num_microbatches: int | None,
    schedules: Sequence[str],
    optimizer: str,
    memory_limit: float,
    time_limit_s: float,
    max_layers: int,
    meshes: Sequence[tuple[int, ...]] | None = None,
    num_stages: int | None = None,
) -> PipelinePlan | None:
    """The fastest pipeline of two or more uniform stages (``num_stages`` if given) under one
    of ``schedules``, or None if none fits.

    The microbatch count is ``num_microbatches`` if given, else `default_microbatches`; on
    one node the search then halves it while the best pipeline gets faster: fewer, larger
    microbatches pay the framework's work per microbatch fewer times and run larger kernels,
    against a longer bubble (where ranks share cores, a bubble leaves them to the others).
    The step is traced for each count tried, and every stage size solved again: across nodes
    that multiplied planning time (GPT-175B on 1024 simulated A100s: 30 s to 250 s), so there
    the one count serves, as in Alpa."""
    sizes = [
        size
        for size in stage_sizes(cluster)
        if num_stages is None or cluster.num_devices // size == num_stages
    ]
    if not sizes or batch < 2:
        return None
    deepest = cluster.num_devices // min(sizes)
    count = num_microbatches or default_microbatches(batch, min(deepest, max_layers))
    best: PipelinePlan | None = None
    while True:
        found = _best_for_count(
            graph_for(count), cluster, sizes, count, schedules, optimizer, memory_limit,
            time_limit_s, max_layers, meshes, num_stages,
        )  # fmt: skip
        if found is None or (best is not None and found.step_time_s >= best.step_time_s):
            return best or found
        best = found
        if num_microbatches or count % 2 or cluster.num_nodes > 1:
            return best
        count //= 2


def _best_for_count(
    graph: Graph,
    cluster: Cluster,
    sizes: Sequence[int],
    num_microbatches: int,
    schedules: Sequence[str],
    optimizer: str,
    memory_limit: float,
    time_limit_s: float,
    max_layers: int,
    meshes: Sequence[tuple[int, ...]] | None,
    num_stages: int | None,
) -> PipelinePlan | None:
    layers = cut_layers(graph, max_layers)
    shared = shared_params(graph, layers)
    if shared:
        name, readers = next(iter(shared.items()))
        log.info("no pipeline: parameter %s is read by layers %s (tied weights)", name, readers)
        return None
    if num_stages is not None and num_stages > len(layers):
        raise AutoplanError(
            f"num_stages={num_stages}, but the step has only {len(layers)} layer(s) to divide "
            f"({', '.join(layer.name for layer in layers)}); use at most {len(layers)} stages"
        )
    best: PipelinePlan | None = None
    for size in sizes:
        if cluster.num_devices // size > len(layers):
            continue
        found = _best_for_size(
            graph, layers, cluster, size, num_microbatches, schedules, optimizer, memory_limit,
            time_limit_s, meshes,
        )  # fmt: skip
        if found is not None and (best is None or found.step_time_s < best.step_time_s):
            best = found
    return best


def _best_for_size(
    graph: Graph,
    layers: tuple[Layer, ...],
    cluster: Cluster,
    size: int,
    num_microbatches: int,
    schedules: Sequence[str],
    optimizer: str,
    memory_limit: float,
    time_limit_s: float,
    meshes: Sequence[tuple[int, ...]] | None,
) -> PipelinePlan | None:
    stage_cluster = _stage_cluster(cluster, size)
    num_stages = cluster.num_devices // size
    runnable = [s for s in schedules if not schedule_refusal(s, num_stages, num_microbatches)]
    if not runnable:
        return None
    best: PipelinePlan | None = None
    for mesh in meshes or stage_meshes(stage_cluster):
        if math.prod(mesh) != size:
            continue
        costs = Pricer(stage_cluster, tuple(mesh), optimizer)
        for boundary in boundary_specs(tuple(mesh), spans_nodes=stage_cluster.num_nodes > 1):
            solver = _StageSolver(
                graph, layers, cluster, costs, boundary, memory_limit, time_limit_s
            )
            solved = _solve_dp(solver, _submesh(cluster, size), num_microbatches)
            if solved is None:
                continue
            for schedule in runnable:
                found = _pipeline(
                    cluster, graph, layers, num_microbatches, schedule, costs, boundary, solved,
                    memory_limit,
                )  # fmt: skip
                log.info(
                    "pipeline %d x %s, %d microbatches, %s, boundary %s: %.4g s per step",
                    len(solved),
                    mesh,
                    num_microbatches,
                    schedule,
                    boundary,
                    found.step_time_s,
                )
                if any(found.stage_memory(s) > memory_limit for s in range(len(solved))):
                    continue
                if best is None or found.step_time_s < best.step_time_s:
                    best = found
    return best


def _solve_dp(
    solver: _StageSolver, sub: Submesh, num_microbatches: int
) -> tuple[SolvedStage, ...] | None:
    """Alpa's stage DP with every stage on ``sub`` (see the module docstring)."""
    cluster = solver.cluster
    num_stages = cluster.num_devices // sub.num_devices
    longest = len(solver.layers) - num_stages + 1  # every other stage needs a layer

    def cost(i: int, j: int, submesh: Submesh) -> StageCost:
        usable = submesh == sub and j - i <= longest
        found = solver.cost(i, j) if usable else None
        if found is None:
            return StageCost(math.inf, math.inf, feasible=False)
        return StageCost(
            time_s=found.time_s + found.extra_s / num_microbatches,
            memory_bytes=found.memory_bytes,
            activation_bytes=found.activation_bytes,
        )

    problem = StageProblem(
        num_layers=len(solver.layers),
        num_nodes=cluster.num_nodes,
        devices_per_node=cluster.devices_per_node,
        num_microbatches=num_microbatches,
        memory_limit=solver.memory_limit,
        cost=cost,
        send_time=lambda j, a, b: solver.send_s(j),
    )
    try:
        solution = solve_stages(problem)
    except InfeasibleStagesError:
        return None
    return tuple(solver.stage(p.start, p.stop) for p in solution.stages)


def _pipeline(
    cluster: Cluster,
    graph: Graph,
    layers: tuple[Layer, ...],
    num_microbatches: int,
    schedule: str,
    costs: Pricer,
    boundary: Spec,
    stages: tuple[SolvedStage, ...],
    memory_limit: float,
) -> PipelinePlan:
    """``stages`` as a pipeline, priced by the formula the stage DP minimizes,
    ``sum(t) + (B - 1) max(t)``; or, where ranks share fewer cores than they are (CPU ranks on
    one node, `Cluster.shares_cores`), by simulating the schedule with the stages sharing
    them (`autoplan.schedules.simulate`), as the DP's formula cannot say."""
    times = [s.time_s + s.send_s for s in stages]
    if not (cluster.shares_cores and cluster.num_nodes == 1):
        scheduled = pipeline_time(times, num_microbatches)
    else:
        stage_size = math.prod(costs.mesh_shape)
        # ranks sharing cores: a stage waiting in the bubble leaves its cores to the others.
        # Its sends are its CPU work too (gloo), half with each forward, half with each backward
        steps = [
            (s.forward_s + s.send_s / 2, s.time_s - s.forward_s + s.send_s / 2) for s in stages
        ]
        events = simulate(
            schedule,
            len(stages),
            num_microbatches,
            steps,
            lambda running: cluster.rank_speed(running * stage_size),
        )
        scheduled = max(e.end for e in events)
    # gradient sync and the optimizer update run once, after the last microbatch
    step = scheduled + max(s.extra_s for s in stages)
    # the schedule's idle share: (S - 1) / (S + B - 1) for equal stages
    busy = num_microbatches * sum(times) / len(times)
    return PipelinePlan(
        graph=graph,
        layers=layers,
        num_microbatches=num_microbatches,
        schedule=schedule,
        mesh_shape=costs.mesh_shape,
        costs=costs,
        boundary=boundary,
        stages=stages,
        step_time_s=step,
        bubble_fraction=max(0.0, 1.0 - busy / scheduled) if scheduled > 0 else 0.0,
        memory_limit=memory_limit,
    )


def price_pipeline(
    graph: Graph,
    layers: tuple[Layer, ...],
    cluster: Cluster,
    *,
    mesh_shape: tuple[int, ...],
    boundary: Spec,
    assignments: Sequence[dict[str, Strategy]],
    num_microbatches: int,
    schedule: str,
    optimizer: str,
    memory_limit: float,
) -> PipelinePlan:
    """A pipeline whose decisions are given (a plan to re-price, a baseline): stage ``s`` is
    ``layers[s]`` with strategies ``assignments[s]`` (by node name of its stage graph)."""
    stage_cluster = _stage_cluster(cluster, math.prod(mesh_shape))
    costs = Pricer(stage_cluster, mesh_shape, optimizer)
    stages = []
    for s, assignment in enumerate(assignments):
        stage = stage_graph(graph, layers, s, s + 1)
        step = price_step(stage.graph, assignment, costs)
        send = _send_time(cluster, _sent_bytes(stage, mesh_shape, boundary))
        rules = dict.fromkeys(assignment, "given")
        no_solver = _SolverStats(0.0, 0, 0, 0)
        stages.append(_priced(s, s + 1, stage, assignment, step, rules, costs, send, no_solver))
    return _pipeline(
        cluster, graph, layers, num_microbatches, schedule, costs, boundary, tuple(stages),
        memory_limit,
    )  # fmt: skip
