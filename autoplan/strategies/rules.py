"""Our own per-mesh-axis sharding rules, for ops DTensor has no single-dim rule for.

export keeps composite ops (``aten.linear``, ``aten.layer_norm``, attention: its own module,
`autoplan.strategies.attention`; the losses) that DTensor only sees decomposed, and view ops
whose DTensor rules need a live mesh. Each rule returns, for one mesh axis, tuples
``(output, input 0, input 1, ...)`` over the node's tensor inputs (`Node.refs` order). The
all-replicated tuple is added by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.graph.ir import Node, TensorInfo
from autoplan.strategies.attention import attention, flex_attention
from autoplan.strategies.grouped_mm import RULES as EXPERT_RULES
from autoplan.strategies.index_rules import (
    AxisRule,
    Rule,
    arg,
    bincount,
    histogram,
    index_put,
    indexed,
)
from autoplan.strategies.placement import P, R, shard


def _linear(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    x = ins[0]
    has_bias = len(ins) == 3
    last = len(x.shape) - 1
    rules: list[AxisRule] = []
    for d in range(len(x.shape) - 1):  # batch-like dims: data parallel
        rules.append((shard(d), shard(d), R, *([R] if has_bias else [])))
    # column split: weight rows (output features); bias split alike
    rules.append((shard(last), R, shard(0), *([shard(0)] if has_bias else [])))
    # row split: contraction dim split, partial sums out; bias added on one rank only
    rules.append((P, shard(last), shard(1), *([P] if has_bias else [])))
    return rules


def _layer_norm(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    x = ins[0]
    normalized = arg(node, 1, "normalized_shape", ())
    num_norm = len(normalized) if isinstance(normalized, tuple | list) else 1
    rest = [R] * (len(ins) - 1)  # weight, bias
    return [(shard(d), shard(d), *rest) for d in range(len(x.shape) - num_norm)]


def _cross_entropy(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # logits (N, C, ...) / target (N, ...): split the batch; class weights stay replicated.
    # The loss then holds partial sums on that axis (the executor averages by the split).
    # Or split along the classes, whole targets, the whole loss out: Megatron's parallel
    # cross-entropy (execute/vocab.py); not of class probabilities, nor with label smoothing.
    logits, target = ins[0], ins[1]
    classes = len(logits.shape) - len(target.shape)  # 1: class indices; 0: probabilities
    rules: list[AxisRule] = [(P, shard(0), shard(0), *[R] * (len(ins) - 2))]
    for d in range(2, len(logits.shape)):
        rules.append((P, shard(d), shard(d - classes), *[R] * (len(ins) - 2)))
    if classes == 1 and not arg(node, 5, "label_smoothing", 0.0):
        rules.append((R, shard(1), R, *[R] * (len(ins) - 2)))
    return rules


def _embedding(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """embedding(weight (V, H), indices): the indices' dims split, or the features, or (not
    for a gradient sparse or scaled by frequency) the vocabulary, each rank's lookup masked
    to its rows (execute/vocab.py): partial sums, where DTensor's rule makes a MaskPartial."""
    n = len(ins[1].shape)
    vocab = not arg(node, 3, "scale_grad_by_freq", False) and not arg(node, 4, "sparse", False)
    split: list[AxisRule] = [(shard(d), R, shard(d)) for d in range(n)]
    return split + [(shard(n), shard(1), R)] + [(P, shard(0), R)] * vocab


def _elementwise_loss(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    x = ins[0]
    reduction = arg(node, 2, "reduction", 1)
    out = P if reduction != 0 else None
    return [(out or shard(d), *[shard(d)] * len(ins)) for d in range(len(x.shape))]


def _view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim where a split of the input dim stays a plain split of the output.

    Dims are grouped where their products match (as a reshape regroups them); the first
    non-unit dim of an input group maps to the first non-unit dim of the output group.
    """
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(src):
                    return mapping
                gi.append(i)
                pi *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return mapping
                gj.append(j)
                pj *= dst[j]
        first_i = next((d for d in gi if src[d] != 1), None)
        first_j = next((d for d in gj if dst[d] != 1), None)
        if first_i is not None and first_j is not None:
            mapping[first_i] = first_j
        i += 1
        j += 1
    return mapping


def _from_dim_map(mapping: dict[int, int], extra_inputs: int = 0) -> list[AxisRule]:
    rules: list[AxisRule] = [(P, P, *[R] * extra_inputs)]
    rules += [(shard(o), shard(i), *[R] * extra_inputs) for i, o in sorted(mapping.items())]
    return rules


def _reshape(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    return _from_dim_map(_view_dim_map(ins[0].shape, node.outputs[0].shape))


def _permutation(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    ndim = len(ins[0].shape)
    order = list(range(ndim))
    name = node.op.split(".")[1]
    if name == "permute":
        order = [int(d) % ndim for d in node.args[1]]
    elif ndim >= 2:  # transpose / t: swap two dims
        a, b = (
            (int(node.args[1]) % ndim, int(node.args[2]) % ndim) if name == "transpose" else (0, 1)
        )
        order[a], order[b] = order[b], order[a]
    return _from_dim_map({src: dst for dst, src in enumerate(order)})


def _identity(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    return _from_dim_map({d: d for d in range(len(ins[0].shape))})


def _split(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    ndim = len(ins[0].shape)
    dim = int(arg(node, 2, "dim", 0)) % ndim  # type: ignore[call-overload]
    return _from_dim_map({d: d for d in range(ndim) if d != dim})


def _broadcast(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # outputs have the broadcast shape; an input dim of size 1 (or missing) stays replicated
    out = node.outputs[0].shape
    rules: list[AxisRule] = []
    for d in range(len(out)):
        placements = []
        for t in ins:
            td = d - (len(out) - len(t.shape))
            placements.append(shard(td) if td >= 0 and t.shape[td] == out[d] else R)
        rules.append((shard(d), *placements))
    return rules


def _pad(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # pad(input, pad, ...): ``pad`` gives (before, after) amounts from the last dim backwards
    # (as labels are shifted for a language model's loss); a dim that is not padded may stay
    # split, and the pad value fills each shard's padded dims alike
    x = ins[0]
    amounts: Sequence[int] = arg(node, 1, "pad", ())  # type: ignore[assignment]
    padded = {len(x.shape) - 1 - i // 2 for i, a in enumerate(amounts) if a != 0}
    return [(shard(d), shard(d)) for d in range(len(x.shape)) if d not in padded]


def _other_dims(
    node: Node, ins: Sequence[TensorInfo], index: int, default: int = 0
) -> list[AxisRule]:
    """Ops along one dim (argument ``index``): slice, cat, sort, diff. Any other dim may be
    split, every tensor input alike (and every output: sort's values and indices). A 1-dim
    empty input stays whole: cat skips it (transformers' caches start from one, and a key
    or value joined to it may still split by batch or heads)."""
    ndim = len(node.outputs[0].shape)
    dim = int(arg(node, index, "dim", default)) % ndim  # type: ignore[call-overload]
    skipped = [t.shape == (0,) and ndim > 1 for t in ins]
    same = all(len(t.shape) == ndim or skip for t, skip in zip(ins, skipped, strict=True))
    return [
        (shard(d), *[R if skip else shard(d) for skip in skipped])
        for d in range(ndim)
        if d != dim and same
    ]


def _along(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    return _other_dims(node, ins, 1)  # softmax / log_softmax / cumsum (input, dim)


def _along_last(index: int) -> Rule:
    """sort / argsort (input, dim=-1), topk (input, k, dim=-1), diff (input, n, dim=-1, ...),
    their ``dim`` argument at ``index``; the stable overloads take it by keyword."""

    def rule(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
        return _other_dims(node, ins, index, default=-1)

    return rule


def _factory_like(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """new_ones / new_zeros / new_empty / new_full (input, size): the input is read for its
    dtype alone, so each dim of the output may be split whatever the input's placement; the
    input split alike, or whole, or split and the output whole (never gathered to be read)."""
    out, x = node.outputs[0].shape, ins[0].shape
    rules: list[AxisRule] = [(shard(d), R) for d in range(len(out))]
    rules += [(shard(d), shard(d)) for d in range(len(out)) if out == x]
    return rules + [(R, shard(d)) for d in range(len(x))]


def _like_other(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """type_as (input, other) and fill (input, value tensor): the output is the input's
    shape, any dim split with it; ``other`` is read for its dtype (or its one value), whole or
    split alike."""
    x = ins[0].shape
    rules: list[AxisRule] = [(shard(d), shard(d), R) for d in range(len(x))]
    return rules + [(shard(d), shard(d), shard(d)) for d in range(len(x)) if ins[1].shape == x]


def _arg_reduce(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # argmax / argmin (input, dim, keepdim): the other dims may stay split (an index is not a
    # sum: no partial outputs)
    ndim = len(ins[0].shape)
    dim = arg(node, 1, "dim", None)
    if dim is None:
        return []
    dim = int(dim) % ndim  # type: ignore[call-overload]
    keep = bool(arg(node, 2, "keepdim", False))
    kept = [d for d in range(ndim) if d != dim]
    return [(shard(d if keep else kept.index(d)), shard(d)) for d in kept]


def _one_hot(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # one_hot(indices, classes): a new last dim; the indices' dims may stay split
    return [(shard(d), shard(d)) for d in range(len(ins[0].shape))]


def _matmul(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """matmul(a, b) as torch broadcasts it: ``a (..., n, k) @ b (..., k, m)`` (a 1-dim
    operand lacks ``n`` or ``m``). Each batch dim of the output split with the operands that
    have it at full size (an operand broadcast along it stays whole); ``n`` with ``a``;
    ``m`` with ``b``; the contracted ``k`` in both, partial sums out. Eager attention's
    ``q @ k^T`` and ``p @ v`` split so by batch and heads."""
    (a, b), out = (len(t.shape) for t in ins), node.outputs[0].shape
    if a == 1 and b == 1:
        return [(P, shard(0), shard(0))]
    batch = len(out) - (a > 1) - (b > 1)
    rules: list[AxisRule] = []
    for d in range(batch):
        specs = []
        for t, rank in zip(ins, (a, b), strict=True):
            own = d - (batch - (rank - 2))  # the operand's dim that broadcasts to d, if any
            whole = rank < 2 or own < 0 or t.shape[own] != out[d]
            specs.append(R if whole else shard(own))
        rules.append((shard(d), *specs))
    if a > 1:
        rules.append((shard(batch), shard(a - 2), R))
    if b > 1:
        rules.append((shard(len(out) - 1), R, shard(b - 1)))
    rules.append((P, shard(a - 1), shard(max(b - 2, 0))))
    return rules


def _einsum(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """einsum(equation, operands): per subscript letter, every operand that has it split
    along it; the output too where it has the letter, else partial sums (a contraction).
    Operands without the letter stay whole. Equations with "..." or a letter repeated within
    an operand (a diagonal) get no rule (planned replicated)."""
    equation = str(node.args[0]).replace(" ", "")
    if "->" not in equation or "." in equation:
        return []
    inputs, output = equation.split("->")
    operands = inputs.split(",")
    if len(operands) != len(ins) or any(len(set(o)) != len(o) for o in [*operands, output]):
        return []
    rules: list[AxisRule] = []
    for letter in sorted(set(inputs) - {","}):
        out = shard(output.index(letter)) if letter in output else P
        rules.append((out, *[shard(o.index(letter)) if letter in o else R for o in operands]))
    return rules


def _stack(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # stack(tensors, dim): every input split alike, the output one dim further past ``dim``
    ndim = len(ins[0].shape)
    dim = int(arg(node, 1, "dim", 0)) % (ndim + 1)  # type: ignore[call-overload]
    return [(shard(d if d < dim else d + 1), *[shard(d)] * len(ins)) for d in range(ndim)]


def _cat(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # cat(tensors, dim); one tensor joined to empty ones (a cache's first keys) is itself,
    # split along ``dim`` too (by the sequence, context parallelism's keys)
    ndim, real = len(node.outputs[0].shape), [t.shape != (0,) for t in ins]
    whole = [(shard(d), *[shard(d) if r else R for r in real]) for d in range(ndim)]
    return whole if sum(real) == 1 and ndim > 1 else _other_dims(node, ins, 1)


def _expand(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # the output dims the input has at full size may be split along with it
    return [rule for rule in _broadcast(node, ins) if rule[1] != R]


def _reduce(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # sum / mean (input, dims, keepdim): a dim not reduced may stay split; a reduction over a
    # split dim is a partial sum (the executor runs a mean as a sum over the global count)
    ndim = len(ins[0].shape)
    dims = arg(node, 1, "dim", None) if node.op.endswith((".dim", ".dim_IntList")) else None
    reduced = {int(d) % ndim for d in dims} if dims else set(range(ndim))  # type: ignore[attr-defined]
    keep = bool(arg(node, 2, "keepdim", False))
    kept = [d for d in range(ndim) if d not in reduced]
    rules: list[AxisRule] = [(shard(d if keep else kept.index(d)), shard(d)) for d in kept]
    return rules + [(P, shard(d)) for d in sorted(reduced)]


def _select(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # select(input, dim, index): the other dims may stay split, one lower past ``dim``; so may
    # select_scatter's src (input, src, dim, index: ``x[:, i] = src``), its input and output
    # split alike (ours: DTensor's backward of it adds plain zeros to a DTensor gradient)
    scatter = len(ins) == 2
    ndim = len(ins[0].shape)
    dim = int(arg(node, 1 + scatter, "dim", 0)) % ndim  # type: ignore[call-overload]
    pairs = [(d, d if d < dim else d - 1) for d in range(ndim) if d != dim]
    return [(shard(d), shard(d), shard(s)) if scatter else (shard(s), shard(d)) for d, s in pairs]


def _convolution(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # conv(input, weight, bias, ...): data parallel only (the batch split, filters whole)
    return [(shard(0), shard(0), *[R] * (len(ins) - 1))]


def _pool(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # pooling over the trailing (spatial) dims: the batch and channels may stay split
    spatial = 2 if "2d" in node.op else 1
    return [(shard(d), shard(d)) for d in range(len(ins[0].shape) - spatial)]


def _batch_norm(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # batch_norm(input, weight, bias, running_mean, running_var, training, ...): with its
    # running statistics (eval mode) each sample is normalized alone, so the batch may be
    # split; in training it normalizes by the batch's statistics: whole only
    if arg(node, 5, "training", True):
        return []
    return [(shard(0), shard(0), *[R] * (len(ins) - 1))]


def _elementwise(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    # dropout, and tensors made like their input (random draws, zeros): any dim split, no
    # partial sums (the executor seeds each shard's draws apart, see execute/randomness)
    return [(shard(d), shard(d)) for d in range(len(ins[0].shape))]


def _no_inputs(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    return []  # factories (arange, zeros ...): replicated only


_RULES: dict[str, Rule] = {
    "linear": _linear,
    "scaled_dot_product_attention": attention,
    "_scaled_dot_product_flash_attention_for_cpu": attention,
    "_scaled_dot_product_flash_attention": attention,
    "_scaled_dot_product_efficient_attention": attention,
    "layer_norm": _layer_norm,
    "rms_norm": _layer_norm,  # (input, normalized_shape, weight, eps): layer norm's layout
    "cross_entropy_loss": _cross_entropy,
    "embedding": _embedding,
    "mse_loss": _elementwise_loss,
    "l1_loss": _elementwise_loss,
    "view": _reshape,
    "reshape": _reshape,
    "_unsafe_view": _reshape,
    "flatten": _reshape,
    "unflatten": _reshape,
    "unsqueeze": _reshape,
    "squeeze": _reshape,
    "transpose": _permutation,
    "permute": _permutation,
    "t": _permutation,
    "contiguous": _identity,
    "clone": _identity,
    "alias": _identity,
    "detach": _identity,
    "split": _split,
    "split_with_sizes": _split,
    "chunk": _split,
    "broadcast_tensors": _broadcast,
    "pad": _pad,
    "slice": lambda node, ins: _other_dims(node, ins, 1),  # (input, dim, start, ...)
    "cat": _cat,
    "expand": _expand,
    "dropout": _elementwise,
    "softmax.int": _along,
    "log_softmax.int": _along,
    "_softmax": _along,
    "_log_softmax": _along,
    "cumsum": _along,
    "sort": _along_last(1),
    "argsort": _along_last(1),
    "topk": _along_last(2),
    "diff": _along_last(2),
    "gather": indexed(1),
    "scatter": indexed(1),
    "scatter_add": indexed(1),
    "index_add": indexed(1, whole=(1,)),
    "histc": histogram,
    "index_put": index_put,
    "bincount": bincount,
    "new_ones": _factory_like,
    "new_zeros": _factory_like,
    "new_empty": _factory_like,
    "new_full": _factory_like,
    "type_as": _like_other,
    "fill.Tensor": _like_other,
    "fill.Scalar": _elementwise,
    # copy (dst, src): src broadcast to dst's shape; where / floor_divide element by element
    "copy": _broadcast,
    "where.ScalarOther": _broadcast,
    "where.ScalarSelf": _broadcast,
    "where.Scalar": _broadcast,
    "floor_divide": _broadcast,
    "slice_scatter": lambda node, ins: _other_dims(node, ins, 2),  # (input, src, dim, ...)
    "select_scatter": _select,
    "argmax": _arg_reduce,
    "argmin": _arg_reduce,
    "one_hot": _one_hot,
    "einsum": _einsum,
    "matmul": _matmul,
    "rand_like": _elementwise,
    "zeros_like": _elementwise,
    "ones_like": _elementwise,
    "empty_like": _elementwise,
    "full_like": _elementwise,
    "stack": _stack,
    "randn_like": _elementwise,
    "bernoulli": _elementwise,
    "mean.dim": _reduce,
    "mean.default": _reduce,
    "sum.dim_IntList": _reduce,
    "sum.default": _reduce,
    "select": _select,
    "conv1d": _convolution,
    "conv2d": _convolution,
    "max_pool1d": _pool,
    "max_pool2d": _pool,
    "avg_pool1d": _pool,
    "avg_pool2d": _pool,
    "adaptive_avg_pool1d": _pool,
    "adaptive_avg_pool2d": _pool,
    "batch_norm": _batch_norm,
    "__and__": _broadcast,
    "__or__": _broadcast,
    "to": _identity,
    "_to_copy": _identity,
    "detach_": _identity,
    "lift_fresh_copy": _identity,
    "constant_pad_nd": _pad,
    "arange": _no_inputs,
    "zeros": _no_inputs,
    "ones": _no_inputs,
    "full": _no_inputs,
}


# other libraries' ops, by full name: the experts' grouped matmuls, and torchtitan's MoE
# combine (``out.scatter_add(0, index, src)`` under deterministic algorithms)
LIBRARY_RULES: dict[str, Rule] = {
    **EXPERT_RULES,
    "torchtitan.deterministic_scatter_add.default": indexed(None),
}


def own_rule(op: str) -> Rule | None:
    """Our rule for ``op`` ("aten.<name>.<overload>"): one for that overload, else one for
    every overload of the name, else None; for another library's op, its full name's."""
    parts = op.split(".")
    if op == "flex_attention":  # torch's higher-order op, by its name
        return flex_attention
    if op in LIBRARY_RULES or len(parts) != 3 or parts[0] != "aten":
        return LIBRARY_RULES.get(op)
    return _RULES.get(f"{parts[1]}.{parts[2]}", _RULES.get(parts[1]))
