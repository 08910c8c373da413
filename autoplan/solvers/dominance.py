"""Dominated strategies: dropped before the ILP is built, so that it has fewer variables.

Strategy ``k`` of group ``v`` is *dominated* by ``k'`` when swapping ``k`` for ``k'`` can never
make an assignment dearer or bigger, whatever the other groups take:

- node cost and memory: ``c[v][k'] <= c[v][k]`` and ``m[v][k'] <= m[v][k]``;
- every edge: row (or column) ``k'`` at most row ``k``, entry by entry;
- every shared cost: ``C[t][k'] <= C[t][k]`` where ``v`` is its source, and ``(v, k')``
  triggers no shared cost that ``(v, k)`` does not;
- every bucket cost: what ``(v, k')`` puts in it, pair by pair (the same partner group and
  strategy), at most what ``(v, k)`` puts there, and no pair that ``(v, k)`` lacks;
- every recomputation: no more time, no less freed, no more held again.

All costs are non-negative and the buckets' count grows with the bytes, so each condition
keeps the objective and the memory from growing. Among strategies equal in all of these the
first is kept. Every dropped strategy has a kept one that dominates it (the relation is
transitive), so an optimal assignment of the kept strategies is optimal for the problem:
dropping them changes what the ILP must search, not what it finds.

On real models most candidates of an op are distinct, and the gain is modest: Qwen2.5-7B in
bf16 mixed precision on an 8 x 8 mesh keeps 2,436 of its 2,551 strategies, and its ILP 87,228
of 90,642 variables.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from autoplan.solvers.problem import BucketCost, Edge, IntraOpProblem, SharedCost

Kept = tuple[tuple[int, ...], ...]  # for each group, the original indices of its strategies


def drop_dominated(problem: IntraOpProblem) -> tuple[IntraOpProblem, Kept]:
    """``problem`` without its dominated strategies, and for each group the original index of
    each strategy it keeps."""
    profiles = _profiles(problem)
    kept = tuple(_undominated(p) for p in profiles)
    if all(len(k) == len(c) for k, c in zip(kept, problem.node_costs, strict=True)):
        return problem, kept
    return restrict(problem, kept), kept


def restrict(problem: IntraOpProblem, kept: Kept) -> IntraOpProblem:
    """``problem`` with group ``v`` limited to strategies ``kept[v]`` (renumbered from 0)."""
    new_index = [{k: i for i, k in enumerate(ks)} for ks in kept]

    def pick(values: tuple[float, ...], v: int) -> tuple[float, ...]:
        return tuple(values[k] for k in kept[v])

    edges = tuple(
        Edge(e.src, e.dst, tuple(pick(e.cost[i], e.dst) for i in kept[e.src]))
        for e in problem.edges
    )
    shared = tuple(
        SharedCost(
            t.src,
            pick(t.cost, t.src),
            tuple((g, new_index[g][k]) for g, k in t.when if k in new_index[g]),
        )
        for t in problem.shared
    )
    buckets = tuple(
        replace(
            b,
            when=tuple(
                (g, new_index[g][k], h, new_index[h][m], n)
                for g, k, h, m, n in b.when
                if k in new_index[g] and m in new_index[h]
            ),
        )
        for b in problem.buckets
    )
    recompute = tuple(
        replace(
            r,
            time=tuple(pick(x, v) for v, x in enumerate(r.time)),
            freed=tuple(pick(x, v) for v, x in enumerate(r.freed)),
            held=tuple(pick(x, v) for v, x in enumerate(r.held)),
        )
        for r in problem.recompute
    )
    return replace(
        problem,
        node_costs=tuple(pick(c, v) for v, c in enumerate(problem.node_costs)),
        node_memory=tuple(pick(m, v) for v, m in enumerate(problem.node_memory)),
        edges=edges,
        shared=shared,
        buckets=buckets,
        recompute=recompute,
    )


@dataclass(frozen=True)
class Profile:
    """What each strategy of one group costs, as comparable parts, row ``k`` for strategy
    ``k``: numbers where less is better (``at_most``), numbers where more is better
    (``at_least``), and what it triggers (`triggers`, where fewer is better)."""

    at_most: np.ndarray
    at_least: np.ndarray
    triggers: list[frozenset[tuple[int, int]]]  # shared costs ``(t, 0)``
    fills: list[dict[tuple[int, str, int, int], float]]  # `_bucket_fills`


def _profiles(problem: IntraOpProblem) -> list[Profile]:
    """The `Profile` of each group."""
    size = [len(c) for c in problem.node_costs]
    at_most: list[list[list[float]]] = [[[] for _ in range(n)] for n in size]
    at_least: list[list[list[float]]] = [[[] for _ in range(n)] for n in size]
    for v, (costs, memory) in enumerate(zip(problem.node_costs, problem.node_memory, strict=True)):
        for k in range(size[v]):
            at_most[v][k] += (costs[k], memory[k])
    for e in problem.edges:
        for i, row in enumerate(e.cost):
            at_most[e.src][i] += row
        for j in range(size[e.dst]):
            at_most[e.dst][j] += [row[j] for row in e.cost]
    for t in problem.shared:
        for k, c in enumerate(t.cost):
            at_most[t.src][k].append(c)
    for r in problem.recompute:
        for v in range(len(size)):
            for k in range(size[v]):
                at_most[v][k] += (r.time[v][k], r.held[v][k])
                at_least[v][k].append(r.freed[v][k])
    triggers: list[list[set[tuple[int, int]]]] = [[set() for _ in range(n)] for n in size]
    for ti, t in enumerate(problem.shared):
        for g, k in t.when:
            triggers[g][k].add((ti, 0))
    fills = _bucket_fills(problem.buckets, size)
    return [
        Profile(
            np.array(at_most[v], dtype=float).reshape(n, -1),
            np.array(at_least[v], dtype=float).reshape(n, -1),
            [frozenset(t) for t in triggers[v]],
            fills[v],
        )
        for v, n in enumerate(size)
    ]


def _bucket_fills(
    buckets: tuple[BucketCost, ...], size: list[int]
) -> list[list[dict[tuple[int, str, int, int], float]]]:
    """For each group and strategy, the bytes it puts in each bucket cost with each partner:
    ``{(bucket, side, partner group, partner strategy): bytes}``."""
    fills: list[list[dict[tuple[int, str, int, int], float]]] = [
        [defaultdict(float) for _ in range(n)] for n in size
    ]
    for bi, b in enumerate(buckets):
        for g, k, h, m, nbytes in b.when:
            if g == h:
                fills[g][k][(bi, "self", g, k)] += nbytes
            else:
                fills[g][k][(bi, "dst", h, m)] += nbytes
                fills[h][m][(bi, "src", g, k)] += nbytes
    return [[dict(f) for f in row] for row in fills]


def _undominated(p: Profile) -> tuple[int, ...]:
    """The strategies of one group that no other dominates (the first of equals kept)."""
    n = len(p.triggers)
    if n == 1:
        return (0,)
    most, least = p.at_most, p.at_least
    # no_worse[j, k]: j's numbers are all at least as good as k's; equal[j, k]: all the same
    no_worse = np.asarray((most[:, None] <= most[None]).all(axis=2))
    no_worse &= np.asarray((least[:, None] >= least[None]).all(axis=2))
    equal = np.asarray((most[:, None] == most[None]).all(axis=2))
    equal &= np.asarray((least[:, None] == least[None]).all(axis=2))
    kept = []
    for k in range(n):
        if not any(
            no_worse[j, k] and _no_more_triggered(p, j, k) and (j < k or not _same(p, j, k, equal))
            for j in range(n)
            if j != k
        ):
            kept.append(k)
    return tuple(kept)


def _no_more_triggered(p: Profile, j: int, k: int) -> bool:
    """Whether strategy ``j`` triggers no shared cost and fills no bucket pair beyond ``k``."""
    if not p.triggers[j] <= p.triggers[k]:
        return False
    theirs = p.fills[k]
    return all(key in theirs and nbytes <= theirs[key] for key, nbytes in p.fills[j].items())


def _same(p: Profile, j: int, k: int, equal: np.ndarray) -> bool:
    return bool(equal[j, k]) and p.triggers[j] == p.triggers[k] and p.fills[j] == p.fills[k]
