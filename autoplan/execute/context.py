"""Attention on local shards: context parallelism's block of queries, and grouped-query
attention's key-value heads.

Under context parallelism (`autoplan.strategies.attention`) a rank holds a block of the
queries, split along the sequence, and the keys and values whole. Without a causal mask its
local attention is exactly its block of the result. A causal one (``is_causal=True``) masks
by position, and torch places the local block's first query at position 0: here it is at
its block's place in the sequence (`query_offset`), so the rank passes the mask of those
positions, query ``i`` seeing the keys up to ``offset + i``, as one process does.

Grouped-query attention with its query heads split and its key-value heads whole (fewer
than the ranks: Megatron's and vLLM's replicated key-value heads) or split less: torch's
``enable_gqa`` would pair the local query heads with the local key-value heads as if they were
the whole, so each rank picks the key-value head each of its query heads reads in one process
(`autoplan.strategies.attention.key_heads`) and attends head by head. Autograd sends the
picked heads' gradients back to the whole key and value: partial sums, as planned.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.planfile.schema import Plan
from autoplan.strategies.attention import context_axes, key_heads, query_offset

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def causal_offsets(
    graph: torch.fx.Graph, plan: Plan, local: Collection[str], mesh: DeviceMesh
) -> dict[str, int]:
    """By causal attention run on local shards with its queries split along the sequence
    (the ``local`` ops of a stage on ``mesh``), this rank's first query's position."""
    axes, coordinate = plan.stage_axes, mesh.get_coordinate()
    found = {}
    for node in graph.nodes:
        if node.name not in local or node.target is not SDPA or coordinate is None:
            continue
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        inputs = [tuple(p[a] for a in axes) for p in plan.nodes[node.name].inputs]
        q_shape = tuple(node.args[0].meta["val"].shape)
        if causal and context_axes(inputs, len(q_shape)):
            found[node.name] = query_offset(inputs, q_shape, coordinate, mesh.shape)
    return found


def grouped_heads(
    graph: torch.fx.Graph, plan: Plan, local: Collection[str], mesh: DeviceMesh
) -> dict[str, tuple[int, ...]]:
    """By grouped-query attention run on local shards (``enable_gqa``; the ``local`` ops of a
    stage on ``mesh``) whose local heads torch would pair wrongly: the local key-value head
    of each of this rank's query heads."""
    axes, coordinate = plan.stage_axes, mesh.get_coordinate()
    found = {}
    for node in graph.nodes:
        if node.name not in local or node.target is not SDPA or coordinate is None:
            continue
        if not node.kwargs.get("enable_gqa", False):
            continue
        inputs = [tuple(p[a] for a in axes) for p in plan.nodes[node.name].inputs]
        q, k = (tuple(node.args[i].meta["val"].shape) for i in range(2))
        heads = key_heads(inputs, q, k, coordinate, mesh.shape)
        if heads is not None:
            found[node.name] = heads
    return found


def attention(
    args: tuple[Any, ...], kwargs: dict[str, Any], offset: int | None, heads: tuple[int, ...] | None
) -> torch.Tensor:
    """``scaled_dot_product_attention(*args, **kwargs)`` on local shards: each query head with
    the key-value head ``heads`` names (`grouped_heads`), its causal mask shifted by ``offset``
    (`shifted_causal`)."""
    if heads is not None:
        q, k, v = args[:3]
        index = torch.tensor(heads, device=q.device)
        picked = [t.index_select(-3, index) for t in (k, v)]
        args = (q, *picked, *args[3:])
        kwargs = {**kwargs, "enable_gqa": False}  # one key-value head a query head now
    if offset is not None:
        return shifted_causal(args, kwargs, offset)
    return SDPA(*args, **kwargs)


def shifted_causal(args: tuple[Any, ...], kwargs: dict[str, Any], offset: int) -> torch.Tensor:
    """``scaled_dot_product_attention(*args, **kwargs)`` with its causal mask shifted: the
    local queries are at positions ``offset, offset + 1, ...`` of the sequence."""
    q, k, v = args[:3]
    # the schema: (q, k, v, attn_mask, dropout_p, is_causal, *, scale, enable_gqa); causal
    # attention has no mask of its own, and context parallelism no dropout
    named = {key: value for key, value in kwargs.items() if key not in ("attn_mask", "is_causal")}
    queries = torch.arange(offset, offset + q.shape[-2], device=q.device)
    mask = torch.arange(k.shape[-2], device=q.device)[None, :] <= queries[:, None]
    return SDPA(q, k, v, mask, *args[4:5], **named)
