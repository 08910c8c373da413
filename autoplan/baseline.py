"""Baselines: the conventional hand-written plan of a model, as a `Plan`.

``baseline(model, inputs, cluster, dp=2, tp=4)`` is Megatron-style tensor parallelism over
groups of ``tp`` devices and data parallelism over ``dp`` such groups, optionally with ZeRO-3.
Every node's placement is fixed (nothing is searched) and priced by the planner's cost model,
so a baseline is shown, estimated, compared and executed like any plan.

Each mesh axis is placed by *propagation*: parameters and inputs are seeded, and each op in
graph order takes the first of its own sharding rules (`axis_rules`: ours, else DTensor's)
that accepts its inputs as their producers place them; an op with no such rule runs
replicated on that axis (its inputs gathered, partial sums all-reduced). On the ``dp`` axis
the inputs (and target) are split along dim 0 and parameters replicated (ZeRO-3: stored split,
gathered before use), so every op follows the batch and the loss ends as partial sums.

On the ``tp`` axis, which linears Megatron splits is found in the traced graph, not from
parameter names. Activations outside a tensor-parallel *region* are replicated. A region
starts at *column* linears (``aten.linear`` reading an activation outside any region: the
residual stream, a normalized activation, an input); their output is split along its last
dim. The split follows every op that has a rule taking the split inputs, with its other inputs
replicated, to a split output: views and transposes that keep the split dim whole, attention
over split heads, activation functions, products of two split tensors. A region ends at *row*
linears that contract the split dim; their partial sums are all-reduced by the next op.
Regions that meet at an op are one region. A region is kept only if every path out of it
ends at a row linear; one that reaches anything else (a normalization or residual add over the
split dim, the loss, the output, a view that moves the split dim) stays replicated, as do
linears whose weight or bias another op also reads (tied weights). Column weights and biases
are split ``S(0)`` (output features), row weights ``S(1)`` (input features), row biases are
stored replicated and read as partial sums (added on one rank).

Limits: only ``aten.linear`` is split, not ``matmul`` with a parameter, convolutions or
embeddings (no vocabulary-parallel embedding or head); a parameter read inside a region by
anything but its linears breaks the region; a fused projection chunked along its features
(one ``qkv`` linear, then ``chunk``) stays replicated, since a plain row split of its weight
would mix the pieces (Megatron interleaves them); no sequence parallelism.

Pipelines (``pp > 1``) split the step as Megatron does: traced at the shape of one
microbatch, it is cut into one layer per repeated block (`autoplan.graph.cut`: the embedding
joins the first, the head and the loss the last), and stage ``s`` of ``pp`` gets a contiguous
run of equally many layers (the first stages one more when ``pp`` does not divide the count).
Each stage runs on ``dp * tp`` devices and is placed as above on its own graph
(`stage_graph`), where the tensors it receives are inputs: split along dim 0 on dp like the
batch, whole on tp. The tensors it sends leave laid out the same way (read so by its output),
so a tensor-parallel region cut by a stage boundary is not split (it reaches an output).
Stages are priced as the planner prices its own (`autoplan.search.pipeline_price.price_pipeline`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.api import check_budget
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.graph.blocks import BlockSharing, block_of
from autoplan.graph.capture import as_tuple, capture, microbatch
from autoplan.graph.cut import DEFAULT_MAX_LAYERS, Layer, cut_layers, shared_params, stage_graph
from autoplan.graph.ir import INPUT, OP, OUTPUT, PARAM, Graph, Node
from autoplan.planfile.assemble import make_pipeline_plan, make_plan
from autoplan.planfile.schema import Plan
from autoplan.schedules import check_schedule, schedule_refusal
from autoplan.search.intra_op import IntraOpResult, build_problem
from autoplan.search.pipeline_price import price_pipeline
from autoplan.search.step_price import price_step
from autoplan.solve.evaluate import evaluate
from autoplan.solve.problem import IntraOpSolution
from autoplan.strategies.placement import P, R, Spec, shard, shard_dim
from autoplan.strategies.pricing import Pricer
from autoplan.strategies.rules import AxisRule
from autoplan.strategies.space import NodeStrategies, Strategy, axis_rules, node_strategies

log = logging.getLogger(__name__)

GiB = 2**30
LINEAR = "aten.linear.default"

Seeds = Mapping[str, tuple[str, str]]  # param / input node -> (stored, read) on one mesh axis


@dataclass(frozen=True)
class Region:
    """One tensor-parallel region: linears split by output features, then by input features."""

    columns: tuple[str, ...]  # linear node names, in graph order
    rows: tuple[str, ...]
    split: tuple[tuple[str, int], ...]  # (node, dim) of every split activation inside


def _rule_for(node: Node, graph: Graph, inputs: tuple[str, ...]) -> AxisRule | None:
    """The first per-axis rule of ``node`` that takes its inputs placed as ``inputs``."""
    if all(p == R for p in inputs):
        return (R, *inputs)
    rules, _ = axis_rules(node, graph)
    return next((rule for rule in rules if rule[1:] == inputs), None)


def _own_params(graph: Graph, node: Node) -> bool:
    """The linear's weight (and bias) are parameters that no other op reads."""
    return all(
        graph.node(r.name).kind == PARAM and graph.users(r.name) == (node.name,)
        for r in node.refs[1:]
    )


def _is_row(graph: Graph, node: Node, split: Mapping[str, int]) -> bool:
    """A linear whose only split input is its activation, split along the contracted dim."""
    x = node.refs[0].name
    return (
        node.op == LINEAR
        and [r.name for r in node.refs if r.name in split] == [x]
        and split[x] == len(graph.node(x).outputs[0].shape) - 1
        and _own_params(graph, node)
    )


def find_regions(graph: Graph) -> tuple[Region, ...]:
    """Megatron's tensor-parallel regions of ``graph`` (see the module docstring)."""
    split: dict[str, int] = {}  # activation inside a region -> its split dim
    parent: dict[str, str] = {}  # union-find over column linears; a class is one region
    region_of: dict[str, str] = {}  # split activation or row linear -> a column of its region
    rows: set[str] = set()
    broken: set[str] = set()

    def find(column: str) -> str:
        while parent[column] != column:
            column = parent[column]
        return column

    for node in graph:
        if node.kind not in (OP, OUTPUT):
            continue
        inside = [r.name for r in node.refs if r.name in split]
        if not inside:
            x = graph.node(node.refs[0].name) if node.refs else None
            if node.op == LINEAR and x is not None and x.kind != PARAM and _own_params(graph, node):
                split[node.name] = len(node.output.shape) - 1
                parent[node.name] = region_of[node.name] = node.name
            continue
        roots = sorted({find(region_of[name]) for name in inside})
        for other in roots[1:]:
            parent[other] = roots[0]
        if _is_row(graph, node, split):
            rows.add(node.name)  # its output is replicated again (after the all-reduce)
            region_of[node.name] = roots[0]
            continue
        ins = tuple(shard(split[r.name]) if r.name in split else R for r in node.refs)
        rule = _rule_for(node, graph, ins) if node.kind == OP else None
        dim = shard_dim(rule[0]) if rule is not None else None
        if dim is None:
            broken.add(roots[0])
        else:
            split[node.name] = dim
            region_of[node.name] = roots[0]

    members: dict[str, list[str]] = {}
    for name in region_of:  # graph order
        members.setdefault(find(region_of[name]), []).append(name)
    broken = {find(c) for c in broken}
    regions = []
    for root, names in members.items():
        if root not in broken and any(n in rows for n in names):
            regions.append(
                Region(
                    columns=tuple(n for n in names if n in parent),
                    rows=tuple(n for n in names if n in rows),
                    split=tuple((n, split[n]) for n in names if n in split),
                )
            )
    return tuple(regions)


def _check_tp_divides(graph: Graph, regions: Sequence[Region], tp: int) -> None:
    for region in regions:
        for linear, dim in [(c, 0) for c in region.columns] + [(r, 1) for r in region.rows]:
            weight = graph.node(graph.node(linear).refs[1].name)
            size = weight.output.shape[dim]
            if size % tp:
                kind = "column" if dim == 0 else "row"
                raise AutoplanError(
                    f"tp={tp} does not divide dim {dim} (size {size}) of parameter "
                    f"{weight.target!r}, which the {kind}-parallel split of its linear cuts; "
                    "choose a tp that divides it"
                )
        for name, dim in region.split:
            node = graph.node(name)
            size = node.outputs[0].shape[dim]
            if size % tp:
                where = node.module_path or "the top-level module"
                raise AutoplanError(
                    f"tp={tp} does not divide dim {dim} (size {size}) of {node.op} in {where}, "
                    "which the tensor-parallel split runs through (e.g. the number of attention "
                    "heads); choose a tp that divides it"
                )


def _tp_seeds(graph: Graph, tp: int) -> dict[str, tuple[str, str]]:
    regions = find_regions(graph)
    if not regions:
        raise AutoplanError(
            f"tp={tp}, but the model has no linears Megatron would split (a linear whose output "
            "reaches only other linears, through element-wise ops, views or attention); use tp=1"
        )
    _check_tp_divides(graph, regions, tp)
    log.info(
        "tp=%d: %d tensor-parallel regions, %d column and %d row linears split",
        tp,
        len(regions),
        sum(len(r.columns) for r in regions),
        sum(len(r.rows) for r in regions),
    )
    seeds = {}
    for region in regions:
        for column in region.columns:
            seeds.update({r.name: (shard(0), shard(0)) for r in graph.node(column).refs[1:]})
        for row in region.rows:
            weight, *bias = graph.node(row).refs[1:]
            seeds[weight.name] = (shard(1), shard(1))
            seeds.update({b.name: (R, P) for b in bias})  # added on one rank: a partial sum
    return seeds


def _zero3_storage(node: Node, tp_storage: str, dp: int, tp: int) -> str:
    """How ZeRO-3 stores a parameter on the dp axis: split along a dim the tp split leaves
    whole if one divides by dp (so a gather on dp alone restores what tp reads), else along
    the tp-split dim if it divides by dp * tp, else replicated."""
    shape = node.output.shape
    tp_dim = shard_dim(tp_storage)
    for d, size in enumerate(shape):
        if d != tp_dim and size % dp == 0:
            return shard(d)
    if tp_dim is not None and shape[tp_dim] % (dp * tp) == 0:
        return shard(tp_dim)
    return R


def _dp_seeds(
    graph: Graph, dp: int, tp: int, zero_stage: int, tp_seeds: Seeds
) -> dict[str, tuple[str, str]]:
    seeds = {}
    kept = []
    for i, node in enumerate(n for n in graph if n.kind == INPUT):
        if not node.output.shape or node.output.shape[0] % dp:
            raise AutoplanError(
                f"dp={dp} does not divide the batch (dim 0) of input {i} ({node.target!r}, shape "
                f"{node.output.shape}); use a batch size that is a multiple of {dp}"
            )
        seeds[node.name] = (shard(0), shard(0))
    if zero_stage == 3:
        for node in graph.params:
            if node.needs_grad:
                storage = _zero3_storage(node, tp_seeds.get(node.name, (R, R))[0], dp, tp)
                seeds[node.name] = (storage, R)
                if storage == R:
                    kept.append(node.target)
    if kept:
        log.warning("ZeRO-3: no dim of %s divides by dp=%d; kept replicated", ", ".join(kept), dp)
    return seeds


def _propagate(graph: Graph, seeds: Seeds) -> dict[str, AxisRule]:
    """One mesh axis: every node's (output, input...) placements, from the seeds. Ops read
    partial sums all-reduced (Megatron's all-reduce after a row linear, the loss's on dp)."""
    read: dict[str, str] = {}  # how consumers read each node's output
    placed: dict[str, AxisRule] = {}
    for node in graph:
        if node.kind in (PARAM, INPUT):
            stored, read[node.name] = seeds.get(node.name, (R, R))
            placed[node.name] = (stored,)
            continue
        ins = tuple(read[r.name] for r in node.refs)
        rule = _rule_for(node, graph, ins) if node.kind == OP else None
        placed[node.name] = rule if rule is not None else (R,) * (1 + len(ins))
        # partial sums are all-reduced for the next op, as Megatron does after a row linear
        read[node.name] = R if placed[node.name][0] == P else placed[node.name][0]
    return placed


def _strategies(
    graph: Graph, dp: int, tp: int, zero_stage: int, sent: Collection[str] = ()
) -> dict[str, NodeStrategies]:
    """Each node's one strategy in the baseline, on mesh `_mesh_shape(dp, tp)`. On a pipeline
    stage's graph, the tensors received are inputs (seeded as the batch is: the `_boundary`
    placement) and the output reads those ``sent`` on in the `_boundary` placement."""
    tp_seeds = _tp_seeds(graph, tp) if tp > 1 else {}
    seeds = [_dp_seeds(graph, dp, tp, zero_stage, tp_seeds)] if dp > 1 else []
    seeds += [tp_seeds] if tp > 1 else []
    mesh_shape = _mesh_shape(dp, tp)
    per_axis = [_propagate(graph, s) for s in seeds or [{}]]  # one device: all replicated
    space = {}
    for node in graph:
        rules = [placed[node.name] for placed in per_axis]
        strategy = Strategy(
            output=tuple(r[0] for r in rules) if node.outputs else (),
            inputs=tuple(tuple(r[i + 1] for r in rules) for i in range(len(node.refs))),
        )
        if node.kind == OUTPUT:
            inputs = zip(node.refs, strategy.inputs, strict=True)
            strategy = Strategy(
                (), tuple(_boundary(dp, tp) if r.name in sent else spec for r, spec in inputs)
            )
            space[node.name] = NodeStrategies(node.name, (strategy,), "output")
            continue
        allowed = node_strategies(node, graph, mesh_shape)
        if strategy not in allowed.strategies:
            raise AutoplanError(
                f"the baseline places {node.op} in {node.module_path or 'the top level'!r} "
                f"({node.name}) as {_text(strategy.output)} from {_text(*strategy.inputs)}, "
                f"which does not split evenly on mesh {mesh_shape}; choose other dp/tp degrees"
            )
        space[node.name] = NodeStrategies(node.name, (strategy,), allowed.source)
    return space


def _assignment(space: Mapping[str, NodeStrategies]) -> dict[str, Strategy]:
    return {name: ns.strategies[0] for name, ns in space.items()}


def _text(*specs: Spec) -> str:
    return ", ".join("(" + ", ".join(s) + ")" for s in specs)


def _mesh_shape(dp: int, tp: int) -> tuple[int, ...]:
    """``(dp, tp)`` when both are > 1, else the one that is (``(1,)`` on a single device)."""
    return tuple(n for n in (dp, tp) if n > 1) or (1,)


def _boundary(dp: int, tp: int) -> Spec:
    """How tensors cross pipeline stages on mesh `_mesh_shape(dp, tp)`: each dp group's slice
    of the batch, whole on tp (as Megatron keeps the residual stream between blocks)."""
    return (shard(0),) * (dp > 1) + (R,) * (tp > 1) or (R,)


def _check_options(
    cluster: Cluster,
    dp: int,
    tp: int,
    pp: int,
    num_microbatches: int | None,
    zero_stage: int,
    optimizer: str,
    memory_fraction: float,
) -> None:
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise AutoplanError(f"{name} must be a positive integer, got {value!r}")
    if dp * tp * pp != cluster.num_devices:
        raise AutoplanError(
            f"dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp}, but cluster {cluster.name!r} "
            f"has {cluster.num_devices} devices; choose degrees whose product is "
            f"{cluster.num_devices}"
        )
    if pp == 1 and num_microbatches not in (None, 1):
        raise AutoplanError(
            f"num_microbatches={num_microbatches} applies to pipeline stages (pp > 1); with "
            "pp=1 leave it out"
        )
    if zero_stage in (1, 2):
        raise AutoplanError(
            f"zero_stage={zero_stage} cannot be written in a plan: a plan stores each parameter "
            "together with its gradient and optimizer state, so the optimizer state (ZeRO-1) "
            "or gradients (ZeRO-2) cannot be split alone; use zero_stage=0 or 3"
        )
    if zero_stage not in (0, 3):
        raise AutoplanError(f"zero_stage must be 0 or 3, got {zero_stage!r}")
    if zero_stage == 3 and dp == 1:
        raise AutoplanError("zero_stage=3 splits parameters along the dp axis; it needs dp > 1")
    check_budget(optimizer, memory_fraction)


def _check_pipeline(
    cluster: Cluster,
    example_inputs: Any,
    example_target: Any,
    dp: int,
    tp: int,
    pp: int,
    num_microbatches: int,
    schedule: str,
) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise AutoplanError(
            f"num_microbatches must be a positive integer, got {num_microbatches!r}"
        )
    refusal = schedule_refusal(schedule, pp, num_microbatches)
    if refusal:
        raise AutoplanError(refusal)
    size, per_node = dp * tp, cluster.devices_per_node
    if per_node % size and size % per_node:
        raise AutoplanError(
            f"a pipeline stage of dp * tp = {size} devices would straddle the nodes of cluster "
            f"{cluster.name!r} ({per_node} devices each); choose dp * tp dividing {per_node} "
            "or a multiple of it"
        )
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


def _split_layers(graph: Graph, pp: int) -> list[tuple[Layer, ...]]:
    """Megatron's split: one layer per block (without repeated blocks, runs of ops of about
    equal FLOPs, see `autoplan.graph.cut`) in ``pp`` contiguous runs of equal length, the
    first ones one layer longer when ``pp`` does not divide the layer count."""
    blocks = {b for n in graph if n.kind == OP and (b := block_of(n)) is not None}
    layers = cut_layers(graph, len(blocks) or DEFAULT_MAX_LAYERS)
    if len(layers) < pp:
        names = ", ".join(layer.name for layer in layers)
        raise AutoplanError(
            f"pp={pp}, but the model has {len(layers)} layer(s) to split into stages ({names}); "
            f"use pp <= {len(layers)}"
        )
    size, extra = divmod(len(layers), pp)
    bounds = [s * size + min(s, extra) for s in range(pp + 1)]
    return [layers[start:stop] for start, stop in itertools.pairwise(bounds)]


def _one_stage(
    graph: Graph, cluster: Cluster, dp: int, tp: int, zero_stage: int, optimizer: str, limit: float
) -> Plan:
    space = _strategies(graph, dp, tp, zero_stage)
    mesh_shape = _mesh_shape(dp, tp)
    costs = Pricer(cluster, mesh_shape, optimizer)
    problem, _ = build_problem(graph, BlockSharing(blocks={}, canonical={}), space, costs, limit)
    choice = (0,) * problem.num_groups
    solution = IntraOpSolution(choice, evaluate(problem, choice).objective, "baseline", 0.0, 0, 0)
    assignment = _assignment(space)
    result = IntraOpResult(mesh_shape, assignment, solution, problem)
    rules = {name: ns.source for name, ns in space.items()}
    return make_plan(
        graph, cluster, result, price_step(graph, assignment, costs), rules, (mesh_shape,)
    )


def _pipelined(
    graph: Graph,
    cluster: Cluster,
    dp: int,
    tp: int,
    pp: int,
    num_microbatches: int,
    schedule: str,
    zero_stage: int,
    optimizer: str,
    limit: float,
) -> Plan:
    """``graph`` (one microbatch's step) in the stages of `_split_layers`, each placed on its
    own graph as a one-stage baseline is."""
    groups = _split_layers(graph, pp)
    stages = []  # each stage as one layer, the unit `price_pipeline` prices
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
    assignments = []
    for s, group in enumerate(groups):
        stage = stage_graph(graph, stages, s, s + 1)
        try:
            assignments.append(
                _assignment(_strategies(stage.graph, dp, tp, zero_stage, stage.sent))
            )
        except AutoplanError as e:
            names = ", ".join(layer.name for layer in group)
            raise AutoplanError(f"pipeline stage {s} ({names}): {e}") from e
    mesh_shape = _mesh_shape(dp, tp)
    pipe = price_pipeline(
        graph,
        tuple(stages),
        cluster,
        mesh_shape=mesh_shape,
        boundary=_boundary(dp, tp),
        assignments=assignments,
        num_microbatches=num_microbatches,
        schedule=schedule,
        optimizer=optimizer,
        memory_limit=limit,
    )
    plan = make_pipeline_plan(pipe, cluster, (mesh_shape,))
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
    num_microbatches: int | None = None,
    zero_stage: int = 0,
    schedule: str = "1F1B",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    optimizer: str = "adamw",
    memory_fraction: float = 0.9,
) -> Plan:
    """The conventional plan of ``model`` on ``cluster``: Megatron tensor parallelism over
    ``tp`` devices (the module docstring says which linears it splits) and data parallelism
    over ``dp`` (inputs and target split along dim 0), on mesh ``(dp, tp)`` (1-D if one is 1),
    in ``pp`` pipeline stages.

    ``zero_stage=3`` stores parameters, with their gradients and optimizer state, split along
    the dp axis and gathers each before use (ZeRO-3 / FSDP); a parameter with no dim divisible
    by ``dp`` stays replicated (with a warning). Stages 1 and 2 (only the optimizer state, or
    it and the gradients, split) cannot be written in a plan, whose storage placement covers a
    parameter together with its gradient and optimizer state: they raise an error.

    ``pp > 1`` splits the step, traced at the shape of one of ``num_microbatches`` (default
    ``pp``) microbatches, into ``pp`` stages of equal layer counts (the module docstring says
    how), run with ``schedule`` ("1F1B" or "GPipe"); on mesh ``("pp", dp, tp)``.

    ``dp * tp * pp`` must equal the cluster's device count. Time and memory are predicted by
    the planner's cost model; a baseline that does not fit in ``memory_fraction`` of device
    memory raises `InfeasiblePlanError`.
    """
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    _check_options(cluster, dp, tp, pp, num_microbatches, zero_stage, optimizer, memory_fraction)
    schedule = check_schedule(schedule)
    limit = cluster.device.memory_bytes * memory_fraction
    degrees = f"dp={dp} tp={tp}"
    if pp == 1:
        graph = capture(model, example_inputs, loss_fn, example_target)
        plan = _one_stage(graph, cluster, dp, tp, zero_stage, optimizer, limit)
    else:
        count = pp if num_microbatches is None else num_microbatches
        _check_pipeline(cluster, example_inputs, example_target, dp, tp, pp, count, schedule)
        inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
        graph = capture(model, inputs, loss_fn, target)
        plan = _pipelined(graph, cluster, dp, tp, pp, count, schedule, zero_stage, optimizer, limit)
        degrees += f" pp={pp} num_microbatches={count}"
    need = plan.predicted.peak_memory_bytes
    if need > limit:
        raise InfeasiblePlanError(
            f"the baseline {degrees} zero_stage={zero_stage} needs {need / GiB:.2f} GiB per "
            f"device, but a device of cluster {cluster.name!r} offers {limit / GiB:.2f} GiB "
            f"({memory_fraction:.0%} of {cluster.device.memory_bytes / GiB:.0f} GiB)"
        )
    return plan
