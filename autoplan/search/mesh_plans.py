"""One logical mesh's plan: its strategies, its ILP (`search.intra_op`) solved and decoded,
and the plan priced again from its assignment, node by node (`costmodel.step_price`).

The ILP's memory is a sum of the ops' memory (`Pricer.node_memory`); the step's price is the
peak as autograd holds it (`costmodel.peak`), which also holds the saved inputs an op reads
moved (copies of their own: a grouped matmul's experts gathered whole, say) and counts
recomputed layers exactly. Where the ILP's plan is priced over the limit, the mesh is solved
once more within the limit less what the ILP did not see of that plan; a plan still over
it is no proof that none fits (`Overshot`), so the planner keeps the mesh's conventional
plans in the running (`autoplan.api`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import PricedStep, price_step
from autoplan.errors import InfeasiblePlanError
from autoplan.graph.blocks import BlockSharing
from autoplan.graph.ir import Graph
from autoplan.phases import timed
from autoplan.search.intra_op import IntraOpResult, build_problem, solve_problem
from autoplan.search.recompute_ilp import RecomputeChoice
from autoplan.solvers.evaluate import evaluate, min_memory
from autoplan.solvers.problem import lower_bound
from autoplan.strategies.float32_grads import searched_in_float32
from autoplan.strategies.space import NodeStrategies, searched, strategy_space
from autoplan.units import fmt_bytes

log = logging.getLogger(__name__)


SpaceFilter = Callable[[dict[str, NodeStrategies]], dict[str, NodeStrategies]]


@dataclass(frozen=True)
class Slower:
    """A mesh left unsolved: no plan on it is faster than ``bound_s`` a step by its ILP
    (its optimum without the memory limit or recomputation, or that solve's bound)."""

    bound_s: float


@dataclass(frozen=True)
class MeshPlan:
    """The solved plan of a graph on one logical mesh."""

    result: IntraOpResult
    pricer: Pricer
    step: PricedStep
    rules: dict[str, str]  # node -> where its strategy came from


@dataclass(frozen=True)
class Overshot:
    """A mesh whose ILP's plans, within its memory limit by the ILP's sum, are priced at
    ``peak_bytes`` per device, over it: no proof that no plan of the mesh fits."""

    peak_bytes: float


def solve_mesh(
    graph: Graph,
    layers: BlockSharing,
    pricer: Pricer,
    memory_limit: float,
    time_limit_s: float,
    restrict: SpaceFilter | None = None,
    once: float = 1.0,
    float32_grads: bool = False,
    in_flight: float = 1.0,
    recompute: RecomputeChoice | None = None,
    relaxed_first: bool = True,
    slower_than: float = math.inf,
) -> MeshPlan | float | Slower | Overshot:
    """Plan ``graph`` on ``pricer.mesh_shape``; ``restrict`` narrows the candidates (pins),
    ``once`` weighs the once-per-step work and ``in_flight`` the activations' memory
    (`build_problem`), ``float32_grads`` has every gradient reduced in float32
    (`searched_in_float32`), ``recompute`` lets the ILP choose which layers recompute (the
    plan's `MeshPlan.pricer` then recompute those). Returns the least memory any plan would
    need per device when none fits (where recomputation is chosen, at least that: just over
    ``memory_limit`` when only the activations a recomputed layer holds again during its
    backward keep it from fitting). Where the ILP's plan fits by its summed memory but not by
    the peak `price_step` prices, it is solved again within the limit less the bytes the ILP
    did not see of that plan; `Overshot` where that plan is over the limit too. Raises
    `SolverTimeLimitError` where an ILP found no plan within ``time_limit_s`` (a plan found
    by then is kept, its solution saying so).

    Where the ILP chooses recomputation it is first solved without recomputing or a memory
    limit (``relaxed_first``; a caller that knows that plan does not fit says False): if
    that plan fits, no plan is faster, since recomputing only adds time; the ILP with the
    limit and recomputation, several times slower, is then not needed. Where it does not
    fit, its objective bounds every plan's from below: above ``slower_than`` (s a step) the
    mesh is left there (`Slower`); with a ``slower_than``, it is solved for that bound even
    where no plan without recomputation could fit."""
    within, peak = memory_limit, math.inf
    for again in (False, True):
        found = _solved(
            graph, layers, pricer, within, time_limit_s, restrict, once, float32_grads,
            in_flight, recompute, relaxed_first and not again, slower_than,
        )  # fmt: skip
        if not isinstance(found, MeshPlan):
            return Overshot(peak) if again else found
        peak = found.step.peak_bytes
        if peak <= memory_limit:
            problem = replace(found.result.problem, memory_limit=memory_limit)
            return replace(found, result=replace(found.result, problem=problem))
        solution = found.result.solution
        unseen = peak - evaluate(found.result.problem, solution.choice, solution.recomputed).memory
        log.info(
            "mesh %s: the ILP's plan is priced at %s per device, over the limit of %s (%s "
            "the ILP does not see)%s", pricer.mesh_shape, fmt_bytes(peak),
            fmt_bytes(memory_limit), fmt_bytes(unseen), "" if again else "; solved again",
        )  # fmt: skip
        within -= unseen
    return Overshot(peak)


def _solved(
    graph: Graph,
    layers: BlockSharing,
    pricer: Pricer,
    memory_limit: float,
    time_limit_s: float,
    restrict: SpaceFilter | None,
    once: float,
    float32_grads: bool,
    in_flight: float,
    recompute: RecomputeChoice | None,
    relaxed_first: bool,
    slower_than: float,
) -> MeshPlan | float | Slower:
    """`solve_mesh`'s plan within ``memory_limit`` by the ILP's memory, priced, its peak
    unchecked."""
    reps = {n.name for n in graph if n.name not in layers.canonical}
    with timed("strategies"):
        space = strategy_space(graph, pricer.mesh_shape, reps)
    if float32_grads:
        space = searched_in_float32(space, graph, pricer.mesh_shape)
    if restrict is not None:
        space = restrict(space)
    space = searched(space, graph, pricer.mesh_shape)
    with timed("ILP build"):
        problem, grouping = build_problem(
            graph, layers, space, pricer, memory_limit, once, in_flight
        )
    mesh = pricer.mesh_shape
    result = None
    # solved for its bound alone where it cannot fit, if that bound may leave the mesh
    fits = min_memory(problem) <= memory_limit
    if recompute is not None and relaxed_first and (fits or slower_than < math.inf):
        relaxed = replace(problem, memory_limit=math.inf)
        found = solve_problem(graph, layers, space, relaxed, grouping, mesh, time_limit_s)
        if fits and evaluate(problem, found.solution.choice).memory <= memory_limit:
            result = replace(found, problem=problem)
        elif lower_bound(found.solution) > slower_than:
            return Slower(lower_bound(found.solution))
    if recompute is not None and result is None:
        ways = recompute.recomputations(problem, graph, layers, space, grouping, pricer, in_flight)
        problem = replace(problem, recompute=ways)
    need = min_memory(problem)
    if need > memory_limit:
        return need
    if result is None:
        try:
            result = solve_problem(graph, layers, space, problem, grouping, mesh, time_limit_s)
        except InfeasiblePlanError:
            assert problem.recompute, "min_memory is exact without recomputation"
            return math.nextafter(memory_limit, math.inf)
    if problem.recompute:
        assert recompute is not None
        counts = result.solution.recomputed
        pricer = pricer.recomputing(recompute.chosen(graph, layers, problem.recompute, counts))
    rules = {n.name: space[layers.rep(n.name)].source for n in graph}
    with timed("pricing"):
        step = price_step(graph, result.assignment, pricer)
    return MeshPlan(result, pricer, step, rules)
