"""Vocabulary parallelism on this rank's shards: the embedding and the cross-entropy with the
vocabulary split along some mesh axes (their rules: `autoplan.strategies.rules`).

* The embedding of a weight split by rows (Megatron's VocabParallelEmbedding): each rank
  looks up the indices among the rows it holds and zeroes the others' rows of the output, so
  the output is a partial sum along those axes, which the plan reduces like a row linear's.
  In backward each rank's rows get exactly their own indices' gradients.
* The cross-entropy of logits split along the classes (Megatron's parallel cross-entropy,
  `vocab_parallel_cross_entropy`): the logits' maximum per element is all-reduced (max), then
  the target's logit and the sum of exponentials, stacked, are all-reduced (sum): two
  all-reduces of the targets' size, where gathering the logits would move all of them. Every
  rank then holds each element's whole loss; backward needs no communication (softmax minus
  the one-hot target, on each rank's classes).

DTensor has a vocabulary-split embedding (its `MaskPartial`, which its other ops do not take as
a partial sum) and `loss_parallel` (whose mean is exact on a one-dimensional mesh only), so
both run here on local tensors, their collectives c10d's in-place all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

_aten = torch.ops.aten
EMBEDDING = _aten.embedding.default
CROSS_ENTROPY = _aten.cross_entropy_loss.default
# the dim of input 0 that holds the vocabulary: the embedding's weight rows, the logits' classes
VOCAB_DIM = {EMBEDDING: 0, CROSS_ENTROPY: 1}


@dataclass(frozen=True)
class VocabShard:
    """This rank's piece of a vocabulary split along some mesh axes."""

    start: int  # the first vocabulary entry it holds
    groups: tuple[dist.ProcessGroup, ...]  # of the mesh axes that split the vocabulary


def vocab_shard(
    node: torch.fx.Node, inputs: Sequence[Sequence[Placement]], mesh: DeviceMesh
) -> VocabShard | None:
    """This rank's piece of ``node``'s vocabulary, placed as planned (``inputs``), or None
    where the node is no embedding or cross-entropy or its vocabulary is whole. A dim split
    along several axes is cut outer axis first, as DTensor cuts it."""
    dim = VOCAB_DIM.get(node.target)  # type: ignore[call-overload]
    if dim is None:
        return None
    axes = [a for a, p in enumerate(inputs[0]) if isinstance(p, Shard) and p.dim == dim]
    if not axes:
        return None
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a rank of the mesh runs its ops
    index = 0
    for a in axes:
        index = index * mesh.size(a) + coordinate[a]
    size = node.args[0].meta["val"].shape[dim]  # type: ignore[union-attr]
    pieces = math.prod(mesh.size(a) for a in axes)
    return VocabShard(index * (size // pieces), tuple(mesh.get_group(a) for a in axes))


def masked_embedding(
    weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, shard: VocabShard
) -> torch.Tensor:
    """The embedding of this rank's rows of ``weight``: zero where an index is another's."""
    rows = weight.shape[0]
    local = indices - shard.start
    outside = (local < 0) | (local >= rows)
    pad = padding_idx - shard.start if 0 <= padding_idx - shard.start < rows else -1
    found = EMBEDDING(weight, local.masked_fill(outside, 0), pad)
    return found.masked_fill(outside.unsqueeze(-1), 0.0)


class _SumOver(torch.autograd.Function):
    """Summed over process groups in forward; the gradient passed on as it is in backward:
    every rank of the groups computes the same loss from the sum, so the gradient each rank
    gets for the sum is the gradient of its own term."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: tuple[dist.ProcessGroup, ...]) -> torch.Tensor:
        del ctx
        summed = x.clone()
        for group in groups:
            dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        del ctx
        return grad, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    shard: VocabShard,
) -> torch.Tensor:
    """Each element's cross-entropy (the shape of ``target``; 0 where ignored, scaled by its
    class weight) from this rank's classes of ``logits`` (dim 1) and the whole ``target``."""
    classes = logits.shape[1]
    with torch.no_grad():  # the loss does not depend on the shift: no gradient through it
        top = logits.amax(dim=1)
        for group in shard.groups:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(1)
    local = target - shard.start
    inside = (local >= 0) & (local < classes)
    picked = shifted.gather(1, local.clamp(0, classes - 1).unsqueeze(1)).squeeze(1)
    stacked = torch.stack([picked.masked_fill(~inside, 0.0), shifted.exp().sum(dim=1)])
    chosen, total = _SumOver.apply(stacked, shard.groups)
    loss = total.log() - chosen
    kept = target != ignore_index
    if weight is not None:
        loss = loss * weight[target.masked_fill(~kept, 0)]
    return loss.masked_fill(~kept, 0.0)
