"""Megatron's tensor-parallel regions: which linears a baseline splits on the ``tp`` axis.

On the ``tp`` axis, which linears Megatron splits is found in the traced graph, not from
parameter names. A linear is ``aten.linear`` of a parameter weight (out, in), or the
``addmm`` of transformers' Conv1D (GPT-2: bias, activation, a parameter weight (in, out)).
Activations outside a tensor-parallel *region* are replicated. A region starts at *column*
linears (linears reading an activation outside any region: the residual stream, a normalized
activation, an input); their output is split along its last
dim. The split follows every op that has a rule taking the split inputs, with its other inputs
replicated, to a split output: views and transposes that keep the split dim whole, attention
over split heads, activation functions, products of two split tensors. A region ends at *row*
linears that contract the split dim; their partial sums are all-reduced by the next op. It
also ends at a cross-entropy over the split classes: the head's logits split along the
vocabulary, the loss computed on their shards (Megatron's parallel cross-entropy).
Regions that meet at an op are one region. A region is kept only if every path out of it
ends at a row linear or such a loss; one that reaches anything else (a normalization or
residual add over the split dim, the output, a view that moves the split dim) stays
replicated, as do linears whose weight or bias another op also reads (but a head tied to
the word embedding, `tied_embedding`), and a head whose vocabulary ``tp`` does not divide
(Megatron pads it). Column weights and biases
are split ``S(0)`` (output features), row weights ``S(1)`` (input features), row biases are
stored replicated and read as partial sums (added on one rank).

The word embedding (the largest table looked up with a step input's indices, its weight
read by it alone, or tied to a split head) is split along the vocabulary, ``S(0)``, as
Megatron's VocabParallelEmbedding: each rank looks up its rows, and the partial sums are
all-reduced.

A fused projection whose output is cut into pieces along its features (one ``qkv`` linear,
then ``split``, ``chunk``, ``split_with_sizes`` or slices; a SwiGLU's gate|up) is split
strided, as Megatron interleaves it: its weight and bias ``S(0)xk`` (``k`` equal pieces) or
``S(0)x4:1:1`` (grouped-query attention's q|k|v of unequal widths), each rank's share of
each piece, and every piece then split plainly (`autoplan.strategies.strided`).

Limits: only linears are split, not ``matmul`` with a parameter or convolutions; a
parameter read inside a region by anything but its linears breaks the region (a head tied
to its embedding through mixed precision's casts stays whole).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from autoplan.errors import AutoplanError
from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind
from autoplan.strategies.placement import P, R, is_valid, shard, shard_dim, strided, widths
from autoplan.strategies.rules import AxisRule
from autoplan.strategies.space import axis_rules, plain_rules
from autoplan.strategies.strided import marks as fused_marks

log = logging.getLogger(__name__)

LINEAR = "aten.linear.default"
CAST = "aten._to_copy.default"
ADDMM = "aten.addmm.default"
CROSS_ENTROPY = "aten.cross_entropy_loss.default"
EMBEDDING = "aten.embedding.default"
ATTENTION = "aten.scaled_dot_product_attention.default"


@dataclass(frozen=True)
class TpRegion:
    """One tensor-parallel region: linears split by output features, then by input features."""

    columns: tuple[str, ...]  # linear node names, in graph order
    rows: tuple[str, ...]
    # (node, placement) of every split activation inside: "S(d)", or "S(d)xk" for a fused
    # projection's output of k pieces
    split: tuple[tuple[str, str], ...]
    losses: tuple[str, ...] = ()  # cross-entropies over the split vocabulary


def rule_for(node: Node, graph: Graph, inputs: tuple[str, ...]) -> AxisRule | None:
    """The first per-axis rule of ``node`` that takes its inputs placed as ``inputs``: how a
    split follows an op, inside a region here and on every axis in `propagate`."""
    if all(p == R for p in inputs):
        return (R, *inputs)
    rules, _ = axis_rules(node, graph)
    return next((rule for rule in rules if rule[1:] == inputs), None)


def rule_moving(
    node: Node, graph: Graph, inputs: tuple[str, ...], most: int | None = None, size: int = 1
) -> AxisRule | None:
    """The rule of ``node`` that keeps its parameters as placed and moves the fewest of its
    activations (a whole one is sliced for free; a split one is gathered, or re-split by an
    all-to-all), preferring an output without partial sums; with ``most``, moving at most
    that many (0: only slicing whole ones); only rules whose splits ``size`` devices divide
    (an axis's, where given). None if every rule needs a parameter placed otherwise."""
    rules, _ = axis_rules(node, graph)
    params = [graph.node(r.name).kind == NodeKind.PARAM for r in node.refs]
    shapes = [node.outputs[0].shape, *(graph.tensor(r).shape for r in node.refs)]
    rules = [
        rule
        for rule in rules
        if all(
            (d := shard_dim(p)) is None or d >= len(shape) or shape[d] % size == 0
            for p, shape in zip(rule, shapes, strict=True)
        )
    ]

    def moves(rule: AxisRule) -> int | None:
        count = 0
        for want, have, param in zip(rule[1:], inputs, params, strict=True):
            if want == have or (have == R and not param):
                continue
            if want == P:
                return None  # no collective makes a split tensor partial sums
            if param:
                return None
            count += 1
        return count

    ranked = [
        (n, rule[0] == P, i)
        for i, rule in enumerate(rules)
        if (n := moves(rule)) is not None and (most is None or n <= most)
    ]
    return rules[min(ranked)[2]] if ranked else None


@dataclass(frozen=True)
class Projection:
    """A linear's tensors: its activation, its weight and bias (parameters, or their casts)."""

    x: Ref
    weight: Ref
    bias: Ref | None
    out_dim: int  # the weight's dim of output features: 0 (out, in), 1 for a Conv1D's (in, out)

    @property
    def params(self) -> tuple[Ref, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


def projection(graph: Graph, node: Node) -> Projection | None:
    """``node`` as a linear (``aten.linear``, or a Conv1D's plain ``addmm`` of a 1-dim bias and
    a weight, both parameters), else None."""
    if node.op == LINEAR and len(node.refs) in (2, 3):
        return Projection(node.refs[0], node.refs[1], (node.refs[2:] or [None])[0], 0)
    if node.op != ADDMM or len(node.refs) != 3 or node.kwargs or len(node.args) != 3:
        return None  # beta or alpha given: not a Conv1D
    bias, x, weight = node.refs
    params = param_of(graph, bias.name) is not None and param_of(graph, weight.name) is not None
    return Projection(x, weight, bias, 1) if params and len(graph.tensor(bias).shape) == 1 else None


def _own_params(graph: Graph, node: Node, refs: Sequence[Ref]) -> bool:
    """``refs`` (a linear's weight and bias) are parameters that no other op reads (in mixed
    precision, each through its own cast)."""
    return all(
        param_of(graph, r.name) is not None and graph.users(r.name) == (node.name,) for r in refs
    )


def tied_embedding(graph: Graph, linear: Node) -> Node | None:
    """The embedding whose weight ``linear`` (a head without bias) shares, the two its only
    readers (GPT-2 and Gemma tie them so); None if there is none. Split along the
    vocabulary, both read it so, as Megatron splits them."""
    if len(linear.refs) != 2 or graph.node(linear.refs[1].name).kind != NodeKind.PARAM:
        return None
    weight = linear.refs[1].name
    others = [graph.node(u) for u in graph.users(weight) if u != linear.name]
    if len(others) == 1 and others[0].op == EMBEDDING and others[0].refs[0].name == weight:
        return others[0]
    return None


def param_of(graph: Graph, name: str) -> Node | None:
    """The parameter node ``name`` is, or casts (autocast's copy of a float32 weight in
    mixed precision, `autoplan.precision`) when that cast is the parameter's only reader."""
    node = graph.node(name)
    if node.kind == NodeKind.PARAM:
        return node
    if node.op != CAST or len(node.refs) != 1:
        return None
    source = graph.node(node.refs[0].name)
    return source if source.kind == NodeKind.PARAM and graph.users(source.name) == (name,) else None


def _is_row(graph: Graph, node: Node, split: Mapping[str, str]) -> bool:
    """A linear whose only split input is its activation, split along the contracted dim."""
    found = projection(graph, node)
    if found is None:
        return False
    x = found.x.name
    return (
        [r.name for r in node.refs if r.name in split] == [x]
        and split[x] == shard(len(graph.tensor(found.x).shape) - 1)
        and _own_params(graph, node, found.params)
    )


def _column_output(graph: Graph, node: Node) -> str:
    """How a column linear's output is split: along its features, strided where they are
    cut into pieces (one way only) for the ops after it."""
    last = len(node.output.shape) - 1
    marks = fused_marks(graph, plain_rules).get(Ref(node.name), frozenset())
    cut = [ws for d, ws in marks if d == last]
    return strided(last, cut[0]) if len(marks) == 1 and cut else shard(last)


def find_regions(graph: Graph, whole: frozenset[str] = frozenset()) -> tuple[TpRegion, ...]:
    """Megatron's tensor-parallel regions of ``graph`` (see the module docstring); the
    linears ``whole`` start none (`whole_keys`): their outputs stay replicated, and an
    attention reading them takes its share of their heads by slicing."""
    split: dict[str, str] = {}  # activation inside a region -> its placement
    columns: set[str] = set()
    regions_met = nx.utils.UnionFind()  # over column linears; a class is one region
    region_of: dict[str, str] = {}  # split activation or row linear -> a column of its region
    rows: set[str] = set()
    losses: set[str] = set()
    broken: set[str] = set()

    for node in graph:
        if node.kind not in (NodeKind.OP, NodeKind.OUTPUT):
            continue
        inside = [r.name for r in node.refs if r.name in split]
        if not inside:
            found = projection(graph, node) if node.kind == NodeKind.OP else None
            if (
                found is not None
                and node.name not in whole
                and graph.node(found.x.name).kind != NodeKind.PARAM
                and (
                    _own_params(graph, node, found.params)
                    or tied_embedding(graph, node) is not None
                )
            ):
                split[node.name] = _column_output(graph, node)
                columns.add(node.name)
                region_of[node.name] = node.name
            continue
        regions_met.union(*(region_of[name] for name in inside))
        region = region_of[inside[0]]
        if _is_row(graph, node, split):
            rows.add(node.name)  # its output is replicated again (after the all-reduce)
            region_of[node.name] = region
            continue
        ins = tuple(split.get(r.name, R) for r in node.refs)
        rule = rule_for(node, graph, ins) if node.kind == NodeKind.OP else None
        if rule is None and whole and node.op == ATTENTION:
            rule = rule_moving(node, graph, ins, most=0)  # whole keys sliced by heads
        if node.op == CROSS_ENTROPY and rule is not None and rule[0] == R:
            losses.add(node.name)  # on the vocabulary's shards, the whole loss out
            region_of[node.name] = region
        elif rule is None or shard_dim(rule[0]) is None:
            broken.add(region)
        else:
            split[node.name] = rule[0]
            region_of[node.name] = region

    members: dict[str, list[str]] = {}
    for name, column in region_of.items():  # graph order
        members.setdefault(regions_met[column], []).append(name)
    broken = {regions_met[c] for c in broken}
    regions = []
    for root, names in members.items():
        if root not in broken and any(n in rows or n in losses for n in names):
            regions.append(
                TpRegion(
                    columns=tuple(n for n in names if n in columns),
                    rows=tuple(n for n in names if n in rows),
                    split=tuple((n, split[n]) for n in names if n in split),
                    losses=tuple(n for n in names if n in losses),
                )
            )
    return tuple(regions)


def _features(dim: int, ws: tuple[int, ...]) -> str:
    return strided(dim, ws) if len(ws) > 1 else shard(dim)


def _weight_split(graph: Graph, region: TpRegion, linear: str) -> tuple[Projection, str]:
    """``linear``'s tensors, and how ``region`` splits its weight: a row linear's along its
    input features; a column linear's along its output features, strided as its output
    ("S(0)xk") where that is cut into pieces."""
    found = projection(graph, graph.node(linear))
    assert found is not None  # a split linear
    if linear in region.rows:
        return found, shard(1 - found.out_dim)
    return found, _features(found.out_dim, widths(dict(region.split)[linear]))


def _refusal(graph: Graph, region: TpRegion, tp: int) -> str | None:
    """Why ``tp`` cannot split ``region`` evenly (None if it can)."""
    for linear in region.columns + region.rows:
        found, placement = _weight_split(graph, region, linear)
        weight = param_of(graph, found.weight.name)
        assert weight is not None  # a split linear's own parameter
        dim = shard_dim(placement)
        assert dim is not None
        if not is_valid((placement,), weight.output.shape, (tp,)):
            kind = "column" if linear in region.columns else "row"
            size, ws = weight.output.shape[dim], widths(placement)
            what = f"size {size}" if len(ws) == 1 else f"pieces of {size // sum(ws)} x {ws}"
            return (
                f"tp={tp} does not divide dim {dim} ({what}) of parameter "
                f"{weight.target!r}, which the {kind}-parallel split of its linear cuts; "
                "choose a tp that divides it"
            )
    for name, placement in region.split:
        node = graph.node(name)
        dim = shard_dim(placement)
        assert dim is not None
        size = node.outputs[0].shape[dim]
        if not all(is_valid((placement,), out.shape, (tp,)) for out in node.outputs):
            where = node.module_path or "the top-level module"
            return (
                f"tp={tp} does not divide dim {dim} (size {size}) of {node.op} in {where}, "
                "which the tensor-parallel split runs through (e.g. the number of attention "
                "heads); choose a tp that divides it"
            )
    return None


def whole_keys(graph: Graph, regions: Sequence[TpRegion], tp: int) -> frozenset[str]:
    """The column linears of keys and values whose heads ``tp`` does not divide, where the
    queries' it does (grouped-query attention with fewer key-value heads than ranks): each
    computed whole on every rank, as Megatron's and vLLM's replicated key-value heads; each
    rank's attention reads the heads its query heads need, their gradients partial sums."""
    found: set[str] = set()
    for region in regions:
        split = dict(region.split)
        for name in split:
            node = graph.node(name)
            if node.op != ATTENTION or not is_valid((split[name],), node.output.shape, (tp,)):
                continue
            queries, _ = _behind(graph, split, node.refs[0].name, tp)
            for ref in node.refs[1:3]:  # the keys and the values, back to their linears
                seen, bad = _behind(graph, split, ref.name, tp)
                if bad:  # a fused q|k|v is not computed whole: refused (`_refusal`)
                    found |= (seen - queries) & set(region.columns)
    return frozenset(found)


def _behind(graph: Graph, split: Mapping[str, str], name: str, tp: int) -> tuple[set[str], bool]:
    """The split activations (and column linears) ``name`` is computed from inside its
    region, and whether ``tp`` fails to divide any of them."""
    seen: set[str] = set()
    todo, bad = [name], False
    while todo:
        at = todo.pop()
        if at in seen or at not in split:
            continue
        seen.add(at)
        made = graph.node(at)
        bad |= not all(is_valid((split[at],), t.shape, (tp,)) for t in made.outputs)
        todo += [r.name for r in made.refs]
    return seen, bad


def _split_regions(graph: Graph, tp: int) -> list[TpRegion]:
    """The regions of ``graph`` that ``tp`` splits: all of them, but a head whose
    vocabulary it does not divide (kept whole), and the keys and values of attention whose
    query heads it divides (`whole_keys`); any other it does not divide is refused."""
    regions = graph.memo("tensor-parallel regions", lambda: find_regions(graph))
    whole = whole_keys(graph, regions, tp)
    if whole:
        log.info("tp=%d: %s whole (fewer key-value heads than ranks)", tp, ", ".join(sorted(whole)))
        regions = graph.memo(("tensor-parallel regions", whole), lambda: find_regions(graph, whole))
    kept = []
    for region in regions:
        refusal = _refusal(graph, region, tp)
        if refusal is not None and region.losses:
            log.info("tp=%d: the head stays whole: %s", tp, refusal)
        elif refusal is not None:
            raise AutoplanError(refusal)
        else:
            kept.append(region)
    return kept


def word_embedding(graph: Graph, tp: int, tied: Collection[str] = ()) -> Node | None:
    """The embedding a baseline splits along the vocabulary on ``tp`` devices (see the
    module docstring; ``tied``: those tied to a split head): None if there is none, or
    ``tp`` does not divide its vocabulary, or its rule cannot split it so."""
    found = [
        node
        for node in graph
        if node.op == EMBEDDING
        and graph.node(node.refs[1].name).kind == NodeKind.INPUT
        and (_own_params(graph, node, node.refs[:1]) or node.name in tied)
    ]
    if not found:
        return None
    table = max(found, key=lambda n: graph.tensor(n.refs[0]).shape[0])
    rows = graph.tensor(table.refs[0]).shape[0]
    vocab_split: AxisRule = (P, shard(0), R)
    return table if rows % tp == 0 and vocab_split in axis_rules(table, graph)[0] else None


def tp_seeds(graph: Graph, tp: int) -> dict[str, tuple[str, str]]:
    """The ``tp`` axis's seeds (parameter -> stored, read placements) from the regions of
    ``graph`` and its word embedding, checked to split evenly over ``tp`` devices."""
    regions = _split_regions(graph, tp)
    if not regions:
        raise AutoplanError(
            f"tp={tp}, but the model has no linears Megatron would split (a linear whose output "
            "reaches only other linears, through element-wise ops, views or attention); "
            "use tp=1"
        )
    heads = [graph.node(c) for r in regions for c in r.columns]
    tied = {e.name for head in heads if (e := tied_embedding(graph, head)) is not None}
    embedding = word_embedding(graph, tp, tied)
    log.info(
        "tp=%d: %d tensor-parallel regions, %d column and %d row linears split, %d loss(es) "
        "on the vocabulary's shards, word embedding %s",
        tp,
        len(regions),
        sum(len(r.columns) for r in regions),
        sum(len(r.rows) for r in regions),
        sum(len(r.losses) for r in regions),
        "split" if embedding is not None else "whole",
    )
    seeds = {}

    def param(ref: Ref) -> str:
        return param_of(graph, ref.name).name  # type: ignore[union-attr]

    for region in regions:
        for linear in region.columns + region.rows:
            found, placement = _weight_split(graph, region, linear)
            seeds[param(found.weight)] = (placement, placement)
            if found.bias is None:
                continue
            if linear in region.rows:
                seeds[param(found.bias)] = (R, P)  # added on one rank: a partial sum
            else:  # split as the output features
                bias = _features(0, widths(placement))
                seeds[param(found.bias)] = (bias, bias)
    if embedding is not None:
        seeds[param(embedding.refs[0])] = (shard(0), shard(0))  # its lookup a partial sum
    return seeds
