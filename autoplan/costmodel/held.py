"""What a step holds on a device beyond its ops' outputs as placed: the tensors an op reads
redistributed and saves for backward, and the gradient buckets' buffers.

* An op's backward saves its inputs as it reads them (`Node.saves`). The executor places a
  tensor once per placement its readers need (`autoplan.execute.interpreter`), so an input
  moved by a collective (ZeRO-3's gathered weight, tensor parallelism's gathered
  activation) is a tensor of its own, kept until the backward of its first saver in graph
  order (the last of them to run): `saved_copies`. One moved by no collective (a split of
  a replicated tensor, a placement unchanged) is a view of the producer's tensor: the
  producer's own storage is kept. A producer's output that every saver reads moved, and
  that the producer does not save itself, is freed at its last read in forward: its
  `Node.kept` bytes are not held (`SavedCopies.unkept`).
* A gradient bucket's flat buffer (`autoplan.execute.gradients`) is allocated at the first
  step and reused: it is held throughout, forward included. A bucketed gradient is copied
  into it once the bucket is complete and in turn (buckets are issued in order), and the
  gradient backward made is then freed: `bucket_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autoplan.costmodel.pricer import Pricer
from autoplan.graph.ir import Graph, Ref, itemsize
from autoplan.modes import NodeKind
from autoplan.strategies.buckets import Bucket
from autoplan.strategies.placement import local_numel
from autoplan.strategies.space import Strategy


@dataclass(frozen=True)
class SavedCopies:
    """Bytes per device, by op: ``made``, the copies it is the first to save, made in its
    forward and freed after its backward; ``unkept``: of an op's
    `Pricer.activation_memory`, what no saver keeps as placed."""

    made: Mapping[str, float] = field(default_factory=dict)
    unkept: Mapping[str, float] = field(default_factory=dict)


def _base(graph: Graph, ref: Ref) -> Ref:
    """The tensor whose storage ``ref`` reads: through views, to the op that made it."""
    node = graph.node(ref.name)
    while node.kind == NodeKind.OP and node.is_view and node.refs:
        ref = node.refs[0]
        node = graph.node(ref.name)
    return ref


def saved_copies(graph: Graph, assignment: Mapping[str, Strategy], pricer: Pricer) -> SavedCopies:
    """The saved inputs an op reads moved by a collective (`SavedCopies`)."""
    made: dict[str, float] = {}
    copies: set[tuple[Ref, tuple[str, ...]]] = set()
    as_placed: set[Ref] = set()  # producers' outputs some saver keeps as they are
    moved: set[Ref] = set()  # those some saver keeps as a copy
    recompute = pricer.recompute
    for node in graph:
        if node.kind != NodeKind.OP or not node.needs_grad or recompute.drops(node.name):
            continue
        strategy = assignment[node.name]
        for i in node.saves:
            ref = node.refs[i]
            tensor = graph.tensor(ref)
            dst = strategy.inputs[i]
            _, found = pricer.forward(tensor, assignment[ref.name], strategy, i)
            base = _base(graph, ref)
            if not found:
                as_placed.add(base)
                continue
            moved.add(base)
            if (ref, dst) in copies:
                continue  # one redistribution per tensor and placement, shared
            copies.add((ref, dst))
            nbytes = float(local_numel(dst, tensor.shape, pricer.mesh_shape))
            nbytes *= itemsize(tensor.dtype)
            # its first saver in graph order: the last whose backward runs frees it
            made[node.name] = made.get(node.name, 0.0) + nbytes
    unkept: dict[str, float] = {}
    for ref in moved - as_placed:
        producer = graph.node(ref.name)
        if producer.kind != NodeKind.OP or producer.kept_by in ("", producer.name):
            continue  # a parameter or input is held anyway; an op saving its own output
        if producer.name in recompute.saved or ref.index not in (producer.kept or ()):
            continue
        info = producer.outputs[ref.index]
        spec = assignment[producer.name].output
        nbytes = local_numel(spec, info.shape, pricer.mesh_shape) * itemsize(info.dtype)
        unkept[producer.name] = unkept.get(producer.name, 0.0) + float(nbytes)
    return SavedCopies(made, unkept)


def bucket_bytes(buckets: Sequence[Bucket]) -> float:
    """The gradient buckets' flat buffers, held throughout the step, per device."""
    return float(sum(b.nbytes for b in buckets))
