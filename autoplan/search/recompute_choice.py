"""How many layers a pipeline stage recomputes: the fewest that fit.

Each stage's layers choose their recomputation in their own ILPs, within the memory budget of
the variant the stage DP chose for the stage (`autoplan.search.layer_plans`,
`autoplan.search.pipeline_search`). The strategies found are then priced again
(`price_step`) with only the first ``k`` of those layers recomputed, for the least ``k`` at
which the stage, with the microbatches it holds in flight, still fits. Memory only falls as
``k`` grows (a layer recomputed gives up its activations but the largest recomputed layer's,
which the stage still holds once), so ``k`` is found by bisection; each layer left alone
saves its forward's time in backward. (A one-stage plan's ILP chooses its recomputed layers
itself: `autoplan.search.recompute_ilp`.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import PipelinePlan, SolvedStage, price_stages, priced_stage
from autoplan.costmodel.step_price import price_step
from autoplan.graph.recompute import Recompute
from autoplan.phases import timed


def fewest_in_stages(pipe: PipelinePlan, cluster: Cluster) -> PipelinePlan:
    """``pipe`` with each stage recomputing the first ``k`` of its recomputed layers, the
    least ``k`` with which it still fits the microbatches it holds in flight under the
    pipeline's schedule (interleaved: with its device group's other stages), priced again
    on ``cluster``; ``pipe`` itself where no stage recomputes."""
    if not any(stage.recomputed for stage in pipe.stages):
        return pipe
    stages = list(pipe.stages)
    for s in range(len(stages)):
        stages[s] = _fewest_in_stage(pipe, stages, s)
    return price_stages(
        cluster, pipe.graph, pipe.layers, pipe.num_microbatches, pipe.schedule, pipe.pricer,
        pipe.boundary, tuple(stages), pipe.memory_limit, pipe.virtual_stages,
    )  # fmt: skip


def _fewest_in_stage(pipe: PipelinePlan, stages: Sequence[SolvedStage], s: int) -> SolvedStage:
    """Stage ``s`` recomputing the fewest of its layers with which it fits among ``stages``
    (itself if it recomputes none, or fits only as it is)."""
    stage = stages[s]
    tried: dict[int, SolvedStage] = {}

    def fits(k: int) -> bool:
        tried[k] = _recomputing(stage, pipe, k)
        trial = dataclasses.replace(pipe, stages=(*stages[:s], tried[k], *stages[s + 1 :]))
        return trial.stage_memory(s) <= pipe.memory_limit

    k = least(len(stage.recomputed), fits) if stage.recomputed else None
    return stage if k is None else tried[k]


def _recomputing(stage: SolvedStage, pipe: PipelinePlan, k: int) -> SolvedStage:
    """``stage`` priced again recomputing only the first ``k`` of its recomputed layers."""
    recompute = Recompute.mixed(pipe.graph, stage.recomputed[:k])
    pricer = pipe.pricer.recomputing(recompute)
    with timed("pricing"):
        step = price_step(stage.stage.graph, stage.assignment, pricer)
    return priced_stage(
        stage.start, stage.stop, stage.stage, stage.assignment, step, stage.rules, pricer,
        stage.send_s, stage.solver,
    )  # fmt: skip


def least(count: int, fits: Callable[[int], bool]) -> int | None:
    """The least ``k`` in ``0..count`` for which ``fits(k)`` (false, then true as ``k``
    grows), by bisection; None if not even ``fits(count)``."""
    if not fits(count):
        return None
    low, high = 0, count  # high fits
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high
