"""The stage DP (`autoplan.solvers.stages`) run for the pipeline search on uniform stages:
layer ranges priced by a function, the stages put on one-device nodes so that its tables grow
with the stages and not with the devices (`partition`), and a quick bound that rules a stage
layout out before any layer is planned (`may_fit`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from autoplan.costmodel.pricer import Pricer
from autoplan.modes import NodeKind
from autoplan.search.layer_plans import LayerGraphs
from autoplan.solvers.stage_problem import (
    InfeasibleStagesError,
    SendTimeFn,
    StageCost,
    StageProblem,
    StageSolution,
    Submesh,
)
from autoplan.solvers.stages import solve_stages


def may_fit(
    parts: LayerGraphs,
    pricer: Pricer,
    stage_counts: Sequence[int],
    num_microbatches: int,
    memory_limit: float,
) -> bool:
    """Whether the layers might fit in one of ``stage_counts`` stages on meshes of
    ``pricer``'s size: the stage DP run on each layer's memory floor (`Pricer.memory_floor`,
    every tensor split over all the stage's devices), which no plan of the layers' undercuts.
    When it says no, no layer needs planning (a 1T-parameter GPT without recomputation: its
    activations in flight alone outgrow the devices, whatever the stages' meshes)."""
    floors = [
        (
            sum(
                pricer.memory_floor(n)
                for n in st.graph
                if n.kind in (NodeKind.PARAM, NodeKind.INPUT)
            ),
            sum(pricer.memory_floor(n) for n in st.graph if n.kind == NodeKind.OP),
        )
        for st in parts.stages
    ]
    static = [0.0, *itertools.accumulate(f[0] for f in floors)]
    active = [0.0, *itertools.accumulate(f[1] for f in floors)]

    def range_cost(i: int, j: int) -> list[StageCost | None]:
        return [StageCost(j - i, static[j] - static[i], activation_bytes=active[j] - active[i])]

    return any(
        partition(len(parts.layers), count, num_microbatches, memory_limit, range_cost) is not None
        for count in stage_counts
    )


def partition(
    num_layers: int,
    num_stages: int,
    num_microbatches: int,
    memory_limit: float,
    range_cost: Callable[[int, int], Sequence[StageCost | None]],
    send_time: SendTimeFn | None = None,
    variants: int = 1,
) -> StageSolution | None:
    """The stage DP into ``num_stages`` stages of uniform submeshes, ``range_cost(i, j)``
    pricing layers ``[i, j)`` as one stage in each of ``variants`` (None: it cannot be one),
    or None if none fits. The DP runs on as many one-device nodes as there are stages: its
    tables and states grow with the stages, not with the devices (Alpa's submesh choices of
    3072 devices made a 1T-parameter GPT's send table 20 million entries, all but the
    uniform ones unusable)."""
    unit = Submesh(1, 1)
    longest = num_layers - num_stages + 1  # every other stage needs a layer
    unusable = StageCost(math.inf, math.inf, feasible=False)

    def cost(i: int, j: int, submesh: Submesh) -> list[StageCost]:
        if submesh != unit or j - i > longest:
            return [unusable] * variants
        return [unusable if c is None else c for c in range_cost(i, j)]

    problem = StageProblem(
        num_layers=num_layers,
        num_nodes=num_stages,
        devices_per_node=1,
        num_microbatches=num_microbatches,
        memory_limit=memory_limit,
        cost=cost,
        send_time=send_time,
        variants=variants,
    )
    try:
        return solve_stages(problem)
    except InfeasibleStagesError:
        return None
