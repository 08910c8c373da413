"""The strategy space: every node's candidate placements over a logical mesh.

An op's candidates are the product over mesh axes of its per-axis rules (ours first, then
DTensor's, else replicated only), kept where every tensor splits evenly. A parameter's
candidates are its *storage* placements; the placement an op needs is chosen by the op, and
the edge between them carries the all-gather (ZeRO-3 / FSDP) and the gradient reduction.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from autoplan.graph.ir import INPUT, OUTPUT, PARAM, Graph, Node, Ref, TensorInfo
from autoplan.strategies import dtensor_rules
from autoplan.strategies.placement import R, Spec, is_valid, replicated, shard
from autoplan.strategies.rules import AxisRule, own_rule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Strategy:
    output: Spec  # placement of every output of the node
    inputs: tuple[Spec, ...]  # required placement of each tensor input (Node.refs order)


@dataclass(frozen=True)
class NodeStrategies:
    node: str
    strategies: tuple[Strategy, ...]
    source: str  # "ours" | "dtensor" | "replicated" | "storage" | "data" | "output"


def _all_shardings(shape: tuple[int, ...]) -> list[str]:
    return [R, *(shard(d) for d in range(len(shape)) if shape[d] > 1)]


def _storage_strategies(info: TensorInfo, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    options = _all_shardings(info.shape)
    return [
        Strategy(spec, ())
        for spec in itertools.product(options, repeat=len(mesh_shape))
        if is_valid(spec, info.shape, mesh_shape)
    ]


def axis_rules(node: Node, graph: Graph) -> tuple[list[AxisRule], str]:
    ins = [graph.tensor(r) for r in node.refs]
    out_ndim = len(node.outputs[0].shape) if node.outputs else 0
    rule = own_rule(node.op)
    if rule is not None:
        return rule(node, ins), "ours"
    tensors: dict[Ref, TensorInfo] = {r: graph.tensor(r) for r in node.refs}
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
        return found, "dtensor"
    return [], "replicated"


def _expand(
    rules: Sequence[AxisRule], node: Node, ins: Sequence[TensorInfo], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """Product of per-axis rules over the mesh, keeping only evenly splittable ones."""
    num_axes = len(mesh_shape)
    all_r: AxisRule = (R,) * (1 + len(ins))
    per_axis = list(dict.fromkeys([all_r, *rules]))
    found: list[Strategy] = []
    for combo in itertools.product(per_axis, repeat=num_axes):
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
    if node.kind == PARAM:
        return NodeStrategies(
            node.name, tuple(_storage_strategies(node.output, mesh_shape)), "storage"
        )
    if node.kind == INPUT:
        # the data loader can hand each rank any even slice of the batch at no cost
        return NodeStrategies(
            node.name, tuple(_storage_strategies(node.output, mesh_shape)), "data"
        )
    if node.kind == OUTPUT:
        inputs = tuple(replicated(num_axes) for _ in node.refs)
        return NodeStrategies(node.name, (Strategy((), inputs),), "output")
    ins = [graph.tensor(r) for r in node.refs]
    rules, source = axis_rules(node, graph)
    strategies = _expand(rules, node, ins, mesh_shape)
    return NodeStrategies(node.name, tuple(strategies), source)


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
