"""Our rules for the ops real models carry beside their matmuls (strategies/rules.py): the
mixtures of experts' routing (sort, topk, gathers and scatters, torchtitan's
deterministic_scatter_add, histograms, bincount),
attention masks (where, diff, factories like ``new_ones``), slice assignments (copy,
slice_scatter, select_scatter), indexed assignments (index_put), a cache's concatenation
onto an empty tensor, splits, and RMS norms. Each rule, run by the executor's local path on
two ranks' shards, makes the shards (or, for ``P``, the partial sums) of the whole result."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torchtitan.ops.scatter_add import deterministic_scatter_add

from autoplan.execute.context import attention
from autoplan.execute.interpreter import Arguments
from autoplan.execute.op_calls import SIZED, call_op, local_shape, runs_locally
from autoplan.graph.capture import graph_from_export
from autoplan.graph.passes import drop_checks
from autoplan.strategies.attention import key_heads
from autoplan.strategies.placement import is_valid
from autoplan.strategies.rules import own_rule


class _Routing(nn.Module):
    """x (4, 6, 8) scores, ids (4, 6) token ids, mask (4, 6), slots (6,) indices below 3."""

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        values, order = x.sort(dim=-1)
        top, chosen = x.topk(4)
        ranks = x.argsort(dim=1, stable=True)
        picked = x.gather(2, chosen)
        spread = torch.zeros_like(x).scatter(2, chosen, 1.0)
        added = torch.zeros_like(x).scatter_add(2, chosen, top)
        # torchtitan's MoE combine: rows added into their tokens along dim 0
        tokens = (ids[:2] % 4).unsqueeze(-1).expand(2, 6, 8)
        combined = deterministic_scatter_add(torch.zeros_like(x), tokens, x[:2] * 2)
        pooled = x.new_zeros(4, 3, 8).index_add(1, slots, x)
        counts = torch.histc(x, bins=6, min=-2.0, max=2.0)
        # slots per index, at the length the model uses them (3: minlength, so every slot is
        # below it), plain and weighted
        binned = torch.bincount(slots, minlength=3) * ids[0, :3]
        weighed = torch.bincount(slots, x[0, :, 0], minlength=3) + x[0, 0, :3]
        halves = ids // 2
        steps = ids.diff(dim=1)
        ones = x.new_ones(4, 6)
        typed = ids.type_as(x)
        masked = torch.where(mask, x.sum(-1), 0.0)
        joined = torch.cat([x.new_empty(0), x], dim=-2)  # a cache's first keys
        buffer = x.new_empty(4, 6, 10)
        buffer[..., :8] = x  # copy + slice_scatter, once made functional
        buffer[..., 8:] = x[..., :1]
        rows = x.clone()
        rows[:, 2] = x[:, 0] * 2  # select_scatter, once made functional
        head, tail = x.split([2, 4], dim=1)  # a class token split off
        normed = nn.functional.rms_norm(x, (8,), x[0, 0])
        put = x.new_zeros(4, 6, 8)
        put[:, slots[:3]] = x[:, :3] * 2  # index_put, once made functional
        put[:, slots[3:]] = x[0, :3]  # values broadcast along the batch
        summed = x.new_zeros(3, 8).index_put_((slots,), x[0], accumulate=True)
        left, right = x.split(4, dim=2)
        return (
            *(values, order, top, picked, spread, added, pooled, counts, binned, weighed),
            *(halves, steps, combined),
            *(ones, typed, masked, joined, buffer, rows, ranks, head, tail, left, right),
            normed,
            put,
            summed,
        )


def _inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    ids = torch.randint(0, 16, (4, 6))
    return x, ids, ids % 3 == 0, torch.tensor([0, 2, 1, 1, 0, 2])


def _placement(spec: str) -> Placement:
    return Replicate() if spec == "R" else Partial() if spec == "P" else Shard(int(spec[2:-1]))


def _shard(value: Any, spec: str, rank: int) -> Any:
    if spec == "P":  # partial sums: the value on one rank, zeros on the other
        return value if rank == 0 else torch.zeros_like(value)
    if spec == "R" or not isinstance(value, torch.Tensor):
        return value
    return value.chunk(2, int(spec[2:-1]))[rank]


def _whole(parts: list[torch.Tensor], spec: str) -> torch.Tensor:
    if spec == "P":
        return parts[0] + parts[1]
    if spec == "R":
        assert torch.equal(parts[0], parts[1])
        return parts[0]
    return torch.cat(parts, int(spec[2:-1]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN for NaN: a slice assignment into ``new_empty`` keeps the rest of the
    buffer's uninitialized memory, whose bits may read as NaN."""
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return a.shape == b.shape and bool(((a == b) | (nan & b.isnan())).all())


TESTED = {
    "aten.sort.default",
    "aten.topk.default",
    "aten.argsort.stable",
    "aten.gather.default",
    "aten.scatter.value",
    "aten.scatter_add.default",
    "torchtitan.deterministic_scatter_add.default",
    "aten.index_add.default",
    "aten.histc.default",
    "aten.bincount.default",
    "aten.floor_divide.default",
    "aten.diff.default",
    "aten.new_ones.default",
    "aten.new_zeros.default",
    "aten.type_as.default",
    "aten.where.ScalarOther",
    "aten.cat.default",
    "aten.copy.default",
    "aten.slice_scatter.default",
    "aten.select_scatter.default",
    "aten.split_with_sizes.default",
    "aten.split.Tensor",
    "aten.rms_norm.default",
    "aten.index_put.default",
}


def test_rules_are_exact_on_two_shards() -> None:
    inputs = _inputs()
    ep = torch.export.export(_Routing(), inputs).run_decompositions({})
    drop_checks(ep)  # as capture does: bincount's length checked at trace time
    graph = graph_from_export(ep)
    env: dict[str, Any] = {}
    supply = iter(inputs)
    seen: dict[str, int] = {}
    for fx_node in ep.graph.nodes:
        if fx_node.op == "placeholder":
            env[fx_node.name] = next(supply)
            continue
        if fx_node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: env[n.name])
        env[fx_node.name] = whole = fx_node.target(*args, **kwargs)
        if fx_node.target is operator.getitem or graph.node(fx_node.name).op not in TESTED:
            continue
        node = graph.node(fx_node.name)
        rule = own_rule(node.op)
        assert rule is not None, node.op
        ins = [graph.tensor(r) for r in node.refs]
        rules = [  # those the planner keeps: every tensor split evenly (space._expand)
            (out, *specs)
            for out, *specs in rule(node, ins)
            if all(is_valid((out,), o.shape, (2,)) for o in node.outputs)
            and all(is_valid((s,), t.shape, (2,)) for s, t in zip(specs, ins, strict=True))
        ]
        seen[node.op] = seen.get(node.op, 0) + len(rules)
        reads = fx_node.all_input_nodes
        for out, *specs in rules:
            placed = [(_placement(s),) for s in specs]
            assert runs_locally(fx_node, placed, (_placement(out),)), (node.op, out, specs)
            shape = None
            if fx_node.target in SIZED:
                shape = local_shape(fx_node, (_placement(out),), (2,))
            parts = []
            for rank in range(2):
                local = [_shard(env[n.name], s, rank) for n, s in zip(reads, specs, strict=True)]
                a, k = Arguments.of(fx_node, torch.device("cpu"), shape).fill(local)
                parts.append(call_op(fx_node, a, k))
            many = isinstance(whole, tuple | list)
            wholes = whole if many else (whole,)
            made = list(zip(*parts, strict=True)) if many else [parts]
            for want, got in zip(wholes, made, strict=True):
                assert _same(_whole(list(got), out), want), (node.op, out, specs)
    # every op met, each with a rule that splits something
    assert set(seen) == TESTED and all(seen.values()), seen


class _MultiQuery(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_multi_query_attention_splits_its_query_heads_beside_its_one_key_value_head() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    graph = graph_from_export(torch.export.export(_MultiQuery(), (q, k, v)))
    node = next(n for n in graph if n.op == "aten.scaled_dot_product_attention.default")
    rule = own_rule(node.op)
    assert rule is not None
    heads = ("S(1)", "S(1)", "R", "R")
    assert heads in rule(node, [graph.tensor(r) for r in node.refs])
    # each rank's query heads against the one key-value head: the output's shards, and the
    # key's and value's gradients partial sums (the rule's R input under a split output)
    out = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    parts, partial = [], [torch.zeros_like(k), torch.zeros_like(v)]
    for rank in range(2):
        q_r = q.detach().chunk(2, 1)[rank].requires_grad_()
        k_r, v_r = k.detach().requires_grad_(), v.detach().requires_grad_()
        out_r = nn.functional.scaled_dot_product_attention(q_r, k_r, v_r, enable_gqa=True)
        out_r.backward(grad.chunk(2, 1)[rank])
        parts.append(out_r.detach())
        partial = [partial[0] + k_r.grad, partial[1] + v_r.grad]
    assert torch.allclose(torch.cat(parts, 1), out.detach())
    assert torch.allclose(partial[0], k.grad) and torch.allclose(partial[1], v.grad)


@pytest.mark.parametrize("query_heads, key_value_heads", [(8, 2), (12, 3)])
def test_grouped_attention_with_fewer_key_value_heads_than_ranks(
    query_heads: int, key_value_heads: int
) -> None:
    """Four ranks, each with a quarter of the query heads and every key-value head: 2 heads
    (two ranks a head) and 3 (rank 1's three query heads read heads 0, 1 and 1), each rank
    attending with the heads its queries read, the key's and value's gradients partial sums."""
    torch.manual_seed(0)
    ranks = 4
    q = torch.randn(2, query_heads, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, key_value_heads, 6, 8, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    graph = graph_from_export(torch.export.export(_MultiQuery(), (q, k, v)))
    node = next(n for n in graph if n.op == "aten.scaled_dot_product_attention.default")
    rule = own_rule(node.op)
    assert rule is not None
    specs = (("S(1)",), ("S(1)",), ("R",), ("R",))
    placed = tuple(s[0] for s in specs)
    assert placed in rule(node, [graph.tensor(r) for r in node.refs])
    out = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    parts, partial = [], [torch.zeros_like(k), torch.zeros_like(v)]
    shapes = tuple(q.shape), tuple(k.shape)
    for rank in range(ranks):
        heads = key_heads(specs[1:], *shapes, (rank,), (ranks,))
        assert heads is not None  # torch's own pairing of the local heads would be wrong
        q_r = q.detach().chunk(ranks, 1)[rank].requires_grad_()
        k_r, v_r = k.detach().requires_grad_(), v.detach().requires_grad_()
        out_r = attention((q_r, k_r, v_r), {"enable_gqa": True}, None, heads)
        out_r.backward(grad.chunk(ranks, 1)[rank])
        parts.append(out_r.detach())
        partial = [partial[0] + k_r.grad, partial[1] + v_r.grad]
    assert torch.allclose(torch.cat(parts, 1), out.detach())
    assert torch.allclose(partial[0], k.grad) and torch.allclose(partial[1], v.grad)
    # split with the queries (2 ranks, 2 heads each), torch's pairing is right: nothing picked
    assert key_heads((("S(1)",), ("S(1)",)), (2, 4, 6, 8), (2, 2, 6, 8), (1,), (2,)) is None
