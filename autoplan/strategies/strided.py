"""Strided splits of fused projections: which tensors may be split "S(d)xk", and the rules
that keep them so.

A projection written fused (one ``qkv`` linear, then ``split``) and split plainly along its
features holds q on some ranks and v on others, so q, k and v split by heads need its output
redistributed. Split strided (`autoplan.strategies.placement`), each rank holds its share of
every piece, and the split into the pieces hands each of them on plainly split, with no
communication: Megatron's layout of a fused qkv.

`marks` finds where: a ``split``, ``chunk`` or ``split_with_sizes`` into ``k`` pieces along dim
``d``, or slices of one tensor along ``d`` that tile it (Phi-3's ``qkv[..., :q]``,
``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``), marks its input (d, the pieces' widths); the
mark goes back to the op that made the input, along each of its rules that splits the
output's dim ``d`` and no input's dim but one of the same size (a linear's column split: its
weight's rows and its bias; a reshape that keeps the dim), to that input, and so on to the
parameters (whose storage may then be strided). A mark of unequal pieces, or from slices,
is kept only where it reaches a parameter: a fused projection (the slices of rotary
embeddings' halves reach none). `twin_rules` gives a marked op the strided twin of each such
rule, and the cut itself the rule that takes its input strided and hands on its pieces
plainly split. A rule that splits dim ``d`` for any way of cutting it into blocks moves each
element along ``d`` with its index, so it holds for the strided cut too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind
from autoplan.strategies.placement import R, pieces, shard, shard_dim, strided

AxisRule = tuple[str, ...]  # (output, tensor input 0, ...) on one mesh axis
Mark = tuple[int, tuple[int, ...]]  # (dim, the pieces' widths in lowest terms)
PlainRules = Callable[[Node, Graph], Sequence[AxisRule]]

_SPLITS = ("split", "split_with_sizes", "chunk")
_SLICE = "aten.slice.Tensor"


def _dim(node: Node, graph: Graph, index: int) -> int:
    dim = node.args[index] if len(node.args) > index else dict(node.kwargs).get("dim", 0)
    return int(dim) % len(graph.tensor(node.refs[0]).shape)


def _lowest(sizes: Sequence[int]) -> tuple[int, ...]:
    unit = math.gcd(*sizes)
    return tuple(s // unit for s in sizes)


def cut_pieces(node: Node, graph: Graph) -> Mark | None:
    """(dim, widths) of a split of ``node``'s first input into two or more pieces, else None."""
    parts = node.op.split(".")
    if len(parts) != 3 or parts[1] not in _SPLITS or not node.refs or len(node.outputs) < 2:
        return None
    dim = _dim(node, graph, 2)
    return dim, _lowest([out.shape[dim] for out in node.outputs])


def _slice_span(node: Node, graph: Graph) -> tuple[Ref, int, int, int] | None:
    """(input, dim, start, end) of a slice of step 1, its bounds clamped as torch clamps them."""
    if node.op != _SLICE or not node.refs:
        return None
    args = [*node.args, None, None, None, None][:5]
    if args[4] not in (None, 1):
        return None
    size = graph.tensor(node.refs[0]).shape[_dim(node, graph, 1)]

    def bound(value: object, default: int) -> int:
        v = default if value is None else int(value)  # type: ignore[call-overload]
        return max(0, min(size, v + size if v < 0 else v))

    return node.refs[0], _dim(node, graph, 1), bound(args[2], 0), bound(args[3], size)


def tiles(graph: Graph) -> dict[str, Mark]:
    """Slices that tile their input along one dim (two or more, side by side, covering it),
    by name: the input's (dim, widths)."""

    def find() -> dict[str, Mark]:
        groups: dict[tuple[Ref, int], list[tuple[int, int, str]]] = {}
        for node in graph:
            span = _slice_span(node, graph)
            if span is not None and span[3] > span[2]:
                groups.setdefault(span[:2], []).append((span[2], span[3], node.name))
        found = {}
        for (ref, dim), spans in groups.items():
            spans.sort()
            bounds = [0, *(end for _, end, _ in spans)]
            size = graph.tensor(ref).shape[dim]
            if len(spans) < 2 or [s for s, _, _ in spans] != bounds[:-1] or bounds[-1] != size:
                continue
            mark = (dim, _lowest([end - start for start, end, _ in spans]))
            found.update({name: mark for _, _, name in spans})
        return found

    return graph.memo("slice tiles", find)


def _seeds(graph: Graph) -> list[tuple[Ref, Mark, bool]]:
    """Each cut's input and mark, and whether the mark must reach a parameter to be kept."""
    found = []
    sliced = tiles(graph)
    for node in graph:
        if node.kind != NodeKind.OP:
            continue
        mark = cut_pieces(node, graph) or sliced.get(node.name)
        if mark is not None:
            must = node.name in sliced or len(set(mark[1])) > 1
            found.append((node.refs[0], mark, must))
    return found


def twin(rule: AxisRule, node: Node, graph: Graph, mark: Mark) -> AxisRule | None:
    """The strided twin of ``rule`` for ``node``'s output marked ``mark``: its output split
    plainly along the marked dim, each input split (if at all) along a dim of the same size,
    which becomes strided alike; None for a rule that is not so."""
    dim, widths = mark
    if rule[0] != shard(dim) or len(node.outputs) != 1:
        return None
    size = node.output.shape[dim]
    found = [strided(dim, widths)]
    for placement, ref in zip(rule[1:], node.refs, strict=True):
        d = shard_dim(placement)
        if d is None:
            found.append(placement)
        elif pieces(placement) == 1 and graph.tensor(ref).shape[d] == size:
            found.append(strided(d, widths))
        else:
            return None
    return tuple(found)


def marks(graph: Graph, plain: PlainRules) -> dict[Ref, frozenset[Mark]]:
    """The tensors that may be split strided, by their (dim, pieces); ``plain``: an op's rules
    on one mesh axis, strided twins aside."""

    def follow(ref: Ref, mark: Mark) -> tuple[dict[Ref, set[Mark]], bool]:
        """The tensors ``mark`` on ``ref`` reaches back, and whether a parameter is one."""
        todo, param = [(ref, mark)], False
        found: dict[Ref, set[Mark]] = {}
        while todo:
            ref, mark = todo.pop()
            if mark in found.setdefault(ref, set()):
                continue
            found[ref].add(mark)
            producer = graph.node(ref.name)
            param |= producer.kind == NodeKind.PARAM
            if producer.kind != NodeKind.OP:
                continue
            for rule in plain(producer, graph):
                made = twin(rule, producer, graph, mark)
                if made is None:
                    continue
                for placement, read in zip(made[1:], producer.refs, strict=True):
                    if pieces(placement) > 1:
                        todo.append((read, (shard_dim(placement) or 0, mark[1])))
        return found, param

    def find() -> dict[Ref, frozenset[Mark]]:
        found: dict[Ref, set[Mark]] = {}
        for ref, mark, must in _seeds(graph):
            reached, param = follow(ref, mark)
            if param or not must:
                for r, ms in reached.items():
                    found.setdefault(r, set()).update(ms)
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
    cut = cut_pieces(node, graph) or tiles(graph).get(node.name)
    if cut is not None and cut in found.get(node.refs[0], ()):
        dim, widths = cut
        rest = [R] * (len(node.refs) - 1)
        rules.append((shard(dim), strided(dim, widths), *rest))
    return rules


def storage_options(node: Node, graph: Graph, plain: PlainRules) -> list[str]:
    """The strided placements a parameter may be stored with."""
    return [strided(d, ws) for d, ws in sorted(marks(graph, plain).get(Ref(node.name), ()))]
