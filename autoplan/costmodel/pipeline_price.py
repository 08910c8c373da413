"""The price of a pipeline: each stage's time per microbatch, the send to the next stage, its
once-per-step work and its memory, and the step the stages make under a schedule.

Times. A stage's time per microbatch covers its forward and backward, the collectives inside
them, and the send of its boundary tensors (and their gradients) to the next stage
(`send_time`). The gradient synchronization and optimizer update run once per step: the
predicted step time adds them once, after the last microbatch: ``sum(t) + (B - 1) * max(t) +
max(extra)`` (`price_stages`; the stage DP amortizes them as ``extra / B`` per microbatch,
`autoplan.search.pipeline_search`). Interleaved 1F1B, ``v`` stages on each of ``p`` device
groups, takes ``B W + (sum(t) - W) / v`` with ``W`` the busiest group's ``sum(t)``
(`autoplan.solvers.stage_problem.interleaved_time`): a bubble ``v`` times smaller, for ``v``
times the sends, each stage paying its own. Memory: a stage's parameters, gradients and
optimizer state once, plus the activations of each microbatch in flight (1F1B: ``S - s`` for
stage ``s``; GPipe: all ``B``); interleaved, a device group holds all its stages' and the
most activations in flight at once as torch's order runs them
(`autoplan.schedules.peak_in_flight`; `PipelinePlan.stage_memory`).

ZeroBubble (and ZBV and DualPipeV, in a V) splits each backward into the input gradients
(``B``) and the weight gradients (``W``), which it runs later, in the bubble: no formula
says its step, which is simulated from torch's order (`autoplan.schedules.simulate`). A
stage's ``W`` is its ``weight_share`` of its backward: the forward FLOPs of its ops that
read a parameter over its backward FLOPs (a matmul's weight gradient is one more matmul of
its forward's size, as its input gradient is; the other ops' backward is all ``B``). From
``B`` to ``W`` a microbatch holds, besides its activations, the gradients of those ops'
outputs (``held_bytes``).

A pipeline's stages come from the stage search (`autoplan.search.layer_plans`) or are given
(`price_pipeline`: a plan to re-price, a baseline); both are priced here the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import PricedStep, price_step
from autoplan.costmodel.timing import collective_time, sync_overhead
from autoplan.graph.cut import Layer, StageGraph
from autoplan.graph.ir import Graph, itemsize
from autoplan.graph.recompute import NO_RECOMPUTE, Recompute
from autoplan.modes import NodeKind, Phase, Schedule
from autoplan.schedules import (
    MULTI_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    group_order,
    group_stages,
    peak_in_flight,
    simulate,
    stage_group,
)
from autoplan.solvers.stage_problem import interleaved_time, pipeline_time
from autoplan.strategies.placement import Spec, fitted, local_numel
from autoplan.strategies.space import Strategy
from autoplan.strategies.zero_state import param_gathered_dtype


@dataclass(frozen=True)
class SolvedStage:
    """Layers ``[start, stop)`` as one pipeline stage: its strategies and their price."""

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
    memory_bytes: float  # parameters, gradients, optimizer state; a recomputed layer's
    activation_bytes: float  # one microbatch in flight
    solver: SolverStats
    recompute_bytes: float = 0.0  # of memory_bytes, its largest recomputed layer's activations
    # its recomputed layers (`Recompute.layers`): stages choose their own
    recomputed: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    weight_share: float = 0.5  # of the backward, the weight gradients' (ZeroBubble's W)
    held_bytes: float = 0.0  # output gradients a microbatch holds from its B to its W


@dataclass(frozen=True)
class PipelinePlan:
    """Stages on uniform submeshes and the step they make under ``schedule``: stage ``s`` on
    device group ``s mod p``, ``p = len(stages) / virtual_stages``, or in a V (ZBV:
    `autoplan.schedules.stage_group`)."""

    graph: Graph  # the step at the microbatch's shape
    layers: tuple[Layer, ...]
    num_microbatches: int
    schedule: str
    mesh_shape: tuple[int, ...]  # each stage's logical mesh
    pricer: Pricer  # of a stage's mesh (what each stage recomputes: `recompute`)
    boundary: Spec
    stages: tuple[SolvedStage, ...]
    step_time_s: float
    bubble_fraction: float
    memory_limit: float
    virtual_stages: int = 1  # stages on each device group (Interleaved1F1B: 2 or more)

    def order(self, group: int) -> tuple[tuple[str, int, int], ...]:
        """The steps device group ``group`` runs, in order (`autoplan.schedules.group_order`)."""
        return group_order(
            self.schedule, len(self.stages), self.num_microbatches, group, self.virtual_stages
        )

    @property
    def num_groups(self) -> int:
        return len(self.stages) // self.virtual_stages

    def group(self, s: int) -> int:
        """The device group of stage ``s`` (`autoplan.schedules.stage_group`)."""
        return stage_group(self.schedule, len(self.stages), self.virtual_stages, s)

    @property
    def recompute(self) -> Recompute:
        """The stages' recomputed layers, each in the mode its stage chose."""
        return Recompute.mixed(self.graph, (la for st in self.stages for la in st.recomputed))

    def stage_memory(self, s: int) -> float:
        """Peak bytes per device of stage ``s`` under the schedule; interleaved, of its device
        group, which holds all its stages."""
        if self.schedule in MULTI_STAGE:
            group = self.group(s)
            held = group_stages(self.schedule, len(self.stages), self.virtual_stages, group)
            static = sum(self.stages[c].memory_bytes for c in held)
            return static + peak_in_flight(
                self.order(group),
                lambda c: self.stages[c].activation_bytes,
                lambda c: self.stages[c].held_bytes,
            )
        in_flight = (
            self.num_microbatches if self.schedule == Schedule.GPIPE else len(self.stages) - s
        )
        stage = self.stages[s]
        return stage.memory_bytes + min(in_flight, self.num_microbatches) * stage.activation_bytes


@dataclass(frozen=True)
class SolverStats:
    """What the ILPs behind a stage took to solve (zeros for strategies given)."""

    solve_time_s: float
    num_variables: int
    num_constraints: int
    num_groups: int

    @staticmethod
    def total(stats: Iterable[SolverStats]) -> SolverStats:
        """The ILPs behind several stages or layers, added up."""
        found = list(stats)
        return SolverStats(
            solve_time_s=sum(s.solve_time_s for s in found),
            num_variables=sum(s.num_variables for s in found),
            num_constraints=sum(s.num_constraints for s in found),
            num_groups=sum(s.num_groups for s in found),
        )


def own_decisions(stages: Iterable[SolvedStage]) -> tuple[dict[str, Strategy], dict[str, str]]:
    """The strategies and rules of the stages' own nodes (their nodes of the original graph,
    not the boundary nodes each stage graph adds), merged in stage order."""
    assignment: dict[str, Strategy] = {}
    rules: dict[str, str] = {}
    for st in stages:
        own = set(st.stage.nodes)
        assignment.update({k: v for k, v in st.assignment.items() if k in own})
        rules.update({k: v for k, v in st.rules.items() if k in own})
    return assignment, rules


def priced_stage(
    start: int,
    stop: int,
    stage: StageGraph,
    assignment: dict[str, Strategy],
    step: PricedStep,
    rules: dict[str, str],
    pricer: Pricer,
    send_s: float,
    solver: SolverStats,
) -> SolvedStage:
    """A stage's price from its step's: the parameters' updates and the gradient
    synchronization are its once-per-step ``extra_s``, the rest its time per microbatch, split
    into forward and backward by FLOPs; its parameters and inputs are the memory it holds
    once (with the activations of its largest recomputed layer, made again in backward one
    microbatch at a time), the rest one microbatch's activations."""
    graph = stage.graph
    extra = sum(pricer.node_time(n, assignment[n.name]) for n in graph if n.kind == NodeKind.PARAM)
    extra += pricer.gradients_s([p for _, _, p in step.collectives if p.phase == Phase.GRAD_SYNC])
    extra += sum(
        pricer.internal_time(n, assignment[n.name], (), param_gathered_dtype(graph, n.name))
        for n in graph
        if n.kind == NodeKind.PARAM
    )
    static = step.recompute_bytes + sum(
        pricer.node_memory(n, assignment[n.name])
        for n in graph
        if n.kind in (NodeKind.PARAM, NodeKind.INPUT)
    )
    flops = sum(n.flops for n in graph)
    backward_flops = sum(n.bwd_flops for n in graph)
    total_flops = flops + backward_flops
    weighted = [n for n in graph if n.kind == NodeKind.OP and n.params and n.needs_grad]
    weight_flops = sum(n.flops for n in weighted)
    # a pipeline reduces its gradients after its schedule (`GradientReducer.reduce_now`):
    # nothing of them hides behind a microbatch's backward
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
        # the buckets' buffers are not counted in a pipeline's stages (docs/status.md)
        activation_bytes=step.memory_bytes - step.rest.bucket_bytes - static,
        solver=solver,
        recompute_bytes=step.recompute_bytes,
        recomputed=pricer.recompute.within(frozenset(stage.nodes)),
        weight_share=min(1.0, weight_flops / backward_flops) if backward_flops else 0.5,
        held_bytes=sum(pricer.activation_memory(n, assignment[n.name]) for n in weighted),
    )


def sent_bytes(stage: StageGraph, mesh: tuple[int, ...], boundary: Spec) -> int:
    """Bytes each rank sends to its peer in the next stage."""
    infos = [stage.graph.node(n).output for n in stage.sent]
    return sum(
        local_numel(fitted(boundary, t.shape), t.shape, mesh) * itemsize(t.dtype) for t in infos
    )


def send_time(cluster: Cluster, nbytes: float) -> float:
    """Activations forward and their gradients back, between peers of consecutive stages;
    priced on the inter-node link whenever the pipeline spans nodes (some boundary does). The
    receiver waits for each right after computing, as for a blocking collective: each pays
    the measured `sync_overhead`."""
    link = cluster.inter_node if cluster.num_nodes > 1 else cluster.intra_node
    message = collective_time(cluster, "send_recv", nbytes, 2, link)
    return 2 * (message + sync_overhead(cluster)) if message else 0.0


def price_stages(
    cluster: Cluster,
    graph: Graph,
    layers: tuple[Layer, ...],
    num_microbatches: int,
    schedule: str,
    pricer: Pricer,
    boundary: Spec,
    stages: tuple[SolvedStage, ...],
    memory_limit: float,
    virtual_stages: int = 1,
) -> PipelinePlan:
    """``stages`` as a pipeline, priced by the formula the stage DP minimizes, ``sum(t) + (B - 1)
    max(t)`` (interleaved: `interleaved_time`); or, under ZeroBubble or where ranks share fewer
    cores than they are (CPU ranks on one node, `Cluster.shares_cores`), by simulating the
    schedule (with the stages sharing the cores; `autoplan.schedules.simulate`), as the DP's
    formula cannot say. In a V (ZBV, DualPipeV) the middle stage's output stays on its device
    group: it sends nothing."""
    if schedule in V_SHAPED:
        middle = len(stages) // 2 - 1
        stages = tuple(replace(s, send_s=0.0) if i == middle else s for i, s in enumerate(stages))
    times = [s.time_s + s.send_s for s in stages]
    shared = cluster.shares_cores and cluster.num_nodes == 1
    if schedule not in SPLIT_BACKWARD and not shared:
        if virtual_stages > 1:
            scheduled = interleaved_time(times, num_microbatches, virtual_stages)
        else:
            scheduled = pipeline_time(times, num_microbatches)
    else:
        stage_size = math.prod(pricer.mesh_shape)
        # a stage's sends, half with each forward, half with each backward; ranks sharing
        # cores: a stage waiting in the bubble leaves its cores to the others, and its sends
        # are its CPU work too (gloo)
        steps = [
            (s.forward_s + s.send_s / 2, s.time_s - s.forward_s + s.send_s / 2) for s in stages
        ]
        events = simulate(
            schedule,
            len(stages),
            num_microbatches,
            steps,
            (lambda running: cluster.rank_speed(running * stage_size)) if shared else None,
            virtual_stages,
            # of the backward with its half of the sends, W's share: the sends go with B
            [
                s.weight_share * (b - s.send_s / 2) / b if b else 0.0
                for s, (_, b) in zip(stages, steps, strict=True)
            ],
        )
        scheduled = max(e.end for e in events)
    # gradient sync and the optimizer update run once, after the last microbatch
    step = scheduled + max(s.extra_s for s in stages)
    # the schedule's idle share: (S - 1) / (S + B - 1) for equal stages (interleaved: the
    # groups' (p - 1) / (v B + p - 1))
    busy = num_microbatches * sum(times) / (len(times) // virtual_stages)
    return PipelinePlan(
        graph=graph,
        layers=layers,
        num_microbatches=num_microbatches,
        schedule=schedule,
        mesh_shape=pricer.mesh_shape,
        pricer=pricer,
        boundary=boundary,
        stages=stages,
        step_time_s=step,
        bubble_fraction=max(0.0, 1.0 - busy / scheduled) if scheduled > 0 else 0.0,
        memory_limit=memory_limit,
        virtual_stages=virtual_stages,
    )


def price_pipeline(
    graph: Graph,
    layers: tuple[Layer, ...],
    cluster: Cluster,
    *,
    stage_graphs: Sequence[StageGraph],
    mesh_shape: tuple[int, ...],
    boundary: Spec,
    assignments: Sequence[dict[str, Strategy]],
    num_microbatches: int,
    schedule: str,
    optimizer: str,
    memory_limit: float,
    virtual_stages: int = 1,
    recompute: Recompute = NO_RECOMPUTE,
) -> PipelinePlan:
    """A pipeline whose decisions are given (a plan to re-price, a baseline): stage ``s`` is
    ``layers[s]``, as ``stage_graphs[s]`` (`stage_graph`), with strategies ``assignments[s]``
    (by node name of its stage graph), on device group ``s mod (S / virtual_stages)`` (or in a
    V: `autoplan.schedules.stage_group`), recomputing ``recompute``."""
    sub_cluster = cluster.stage(math.prod(mesh_shape))
    pricer = Pricer(sub_cluster, mesh_shape, optimizer, recompute)
    stages = []
    for s, (stage, assignment) in enumerate(zip(stage_graphs, assignments, strict=True)):
        step = price_step(stage.graph, assignment, pricer)
        send = send_time(cluster, sent_bytes(stage, mesh_shape, boundary))
        rules = dict.fromkeys(assignment, "given")
        no_solver = SolverStats(0.0, 0, 0, 0)
        stages.append(
            priced_stage(s, s + 1, stage, assignment, step, rules, pricer, send, no_solver)
        )
    return price_stages(
        cluster, graph, layers, num_microbatches, schedule, pricer, boundary, tuple(stages),
        memory_limit, virtual_stages,
    )  # fmt: skip
