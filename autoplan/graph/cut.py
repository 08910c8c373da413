"""Cut a traced step into layers, and a run of layers into a stage graph of its own.

Layers (the units the stage DP assigns to pipeline stages) follow the model's structure:
each repeated block (``blocks.3``, see `autoplan.graph.blocks`) is a layer, and consecutive
blocks are merged evenly when there are more than ``max_layers`` of them. Ops outside any
block join the layer they run in (the embedding joins the first, the head and the loss the
last); a parameter joins the layer of its first reader; the step's inputs (the batch and the
target) join the first layer, so that a stage receives everything it reads from the stage
before it. A model without repeated blocks is cut into ``max_layers`` runs of ops in graph order
where the fewest bytes cross, each of about equal FLOPs, as Alpa's layer clustering does
(`autoplan.graph.crossing`): where one tensor crosses if it can, not in the middle of a skip
connection or beside a residual stream.

Because every layer is a set of nodes that only reads nodes of itself or of earlier layers,
any contiguous run of layers is a valid pipeline stage: `stage_graph` turns it into a graph
whose inputs are the tensors it receives and whose output lists the tensors it sends on.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.errors import AutoplanError
from autoplan.graph.blocks import block_of
from autoplan.graph.crossing import balanced_cut, crossing_points
from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind

log = logging.getLogger(__name__)

DEFAULT_MAX_LAYERS = 16
SEND = "send"  # the output node of a stage graph that is not the last: what it sends on


@dataclass(frozen=True)
class Layer:
    name: str  # "blocks.0-2", or "ops 0-41" (of the graph's ops in graph order) without blocks
    nodes: tuple[str, ...]  # in graph order


def cut_layers(graph: Graph, max_layers: int = DEFAULT_MAX_LAYERS) -> tuple[Layer, ...]:
    """The graph's layers in order; every node is in exactly one."""
    if max_layers < 1:
        raise AutoplanError(f"max_layers must be at least 1, got {max_layers}")
    ops = [n for n in graph if n.kind == NodeKind.OP]
    blocks = list(dict.fromkeys(b for n in ops if (b := block_of(n)) is not None))
    if blocks:
        groups = _even_groups(blocks, max_layers)
        index = {b: i for i, group in enumerate(groups) for b in group}
        names = [g[0] if len(g) == 1 else f"{g[0]}-{g[-1].rsplit('.', 1)[-1]}" for g in groups]
        op_layer = _follow_blocks(ops, index)
    else:
        op_layer, names = _balanced(graph, max_layers)
    return _assemble(graph, op_layer, names)


def _even_groups(items: list[str], count: int) -> list[list[str]]:
    count = min(count, len(items))
    size, extra = divmod(len(items), count)
    groups, start = [], 0
    for i in range(count):
        stop = start + size + (1 if i < extra else 0)
        groups.append(items[start:stop])
        start = stop
    return groups


def _follow_blocks(ops: list[Node], index: dict[str, int]) -> dict[str, int]:
    """An op in a block takes that block's layer; an op outside takes the layer of the last
    block before it in graph order (the first layer before any block)."""
    layer_of, current = {}, 0
    for n in ops:
        b = block_of(n)
        if b is not None:
            current = max(current, index[b])
        layer_of[n.name] = current
    return layer_of


def _balanced(graph: Graph, count: int) -> tuple[dict[str, int], list[str]]:
    points = crossing_points(graph)
    starts = list(balanced_cut(points, count))
    for p in starts[1:]:
        log.debug(
            "cut before op %d (%s): %d tensor(s), %d bytes cross",
            p,
            points.ops[p],
            points.tensors[p],
            points.nbytes[p],
        )
    layer_of = {name: bisect.bisect_right(starts, i) - 1 for i, name in enumerate(points.ops)}
    bounds = itertools.pairwise([*starts, len(points.ops)])
    return layer_of, [f"ops {start}-{stop - 1}" for start, stop in bounds]


def _assemble(graph: Graph, op_layer: dict[str, int], names: Sequence[str]) -> tuple[Layer, ...]:
    last = len(names) - 1
    layer_of: dict[str, int] = {}
    for n in graph:
        if n.kind == NodeKind.OP:
            layer_of[n.name] = op_layer[n.name]
        elif n.kind == NodeKind.INPUT:
            layer_of[n.name] = 0
        elif n.kind == NodeKind.OUTPUT:
            layer_of[n.name] = last
    for n in graph:
        if n.kind == NodeKind.PARAM:
            readers = [layer_of[u] for u in graph.users(n.name)]
            layer_of[n.name] = min(readers, default=0)
    members: list[list[str]] = [[] for _ in names]
    for n in graph:
        members[layer_of[n.name]].append(n.name)
    return tuple(Layer(name, tuple(m)) for name, m in zip(names, members, strict=True))


def shared_params(graph: Graph, layers: Sequence[Layer]) -> dict[str, tuple[int, ...]]:
    """Parameters read by more than one layer (tied weights), with the layers reading them."""
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer.nodes}
    shared = {}
    for n in graph:
        if n.kind == NodeKind.PARAM:
            readers = tuple(sorted({layer_of[u] for u in graph.users(n.name)}))
            if len(readers) > 1:
                shared[n.target] = readers
    return shared


def crossing_tuple(graph: Graph, layers: Sequence[Layer]) -> tuple[str, int] | None:
    """An op of several outputs that a later layer reads (GPT-J's ``split`` of its rotary
    table), with its layer: a stage boundary there would send a tuple, which pipeline stages
    do not; None if there is none."""
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer.nodes}
    for n in graph:
        if len(n.outputs) > 1 and any(layer_of[u] != layer_of[n.name] for u in graph.users(n.name)):
            return n.name, layer_of[n.name]
    return None


@dataclass(frozen=True)
class StageGraph:
    """Layers ``[start, stop)`` as a graph of their own: ``graph`` has an input node for each
    tensor received (named as its producer) and an output node reading the tensors sent on,
    then the step's loss if the stage computes it."""

    graph: Graph
    received: tuple[str, ...]  # producer names, in graph order
    sent: tuple[str, ...]  # producer names read by later stages, in graph order
    nodes: tuple[str, ...]  # this stage's nodes of the original graph, in graph order


def stage_graph(graph: Graph, layers: Sequence[Layer], start: int, stop: int) -> StageGraph:
    inside = {name for layer in layers[start:stop] for name in layer.nodes}
    later = {name for layer in layers[stop:] for name in layer.nodes}
    onward = inside | later
    dag = graph.dataflow
    order = {n.name: i for i, n in enumerate(graph)}
    entering = {u for u, _ in dag.in_edges(onward) if u not in onward}
    leaving = {u for u, _ in dag.in_edges(later) if u not in later}
    read_here = {u for u, _ in dag.in_edges(inside)}
    # read here or passed through to a later stage (the target travels to the loss)
    received = tuple(sorted(entering & (read_here | leaving), key=order.__getitem__))
    sent = tuple(sorted(leaving, key=order.__getitem__))
    for name in received + sent:
        if len(graph.node(name).outputs) != 1:
            raise AutoplanError(
                f"the stage boundary after layer {stop - 1} cuts through {name}, an op with "
                f"{len(graph.node(name).outputs)} outputs; choose other layers (max_layers)"
            )
    nodes: list[Node] = []
    for n in graph:
        if n.name in received:
            producer = graph.node(n.name)
            nodes.append(
                Node(
                    name=producer.name,
                    kind=NodeKind.INPUT,
                    op=NodeKind.INPUT,
                    args=(),
                    kwargs=(),
                    outputs=producer.outputs,
                    flops=0.0,
                    bwd_flops=0.0,
                    bytes_moved=0.0,
                    module_path=producer.module_path,
                    target=producer.target,
                    params=(),
                    needs_grad=producer.needs_grad,
                    is_view=False,
                )
            )
        elif n.name in inside and n.kind != NodeKind.OUTPUT:
            nodes.append(n)
    final = next((n for n in graph if n.kind == NodeKind.OUTPUT and n.name in inside), None)
    nodes.append(_output(graph, sent, final))
    sub_fingerprint = f"{graph.fingerprint}:{start}-{stop}"
    return StageGraph(
        graph=Graph(tuple(nodes), sub_fingerprint),
        received=received,
        sent=sent,
        nodes=tuple(n.name for n in graph if n.name in inside),
    )


def _output(graph: Graph, sent: tuple[str, ...], final: Node | None) -> Node:
    refs: tuple[Ref, ...] = tuple(Ref(name) for name in sent)
    if final is not None:
        refs += final.refs
    return Node(
        name=final.name if final is not None else SEND,
        kind=NodeKind.OUTPUT,
        op=NodeKind.OUTPUT,
        args=(refs,),
        kwargs=(),
        outputs=(),
        flops=0.0,
        bwd_flops=0.0,
        bytes_moved=0.0,
        module_path="",
        target="",
        params=(),
        needs_grad=False,
        is_view=False,
    )
