"""The strategies of two linked groups that the ILP tells apart, so that their product
columns ``e[u,v]`` are made per class pair instead of per strategy pair.

A pair of groups is linked by an edge (its matrix of resharding costs), by shared costs and
by bucket costs (`autoplan.solvers.ilp`). Two strategies of ``u`` whose rows of every term
on the pair are the same (the same resharding costs to each strategy of ``v``, the same
membership in each shared cost's triggers) can share their columns: ``e[u,v][I][J]`` then
stands for ``sum_(i in I) s[u][i] * sum_(j in J) s[v][j]``, its rows and columns summing to
those sums. With ``s`` integral that is the product of the chosen classes, exactly as the
per-strategy columns are; and any LP solution of the per-class columns splits into one of the
per-strategy columns (``e[i][j] = e[I][J] s[i] s[j] / (s(I) s(J))``), so the relaxation's
bound is the same. Resharding costs depend on the placements alone, and many strategies of an
op share its output's placement and differ in their other inputs': on a Llama layer's 2-D
mesh this leaves about a fifth fewer columns.

Where a term reads single strategies (a shared cost's ``y[t][i]`` on the side of its
``src``, a bucket's pairs), those stay classes of one.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

from autoplan.solvers.problem import IntraOpProblem

Classes = tuple[tuple[int, ...], tuple[int, ...]]  # the class of each strategy of u, of v


def link_classes(
    problem: IntraOpProblem, pairs: Collection[tuple[int, int]]
) -> dict[tuple[int, int], Classes]:
    """For each linked pair ``(u, v)``, ``u < v`` (of a simplified problem, whose edges run
    from the lower group), the class of each strategy of ``u`` and of ``v``, numbered from 0
    in order of first strategy."""
    rows: dict[tuple[int, int], list[list[Hashable]]] = {}
    cols: dict[tuple[int, int], list[list[Hashable]]] = {}
    for u, v in pairs:
        rows[u, v] = [[] for _ in problem.node_costs[u]]
        cols[u, v] = [[] for _ in problem.node_costs[v]]
    for edge in problem.edges:
        if (edge.src, edge.dst) in rows:
            for i, row in enumerate(edge.cost):
                rows[edge.src, edge.dst][i].append(row)
            for j, signature in enumerate(cols[edge.src, edge.dst]):
                signature.append(tuple(row[j] for row in edge.cost))
    for t, shared in enumerate(problem.shared):
        triggers: dict[int, set[int]] = {}
        for g, k in shared.when:
            triggers.setdefault(g, set()).add(k)
        for g, ks in triggers.items():
            pair = (min(shared.src, g), max(shared.src, g))
            if pair not in rows or shared.src == g:
                continue
            src_side, g_side = (rows, cols) if shared.src < g else (cols, rows)
            for i, signature in enumerate(src_side[pair]):
                signature.append(("strategy", i))
            for k, signature in enumerate(g_side[pair]):
                signature.append(("trigger", t, k in ks))
    bucketed = {(min(g, h), max(g, h)) for b in problem.buckets for g, _, h, _, _ in b.when}
    for pair in bucketed & rows.keys():
        for side in (rows, cols):
            for i, signature in enumerate(side[pair]):
                signature.append(("strategy", i))
    return {pair: (_numbered(rows[pair]), _numbered(cols[pair])) for pair in rows}


def _numbered(signatures: list[list[Hashable]]) -> tuple[int, ...]:
    ids: dict[tuple[Hashable, ...], int] = {}
    return tuple(ids.setdefault(tuple(s), len(ids)) for s in signatures)
