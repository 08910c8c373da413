"""Attention's per-mesh-axis rules, context parallelism among them.

``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...)`` over
``q (..., L, E)``, ``k (..., S, E)``, ``v (..., S, Ev)``, out ``(..., L, Ev)``, on one mesh
axis:

* any dim before the sequence (batch, heads) split in every tensor alike (a mask broadcast
  along it whole); with ``enable_gqa``, the keys' and values' fewer heads split with the
  queries' heads: each rank's query heads are whole groups of consecutive heads, which share
  its key-value heads (valid where the axis divides the key-value heads); or the key-value
  heads whole beside the split queries (multi-query attention's one head; fewer heads than
  ranks, as Megatron and vLLM replicate them): each rank attends with the key-value heads its
  query heads read (`key_heads`), and their gradients are partial sums;
* context parallelism: the queries split along the sequence (dim ``-2``), the keys and values
  whole, the output split along the sequence with the queries, a mask along its query dim
  (whole where it broadcasts over the queries). The keys and values come whole by an
  all-gather along the axis (the input's redistribution, priced as any other), and their
  gradients go back as partial sums, reduce-scattered (`grad_spec`: a whole input of a split
  output). Each rank computes its block of queries against every key: a causal mask shifted
  to its block's first position (`query_offset`; the executor's `execute/context.py`), so the
  result is exact, with the work of a full square block however many keys the mask hides
  (no ring, no load balancing: the first rank's queries see fewest keys, all ranks compute
  all). With dropout, the draws of each rank's block would not be those of one process:
  not offered.

FlexAttention (``torch.ops.higher_order.flex_attention(q, k, v, score_mod, block_mask,
scale, kernel_options, score_mod_buffers, mask_mod_buffers)``, its tensors ``q, k, v``, the
block mask's tensors, then the buffers) splits the batch or the heads in ``q``, ``k``, ``v``
and its outputs (out, log-sum-exp, max) alike, the key-value heads with the queries' where
the axis divides them, and keeps the sequence whole. The block mask's tensors and the
buffers stay whole: its score_mod and mask_mod are given the batch and head index each local
score has in one process (`flex_offsets`: the rank's block start added), so a function that
reads them (a head's ALiBi slope, a document mask's row of a whole buffer) is exact on
shards, and the dense implementation that runs it reads no block of the block mask.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.graph.ir import Node, TensorInfo
from autoplan.strategies.placement import R, Spec, shard, shard_dim

AxisRule = tuple[str, ...]  # (output, tensor input 0, ...) on one mesh axis, as in rules.py


def _arg(node: Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return dict(node.kwargs).get(name, default)


def attention(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    q = ins[0]
    ndim = len(q.shape)
    rules: list[AxisRule] = []
    grouped = bool(dict(node.kwargs).get("enable_gqa", False))
    for d in range(ndim - 2):
        heads = grouped and d == ndim - 3
        rules.append(
            (shard(d), *[_with_queries(d, q, t, heads and i in (1, 2)) for i, t in enumerate(ins)])
        )
        if heads and 1 < ins[1].shape[d] < q.shape[d]:  # the key-value heads whole
            rest = [_with_queries(d, q, t, False) for t in ins[3:]]
            rules.append((shard(d), shard(d), R, R, *rest))
    if q.shape[-2] > 1 and not _arg(node, 4, "dropout_p", 0.0):
        masks = [
            R if len(t.shape) < 2 or t.shape[-2] == 1 else shard(len(t.shape) - 2) for t in ins[3:]
        ]
        rules.append((shard(ndim - 2), shard(ndim - 2), R, R, *masks))
    return rules


def flex_attention(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    q = ins[0]
    rules: list[AxisRule] = []
    for d in (0, 1):  # batch, heads
        qkv = [_with_queries(d, q, t, d == 1) for t in ins[:3]]
        if d == 1 and R in qkv[1:]:
            continue  # fewer key-value heads than ranks: the local heads would pair wrongly
        rules.append((shard(d), *qkv, *[R] * (len(ins) - 3)))
    return rules


def flex_offsets(
    inputs: Sequence[Spec],
    q_shape: tuple[int, ...],
    coordinate: Sequence[int],
    mesh_shape: Sequence[int],
) -> tuple[int, int]:
    """The batch and head index in one process of this rank's first query of a FlexAttention
    placed ``inputs``: what its score_mod and mask_mod are given added to the local ones."""
    batch = _block(inputs[0], 0, q_shape[0], coordinate, mesh_shape)[0]
    return batch, _block(inputs[0], 1, q_shape[1], coordinate, mesh_shape)[0]


def _with_queries(d: int, q: TensorInfo, t: TensorInfo, key_heads: bool) -> str:
    """How input ``t`` is placed where the queries split along dim ``d`` (batch or heads): a
    mask broadcast along it (one for every head) stays whole. Grouped-query attention's fewer
    key-value heads (``key_heads``) split with the queries' heads: a rank's query heads are
    whole groups, and their key-value heads its share. Multi-query attention's one key-value
    head stays whole: it serves every rank's query heads (its gradient then a partial sum)."""
    if len(t.shape) != len(q.shape):
        return R
    if t.shape[d] == q.shape[d] or (key_heads and t.shape[d] > 1 and q.shape[d] % t.shape[d] == 0):
        return shard(d)
    return R


def _block(
    spec: Spec, dim: int, size: int, coordinate: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[int, int]:
    """(first index, count) of this rank's block of a dim of ``size`` placed ``spec``: the
    axes that split it nested outer first, as DTensor nests them."""
    index, block = 0, size
    for a, p in enumerate(spec):
        if shard_dim(p) == dim:
            index = index * mesh_shape[a] + coordinate[a]
            block //= mesh_shape[a]
    return index * block, block


def key_heads(
    inputs: Sequence[Spec],
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    coordinate: Sequence[int],
    mesh_shape: Sequence[int],
) -> tuple[int, ...] | None:
    """Grouped-query attention's key-value head of each of this rank's query heads, as an
    index into its local key-value heads, where ``scaled_dot_product_attention(...,
    enable_gqa=True)`` on the local tensors would pair them otherwise (the key-value heads
    whole, or split less than the queries': each local query head ``j`` would read local head
    ``j // (local query heads / local key-value heads)``); None where it pairs them right.
    One process's query head ``h`` reads key-value head ``h // (query heads / key-value
    heads)``."""
    d = len(q_shape) - 3
    group = q_shape[d] // k_shape[d]
    q_first, q_count = _block(inputs[0], d, q_shape[d], coordinate, mesh_shape)
    k_first, k_count = _block(inputs[1], d, k_shape[d], coordinate, mesh_shape)
    found = tuple((q_first + j) // group - k_first for j in range(q_count))
    assert all(0 <= h < k_count for h in found), (inputs, q_shape, k_shape, coordinate)
    if q_count % k_count == 0 and found == tuple(j // (q_count // k_count) for j in range(q_count)):
        return None
    return found


def context_axes(inputs: Sequence[Spec], q_ndim: int) -> tuple[int, ...]:
    """The mesh axes on which an attention placed ``inputs`` (q, k, v, ...) splits its
    queries along the sequence with its keys whole: context parallelism."""
    seq = q_ndim - 2
    q, k = inputs[0], inputs[1]
    return tuple(a for a, p in enumerate(q) if shard_dim(p) == seq and k[a] == R)


def query_offset(
    inputs: Sequence[Spec],
    q_shape: tuple[int, ...],
    coordinate: Sequence[int],
    mesh_shape: Sequence[int],
) -> int:
    """The position in the whole sequence of this rank's first query (at ``coordinate`` on a
    mesh of ``mesh_shape``): its block's index along the sequence, the axes that split it
    (the context axes: no rule splits the keys' sequence) nested outer first, times the
    block's length."""
    return _block(inputs[0], len(q_shape) - 2, q_shape[-2], coordinate, mesh_shape)[0]
