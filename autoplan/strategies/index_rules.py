"""Sharding rules of the ops that index, scatter and count: gathers and scatters along one
dim, indexed assignments (``x[:, idx] = v``), histograms and bincounts. Each rule returns, for
one mesh axis, tuples ``(output, input 0, ...)`` over the node's tensor inputs
(`Node.refs` order), as in `autoplan.strategies.rules`, whose table names them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autoplan.graph.ir import Node, TensorInfo
from autoplan.strategies.placement import P, R, shard

AxisRule = tuple[str, ...]
Rule = Callable[[Node, Sequence[TensorInfo]], list[AxisRule]]


def arg(node: Node, index: int, name: str, default: object) -> object:
    return node.args[index] if len(node.args) > index else dict(node.kwargs).get(name, default)


def indexed(dim_index: int | None, whole: Sequence[int] = ()) -> Rule:
    """gather (input, dim, index), scatter (input, dim, index, src), scatter_add, index_add
    (input, dim, index, source): a dim other than ``dim`` (argument ``dim_index``; dim 0 for
    an op without one, torchtitan's ``deterministic_scatter_add (out, index, src)``) may be
    split where every tensor has it at one size, each element then reading and writing within
    its own shard. Inputs numbered in ``whole`` (index_add's 1-dim index) stay whole."""

    def rule(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
        ndim = len(ins[0].shape)
        at = 0 if dim_index is None else arg(node, dim_index, "dim", 0)
        dim = int(at) % ndim  # type: ignore[call-overload]
        split = [i for i in range(len(ins)) if i not in whole]
        rules: list[AxisRule] = []
        for d in range(ndim):
            sizes = {ins[i].shape[d] if len(ins[i].shape) == ndim else -1 for i in split}
            if d != dim and len(sizes) == 1:
                rules.append((shard(d), *[R if i in whole else shard(d) for i in range(len(ins))]))
        return rules

    return rule


def index_put(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """index_put (input, indices, values, accumulate): ``input[indices] = values`` (or ``+=``).
    A dim of the input that no index covers may be split, each rank writing its own part,
    the values split along the dim they have there (whole where they broadcast along it),
    the indices whole. Integer indices of consecutive dims only: their dims' positions in
    the indexed shape are then where the indices stand."""
    indices = arg(node, 1, "indices", ())
    assert isinstance(indices, tuple | list)
    x, index_ins, values = ins[0], ins[1:-1], ins[-1]
    at = [k for k, i in enumerate(indices) if i is not None]
    if not at or at != list(range(at[0], at[0] + len(at))):
        return []
    if any(not t.dtype.startswith(("int", "uint")) for t in index_ins):
        return []  # a boolean mask: its dims are the input's, and the values' count the data's
    first, num = at[0], len(at)
    index_ndim = max(len(t.shape) for t in index_ins)
    # values broadcast against the indexed shape: input's dims before the indices, the
    # indices' broadcast dims, the input's dims after them
    offset = len(x.shape) - num + index_ndim - len(values.shape)
    rules: list[AxisRule] = []
    for d in range(len(x.shape)):
        if first <= d < first + num:
            continue
        v = (d if d < first else d - num + index_ndim) - offset  # its dim in the values
        if v < 0 or values.shape[v] == 1:
            value = R
        elif values.shape[v] == x.shape[d]:
            value = shard(v)
        else:
            continue
        rules.append((shard(d), shard(d), *[R] * len(index_ins), value))
    return rules


def histogram(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # histc(input, bins, min, max): over a fixed range, the counts of a split input are the
    # sums of its shards' counts; min == max takes the range from the data: whole only
    low, high = arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    if low == high:
        return []
    return [(P, shard(d)) for d in range(len(ins[0].shape))]


def bincount(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """bincount (input, weights, minlength): its length is the largest value + 1, at least
    ``minlength``. Where the trace fixed it at ``minlength`` (the model uses the counts at that
    length, so every value lies below it), each shard's counts have that length too, and the
    counts of a split input (its weights split alike) are the sums of its shards' counts;
    a length above ``minlength`` would be a shard's largest value + 1: whole only."""
    if node.outputs[0].shape[0] != arg(node, 2, "minlength", 0):
        return []
    return [(P, *[shard(0)] * len(ins))]
