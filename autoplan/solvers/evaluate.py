"""Score a strategy assignment for an :class:`IntraOpProblem`, independently of any solver.

The solver's own objective value is never trusted: a plan's cost is what :func:`evaluate`
recomputes from the plain problem data, so a mistake in the ILP formulation or its
preprocessing shows up as a disagreement instead of a silently wrong number.

Costs are seconds per training step; memory is bytes per device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.solvers.problem import IntraOpProblem


@dataclass(frozen=True)
class Evaluation:
    """The cost and memory of one assignment, and every way it breaks the problem's rules.

    When ``choice`` has the wrong length or an out-of-range entry the costs and memory cannot be
    computed and are ``inf``; ``violations`` says why.
    """

    objective: float  # node + edge + shared + bucket + recompute costs, seconds
    node_cost: float
    edge_cost: float
    shared_cost: float
    bucket_cost: float
    memory: float  # bytes per device
    memory_limit: float
    feasible: bool
    violations: tuple[str, ...]
    recompute_cost: float = 0.0


def min_memory(problem: IntraOpProblem) -> float:
    """The least memory (bytes per device) that any assignment can use; where the problem
    chooses recomputation, a floor under it, exact for one way of recomputing one set of
    layers: nothing recomputed, or every layer recomputed the way that frees the most of each
    group, and what some recomputation ``r`` holds again (at its least for each group)."""
    kept = math.fsum(min(mem) for mem in problem.node_memory)
    if not problem.recompute:
        return kept
    frees = [[0.0] * len(mem) for mem in problem.node_memory]
    for unit in {r.unit for r in problem.recompute}:
        ways = [r for r in problem.recompute if r.unit == unit]
        for v, row in enumerate(frees):
            for k in range(len(row)):
                row[k] += max(r.freed[v][k] for r in ways)
    recomputed = min(
        math.fsum(
            min(m - f + h for m, f, h in zip(mem, row, r.held[v], strict=True))
            for v, (mem, row) in enumerate(zip(problem.node_memory, frees, strict=True))
        )
        for r in problem.recompute
    )
    return min(kept, recomputed)


def evaluate(
    problem: IntraOpProblem, choice: Sequence[int], recomputed: Sequence[int] = ()
) -> Evaluation:
    """Recompute cost and memory of ``choice`` (one strategy index per group), with
    ``recomputed`` copies recomputing each way (one count per `Recomputation` of the problem;
    none if empty), from scratch."""
    counts = tuple(recomputed) or (0,) * len(problem.recompute)
    violations = _structural_violations(problem, choice, counts)
    if violations:
        return Evaluation(
            objective=math.inf,
            node_cost=math.inf,
            edge_cost=math.inf,
            shared_cost=math.inf,
            bucket_cost=math.inf,
            memory=math.inf,
            memory_limit=problem.memory_limit,
            feasible=False,
            violations=violations,
        )
    node_cost = math.fsum(costs[k] for costs, k in zip(problem.node_costs, choice, strict=True))
    # For a self-edge (src == dst) choice[src] == choice[dst], so this picks the diagonal.
    edge_cost = math.fsum(e.cost[choice[e.src]][choice[e.dst]] for e in problem.edges)
    shared_cost = math.fsum(
        c.cost[choice[c.src]] for c in problem.shared if any(choice[g] == k for g, k in c.when)
    )
    bucket_cost = 0.0
    for b in problem.buckets:
        filled = [n for g, k, h, m, n in b.when if choice[g] == k and choice[h] == m]
        bucket_cost += b.cost * b.count(math.fsum(filled)) if filled else 0.0
    memory = math.fsum(mem[k] for mem, k in zip(problem.node_memory, choice, strict=True))
    recompute_cost, freed, held = 0.0, 0.0, 0.0
    for r, n in zip(problem.recompute, counts, strict=True):
        if n == 0:
            continue
        share = n / r.copies
        recompute_cost += share * math.fsum(t[k] for t, k in zip(r.time, choice, strict=True))
        freed += share * math.fsum(f[k] for f, k in zip(r.freed, choice, strict=True))
        held = max(held, math.fsum(h[k] for h, k in zip(r.held, choice, strict=True)))
    memory += held - freed
    if memory > problem.memory_limit:
        violations = (f"memory {memory:.1e} B exceeds limit {problem.memory_limit:.1e} B",)
    return Evaluation(
        objective=node_cost + edge_cost + shared_cost + bucket_cost + recompute_cost,
        node_cost=node_cost,
        edge_cost=edge_cost,
        shared_cost=shared_cost,
        bucket_cost=bucket_cost,
        memory=memory,
        memory_limit=problem.memory_limit,
        feasible=not violations,
        violations=violations,
        recompute_cost=recompute_cost,
    )


def _structural_violations(
    problem: IntraOpProblem, choice: Sequence[int], counts: Sequence[int]
) -> tuple[str, ...]:
    """Reasons ``choice`` and ``counts`` are not an assignment at all: wrong length, index
    out of range, more copies recomputed than a unit has."""
    if len(choice) != problem.num_groups:
        return (f"choice has {len(choice)} entries for {problem.num_groups} groups",)
    if len(counts) != len(problem.recompute):
        return (f"{len(counts)} recomputed counts for {len(problem.recompute)} recomputations",)
    violations = []
    for name, costs, k in zip(problem.names, problem.node_costs, choice, strict=True):
        if not 0 <= k < len(costs):
            violations.append(f"group {name!r} choice {k} out of range ({len(costs)} strategies)")
    units: dict[int, int] = {}
    for r, n in zip(problem.recompute, counts, strict=True):
        if not 0 <= n <= r.copies:
            violations.append(f"{r.name}: {n} copies recomputed of {r.copies}")
        units[r.unit] = units.get(r.unit, 0) + n
        if units[r.unit] > r.copies:
            violations.append(f"unit {r.unit}: {units[r.unit]} copies recomputed of {r.copies}")
    return tuple(violations)
