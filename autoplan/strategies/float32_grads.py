"""Gradients reduced in float32 under mixed precision (``PlanOptions(reduce_dtype="fp32")``, as
FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` and Megatron's
``--accumulate-allreduce-grads-in-fp32`` do).

Under autocast a trained parameter is read through its *weight copies*: the ops computed from
parameters alone whose output is in the compute dtype (the cast autocast makes, a view of it).
A plan sums the partial gradients of a parameter where they meet the placement their tensor
is kept in: at a weight copy's output, in the compute dtype, if the copy keeps its gradient
whole there, else, passed back through the copies, at the parameter, in float32 (its
gradient synchronization). So under the option a weight copy keeps its output's gradient
partial on every mesh axis where its output is whole, and has no axis of its output split
where a user reads it whole (gathered in the compute dtype, its gradient reduce-scattered
so): the search gives each weight copy the one candidate replicated on every axis that keeps
its gradient partial (`kept_partial`'s, whatever else reads its inputs), a baseline keeps
its own placements (Megatron's split weight copies included) with the gradient kept partial
where they are whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from autoplan.errors import AutoplanError
from autoplan.graph.ir import Graph, Node
from autoplan.modes import NodeKind, ReduceDtype
from autoplan.strategies.placement import P, R, replicated, without_partial
from autoplan.strategies.space import NodeStrategies, Strategy

# the weight copies that may keep their gradient partial while split on other axes: each
# rank's cast of its shard is its shard of the cast
SPLIT_COPIES = frozenset({"aten._to_copy.default"})


def check_reduce_dtype(reduce_dtype: str | None, precision: str | None) -> ReduceDtype | None:
    """``reduce_dtype`` as a `ReduceDtype`: None (the planner's choice) or "fp32" under mixed
    precision."""
    if reduce_dtype is None:
        return None
    if reduce_dtype not in tuple(ReduceDtype):
        raise AutoplanError(
            f"reduce_dtype {reduce_dtype!r} is not known; use 'fp32' (every gradient reduced "
            "in float32) or None (the planner's choice)"
        )
    if precision is None:
        raise AutoplanError(
            f"reduce_dtype={reduce_dtype!r} needs mixed precision: without it every gradient "
            'is float32 already; add mixed_precision="bf16" (or "fp16"), or drop reduce_dtype'
        )
    return ReduceDtype(reduce_dtype)


def weight_copies(graph: Graph) -> frozenset[str]:
    """The ops of ``graph`` that compute, from trained parameters alone (no input of the
    step), a tensor in a dtype other than float32 that needs a gradient."""

    def find() -> frozenset[str]:
        alone: set[str] = set()  # parameters and the ops of them alone
        found = set()
        for node in graph:
            if node.kind == NodeKind.PARAM or (
                node.kind == NodeKind.OP and all(r.name in alone for r in node.refs)
            ):
                alone.add(node.name)
                dtypes = {o.dtype for o in node.outputs}
                if node.kind == NodeKind.OP and node.needs_grad and dtypes != {"float32"}:
                    found.add(node.name)
        return frozenset(found)

    return graph.memo("weight_copies", find)


def searched_in_float32(
    space: Mapping[str, NodeStrategies], graph: Graph, mesh_shape: tuple[int, ...]
) -> dict[str, NodeStrategies]:
    """``space`` with each weight copy's candidates the one replicated strategy that keeps its
    output's gradient partial (module docstring). On a mesh of one device nothing is
    reduced, and ``space`` stays as it is."""
    if all(size == 1 for size in mesh_shape):
        return dict(space)
    copies = weight_copies(graph)
    whole = replicated(len(mesh_shape))
    grad = tuple(P if size > 1 else R for size in mesh_shape)
    out = dict(space)
    for name, ns in space.items():
        if name in copies:
            inputs = tuple(whole for _ in graph.node(name).refs)
            out[name] = replace(ns, strategies=(Strategy(whole, inputs, grad),))
    return out


def kept_where_whole(strategy: Strategy, mesh_shape: tuple[int, ...]) -> Strategy:
    """A weight copy's ``strategy`` keeping its output's gradient partial on every axis (of
    more than one device) where the output is whole."""
    placed = zip(strategy.output, without_partial(strategy.output), mesh_shape, strict=True)
    grad = tuple(P if p == R and size > 1 else whole for p, whole, size in placed)
    return strategy if P not in grad else replace(strategy, grad=grad)


def baseline_copy(node: Node, strategy: Strategy, mesh_shape: tuple[int, ...]) -> Strategy:
    """A baseline's weight copy ``node`` placed as ``strategy``, its gradient kept partial
    where it is whole (`kept_where_whole`); refused split, but for a cast (`SPLIT_COPIES`)."""
    kept = kept_where_whole(strategy, mesh_shape)
    split = any(p != R for p in kept.output)
    if kept.grad is not None and split and node.op not in SPLIT_COPIES:
        raise AutoplanError(
            f"the baseline splits {node.op} ({node.name}, a weight copy in the compute dtype), "
            'which cannot keep its gradient partial so: reduce_dtype="fp32" cannot reduce its '
            "parameter's gradient in float32; choose other dp/tp degrees"
        )
    return kept


def check_copies_read_as_placed(
    space: Mapping[str, NodeStrategies], graph: Graph, mesh_shape: tuple[int, ...]
) -> None:
    """Refuse a baseline that reads a weight copy whole along an axis its output is split on:
    the copy would be gathered in the compute dtype and its gradient reduce-scattered so."""
    for name in weight_copies(graph):
        placed = space[name].strategies[0].output
        for user in graph.users(name):
            s = space[user].strategies[0]
            for ref, spec in zip(graph.node(user).refs, s.inputs, strict=True):
                gathered = [
                    a
                    for a, (have, read) in enumerate(zip(placed, spec, strict=True))
                    if ref.name == name and have != R and read != have and mesh_shape[a] > 1
                ]
                if gathered:
                    node = graph.node(name)
                    raise AutoplanError(
                        f"the baseline reads {node.op} ({name}, a weight copy in the compute "
                        f"dtype) whole along mesh axis {gathered[0]} where it is split: its "
                        "gradient would be reduced in the compute dtype, not in float32 as "
                        'reduce_dtype="fp32" asks; choose other dp/tp degrees'
                    )
