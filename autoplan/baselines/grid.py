"""Every conventional plan of a step on a cluster: the baselines of each choice of degrees
(``dp * tp * pp`` devices, each ZeRO stage, sequence parallelism or not, the microbatches of a
pipeline, its stages on each device group under Interleaved1F1B, every layer recomputed or
not) that divides the cluster and the batch and fits in memory.

The planner must never be slower than the best of them (tests/test_optimality.py and
benchmarks/vs_baselines.py price `every_degrees`, the whole grid). It checks
its plans against the conventional plans of their shape (`shaped_degrees`: one stage on each
mesh it solved, or pipelines of the stage and microbatch counts it found) and keeps the faster
(`autoplan.api`). Expert parallelism (``ep``) applies to mixtures of experts alone: their
degrees are tried again with the experts split along dp (`with_experts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, replace

from autoplan.baselines.build import baseline_of_graph
from autoplan.baselines.propagate import Layout, expert_weights, mesh_of
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.graph.ir import Graph
from autoplan.modes import NodeKind, RecomputeMode, Schedule
from autoplan.options import PlanOptions
from autoplan.planfile.schema import Plan
from autoplan.schedules import schedule_refusal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Degrees:
    """One conventional plan's degrees: `autoplan.baseline`'s arguments."""

    dp: int
    tp: int
    pp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    num_microbatches: int = 1  # of a pipeline; 1 without one
    virtual_stages: int = 1  # stages on each of the pp device groups (Interleaved1F1B: 2)
    # every layer recomputed in backward in this mode (none, full or selective)
    recompute: RecomputeMode = RecomputeMode.NONE
    ep: int = 1  # experts split along the dp axis: 1 or dp (`with_experts`)

    @property
    def layout(self) -> Layout:
        return Layout(
            self.dp,
            self.tp,
            self.zero_stage,
            self.sequence_parallel,
            ep=self.ep,
            recompute=self.recompute,
        )

    def __str__(self) -> str:
        text = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        text += f" zero{self.zero_stage}" * (self.zero_stage > 0) + " sp" * self.sequence_parallel
        text += f" ep={self.ep}" * (self.ep > 1)
        text += f" v={self.virtual_stages}" * (self.virtual_stages > 1)
        text += f" recompute={self.recompute}" * (self.recompute != RecomputeMode.NONE)
        return text + (f" mb={self.num_microbatches}" if self.pp > 1 else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_degrees(
    num_devices: int, batch: int, schedule: Schedule = Schedule.ONE_F_ONE_B
) -> list[Degrees]:
    """Every choice of degrees over ``num_devices`` devices for a step of ``batch`` samples:
    ``dp * tp * pp == num_devices``; ZeRO-1, 2 and 3 where ``dp > 1``, sequence parallelism where
    ``tp > 1``; a pipeline's microbatches divide the batch, ``dp`` divides each, and
    ``schedule`` runs them (Interleaved1F1B: with 2 stages on each device group, as Megatron
    interleaves). Whether the model splits so is left to `conventional_plans`."""
    virtual = 2 if schedule == Schedule.INTERLEAVED else 1
    found = []
    for dp in _divisors(num_devices):
        for tp in _divisors(num_devices // dp):
            pp = num_devices // (dp * tp)
            counts = [1] if pp == 1 else _divisors(batch)
            v = virtual if pp > 1 else 1
            for count in counts:
                if pp > 1 and (
                    (batch // count) % dp or schedule_refusal(schedule, pp * v, count, v)
                ):
                    continue
                for zero_stage in (0, 1, 2, 3) if dp > 1 else (0,):
                    for sequence in (False, True) if tp > 1 else (False,):
                        found.append(Degrees(dp, tp, pp, zero_stage, sequence, count, v))
    return found


def every_degrees(num_devices: int, batch: int) -> list[Degrees]:
    """The whole grid: `all_degrees` under 1F1B, the pipelines again under Interleaved1F1B,
    and each of them also with every layer recomputed (Megatron's full recomputation)."""
    interleaved = [d for d in all_degrees(num_devices, batch, Schedule.INTERLEAVED) if d.pp > 1]
    return [
        replace(d, recompute=recompute)
        for d in all_degrees(num_devices, batch) + interleaved
        for recompute in (RecomputeMode.NONE, RecomputeMode.FULL)
    ]


def shaped_degrees(
    num_devices: int,
    batch: int,
    *,
    pp: int = 1,
    num_microbatches: int = 1,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
    meshes: Collection[tuple[int, ...]] | None = None,
) -> list[Degrees]:
    """The degrees of `all_degrees` with ``pp`` device groups of ``virtual_stages`` stages
    each and ``num_microbatches`` microbatches (one stage by default), each stage on one of
    ``meshes`` if given."""
    return [
        replace(d, virtual_stages=virtual_stages) if d.pp > 1 else d
        for d in all_degrees(num_devices, batch, schedule)
        if d.pp == pp
        and d.num_microbatches == num_microbatches
        and (meshes is None or mesh_of(d.dp, d.tp) in meshes)
    ]


def with_experts(graph: Graph, degrees: Iterable[Degrees]) -> list[Degrees]:
    """``degrees``, and, where ``graph`` has experts' weights (`expert_weights`), each of
    them with dp > 1 again with its experts split along dp (``ep = dp``), as
    ``autoplan.baseline(ep=...)`` writes a mixture of experts."""
    found = list(degrees)
    if not expert_weights(graph):
        return found
    return found + [replace(d, ep=d.dp) for d in found if d.dp > 1 and d.ep == 1]


def batch_of(graph: Graph) -> int:
    """The step's batch: dim 0 of its first input with dims (1 without one)."""
    return next(
        (n.output.shape[0] for n in graph if n.kind == NodeKind.INPUT and n.output.shape), 1
    )


def conventional_plans(
    graph_for: Callable[[int], Graph],
    cluster: Cluster,
    degrees: Iterable[Degrees],
    options: PlanOptions | None = None,
) -> Iterator[tuple[Degrees, Plan]]:
    """The baselines of ``degrees`` that can be written and fit, in order, with their degrees;
    ``graph_for(count)`` is the step traced at the shape of one of ``count`` microbatches
    (asked once per count, in order of first need). Degrees the model does not split by, or
    that do not fit, are skipped (logged at debug level); as the planner does, degrees that
    fit only with recomputation are tried so (`PlanOptions.recompute_tries`: every layer's
    attention core, then every layer) unless ``options.recompute`` says. Degrees asked with
    a ``recompute`` mode are tried in that mode alone; each plan is written once, even if
    both a degree and its recomputed twin are asked."""
    graphs: dict[int, Graph] = {}
    options = options or PlanOptions()
    tried_already: set[Degrees] = set()
    for d in degrees:
        if d.num_microbatches not in graphs:
            graphs[d.num_microbatches] = graph_for(d.num_microbatches)
        graph = graphs[d.num_microbatches]
        tries = (
            options.recompute_tries(graph) if d.recompute == RecomputeMode.NONE else (d.recompute,)
        )
        for recompute in tries:
            tried = replace(d, recompute=recompute)
            if tried in tried_already:
                break
            tried_already.add(tried)
            try:
                plan = baseline_of_graph(
                    graph,
                    cluster,
                    tried.layout,
                    d.pp,
                    d.num_microbatches,
                    options,
                    d.virtual_stages,
                )
            except InfeasiblePlanError as e:
                log.debug("conventional plan %s skipped: %s", tried, e)
                continue
            except AutoplanError as e:
                log.debug("conventional plan %s skipped: %s", tried, e)
                break
            yield tried, plan
            break


def fastest_conventional(
    graph: Graph,
    cluster: Cluster,
    degrees: Iterable[Degrees],
    options: PlanOptions | None = None,
) -> tuple[Degrees, Plan] | None:
    """The fastest of `conventional_plans` of one stage's ``graph`` (a pipeline's: of one
    microbatch) for ``degrees``, with its degrees; None where none can be written and fit."""
    best = None
    for d, plan in conventional_plans(lambda _: graph, cluster, degrees, options):
        if best is None or plan.predicted.step_time_s < best[1].predicted.step_time_s:
            best = (d, plan)
    return best
