"""How the executor runs an op: which ops run on this rank's shards as plain torch (the
others run as DTensor ops), and the losses it runs as sums.

An op runs locally when its planned inputs and output have no partial sums and its result on
local shards is the local shard of its result: matmuls, element-wise ops, layer norm,
attention, embedding lookups and transposes (DTensor's rules for them change no argument),
views and factories like ``new_zeros`` (their size argument made local), and losses over a
split batch: an element-wise loss's local sum over the global element count, and
cross-entropy's over the global total weight of its targets, are partial sums along the axes
their inputs are split on. So do the vocabulary's split ops (execute/vocab.py): an embedding
of a weight split by rows (its masked lookup a partial sum) and a cross-entropy of logits
split along the classes (Megatron's parallel cross-entropy); so does a mixture of experts'
grouped matmul, each rank multiplying its experts' rows (execute/experts.py). An op DTensor
cannot run at all (``lift_fresh_copy``, the functional ``copy`` of a slice assignment) runs
locally too, placed as the plan says: only that way does it run, not raise on the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.execute.placements import split_dim
from autoplan.execute.vocab import (
    CROSS_ENTROPY,
    EMBEDDING,
    VocabShard,
    masked_embedding,
    vocab_parallel_cross_entropy,
)
from autoplan.graph.flops import GROUPED_MMS
from autoplan.torch_private import dtensor_runs
from autoplan.torch_private.flex_op import FLEX_ATTENTION

NONE, MEAN, SUM = 0, 1, 2  # torch's Reduction
# DTensor runs these by decomposition, and on a split batch the backward of the mean divides
# by the local element count (gradients n times too large); a sum over the global count is
# exact, on DTensors and (as a partial sum) on local shards alike. torch 2.13.0.
ELEMENTWISE_LOSSES = {
    torch.ops.aten.mse_loss.default,
    torch.ops.aten.l1_loss.default,
    torch.ops.aten.smooth_l1_loss.default,
    torch.ops.aten.huber_loss.default,
}
# cross_entropy_loss(input, target, weight, reduction, ignore_index, label_smoothing): its mean
# divides by the targets' total weight (their class weights, ignored ones left out), so on a
# split batch its local sum over the *global* total weight is the partial sum. The executor
# all-reduces that scalar as soon as the targets are there; DTensor would in backward, where
# every rank stalls until the last one has finished its forward. Split along the classes, it
# runs as Megatron's parallel cross-entropy (execute/vocab.py).


def _arg(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def reduction(node: torch.fx.Node) -> Any:
    return _arg(node, 3 if node.target is CROSS_ENTROPY else 2, "reduction", MEAN)


def class_weights(node: torch.fx.Node) -> Any:
    """The cross-entropy's class weights: an fx Node, or None."""
    return _arg(node, 2, "weight", None)


def local_total_weight(node: torch.fx.Node, target: torch.Tensor, weight: Any) -> torch.Tensor:
    """This rank's part of the cross-entropy's total weight, for its local ``target``."""
    kept = target != _arg(node, 4, "ignore_index", -100)
    dtype = node.args[0].meta["val"].dtype  # type: ignore[union-attr]
    if weight is None:
        return kept.sum().to(dtype)
    return weight[target[kept]].sum().to(dtype)


class Summed:
    """A local scalar (a cross-entropy's total weight) summed over process groups in place:
    the first all-reduce starts now (gloo's waits sleep, so it overlaps what the rank does
    next), the others when it is read. c10d's in-place all-reduce, as the gradient buckets:
    no autograd, no DTensor."""

    def __init__(self, local: torch.Tensor, groups: list[dist.ProcessGroup]) -> None:
        self.tensor = local
        self.groups = groups
        self.work = dist.all_reduce(local, group=groups[0], async_op=True) if groups else None

    def value(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            for group in self.groups[1:]:
                dist.all_reduce(self.tensor, group=group)
            self.work = None
        return self.tensor


def local_cross_entropy(
    node: torch.fx.Node,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    total: Any,
    vocab: VocabShard | None = None,
) -> torch.Tensor:
    """The cross-entropy of this rank's shards: per element (reduction none), else summed
    over the global ``total`` weight (None for a summed loss); with ``vocab``, of the logits
    of this rank's classes (`vocab_parallel_cross_entropy`)."""
    logits, target = args[:2]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    ignore_index = _arg(node, 4, "ignore_index", -100)
    if vocab is not None:
        each = vocab_parallel_cross_entropy(logits, target, weight, ignore_index, vocab)
        if reduction(node) == NONE:
            return each
        return each.sum() if total is None else each.sum() / total
    if reduction(node) == NONE:
        return CROSS_ENTROPY(*args, **kwargs)  # its local result is the local shard
    smoothing = _arg(node, 5, "label_smoothing", 0.0)
    summed = CROSS_ENTROPY(logits, target, weight, SUM, ignore_index, smoothing)
    return summed if total is None else summed / total


def local_embedding(node: torch.fx.Node, args: tuple[Any, ...], vocab: VocabShard) -> Any:
    """The embedding of this rank's rows of the vocabulary: a partial sum (execute/vocab.py)."""
    return masked_embedding(args[0], args[1], _arg(node, 2, "padding_idx", -1), vocab)


def call_op(node: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    target: Any = node.target
    if target in ELEMENTWISE_LOSSES and reduction(node) == MEAN:
        rest = {k: v for k, v in kwargs.items() if k != "reduction"}
        summed = target(args[0], args[1], SUM, *args[3:], **rest)
        return summed / node.args[0].meta["val"].numel()  # type: ignore[union-attr]
    if target in MEANS:
        return _mean_as_sum(node, args[0], kwargs.get("dtype"))
    if target is _aten.copy.default:
        return _copy(*args, **kwargs)
    if target is _aten.detach_.default and node.args[0].op == "placeholder":  # type: ignore[union-attr]
        # a constant or input detached in place (transformers' empty key-value cache before
        # its cat): its local tensor is a view of the DTensor's, which autograd refuses to
        # detach in place; out of place it is the same value, and no gradient reaches it
        return args[0].detach()
    if target is _aten.view.default and not isinstance(args[0], DTensor):
        # a view of strides that the trace's fake kernel gave and the real one need not
        # (CPU's float16 attention returns its heads transposed in memory): a copy then,
        # as the model's own .contiguous(), which the trace dropped, makes in one process.
        # A local tensor, real or fake (the step checked before training runs on fake ones)
        return torch.reshape(args[0], args[1])
    return target(*args, **kwargs)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """The functional ``copy`` (what tracing makes of ``dst[...] = src``) as the differentiable
    op it means: ``src`` in ``dst``'s dtype, broadcast to ``dst``'s shape. ATen's own has no
    derivative; this one sends the gradient to ``src`` (summed over what it was broadcast
    along) and none to ``dst``, all of whose values it replaces."""
    del non_blocking
    return src.to(dst.dtype).expand(dst.shape).clone()


def _mean_as_sum(node: torch.fx.Node, x: torch.Tensor, dtype: torch.dtype | None) -> Any:
    """A mean as a sum over the global count of what it reduces: on a shard split along a
    reduced dim, its partial sum (a mean of the shard would divide by the shard's count)."""
    shape = node.args[0].meta["val"].shape  # type: ignore[union-attr]
    dims = _arg(node, 1, "dim", None) if node.target is _aten.mean.dim else None
    reduced = [int(d) % len(shape) for d in dims] if dims else list(range(len(shape)))
    keepdim = bool(_arg(node, 2, "keepdim", False)) and node.target is _aten.mean.dim
    count = math.prod(shape[d] for d in reduced)
    return torch.sum(x, dim=reduced, keepdim=keepdim, dtype=dtype) / count


_aten = torch.ops.aten
# the local result of these on local shards is the local shard of the result, for any plan
# without partial sums (DTensor's rules for them change no argument)
LOCAL_OPS = {
    _aten.linear.default,
    _aten.addmm.default,
    _aten.mm.default,
    _aten.bmm.default,
    _aten.matmul.default,
    _aten.add.Tensor,
    _aten.sub.Tensor,
    _aten.mul.Tensor,
    _aten.div.Tensor,
    _aten.neg.default,
    _aten.relu.default,
    _aten.gelu.default,
    _aten.silu.default,
    _aten.tanh.default,
    _aten.sigmoid.default,
    _aten.pow.Tensor_Scalar,
    _aten.exp.default,
    _aten.log.default,
    _aten.sqrt.default,
    _aten.rsqrt.default,
    _aten.abs.default,
    _aten.erf.default,
    _aten.cumsum.default,
    _aten.clamp.default,
    _aten.rsub.Scalar,
    _aten.lt.Scalar,
    _aten.gt.Scalar,
    _aten.le.Scalar,
    _aten.ge.Scalar,
    _aten.eq.Scalar,
    _aten.unsqueeze.default,
    _aten.stack.default,
    _aten.zeros_like.default,
    _aten.ones_like.default,
    _aten.argmax.default,
    _aten.argmin.default,
    _aten.one_hot.default,
    _aten.einsum.default,  # over a split contracted letter: a partial sum (`PARTIAL_SUMS`)
    # random draws: each shard from its own generator (randomness.Draws)
    _aten.dropout.default,
    _aten.rand_like.default,
    _aten.randn_like.default,
    _aten.layer_norm.default,
    _aten.rms_norm.default,
    _aten.softmax.int,
    _aten.log_softmax.int,
    _aten.scaled_dot_product_attention.default,
    _aten.embedding.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.flatten.using_ints,
    # padding, slicing and concatenation (their rules split only the dims they leave alone)
    _aten.pad.default,
    _aten.slice.Tensor,
    _aten.cat.default,
    _aten.select.int,
    # a gather by index tensors (a mixture of experts' rows sorted by expert): its rules split
    # the indices, the data whole, or a data dim the indices leave alone
    _aten.index.Tensor,
    # reductions: over a split dim, a partial sum (`PARTIAL_SUMS`)
    _aten.mean.dim,
    _aten.mean.default,
    _aten.sum.dim_IntList,
    _aten.sum.default,
    # convolutions over a split batch, masks combined element by element
    _aten.conv1d.default,
    _aten.conv2d.default,
    _aten.max_pool1d.default,
    _aten.max_pool2d.default,
    _aten.avg_pool1d.default,
    _aten.avg_pool2d.default,
    _aten.adaptive_avg_pool1d.default,
    _aten.adaptive_avg_pool2d.default,
    _aten.batch_norm.default,  # only ever split along the batch, and only in eval mode
    _aten.__and__.Tensor,
    _aten.__or__.Tensor,
    _aten.constant_pad_nd.default,
    # dtype casts (``logits.float()``): element by element
    _aten.to.dtype,
    _aten.to.dtype_layout,
    _aten._to_copy.default,
    _aten.type_as.default,
    # element by element, a broadcast operand whole; copy's src broadcast to dst's shape
    _aten.where.ScalarOther,
    _aten.where.ScalarSelf,
    _aten.where.Scalar,
    _aten.floor_divide.default,
    _aten.floor_divide.Scalar,
    _aten.fill.Scalar,
    _aten.fill.Tensor,
    _aten.copy.default,
    # along one dim, split along the others (rules._other_dims); sort and topk in MULTI_OUTPUT
    _aten.slice_scatter.default,
    _aten.select_scatter.default,
    _aten.diff.default,
    _aten.argsort.default,
    _aten.argsort.stable,
    # gathers and scatters along one dim, every tensor split alike along another
    _aten.gather.default,
    _aten.scatter.value,
    _aten.scatter.src,
    _aten.scatter_add.default,
    _aten.index_add.default,
    _aten.index_put.default,
    # counts over a fixed range: over a split input, partial sums (`PARTIAL_SUMS`)
    _aten.histc.default,
    _aten.bincount.default,
}
LOSSES = ELEMENTWISE_LOSSES | {CROSS_ENTROPY}
MEANS = {_aten.mean.dim, _aten.mean.default}
# their local result over a split reduced dim (contracted letter or dim) is a partial sum, as
# planned; the embedding's over its weight's split rows, its lookup masked (`local_embedding`)
PARTIAL_SUMS = MEANS | {
    EMBEDDING,
    _aten.sum.dim_IntList,
    _aten.sum.default,
    _aten.einsum.default,
    _aten.matmul.default,
    _aten.histc.default,
    _aten.bincount.default,
}
# splits into pieces, their size argument (args[1]) made local (`local_split`): linear, so
# partial sums in are partial sums out; run as DTensor ops, an output that no op reads would
# get a plain zero gradient in backward, which their backward (a cat) refuses to mix with the
# others' DTensor gradients (CvT's class token)
SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default}
# a list of tensors, placed alike: sort's and topk's values and indices split along a dim they
# do not sort; a split's pieces
MULTI_OUTPUT = SPLITS | {
    _aten.broadcast_tensors.default,
    _aten.sort.default,
    _aten.sort.stable,
    _aten.topk.default,
}
# views, and factories of a tensor's dtype and device, whose size argument (args[1]) is the
# global shape: made local from the planned output. A factory's input is read for its dtype
# alone, so it runs locally however that is placed: DTensor would place the output as it likes
# (its rule lets a split input's new tensor be split alike, and prefers it; the plan may not)
SIZED = {
    _aten.view.default,
    _aten.reshape.default,
    _aten._unsafe_view.default,
    _aten.expand.default,
    _aten.new_empty.default,
    _aten.new_zeros.default,
    _aten.new_ones.default,
    _aten.new_full.default,
}


def runs_locally(
    node: torch.fx.Node,
    inputs: Sequence[Sequence[Placement]],
    output: Sequence[Placement],
) -> bool:
    """Whether ``node``, placed as planned (``inputs``, ``output``), runs on local shards."""
    if node.target is FLEX_ATTENTION:
        return True  # no DTensor rule: torch's operator on local shards (execute/flex_shards.py)
    if str(node.target) in GROUPED_MMS:
        # experts split or whole, rows whole (execute/experts.py): DTensor's rule for torch's
        # grouped matmul would place it otherwise
        return True
    if node.target not in LOCAL_OPS | SIZED | LOSSES | MULTI_OUTPUT:
        return _replicated(node, inputs, output) or _without_dtensor(node)
    val = node.meta.get("val")
    values = val if node.target in MULTI_OUTPUT else [val]
    if not isinstance(values, list | tuple) or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if node.target in SPLITS:
        return True  # as planned (strategies/rules.py `_split`): each output as its input
    if any(isinstance(p, Partial) for ps in inputs for p in ps):
        return False
    if node.target is CROSS_ENTROPY and node.args[1].meta["val"].is_floating_point():  # type: ignore[union-attr]
        return False  # class probabilities as targets: DTensor's rules
    if node.target in LOSSES and reduction(node) != NONE:
        # the loss of this rank's shards is a partial sum along the axes they split the
        # elements on (a cross-entropy's target says which: its logits may be split along the
        # classes too, whose loss every rank holds whole)
        split_by = inputs[1:2] if node.target is CROSS_ENTROPY else inputs
        split = [any(isinstance(ps[a], Shard) for ps in split_by) for a in range(len(output))]
        return tuple(output) == tuple(Partial() if s else Replicate() for s in split)
    return node.target in PARTIAL_SUMS or not any(isinstance(p, Partial) for p in output)


def _replicated(
    node: torch.fx.Node,
    inputs: Sequence[Sequence[Placement]],
    output: Sequence[Placement],
) -> bool:
    """Any op (one DTensor has no rule for, too) run whole on every rank from whole inputs:
    each rank computes the same value, so plain torch on the local tensors is exact (a random
    op too: every rank draws from the same generator, see `randomness`)."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    placed = [*inputs, output]
    return all(isinstance(p, Replicate) for ps in placed for p in ps)


def _without_dtensor(node: torch.fx.Node) -> bool:
    """An op DTensor cannot run (no rule, no decomposition: `dtensor_runs`) runs on local
    tensors, placed as the plan says: replicated where the planner has no rule for it either,
    else as our rule places it, whose local result on local shards is the local shard of the
    result (strategies/rules.py). As a DTensor op it would raise NotImplementedError."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and not dtensor_runs(target)


def local_shape(
    node: torch.fx.Node, output: Sequence[Placement], mesh_shape: Sequence[int]
) -> list[int]:
    """This rank's shape of ``node``'s output (a view's size argument, made local)."""
    shape = list(node.meta["val"].shape)
    for placement, size in zip(output, mesh_shape, strict=True):
        d = split_dim(placement)
        if d is not None:
            shape[d] //= size
    return shape


def local_split(
    node: torch.fx.Node, input_placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> Any:
    """A split's size argument for this rank's shard of its input: the pieces' sizes along a
    dim the input is split along (strided: each rank holds its share of every piece), made
    local; a chunk's count as it is."""
    dim = int(_arg(node, 2, "dim", 0)) % node.args[0].meta["val"].dim()  # type: ignore[union-attr]
    parts = math.prod(
        size for p, size in zip(input_placements, mesh_shape, strict=True) if split_dim(p) == dim
    )
    sizes: Any = node.args[1]
    if node.target is _aten.chunk.default:
        return sizes
    if isinstance(sizes, list | tuple):
        return [int(s) // parts for s in sizes]
    return int(sizes) // parts


def local_slice(
    node: torch.fx.Node, inputs: Sequence[Sequence[Placement]], mesh_shape: Sequence[int]
) -> tuple[Any, ...] | None:
    """A slice's arguments for this rank's shard of an input split along the sliced dim: only
    ever strided (plain splits are planned along the other dims, strategies/rules.py), and
    the slice one of a fused projection's pieces (`autoplan.strategies.strided.tiles`), so its
    bounds made local, as each rank holds its share of every piece side by side; None for any
    other slice."""
    if node.target is not _aten.slice.Tensor:
        return None
    size = node.args[0].meta["val"].shape  # type: ignore[union-attr]
    dim = int(_arg(node, 1, "dim", 0)) % len(size)
    parts = math.prod(n for p, n in zip(inputs[0], mesh_shape, strict=True) if split_dim(p) == dim)
    if parts == 1:
        return None

    def local(bound: Any, default: int) -> int:
        v = default if bound is None else int(bound)
        return min(max(0, v + size[dim] if v < 0 else v), size[dim]) // parts

    start, end = _arg(node, 2, "start", None), _arg(node, 3, "end", None)
    return (node.args[0], dim, local(start, 0), local(end, size[dim]), *node.args[4:5])
