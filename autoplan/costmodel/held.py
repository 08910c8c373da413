"""What a step holds on a device beyond its ops' outputs as placed: the tensors an op reads
redistributed (saved for backward, or in forward only), and the gradient buckets' buffers.

* An op's backward saves its inputs as it reads them (`Node.saves`). The executor places a
  tensor once per placement its readers need (`autoplan.execute.interpreter`), so an input
  moved by a collective (ZeRO-3's gathered weight, tensor parallelism's gathered
  activation) is a tensor of its own, kept until the backward of its first saver in graph
  order (the last of them to run): `saved_copies`. One moved by no collective (a split of
  a replicated tensor, a placement unchanged) is a view of the producer's tensor: the
  producer's own storage is kept. A producer's output that every saver reads moved, and
  that the producer does not save itself, is freed at its last read in forward: its
  `Node.kept` bytes are not held (`SavedCopies.unkept`). A copy no op saves is held in
  forward from its first reader to the last reader of the tensor it was moved from.
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
    # the copies no op saves: made by their first reader, freed after the last op reading
    # the tensor they were moved from (the executor keeps them as long)
    passing: Mapping[str, float] = field(default_factory=dict)
    passed: Mapping[str, float] = field(default_factory=dict)


def _base(graph: Graph, ref: Ref) -> Ref:
    """The tensor whose storage ``ref`` reads: through views, to the op that made it."""
    node = graph.node(ref.name)
    while node.kind == NodeKind.OP and node.is_view and node.refs:
        ref = node.refs[0]
        node = graph.node(ref.name)
    return ref


def saved_copies(graph: Graph, assignment: Mapping[str, Strategy], pricer: Pricer) -> SavedCopies:
    """The inputs ops read moved by a collective (`SavedCopies`)."""
    made: dict[str, float] = {}
    passing: dict[str, float] = {}
    passed: dict[str, float] = {}
    as_placed: set[Ref] = set()  # producers' outputs some saver keeps as they are
    moved: set[Ref] = set()  # those some saver keeps as a copy
    recompute = pricer.recompute
    last_read: dict[str, str] = {}  # by tensor: the last op to read it in forward
    first: dict[tuple[Ref, tuple[str, ...]], str] = {}  # a copy: its first reader
    saver: dict[tuple[Ref, tuple[str, ...]], str] = {}  # a saved copy: its first saver
    for node in graph:
        if node.kind != NodeKind.OP:
            continue
        strategy = assignment[node.name]
        saves = set(node.saves) if node.needs_grad and not recompute.drops(node.name) else set()
        for i, ref in enumerate(node.refs):
            last_read[ref.name] = node.name
            _, found = pricer.forward(graph.tensor(ref), assignment[ref.name], strategy, i)
            if i in saves:
                (moved if found else as_placed).add(_base(graph, ref))
            if found:
                first.setdefault((ref, strategy.inputs[i]), node.name)
                if i in saves:
                    saver.setdefault((ref, strategy.inputs[i]), node.name)
    for (ref, dst), reader in first.items():
        tensor = graph.tensor(ref)
        nbytes = float(local_numel(dst, tensor.shape, pricer.mesh_shape) * itemsize(tensor.dtype))
        if (ref, dst) in saver:
            # its first saver in graph order: the last whose backward runs frees it
            by = saver[(ref, dst)]
            made[by] = made.get(by, 0.0) + nbytes
        else:  # freed with the tensor it was moved from, after its last read in forward
            passing[reader] = passing.get(reader, 0.0) + nbytes
            passed[last_read[ref.name]] = passed.get(last_read[ref.name], 0.0) + nbytes
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
    return SavedCopies(made, unkept, passing, passed)


def bucket_bytes(buckets: Sequence[Bucket]) -> float:
    """The gradient buckets' flat buffers, held throughout the step, per device."""
    return float(sum(b.nbytes for b in buckets))
