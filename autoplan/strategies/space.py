"""The strategy space: every node's candidate placements over a logical mesh.

An op's candidates are the product over mesh axes of its per-axis rules (ours first, then
DTensor's, else replicated only), kept where every tensor splits evenly. A parameter's
candidates are its *storage* placements; the placement an op needs is chosen by the op, and
the edge between them carries the all-gather (ZeRO-3 / FSDP) and the gradient reduction.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from autoplan.graph.flops import GROUPED_MMS
from autoplan.graph.ir import Graph, Node, Ref, TensorInfo, itemsize
from autoplan.modes import NodeKind
from autoplan.strategies import dtensor_rules, grouped_mm, routing, strided
from autoplan.strategies.buckets import FIRST_BUCKET_BYTES
from autoplan.strategies.placement import (
    P,
    R,
    Spec,
    grad_spec,
    is_valid,
    on_mesh,
    pieces,
    replicated,
    shard,
    without_partial,
)
from autoplan.strategies.rules import AxisRule, own_rule
from autoplan.strategies.zero_state import state_specs

log = logging.getLogger(__name__)

# a parameter smaller than DDP's first gradient bucket (1 MiB) is left out of the search's
# ZeRO candidates: its state saves at most 3 MiB of AdamW moments a device, for two
# collectives of latency each step
ZERO_MIN_BYTES = FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class Strategy:
    output: Spec  # placement of every output of the node
    inputs: tuple[Spec, ...]  # required placement of each tensor input (Node.refs order)
    # where the output's gradient is kept: None for the output's placement with partial sums
    # reduced; else P on the axes where a replicated op keeps it partial (see `kept_partial`)
    grad: Spec | None = None
    # a parameter's optimizer state where split further than it is stored (ZeRO-1/2,
    # `autoplan.strategies.zero_state`; its gradient then kept as stored, or, with ``grad`` the
    # state's placement, split as the state); None: kept as the parameter is stored
    state: Spec | None = None

    @property
    def grad_target(self) -> Spec:
        """The placement the gradients of the output's users are brought to and summed in."""
        return self.grad if self.grad is not None else without_partial(self.output)


def input_grad(consumer: Node, strategy: Strategy, index: int) -> Spec:
    """Where the gradient of input ``index`` of ``consumer`` (run as ``strategy``) arrives:
    `grad_spec` of the op; of the step's output, the placement it reads, partial sums
    reduced: a tensor a pipeline stage sends gets its gradient back so placed from the next
    stage (the loss's, a replicated 1, moves nothing)."""
    placement = strategy.inputs[index]
    if consumer.kind == NodeKind.OUTPUT:
        return without_partial(placement)
    return grad_spec(placement, strategy.output, strategy.grad)


@dataclass(frozen=True)
class NodeStrategies:
    node: str
    strategies: tuple[Strategy, ...]
    source: str  # "ours" | "dtensor" | "replicated" | "storage" | "data" | "output"


def _all_shardings(shape: tuple[int, ...], strided_options: Sequence[str] = ()) -> list[str]:
    return [R, *(shard(d) for d in range(len(shape)) if shape[d] > 1), *strided_options]


def _storage_strategies(
    info: TensorInfo, mesh_shape: tuple[int, ...], strided_options: Sequence[str] = ()
) -> list[Strategy]:
    options = _all_shardings(info.shape, strided_options)
    per_axis = [options if size > 1 else [R] for size in mesh_shape]
    return [
        Strategy(spec, ())
        for spec in itertools.product(*per_axis)
        if is_valid(spec, info.shape, mesh_shape)
    ]


def _zero_strategies(
    node: Node, stored: Sequence[Strategy], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """A trained parameter's ZeRO-1 and ZeRO-2 candidates for each storage candidate (none
    for a strided one)."""
    if not node.needs_grad:
        return []
    return [
        Strategy(s.output, (), grad, state)
        for s in stored
        if all(pieces(p) == 1 for p in s.output)
        for state in state_specs(s.output, node.output.shape, mesh_shape)
        for grad in (None, state)
    ]


def searched(
    space: Mapping[str, NodeStrategies], graph: Graph, mesh_shape: tuple[int, ...]
) -> dict[str, NodeStrategies]:
    """``space`` less the ZeRO candidates the search leaves out, to keep the ILP small: those
    of parameters under `ZERO_MIN_BYTES`, ZeRO-1 (ZeRO-2 keeps less memory, and its gradient
    is reduce-scattered rather than all-reduced whole) and states split along only some of
    the axes where a parameter is stored whole (the search splits them along all of them). A
    node left with none of its candidates by that (pinned so) keeps them."""
    out = {}
    for name, ns in space.items():
        info = graph.node(name).output if graph.node(name).kind == NodeKind.PARAM else None
        small = info is not None and math.prod(info.shape) * itemsize(info.dtype) < ZERO_MIN_BYTES
        kept = tuple(
            s for s in ns.strategies if s.state is None or (not small and _searched(s, mesh_shape))
        )
        out[name] = replace(ns, strategies=kept) if kept else ns
    return out


def _searched(s: Strategy, mesh_shape: tuple[int, ...]) -> bool:
    assert s.state is not None
    whole = [p == R and size > 1 for p, size in zip(s.output, mesh_shape, strict=True)]
    split = [p != q for p, q in zip(s.output, s.state, strict=True)]
    return s.grad == s.state and split == whole


def axis_rules(node: Node, graph: Graph) -> tuple[list[AxisRule], str]:
    """``node``'s rules on one mesh axis (ours, else DTensor's, else none: "replicated"), with
    their strided twins where a fused projection's pieces may split strided
    (`autoplan.strategies.strided`), and where they came from."""
    rules, source = _axis_rules(node, tuple(graph.tensor(r) for r in node.refs))
    found = routing.graph_region(graph)
    if node.name in found:  # routing each rank's own tokens (`autoplan.strategies.routing`)
        op = routing.region_op(node, graph)
        rules = tuple(r for r in rules if routing.keeps(r, op, found))
        rules += tuple(routing.local_rules(node.op, len(node.refs), node.name in found.exits))
        source = "ours" if source == "replicated" else source
    return [*rules, *strided.twin_rules(node, graph, plain_rules)], source


def plain_rules(node: Node, graph: Graph) -> tuple[AxisRule, ...]:
    """``node``'s rules on one mesh axis without their strided twins."""
    return _axis_rules(node, tuple(graph.tensor(r) for r in node.refs))[0]


# a node's rules depend on it and its inputs alone; baselines and the planner ask for them
# once per mesh, stage and layout, for the same node and input shapes
@functools.lru_cache(maxsize=2**16)
def _axis_rules(node: Node, ins: tuple[TensorInfo, ...]) -> tuple[tuple[AxisRule, ...], str]:
    out_ndim = len(node.outputs[0].shape) if node.outputs else 0
    rule = own_rule(node.op)
    if rule is not None:
        return tuple(rule(node, list(ins))), "ours"
    tensors: dict[Ref, TensorInfo] = dict(zip(node.refs, ins, strict=True))
    found = dtensor_rules.axis_rules(
        node.op,
        node.args,
        node.kwargs,
        tensors,
        len(node.outputs),
        out_ndim,
        [len(i.shape) for i in ins],
    )
    if found is not None:
        return tuple(found), "dtensor"
    return (), "replicated"


def _expand(
    rules: Sequence[AxisRule], node: Node, ins: Sequence[TensorInfo], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """Product of per-axis rules over the mesh, keeping only evenly splittable ones. An axis
    of size 1 takes only the replicated rule (`on_mesh`)."""
    all_r: AxisRule = (R,) * (1 + len(ins))
    rules = list(dict.fromkeys([all_r, *rules]))
    per_axis = [rules if size > 1 else [all_r] for size in mesh_shape]
    found: list[Strategy] = []
    for combo in itertools.product(*per_axis):
        out = tuple(c[0] for c in combo)
        inputs = tuple(tuple(c[i + 1] for c in combo) for i in range(len(ins)))
        if not all(is_valid(out, o.shape, mesh_shape) for o in node.outputs):
            continue
        if not all(is_valid(s, t.shape, mesh_shape) for s, t in zip(inputs, ins, strict=True)):
            continue
        found.append(Strategy(out, inputs))
    return list(dict.fromkeys(found))


def node_strategies(node: Node, graph: Graph, mesh_shape: tuple[int, ...]) -> NodeStrategies:
    num_axes = len(mesh_shape)
    if node.kind == NodeKind.PARAM:
        options = strided.storage_options(node, graph, plain_rules)
        stored = _storage_strategies(node.output, mesh_shape, options)
        zero = _zero_strategies(node, stored, mesh_shape)
        return NodeStrategies(node.name, (*stored, *zero), "storage")
    if node.kind == NodeKind.INPUT:
        # the data loader can hand each rank any even slice of the batch at no cost
        return NodeStrategies(
            node.name, tuple(_storage_strategies(node.output, mesh_shape)), "data"
        )
    if node.kind == NodeKind.OUTPUT:
        inputs = tuple(replicated(num_axes) for _ in node.refs)
        return NodeStrategies(node.name, (Strategy((), inputs),), "output")
    ins = [graph.tensor(r) for r in node.refs]
    rules, source = axis_rules(node, graph)
    strategies = _expand(rules, node, ins, mesh_shape)
    if node.op in GROUPED_MMS:
        strategies = [s for s in strategies if grouped_mm.supported(s.inputs)]
    kept = kept_partial(node, graph, mesh_shape)
    return NodeStrategies(node.name, (*strategies, *kept), source)


def is_candidate(node: Node, graph: Graph, strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
    """Whether ``strategy`` of a parameter, input or op is among `node_strategies`' candidates
    (those keeping the output's gradient partial aside), told without listing them all as a
    baseline checks its own: each mesh axis takes one of the node's rules (replicated on an
    axis of one device), and every tensor splits evenly."""
    if node.kind == NodeKind.PARAM and strategy.state is not None:
        stored = Strategy(strategy.output, strategy.inputs)
        return strategy in _zero_strategies(node, [stored], mesh_shape) and is_candidate(
            node, graph, stored, mesh_shape
        )
    if strategy.grad is not None or strategy.state is not None:
        return False
    if len(strategy.output) != len(mesh_shape):
        return False
    if node.kind in (NodeKind.PARAM, NodeKind.INPUT):
        strided_options = (
            strided.storage_options(node, graph, plain_rules) if node.kind == NodeKind.PARAM else []
        )
        options = _all_shardings(node.output.shape, strided_options)
        placed = zip(strategy.output, mesh_shape, strict=True)
        return (
            not strategy.inputs
            and all(p in options if size > 1 else p == R for p, size in placed)
            and is_valid(strategy.output, node.output.shape, mesh_shape)
        )
    ins = [graph.tensor(r) for r in node.refs]
    if len(strategy.inputs) != len(ins):
        return False
    all_r: AxisRule = (R,) * (1 + len(ins))
    for axis, size in enumerate(mesh_shape):
        rule = (strategy.output[axis], *(spec[axis] for spec in strategy.inputs))
        if rule != all_r and (size == 1 or rule not in axis_rules(node, graph)[0]):
            return False
    if node.op in GROUPED_MMS and not grouped_mm.supported(strategy.inputs):
        return False
    return all(is_valid(strategy.output, o.shape, mesh_shape) for o in node.outputs) and all(
        is_valid(spec, t.shape, mesh_shape) for spec, t in zip(strategy.inputs, ins, strict=True)
    )


def source_of(node: Node, graph: Graph) -> str:
    """Where a node's candidates come from: "storage" (a parameter), "data" (an input),
    "output", or an op's rules (`axis_rules`)."""
    sources: dict[str, str] = {
        NodeKind.PARAM: "storage",
        NodeKind.INPUT: "data",
        NodeKind.OUTPUT: "output",
    }
    return sources[node.kind] if node.kind in sources else axis_rules(node, graph)[1]


# reshapes: their backward is a reshape of the gradient, so wherever their output is whole
# it may run on partial sums and keep them partial (`autoplan.planfile.check` allows it; a
# baseline so reads the sequence gathered under sequence parallelism)
RESHAPES = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"})

# ops whose result depends on a random generator: run replicated, each rank would draw its own
_RANDOM = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "rrelu"}


def kept_partial(node: Node, graph: Graph, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """The replicated strategy once more, keeping the output's gradient partial.

    Every rank computes a replicated op on the same values, so its backward, linear in the
    gradient, can run on a partial gradient and hand partial gradients to its inputs: a
    parameter-only computation (a position embedding of ``arange``, a weight's view) then
    passes the partial gradient of its sharded users on to its parameters' buckets, as DDP
    does, instead of an all-reduce of an activation's gradient in the middle of backward.
    The executor runs such an op on local tensors.

    Only for an op that alone reads each input it sends a gradient to: a tensor's gradient
    is reduced once however many of its users hand it partial sums, which the ILP's edges,
    priced one by one, cannot see when its users disagree.
    """
    if not node.needs_grad or all(size == 1 for size in mesh_shape):
        return []
    name = node.op.split(".")[1] if "." in node.op else node.op
    if name.rstrip("_") in _RANDOM:
        return []
    if any(graph.node(r.name).needs_grad and graph.fan_out(r) > 1 for r in node.refs):
        return []
    whole = replicated(len(mesh_shape))
    grad = on_mesh((P,) * len(mesh_shape), mesh_shape)
    return [Strategy(whole, tuple(whole for _ in node.refs), grad)]


def strategy_space(
    graph: Graph, mesh_shape: tuple[int, ...], names: Collection[str] | None = None
) -> dict[str, NodeStrategies]:
    """Candidates for every node (or those in ``names``); ops without a rule are listed in
    one warning."""
    space = {
        n.name: node_strategies(n, graph, mesh_shape)
        for n in graph
        if names is None or n.name in names
    }
    fallback = sorted({graph.node(k).op for k, v in space.items() if v.source == "replicated"})
    if fallback:
        log.warning(
            "no sharding rule for %d op(s), planned replicated: %s",
            len(fallback),
            ", ".join(fallback),
        )
    return space
