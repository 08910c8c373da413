"""Build a baseline `Plan` (the package docstring says what a baseline is).

A one-stage baseline is placed by `autoplan.baselines.propagate` (which splits on ``tp`` what
`autoplan.baselines.regions` finds) and priced as the planner prices its own choice of one
strategy per node (`autoplan.costmodel.step_price.price_step`).

Pipelines (``pp > 1``) split the step as Megatron does: traced at the shape of one
microbatch, it is cut into one layer per repeated block (`autoplan.graph.cut`: the embedding
joins the first, the head and the loss the last), and stage ``s`` of ``pp`` gets a contiguous
run of equally many layers (the first stages one more when ``pp`` does not divide the count).
Each stage runs on ``dp * tp`` devices and is placed as one stage is, on its own graph
(`stage_graph`), where the tensors it receives are inputs: split along dim 0 on dp like the
batch, whole on tp. The tensors it sends leave laid out the same way (read so by its output),
so a tensor-parallel region cut by a stage boundary is not split (it reaches an output).
Stages are priced as the planner prices its own
(`autoplan.costmodel.pipeline_price.price_pipeline`). Interleaved 1F1B (``virtual_stages=v``, as
Megatron's ``--num-layers-per-virtual-pipeline-stage``) splits the layers so into ``pp v``
stages, stage ``s`` on device group ``s mod pp``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.baselines.propagate import (
    Layout,
    assignment_of,
    baseline_strategies,
    boundary,
    mesh_of,
    zero_replicated,
)
from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import PipelinePlan, price_pipeline
from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import price_step
from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.graph.blocks import block_of
from autoplan.graph.capture import as_tuple, capture, microbatch
from autoplan.graph.cut import (
    DEFAULT_MAX_LAYERS,
    Layer,
    StageGraph,
    cut_layers,
    shared_params,
    stage_graph,
)
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import chosen
from autoplan.modes import BaselineStyle, NodeKind, RecomputeMode, Schedule, parse_mode
from autoplan.options import PlanOptions
from autoplan.planfile.assemble import assemble_pipeline_plan, assemble_plan
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import SolverInfo
from autoplan.schedules import schedule_refusal
from autoplan.units import fmt_bytes

GiB = 2**30

log = logging.getLogger(__name__)


def _check_options(
    cluster: Cluster,
    dp: int,
    tp: int,
    pp: int,
    zero_stage: int,
    options: PlanOptions,
    cp: int = 1,
) -> None:
    searched = {
        "mesh_shape": options.mesh_shape,
        "pin": dict(options.pin) or None,
        "pipeline": options.pipeline,
        "num_stages": options.num_stages,
    }
    for name, value in searched.items():
        if value is not None:
            raise AutoplanError(
                f"a baseline takes its mesh and stages from dp, tp and pp, not from options; "
                f"leave PlanOptions.{name} unset (it is {value!r})"
            )
    num_microbatches = options.num_microbatches
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise AutoplanError(f"{name} must be a positive integer, got {value!r}")
    if dp * tp * pp * cp != cluster.num_devices:
        names, values = (
            "dp * tp * pp" + " * cp" * (cp > 1),
            f"{dp} * {tp} * {pp}" + f" * {cp}" * (cp > 1),
        )
        raise AutoplanError(
            f"{names} = {values} = {dp * tp * pp * cp}, but cluster {cluster.name!r} has "
            f"{cluster.num_devices} devices; choose degrees whose product is {cluster.num_devices}"
        )
    if cp > 1 and pp > 1:
        raise AutoplanError(
            f"cp={cp} with pp={pp}: a baseline splits the sequence on one stage only; use pp=1 "
            "(the planner may still choose both)"
        )
    if pp == 1 and num_microbatches not in (None, 1):
        raise AutoplanError(
            f"num_microbatches={num_microbatches} applies to pipeline stages (pp > 1); with "
            "pp=1 leave it out"
        )
    if zero_stage not in (0, 1, 2, 3):
        raise AutoplanError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if zero_stage and dp == 1:
        raise AutoplanError(
            f"zero_stage={zero_stage} splits the optimizer state along the dp axis; it needs dp > 1"
        )


def _check_stages(
    cluster: Cluster,
    dp: int,
    tp: int,
    pp: int,
    num_microbatches: int,
    schedule: str,
    virtual_stages: int,
) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise AutoplanError(
            f"num_microbatches must be a positive integer, got {num_microbatches!r}"
        )
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise AutoplanError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    refusal = schedule_refusal(schedule, pp * virtual_stages, num_microbatches, virtual_stages)
    if refusal:
        raise AutoplanError(refusal)
    size, per_node = dp * tp, cluster.devices_per_node
    if per_node % size and size % per_node:
        raise AutoplanError(
            f"a pipeline stage of dp * tp = {size} devices would straddle the nodes of cluster "
            f"{cluster.name!r} ({per_node} devices each); choose dp * tp dividing {per_node} "
            "or a multiple of it"
        )


def _schedule(options: PlanOptions, virtual_stages: int) -> str:
    """The schedule a baseline runs: the options', else Interleaved1F1B for stages
    interleaved, else 1F1B."""
    return options.schedule or (
        Schedule.INTERLEAVED if virtual_stages > 1 else Schedule.ONE_F_ONE_B
    )


def _check_batches(
    example_inputs: Any, example_target: Any, dp: int, num_microbatches: int
) -> None:
    named = [(f"input {i}", x) for i, x in enumerate(as_tuple(example_inputs))]
    for what, x in [*named, ("the target", example_target)]:
        if not isinstance(x, torch.Tensor) or not x.dim():
            continue
        batch = x.shape[0]
        if batch % num_microbatches:
            raise AutoplanError(
                f"num_microbatches={num_microbatches} does not divide the batch (dim 0, size "
                f"{batch}) of {what}; use a divisor of {batch}"
            )
        if batch // num_microbatches % dp:
            raise AutoplanError(
                f"dp={dp} does not divide the microbatches of {what} ({batch} in "
                f"{num_microbatches} microbatches of {batch // num_microbatches}); use a batch "
                f"that is a multiple of dp * num_microbatches = {dp * num_microbatches}"
            )


def _torchtitan(
    dp: int, tp: int, zero_stage: int, sequence_parallel: bool, ep: int, cp: int
) -> Layout:
    """torchtitan's Llama plan (``parallelize_llama``) as a layout: its ``apply_tp`` splits
    what Megatron splits (q, k, v and the MLP's gate and up ColwiseParallel, the attention's
    output and the MLP's down RowwiseParallel, the embedding RowwiseParallel, that is along
    the vocabulary, the head ColwiseParallel with its logits left split for the loss,
    ``loss_parallel``) with sequence parallelism (its default: the norms SequenceParallel,
    each block's inputs gathered, each row linear's output reduce-scattered), and
    ``fully_shard`` stores every parameter split over dp, gathers it before use and
    reduce-scatters its gradient (ZeRO-3)."""
    if zero_stage or sequence_parallel or ep > 1 or cp > 1:
        raise AutoplanError(
            f"style='torchtitan' sets FSDP over dp and sequence parallelism itself and has no "
            f"ep or cp here; leave zero_stage ({zero_stage}), sequence_parallel "
            f"({sequence_parallel}), ep ({ep}) and cp ({cp}) at their defaults"
        )
    return Layout(dp, tp, zero_stage=3 if dp > 1 else 0, sequence_parallel=tp > 1)


def _split_layers(graph: Graph, pp: int, virtual_stages: int = 1) -> list[tuple[Layer, ...]]:
    """Megatron's split: one layer per block (without repeated blocks, runs of ops of about
    equal FLOPs, see `autoplan.graph.cut`) in ``pp * virtual_stages`` contiguous runs of equal
    length, the first ones one layer longer when their count does not divide the layers'."""
    blocks = {b for n in graph if n.kind == NodeKind.OP and (b := block_of(n)) is not None}
    layers = cut_layers(graph, len(blocks) or DEFAULT_MAX_LAYERS)
    count = pp * virtual_stages
    if len(layers) < count:
        names = ", ".join(layer.name for layer in layers)
        asked = f"pp={pp}" if virtual_stages == 1 else f"pp * virtual_stages = {count}"
        raise AutoplanError(
            f"{asked}, but the model has {len(layers)} layer(s) to split into stages ({names}); "
            f"use at most {len(layers)} stages"
        )
    size, extra = divmod(len(layers), count)
    bounds = [s * size + min(s, extra) for s in range(count + 1)]
    return [layers[start:stop] for start, stop in itertools.pairwise(bounds)]


def _one_stage(
    graph: Graph, cluster: Cluster, layout: Layout, optimizer: str, limit: float
) -> Plan:
    space = baseline_strategies(graph, layout)
    mesh_shape = layout.mesh_shape
    recompute = chosen(graph, DEFAULT_MAX_LAYERS, layout.recompute)
    pricer = Pricer(cluster, mesh_shape, optimizer, recompute)
    assignment = assignment_of(space)
    rules = {name: ns.source for name, ns in space.items()}
    step = price_step(graph, assignment, pricer)
    # nothing is solved: the objective is the step's price, as a pipeline plan's
    solver = SolverInfo("baseline", step.time_s, 0.0, 0, 0, 0, (mesh_shape,))
    return assemble_plan(
        graph, cluster, mesh_shape, assignment, step, rules, solver, limit, recompute
    )


# the stages of a step depend on pp (and virtual_stages) alone: all conventional plans of so
# many stages share them
@functools.lru_cache(maxsize=8)
def _stages(
    graph: Graph, pp: int, virtual_stages: int
) -> tuple[tuple[tuple[Layer, ...], ...], tuple[Layer, ...], tuple[StageGraph, ...]]:
    """The layers of each of ``pp * virtual_stages`` stages (`_split_layers`), each stage as
    one layer (the unit `price_pipeline` prices) and as its stage graph."""
    groups = _split_layers(graph, pp, virtual_stages)
    stages = []
    for s, group in enumerate(groups):
        members = {name for layer in group for name in layer.nodes}
        stages.append(Layer(f"stage {s}", tuple(n.name for n in graph if n.name in members)))
    shared = shared_params(graph, stages)
    if shared:
        name, readers = next(iter(shared.items()))
        raise AutoplanError(
            f"parameter {name!r} is read by pipeline stages {list(readers)} (tied weights), "
            "which cannot share it; use pp=1 or untie the weights"
        )
    graphs = tuple(stage_graph(graph, stages, s, s + 1) for s in range(len(stages)))
    return tuple(groups), tuple(stages), graphs


def _pipelined(
    graph: Graph,
    cluster: Cluster,
    layout: Layout,
    pp: int,
    num_microbatches: int,
    schedule: str,
    optimizer: str,
    limit: float,
    virtual_stages: int,
) -> tuple[PipelinePlan, tuple[tuple[Layer, ...], ...]]:
    """``graph`` (one microbatch's step) in the stages of `_split_layers`, each placed on its
    own graph as a one-stage baseline is, priced; with each stage's layers."""
    groups, stages, stage_graphs = _stages(graph, pp, virtual_stages)
    assignments = []
    for s, (group, stage) in enumerate(zip(groups, stage_graphs, strict=True)):
        try:
            space = baseline_strategies(stage.graph, layout, stage.sent, stage.received)
            assignments.append(assignment_of(space))
        except AutoplanError as e:
            names = ", ".join(layer.name for layer in group)
            raise AutoplanError(f"pipeline stage {s} ({names}): {e}") from e
    mesh_shape = mesh_of(layout.dp, layout.tp)
    pipe = price_pipeline(
        graph,
        stages,
        cluster,
        stage_graphs=stage_graphs,
        mesh_shape=mesh_shape,
        boundary=boundary(layout.dp, layout.tp),
        assignments=assignments,
        num_microbatches=num_microbatches,
        schedule=schedule,
        optimizer=optimizer,
        memory_limit=limit,
        virtual_stages=virtual_stages,
        recompute=chosen(graph, DEFAULT_MAX_LAYERS, layout.recompute),
    )
    return pipe, groups


def _conventional_pipeline(
    pipe: PipelinePlan, groups: tuple[tuple[Layer, ...], ...], cluster: Cluster
) -> Plan:
    """The plan of a conventional pipeline, each stage named by its layers."""
    plan = assemble_pipeline_plan(pipe, cluster, (pipe.mesh_shape,))
    named = (
        replace(st, layers=tuple(layer.name for layer in group))
        for st, group in zip(plan.stages, groups, strict=True)
    )
    return replace(plan, stages=tuple(named), solver=replace(plan.solver, status="baseline"))


def baseline(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster | str | Path,
    *,
    dp: int,
    tp: int,
    pp: int = 1,
    virtual_stages: int = 1,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
    ep: int = 1,
    cp: int = 1,
    recompute: RecomputeMode | str = RecomputeMode.NONE,
    style: BaselineStyle | str = BaselineStyle.MEGATRON,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    options: PlanOptions | None = None,
) -> Plan:
    """The conventional plan of ``model`` on ``cluster``: Megatron tensor parallelism over
    ``tp`` devices (`autoplan.baselines.regions` says which linears it splits) and data
    parallelism over ``dp`` (inputs and target split along dim 0), on mesh ``(dp, tp)`` (1-D
    if one is 1), in ``pp`` pipeline stages.

    ``zero_stage=3`` stores parameters, with their gradients and optimizer state, split along
    the dp axis and gathers each before use (ZeRO-3 / FSDP). ``zero_stage=1`` keeps parameters
    and gradients as data parallelism does (gradients all-reduced) and splits the optimizer
    state along the dp axis: each rank updates its shard, and the shards are all-gathered
    after the step; ``zero_stage=2`` splits the gradients too (reduce-scattered). A parameter
    with no dim divisible by ``dp`` stays replicated (with a warning).

    ``sequence_parallel=True`` adds Megatron's sequence parallelism on the tp axis: the ops
    between tensor-parallel regions (layer norms, residual adds, dropout) run split along the
    sequence (dim 1), a row linear's partial sums are reduce-scattered and gathered again
    before the next column linear, in place of the all-reduce.

    ``ep=dp`` splits the experts of a mixture of experts along the dp axis (GShard): their
    weights (parameters of three or more dims read only by einsums, experts along dim 0)
    are stored and used split by expert, and tokens go to their experts' devices and back
    by all-to-all.

    ``cp=n`` adds context parallelism on a ``cp`` axis of ``n`` devices (Megatron's mesh
    order: dp, cp, tp): the inputs and target split along dim 1, the sequence, and every op
    following them; attention takes its block of queries against the keys and values
    all-gathered (`autoplan.strategies.attention`), parameters are whole on cp and their
    gradients all-reduced over it. One stage only (``pp=1``).

    ``recompute="full"`` recomputes every layer's blocks in backward (Megatron's full
    activation recomputation, `autoplan.graph.recompute`), ``recompute="selective"`` only
    their attention cores (Megatron's selective recomputation), ``recompute="ops"`` all but
    the ops torchtitan's op-level selective checkpointing saves; so does
    ``options.recompute``.

    ``pp > 1`` splits the step, traced at the shape of one of ``options.num_microbatches``
    (default ``pp``) microbatches, into ``pp`` stages of equal layer counts (this module's
    docstring says how), run with ``options.schedule`` (default "1F1B"); on mesh
    ``("pp", dp, tp)``. ``virtual_stages=v`` (2 or more) runs Interleaved1F1B instead: the
    layers split so into ``pp v`` stages, stage ``s`` on device group ``s mod pp``.
    ``options`` also give the optimizer and the memory budget; what the planner would search
    (mesh, pins, stages) must be left unset.

    ``style="torchtitan"`` is torchtitan's Llama plan (`_torchtitan`): the same tensor
    parallelism, always with sequence parallelism, and FSDP over dp, which is
    ``zero_stage=3`` (so ``zero_stage``, ``sequence_parallel``, ``ep`` and ``cp`` are left
    out). Unlike FSDP2 by default, the parameters gathered in forward are kept for backward
    (torchtitan's ``fsdp_reshard_after_forward="never"``, its default under pipelines), and
    each is split along a dim its tp split leaves whole, not always dim 0 (the same bytes).

    ``dp * tp * pp * cp`` must equal the cluster's device count. Time and memory are predicted by
    the planner's cost model; a baseline that does not fit in ``options.memory_fraction`` of
    device memory raises `InfeasiblePlanError`.
    """
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    options = options or PlanOptions()
    _check_options(cluster, dp, tp, pp, zero_stage, options, cp)
    if ep not in (1, dp) or (ep > 1 and zero_stage == 3):
        raise AutoplanError(
            f"ep={ep}: experts are split along the whole dp axis (GShard), so ep must be 1 or "
            f"dp={dp}, and without ZeRO-3 (zero_stage={zero_stage})"
        )
    mode = parse_mode(RecomputeMode, recompute, "recompute")
    if parse_mode(BaselineStyle, style, "style") == BaselineStyle.TORCHTITAN:
        layout = replace(_torchtitan(dp, tp, zero_stage, sequence_parallel, ep, cp), recompute=mode)
        zero_stage = layout.zero_stage
    else:
        layout = Layout(dp, tp, zero_stage, sequence_parallel, ep, mode, cp=cp)
    count = 1
    if pp > 1:
        count = pp if options.num_microbatches is None else options.num_microbatches
        _check_stages(
            cluster, dp, tp, pp, count, _schedule(options, virtual_stages), virtual_stages
        )
        _check_batches(example_inputs, example_target, dp, count)
    elif virtual_stages != 1:
        raise AutoplanError(f"virtual_stages={virtual_stages} applies to pipelines (pp > 1)")
    inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
    graph = capture(model, inputs, loss_fn, target, options.mixed_precision)
    plan = baseline_of_graph(graph, cluster, layout, pp, count, options, virtual_stages)
    kept = zero_replicated(graph, layout) if zero_stage else []
    if kept:
        log.warning(
            "ZeRO-%d: no dim of %s splits dp=%d ways (or it is stored strided); kept replicated",
            zero_stage,
            ", ".join(kept),
            dp,
        )
    return plan


def baseline_of_graph(
    graph: Graph,
    cluster: Cluster,
    layout: Layout,
    pp: int = 1,
    num_microbatches: int = 1,
    options: PlanOptions | None = None,
    virtual_stages: int = 1,
) -> Plan:
    """`baseline` of a step already traced (`autoplan.graph.capture`), at the shape of one of
    ``num_microbatches`` microbatches when ``pp > 1``; ``options`` give the schedule, the
    optimizer and the memory budget. Raises `InfeasiblePlanError` if it does not fit."""
    options = options or PlanOptions()
    if options.recompute not in (None, RecomputeMode.NONE):
        layout = replace(layout, recompute=options.recompute)
    if options.float32_grads:
        layout = replace(layout, float32_grads=True)
    dp, tp = layout.dp, layout.tp
    schedule = _schedule(options, virtual_stages)
    optimizer, memory_fraction = options.optimizer, options.memory_fraction
    limit = cluster.device.tensor_bytes(memory_fraction)
    degrees = f"dp={dp} tp={tp}" + f" cp={layout.cp}" * (layout.cp > 1)
    degrees += f" recompute={layout.recompute}" * (layout.recompute != RecomputeMode.NONE)

    def refuse_unless_fits(need: float) -> None:
        if need > limit:
            raise InfeasiblePlanError(
                f"the baseline {degrees} zero_stage={layout.zero_stage} needs "
                f"{fmt_bytes(need)} per device, but a device of cluster {cluster.name!r} "
                f"offers {fmt_bytes(limit)} "
                f"({cluster.device.tensor_bytes_words(memory_fraction)})"
            )

    if pp == 1:
        plan = _one_stage(graph, cluster, layout, optimizer, limit)
        refuse_unless_fits(plan.predicted.peak_memory_bytes)
        return plan
    _check_stages(cluster, dp, tp, pp, num_microbatches, schedule, virtual_stages)
    degrees += f" pp={pp} num_microbatches={num_microbatches}"
    degrees += f" virtual_stages={virtual_stages}" * (virtual_stages > 1)
    pipe, groups = _pipelined(
        graph, cluster, layout, pp, num_microbatches, schedule, optimizer, limit, virtual_stages
    )
    refuse_unless_fits(max(pipe.stage_memory(s) for s in range(len(pipe.stages))))
    return _conventional_pipeline(pipe, groups, cluster)  # written only once it fits
