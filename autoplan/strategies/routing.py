"""Routing regions: where index-routed experts may route each rank's own tokens.

transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 order their (token, expert) rows by expert
(`strategies/grouped_mm.py`): ``sort`` of the routed expert ids, the rows gathered by the
sort's permutation (``index``), counted per expert (``histc``, ``cumsum``: the offsets),
multiplied by the grouped matmuls and put back in token order by ``index`` with the inverse
permutation (``index_put`` of an ``arange`` at the permutation's positions). With the tokens
split by batch on a mesh axis, each rank can do all of that on its own tokens: sort its own
rows, count its own rows per expert (partial sums of the counts, ``P``) and send them to the
ranks that hold their experts (the grouped matmul's all-to-all, `execute/experts.py`), as
torchtitan's and DeepSeek's dispatch does. The rows between the sort and the inverse
permutation are then *this rank's rows in its own order*: split along dim 0 (``S(0)``), but
not the shards of the one-process tensor. That is exact where the region is closed: every
reader of its tensors is in it, they are the ops below, and its only way out is the inverse
permutation, whose output is the rank's tokens' rows in token order again (a true ``S(0)``).

torchtitan's MoE routes the same way with other ops: ``argsort`` of the routed ids, offsets
counted outside (the routing map summed over the tokens, read by the region's ``cumsum``
alone: partial, each rank's counts of its own tokens, as computed), views and expands that
keep dim 0 (`keeps_rows`), and for its exit the scatter-add of the region's rows at the
region's positions into zeros of the tokens made outside (``deterministic_scatter_add``).

`region` finds such regions from the graph alone; `local_rules` are the rules its ops take
there on top of their own (the rows split, the counts partial), and `moves_routed_rows` says
which redistributions of a region's tensors would mix the two meanings of ``S(0)``: the
planner prices those above any plan (`search/intra_op.py`), so that along each mesh axis a
region routes its rows either all locally or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autoplan.graph.flops import GROUPED_MMS
from autoplan.graph.ir import Graph, Node
from autoplan.modes import NodeKind
from autoplan.strategies.placement import P, R, Spec, shard, shard_dim

AxisRule = tuple[str, ...]  # (output, tensor input 0, ...) on one mesh axis, as in rules.py

SORTS = frozenset(
    {"aten.sort.default", "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable"}
)
INDEX, INDEX_PUT, ARANGE = "aten.index.Tensor", "aten.index_put.default", "aten.arange.default"
CUMSUM = "aten.cumsum.default"
COUNTS = frozenset({"aten.histc.default", CUMSUM})
# torchtitan's combine: the products added into zeros at their tokens' positions (dim 0)
SCATTER_ADDS = frozenset({"torchtitan.deterministic_scatter_add.default"})
ZEROS = frozenset({"aten.zeros_like.default", "aten.zeros.default", "aten.new_zeros.default"})
EXPAND = "aten.expand.default"
# row-wise where they keep dim 0 (`keeps_rows`)
RESHAPES = frozenset(
    {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", EXPAND}
)
# row-wise ops: each output row depends on the same row of each input (or on none)
ROW_OPS = frozenset(
    {
        "aten.floor_divide.default",
        "aten._to_copy.default",
        "aten.type_as.default",
        "aten.empty_like.default",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.unsqueeze.default",
        "aten.silu.default",
        "aten.gelu.default",
        "aten.relu.default",
        "aten.sigmoid.default",
        "aten.mul.Tensor",
        "aten.add.Tensor",
        "aten.clamp.default",
        "aten.masked_fill.Scalar",
        "aten.eq.Scalar",
        "aten.ge.Scalar",
    }
)


@dataclass(frozen=True)
class RegionOp:
    """One node as the analysis sees it: its name, op (``aten.sort.default``), the
    producers of its tensor inputs in argument order (an output of several outputs by its
    producer's name) and, of a view or expand, whether it keeps its input's rows
    (`keeps_rows`)."""

    name: str
    op: str
    reads: tuple[str, ...]
    rows_kept: bool = False


def keeps_rows(op: str, shape_in: Sequence[int], shape_out: Sequence[int]) -> bool:
    """Whether a view or expand ``op`` of a ``shape_in`` tensor to ``shape_out`` is row-wise:
    row ``i`` of its output made of row ``i`` of its input alone. A view keeps the elements'
    order, so one that keeps dim 0's size keeps each row's elements; an expand does where it
    adds no dim and does not expand dim 0."""
    if op not in RESHAPES or not shape_in or not shape_out or shape_in[0] != shape_out[0]:
        return False
    return op != EXPAND or len(shape_in) == len(shape_out)


@dataclass(frozen=True)
class Region:
    """The routed regions of a graph: their ops (the sorts, the rows between, the ``arange``
    of the inverse permutation) and their exits (the inverse permutations' ``index``)."""

    inside: frozenset[str]
    exits: frozenset[str]

    def __contains__(self, name: object) -> bool:
        return name in self.inside or name in self.exits


NO_REGION = Region(frozenset(), frozenset())


def region(ops: Sequence[RegionOp]) -> Region:
    """Every closed routed region of ``ops`` (graph order), from each sort whose values
    reach a grouped matmul's offsets; a sort whose region is not closed routes nothing."""
    by_name = {o.name: o for o in ops}
    readers: dict[str, list[RegionOp]] = {}
    for o in ops:
        for r in dict.fromkeys(o.reads):
            readers.setdefault(r, []).append(o)
    inside: set[str] = set()
    exits: set[str] = set()
    for seed in ops:
        if seed.op not in SORTS or seed.name in inside:
            continue
        found = _closed(seed, by_name, readers)
        if found is not None:
            inside |= found[0]
            exits |= found[1]
    return Region(frozenset(inside), frozenset(exits))


def graph_region(graph: Graph) -> Region:
    """`region` of a traced graph, once per graph."""

    def find() -> Region:
        return region([region_op(n, graph) for n in graph if n.kind == NodeKind.OP])

    return graph.memo("routed region", find)


def region_op(node: Node, graph: Graph) -> RegionOp:
    """``node`` of ``graph`` as the analysis sees it."""
    rows_kept = bool(node.refs and node.outputs) and keeps_rows(
        node.op, graph.tensor(node.refs[0]).shape, node.outputs[0].shape
    )
    return RegionOp(node.name, node.op, tuple(r.name for r in node.refs), rows_kept)


def _closed(
    seed: RegionOp, by_name: dict[str, RegionOp], readers: dict[str, list[RegionOp]]
) -> tuple[set[str], set[str]] | None:
    inside, exits = {seed.name}, set()
    todo = [seed.name]
    while todo:
        for user in readers.get(todo.pop(), ()):
            if user.name in inside or user.name in exits:
                continue
            if _is_exit(user, by_name):
                exits.add(user.name)
                continue
            if not _routes(user):
                return None
            inside.add(user.name)
            todo.append(user.name)
    # offsets counted outside (torchtitan's: the routing map summed over the tokens, a
    # rank's counts of its own rows where they are partial), and the inverse permutations'
    # positions (an arange), each read by the region alone
    for readers_op, arg, producer in ((GROUPED_MMS, 2, CUMSUM), ((INDEX_PUT,), 2, ARANGE)):
        if not _pull_in(inside, by_name, readers, readers_op, arg, producer):
            return None
    # the rows come in only as the sorted ids, gathered tokens and the experts' weights
    for name in inside:
        op = by_name[name]
        outer = [i for i, r in enumerate(op.reads) if r not in inside]
        allowed = (
            {0}
            if op.op in (INDEX, CUMSUM) or op.op in SORTS
            else {1}
            if op.op in GROUPED_MMS
            else set()
        )
        if not set(outer) <= allowed:
            return None
    # a scatter-add adds rows of the region at positions of the region into outer zeros
    for name in exits:
        op = by_name[name]
        into, added = op.reads[0], set(op.reads[1:])
        if op.op in SCATTER_ADDS and (into in inside or not added <= inside):
            return None
    grouped = [n for n in inside if by_name[n].op in GROUPED_MMS]
    counted = any(by_name[n].op in COUNTS for n in inside)
    return (inside, exits) if grouped and counted and exits else None


def _pull_in(
    inside: set[str],
    by_name: dict[str, RegionOp],
    readers: dict[str, list[RegionOp]],
    ops: Sequence[str],
    arg: int,
    producer: str,
) -> bool:
    """Adds to ``inside`` the outer producer of argument ``arg`` of each region op in ``ops``
    (of 3 tensor inputs) where it is a ``producer`` op read by the region alone; False where
    one is not."""
    for name in list(inside):
        op = by_name[name]
        if op.op not in ops or len(op.reads) != 3 or op.reads[arg] in inside:
            continue
        made = by_name.get(op.reads[arg])
        if made is None or made.op != producer:
            return False
        if any(u.name not in inside for u in readers.get(made.name, ())):
            return False
        inside.add(made.name)
    return True


def _routes(op: RegionOp) -> bool:
    return (
        op.op in ROW_OPS
        or op.rows_kept
        or op.op in COUNTS
        or op.op in GROUPED_MMS
        or op.op
        in (
            INDEX,
            INDEX_PUT,
            "getitem",
        )
    )


def _is_exit(op: RegionOp, by_name: dict[str, RegionOp]) -> bool:
    """An ``index`` of rows by an inverse permutation (an ``index_put`` of positions), or a
    scatter-add of rows into zeros at their tokens' positions (torchtitan's combine)."""
    if op.op in SCATTER_ADDS and len(op.reads) == 3:
        zeros = by_name.get(op.reads[0])
        return zeros is not None and zeros.op in ZEROS
    if op.op != INDEX or len(op.reads) != 2:
        return False
    positions = by_name.get(op.reads[1])
    return positions is not None and positions.op == INDEX_PUT


def local_rules(op: str, num_inputs: int, exit: bool) -> list[AxisRule]:
    """The rules of a routed region's op on one mesh axis beyond its own: the rows split
    (this rank's, in its order), the counts partial (each rank's counts of its rows, whose
    sum is the whole's), the experts whole (``S(0), S(0), R, P``: each rank multiplies its
    rows by every expert, DDP's) or split (``S(0), S(0), S(0), P``: its rows sent to their
    experts' ranks and back by all-to-all)."""
    rows = shard(0)
    if op in SORTS:
        return [(rows, rows)]
    if op == ARANGE:
        return [(rows,)]
    if op in (INDEX, INDEX_PUT) or exit:
        return [(rows, *[rows] * num_inputs)]
    if op == CUMSUM:
        return [(P, P)]
    if op in GROUPED_MMS:
        return [(rows, rows, R, P), (rows, rows, shard(0), P)]
    return []


def keeps(rule: AxisRule, op: RegionOp, found: Region) -> bool:
    """Whether a region's ``op`` keeps its own rule ``rule`` there. A row-wise op does: inside,
    a split along dim 0 is this rank's rows in its own order, row for row the same op. An
    op that reads positions (``index``, ``index_put``) does not where it splits a region's
    tensor (its output inside, an input read from inside) along dim 0: its positions there
    are this rank's own (`local_rules`), not the one-process tensor's."""
    if op.op in ROW_OPS or op.op in COUNTS or op.rows_kept:
        return True
    out, *ins = rule
    if op.name in found.inside and shard_dim(out) == 0:
        return False
    return not any(
        r in found.inside and shard_dim(p) == 0 for r, p in zip(op.reads, ins, strict=True)
    )


def moves_routed_rows(src: Spec, dst: Spec) -> bool:
    """Whether moving a routed region's tensor from ``src`` to ``dst`` would change it on an
    axis where either routes locally (its rows split along dim 0, or its counts partial)."""
    return any(
        a != b and (shard_dim(a) == 0 or shard_dim(b) == 0 or b == P)
        for a, b in zip(src, dst, strict=True)
    )


def makes_counts(src: Spec, dst: Spec) -> bool:
    """Whether moving a tensor from outside into a routed region's counts (``COUNTS``) from
    ``src`` to ``dst`` would make partial sums of it: counts partial there must be each
    rank's counts of its own rows, as computed (a sum over its tokens), not a share of
    whole ones."""
    return any(a != b and b == P for a, b in zip(src, dst, strict=True))


def routes_locally(placements: Iterable[Spec]) -> bool:
    """Whether a region's op so placed routes its rows on some axis (a dim-0 split or partial
    counts among its tensors), and so runs on this rank's tensors (execute/interpreter.py)."""
    return any(p == P or shard_dim(p) == 0 for spec in placements for p in spec if p != R)
