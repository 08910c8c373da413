"""The pipeline search: Alpa's stage DP over the layers' intra-op plans, for each stage size,
logical mesh, boundary placement and microbatch count, and the fastest pipeline that fits.

For each microbatch count ``B`` tried (`search_pipelines`), the step is traced at the shape of one
microbatch and cut into layers (`autoplan.graph.cut`). For each stage size (a submesh of
``|m|`` devices: part of a node or whole nodes), each logical mesh of it and each boundary
placement (`autoplan.search.stage_layout`), the stage DP (`autoplan.solvers.stages`)
chooses the layer ranges; a range costs the sum of its layers' intra-op ILP plans
(`autoplan.search.layer_plans`), each layer solved once per structure. The stages found are
then priced under each schedule allowed (1F1B, GPipe, ZeroBubble;
`autoplan.costmodel.pipeline_price`) and the fastest that fits kept. The DP's formula is
1F1B's; ZeroBubble runs the same stages with their weight gradients put off into the bubble,
priced by simulating torch's order.

Each range comes in variants (`_variants`) that the DP chooses among stage by stage: a memory
budget for its layers' plans (`autoplan.search.layer_plans.Budget`: a share of the memory,
the activations counted once, once per microbatch the first stage holds, or that for every
layer). Each layer's ILP chooses which of its blocks recompute, and how, within its budget
(`autoplan.search.recompute_ilp`), unless the options fix the mode. Under 1F1B the first
stage holds as many microbatches in flight as there are stages, the last stage one: the DP
gives each stage the fastest variant that fits its own count, so early stages recompute or
shard more than late ones; a stage that recomputes then keeps the fewest of its layers
recomputed that fit (`autoplan.search.recompute_choice`), unless the mode was given.
Variants are added only while some range of balanced length cannot fit at the fewest
microbatches it could hold in flight.

Interleaved 1F1B (and ZeroBubble interleaved, and ZBV: ``v = 2`` in a V) with ``v`` stages
on each of the ``p`` device groups is searched the same way (`_interleaved`): the DP splits
the layers into ``p v`` stages (the layers' plans are the same), for ``v = 2, 3, ...`` while
the layers allow and the step gets faster; its memory per device group, over all its stages,
is checked once priced.

The DP minimizes ``sum(t) + (B - 1) * max(t)`` over stage times ``t`` per microbatch, with the
once-per-step gradient synchronization and optimizer update amortized as ``extra / B``; it
allows mixed submeshes, and the cost function given to it rules all but the uniform stages
out (`_solve_dp`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import PipelinePlan, SolvedStage, price_stages
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import AutoplanError
from autoplan.graph.cut import crossing_tuple, cut_layers, shared_params
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import chosen
from autoplan.modes import RecomputeMode, Schedule
from autoplan.options import PlanOptions
from autoplan.progress import Tally
from autoplan.schedules import MULTI_STAGE, schedule_refusal
from autoplan.search.layer_plans import FULL_BUDGET, Budget, LayerGraphs, StageSolver
from autoplan.search.partition import may_fit, partition
from autoplan.search.recompute_choice import fewest_in_stages
from autoplan.search.recompute_ilp import RecomputeChoice
from autoplan.search.stage_layout import (
    boundary_specs,
    stage_meshes,
    stage_sizes,
    stage_submesh,
)
from autoplan.solvers.problem import Unproven
from autoplan.solvers.stage_problem import (
    StageCost,
    Submesh,
)
from autoplan.strategies.placement import Spec, is_valid

log = logging.getLogger(__name__)

GraphForMicrobatches = Callable[[int], Graph]

# a layer's ILP stops here (or at PlanOptions.time_limit_s if sooner), keeping the best plan
# found: a search solves dozens, and the hardest spend most of their time proving plans they
# found early (planning times: benchmarks/results/plan_gpt.md)
LAYER_TIME_LIMIT_S = 2.0


def default_microbatches(batch: int, max_stages: int) -> int:
    """Where the search for a microbatch count starts, as Alpa takes one: the fewest that keep
    the 1F1B bubble of the deepest pipeline tried at or below a third of the step
    (``B >= 2 S``) and divide the batch, or one sample per microbatch."""
    return next((b for b in range(2 * max_stages, batch + 1) if batch % b == 0), batch)


@dataclass(frozen=True)
class PipelineSearch:
    """What the pipeline search found: the fastest pipeline (None if none fits), and the
    layers' ILPs that ran into their time limit on the way (`StageSolver.unproven`)."""

    plan: PipelinePlan | None
    unproven: tuple[Unproven, ...] = ()


def search_pipelines(
    graph_for: GraphForMicrobatches,
    cluster: Cluster,
    options: PlanOptions,
    *,
    batch: int,
    memory_limit: float,
    tally: Tally,
) -> PipelineSearch:
    """The fastest pipeline of two or more uniform stages (``options.num_stages`` if given)
    under one of ``options.schedules``, each stage on ``options.mesh_shape`` if given, within
    ``memory_limit`` bytes per device, or None if none fits; and the layers' ILPs that ran
    into the time limit.

    The microbatch count is ``options.num_microbatches`` if given, else `default_microbatches`; on
    one node the search then halves it while the best pipeline gets faster: fewer, larger
    microbatches pay the framework's work per microbatch fewer times and run larger kernels,
    against a longer bubble (where ranks share cores, a bubble leaves them to the others).
    Each count's ILPs are announced to ``tally`` as its search begins. The step is traced
    for each count tried, and every stage size solved again: across nodes that multiplied
    planning time several-fold, so there the one count serves, as in Alpa."""
    num_microbatches = options.num_microbatches
    sizes = _sizes(cluster, options)
    count = first_microbatches(cluster, options, batch)
    if count is None:
        return PipelineSearch(None)
    best: PipelinePlan | None = None
    unproven: list[Unproven] = []
    while True:
        found, cut_short = _best_for_count(
            cluster, options, memory_limit, graph_for(count), sizes, count, tally, batch // count
        )
        unproven += cut_short
        if found is None or (best is not None and found.step_time_s >= best.step_time_s):
            return PipelineSearch(best or found, tuple(unproven))
        best = found
        if num_microbatches or count % 2 or cluster.num_nodes > 1:
            return PipelineSearch(best, tuple(unproven))
        count //= 2


def _sizes(cluster: Cluster, options: PlanOptions) -> list[int]:
    """The stage sizes searched: every `stage_sizes`, or those of ``options.num_stages``."""
    num_stages = options.num_stages
    return [
        size
        for size in stage_sizes(cluster)
        if num_stages is None or cluster.num_devices // size == num_stages
    ]


def first_microbatches(cluster: Cluster, options: PlanOptions, batch: int) -> int | None:
    """The microbatch count `search_pipelines` tries first for a step of ``batch`` samples
    (None: it searches no pipeline)."""
    sizes = _sizes(cluster, options)
    if not sizes or batch < 2:
        return None
    deepest = cluster.num_devices // min(sizes)
    return options.num_microbatches or default_microbatches(batch, min(deepest, options.max_layers))


def _best_for_count(
    cluster: Cluster,
    options: PlanOptions,
    memory_limit: float,
    graph: Graph,
    sizes: Sequence[int],
    num_microbatches: int,
    tally: Tally,
    microbatch: int,
) -> tuple[PipelinePlan | None, list[Unproven]]:
    """The fastest pipeline of ``graph`` (the step at the shape of one microbatch of
    ``microbatch`` samples) over the stage sizes ``sizes``, and the layers' ILPs that ran
    into the time limit."""
    num_stages = options.num_stages
    layers = cut_layers(graph, options.max_layers)
    shared = shared_params(graph, layers)
    if shared:
        name, readers = next(iter(shared.items()))
        log.info("no pipeline: parameter %s is read by layers %s (tied weights)", name, readers)
        return None, []
    if (crossing := crossing_tuple(graph, layers)) is not None:
        log.info(
            "no pipeline: %s (layer %d) has several outputs that later layers read; a stage "
            "sends one tensor at a time",
            *crossing,
        )
        return None, []
    if num_stages is not None and num_stages > len(layers):
        raise AutoplanError(
            f"num_stages={num_stages}, but the step has only {len(layers)} layer(s) to divide "
            f"({', '.join(layer.name for layer in layers)}); use at most {len(layers)} stages"
        )
    parts = LayerGraphs.of(graph, layers)
    tried = {
        size: _configurations(cluster, options, size, num_microbatches, len(layers), microbatch)
        for size in sizes
        if cluster.num_devices // size <= len(layers)
    }
    tally.expect(parts.num_structures * sum(len(c) for c in tried.values()))
    best: PipelinePlan | None = None
    unproven: list[Unproven] = []
    for size, configurations in tried.items():
        found, cut_short = _best_for_size(
            cluster, options, memory_limit, parts, size, num_microbatches, configurations, tally
        )
        unproven += cut_short
        if found is not None and (best is None or found.step_time_s < best.step_time_s):
            best = found
    return best, unproven


def _virtual_counts(options: PlanOptions, groups: int, num_layers: int) -> list[int]:
    """The stages per device group to try under Interleaved1F1B or ZeroBubble:
    `PlanOptions.virtual_stages`, or 2 up to what the layers allow (none where neither
    schedule is allowed)."""
    if not set(MULTI_STAGE) & set(options.schedules):
        return []
    if options.virtual_stages is not None:
        return [options.virtual_stages] if groups * options.virtual_stages <= num_layers else []
    return list(range(2, num_layers // groups + 1))


def _runnable(
    options: PlanOptions, groups: int, num_microbatches: int, num_layers: int
) -> tuple[list[Schedule], list[tuple[Schedule, int]]]:
    """The schedules of one stage a group, and the schedules with several stages a group
    and their stages per group, that torch runs over ``groups`` device groups and
    ``num_microbatches``."""
    single: list[Schedule] = [
        s
        for s in options.schedules
        if options.virtual_stages is None and not schedule_refusal(s, groups, num_microbatches)
    ]
    virtual = [
        (s, v)
        for v in _virtual_counts(options, groups, num_layers)
        for s in options.schedules
        if s in MULTI_STAGE and not schedule_refusal(s, groups * v, num_microbatches, v)
    ]
    return single, virtual


def _configurations(
    cluster: Cluster,
    options: PlanOptions,
    size: int,
    num_microbatches: int,
    num_layers: int,
    microbatch: int,
) -> list[tuple[tuple[int, ...], Spec]]:
    """The logical meshes and boundary placements tried for stages of ``size`` devices: none
    if no schedule allowed runs their pipeline of ``num_microbatches``. A boundary that does
    not split a microbatch of ``microbatch`` samples evenly is not tried: its batch could not
    cross so, or with one sample would cross whole (`fitted`), as under another boundary."""
    num_stages = cluster.num_devices // size
    if _runnable(options, num_stages, num_microbatches, num_layers) == ([], []):
        return []
    sub_cluster = cluster.stage(size)
    meshes = [options.mesh_shape] if options.mesh_shape is not None else None
    return [
        (tuple(mesh), boundary)
        for mesh in meshes or stage_meshes(sub_cluster)
        if math.prod(mesh) == size
        for boundary in boundary_specs(tuple(mesh), spans_nodes=sub_cluster.num_nodes > 1)
        if is_valid(boundary, (microbatch,), tuple(mesh))
    ]


def _best_for_size(
    cluster: Cluster,
    options: PlanOptions,
    memory_limit: float,
    parts: LayerGraphs,
    size: int,
    num_microbatches: int,
    configurations: Sequence[tuple[tuple[int, ...], Spec]],
    tally: Tally,
) -> tuple[PipelinePlan | None, list[Unproven]]:
    """The fastest pipeline with stages of ``size`` devices, over their ``configurations``
    (logical mesh, boundary placement), schedules and the stages' variants, and the layers'
    ILPs that ran into the time limit."""
    if not configurations:
        return None, []
    sub_cluster = cluster.stage(size)
    num_stages = cluster.num_devices // size
    runnable, virtual = _runnable(options, num_stages, num_microbatches, len(parts.layers))
    counts = [num_stages] * bool(runnable) + [v * num_stages for _, v in virtual]
    graph = parts.graph
    # the layers' ILPs choose what recomputes, unless the options say
    mode = options.recompute
    # a balanced stage of k layers holds one recomputed layer's activations again at a time
    holds = 1 / -(-len(parts.layers) // num_stages)
    choice = RecomputeChoice.of(graph, options.max_layers, holds) if mode is None else None
    recomputed = chosen(graph, options.max_layers, mode or RecomputeMode.NONE)
    lightest = chosen(graph, options.max_layers, mode or RecomputeMode.FULL)
    floor = Pricer(sub_cluster, configurations[0][0], options.optimizer, lightest)
    if not may_fit(parts, floor, counts, num_microbatches, memory_limit):
        log.info(
            "%d stages of %d devices, %d microbatches: cannot fit, even with every tensor "
            "split over a stage's devices",
            num_stages,
            size,
            num_microbatches,
        )
        tally.withdraw(parts.num_structures * len(configurations))
        return None, []
    best: PipelinePlan | None = None
    unproven: list[Unproven] = []
    for mesh, boundary in configurations:
        label = (
            f"{num_stages} stages of mesh {mesh}, boundary {'/'.join(boundary)}, "
            f"{num_microbatches} microbatches"
        )
        solver = StageSolver(
            parts,
            cluster,
            Pricer(sub_cluster, mesh, options.optimizer, recomputed),
            boundary,
            num_microbatches,
            memory_limit,
            min(options.time_limit_s, LAYER_TIME_LIMIT_S),
            tally,
            label,
            options.float32_grads,
            recompute=choice,
        )
        variants = _variants(solver, num_stages, num_microbatches)
        sub = stage_submesh(cluster, size)
        solved = _solve_dp(variants, sub, num_microbatches) if runnable and variants else None
        fitting = []
        for schedule in runnable:
            if solved is None:
                break
            found = _priced(solver, num_microbatches, schedule, solved, 1)
            _log(found)
            if _fits(found):
                fitting.append(found)
        if variants:
            fitting += _interleaved(variants, sub, num_microbatches, virtual)
        if options.recompute is None:  # the planner's choice: each stage as few layers as fit
            fitting = [fewest_in_stages(found, cluster) for found in fitting]
        tally.withdraw(solver.unplanned())
        unproven += solver.unproven()
        fastest = min(fitting, key=lambda found: found.step_time_s, default=None)
        outcome = "none fits" if fastest is None else f"{fastest.step_time_s:.4g} s per step"
        tally.report(f"{label}: {outcome}", milestone=True)
        if fastest is not None and (best is None or fastest.step_time_s < best.step_time_s):
            best = fastest
    return best, unproven


@dataclass(frozen=True)
class Variant:
    """A stage's layers planned by ``solver`` within ``budget``."""

    solver: StageSolver
    budget: Budget

    def cost(self, start: int, stop: int) -> StageCost | None:
        """Layers ``[start, stop)`` as the stage DP counts them: the once-per-step work
        amortized over the microbatches."""
        found = self.solver.cost(start, stop, self.budget)
        if found is None:
            return None
        return StageCost(
            time_s=found.time_s + found.extra_s / self.solver.num_microbatches,
            memory_bytes=found.memory_bytes,
            activation_bytes=found.activation_bytes,
        )


def _variants(solver: StageSolver, num_stages: int, num_microbatches: int) -> list[Variant]:
    """The variants the DP chooses among (module docstring): the layers' plans within the
    whole memory; then, while some range does not fit (`_uncovered`), lines of budgets:
    the whole memory with the activations counted as often as the first stage holds them,
    and that for every layer (where the layers' ILPs choose recomputation, plans with the
    fewest activations: a layer alone may fit its share of a stage without, and the first
    layer's embedding leaves it no even share of the memory), each line going on within
    ``memory_limit / level`` for ``level`` = 2, 4, ... (where the first stage holds one
    microbatch, the one line counts the activations once). A budget within which no layer
    has a plan ends its line; one whose plans repeat the looser budget's adds nothing."""
    if solver.infeasible(FULL_BUDGET):
        return []
    found = [Variant(solver, FULL_BUDGET)]
    most = min(num_stages, num_microbatches)  # the first stage's microbatches in flight
    counts = sorted({most, most * len(solver.layers)} - {1})
    lines = [Budget(1, count) for count in counts] or [FULL_BUDGET.tighter()]
    while lines and _uncovered(found, num_stages, num_microbatches):
        budget = lines.pop(0)
        if budget.level > 2 * len(solver.layers) or solver.infeasible(budget):
            continue
        if not solver.repeats(budget):
            found.append(Variant(solver, budget))
        lines.append(budget.tighter())
    return found


def _uncovered(variants: Sequence[Variant], num_stages: int, num_microbatches: int) -> bool:
    """Whether some range of layers fits in none of ``variants`` with the fewest
    microbatches in flight it could hold as one of ``num_stages`` stages under 1F1B: a range
    from layer ``i`` is at most the ``i``-th stage, with ``num_stages - i`` (at least one, at
    most the microbatches) in flight. Only ranges as long as balanced stages are (``L / S``
    layers, rounded up) are asked to fit: a longer one would hold the pipeline back."""
    solver = variants[0].solver
    num_layers, limit = len(solver.layers), solver.memory_limit
    longest = -(-num_layers // num_stages)
    for start in range(num_layers):
        in_flight = min(num_microbatches, max(1, num_stages - start))
        for stop in range(start + 1, min(start + longest, num_layers) + 1):
            range_costs = [v.cost(start, stop) for v in variants]
            if not any(
                c is not None and c.memory_bytes + in_flight * c.activation_bytes <= limit
                for c in range_costs
            ):
                return True
    return False


def _fits(found: PipelinePlan) -> bool:
    return all(found.stage_memory(s) <= found.memory_limit for s in range(len(found.stages)))


def _log(found: PipelinePlan) -> None:
    log.info(
        "pipeline %d x %s, %d microbatches, %s%s, boundary %s: %.4g s per step",
        len(found.stages),
        found.mesh_shape,
        found.num_microbatches,
        found.schedule,
        f" ({found.virtual_stages} stages a group)" if found.virtual_stages > 1 else "",
        found.boundary,
        found.step_time_s,
    )


def _interleaved(
    variants: Sequence[Variant],
    sub: Submesh,
    num_microbatches: int,
    counts: Sequence[tuple[Schedule, int]],
) -> list[PipelinePlan]:
    """The interleaved pipelines that fit, ``v`` stages on each device group under
    ``schedule`` for each ``(schedule, v)`` in ``counts``, stopping after two ``v`` in a row
    slower than the fastest before them (a ``v`` that splits the layers unevenly can be
    slower than the next)."""
    found: list[PipelinePlan] = []
    fastest, slower = math.inf, 0
    solver = variants[0].solver
    for v in sorted({v for _, v in counts}):
        solved = _solve_dp(variants, sub, num_microbatches, v)
        if solved is None:
            continue
        schedules = [schedule for schedule, count in counts if count == v]
        priced = [_priced(solver, num_microbatches, schedule, solved, v) for schedule in schedules]
        for plan in priced:
            _log(plan)
        quickest = min(plan.step_time_s for plan in priced)
        slower = slower + 1 if quickest > fastest else 0
        if slower == 2:
            break
        fastest = min(fastest, quickest)
        found += [plan for plan in priced if _fits(plan)]
    return found


def _priced(
    solver: StageSolver,
    num_microbatches: int,
    schedule: Schedule,
    stages: tuple[SolvedStage, ...],
    virtual_stages: int,
) -> PipelinePlan:
    return price_stages(
        solver.cluster, solver.graph, solver.layers, num_microbatches, schedule, solver.pricer,
        solver.boundary, stages, solver.memory_limit, virtual_stages,
    )  # fmt: skip


def _solve_dp(
    variants: Sequence[Variant], sub: Submesh, num_microbatches: int, virtual_stages: int = 1
) -> tuple[SolvedStage, ...] | None:
    """Alpa's stage DP with every stage on ``sub`` in one of ``variants`` (see the module
    docstring); with ``virtual_stages`` v, into v times the stages."""
    solver = variants[0].solver
    num_stages = virtual_stages * solver.cluster.num_devices // sub.num_devices

    def range_cost(i: int, j: int) -> list[StageCost | None]:
        return [v.cost(i, j) for v in variants]

    solution = partition(
        len(solver.layers), num_stages, num_microbatches, solver.memory_limit, range_cost,
        lambda j, a, b: solver.send_s(j), len(variants),
    )  # fmt: skip
    if solution is None:
        return None
    return tuple(
        variants[p.variant].solver.stage(p.start, p.stop, variants[p.variant].budget)
        for p in solution.stages
    )
