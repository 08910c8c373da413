"""Dominated strategies dropped before the ILP (`autoplan.solvers.dominance`): on random
problems with shared costs, buckets and recomputation, a strategy worse than another in every
part goes, and the best plan, found by brute force, is the same with and without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autoplan.solvers.dominance import drop_dominated, restrict
from autoplan.solvers.evaluate import evaluate
from autoplan.solvers.ilp import solve_intra_op
from autoplan.solvers.problem import Edge, IntraOpProblem, SharedCost
from tests.test_ilp import (
    _random_recomputations,
    all_choices,
    all_counts,
    make_problem,
    random_problem,
)


def with_copy(
    problem: IntraOpProblem, v: int, k: int, extra: float, memory: float = 0.0
) -> IntraOpProblem:
    """Group ``v`` gets one more strategy: ``k``'s, with ``extra`` more time in each of its
    costs (and ``memory`` more bytes), triggering what ``k`` triggers."""
    new = len(problem.node_costs[v])

    def grow(values: tuple[float, ...], g: int, more: float = extra) -> tuple[float, ...]:
        return (*values, values[k] + more) if g == v else values

    def edge(e: Edge) -> Edge:
        rows = (*e.cost, tuple(x + extra for x in e.cost[k])) if e.src == v else e.cost
        return Edge(e.src, e.dst, tuple(grow(row, e.dst) for row in rows))

    def triggers(when: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        return (*when, (v, new)) if (v, k) in when else when

    def fills(b_when: tuple[tuple[int, int, int, int, float], ...]) -> tuple:
        copies = []
        for g, a, h, b, nbytes in b_when:
            if (g, a) == (v, k) or (h, b) == (v, k):
                copies.append(
                    (g, new if (g, a) == (v, k) else a, h, new if (h, b) == (v, k) else b, nbytes)
                )
        return b_when + tuple(copies)

    return dataclasses.replace(
        problem,
        node_costs=tuple(grow(c, g) for g, c in enumerate(problem.node_costs)),
        node_memory=tuple(grow(m, g, memory) for g, m in enumerate(problem.node_memory)),
        edges=tuple(edge(e) for e in problem.edges),
        shared=tuple(
            SharedCost(t.src, grow(t.cost, t.src), triggers(t.when)) for t in problem.shared
        ),
        buckets=tuple(dataclasses.replace(b, when=fills(b.when)) for b in problem.buckets),
        recompute=tuple(
            dataclasses.replace(
                r,
                time=tuple(grow(x, g) for g, x in enumerate(r.time)),
                freed=tuple(grow(x, g, 0.0) for g, x in enumerate(r.freed)),
                held=tuple(grow(x, g, 0.0) for g, x in enumerate(r.held)),
            )
            for r in problem.recompute
        ),
    )


def problem_with_copies(seed: int, extra: float, memory: float = 0.0) -> IntraOpProblem:
    rng = np.random.default_rng(200 + seed)
    base = random_problem(seed, min_strategies=2)
    base = dataclasses.replace(base, recompute=_random_recomputations(rng, base))
    return with_copy(with_copy(base, 0, 1, extra, memory), 3, 0, extra, memory)


def best(problem: IntraOpProblem) -> float:
    return min(
        e.objective
        for c in all_choices(problem)
        for n in all_counts(problem)
        if (e := evaluate(problem, c, n)).feasible
    )


@pytest.mark.parametrize("seed", range(4))
def test_a_strategy_worse_in_every_part_is_dropped_and_the_best_plan_stays(seed: int) -> None:
    problem = problem_with_copies(seed, extra=0.5)
    reduced, kept = drop_dominated(problem)
    assert kept[0][-1] != len(problem.node_costs[0]) - 1, "group 0's worse copy stays"
    assert kept[3][-1] != len(problem.node_costs[3]) - 1, "group 3's worse copy stays"
    assert best(reduced) == pytest.approx(best(problem))
    assert solve_intra_op(problem).objective == pytest.approx(best(problem), rel=1e-6)


@pytest.mark.parametrize("seed", range(2))
def test_a_restricted_problem_costs_each_assignment_as_the_original(seed: int) -> None:
    problem = problem_with_copies(seed, extra=0.5)
    kept = tuple(ks[::2] for ks in (tuple(range(len(c))) for c in problem.node_costs))
    reduced = restrict(problem, kept)
    for choice in all_choices(reduced):
        original = tuple(kept[v][k] for v, k in enumerate(choice))
        for counts in all_counts(problem):
            mine, theirs = evaluate(reduced, choice, counts), evaluate(problem, original, counts)
            assert mine.objective == pytest.approx(theirs.objective)
            assert mine.memory == pytest.approx(theirs.memory)


def test_of_equal_strategies_the_first_stays() -> None:
    problem = problem_with_copies(0, extra=0.0)
    _, kept = drop_dominated(problem)
    assert 1 in kept[0] and len(problem.node_costs[0]) - 1 not in kept[0]


def test_a_faster_but_bigger_strategy_stays() -> None:
    problem = problem_with_copies(1, extra=-0.01, memory=2**20)
    _, kept = drop_dominated(problem)
    assert len(problem.node_costs[0]) - 1 in kept[0]


def test_a_strategy_that_triggers_more_shared_costs_goes() -> None:
    # group 0's strategies cost alike, but its strategy 1 triggers the shared cost of group 1
    problem = dataclasses.replace(
        make_problem([[1.0, 1.0], [2.0, 3.0]]),
        shared=(SharedCost(1, (4.0, 4.0), ((0, 1),)),),
    )
    _, kept = drop_dominated(problem)
    assert kept == ((0,), (0,))
