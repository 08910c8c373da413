"""Which ops the executor runs on local shards (execute/op_calls.py), on a small exported graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan.execute.op_calls import (
    CROSS_ENTROPY,
    call_op,
    local_cross_entropy,
    local_shape,
    local_total_weight,
    runs_locally,
)
from autoplan.execute.step import local_shard
from autoplan.torch_private import dtensor_runs

R, P, S0, S1 = (Replicate(),), (Partial(),), (Shard(0),), (Shard(1),)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).view(8, 2, 3).relu()
        return F.mse_loss(h.flatten(1), y)


def _nodes() -> dict[str, torch.fx.Node]:
    ep = torch.export.export(_Tiny(), (torch.randn(8, 6), torch.randn(8, 6)))
    ops = [n for n in ep.graph.nodes if str(n.target).startswith("aten.")]
    return {str(n.target).split(".")[1]: n for n in ops}


def test_ops_without_partial_sums_run_locally() -> None:
    nodes = _nodes()
    assert runs_locally(nodes["linear"], [S0, R, R], S0)  # data parallel
    assert runs_locally(nodes["linear"], [R, S0, S0], S1)  # column split
    assert not runs_locally(nodes["linear"], [S1, S1, P], P)  # row split: a partial sum
    assert runs_locally(nodes["relu"], [S0], S0)
    assert not runs_locally(nodes["relu"], [P], P)


def test_a_mean_loss_runs_locally_as_a_partial_sum_along_split_axes() -> None:
    loss = _nodes()["mse_loss"]
    assert runs_locally(loss, [S0, S0], P)
    assert runs_locally(loss, [R, R], R)
    assert not runs_locally(loss, [S0, S0], R)  # the plan would need the sum whole


def test_a_view_gets_its_local_shape() -> None:
    view = _nodes()["view"]
    assert runs_locally(view, [S0], S0)
    assert local_shape(view, S0, (4,)) == [2, 2, 3]
    assert local_shape(view, (Shard(0), Shard(2)), (2, 3)) == [4, 2, 1]


def test_a_local_view_of_strides_the_trace_did_not_give_copies_real_or_fake() -> None:
    """A view the trace found contiguous (the model's own ``.contiguous()`` dropped) of a
    local tensor laid out otherwise runs as a reshape: on real tensors in training and on
    fake ones in the step checked before it."""
    view = _nodes()["view"]
    x = torch.randn(8, 3, 2).transpose(1, 2)  # (8, 2, 3), not viewable as (8, 6)
    assert torch.equal(call_op(view, (x, [8, 6]), {}), x.reshape(8, 6))
    with FakeTensorMode():
        fake = torch.empty(8, 3, 2).transpose(1, 2)
        assert call_op(view, (fake, [8, 6]), {}).shape == (8, 6)


def test_a_batch_split_evenly_is_sliced_locally_as_dtensor_shards_it() -> None:
    batch = torch.arange(8 * 6.0).view(8, 6)
    mesh_shape = (2, 2)
    for placements in [(Shard(0), Shard(0)), (Shard(0), Replicate()), (Shard(1), Shard(0))]:
        for coordinate in ([0, 0], [0, 1], [1, 0], [1, 1]):
            expected = batch
            for axis, p in enumerate(placements):
                if isinstance(p, Shard):  # DTensor splits mesh axis by axis, like torch.chunk
                    expected = expected.chunk(mesh_shape[axis], p.dim)[coordinate[axis]]
            got = local_shard(batch, placements, mesh_shape, coordinate)
            assert got is not None and torch.equal(got, expected)
            assert got.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()  # a view
    assert local_shard(torch.ones(6, 3), (Shard(0), Shard(0)), mesh_shape, [0, 0]) is None


class _Classifier(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.options = options

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, **self.options)  # type: ignore[arg-type]


def test_cross_entropy_of_shards_over_the_global_total_weight_is_the_mean() -> None:
    """Summed over the shards of a split batch, each shard's cross-entropy over the total
    weight of all targets is torch's mean, with class weights, ignored targets and label
    smoothing alike; the total weight is the sum of the shards' parts."""
    torch.manual_seed(0)
    logits, target = torch.randn(8, 5), torch.randint(0, 5, (8,))
    target[[1, 6]] = -100
    weight = torch.rand(5) + 0.5
    for options in [{}, {"weight": weight}, {"label_smoothing": 0.1, "weight": weight}]:
        ep = torch.export.export(_Classifier(**options), (logits, target))
        (node,) = [n for n in ep.graph.nodes if n.target is CROSS_ENTROPY]
        assert runs_locally(node, [S0, S0, *([R] if options.get("weight") is not None else [])], P)
        w = options.get("weight")
        shards = list(zip(logits.chunk(4), target.chunk(4), strict=True))
        total = sum(local_total_weight(node, t, w) for _, t in shards)
        kwargs = {"weight": w} if w is not None else {}
        summed = sum(local_cross_entropy(node, (x, t), kwargs, total) for x, t in shards)
        expected = F.cross_entropy(logits, target, **options)  # type: ignore[arg-type]
        torch.testing.assert_close(summed, expected)


def test_cross_entropy_per_element_runs_locally_as_the_local_shard() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(8, 5), torch.randint(0, 5, (8,))
    ep = torch.export.export(_Classifier(reduction="none"), (logits, target))
    (node,) = [n for n in ep.graph.nodes if n.target is CROSS_ENTROPY]
    assert runs_locally(node, [S0, S0], S0)
    shards = [  # the node's other arguments as the interpreter passes them
        local_cross_entropy(node, (x, t, *node.args[2:]), {}, None)
        for x, t in zip(logits.chunk(4), target.chunk(4), strict=True)
    ]
    torch.testing.assert_close(torch.cat(shards), F.cross_entropy(logits, target, reduction="none"))


class _Cache(nn.Module):
    """A constant made in forward (``lift_fresh_copy``, as transformers' caches make their
    counters) and a slice assignment into a new tensor (the functional ``copy``, as
    DeepSeek-V3's attention joins its query parts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(2.0)
        joined = x.new_empty(x.shape[0], 8)
        joined[:, :6] = x
        joined[:, 6:] = x[:, :1]
        return joined * scale


def _cache_nodes(functional: bool = False) -> list[torch.fx.Node]:
    """The exported graph's ops; ``functional``: with its mutations made functional, as the
    capture does for a graph that has some (``lift_fresh_copy`` then a ``clone``)."""
    ep = torch.export.export(_Cache(), (torch.randn(8, 6),))
    graph = (ep.run_decompositions({}) if functional else ep).graph
    return [n for n in graph.nodes if n.op == "call_function"]


def test_ops_dtensor_cannot_run_run_locally_as_planned() -> None:
    nodes = {n.target: n for n in [*_cache_nodes(), *_cache_nodes(functional=True)]}
    lift = nodes[torch.ops.aten.lift_fresh_copy.default]
    copy = nodes[torch.ops.aten.copy.default]
    assert not dtensor_runs(lift.target) and not dtensor_runs(copy.target)  # type: ignore[arg-type]
    aten = torch.ops.aten
    assert dtensor_runs(aten.mul.Tensor) and dtensor_runs(aten.diff.default)  # rule; decomposed
    # placed as our rule (a copy, partial sums too) or the planner (replicated) places them:
    # as DTensor ops they would raise NotImplementedError
    assert runs_locally(lift, [P], P) and runs_locally(lift, [S0], S0)
    assert runs_locally(copy, [R, R], R)
    assert not runs_locally(nodes[torch.ops.aten.mul.Tensor], [P, R], P)  # DTensor's


def test_the_functional_copy_runs_with_a_derivative() -> None:
    """``dst[:, 6:] = x[:, :1]``: the gradient of the broadcast source is summed over the
    columns it fills; the destination's replaced values get none."""
    copies = [n for n in _cache_nodes(True) if n.target is torch.ops.aten.copy.default]
    dst = torch.full((8, 2), float("nan"), requires_grad=True)
    src = torch.randn(8, 1, requires_grad=True)
    out = call_op(copies[-1], (dst, src), {})
    assert torch.equal(out, src.expand(8, 2)) and out.dtype == dst.dtype
    out.sum().backward()
    assert torch.equal(src.grad, torch.full((8, 1), 2.0)) and dst.grad is None  # type: ignore[arg-type]
