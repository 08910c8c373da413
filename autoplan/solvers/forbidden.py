"""Moves the ILP must not choose, priced so that it never does: a cost above every plan
without them, where an infinite one (`math.inf` in a cost matrix) marks them. A constant far
above every cost would cost the solver its precision: its tolerances are relative to the
largest coefficient."""

from __future__ import annotations

import math
from dataclasses import replace

from autoplan.solvers.problem import SharedCost


def priced_forbidden(
    node_costs: list[list[float]],
    edges: dict[tuple[int, int], list[list[float]]],
    shared: list[SharedCost],
) -> tuple[dict[tuple[int, int], list[list[float]]], list[SharedCost]]:
    """The moves that would mix a routed region's local rows with the one-process tensor's
    shards (`autoplan.strategies.routing`), priced above twice the dearest plan without
    them: a constant far above every cost would cost the solver its precision (its
    tolerances are relative to the largest coefficient)."""

    def dearest(values: list[float] | tuple[float, ...]) -> float:
        return max((v for v in values if math.isfinite(v)), default=0.0)

    bound = sum(dearest(c) for c in node_costs)
    bound += sum(dearest([v for row in m for v in row]) for m in edges.values())
    bound += sum(dearest(c.cost) for c in shared)
    cost = 2.0 * bound + 1e-3

    def priced(v: float) -> float:
        return v if math.isfinite(v) else cost

    edges = {k: [[priced(v) for v in row] for row in m] for k, m in edges.items()}
    shared = [replace(c, cost=tuple(priced(v) for v in c.cost)) for c in shared]
    return edges, shared
