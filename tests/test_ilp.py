"""ILP strategy selection and evaluation on hand-built problems with hand-computed optima."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from autoplan.errors import AutoplanError, InfeasiblePlanError, SolverTimeLimitError
from autoplan.solvers import ilp
from autoplan.solvers.evaluate import evaluate, min_memory
from autoplan.solvers.ilp import (
    build_model,
    drop_zero_edges,
    fold_self_edges,
    fold_single_strategy_edges,
    group_labels,
    merge_parallel_edges,
    simplify,
    solve_intra_op,
)
from autoplan.solvers.linear import LinearSolution
from autoplan.solvers.link_classes import link_classes
from autoplan.solvers.problem import (
    BucketCost,
    Edge,
    IntraOpProblem,
    IntraOpSolution,
    Recomputation,
    SharedCost,
)

GIB = float(2**30)
SOLVERS = ["highs", "cbc"]

Costs = Sequence[Sequence[float]]


def make_problem(
    node_costs: Costs,
    edges: Sequence[tuple[int, int, Costs]] = (),
    *,
    memory_gib: Costs | None = None,
    limit_gib: float = math.inf,
    names: Sequence[str] | None = None,
) -> IntraOpProblem:
    """A problem from plain lists; memory defaults to 0 B for every strategy."""
    if memory_gib is None:
        memory_gib = [[0.0] * len(c) for c in node_costs]
    return IntraOpProblem(
        names=tuple(names or (f"g{v}" for v in range(len(node_costs)))),
        node_costs=tuple(tuple(float(x) for x in c) for c in node_costs),
        node_memory=tuple(tuple(x * GIB for x in m) for m in memory_gib),
        edges=tuple(
            Edge(u, v, tuple(tuple(float(x) for x in row) for row in cost)) for u, v, cost in edges
        ),
        memory_limit=limit_gib * GIB,
    )


def check_solution(
    problem: IntraOpProblem, solver: str, choice: tuple[int, ...], objective: float
) -> IntraOpSolution:
    """Solve and compare with the hand-computed optimum; evaluate() must agree."""
    solution = solve_intra_op(problem, solver=solver)
    assert solution.status == "optimal"
    assert solution.choice == choice
    assert solution.objective == pytest.approx(objective)
    evaluation = evaluate(problem, solution.choice)
    assert evaluation.feasible, evaluation.violations
    assert evaluation.objective == pytest.approx(solution.objective)
    return solution


# Strategy 0 mismatching strategy 1 across an edge costs a 10 s reshard.
RESHARD = [[0, 10], [10, 0]]


def chain_problem() -> IntraOpProblem:
    # Greedy per node: a0 (1) + b0 (1) + c1 (1) = 3, plus the b0->c1 reshard 10 = 13.
    # All 0: 1 + 1 + 4 = 6.  All 1: 2 + 2 + 1 = 5 (a and b take their locally worse strategy).
    # Mixed: (0,1,1) 1+2+1+10 = 14; (1,0,0) 2+1+4+10 = 17; every other mix pays >= 10.
    return make_problem([[1, 2], [1, 2], [4, 1]], [(0, 1, RESHARD), (1, 2, RESHARD)])


@pytest.mark.parametrize("solver", SOLVERS)
def test_chain_takes_locally_worse_strategy_to_avoid_reshard(solver: str) -> None:
    solution = check_solution(chain_problem(), solver, (1, 1, 1), 5.0)
    # 6 s variables + 2 edges x 4 e variables; 3 pick + 2 edges x (2 rows + 2 cols).
    assert (solution.num_variables, solution.num_constraints) == (14, 11)


def memory_problem(limit_gib: float) -> IntraOpProblem:
    # Strategy 0 replicates (fast, 4 GiB), strategy 1 shards (slow, 1 GiB); mismatch costs 1.
    mismatch = [[0, 1], [1, 0]]
    return make_problem(
        [[1, 2], [1, 2], [1, 1.5]],
        [(0, 1, mismatch), (1, 2, mismatch)],
        memory_gib=[[4, 1]] * 3,
        limit_gib=limit_gib,
    )


@pytest.mark.parametrize("solver", SOLVERS)
def test_memory_limit_forces_smaller_strategy(solver: str) -> None:
    # Unlimited: all replicated, 1 + 1 + 1 = 3 (12 GiB).
    check_solution(memory_problem(math.inf), solver, (0, 0, 0), 3.0)
    # 10 GiB: one group must shard (4 + 4 + 1 = 9 GiB).
    # Shard c: 1 + 1 + 1.5 + mismatch 1 = 4.5.  Shard a: 2 + 1 + 1 + 1 = 5.
    # Shard b: 1 + 2 + 1 + two mismatches 2 = 6.
    check_solution(memory_problem(10.0), solver, (0, 0, 1), 4.5)


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_plan_a_hair_over_the_memory_limit_is_not_taken(solver: str) -> None:
    # 9 GiB less 100 B: the plan of 9 GiB is over by 2e-8 of the row's largest coefficient,
    # within a solver's feasibility tolerance; the row's margin keeps it out
    problem = dataclasses.replace(memory_problem(10.0), memory_limit=9 * GIB - 100)
    solution = solve_intra_op(problem, solver=solver)
    assert solution.choice != (0, 0, 1)
    assert evaluate(problem, solution.choice).feasible


def test_infeasible_memory_limit_names_both_numbers() -> None:
    # The smallest plan shards everything: 3 x 1 GiB = 3 GiB > 2 GiB.
    problem = memory_problem(2.0)
    assert min_memory(problem) == 3 * GIB
    with pytest.raises(InfeasiblePlanError, match=r"2\.00 GiB.*3\.00 GiB"):
        solve_intra_op(problem)


def test_merge_parallel_edges_sums_and_transposes() -> None:
    problem = make_problem(
        [[1, 1], [1, 1]],
        [
            (0, 1, [[0, 3], [3, 1]]),
            (0, 1, [[2, 0], [0, 2]]),
            (1, 0, [[0, 1], [2, 0]]),  # rows are strategies of group 1: transposed onto (0, 1)
        ],
    )
    merged = merge_parallel_edges(problem)
    # [[0,3],[3,1]] + [[2,0],[0,2]] + [[0,2],[1,0]] = [[2,5],[4,3]]
    assert merged.edges == (Edge(0, 1, ((2.0, 5.0), (4.0, 3.0))),)
    # Node costs 1 + 1 = 2 everywhere, so the smallest merged entry wins: (0,0) = 2 + 2 = 4.
    # (1,1) = 5, (1,0) = 6, (0,1) = 7.
    for solver in SOLVERS:
        solution = check_solution(problem, solver, (0, 0), 4.0)
        # One merged edge: 4 s + 4 e variables.
        assert solution.num_variables == 8


def test_self_edge_adds_its_diagonal() -> None:
    # A repeated layer "l" feeds itself; only the diagonal 5, 0.5, 0 can occur (not the 100s).
    self_edge = [[5, 100, 100], [100, 0.5, 100], [100, 100, 0]]
    problem = make_problem(
        [[1, 2, 3], [1, 1]], [(0, 0, self_edge), (0, 1, [[0, 0], [0, 2], [0, 0]])]
    )
    folded = fold_self_edges(problem)
    assert folded.node_costs[0] == (6.0, 2.5, 3.0)
    assert [(e.src, e.dst) for e in folded.edges] == [(0, 1)]
    assert evaluate(problem, (1, 0)).edge_cost == 0.5
    # l costs 6, 2.5, 3 with the diagonal; l1 with b0 costs nothing on the edge:
    # (1,0) = 2.5 + 1 = 3.5; (2,*) = 3 + 1 = 4; (0,*) = 7; (1,1) = 2.5 + 1 + 2 = 5.5.
    for solver in SOLVERS:
        check_solution(problem, solver, (1, 0), 3.5)


def test_zero_edges_are_dropped() -> None:
    problem = make_problem([[1, 2], [2, 1]], [(0, 1, [[0, 0], [0, 0]]), (0, 1, RESHARD)])
    assert drop_zero_edges(problem).edges == (problem.edges[1],)
    assert simplify(make_problem([[1, 2], [2, 1]], [(0, 1, [[0, 0], [0, 0]])])).edges == ()


def single_strategy_problem(limit_gib: float = 11) -> IntraOpProblem:
    return make_problem(
        [[2], [1, 1, 2], [0.5]],
        [(0, 1, [[0, 7, 3]]), (1, 2, [[4], [0], [1]]), (0, 2, [[1]])],
        memory_gib=[[4], [3, 1, 2], [4]],
        limit_gib=limit_gib,
        names=["embed", "fc", "out"],
    )


def test_single_strategy_edges_fold_into_node_costs() -> None:
    folded = fold_single_strategy_edges(single_strategy_problem())
    assert folded.edges == ()
    # fc: (1, 1, 2) + embed row (0, 7, 3) + out column (4, 0, 1) = (5, 8, 6).
    # embed: 2 + the fixed-fixed edge embed->out 1 = 3 (folded into the source).
    assert folded.node_costs == ((3.0,), (5.0, 8.0, 6.0), (0.5,))


@pytest.mark.parametrize("solver", SOLVERS)
def test_single_strategy_groups_get_no_variables(solver: str) -> None:
    # fc0: 3 + 5 + 0.5 = 8.5; fc2: 3 + 6 + 0.5 = 9.5; fc1: 3 + 8 + 0.5 = 11.5.
    solution = check_solution(single_strategy_problem(), solver, (0, 0, 0), 8.5)
    # Only fc's 3 binaries; constraints pick_fc_1 and memory.
    assert (solution.num_variables, solution.num_constraints) == (3, 2)
    # The fixed groups still use 4 + 4 GiB: in 10 GiB fc0 (3 GiB) no longer fits, fc2 (2) does.
    check_solution(single_strategy_problem(limit_gib=10), solver, (0, 2, 0), 9.5)


def test_all_single_strategies_needs_no_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_solve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the solver must not run")

    monkeypatch.setattr(ilp, "_solve", no_solve)
    problem = make_problem([[2], [3]], [(0, 1, [[4]]), (1, 1, [[1]])], limit_gib=1)
    solution = solve_intra_op(problem)
    # 2 + 3 + edge 4 + self-edge 1 = 10.
    assert solution == IntraOpSolution((0, 0), 10.0, "optimal", solution.solve_time_s, 0, 0)


def test_names_are_sanitized_and_unique() -> None:
    names = ["layers.0.attn", "layers.0.attn", "  "]
    assert group_labels(tuple(names)) == ["layers_0_attn_0", "layers_0_attn_1", "group_2"]
    problem = make_problem([[1, 2]] * 3, [(0, 1, RESHARD)], limit_gib=1, names=names)
    model, variables = build_model(simplify(problem))
    constraint_names = set(model.row_names)
    assert {"pick_layers_0_attn_0", "pick_group_2", "memory"} <= constraint_names
    assert "row_layers_0_attn_0__layers_0_attn_1_1" in constraint_names
    assert [model.names[x] for x in variables.s[2]] == ["s_group_2_0", "s_group_2_1"]


def test_solution_is_deterministic() -> None:
    problem = random_problem(3)
    first, second = solve_intra_op(problem), solve_intra_op(problem)
    assert (first.choice, first.objective) == (second.choice, second.objective)


def test_status_time_limit_and_no_solution(caplog: pytest.LogCaptureFixture) -> None:
    problem = chain_problem()
    # CBC does not say how far from optimal it stopped
    incumbent = LinearSolution("stopped", (1.0,), None)
    with caplog.at_level(logging.WARNING, logger=ilp.__name__):
        assert ilp._status(incumbent, problem, 5.0) == ("time_limit", None)
    assert "time limit" in caplog.text and "gap unknown" in caplog.text
    # HiGHS does, as its info's mip_gap (a fraction)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ilp.__name__):
        assert ilp._status(LinearSolution("stopped", (1.0,), 0.031), problem, 5.0) == (
            "time_limit",
            0.031,
        )
    assert "gap <= 3.10%" in caplog.text
    assert ilp._status(LinearSolution("optimal", (1.0,)), problem, 5.0) == ("optimal", None)
    with pytest.raises(SolverTimeLimitError, match="time_limit_s=5"):
        ilp._status(LinearSolution("none", ()), problem, 5.0)


def long_chain(seed: int, num_groups: int) -> IntraOpProblem:
    """A chain of ``num_groups`` groups of 4 strategies with random extra edges, within 30% of
    the way from its least memory to its most: HiGHS's first plan of it is not its best."""
    rng = np.random.default_rng(seed)
    pairs = [(v, v + 1) for v in range(num_groups - 1)]
    pairs += [(int(u), int(v)) for u, v in rng.integers(0, num_groups, size=(num_groups, 2))]
    memory = rng.uniform(1, 4, size=(num_groups, 4)).round(2)
    least, most = memory.min(axis=1).sum(), memory.max(axis=1).sum()
    return make_problem(
        rng.uniform(0, 10, size=(num_groups, 4)).round(2).tolist(),
        [(u, v, rng.uniform(0, 10, size=(4, 4)).round(2).tolist()) for u, v in pairs if u < v],
        memory_gib=memory.tolist(),
        limit_gib=float(least + 0.3 * (most - least)),
    )


def _stopped_at_first_plan(run: Any) -> Any:
    """Highs.run (``run``), HiGHS stopped as soon as it has a plan: as a time limit stops
    it, but at the same point every run."""
    import highspy

    def stopped(highs: Any) -> Any:
        highs.setCallback(stop, None)
        highs.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
        return run(highs)

    return stopped


def stop(kind: object, message: str, out: Any, into: Any, user: object) -> None:
    """A HiGHS callback: interrupt once a plan is found."""
    if out.mip_primal_bound < math.inf:
        into.user_interrupt = True


def test_a_solve_stopped_with_a_plan_keeps_it_and_its_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    import highspy

    problem = long_chain(0, 20)
    best = solve_intra_op(problem)
    monkeypatch.setattr(highspy.Highs, "run", _stopped_at_first_plan(highspy.Highs.run))
    stopped = solve_intra_op(problem)
    assert stopped.status == "time_limit"
    assert evaluate(problem, stopped.choice).feasible
    assert stopped.gap is not None and stopped.gap > 0
    # the plan kept is at most its gap above the optimum, and no better than it
    assert best.objective < stopped.objective
    assert stopped.objective * (1 - stopped.gap) <= best.objective * (1 + 1e-9)
    assert best.status == "optimal" and best.gap is None


def test_a_solve_stopped_without_a_plan_raises() -> None:
    # HiGHS looks at the clock before it looks for a plan: at a limit of a nanosecond it
    # stops with none, every run
    with pytest.raises(SolverTimeLimitError, match=r"time_limit_s=1e-09.*raise the time limit"):
        solve_intra_op(long_chain(0, 20), time_limit_s=1e-9)


def test_highs_unavailable_falls_back_to_cbc(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ilp, "highs_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=ilp.__name__):
        check_solution(chain_problem(), "highs", (1, 1, 1), 5.0)
    assert "falling back to CBC" in caplog.text


@pytest.mark.parametrize("solver", SOLVERS)
def test_the_solvers_own_log_goes_to_the_debug_log_and_nowhere_else(
    solver: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    prefix = {"highs": "HiGHS: ", "cbc": "CBC: "}[solver]

    def solver_lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith(prefix)]

    with caplog.at_level(logging.INFO, logger=ilp.__name__):
        check_solution(chain_problem(), solver, (1, 1, 1), 5.0)
    assert not solver_lines()  # silent unless asked
    with caplog.at_level(logging.DEBUG, logger=ilp.__name__):
        check_solution(chain_problem(), solver, (1, 1, 1), 5.0)
    lines = solver_lines()
    assert len(lines) > 3 and {r.levelno for r in lines} == {logging.DEBUG}
    out, err = capfd.readouterr()  # what the process wrote, the solver's C code included
    assert (out, err) == ("", "")


def test_unknown_solver_is_rejected() -> None:
    with pytest.raises(AutoplanError, match="'gurobi'"):
        solve_intra_op(chain_problem(), solver="gurobi")


# ---------------------------------------------------------------- evaluate


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_shared_cost_is_paid_once_however_many_trigger_it(solver: str) -> None:
    # groups 1 and 2 reading group 0's tensor in placement 0 share one move: 5 s from group
    # 0's strategy 0, 1 s from its strategy 1 (which costs 2 s itself); reading it otherwise
    # costs each reader 3 s. Both read it, group 0 takes 1: 2 + 1 = 3 (not 2 + 1 + 1)
    shared = (SharedCost(0, (5.0, 1.0), ((1, 0), (2, 0))),)
    problem = dataclasses.replace(make_problem([[0, 2], [0, 3], [0, 3]]), shared=shared)
    check_solution(problem, solver, (1, 0, 0), 3.0)
    assert evaluate(problem, (0, 0, 0)).shared_cost == 5.0
    assert evaluate(problem, (0, 1, 1)).shared_cost == 0.0


@pytest.mark.parametrize("solver", SOLVERS)
def test_buckets_cost_one_each_past_the_first(solver: str) -> None:
    # 10 s a bucket; the first holds 4 bytes, each next 10. Group 0 at 0 with group 1 at 0
    # buckets 8 bytes (two buckets: 20 s), with group 1 at 1 only 2 (one: 10 s + 1 s of group
    # 1); group 0 at 1 buckets nothing but costs 15 s
    buckets = (BucketCost(10.0, 4.0, 10.0, ((0, 0, 1, 0, 8.0), (0, 0, 1, 1, 2.0))),)
    problem = dataclasses.replace(make_problem([[0, 15], [0, 1]]), buckets=buckets)
    check_solution(problem, solver, (0, 1), 11.0)
    assert [evaluate(problem, c).bucket_cost for c in all_choices(problem)] == [20, 10, 0, 0]
    assert buckets[0].count(4.0) == 1 and buckets[0].count(4.5) == 2
    assert buckets[0].count(24.0) == 3


def test_evaluate_costs_and_memory() -> None:
    problem = memory_problem(10.0)
    evaluation = evaluate(problem, (0, 1, 1))
    # Nodes 1 + 2 + 1.5; one mismatch (a0-b1) 1; memory 4 + 1 + 1 GiB.
    assert (evaluation.node_cost, evaluation.edge_cost) == (4.5, 1.0)
    assert evaluation.objective == 5.5
    assert evaluation.memory == 6 * GIB
    assert evaluation.feasible and evaluation.violations == ()


def test_evaluate_reports_violations() -> None:
    problem = make_problem([[1, 2], [1, 2, 3]], names=["fc1", "fc2"])
    out_of_range = evaluate(problem, (2, -1))
    assert not out_of_range.feasible
    assert out_of_range.violations == (
        "group 'fc1' choice 2 out of range (2 strategies)",
        "group 'fc2' choice -1 out of range (3 strategies)",
    )
    assert math.isinf(out_of_range.objective)
    assert evaluate(problem, (0,)).violations == ("choice has 1 entries for 2 groups",)

    tight = make_problem([[1, 2]] * 2, memory_gib=[[4, 1]] * 2, limit_gib=5)
    over = evaluate(tight, (0, 0))
    assert not over.feasible
    assert over.violations == ("memory 8.6e+09 B exceeds limit 5.4e+09 B",)
    assert over.objective == 2.0
    assert evaluate(tight, (0, 1)).feasible


# ---------------------------------------------------------------- brute force


def random_problem(seed: int, min_strategies: int = 2) -> IntraOpProblem:
    """5 groups, 2-4 strategies (1-4 with min_strategies=1); a chain of edges plus random extra
    ones, which may be parallel, reversed or self edges."""
    rng = np.random.default_rng(seed)
    sizes = [int(k) for k in rng.integers(min_strategies, 5, size=5)]
    pairs = [(v, v + 1) for v in range(4)]  # a chain, plus random extras
    pairs += [tuple(int(x) for x in rng.integers(0, 5, size=2)) for _ in range(rng.integers(2, 6))]
    edges = []
    for u, v in pairs:
        cost = rng.uniform(0, 10, size=(sizes[u], sizes[v])).round(2)
        if rng.random() < 0.1:
            cost[:] = 0
        edges.append((u, v, cost.tolist()))
    memory = [rng.uniform(1, 4, size=k).round(2).tolist() for k in sizes]
    least, most = sum(map(min, memory)), sum(map(max, memory))
    problem = make_problem(
        [rng.uniform(0, 10, size=k).round(2).tolist() for k in sizes],
        edges,
        memory_gib=memory,
        limit_gib=least + 0.4 * (most - least),
    )
    return dataclasses.replace(
        problem, shared=_random_shared(rng, sizes), buckets=_random_buckets(rng, sizes)
    )


def _random_choices(rng: np.random.Generator, sizes: list[int]) -> list[tuple[int, int]]:
    """A few (group, strategy) pairs, possibly of one group or of a one-strategy group."""
    groups = rng.integers(0, len(sizes), size=int(rng.integers(1, 4)))
    return [(int(g), int(rng.integers(0, sizes[g]))) for g in groups]


def _random_shared(rng: np.random.Generator, sizes: list[int]) -> tuple[SharedCost, ...]:
    """Shared costs, some of whose triggers include their own src."""
    found = []
    for _ in range(int(rng.integers(1, 4))):
        src = int(rng.integers(0, len(sizes)))
        cost = tuple(float(x) for x in rng.uniform(0, 10, size=sizes[src]).round(2))
        found.append(SharedCost(src, cost, tuple(_random_choices(rng, sizes))))
    return tuple(found)


def _random_buckets(rng: np.random.Generator, sizes: list[int]) -> tuple[BucketCost, ...]:
    """Bucket costs whose pairs fill 0 to 3 buckets of 10 bytes after a first of 4."""
    when = [
        (*a, *b, float(rng.integers(0, 12)))
        for a, b in zip(_random_choices(rng, sizes), _random_choices(rng, sizes), strict=False)
        if a[0] != b[0] or a[1] == b[1]
    ]
    cost = round(float(rng.uniform(1, 5)), 2)
    return (BucketCost(cost, 4.0, 10.0, tuple(when)),) if when else ()


def all_choices(problem: IntraOpProblem) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(len(c)) for c in problem.node_costs)))


def assert_solves_to_brute_force(problem: IntraOpProblem) -> None:
    """Every solver's plan is feasible and as cheap as the best of every assignment."""
    evaluations = [evaluate(problem, c) for c in all_choices(problem)]
    best = min(e.objective for e in evaluations if e.feasible)
    for solver in SOLVERS:
        solution = solve_intra_op(problem, solver=solver)
        assert solution.status == "optimal"
        assert evaluate(problem, solution.choice).feasible
        assert solution.objective == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize(("seed", "min_strategies"), [(s, 2) for s in range(8)] + [(8, 1), (9, 1)])
def test_random_problems_match_brute_force(seed: int, min_strategies: int) -> None:
    problem = random_problem(seed, min_strategies)
    assert_solves_to_brute_force(problem)


def placed_problem(seed: int) -> IntraOpProblem:
    """`random_problem`'s shape with resharding costs as placements make them: each strategy
    of a group has one of 2-3 placements (an op's strategies sharing an output placement),
    and an edge's cost depends on the two placements alone, so rows and columns repeat."""
    rng = np.random.default_rng(100 + seed)
    problem = random_problem(seed)
    sizes = [len(c) for c in problem.node_costs]
    placement = [rng.integers(0, int(rng.integers(2, 4)), size=k) for k in sizes]
    edges = []
    for edge in problem.edges:
        by_placement = rng.uniform(0, 10, size=(3, 3)).round(2)
        cost = [[by_placement[a, b] for b in placement[edge.dst]] for a in placement[edge.src]]
        edges.append(Edge(edge.src, edge.dst, tuple(tuple(map(float, r)) for r in cost)))
    return dataclasses.replace(problem, edges=tuple(edges))


@pytest.mark.parametrize("seed", range(8))
def test_columns_shared_by_strategies_of_one_placement_keep_the_optimum(seed: int) -> None:
    problem = placed_problem(seed)
    reduced = simplify(problem)
    s = {v: list(range(len(c))) for v, c in enumerate(reduced.node_costs) if len(c) > 1}
    classes = link_classes(reduced, ilp._linked_pairs(reduced, s))
    per_strategy = sum(len(reduced.node_costs[u]) * len(reduced.node_costs[v]) for u, v in classes)
    per_class = sum((max(rows) + 1) * (max(cols) + 1) for rows, cols in classes.values())
    assert per_class < per_strategy
    assert_solves_to_brute_force(problem)


@pytest.mark.parametrize("seed", range(4))
def test_simplify_keeps_every_assignment_cost(seed: int) -> None:
    problem = random_problem(seed, min_strategies=1)
    simplified = simplify(problem)
    for edge in simplified.edges:
        assert edge.src < edge.dst
        assert len(problem.node_costs[edge.src]) > 1 and len(problem.node_costs[edge.dst]) > 1
    for choice in all_choices(problem):
        before, after = evaluate(problem, choice), evaluate(simplified, choice)
        assert after.objective == pytest.approx(before.objective)
        assert after.memory == before.memory


# ---------------------------------------------------------------- recomputation chosen


def _random_recomputations(
    rng: np.random.Generator, problem: IntraOpProblem
) -> tuple[Recomputation, ...]:
    """Two units: one of 3 copies that may recompute two ways (over groups 0-2), one of a
    single copy (over groups 2-4, group 2 in both, as a follower merged across layers is)."""
    sizes = [len(c) for c in problem.node_costs]

    def way(name: str, unit: int, copies: int, groups: range) -> Recomputation:
        time = [rng.uniform(0, 3, size=k).round(2) * (g in groups) for g, k in enumerate(sizes)]
        freed = [
            [min(m, x) for m, x in zip(mem, rng.uniform(0, 3, size=len(mem)) * GIB, strict=True)]
            if g in groups
            else [0.0] * len(mem)
            for g, mem in enumerate(problem.node_memory)
        ]
        frozen = [tuple(tuple(float(x) for x in row) for row in rows) for rows in (time, freed)]
        held = tuple(tuple(f / copies for f in row) for row in frozen[1])
        return Recomputation(name, unit, copies, *frozen, held)

    return (
        way("full", 0, 3, range(0, 3)),
        way("selective", 0, 3, range(0, 3)),
        way("single", 1, 1, range(2, 5)),
    )


def all_counts(problem: IntraOpProblem) -> list[tuple[int, ...]]:
    return [
        counts
        for counts in itertools.product(*(range(r.copies + 1) for r in problem.recompute))
        if counts[0] + counts[1] <= problem.recompute[0].copies
    ]


@pytest.mark.parametrize("seed", range(6))
def test_recomputation_chosen_with_strategies_matches_brute_force(seed: int) -> None:
    """The ILP chooses how many copies recompute each way jointly with the strategies: its
    plan is the cheapest of every strategy choice x recomputed counts that fits, counting
    the largest recomputed copy's activations held again during its backward."""
    rng = np.random.default_rng(100 + seed)
    base = random_problem(seed, min_strategies=1)
    # a tighter limit than random_problem's: recomputing is what makes some plans fit
    problem = dataclasses.replace(
        base,
        recompute=_random_recomputations(rng, base),
        memory_limit=min_memory(base) * 0.9,
    )
    evaluations = [
        (evaluate(problem, c, n), c, n) for c in all_choices(problem) for n in all_counts(problem)
    ]
    feasible = [e for e in evaluations if e[0].feasible]
    assert feasible, "the test's limit should leave some plan"
    best = min(e.objective for e, _, _ in feasible)
    for solver in SOLVERS:
        solution = solve_intra_op(problem, solver=solver)
        assert solution.status == "optimal"
        check = evaluate(problem, solution.choice, solution.recomputed)
        assert check.feasible
        assert solution.objective == pytest.approx(best, rel=1e-6)
        assert any(solution.recomputed), "nothing fits without recomputing"
    # min_memory is a floor; just under the least memory of any plan, none is found
    least = min(e.memory for e, _, _ in evaluations)
    assert min_memory(problem) <= least
    with pytest.raises(InfeasiblePlanError):
        solve_intra_op(dataclasses.replace(problem, memory_limit=least * (1 - 1e-6)))


def test_recomputation_is_chosen_only_where_it_pays() -> None:
    """One layer repeated 4 times: a fast strategy (1 s, 10 GiB of activations) or a slow one
    (3 s, 4 GiB); recomputing a copy costs 0.5 s (fast) or 0.25 s (slow) and frees its
    activations, but the step holds one recomputed copy's again during its backward."""
    time = ((2.0, 1.0),)
    freed = ((8.0 * GIB, 2.0 * GIB),)  # of all 4 copies
    held = ((2.0 * GIB, 0.5 * GIB),)  # one copy's
    way = Recomputation("blocks full", 0, 4, time, freed, held)
    cases = {
        # limit: (strategy, copies recomputed, objective)
        11.0: (0, 0, 1.0),  # fits without
        # fast: 10 - 2n + 2 <= 8 -> n = 2 (2 s); slow fits without (3 s)
        8.0: (0, 2, 2.0),
        # fast needs 4 GiB at best (all recomputed: 10 - 8 + 2); slow: 4 - 0.5n + 0.5 -> n = 2
        3.9: (1, 2, 3.5),
    }
    for limit, (k, n, objective) in cases.items():
        problem = make_problem([[1.0, 3.0]], memory_gib=[[10.0, 4.0]], limit_gib=limit)
        problem = dataclasses.replace(problem, recompute=(way,))
        for solver in SOLVERS:
            solution = solve_intra_op(problem, solver=solver)
            assert (solution.choice, solution.recomputed) == ((k,), (n,)), (limit, solver)
            assert solution.objective == pytest.approx(objective)
    # every copy recomputed would need 2 GiB but for the copy held again: 2.5 at best
    assert min_memory(problem) == 2.5 * GIB
    too_tight = dataclasses.replace(problem, memory_limit=2.2 * GIB)
    with pytest.raises(InfeasiblePlanError, match=r"the smallest needs 2\.50 GiB"):
        solve_intra_op(too_tight)
