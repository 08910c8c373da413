"""The public entry points. Orchestration only: each step lives in its own module."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.baselines.grid import (
    Degrees,
    batch_of,
    fastest_conventional,
    shaped_degrees,
    with_experts,
)
from autoplan.cluster.model import Cluster
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import (
    AutoplanError,
    BufferWriteError,
    InfeasiblePlanError,
    SolverTimeLimitError,
)
from autoplan.graph.blocks import find_sharing
from autoplan.graph.capture import batch_size, capture, capture_microbatches
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import chosen
from autoplan.modes import RecomputeMode, Schedule
from autoplan.no_plan import infeasible, no_plan
from autoplan.options import PlanOptions
from autoplan.phases import counted, split, timed
from autoplan.pins import apply_pins, keep_sharing_consistent, parse_pins
from autoplan.planfile.assemble import assemble_pipeline_plan, assemble_plan, solver_info
from autoplan.planfile.schema import Plan
from autoplan.progress import Tally
from autoplan.schedules import V_SHAPED, schedule_refusal
from autoplan.search.ahead import TracedAhead
from autoplan.search.intra_op import candidate_meshes
from autoplan.search.mesh_plans import MeshPlan, Overshot, Slower, solve_mesh
from autoplan.search.pipeline_search import (
    GraphForMicrobatches,
    search_pipelines,
)
from autoplan.search.recompute_ilp import RecomputeChoice
from autoplan.side_by_side import mapped
from autoplan.solvers.problem import SKIPPED, STOPPED, Unproven, optimum_gap
from autoplan.units import fmt_bytes

log = logging.getLogger(__name__)

GiB = 2**30


def plan(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster | str | Path,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    options: PlanOptions | None = None,
) -> Plan:
    """Trace ``model`` and choose pipeline stages and a sharding for every operator.

    ``loss_fn(output, example_target)`` makes the loss; without it the model's output is the
    loss. ``options`` (`PlanOptions`; its defaults search everything the cluster allows) pins
    the mesh or parameters, sets the optimizer and memory budget, and narrows the pipeline
    search.
    """
    start = time.perf_counter()
    options = options or PlanOptions()
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    precision = options.mixed_precision
    traced = capture_microbatches(model, example_inputs, loss_fn, example_target, precision)
    ahead = (
        TracedAhead(traced, cluster, options, batch_size(example_inputs, example_target))
        if _weighs_pipelines(options, cluster)
        else None
    )
    with counted() as seconds:
        log.info("tracing %s ...", type(model).__name__)
        try:
            with timed("trace"):
                graph = capture(model, example_inputs, loss_fn, example_target, precision)
            log.info(
                "traced %d nodes, %.3g M parameters (%.1f s)",
                len(graph),
                graph.num_params / 1e6,
                time.perf_counter() - start,
            )

            @functools.cache  # the search with and without recomputation asks for the same counts
            def microbatch_graph(count: int) -> Graph:
                if count == 1:  # the whole batch: the step just traced
                    return graph
                with timed("trace"):  # waiting for the child that traced it ahead, if any
                    found = ahead.take(count) if ahead is not None else None
                    return found if found is not None else traced(count)

            found = plan_graph(graph, cluster, options, microbatch_graph)
        finally:
            if ahead is not None:
                ahead.close()
    elapsed = time.perf_counter() - start
    log.info("planned in %.1f s: %s", elapsed, split(seconds, elapsed))
    return found


def plan_graph(
    graph: Graph,
    cluster: Cluster | str | Path,
    options: PlanOptions | None = None,
    microbatch_graph: GraphForMicrobatches | None = None,
) -> Plan:
    """`plan` for a graph already traced (`autoplan.graph.capture`); pipelines need
    ``microbatch_graph(count)``, the step traced on one of ``count`` microbatches."""
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    options = options or PlanOptions()
    pipeline = options.wants_pipeline
    if pipeline and microbatch_graph is None:
        raise AutoplanError("a pipeline needs the model to trace microbatches: use autoplan.plan")
    if pipeline and options.pin:
        raise AutoplanError("pins are not supported with pipeline stages yet; drop pin=")
    if pipeline:
        refuse_pipelined_writes(graph)
    memory_limit = cluster.device.tensor_bytes(options.memory_fraction)
    tally = Tally(options.on_progress, "ILP")
    single: Searched | InfeasiblePlanError | None = None
    unproven: list[Unproven] = []  # the parts of the search that ran into the time limit
    # one search after the other: ILPs' time limits are wall-clock, and one search's ILPs
    # beside the other's would each have less of the machine. Pipelines first: a one-stage
    # mesh whose every plan is slower than the pipeline found is then left unsolved
    if not pipeline and options.mesh_shape is not None:  # refused before any search
        cluster.check_mesh_shape(options.mesh_shape)
    piped: Searched | None = None
    piped_cut_short: tuple[Unproven, ...] = ()
    weighed = False
    if _weighs_pipelines(options, cluster, bool(graph.writes)) and microbatch_graph is not None:
        weighed = True
        # one search: each stage's layers choose their recomputation in their ILPs
        piped, piped_cut_short = _plan_pipelined(
            graph, microbatch_graph, cluster, options, memory_limit, tally
        )
    if not pipeline:
        beaten = math.inf if piped is None else piped.plan.predicted.step_time_s * SLOWER_BY
        single, cut_short = _plan_one_stage(graph, cluster, options, memory_limit, tally, beaten)
        unproven += cut_short
    unproven += piped_cut_short
    found = [s for s in (single, piped) if isinstance(s, Searched)]
    if not found:
        assert not isinstance(single, Searched)
        raise no_plan(single, weighed, unproven, cluster, memory_limit)
    fastest = min(s.plan.predicted.step_time_s for s in found)
    checked = [
        _keep_faster_conventional(s, cluster, options)
        for s in found
        if s.plan.predicted.step_time_s <= fastest * CHECKED_WITHIN
    ]
    best = min(checked, key=lambda plan: plan.predicted.step_time_s)  # ties: one stage
    return _noting_unproven(best, tuple(unproven))


def _weighs_pipelines(options: PlanOptions, cluster: Cluster, writes: bool = False) -> bool:
    """Whether the search weighs pipelines: where asked, and by default on every cluster of
    several devices, inside a node too (a small model's pipeline, interleaved above all, can
    beat intra-op sharding there, and the planner is to be no slower than any conventional
    plan: tests/test_optimality.py); never against pins, which pipelines do not take, or for
    a step that ``writes`` buffers in forward (`refuse_pipelined_writes`)."""
    pipeline = options.wants_pipeline
    auto = not options.pin and cluster.num_devices > 1 and not writes
    return bool(pipeline or (pipeline is None and auto))


def refuse_pipelined_writes(graph: Graph) -> None:
    """A step that updates buffers in forward trains as one stage on the whole batch: a
    pipeline runs forward once per microbatch, and each would normalize by (batch norm in
    training), count and update the buffers with its own part of the batch, not the batch as
    one process does. The search then weighs no pipelines; one asked for is refused."""
    if not graph.writes:
        return
    names = [w.buffer for w in graph.writes]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise BufferWriteError(
        f"the model updates buffers in forward ({shown}), which a pipeline's microbatches "
        "cannot update as one process does (each would see its own part of the batch): plan "
        "without pipeline stages (PlanOptions(pipeline=False), --no-pipeline), or put the "
        "modules that update them in eval mode (batch norm: module.eval())"
    )


def _noting_unproven(plan: Plan, unproven: tuple[Unproven, ...]) -> Plan:
    """``plan``, its solver section listing the parts of the search not proven optimal (also
    where a conventional plan or a pipeline won: each part cut short might have beaten it)."""
    if not unproven:
        return plan
    for part in unproven:
        log.info("not proven optimal: %s", part.describe())
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, unproven=unproven))


@dataclasses.dataclass(frozen=True)
class Searched:
    """A plan the search found, the graph it plans, and the conventional plans of its shape
    (`autoplan.baselines.grid.Degrees`) it is to be no slower than."""

    plan: Plan
    graph: Graph
    degrees: list[Degrees]


# a one-stage mesh is left unsolved where its ILP without the memory limit or recomputation
# (a bound on every plan of it) is over this many times the pipeline found: a step's price
# hides at most its gradients' reductions behind backward, so at most min(compute,
# communication) of that objective, half of it, and the ILP misprices by a few percent more
SLOWER_BY = 2 * 1.1

# the conventional plans of a searched plan's shape are written and priced (on large
# clusters, over a hundred of them) only where the searched plan is within this factor of the
# fastest found: the search misprices by a few percent, not more
CHECKED_WITHIN = 1.1


def _keep_faster_conventional(found: Searched, cluster: Cluster, options: PlanOptions) -> Plan:
    """``found``'s plan, or the fastest conventional plan of its degrees if that is faster.
    The search's objective only approximates a plan's price (gradient buckets fill up in
    steps, the stage DP sums its layers' plans), and no plan the baselines write of the
    shape the search found is to beat it."""
    best = fastest_conventional(found.graph, cluster, found.degrees, options)
    searched = found.plan
    if best is None or best[1].predicted.step_time_s >= searched.predicted.step_time_s:
        return searched
    log.info(
        "the conventional plan %s (%.4g s per step) is faster than the one searched (%.4g s): kept",
        best[0],
        best[1].predicted.step_time_s,
        searched.predicted.step_time_s,
    )
    return best[1]


def _plan_pipelined(
    graph: Graph,
    microbatch_graph: GraphForMicrobatches,
    cluster: Cluster,
    options: PlanOptions,
    memory_limit: float,
    tally: Tally,
) -> tuple[Searched | None, tuple[Unproven, ...]]:
    """The fastest pipeline (`search_pipelines`) as a plan, and the parts of its search that
    ran into the time limit."""
    num_stages, num_microbatches = options.num_stages, options.num_microbatches
    batch = batch_of(graph)
    if num_microbatches and (num_microbatches < 1 or batch % num_microbatches):
        raise AutoplanError(
            f"num_microbatches={num_microbatches} must be at least 1 and divide the batch "
            f"of {batch}"
        )

    if num_stages is not None and (num_stages < 2 or cluster.num_devices % num_stages):
        raise AutoplanError(
            f"num_stages={num_stages}: it must be at least 2 and divide the "
            f"{cluster.num_devices} devices of cluster {cluster.name!r}"
        )
    if num_stages and num_microbatches:
        # interleaved: whether torch runs it depends on the groups and microbatches alone
        v = options.virtual_stages or 2
        refusals = [
            schedule_refusal(s, num_stages * v, num_microbatches, v)
            if s in (Schedule.INTERLEAVED, *V_SHAPED) or options.virtual_stages
            else schedule_refusal(s, num_stages, num_microbatches)
            for s in options.schedules
        ]
        if all(refusals):
            raise AutoplanError(str(refusals[0]))
    search = search_pipelines(
        microbatch_graph,
        cluster,
        options,
        batch=batch,
        memory_limit=memory_limit,
        tally=tally,
    )
    found = search.plan
    if found is None:
        return None, search.unproven
    plan = assemble_pipeline_plan(found, cluster, (options.mesh_shape or found.mesh_shape,))
    # the conventional pipelines of its device groups and microbatches: one stage a group
    # (unless Interleaved1F1B or several stages a group are forced: a conventional plan of one
    # would break them), and interleaved as found
    schedules: list[Schedule] = (
        []
        if options.schedule == Schedule.INTERLEAVED or options.virtual_stages is not None
        else [Schedule.GPIPE if options.schedule == Schedule.GPIPE else Schedule.ONE_F_ONE_B]
    )
    schedules += [Schedule.INTERLEAVED] * (found.virtual_stages > 1)
    degrees = [
        d
        for schedule in schedules
        for d in shaped_degrees(
            cluster.num_devices,
            batch,
            pp=found.num_groups,
            num_microbatches=found.num_microbatches,
            schedule=schedule,
            virtual_stages=found.virtual_stages if schedule == Schedule.INTERLEAVED else 1,
            meshes=None if options.mesh_shape is None else [options.mesh_shape],
        )
    ]
    return Searched(plan, found.graph, with_experts(found.graph, degrees)), search.unproven


def _plan_one_stage(
    graph: Graph,
    cluster: Cluster,
    options: PlanOptions,
    memory_limit: float,
    tally: Tally,
    beaten_s: float = math.inf,
) -> tuple[Searched | InfeasiblePlanError | None, tuple[Unproven, ...]]:
    """The plan of ``graph`` as one stage: one ILP per candidate mesh, choosing the layers
    that recompute with the strategies unless ``options.recompute`` fixes them; and the
    meshes whose ILPs ran into the time limit. A mesh whose ILP found no plan by then is
    skipped, the others still searched. A mesh whose every plan is slower than
    ``beaten_s`` a step by its ILP without memory limit (`Slower`) is left there. Without a
    plan: why none fits, None where every mesh was cut short (`no_plan` says so) or
    slower."""
    mesh_shape = options.mesh_shape
    meshes = [mesh_shape] if mesh_shape is not None else candidate_meshes(cluster)
    for m in meshes:
        cluster.check_mesh_shape(m)

    sharing = find_sharing(graph)
    log.info("%d repeated-layer nodes share decisions", len(sharing.canonical))
    pins = parse_pins(options.pin, graph)
    sharing = keep_sharing_consistent(sharing, pins)

    recompute = options.recompute
    recomputed = chosen(graph, options.max_layers, recompute or RecomputeMode.NONE)
    choice = RecomputeChoice.of(graph, options.max_layers) if recompute is None else None
    every_layer = chosen(graph, options.max_layers, RecomputeMode.FULL)
    best: MeshPlan | None = None
    # by mesh: the least a step on it could take by its ILP: its plan's price where the ILP
    # proved it, less the solver's gap where stopped, 0 where unknown or skipped
    fastest: dict[tuple[int, ...], float] = {}
    needs: dict[tuple[int, ...], float] = {}
    unproven: list[Unproven] = []
    limit_s = options.time_limit_s

    def solve(m: tuple[int, ...]) -> MeshPlan | float | Slower | Overshot | None:
        """`solve_mesh` on mesh ``m``; None where its ILP found no plan in time. Where the ILP
        choosing the layers that recompute found none, every layer recomputed (the least
        memory) with the strategies alone chosen: a plan, not proven the best."""
        for layers, ways in ((recomputed, choice), (every_layer, None)):
            try:
                found = solve_mesh(
                    graph,
                    sharing,
                    Pricer(cluster, m, options.optimizer, layers),
                    memory_limit,
                    limit_s,
                    functools.partial(apply_pins, graph=graph, pins=pins, mesh_shape=m),
                    float32_grads=options.float32_grads,
                    recompute=ways,
                    slower_than=beaten_s,
                )
            except SolverTimeLimitError:
                if ways is None:
                    return None
                log.warning(
                    "mesh %s: choosing the layers that recompute found no plan within the %g s "
                    "time limit; planned with every layer recomputed", m, limit_s,
                )  # fmt: skip
                continue
            return found if ways is not None else _not_proven(found)
        return None

    def solved(m: tuple[int, ...]) -> MeshPlan | float | Slower | Overshot | None:
        log.info("mesh %s: solving ...", m)
        tally.report(f"one stage on mesh {m}")
        found = solve(m)
        tally.did(f"one stage on mesh {m}", milestone=True)
        return found

    tally.expect(len(meshes))
    for m, found in zip(meshes, mapped(solved, meshes), strict=True):
        if found is None:
            log.warning(
                "mesh %s: the ILP found no plan within the %g s time limit; skipped (raise "
                "time_limit_s, --time-limit, to plan it)", m, limit_s,
            )  # fmt: skip
            unproven.append(Unproven(f"mesh {m}", SKIPPED, limit_s))
            fastest[m] = 0.0
            continue
        if isinstance(found, Slower):
            log.info(
                "mesh %s: at least %.4g s per step without a memory limit, over %.2g times the "
                "pipeline found; not solved further", m, found.bound_s, SLOWER_BY,
            )  # fmt: skip
            continue
        if isinstance(found, MeshPlan) and found.step.memory_bytes > memory_limit:
            # the ILP counts recomputed activations at the layers' mean (a mode given), or
            # prices a unit's layers on its first (chosen); the step's price is exact
            found = Overshot(found.step.memory_bytes)
        if isinstance(found, Overshot):
            # no proof that none of the mesh's plans fits: its conventional plans are tried
            log.info(
                "mesh %s: its ILP's plans are priced at %s per device, over the limit; its "
                "conventional plans are tried", m, fmt_bytes(found.peak_bytes),
            )  # fmt: skip
            needs[m] = found.peak_bytes
            fastest[m] = 0.0
            continue
        if not isinstance(found, MeshPlan):
            needs[m] = found
            log.info("mesh %s: needs at least %s per device, skipped", m, fmt_bytes(found))
            continue
        solution = found.result.solution
        if solution.status != "optimal":
            unproven.append(Unproven(f"mesh {m}", STOPPED, limit_s, solution.gap))
        log.info(
            "mesh %s: predicted %.4g s per step (%s, %.2f s)",
            m,
            found.step.time_s,
            solution.status,
            solution.solve_time_s,
        )
        fastest[m] = found.step.time_s * (1.0 - optimum_gap(solution))
        # meshes compare by the step's price, which the ILP's objective only approximates
        if best is None or found.step.time_s < best.step.time_s:
            best = found
    # a mesh's conventional plans are in its ILP's space, so only a mesh whose optimum may be
    # near the best can hold one faster than the plan (the ILP misprices by a few percent;
    # an ILP stopped short may be further off, by its gap, and one whose plans are priced
    # over the memory limit is unknown); conventional plans take no pins
    bar = math.inf if best is None else best.step.time_s * CHECKED_WITHIN
    near = [m for m, t in fastest.items() if t <= bar]
    degrees = (
        []
        if options.pin
        else with_experts(graph, shaped_degrees(cluster.num_devices, batch_of(graph), meshes=near))
    )
    if best is None and not needs:
        return None, tuple(unproven)
    if best is None and (conventional := fastest_conventional(graph, cluster, degrees, options)):
        log.info("no plan searched fits; the conventional plan %s does", conventional[0])
        return Searched(conventional[1], graph, []), tuple(unproven)
    if best is None:
        # the ILP that chooses finds none only where every layer recomputed does not fit
        mode = RecomputeMode.FULL if recompute is None else recompute
        fraction = options.memory_fraction
        return infeasible(graph, cluster, needs, memory_limit, fraction, mode), tuple(unproven)
    result = best.result
    plan = assemble_plan(
        graph,
        cluster,
        result.mesh_shape,
        result.assignment,
        best.step,
        best.rules,
        solver_info(result, tuple(meshes)),
        result.problem.memory_limit,
        best.pricer.recompute,
    )
    return Searched(plan, graph, degrees), tuple(unproven)


def _not_proven(
    found: MeshPlan | float | Slower | Overshot,
) -> MeshPlan | float | Slower | Overshot:
    """``found``, its solution marked stopped at the time limit (its gap unknown): a plan of
    a narrower search than the one asked."""
    if not isinstance(found, MeshPlan):
        return found
    solution = dataclasses.replace(found.result.solution, status="time_limit", gap=None)
    return dataclasses.replace(found, result=dataclasses.replace(found.result, solution=solution))
