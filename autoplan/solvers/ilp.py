"""Intra-operator strategy selection as an integer linear program (Alpa's formulation).

Notation: group ``v`` has strategies ``k`` with node cost ``c[v][k]`` (seconds per step) and
memory ``m[v][k]`` (bytes per device); edge ``(u, v)`` has resharding costs ``R[u,v][i][j]``;
``M`` is the memory limit.

Preprocessing (:func:`simplify`) shrinks the problem first. Each step keeps the cost of every
assignment unchanged, so :func:`~autoplan.solvers.evaluate.evaluate` gives the same objective on
the original and on the simplified problem (`autoplan.solvers.dominance` then drops the
strategies that others dominate, and the problem is simplified again):

- :func:`fold_self_edges`: an edge with ``u == v`` only ever costs ``R[v,v][k][k]``; that
  diagonal is added to ``c[v][k]``.
- :func:`merge_parallel_edges`: edges between the same two groups are summed into one edge
  ``(u, v)`` with ``u < v`` (an edge ``(v, u)`` is transposed first).
- :func:`drop_zero_edges`: an edge whose matrix is all zeros is dropped.
- :func:`fold_single_strategy_edges`: an edge with a one-strategy end is folded into the other
  end's node costs (``R[u,v][i][0]`` into ``c[u][i]``, or ``R[u,v][0][j]`` into ``c[v][j]``).
- :func:`fold_certain_shared`: a shared cost ``C[t]`` (paid as ``C[t][i]`` when its group
  ``src(t)`` takes ``i`` and any ``(g, k)`` of ``when(t)`` is chosen) that a one-strategy group
  triggers is always paid: it is added to ``c[src(t)]``. Shared costs that are zero or that
  nothing triggers are dropped, and those with the same ``src`` and ``when`` summed.

Groups with one strategy are then fixed to it and get no variable; what remains goes to the ILP
built by :func:`build_model`:

Variables
    ``s[v][k]`` in {0, 1}: group ``v`` takes strategy ``k`` (groups with 2+ strategies only).
    ``e[u,v][i][j]`` in [0, 1], continuous: groups ``u`` and ``v`` take strategies ``(i, j)``;
    for each pair of groups an edge, a shared cost or a bucket cost relates.
    ``y[t][i]`` in [0, 1], continuous: shared cost ``t`` is paid with ``src(t)`` at ``i`` (for
    each ``i`` with ``C[t][i] != 0``).
    ``x[b]`` in [0, 1], continuous, and ``n[b]`` >= 0: bucket cost ``b`` (``B[b]`` seconds a
    bucket) pays its first bucket, and so many more.
    For each recomputation ``r`` (`Recomputation`: ``C[r]`` copies, extra time ``t[r][v][k]``
    and freed bytes ``f[r][v][k]`` of all copies, ``h[r][v][k]`` held again): ``count[r]``
    in 0..C[r], integer, the copies recomputed; ``some[r]`` in {0, 1}, whether any is;
    ``w[r][v][k]`` in [0, 1], continuous, standing for
    ``count[r] / C[r] * s[v][k]``; ``z[r][v][k]`` in [0, 1], continuous, for
    ``some[r] * s[v][k]``; and one ``T`` >= 0, the bytes the largest recomputed copy holds
    again during its backward.

Objective (minimize, :func:`_set_objective`)
    ``sum_v sum_k c[v][k] s[v][k] + sum_(u,v) sum_(i,j) R[u,v][i][j] e[u,v][i][j]
    + sum_t sum_i C[t][i] y[t][i] + sum_b B[b] (x[b] + n[b]) + sum_r sum_v sum_k t[r][v][k]
    w[r][v][k]``, divided by its largest
    coefficient so that solver tolerances are relative to the costs (which are seconds, often
    1e-6 or smaller).

Constraints
    ``pick_<v>``: ``sum_k s[v][k] == 1`` (:func:`_add_node_variables`).
    ``row_<u>__<v>_<i>``: ``sum_j e[u,v][i][j] == s[u][i]`` and
    ``col_<u>__<v>_<j>``: ``sum_i e[u,v][i][j] == s[v][j]`` (:func:`_add_link_variables`).
    With ``s`` integral these force ``e[u,v][i][j] == s[u][i] * s[v][j]``: every row and column
    but the chosen ones sum to zero. Its LP relaxation is much tighter, and the ILP much faster
    to solve, than with the three-inequality linearization of a product. Below, ``e`` of a
    group with one strategy stands for the other group's ``s``, and of one group with itself
    for its ``s`` on the diagonal.
    ``shared_<t>_<i>_<g>``: ``y[t][i] >= sum_(k: (g, k) in when(t)) e[src(t),g][i][k]`` for
    each group ``g`` of ``when(t)``: with costs >= 0, ``y[t][i]`` is 1 exactly when ``src(t)``
    takes ``i`` and some trigger is chosen (:func:`_add_shared_variables`).
    ``any_<b>_<g>_<h>``: ``x[b] >= sum_((k, l): (g, k, h, l, _) in when(b)) e[g,h][k][l]``
    for each pair of groups in ``when(b)``, and ``more_<b>``: ``n[b] >= (sum_(g, k, h, l, z)
    z e[g,h][k][l] - first(b) x[b]) / capacity(b)``: with costs >= 0 these are the bucket
    count of `BucketCost.count` (:func:`_add_bucket_variables`; one whose pairs are all of
    one-strategy groups is a constant and left out). ``n[b]`` is integer unless ``whole(b)``
    is false (then the count past the first bucket is not rounded up; ``evaluate`` still
    counts it whole).
    ``share_w_<v>_<r>``: ``C[r] sum_k w[r][v][k] == count[r]`` and
    ``within_w_<v>_<r>_<k>``: ``w[r][v][k] <= s[v][k]``: with ``s`` integral, ``w`` is
    ``count[r] / C[r]`` at the chosen strategy and 0 elsewhere (`_times_choice`, as tight as
    the edges' products). ``counted_<r>``: ``count[r] <= C[r] some[r]``; ``z`` from
    ``some[r]`` as ``w`` from the count (``z`` is ``w`` where ``C[r] = 1``, ``some`` the
    count); ``largest_<r>``: ``T >= sum_v sum_k h[r][v][k] z[r][v][k]`` (the memory row
    pushes ``some`` and ``T`` down); ``unit_<u>``: the counts of one unit's recomputations
    add up to at most its copies (:func:`_add_recompute_variables`; a group with one
    strategy enters as a constant times ``count[r]`` or ``some[r]``).
    ``memory``: ``sum_v sum_k m[v][k] s[v][k] - sum_r sum_v sum_k f[r][v][k] w[r][v][k] + T
    <= M - (memory of fixed groups)``, divided by the largest ``m`` or ``f`` so the
    coefficients are at most 1 whatever the unit
    (:func:`_add_memory_constraint`; omitted when ``M`` is infinite). Where the plan found
    is over ``M`` within the solver's tolerance, it is solved again with the bound lowered
    by `MEMORY_MARGIN`.

The returned objective is recomputed by ``evaluate`` on the original problem, never taken from
the solver. A solve stopped at its time limit with a plan returns it, status "time_limit", with
the solver's relative gap (`_status`; HiGHS says it, CBC does not); one stopped with none raises
`SolverTimeLimitError`, which a caller searching several meshes or layers skips past. The
solver's own log goes to this module's logger at debug level and nowhere else (`_solve`): a
plan's output carries no solver text.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, replace

from autoplan.errors import AutoplanError, InfeasiblePlanError, SolverTimeLimitError
from autoplan.solvers.dominance import drop_dominated
from autoplan.solvers.evaluate import evaluate, min_memory
from autoplan.solvers.linear import (
    INF,
    ONE,
    LinearProgram,
    LinearSolution,
    Term,
    solve_with_cbc,
    solve_with_highs,
)
from autoplan.solvers.link_classes import link_classes
from autoplan.solvers.problem import Edge, IntraOpProblem, IntraOpSolution, SharedCost, gap_text
from autoplan.units import fmt_bytes

logger = logging.getLogger(__name__)

# HiGHS stops at a 1e-4 relative gap by default; plans should be optimal, not merely close.
MIP_REL_GAP = 1e-6
SOLVERS = ("highs", "cbc")
# where the solver's plan is over the memory limit within its feasibility tolerance (a plan
# some bytes over a tight limit failed the check after the solve: eager GPT on 140 MiB), it is
# solved again with the memory row's bound lowered by this (in its largest coefficient's units)
MEMORY_MARGIN = 1e-5

Matrix = tuple[tuple[float, ...], ...]


def solve_intra_op(
    problem: IntraOpProblem, *, time_limit_s: float = 60.0, solver: str = "highs"
) -> IntraOpSolution:
    """Choose one strategy per group minimizing node + edge cost within the memory limit.

    Raises :class:`InfeasiblePlanError` when no assignment fits in ``problem.memory_limit``.
    """
    if solver not in SOLVERS:
        raise AutoplanError(f"unknown ILP solver {solver!r}; use one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    if min_memory(problem) > problem.memory_limit:
        raise _infeasible_error(problem)
    undominated, kept = drop_dominated(simplify(problem))
    reduced = simplify(undominated)
    if all(len(costs) == 1 for costs in reduced.node_costs) and not problem.recompute:
        logger.debug("ILP: every group has a single strategy; no solver needed")
        return _solution(problem, tuple(k[0] for k in kept), (), "optimal", start, 0, 0)

    for margin in (0.0, MEMORY_MARGIN):
        model, variables = build_model(reduced, margin)
        num_variables, num_constraints = model.num_columns, model.num_rows
        logger.debug(
            "ILP: %d groups (%d free), %d edges (%d after simplify): %d variables, %d constraints",
            problem.num_groups,
            len(variables.s),
            len(problem.edges),
            len(reduced.edges),
            num_variables,
            num_constraints,
        )
        solved = _solve(model, solver, time_limit_s)
        status, gap = _status(solved, problem, time_limit_s)
        chosen = _extract_choice(reduced, variables, solved.values)
        choice = tuple(kept[v][k] for v, k in enumerate(chosen))
        recomputed = tuple(round(solved.values[n]) for n in variables.n)
        if evaluate(problem, choice, recomputed).memory <= problem.memory_limit:
            break
        # the solver took a plan over the limit by no more than its feasibility tolerance
        # (HiGHS: 1e-6 of the row's largest coefficient): once more, the row's bound lowered
        logger.debug("ILP: the plan found is over the memory limit; solving again with a margin")
    return _solution(
        problem, choice, recomputed, status, start, num_variables, num_constraints, gap
    )


# ---------------------------------------------------------------- preprocessing


def simplify(problem: IntraOpProblem) -> IntraOpProblem:
    """Apply every preprocessing step; the cost of each assignment is unchanged."""
    merged = merge_parallel_edges(fold_self_edges(problem))
    return fold_certain_shared(fold_single_strategy_edges(drop_zero_edges(merged)))


def fold_self_edges(problem: IntraOpProblem) -> IntraOpProblem:
    """Add the diagonal of each edge with ``src == dst`` to that group's node costs."""
    costs = [list(c) for c in problem.node_costs]
    kept = []
    for edge in problem.edges:
        if edge.src == edge.dst:
            for k, row in enumerate(edge.cost):
                costs[edge.src][k] += row[k]
        else:
            kept.append(edge)
    return replace(problem, node_costs=_freeze(costs), edges=tuple(kept))


def merge_parallel_edges(problem: IntraOpProblem) -> IntraOpProblem:
    """Sum edges between the same two groups into one edge ``(u, v)`` with ``u <= v``."""
    merged: dict[tuple[int, int], list[list[float]]] = {}
    for edge in problem.edges:
        if edge.src <= edge.dst:
            key, matrix = (edge.src, edge.dst), edge.cost
        else:
            key, matrix = (edge.dst, edge.src), _transpose(edge.cost)
        if key not in merged:
            merged[key] = [list(row) for row in matrix]
            continue
        total = merged[key]
        for i, row in enumerate(matrix):
            for j, x in enumerate(row):
                total[i][j] += x
    edges = tuple(Edge(u, v, _freeze(merged[u, v])) for u, v in sorted(merged))
    return replace(problem, edges=edges)


def drop_zero_edges(problem: IntraOpProblem) -> IntraOpProblem:
    """Drop edges whose cost matrix is all zeros."""
    edges = tuple(e for e in problem.edges if any(x != 0 for row in e.cost for x in row))
    return replace(problem, edges=edges)


def fold_single_strategy_edges(problem: IntraOpProblem) -> IntraOpProblem:
    """Fold each edge with a one-strategy end into the other end's node costs."""
    costs = [list(c) for c in problem.node_costs]
    kept = []
    for edge in problem.edges:
        if len(costs[edge.dst]) == 1:
            for i, row in enumerate(edge.cost):
                costs[edge.src][i] += row[0]
        elif len(costs[edge.src]) == 1:
            for j, x in enumerate(edge.cost[0]):
                costs[edge.dst][j] += x
        else:
            kept.append(edge)
    return replace(problem, node_costs=_freeze(costs), edges=tuple(kept))


def fold_certain_shared(problem: IntraOpProblem) -> IntraOpProblem:
    """Fold each shared cost that a one-strategy group triggers into its ``src``'s node costs;
    drop zero ones and sum those with the same ``src`` and ``when``."""
    costs = [list(c) for c in problem.node_costs]
    kept: dict[tuple[int, tuple[tuple[int, int], ...]], list[float]] = {}
    for shared in problem.shared:
        if not any(shared.cost) or not shared.when:
            continue
        if any(len(costs[g]) == 1 for g, _ in shared.when):
            for i, x in enumerate(shared.cost):
                costs[shared.src][i] += x
            continue
        key = (shared.src, tuple(sorted(set(shared.when))))
        total = kept.setdefault(key, [0.0] * len(shared.cost))
        for i, x in enumerate(shared.cost):
            total[i] += x
    merged = tuple(SharedCost(src, tuple(c), when) for (src, when), c in kept.items())
    return replace(problem, node_costs=_freeze(costs), shared=merged)


def _freeze(matrix: list[list[float]]) -> Matrix:
    return tuple(tuple(row) for row in matrix)


def _transpose(matrix: Matrix) -> Matrix:
    return tuple(zip(*matrix, strict=True))


# ---------------------------------------------------------------- model


NodeVariables = dict[int, list[int]]  # group -> its columns, one per strategy


@dataclass(frozen=True)
class Variables:
    """What a solution is read from: ``s``, for each group with 2+ strategies its binary
    columns, and ``n``, the column of each recomputation's count."""

    s: NodeVariables
    n: list[int]


def build_model(problem: IntraOpProblem, margin: float = 0.0) -> tuple[LinearProgram, Variables]:
    """The ILP of the module docstring for an already simplified problem, the memory row's
    bound lowered by ``margin`` (in units of its largest coefficient)."""
    labels = group_labels(problem.names)
    model = LinearProgram()
    s = _add_node_variables(model, problem, labels)
    links = _add_link_variables(model, problem, s, labels)
    terms = [(x, problem.node_costs[v][k]) for v, xs in s.items() for k, x in enumerate(xs)]
    for edge in problem.edges:
        matrix = links[edge.src, edge.dst]
        # a column per class pair (`link_classes`): its cost once, the same for each member
        costs = {
            x: c
            for xs, cs in zip(matrix, edge.cost, strict=True)
            for x, c in zip(xs, cs, strict=True)
        }
        terms += costs.items()
    terms += _add_shared_variables(model, problem, s, links)
    terms += _add_bucket_variables(model, problem, s, links)
    scale = _memory_scale(problem, s)
    counts, recompute_terms, memory_terms = _add_recompute_variables(
        model, problem, s, labels, scale
    )
    terms += recompute_terms
    _add_memory_constraint(model, problem, s, margin, memory_terms, scale)
    _set_objective(model, terms)
    return model, Variables(s, counts)


def group_labels(names: tuple[str, ...]) -> list[str]:
    """Readable column and row names: runs of characters other than [A-Za-z0-9] become one
    "_", and the group index is appended so labels are unique (and never contain "__")."""
    labels = []
    for v, name in enumerate(names):
        clean = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "group"
        labels.append(f"{clean}_{v}")
    return labels


def _add_node_variables(
    model: LinearProgram, problem: IntraOpProblem, labels: list[str]
) -> NodeVariables:
    s: NodeVariables = {}
    for v, costs in enumerate(problem.node_costs):
        if len(costs) == 1:
            continue
        s[v] = [model.column(f"s_{labels[v]}_{k}", integer=True) for k in range(len(costs))]
        model.row(f"pick_{labels[v]}", [(x, 1.0) for x in s[v]], 1.0, 1.0)
    return s


Links = dict[tuple[int, int], list[list[int]]]  # (u, v), u < v -> the columns of e[u,v]


def _linked_pairs(problem: IntraOpProblem, s: NodeVariables) -> list[tuple[int, int]]:
    """The pairs of groups, both with variables, that an edge, a shared cost or a bucket cost
    relates, each as ``(u, v)`` with ``u < v``, in sorted order."""
    pairs = {(e.src, e.dst) for e in problem.edges}
    pairs |= {(c.src, g) for c in problem.shared for g, _ in c.when}
    pairs |= {(g, h) for b in problem.buckets for g, _, h, _, _ in b.when}
    ordered = {(min(u, v), max(u, v)) for u, v in pairs if u != v and u in s and v in s}
    return sorted(ordered)


def _add_link_variables(
    model: LinearProgram, problem: IntraOpProblem, s: NodeVariables, labels: list[str]
) -> Links:
    """One matrix of ``e`` columns per pair of `_linked_pairs`, a column per pair of the
    classes of strategies its terms tell apart (`link_classes`): the matrix gives each pair of
    strategies its classes' column."""
    assert all(e.src < e.dst and e.src in s for e in problem.edges), "expects a simplified problem"
    links: Links = {}
    pairs = _linked_pairs(problem, s)
    for (u, v), (row_of, col_of) in link_classes(problem, pairs).items():
        name = f"{labels[u]}__{labels[v]}"
        rows, cols = range(max(row_of) + 1), range(max(col_of) + 1)
        ev = [[model.column(f"e_{name}_{i}_{j}") for j in cols] for i in rows]
        for i in rows:
            members = [(x, -1.0) for x, c in zip(s[u], row_of, strict=True) if c == i]
            model.row(f"row_{name}_{i}", [*((x, 1.0) for x in ev[i]), *members], 0, 0)
        for j in cols:
            members = [(x, -1.0) for x, c in zip(s[v], col_of, strict=True) if c == j]
            model.row(f"col_{name}_{j}", [*((ev[i][j], 1.0) for i in rows), *members], 0, 0)
        links[u, v] = [[ev[i][j] for j in col_of] for i in row_of]
    return links


def _both(links: Links, s: NodeVariables, g: int, k: int, h: int, m: int) -> int | None:
    """``s[g][k] * s[h][m]`` as a column, `ONE` (certain) or None (never)."""
    if g == h:
        return (s[g][k] if g in s else ONE) if k == m else None
    if g not in s:
        return s[h][m] if h in s else ONE
    if h not in s:
        return s[g][k]
    return links[g, h][k][m] if g < h else links[h, g][m][k]


def _add_shared_variables(
    model: LinearProgram, problem: IntraOpProblem, s: NodeVariables, links: Links
) -> list[Term]:
    """``y[t][i]`` of each shared cost and its constraints; returns their objective terms."""
    terms = []
    for t, shared in enumerate(problem.shared):
        by_group: dict[int, list[int]] = {}
        for g, k in shared.when:
            assert g in s, "build_model expects a simplified problem"
            by_group.setdefault(g, []).append(k)
        for i, cost in enumerate(shared.cost):
            if cost == 0:
                continue
            y = model.column(f"y_{t}_{i}")
            for g, ks in sorted(by_group.items()):
                # each column once: the triggers of one class share theirs (`link_classes`)
                paid = dict.fromkeys(_both(links, s, shared.src, i, g, k) for k in ks)
                row = [(y, 1.0), *((x, -1.0) for x in paid if x is not None)]
                model.row(f"shared_{t}_{i}_{g}", row, 0.0)
            terms.append((y, cost))
    return terms


def _add_bucket_variables(
    model: LinearProgram, problem: IntraOpProblem, s: NodeVariables, links: Links
) -> list[Term]:
    """``x[b]`` and ``n[b]`` of each bucket cost and their constraints; returns their
    objective terms."""
    terms = []
    for b, buckets in enumerate(problem.buckets):
        by_pair: dict[tuple[int, int], list[int]] = {}
        filled: list[Term] = []
        for g, k, h, m, nbytes in buckets.when:
            both = _both(links, s, g, k, h, m)
            if both is None:
                continue
            by_pair.setdefault((g, h), []).append(both)
            filled.append((both, nbytes / buckets.capacity))
        if all(x == ONE for x, _ in filled):
            continue  # a constant
        x = model.column(f"x_{b}")
        n = model.column(f"n_{b}", upper=INF, integer=buckets.whole)
        for (g, h), products in sorted(by_pair.items()):
            model.row(f"any_{b}_{g}_{h}", [(x, 1.0), *((p, -1.0) for p in products)], 0.0)
        more = [(n, 1.0), *((both, -z) for both, z in filled)]
        model.row(f"more_{b}", [*more, (x, buckets.first / buckets.capacity)], 0.0)
        terms += [(x, buckets.cost), (n, buckets.cost)]
    return terms


def _memory_scale(problem: IntraOpProblem, s: NodeVariables) -> float:
    """The memory row's largest coefficient (bytes), which divides its coefficients: solvers
    drop a coefficient below 1e-9 or so, and a row of bytes has them near 1e9 besides."""
    found = [m for v in s for m in problem.node_memory[v]]
    found += [f for r in problem.recompute for row in r.freed for f in row]
    return max(map(abs, found), default=0.0) or 1.0


def _add_recompute_variables(
    model: LinearProgram,
    problem: IntraOpProblem,
    s: NodeVariables,
    labels: list[str],
    scale: float,
) -> tuple[list[int], list[Term], list[Term]]:
    """``count[r]`` of each recomputation, with the ``some``, ``w``, ``z`` and ``T`` (in
    units of ``scale`` bytes) that price it and their constraints; returns the counts and
    the terms of the objective and of the memory row (bytes)."""
    counts: list[int] = []
    objective: list[Term] = []
    memory: list[Term] = []
    largest: list[list[Term]] = []  # for each recomputation, what one copy holds again
    for r, way in enumerate(problem.recompute):
        single = way.copies == 1
        n = model.column(f"count_{r}", upper=way.copies, integer=True)
        counts.append(n)
        some = n if single else model.column(f"some_{r}", integer=True)
        if not single:
            model.row(f"counted_{r}", [(n, 1.0), (some, -float(way.copies))], upper=0.0)
        again: list[Term] = []
        # the groups with one strategy: constants times the count
        fixed = [v for v in range(problem.num_groups) if v not in s]
        objective.append((n, sum(way.time[v][0] for v in fixed) / way.copies))
        memory.append((n, -sum(way.freed[v][0] for v in fixed) / way.copies))
        if any(way.held[v][0] for v in fixed):
            again.append((some, sum(way.held[v][0] for v in fixed) / scale))
        for v, (time_s, freed) in enumerate(zip(way.time, way.freed, strict=True)):
            held = way.held[v]
            if v not in s or (not any(time_s) and not any(freed) and not any(held)):
                continue
            name = f"{labels[v]}_{r}"
            w = _times_choice(model, s[v], n, way.copies, f"w_{name}")
            objective += [(x, t) for x, t in zip(w, time_s, strict=True) if t]
            memory += [(x, -f) for x, f in zip(w, freed, strict=True) if f]
            if any(held):
                z = w if single else _times_choice(model, s[v], some, 1, f"z_{name}")
                again += [(x, h / scale) for x, h in zip(z, held, strict=True) if h]
        largest.append(again)
    if any(largest):
        # bounded, so that HiGHS's presolve finds an infeasible problem infeasible (not
        # "infeasible or unbounded")
        most = max(sum(max(row) for row in way.held) for way in problem.recompute)
        largest_held = model.column("largest_held", upper=most / scale)
        memory.append((largest_held, scale))
        for r, again in enumerate(largest):
            if again:
                row = [(largest_held, 1.0), *((x, -c) for x, c in again)]
                model.row(f"largest_{r}", row, 0.0)
    for unit in sorted({way.unit for way in problem.recompute}):
        ways = [n for n, way in zip(counts, problem.recompute, strict=True) if way.unit == unit]
        if len(ways) > 1:
            copies = next(w.copies for w in problem.recompute if w.unit == unit)
            model.row(f"unit_{unit}", [(n, 1.0) for n in ways], upper=copies)
    return counts, objective, memory


def _times_choice(
    model: LinearProgram, s: list[int], total: int, divisor: int, name: str
) -> list[int]:
    """Columns ``x[k]`` equal to ``total / divisor * s[k]`` (``s`` one-hot, ``total /
    divisor`` in [0, 1]): ``divisor * sum_k x[k] == total`` and ``x[k] <= s[k]``, as tight
    as the edges' products (`_add_link_variables`)."""
    x = [model.column(f"{name}_{k}") for k in range(len(s))]
    model.row(f"share_{name}", [*((xk, float(divisor)) for xk in x), (total, -1.0)], 0, 0)
    for k, (xk, sk) in enumerate(zip(x, s, strict=True)):
        model.row(f"within_{name}_{k}", [(xk, 1.0), (sk, -1.0)], upper=0.0)
    return x


def _add_memory_constraint(
    model: LinearProgram,
    problem: IntraOpProblem,
    s: NodeVariables,
    margin: float,
    recompute: list[Term],
    scale: float,
) -> None:
    if math.isinf(problem.memory_limit):
        return
    fixed = sum(mem[0] for v, mem in enumerate(problem.node_memory) if v not in s)
    terms = [(x, problem.node_memory[v][k]) for v, xs in s.items() for k, x in enumerate(xs)]
    terms += recompute
    used = [(x, m / scale) for x, m in terms]
    model.row("memory", used, upper=(problem.memory_limit - fixed) / scale - margin)


def _set_objective(model: LinearProgram, terms: list[Term]) -> None:
    scale = max((abs(c) for _, c in terms), default=0.0) or 1.0
    for x, c in terms:
        model.cost[x] += c / scale


# ---------------------------------------------------------------- solving


# two threads making the process's first solvers at once (a pipeline's layers are solved
# side by side, autoplan.search.layer_plans) must not point file descriptor 1 away together
_STDOUT_LOCK = threading.Lock()


@functools.cache
def _highs_banner_silenced() -> None:
    """HiGHS's C library prints its banner to the process's stdout when the first solver of
    the process is made, before any option can turn its output off, and Python cannot catch
    it: that first solver is made here, with file descriptor 1 pointed at /dev/null."""
    import highspy

    with _STDOUT_LOCK:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _solve(model: LinearProgram, solver: str, time_limit_s: float) -> LinearSolution:
    """Solve ``model`` with ``solver``, its own log sent to `logger` at debug level (when that
    is enabled; else the solver logs nothing)."""
    debug = logger.isEnabledFor(logging.DEBUG)
    if solver == "highs":
        if highs_available():
            _highs_banner_silenced()
            log = functools.partial(_log_lines, "HiGHS") if debug else None
            return solve_with_highs(model, time_limit_s, MIP_REL_GAP, log)
        logger.warning("HiGHS is not available; falling back to CBC")
    log = functools.partial(_log_lines, "CBC") if debug else None
    return solve_with_cbc(model, time_limit_s, MIP_REL_GAP, log)


def highs_available() -> bool:
    """Whether highspy (installed with autoplan) imports."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def _log_lines(solver: str, text: str) -> None:
    for line in text.splitlines():
        if line.strip():
            logger.debug("%s: %s", solver, line.rstrip())


def _status(
    solved: LinearSolution, problem: IntraOpProblem, time_limit_s: float
) -> tuple[str, float | None]:
    """The solution status and, stopped, the solver's gap: ("optimal", None), or
    ("time_limit", gap) with an incumbent (the relative gap the solver stopped at,
    ``(objective - bound) / objective``: the optimum is at least ``(1 - gap)`` times the plan
    found; the costs of the groups fixed before the solve are >= 0 and outside that
    objective, so the gap of the whole objective is no larger; None where the solver does
    not say, as CBC); else raises (`SolverTimeLimitError` where the solver stopped with no
    plan, which a caller planning several meshes skips)."""
    if solved.status == "optimal":
        return "optimal", None
    if solved.status == "stopped":
        logger.warning(
            "ILP stopped at the %.1f s time limit before proving optimality; "
            "using the best plan found (%s)",
            time_limit_s,
            gap_text(solved.gap),
        )
        return "time_limit", solved.gap
    if solved.status == "infeasible":
        raise _infeasible_error(problem)
    raise SolverTimeLimitError(
        f"the ILP solver found no plan within time_limit_s={time_limit_s:g}; raise the time limit"
    )


def _extract_choice(
    problem: IntraOpProblem, variables: Variables, values: tuple[float, ...]
) -> tuple[int, ...]:
    choice = [0] * problem.num_groups
    for v, xs in variables.s.items():
        found = [values[x] for x in xs]
        k = max(range(len(found)), key=found.__getitem__)
        assert [round(x) for x in found].count(1) == 1 and round(found[k]) == 1, (
            f"group {v} has no single chosen strategy: {found}"
        )
        choice[v] = k
    return tuple(choice)


def _solution(
    problem: IntraOpProblem,
    choice: tuple[int, ...],
    recomputed: tuple[int, ...],
    status: str,
    start: float,
    num_variables: int,
    num_constraints: int,
    gap: float | None = None,
) -> IntraOpSolution:
    evaluation = evaluate(problem, choice, recomputed)
    if not evaluation.feasible:
        # over the memory limit even with the margin (solve_intra_op)
        logger.warning("ILP plan violates the problem: %s", "; ".join(evaluation.violations))
    solve_time_s = time.perf_counter() - start
    logger.debug("ILP %s: objective %.6g s in %.2f s", status, evaluation.objective, solve_time_s)
    return IntraOpSolution(
        choice=choice,
        objective=evaluation.objective,
        status=status,
        solve_time_s=solve_time_s,
        num_variables=num_variables,
        num_constraints=num_constraints,
        recomputed=recomputed or (0,) * len(problem.recompute),
        gap=gap,
    )


def _infeasible_error(problem: IntraOpProblem) -> InfeasiblePlanError:
    need = min_memory(problem)
    # with recomputation chosen that is a floor; what one recomputed layer holds again during
    # its backward may take a plan over the limit even so
    smallest = (
        f"the smallest needs {fmt_bytes(need)}"
        if need > problem.memory_limit
        else ("a layer recomputed holds its activations again during its backward, over the limit")
    )
    return InfeasiblePlanError(
        f"no strategy assignment fits in {fmt_bytes(problem.memory_limit)} per device; " + smallest
    )
