"""Strided splits of fused projections: which tensors may be split "S(d)xk", and the rules
that keep them so.

A projection written fused (one ``qkv`` linear, then ``split``) and split plainly along its
features holds q on some ranks and v on others, so q, k and v split by heads need its output
redistributed. Split strided (`autoplan.strategies.placement`), each rank holds its share of
every piece, and the split into the pieces hands each of them on plainly split, with no
communication: Megatron's layout of a fused qkv.

`marks` finds where: a ``split``, ``chunk`` or ``split_with_sizes`` into ``k`` equal pieces
along dim ``d`` marks its input (d, k); the mark goes back to the op that made the input,
along each of its rules that splits the output's dim ``d`` and no input's dim but one of the
same size (a linear's column split: its weight's rows and its bias; a reshape that keeps the
dim), to that input, and so on to the parameters (whose storage may then be strided).
`twin_rules` gives a marked op the strided twin of each such rule, and the split itself the
rule that takes its input strided and hands on its pieces plainly split. A rule that splits
dim ``d`` for any way of cutting it into blocks moves each element along ``d`` with its index,
so it holds for the strided cut too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind
from autoplan.strategies.placement import R, pieces, shard, shard_dim, strided

AxisRule = tuple[str, ...]  # (output, tensor input 0, ...) on one mesh axis
Mark = tuple[int, int]  # (dim, pieces)
PlainRules = Callable[[Node, Graph], Sequence[AxisRule]]

_SPLITS = ("split", "split_with_sizes", "chunk")


def equal_pieces(node: Node, graph: Graph) -> Mark | None:
    """(dim, pieces) of a split of ``node``'s first input into equal pieces, else None."""
    parts = node.op.split(".")
    if len(parts) != 3 or parts[1] not in _SPLITS or not node.refs:
        return None
    shape = graph.tensor(node.refs[0]).shape
    dim_arg = node.args[2] if len(node.args) > 2 else dict(node.kwargs).get("dim", 0)
    dim = int(dim_arg) % len(shape)
    size, how = shape[dim], node.args[1]
    if parts[1] == "chunk":
        num = int(how)
        equal = size % num == 0
    elif parts[1] == "split":
        num = size // int(how) if size % int(how) == 0 else 0
        equal = num > 0
    else:
        num = len(how)
        equal = len(set(how)) == 1
    return (dim, num) if equal and num > 1 else None


def twin(rule: AxisRule, node: Node, graph: Graph, mark: Mark) -> AxisRule | None:
    """The strided twin of ``rule`` for ``node``'s output marked ``mark``: its output split
    plainly along the marked dim, each input split (if at all) along a dim of the same size,
    which becomes strided alike; None for a rule that is not so."""
    dim, num = mark
    if rule[0] != shard(dim) or len(node.outputs) != 1:
        return None
    size = node.output.shape[dim]
    found = [strided(dim, num)]
    for placement, ref in zip(rule[1:], node.refs, strict=True):
        d = shard_dim(placement)
        if d is None:
            found.append(placement)
        elif pieces(placement) == 1 and graph.tensor(ref).shape[d] == size:
            found.append(strided(d, num))
        else:
            return None
    return tuple(found)


def marks(graph: Graph, plain: PlainRules) -> dict[Ref, frozenset[Mark]]:
    """The tensors that may be split strided, by their (dim, pieces); ``plain``: an op's rules
    on one mesh axis, strided twins aside."""

    def find() -> dict[Ref, frozenset[Mark]]:
        todo = [
            (node.refs[0], mark)
            for node in graph
            if node.kind == NodeKind.OP and (mark := equal_pieces(node, graph))
        ]
        found: dict[Ref, set[Mark]] = {}
        while todo:
            ref, mark = todo.pop()
            if mark in found.setdefault(ref, set()):
                continue
            found[ref].add(mark)
            producer = graph.node(ref.name)
            if producer.kind != NodeKind.OP:
                continue
            for rule in plain(producer, graph):
                made = twin(rule, producer, graph, mark)
                if made is None:
                    continue
                for placement, read in zip(made[1:], producer.refs, strict=True):
                    if pieces(placement) > 1:
                        todo.append((read, (shard_dim(placement) or 0, mark[1])))
        return {ref: frozenset(found[ref]) for ref in sorted(found, key=_order(graph))}

    return graph.memo(("strided marks", plain), find)


def _order(graph: Graph) -> Callable[[Ref], tuple[int, int]]:
    position = {node.name: i for i, node in enumerate(graph)}
    return lambda ref: (position[ref.name], ref.index)


def twin_rules(node: Node, graph: Graph, plain: PlainRules) -> list[AxisRule]:
    """``node``'s strided rules on one mesh axis: twins of its plain rules for each mark of
    its output, and, for a split into equal pieces of a marked input, the input strided and
    its pieces plainly split."""
    found = marks(graph, plain)
    rules: list[AxisRule] = []
    if node.kind != NodeKind.OP:
        return rules
    for mark in sorted(found.get(Ref(node.name), ())):
        for rule in plain(node, graph):
            made = twin(rule, node, graph, mark)
            if made is not None:
                rules.append(made)
    split = equal_pieces(node, graph)
    if split is not None and split in found.get(node.refs[0], ()):
        dim, num = split
        rest = [R] * (len(node.refs) - 1)
        rules.append((shard(dim), strided(dim, num), *rest))
    return rules


def storage_options(node: Node, graph: Graph, plain: PlainRules) -> list[str]:
    """The strided placements a parameter may be stored with."""
    return [strided(d, num) for d, num in sorted(marks(graph, plain).get(Ref(node.name), ()))]
