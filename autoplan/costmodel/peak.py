"""A step's peak memory as autograd holds it over time, on one device of one stage.

The ops' memory (`Pricer.node_memory`) summed counts every parameter with its gradient and
optimizer state and every tensor backward keeps, all at once. A step holds less: its
gradients are set to None after the optimizer step (as the executor does), so forward holds
the parameters, optimizer state, inputs and the kept tensors; backward, run in reverse graph
order, frees each op's kept tensors after the op's backward and makes the gradients. This
walks that order and returns the most held at once:

* static: parameters, optimizer state (ZeRO: as stored) and inputs, throughout;
* an op's forward: static + the tensors kept so far (`Pricer.activation_memory`) + the
  outputs made and not yet read for the last time (a loss's logits and log-probabilities);
* an op's backward: static + the tensors still kept + the parameters' gradients made so far
  + the gradients of activations made and not yet consumed (its outputs' among them) + the
  gradients of its inputs it makes (a view's is its output's, moved: nothing new);
* the optimizer step: static + every parameter's gradient (the fused AdamW makes no more).

A kept tensor is freed after the backward of the first op that saves it (`Node.kept_by`), an
op's own saved tensors after its own backward. A recomputed layer
(`Pricer.recompute`) keeps nothing its ops drop until backward reaches it, then makes them
all again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from autoplan.costmodel.pricer import Pricer
from autoplan.graph.ir import Graph, Node, itemsize
from autoplan.modes import NodeKind
from autoplan.strategies.placement import local_numel
from autoplan.strategies.space import Strategy


def peak_bytes(graph: Graph, assignment: Mapping[str, Strategy], pricer: Pricer) -> float:
    """The step's peak bytes per device."""
    recompute = pricer.recompute
    static = grads_total = 0.0
    for node in graph:
        if node.kind in (NodeKind.PARAM, NodeKind.INPUT):
            grad = pricer.gradient_memory(node, assignment[node.name])
            static += pricer.node_memory(node, assignment[node.name]) - grad
            grads_total += grad
    last = _last_readers(graph)
    alive = transient = 0.0  # forward: kept for backward; made and not yet read for the last time
    made_now: dict[str, float] = {}
    freed: dict[str, float] = defaultdict(float)  # after an op's backward, the bytes it frees
    remade: dict[int, float] = defaultdict(float)  # by recomputed layer, what it makes again
    peak = static
    for i, node in enumerate(graph):
        if node.kind != NodeKind.OP:
            continue
        s = assignment[node.name]
        saved = pricer.activation_memory(node, s)
        extra = min(saved, pricer.saved_extra_memory(node, s))
        freed[node.kept_by or node.name] += saved - extra
        freed[node.name] += extra
        if recompute.drops(node.name):
            remade[recompute.layer_of[node.name]] += saved
            saved = 0.0
        alive += saved
        if not node.is_view:
            made_now[node.name] = max(0.0, _output_bytes(node, s, pricer, False) - saved + extra)
            transient += made_now[node.name]
        peak = max(peak, static + alive + transient)
        for name in last.get(i, ()):
            transient -= made_now.pop(name, 0.0)
    grads = 0.0  # gradients alive: parameters' and activations' not yet consumed
    pending: dict[str, float] = {}  # an op's output gradients made, not yet consumed
    made: set[str] = set()  # parameters whose gradient exists
    for node in reversed(graph.nodes):
        if node.kind != NodeKind.OP or not node.needs_grad:
            continue
        if recompute.drops(node.name):  # its layer's forward runs again, once
            alive += remade.pop(recompute.layer_of[node.name], 0.0)
        consumed = pending.pop(node.name, 0.0)
        new = 0.0
        for ref in dict.fromkeys(node.refs):
            producer = graph.node(ref.name)
            if not producer.needs_grad or ref.name in made or ref.name in pending:
                continue
            if producer.kind == NodeKind.PARAM:
                made.add(ref.name)
                new += pricer.gradient_memory(producer, assignment[ref.name])
            else:
                pending[ref.name] = _output_bytes(producer, assignment[ref.name], pricer, True)
                new += pending[ref.name]
        if not node.is_view:
            peak = max(peak, static + alive + grads + new)
        grads += new - consumed
        alive -= freed[node.name]
    return max(peak, static + grads_total)


def _last_readers(graph: Graph) -> dict[int, list[str]]:
    """By the position of an op in the graph, the ops whose outputs it is the last to read
    in forward (a view's reader reads the tensor the view reads)."""
    base: dict[str, str] = {}
    last: dict[str, int] = {}
    for i, node in enumerate(graph):
        for ref in node.refs:
            last[base.get(ref.name, ref.name)] = i
        if node.kind == NodeKind.OP and node.is_view and node.refs:
            base[node.name] = base.get(node.refs[0].name, node.refs[0].name)
    by_reader: dict[int, list[str]] = defaultdict(list)
    for name, i in last.items():
        by_reader[i].append(name)
    return by_reader


def _output_bytes(node: Node, strategy: Strategy, pricer: Pricer, floats: bool) -> float:
    """The bytes of ``node``'s outputs (``floats``: its float ones, whose gradients backward
    makes), placed as they are."""
    return float(
        sum(
            local_numel(strategy.output, o.shape, pricer.mesh_shape) * itemsize(o.dtype)
            for o in node.outputs
            if o.is_differentiable or not floats
        )
    )
