"""What crosses each point of a graph's op order, and the cheapest FLOPs-balanced cut of it.

Points (`crossing_points`). The ops of a graph in graph order (a topological order of its
dataflow DAG, `Graph.dataflow`) are cut at point ``p``, between op ``p - 1`` and op ``p``. A
tensor crosses point ``p`` when its producer comes before it (an input comes before every op)
and one of its readers after it (the graph's output reads after every op): a stage ending at
``p`` sends it to the next, and the stage DP charges its bytes for the send
(`autoplan.costmodel.pipeline_price.sent_bytes`, per rank: split as the boundary placement
says). Parameters never cross: each sits with its first reader (`autoplan.graph.cut`). A point
where one tensor crosses (besides the target, on its way to the loss across every point) is an
articulation of the DAG: every path from the inputs to the loss runs through that tensor, the
kind of point PipeDream and Alpa cut at (a residual stream between blocks, not the middle of a
skip connection). A point where an op with several outputs crosses is never cut: a stage sends
whole tensors.

Cut (`balanced_cut`): ``k`` layers, runs of ops in graph order, minimizing the bytes crossing the
``k - 1`` points cut, with each layer's FLOPs (forward and backward) at most ``1 +
BALANCE_SLACK`` times the average, as Alpa's layer clustering bounds them; of the cuts as cheap,
the most even (least sum of squared deviations from the average). A dynamic program over the
points that may be cut: ``best[j][q]``, the cheapest first ``j`` layers ending at point ``q``, is
``best[j - 1][r]`` plus the layer ``[r, q)`` (the bytes crossing ``q``, its squared deviation)
at the cheapest ``r`` whose layer keeps the bound. Where no cut keeps it, the bound is doubled
until one does. ``O(k L W)`` for ``L`` points and ``W`` points per layer-sized window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplan.graph.ir import Graph
from autoplan.modes import NodeKind

# a layer's FLOPs may exceed the average by this share
BALANCE_SLACK = 0.5


@dataclass(frozen=True)
class Points:
    """A graph's ops in graph order and what crosses each point between them; index ``p`` of
    each per-point tuple is point ``p`` (0 before the first op, ``len(ops)`` after the last)."""

    ops: tuple[str, ...]
    flops: tuple[float, ...]  # per op, forward and backward
    nbytes: tuple[int, ...]  # bytes of the tensors crossing, whole (unsharded)
    tensors: tuple[int, ...]  # how many tensors cross
    cuttable: tuple[bool, ...]  # no op with several outputs crosses


def crossing_points(graph: Graph) -> Points:
    """What crosses each point of ``graph``'s op order (module docstring): each tensor is added
    over the points from its producer to its last reader, with the readers from the DAG."""
    ops = [n for n in graph if n.kind == NodeKind.OP]
    position = {n.name: i for i, n in enumerate(ops)}
    end = len(ops)
    nbytes, tensors, multi = (np.zeros(end + 2, dtype=np.int64) for _ in range(3))
    dag = graph.dataflow
    for n in graph:
        if n.kind not in (NodeKind.OP, NodeKind.INPUT):
            continue
        readers = [position.get(u, end) for u in dag.successors(n.name)]
        if not readers:
            continue
        first = position[n.name] + 1 if n.kind == NodeKind.OP else 0
        last = max(readers)
        # difference arrays: +x at the first point crossed, -x past the last
        for total, x in (
            (nbytes, sum(o.nbytes for o in n.outputs)),
            (tensors, 1),
            (multi, int(len(n.outputs) > 1)),
        ):
            total[first] += x
            total[last + 1] -= x
    nbytes, tensors, multi = (np.cumsum(a)[: end + 1] for a in (nbytes, tensors, multi))
    return Points(
        ops=tuple(n.name for n in ops),
        flops=tuple(n.flops + n.bwd_flops for n in ops),
        nbytes=tuple(int(b) for b in nbytes),
        tensors=tuple(int(t) for t in tensors),
        cuttable=tuple(bool(m == 0) for m in multi),
    )


def balanced_cut(points: Points, count: int) -> tuple[int, ...]:
    """The first op of each layer of the cheapest cut of ``points`` into ``count`` layers
    (fewer where fewer points may be cut); see the module docstring."""
    n = len(points.ops)
    cuts = [0, *(p for p in range(1, n) if points.cuttable[p]), n]
    count = max(1, min(count, len(cuts) - 1))
    prefix = np.concatenate([[0.0], np.cumsum(points.flops)])
    average = prefix[-1] / count
    bound = (1 + BALANCE_SLACK) * average
    while (found := _cheapest(points, cuts, prefix, count, average, bound)) is None:
        bound *= 2  # at the total FLOPs every cut keeps it
    return found


def _cheapest(
    points: Points,
    cuts: list[int],
    prefix: np.ndarray,
    count: int,
    average: float,
    bound: float,
) -> tuple[int, ...] | None:
    """The DP of the module docstring over ``cuts`` (the points that may be cut, with 0 and
    the end), or None if no cut keeps every layer within ``bound`` FLOPs."""
    at = np.asarray(cuts)
    flops_before = prefix[at]
    # the bytes a layer ending at each cut point adds: none after the last op
    crossing = np.array([points.nbytes[p] if p < len(points.ops) else 0 for p in cuts], float)
    size = len(cuts)
    cost = np.full(size, np.inf)  # bytes crossing the cuts so far, layers ending at each point
    spread = np.full(size, np.inf)  # and their squared deviations from the average FLOPs
    cost[0] = spread[0] = 0.0
    parent = np.zeros((count + 1, size), dtype=np.int64)
    for j in range(1, count + 1):
        new_cost, new_spread = np.full(size, np.inf), np.full(size, np.inf)
        for q in range(j, size):
            # the earliest start r keeping layer [r, q) within the bound
            lo = int(np.searchsorted(flops_before, flops_before[q] - bound, side="left"))
            if lo >= q:
                continue
            total = cost[lo:q]
            least = total.min()
            if not np.isfinite(least):
                continue
            deviation = spread[lo:q] + (flops_before[q] - flops_before[lo:q] - average) ** 2
            tied = np.flatnonzero(total == least)
            r = lo + int(tied[np.argmin(deviation[tied])])
            new_cost[q] = least + crossing[q]
            new_spread[q] = deviation[r - lo]
            parent[j][q] = r
        cost, spread = new_cost, new_spread
    if not np.isfinite(cost[-1]):
        return None
    starts, q = [], size - 1
    for j in range(count, 0, -1):
        q = int(parent[j][q])
        starts.append(cuts[q])
    return tuple(reversed(starts))
