"""A step's peak memory as autograd holds it over time, on one device of one stage.

The ops' memory (`Pricer.node_memory`) summed counts every parameter with its gradient and
optimizer state and every tensor backward keeps, all at once. A step holds less: its
gradients are set to None after the optimizer step (as the executor does), so forward holds
the parameters, optimizer state, inputs and the kept tensors; backward, run in reverse graph
order, frees each op's kept tensors after the op's backward and makes the gradients. This
walks that order and returns the most held at once:

* static: parameters, optimizer state (ZeRO: as stored) and inputs, and the gradient
  buckets' buffers, throughout;
* an op's forward: static + the tensors kept so far (`Pricer.activation_memory`) + the
  outputs made and not yet read for the last time (a loss's logits and log-probabilities);
* an op's backward: static + the tensors still kept + the parameters' gradients made so far
  + the gradients of activations made and not yet consumed (its outputs' among them) + the
  gradients of its inputs it makes, each output's apart (a split's pieces get theirs from
  their readers one by one, which its backward joins; a view's is its output's, moved:
  nothing new), with, for
  the while it runs, the gradients of the tensors of its own it saved (a loss's
  log-probabilities: its decomposition's intermediates) and of the inputs it read moved, as
  it read them;
* the optimizer step: static + every parameter's gradient outside the buckets (the fused
  AdamW makes no more).

What the executor holds beyond the ops' outputs as placed (`autoplan.costmodel.held`): an
op's saved inputs that it reads moved by a collective are copies of their own, made in its
forward, freed after its backward; a bucket's gradients leave backward's count once the
bucket, complete and in turn, is copied into its buffer.

A kept tensor is freed after the backward of the first op that saves it (`Node.kept_by`), an
op's own saved tensors after its own backward. A recomputed layer
(`Pricer.recompute`) keeps nothing its ops drop until backward reaches it, then makes them
all again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from autoplan.costmodel.held import bucket_bytes, saved_copies
from autoplan.costmodel.pricer import Pricer
from autoplan.graph.ir import Graph, Node, Ref, itemsize
from autoplan.modes import NodeKind
from autoplan.strategies.buckets import Bucket
from autoplan.strategies.placement import local_numel
from autoplan.strategies.space import Strategy


def peak_bytes(
    graph: Graph,
    assignment: Mapping[str, Strategy],
    pricer: Pricer,
    buckets: Sequence[Bucket] = (),
) -> float:
    """The step's peak bytes per device; ``buckets``: its gradient buckets, in the order
    they are issued."""
    recompute = pricer.recompute
    copies = saved_copies(graph, assignment, pricer)
    static = bucket_bytes(buckets)
    param_grads: dict[str, float] = {}
    for node in graph:
        if node.kind in (NodeKind.PARAM, NodeKind.INPUT):
            grad = pricer.gradient_memory(node, assignment[node.name])
            static += pricer.node_memory(node, assignment[node.name]) - grad
            param_grads[node.name] = grad
    in_bucket = {p: i for i, b in enumerate(buckets) for p in b.params}
    # at the optimizer step the bucketed gradients are views of the buffers
    grads_total = sum(g for p, g in param_grads.items() if p not in in_bucket)
    waiting = [len(b.params) for b in buckets]  # by bucket: its gradients not yet made
    issued = 0
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
        kept = max(0.0, saved - extra - copies.unkept.get(node.name, 0.0))
        freed[node.kept_by or node.name] += kept
        freed[node.name] += extra + copies.made.get(node.name, 0.0)
        saved = kept + extra
        if recompute.drops(node.name):
            remade[recompute.layer_of[node.name]] += saved
            saved = 0.0
        alive += saved + copies.made.get(node.name, 0.0)
        if not node.is_view:
            made_now[node.name] = max(0.0, _output_bytes(node, s, pricer) - saved + extra)
            transient += made_now[node.name]
        transient += copies.passing.get(node.name, 0.0)
        peak = max(peak, static + alive + transient)
        transient -= copies.passed.get(node.name, 0.0)
        for name in last.get(i, ()):
            transient -= made_now.pop(name, 0.0)
    grads = 0.0  # gradients alive: parameters' and activations' not yet consumed
    pending: dict[Ref, float] = {}  # an op's output gradients made, not yet consumed
    made: set[str] = set()  # parameters whose gradient exists
    for node in reversed(graph.nodes):
        if node.kind != NodeKind.OP or not node.needs_grad:
            continue
        if recompute.drops(node.name):  # its layer's forward runs again, once
            alive += remade.pop(recompute.layer_of[node.name], 0.0)
        consumed = sum(pending.pop(Ref(node.name, j), 0.0) for j in range(len(node.outputs)))
        s = assignment[node.name]
        new = 0.0
        # inside its backward: the gradients of the tensors of its own it saved (a loss's
        # log-probabilities), and of inputs it read moved, made as it read them before they
        # are moved back to where their producers keep them
        inside = pricer.saved_extra_memory(node, s)
        first = {r: i for i, r in reversed(list(enumerate(node.refs)))}  # by input: its index
        for ref, i in first.items():
            producer = graph.node(ref.name)
            if not producer.needs_grad or ref.name in made or ref in pending:
                continue
            tensor = graph.tensor(ref)
            if s.inputs[i] != assignment[ref.name].output and tensor.is_differentiable:
                local = local_numel(s.inputs[i], tensor.shape, pricer.mesh_shape)
                inside += float(local * itemsize(tensor.dtype))
            if producer.kind == NodeKind.PARAM:
                made.add(ref.name)
                new += param_grads[ref.name]
                if ref.name in in_bucket:
                    waiting[in_bucket[ref.name]] -= 1
            else:
                pending[ref] = _gradient_bytes(producer, ref.index, assignment[ref.name], pricer)
                new += pending[ref]
        if not node.is_view:
            peak = max(peak, static + alive + grads + new + inside)
        grads += new - consumed
        alive -= freed[node.name]
        while issued < len(buckets) and waiting[issued] == 0:
            # complete and in turn: copied into its buffer, backward's gradients freed
            grads -= sum(param_grads[p] for p in buckets[issued].params)
            issued += 1
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


def _output_bytes(node: Node, strategy: Strategy, pricer: Pricer) -> float:
    """The bytes of ``node``'s outputs, placed as they are."""
    return sum(_bytes(node, j, strategy, pricer) for j in range(len(node.outputs)))


def _bytes(node: Node, index: int, strategy: Strategy, pricer: Pricer) -> float:
    o = node.outputs[index]
    return float(local_numel(strategy.output, o.shape, pricer.mesh_shape) * itemsize(o.dtype))


def _gradient_bytes(node: Node, index: int, strategy: Strategy, pricer: Pricer) -> float:
    """The bytes of the gradient of ``node``'s output ``index`` (0 for one of integers):
    each output's arrives apart, from its own readers (a split's pieces)."""
    return _bytes(node, index, strategy, pricer) if node.outputs[index].is_differentiable else 0.0
