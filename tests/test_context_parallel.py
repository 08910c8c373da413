"""Context parallelism: attention with its queries split along the sequence, its keys and
values gathered (strategies/attention.py), run exactly on each rank's block of queries
(execute/context.py), priced and chosen by the planner where it is the fastest plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplan
from autoplan import PlanOptions
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import AutoplanError
from autoplan.execute.context import shifted_causal
from autoplan.graph.blocks import find_sharing
from autoplan.graph.capture import capture, graph_from_export
from autoplan.planfile.show import summary
from autoplan.search.intra_op import build_problem, solve_problem
from autoplan.strategies.attention import context_axes, query_offset
from autoplan.strategies.placement import Collective
from autoplan.strategies.rules import own_rule
from autoplan.strategies.space import Strategy, strategy_space
from tests.conftest import ROOT, example

SDPA = "aten.scaled_dot_product_attention.default"


class _Attentions(nn.Module):
    """q, k, v (2, 4, 8, 16); masks (8, 8) and (2, 1, 8, 8): causal, masked, and with
    dropout."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        heads: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return (
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5),
            F.scaled_dot_product_attention(q, k, v, attn_mask=heads),
        )


def test_attention_splits_queries_along_the_sequence_with_keys_whole() -> None:
    q = torch.randn(2, 4, 8, 16)
    masks = torch.ones(8, 8, dtype=torch.bool), torch.ones(2, 1, 8, 8, dtype=torch.bool)
    ep = torch.export.export(_Attentions(), (q, q, q, *masks))
    graph = graph_from_export(ep)
    causal, masked, dropped, over_heads = [n for n in graph if n.op == SDPA]
    rule = own_rule(SDPA)
    assert rule is not None

    def rules(node: autoplan.graph.ir.Node) -> list[tuple[str, ...]]:
        assert rule is not None
        return rule(node, [graph.tensor(r) for r in node.refs])

    # batch, heads, and the queries' sequence (keys and values whole)
    assert rules(causal) == [
        ("S(0)", "S(0)", "S(0)", "S(0)"),
        ("S(1)", "S(1)", "S(1)", "S(1)"),
        ("S(2)", "S(2)", "R", "R"),
    ]
    # a mask (queries, keys) splits along its queries; broadcast over batch and heads
    assert ("S(2)", "S(2)", "R", "R", "S(0)") in rules(masked)
    assert ("S(0)", "S(0)", "S(0)", "S(0)", "R") in rules(masked)
    # a mask of one head splits by sequence with the queries (its heads rule asks for its
    # dim of one head split too, which no mesh does evenly: a known gap)
    assert ("S(2)", "S(2)", "R", "R", "S(2)") in rules(over_heads)
    # dropout's draws on a block of queries are not one process's: no sequence split
    assert all(r[0] != "S(2)" for r in rules(dropped))


def test_query_offsets_nest_the_axes_outer_first() -> None:
    cp = [("S(2)", "S(2)"), ("R", "R"), ("R", "R")]
    assert context_axes(cp, 4) == (0, 1)
    # 32 queries in 4 blocks of 8 over a (2, 2) mesh: block 2 * outer + inner
    offsets = [query_offset(cp, (1, 1, 32, 4), (a, b), (2, 2)) for a in (0, 1) for b in (0, 1)]
    assert offsets == [0, 8, 16, 24]
    heads_then_cp = [("S(1)", "S(2)"), ("S(1)", "R"), ("S(1)", "R")]
    assert context_axes(heads_then_cp, 4) == (1,)
    assert query_offset(heads_then_cp, (1, 4, 32, 4), (1, 1), (2, 2)) == 16
    assert context_axes([("S(2)",), ("S(2)",), ("S(2)",)], 4) == ()  # keys split too: not CP


def test_shifted_causal_blocks_make_the_whole_attention_and_its_gradients() -> None:
    """Four ranks' blocks of queries against the whole keys: their outputs are the whole
    causal attention's rows, and their keys' and values' gradients sum to the whole ones
    (the partial sums that backward reduce-scatters)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad_out = torch.randn_like(whole)
    want = torch.autograd.grad(whole, (q, k, v), grad_out)
    outs, grads = [], []
    for rank in range(4):
        offset = query_offset([("S(2)",), ("R",), ("R",)], tuple(q.shape), (rank,), (4,))
        block = q.detach().chunk(4, 2)[rank].requires_grad_()
        keys, values = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = shifted_causal((block, keys, values), {"is_causal": True}, offset)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (block, keys, values), grad_out.chunk(4, 2)[rank]))
    torch.testing.assert_close(torch.cat(outs, 2), whole)
    torch.testing.assert_close(torch.cat([g[0] for g in grads], 2), want[0])
    torch.testing.assert_close(sum(g[1] for g in grads), want[1])
    torch.testing.assert_close(sum(g[2] for g in grads), want[2])


def test_keys_are_gathered_and_their_gradients_reduce_scattered() -> None:
    """Priced as the executor runs it: the keys and values all-gathered in forward, their
    partial gradients reduce-scattered in backward, and kept whole for backward."""
    w = example("gpt", size="tiny", num_layers=1, batch_size=1, seq_len=64, num_heads=1)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    cpu4 = autoplan.Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")
    pricer = Pricer(cpu4, (4,), "adamw")
    node = next(n for n in graph if n.op == SDPA)
    keys = graph.tensor(node.refs[1])
    assert node.keys_bytes == 2 * keys.nbytes  # keys and values: (1, 1, 64, 64) float32 each
    cp = Strategy(("S(2)",), (("S(2)",), ("R",), ("R",)))
    whole = Strategy(("R",), (("R",),) * 3)
    producer = Strategy(("S(2)",), ())
    _, gathered = pricer.forward(keys, producer, cp, 1)
    assert gathered == (Collective("all_gather", (0,), keys.nbytes),)
    _, reduced = pricer.gradient(keys, ("P",), producer)
    assert reduced == (Collective("reduce_scatter", (0,), keys.nbytes),)
    assert pricer.keys_memory(node, cp) == node.keys_bytes
    assert pricer.keys_memory(node, whole) == 0.0
    # the rest of what it keeps splits four ways with the queries
    assert pricer.activation_memory(node, cp) == pytest.approx(
        pricer.activation_memory(node, whole) / 4 + node.keys_bytes
    )


def _solved(
    w: autoplan.Workload, cluster: autoplan.Cluster, drop_cp: bool
) -> tuple[float, dict[str, Strategy]]:
    """The one-stage ILP's optimum on (8,), with context parallelism left out if asked."""
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    mesh = (8,)
    space = strategy_space(graph, mesh)
    if drop_cp:
        for name, ns in space.items():
            if graph.node(name).op == SDPA:
                kept = tuple(s for s in ns.strategies if not context_axes(s.inputs, 4))
                space[name] = dataclasses.replace(ns, strategies=kept)
    layers = find_sharing(graph)
    pricer = Pricer(cluster, mesh, "adamw")
    problem, grouping = build_problem(graph, layers, space, pricer, cluster.device.memory_bytes)
    result = solve_problem(graph, layers, space, problem, grouping, mesh, 60.0)
    return result.solution.objective, dict(result.assignment)


def test_planner_splits_long_attention_along_the_sequence() -> None:
    """A 1.3B GPT's two blocks with 2 heads (which do not split 8 ways) on 8 H100s: at 64k
    tokens the attention's square work dominates, and splitting its queries along the
    sequence is the fastest plan, faster than the best without it; at 1k tokens it is not
    chosen (gathering the keys costs more than the attention it shares; at 2k the two are
    priced within 0.3% of each other)."""
    h100 = autoplan.Cluster.load(ROOT / "costmodels" / "h100-sxm-8.json")
    sizes = {"size": "1.3b", "num_layers": 2, "num_heads": 2, "device": "meta"}
    long = example("gpt", **sizes, batch_size=1, seq_len=65536, dtype="bfloat16")
    with_cp, assignment = _solved(long, h100, drop_cp=False)
    without, _ = _solved(long, h100, drop_cp=True)
    attention = [s for name, s in assignment.items() if name.startswith("scaled_dot_product")]
    assert attention and all(context_axes(s.inputs, 4) == (0,) for s in attention)
    assert with_cp < without
    plan = long.plan(h100, PlanOptions(mesh_shape=(8,), pipeline=False))
    assert "2 of 2 attention(s) split along the sequence 8 ways on cp" in summary(plan)
    short = example("gpt", **sizes, batch_size=1, seq_len=1024, dtype="bfloat16")
    plan = short.plan(h100, PlanOptions(mesh_shape=(8,), pipeline=False))
    chosen = [n for n in plan.nodes.values() if n.op == SDPA]
    assert chosen and all("S(2)" not in n.output.values() for n in chosen)
    assert "attention(s) split along the sequence" not in summary(plan)


def test_baseline_splits_every_op_along_the_sequence_on_cp() -> None:
    """baseline(cp=2) beside dp=2: the inputs split along the batch on dp and the sequence on
    cp; every attention takes its block of queries against the gathered keys; parameters
    whole on cp, their gradients all-reduced over dp and cp together."""
    cpu4 = autoplan.Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")
    w = example("gpt", size="tiny", num_layers=2, batch_size=4, seq_len=64)
    plan = w.baseline(cpu4, dp=2, tp=1, cp=2)
    assert plan.mesh.axes == ("dp", "cp") and plan.mesh.shape == (2, 2)
    assert plan.nodes["args_0"].output == {"dp": "S(0)", "cp": "S(1)"}
    attention = [n for n in plan.nodes.values() if n.op == SDPA]
    assert [n.inputs[:3] for n in attention] == [
        ({"dp": "S(0)", "cp": "S(2)"}, {"dp": "S(0)", "cp": "R"}, {"dp": "S(0)", "cp": "R"})
    ] * 2
    assert all(p.placements == {"dp": "R", "cp": "R"} for p in plan.params.values())
    gathered = {(c.phase, c.kind) for c in plan.collectives if c.node.startswith("scaled_dot")}
    assert gathered == {("forward", "all_gather"), ("backward", "reduce_scatter")}
    assert {c.axes for c in plan.collectives if c.phase == "grad_sync"} == {("dp", "cp")}
    assert "2 of 2 attention(s) split along the sequence 2 ways on cp" in summary(plan)


def test_baseline_cp_refusals() -> None:
    cpu4 = autoplan.Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")
    w = example("gpt", size="tiny", num_layers=2, batch_size=4, seq_len=6)
    with pytest.raises(AutoplanError, match=r"cp=4 does not divide the sequence"):
        w.baseline(cpu4, dp=1, tp=1, cp=4)
    with pytest.raises(AutoplanError, match=r"cp=2 with pp=2.*use pp=1"):
        w.baseline(cpu4, dp=1, tp=1, pp=2, cp=2)
    with pytest.raises(AutoplanError, match=r"dp \* tp \* pp \* cp = 1 \* 1 \* 1 \* 2"):
        w.baseline(cpu4, dp=1, tp=1, cp=2)


class _Cache(nn.Module):
    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return torch.cat([k.new_empty(0), k], dim=-2)


def test_keys_joined_to_an_empty_cache_stay_split_along_the_sequence() -> None:
    ep = torch.export.export(_Cache(), (torch.randn(2, 4, 8, 16),))
    graph = graph_from_export(ep)
    (cat,) = [n for n in graph if n.op == "aten.cat.default"]
    rule = own_rule(cat.op)
    assert rule is not None
    assert ("S(2)", "R", "S(2)") in rule(cat, [graph.tensor(r) for r in cat.refs])
