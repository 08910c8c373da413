"""The collectives an op issues itself, beyond redistributing its inputs (`Pricer.internal`):
a cross-entropy's sums over split targets or classes, and the all-to-alls of a grouped matmul
that sends each rank's rows to their experts; each with the phase of the step that issues it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.graph.ir import Node, TensorInfo, itemsize
from autoplan.graph.recompute import Recompute
from autoplan.modes import Phase
from autoplan.strategies.placement import Collective, local_numel, shard_dim
from autoplan.strategies.space import Strategy


@dataclass(frozen=True)
class Phased:
    """A collective with the phase of the step that issues it."""

    collective: Collective
    phase: Phase
    params: tuple[str, ...] = ()  # a gradient bucket's parameters (see strategies/buckets.py)


def loss_collectives(
    node: Node,
    strategy: Strategy,
    ins: Sequence[TensorInfo],
    mesh_shape: tuple[int, ...],
    recompute: Recompute,
) -> tuple[Phased, ...]:
    """A cross-entropy's collectives: with mean reduction over a split batch, its targets'
    total weight summed along the axes that split them, one all-reduce per axis, as soon as
    the targets are there (execute/op_calls.py); split along the classes (the vocabulary),
    the maximum of each element's logits and then its target's logit with its sum of
    exponentials, all-reduced along each axis that splits them (execute/vocab.py)."""
    if node.op.split(".")[:2] != ["aten", "cross_entropy_loss"] or not strategy.inputs:
        return ()
    reduction = node.args[3] if len(node.args) > 3 else dict(node.kwargs).get("reduction", 1)
    logits, target = strategy.inputs[0], strategy.inputs[1]
    axes = [a for a, size in enumerate(mesh_shape) if size > 1]
    issued: list[Phased] = []
    if ins and len(ins[0].shape) == len(ins[1].shape) + 1:  # targets are class indices
        # the maximum, then the target's logit and the sum, of each element of the shard;
        # again in backward where the loss is recomputed
        size = itemsize(ins[0].dtype) * local_numel(target, ins[1].shape, mesh_shape)
        again = recompute.recomputes(node.name)
        issued += [
            Phased(Collective("all_reduce", (axis,), n * size), phase)
            for phase in (Phase.FORWARD, Phase.RECOMPUTE)[: 1 + again]
            for axis in axes
            if shard_dim(logits[axis]) == 1
            for n in (1, 2)
        ]
    if reduction == 1:
        size = itemsize(node.outputs[0].dtype)
        issued += [
            Phased(Collective("all_reduce", (axis,), size), Phase.FORWARD)
            for axis in axes
            if shard_dim(target[axis]) is not None
        ]
    return tuple(issued)


def dispatch_collectives(
    node: Node,
    strategy: Strategy,
    ins: Sequence[TensorInfo],
    mesh_shape: tuple[int, ...],
    recompute: Recompute,
) -> tuple[Phased, ...]:
    """A grouped matmul whose rows and experts split along the same axis sends each
    rank's rows to its experts' ranks and back (`execute/experts.py`): in forward an
    all-to-all of the counts per expert, one of the rows and one of the products; in
    backward one of each's gradient (again where recomputed). The rows' share of each
    rank depends on the routing: priced at the balanced expectation, each rank sending
    and receiving its own rows' bytes."""
    if len(ins) < 3 or not strategy.inputs:
        return ()
    x, w = strategy.inputs[0], strategy.inputs[1]
    axes = [a for a in range(len(x)) if shard_dim(x[a]) == 0 == shard_dim(w[a])]
    if not axes:
        return ()
    (axis,) = axes  # one axis (`strategies.grouped_mm.supported`)
    rows = itemsize(ins[0].dtype) * local_numel(x, ins[0].shape, mesh_shape)
    out = node.outputs[0]
    products = itemsize(out.dtype) * local_numel(strategy.output, out.shape, mesh_shape)
    counts = itemsize(ins[2].dtype) * math.prod(ins[2].shape)
    sent = [Collective("all_to_all", (axis,), n) for n in (counts, rows, products)]
    phases = [Phase.FORWARD] + [Phase.RECOMPUTE] * recompute.recomputes(node.name)
    issued = [Phased(c, phase) for phase in phases for c in sent]
    if node.needs_grad:
        issued += [Phased(c, Phase.BACKWARD) for c in sent[:0:-1]]
    return tuple(issued)
