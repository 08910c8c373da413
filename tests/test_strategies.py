"""Placements, redistribution, our rules and the DTensor rule adapter."""

from __future__ import annotations

import torch

import autoplan
from autoplan.costmodel.pricer import Pricer
from autoplan.graph.capture import capture
from autoplan.graph.ir import Ref, TensorInfo
from autoplan.graph.recompute import Recompute
from autoplan.strategies import dtensor_rules
from autoplan.strategies.placement import Collective, grad_spec, is_valid, redistribute
from autoplan.strategies.rules import _view_dim_map, own_rule
from autoplan.strategies.space import Strategy, strategy_space
from tests.conftest import example


def test_redistribute_by_hand() -> None:
    shape, mesh = (8, 16), (4,)
    full = 8 * 16 * 4  # bytes of the whole fp32 tensor
    assert redistribute(("R",), ("S(0)",), shape, 4, mesh) == ()  # a local slice
    assert redistribute(("P",), ("R",), shape, 4, mesh) == (Collective("all_reduce", (0,), full),)
    assert redistribute(("P",), ("S(1)",), shape, 4, mesh) == (
        Collective("reduce_scatter", (0,), full),
    )
    assert redistribute(("S(0)",), ("R",), shape, 4, mesh) == (
        Collective("all_gather", (0,), full),
    )
    assert redistribute(("S(0)",), ("S(1)",), shape, 4, mesh) == (
        Collective("all_to_all", (0,), full // 4),
    )


def test_redistribute_on_2d_mesh_counts_the_other_axis_split() -> None:
    # (2, 2) mesh: axis 0 gathers dim 0 while axis 1 still splits dim 1 in two
    found = redistribute(("S(0)", "S(1)"), ("R", "S(1)"), (8, 16), 4, (2, 2))
    assert found == (Collective("all_gather", (0,), 8 * 8 * 4),)
    # nothing split in the source: outer axis first, as DTensor does
    found = redistribute(("P", "P"), ("R", "R"), (4,), 2, (2, 2))
    assert found == (Collective("all_reduce", (0,), 8), Collective("all_reduce", (1,), 8))


def test_redistribute_matches_dtensor_order_and_nesting() -> None:
    """What DTensor 2.13 issued for these on a gloo (2, 2) mesh (tests/distributed checks
    whole plans the same way)."""
    mib = 2**20
    # gather the inner axis first, then reduce the full tensor on the outer one
    found = redistribute(("P", "S(1)"), ("R", "R"), (512, 512), 4, (2, 2))
    assert found == (Collective("all_gather", (1,), mib), Collective("all_reduce", (0,), mib))
    # dim 1 split on both axes: changing the outer split needs the inner one gathered first
    found = redistribute(("S(1)", "S(1)"), ("R", "S(1)"), (256, 256), 4, (2, 2))
    assert found == (Collective("all_gather", (1,), 131072), Collective("all_gather", (0,), 262144))
    # partial on both axes, nothing split: outer axis first, both on the whole 512 KiB
    found = redistribute(("P", "P"), ("R", "S(0)"), (256, 512), 4, (2, 2))
    assert found == (
        Collective("all_reduce", (0,), 2**19),
        Collective("reduce_scatter", (1,), 2**19),
    )


def test_gradient_placements() -> None:
    # column-split linear: replicated input, split output -> the input gradient is partial
    assert grad_spec(("R",), ("S(1)",)) == ("P",)
    # data parallel weight: replicated weight, batch-split output -> partial weight gradient
    assert grad_spec(("R", "R"), ("S(0)", "R")) == ("P", "R")
    # an input read as partial gets a replicated gradient; a split one a split gradient
    assert grad_spec(("P",), ("P",)) == ("R",)
    assert grad_spec(("S(0)",), ("S(0)",)) == ("S(0)",)
    # a replicated op that keeps its output's gradient partial hands its inputs partial ones
    assert grad_spec(("R", "R"), ("R", "R"), ("P", "R")) == ("P", "R")


def test_only_replicated_ops_whose_inputs_they_alone_read_keep_gradients_partial() -> None:
    w = example("gpt", size="tiny", num_layers=2, batch_size=2)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    space = strategy_space(graph, (4,))
    kept = {n for n, ns in space.items() if any(s.grad is not None for s in ns.strategies)}
    # the position embedding reads its weight alone, as the final layer norm its input;
    # arange needs no gradient; a block's first layer norm shares its input with the
    # residual add
    assert graph.node("embedding_1").module_path == "pos_emb"
    assert {"embedding", "embedding_1", "layer_norm_4"} <= kept
    assert graph.fan_out(Ref("add")) == 2 and "layer_norm" not in kept and "arange" not in kept
    (strategy,) = [s for s in space["embedding_1"].strategies if s.grad is not None]
    assert strategy.grad == ("P",) and strategy.output == ("R",)
    assert all(i == ("R",) for i in strategy.inputs)
    assert not any(s.grad for ns in strategy_space(graph, (1,)).values() for s in ns.strategies)


def test_uneven_or_missing_dims_are_invalid() -> None:
    assert is_valid(("S(0)",), (8, 3), (4,))
    assert not is_valid(("S(1)",), (8, 3), (4,))
    assert not is_valid(("S(2)",), (8, 3), (4,))
    assert not is_valid(("S(0)", "S(0)"), (4, 3), (4, 2))  # 4 rows cannot split 8 ways


def test_view_dim_map() -> None:
    # (B, T, C) -> (B, T, H, D): C splits into heads, the head dim is not splittable
    assert _view_dim_map((2, 16, 64), (2, 16, 4, 16)) == {0: 0, 1: 1, 2: 2}
    # flatten (B, T, V) -> (B*T, V): only the outer dim of a merged group maps
    assert _view_dim_map((2, 16, 128), (32, 128)) == {0: 0, 2: 1}
    assert _view_dim_map((1, 8), (8,)) == {1: 0}


def _tensors(*shapes: tuple[int, ...]) -> list[TensorInfo]:
    return [TensorInfo(s, "float32") for s in shapes]


def test_linear_rule_has_data_column_and_row_splits() -> None:
    from autoplan.graph.ir import Node

    node = Node(
        "fc",
        "op",
        "aten.linear.default",
        (Ref("x"), Ref("w"), Ref("b")),
        (),
        tuple(_tensors((4, 8, 32))),
        0,
        0,
        0,
        "",
        "",
        ("w", "b"),
        True,
        False,
    )
    rule = own_rule(node.op)
    assert rule is not None
    rules = rule(node, _tensors((4, 8, 16), (32, 16), (32,)))
    assert ("S(0)", "S(0)", "R", "R") in rules  # batch
    assert ("S(2)", "R", "S(0)", "S(0)") in rules  # column: output features
    assert ("P", "S(2)", "S(1)", "P") in rules  # row: contraction, partial sums
    assert own_rule("aten._scaled_dot_product_flash_attention_for_cpu.default") is not None


def test_dtensor_adapter_translates_single_dim_rules() -> None:
    """Pins the private API this adapter relies on, in every torch autoplan supports."""
    assert dtensor_rules.has_rule("aten.add.Tensor")
    assert not dtensor_rules.has_rule("aten.renorm.default")
    tensors = {Ref("a"): TensorInfo((8, 4), "float32"), Ref("b"): TensorInfo((4,), "float32")}
    rules = dtensor_rules.axis_rules(
        "aten.add.Tensor", (Ref("a"), Ref("b")), (), tensors, 1, 2, [2, 1]
    )
    assert rules is not None
    assert ("S(0)", "S(0)", "R") in rules  # broadcast bias stays replicated
    assert ("S(1)", "S(1)", "S(0)") in rules
    assert ("P", "P", "P") in rules  # sums of partials stay partial
    mm = dtensor_rules.axis_rules(
        "aten.mm.default",
        (Ref("a"), Ref("c")),
        (),
        {**tensors, Ref("c"): TensorInfo((4, 6), "float32")},
        1,
        2,
        [2, 2],
    )
    assert mm is not None and ("P", "S(1)", "S(0)") in mm
    assert (
        dtensor_rules.axis_rules(
            "aten.renorm.default", (Ref("a"), 2.0, 1, 1.0), (), tensors, 1, 2, [2]
        )
        is None
    )


def test_pad_slice_cat_and_expand_split_only_the_dims_they_leave_alone() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Shifts(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            padded = F.pad(x, (0, 2), value=-100.0)  # the last dim, as labels are shifted
            shifted = padded[:, 1:]
            both = torch.cat([shifted, shifted], dim=1)
            return both + both[:, :1].expand(8, 14)

    graph = capture(Shifts(), (torch.randn(8, 6),))
    expected = {
        "aten.pad.default": [("S(0)", "S(0)")],
        "aten.slice.Tensor": [("S(0)", "S(0)")],
        "aten.cat.default": [("S(0)", "S(0)", "S(0)")],
        "aten.expand.default": [("S(0)", "S(0)")],  # dim 1 is broadcast from size 1
    }
    found = {}
    for node in graph:
        if node.op in expected and node.op not in found:
            rule = own_rule(node.op)
            assert rule is not None, node.op
            found[node.op] = rule(node, [graph.tensor(r) for r in node.refs])
    assert found == expected


def test_reductions_selects_convolutions_and_masks_keep_their_other_dims_split() -> None:
    import torch
    from torch import nn

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, kernel_size=2, stride=2)

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)  # (8, 4, 2, 2)
            rms = y.pow(2).mean(-1, keepdim=True)  # as RMSNorm
            total = y.sum(dim=[2, 3])  # (8, 4)
            first = y.select(1, 0)  # (8, 2, 2)
            both = keep & keep  # masks combined
            return rms.sum() + total.sum() + first.sum() + both.sum() + y.mean()

    graph = capture(Mixed(), (torch.randn(8, 3, 4, 4), torch.ones(8, 4, dtype=torch.bool)))
    expected = {
        "aten.conv2d.default": [("S(0)", "S(0)", "R", "R")],  # the batch only
        # kept dims (keepdim), and a partial sum over a reduced split dim: the executor runs a
        # mean as a sum over the global count
        "aten.mean.dim": [*[(f"S({d})", f"S({d})") for d in range(3)], ("P", "S(3)")],
        # kept dims (numbered in the output)
        "aten.sum.dim_IntList": [("S(0)", "S(0)"), ("S(1)", "S(1)"), ("P", "S(2)"), ("P", "S(3)")],
        # whole reductions: partial sums only
        "aten.sum.default": [("P", f"S({d})") for d in range(4)],
        "aten.mean.default": [("P", f"S({d})") for d in range(4)],
        "aten.select.int": [("S(0)", "S(0)"), ("S(1)", "S(2)"), ("S(2)", "S(3)")],
        "aten.__and__.Tensor": [("S(0)", "S(0)", "S(0)"), ("S(1)", "S(1)", "S(1)")],
    }
    found = {}
    for node in graph:
        if node.op in expected and node.op not in found:
            rule = own_rule(node.op)
            assert rule is not None, node.op
            found[node.op] = rule(node, [graph.tensor(r) for r in node.refs])
    assert found == expected


def _shard(t: torch.Tensor, spec: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``t`` placed ``spec`` over two ranks."""
    return t if spec == "R" else t.chunk(2, int(spec[2:-1]))[rank]


def test_matmul_rules_are_exact_on_two_shards() -> None:
    """Each rule of ``a @ b``, run on two ranks' shards, makes the shards (or, for ``P``,
    the partial sums) of the whole product: batch dims (an operand broadcast along one stays
    whole), rows, columns and the contraction, for the shapes torch broadcasts."""
    import torch

    from autoplan.graph.ir import Node

    cases = [
        ((2, 4, 6, 8), (2, 4, 8, 6)),  # eager attention's q @ k^T, by batch and heads
        ((2, 6, 8), (8, 4)),  # x @ W
        ((2, 4, 6, 8), (4, 8, 6)),  # b broadcast along the batch
        ((2, 1, 6, 8), (2, 4, 8, 6)),  # a broadcast along the heads
        ((8,), (2, 8, 6)),
        ((2, 6, 8), (8,)),
        ((8,), (8,)),
    ]
    for a_shape, b_shape in cases:
        a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
        whole = a @ b
        node = Node(
            "mm", "op", "aten.matmul.default", (Ref("a"), Ref("b")), (),
            tuple(_tensors(tuple(whole.shape))), 0, 0, 0, "", "", (), True, False,
        )  # fmt: skip
        rule = own_rule(node.op)
        assert rule is not None
        rules = rule(node, _tensors(a_shape, b_shape))
        assert rules and any(r[0] == "P" for r in rules), (a_shape, b_shape)
        for out, *specs in rules:
            parts = [_shard(a, specs[0], rank) @ _shard(b, specs[1], rank) for rank in range(2)]
            made = parts[0] + parts[1] if out == "P" else torch.cat(parts, int(out[2:-1]))
            assert torch.allclose(made, whole), (a_shape, b_shape, out, specs)


def test_the_vocabulary_splits_are_candidates_and_priced(cpu4: autoplan.Cluster) -> None:
    """The token embedding split by rows (its lookup a partial sum) and the loss on logits
    split along the classes (Megatron's), each all-reduce of the loss counted: the maximum,
    then the target's logit with the sum of exponentials, of each of this rank's tokens;
    the total weight of the targets where they split the batch."""
    w = example("gpt", size="tiny", batch_size=2)  # 32 tokens, a vocabulary of 128
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    loss, embedding = graph.node("cross_entropy_loss"), graph.node("embedding")
    ins = tuple(graph.tensor(r) for r in loss.refs)
    space = strategy_space(graph, (4,))
    assert Strategy(("P",), (("S(0)",), ("R",))) in space["embedding"].strategies
    vocab = Strategy(("R",), (("S(1)",), ("R",)))
    assert vocab in space["cross_entropy_loss"].strategies
    assert own_rule(embedding.op) is not None
    pricer = Pricer(cpu4, (4,), "adamw")
    issued = [p.collective for p in pricer.internal(loss, vocab, ins)]
    assert issued == [
        Collective("all_reduce", (0,), 32 * 4),
        Collective("all_reduce", (0,), 64 * 4),
    ]
    assert pricer.internal_time(loss, vocab, ins) == sum(pricer.collective_s(c) for c in issued)
    # a recomputed loss issues them again in backward
    again = pricer.recomputing(Recompute.of(graph, [("tail", [loss.name])]))
    phases = [p.phase for p in again.internal(loss, vocab, ins)]
    assert phases == ["forward", "forward", "recompute", "recompute"]
    # on (2, 2): the batch split on the outer axis, the classes on the inner
    both = Strategy(("P", "R"), (("S(0)", "S(1)"), ("S(0)", "R")))
    assert both in strategy_space(graph, (2, 2), {loss.name})[loss.name].strategies
    issued = [p.collective for p in Pricer(cpu4, (2, 2), "adamw").internal(loss, both, ins)]
    assert issued == [
        Collective("all_reduce", (1,), 16 * 4),
        Collective("all_reduce", (1,), 32 * 4),
        Collective("all_reduce", (0,), 4),  # the targets' total weight
    ]
