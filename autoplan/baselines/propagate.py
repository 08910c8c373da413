"""Placing a baseline: each mesh axis by propagation from its seeds, then one strategy a node.

Each mesh axis is placed by *propagation*: parameters and inputs are seeded, and each op in
graph order takes the first of its own sharding rules (`axis_rules`: ours, else DTensor's)
that accepts its inputs as their producers place them; an op with no such rule runs
replicated on that axis (its inputs gathered, partial sums all-reduced), unless a rule takes
them with whole activations sliced, which costs no communication. On the ``dp`` axis
the inputs (and target) are split along dim 0 (but a padding mask whose rows are gathered by
batch position, `rows_indexed`) and parameters replicated (ZeRO-3: stored split,
gathered before use; ZeRO-1/2: their optimizer state split, `zero_state`), so every op follows
the batch and the loss ends as partial sums. On the ``cp`` axis (context parallelism) the
inputs are split along dim 1, the sequence, and parameters replicated (`_cp_seeds`). On the
``tp`` axis the seeds are the split linears' parameters (`autoplan.baselines.regions`).

The axes combine into one strategy per node on mesh `mesh_of(dp, tp, cp)`; it must be one of
the node's own strategies on that mesh (`node_strategies`: every split divides evenly), else
the degrees are refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from autoplan.baselines.regions import param_of, rule_for, rule_moving, tp_seeds
from autoplan.errors import AutoplanError
from autoplan.graph.flops import GROUPED_MMS
from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind, RecomputeMode
from autoplan.strategies import routing
from autoplan.strategies.float32_grads import (
    baseline_copy,
    check_copies_read_as_placed,
    kept_where_whole,
    weight_copies,
)
from autoplan.strategies.placement import P, R, Spec, fitted, pieces, shard, shard_dim
from autoplan.strategies.rules import AxisRule
from autoplan.strategies.space import (
    RESHAPES,
    NodeStrategies,
    Strategy,
    axis_rules,
    input_grad,
    is_candidate,
    source_of,
)
from autoplan.strategies.zero_state import state_specs

EINSUM = "aten.einsum.default"
CAST, TRANSPOSE = "aten._to_copy.default", "aten.transpose.int"
INDEX, ARANGE = "aten.index.Tensor", "aten.arange.default"
# single-input ops a tensor's rows pass through unchanged in order: views, casts, unsqueeze
_PASSING = RESHAPES | {
    CAST,
    "aten.to.device",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.unsqueeze.default",
    "aten.expand.default",
    "aten.alias.default",
}

Seeds = Mapping[str, tuple[str, str]]  # param / input node -> (stored, read) on one mesh axis


@dataclass(frozen=True)
class Layout:
    """A baseline's degrees and what it does on each mesh axis."""

    dp: int
    tp: int
    # 1, 2: the optimizer state (and gradients) split along dp; 3: the parameters (ZeRO-3)
    zero_stage: int = 0
    sequence_parallel: bool = False  # Megatron's, on the tp axis
    ep: int = 1  # experts split along the dp axis (GShard): 1 or dp
    # every layer recomputed in backward in this mode (none, full or selective)
    recompute: RecomputeMode = RecomputeMode.NONE
    # every gradient reduced in float32 (`autoplan.strategies.float32_grads`)
    float32_grads: bool = False
    cp: int = 1  # context parallelism: every op split along the sequence on a cp axis

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return mesh_of(self.dp, self.tp, self.cp)


def expert_weights(graph: Graph) -> list[Node]:
    """The experts' weights: parameters of three or more dims, the experts along dim 0, that
    only einsums read (as GShard writes them: "emh" for expert, model, hidden) or grouped
    matmuls as their weights (transformers' index-routed experts, `strategies.grouped_mm`),
    through casts and transposes that keep dim 0."""
    found = []
    for node in graph.params:
        readers = _readers(graph, node.name)
        experts = all(u.op == EINSUM or u.op in GROUPED_MMS for u, _ in readers)
        weights = all(u.op not in GROUPED_MMS or u.refs.index(read) == 1 for u, read in readers)
        if len(node.output.shape) >= 3 and readers and experts and weights:
            found.append(node)
    return found


def _readers(graph: Graph, name: str) -> list[tuple[Node, Ref]]:
    """The ops that read tensor ``name`` (as which of their inputs), casts and transposes of
    dims other than 0 looked through."""
    found = []
    for user in graph.users(name):
        node = graph.node(user)
        ndim = len(node.outputs[0].shape) if node.outputs else 0
        moved = {int(a) % ndim for a in node.args[1:3]} if node.op == TRANSPOSE and ndim else {0}
        if node.op == CAST or (node.op == TRANSPOSE and 0 not in moved):
            found += _readers(graph, user)
        else:
            found += [(node, r) for r in node.refs if r.name == name]
    return found


def _zero3_storage(node: Node, tp_storage: str, dp: int, tp: int) -> str:
    """How ZeRO-3 stores a parameter on the dp axis: split along a dim the tp split leaves
    whole if one divides by dp (so a gather on dp alone restores what tp reads), else along
    the tp-split dim if it divides by dp * tp and tp splits it plainly (not strided: a fused
    projection's bias), else replicated."""
    shape = node.output.shape
    tp_dim = shard_dim(tp_storage)
    for d, size in enumerate(shape):
        if d != tp_dim and size % dp == 0:
            return shard(d)
    if tp_dim is not None and pieces(tp_storage) == 1 and shape[tp_dim] % (dp * tp) == 0:
        return shard(tp_dim)
    return R


def zero_state(node: Node, stored: Spec, layout: Layout) -> Spec | None:
    """ZeRO-1/2's optimizer state of a parameter stored ``stored`` on mesh `mesh_of`: split
    further along the dp axis (the first) alone, as `autoplan.strategies.zero_state` splits it; None
    where no dim its storage leaves whole has a piece for each rank, or the parameter is
    stored strided (a fused projection's: the planner keeps such a state as stored too)."""
    if any(pieces(p) > 1 for p in stored):
        return None
    mesh_shape = layout.mesh_shape
    found = state_specs(stored, node.output.shape, mesh_shape)
    return next((s for s in found if s[1:] == stored[1:]), None)


def zero_replicated(graph: Graph, layout: Layout) -> list[str]:
    """The trained parameters ZeRO keeps whole on the dp axis: ZeRO-3, no dim divides by dp;
    ZeRO-1/2, no dim its storage leaves whole has dp elements or more (a state is split
    unevenly where none divides), or the parameter is stored strided (ZeRO-3:
    `_zero3_storage`, ZeRO-1/2: `zero_state`). Told to whoever asked for the baseline."""
    on_tp = tp_seeds(graph, layout.tp) if layout.tp > 1 else {}

    def whole(node: Node) -> bool:
        tp_storage = on_tp.get(node.name, (R, R))[0]
        if layout.zero_stage == 3:
            return _zero3_storage(node, tp_storage, layout.dp, layout.tp) == R
        stored = (R,) + ((tp_storage,) if layout.tp > 1 else ())
        return zero_state(node, stored, layout) is None

    return [node.target for node in graph.params if node.needs_grad and whole(node)]


def _dp_seeds(
    graph: Graph, layout: Layout, on_tp: Seeds, received: Collection[str]
) -> dict[str, tuple[str, str]]:
    """The dp axis: the inputs split along dim 0, the batch, except a tensor ``received``
    from an earlier pipeline stage that the `boundary` placement keeps whole (`fitted`: one
    without a batch, as a batch-1 table broadcast against it); ZeRO-3's parameters stored
    split; ep's experts split."""
    dp, tp, zero_stage = layout.dp, layout.tp, layout.zero_stage
    seeds = {}
    indexed, indexes = rows_indexed(graph)
    for name in indexes:
        if graph.node(name).output.shape[0] % dp == 0:
            seeds[name] = (shard(0), shard(0))  # its batch positions sliced
    for i, node in enumerate(n for n in graph if n.kind == NodeKind.INPUT):
        if node.name in received and fitted((shard(0),), node.output.shape) == (R,):
            continue  # no seed: whole on dp, as it crosses the boundary
        if node.name in indexed:
            continue  # whole: its rows gathered on each rank by the split arange
        if not node.output.shape or node.output.shape[0] % dp:
            raise AutoplanError(
                f"dp={dp} does not divide the batch (dim 0) of input {i} ({node.target!r}, shape "
                f"{node.output.shape}); use a batch size that is a multiple of {dp}"
            )
        seeds[node.name] = (shard(0), shard(0))
    if zero_stage == 3:
        for node in graph.params:
            if node.needs_grad:
                storage = _zero3_storage(node, on_tp.get(node.name, (R, R))[0], dp, tp)
                seeds[node.name] = (storage, R)
    if layout.ep > 1:
        experts = expert_weights(graph)
        if not experts:
            raise AutoplanError(
                f"ep={layout.ep} splits experts, but the model has none (parameters of three or "
                "more dims read only by einsums or grouped matmuls, the experts along dim 0); "
                "use ep=1"
            )
        for node in experts:
            if node.output.shape[0] % layout.ep:
                raise AutoplanError(
                    f"ep={layout.ep} does not divide the {node.output.shape[0]} experts of "
                    f"{node.target!r}; use an ep that divides the number of experts"
                )
            seeds[node.name] = (shard(0), shard(0))
    return seeds


def _behind(graph: Graph, ref: Ref) -> Node:
    """The node ``ref`` comes from, through ops that pass its rows on unchanged (`_PASSING`)."""
    node = graph.node(ref.name)
    while node.op in _PASSING and len(node.refs) == 1:
        node = graph.node(node.refs[0].name)
    return node


def rows_indexed(graph: Graph) -> tuple[set[str], set[str]]:
    """Inputs whose rows an ``index`` op gathers by a batch-long ``arange`` (transformers'
    padding mask, ``mask[arange(batch)[:, None, None, None], positions]``): the inputs, and
    those index ops. The arange's values are global batch positions: on dp, sliced along the
    batch (free), each rank gathers its own rows by them from the whole input (every rank is
    given the whole batch, so keeping it whole costs no communication), and the gathered
    mask, and all that follows it, are split with the batch, as DDP's would be."""
    inputs, indexes = set(), set()
    for node in graph:
        if node.op != INDEX or len(node.refs) < 2:
            continue
        data, rows = _behind(graph, node.refs[0]), _behind(graph, node.refs[1])
        # an input and an arange have one output each (an index may read a topk's)
        if data.kind != NodeKind.INPUT or rows.op != ARANGE or not data.output.shape:
            continue
        if rows.output.shape == data.output.shape[:1]:
            inputs.add(data.name)
            indexes.add(node.name)
    return inputs, indexes


def _cp_seeds(graph: Graph, cp: int) -> dict[str, tuple[str, str]]:
    """The cp axis: every input of two or more dims (token ids, targets) split along the
    sequence (dim 1), as Megatron's context parallelism hands each rank its part of every
    sequence. Propagated so, every op follows the sequence, an attention takes its queries'
    part against keys and values gathered (the rule that moves the fewest activations)."""
    seeds = {}
    for i, node in enumerate(n for n in graph if n.kind == NodeKind.INPUT):
        if len(node.output.shape) < 2:
            continue
        if node.output.shape[1] % cp:
            raise AutoplanError(
                f"cp={cp} does not divide the sequence (dim 1) of input {i} ({node.target!r}, "
                f"shape {node.output.shape}); use a sequence length that is a multiple of {cp}"
            )
        seeds[node.name] = (shard(1), shard(1))
    return seeds


def _propagate(
    graph: Graph, seeds: Seeds, *, sequence: bool = False, move: bool = False, size: int = 1
) -> Mapping[str, AxisRule]:
    """`_propagated`, once per graph and axis (most conventional plans of a step share their
    axes: the dp axis for all tp degrees, the tp axis for all dp degrees and ZeRO stages)."""
    key = ("propagated", frozenset(seeds.items()), sequence, move, size)
    return graph.memo(
        key, lambda: _propagated(graph, seeds, sequence=sequence, move=move, size=size)
    )


def _propagated(
    graph: Graph, seeds: Seeds, *, sequence: bool = False, move: bool = False, size: int = 1
) -> dict[str, AxisRule]:
    """One mesh axis: every node's (output, input...) placements, from the seeds. Ops read
    partial sums all-reduced (Megatron's all-reduce after a row linear, the loss's on dp), or,
    with ``sequence``, reduce-scattered along the sequence (dim 1) when they have one
    (Megatron's sequence parallelism). An op that no rule takes with its inputs as placed takes
    one that only slices whole activations (free), else runs replicated, or, with ``move``,
    as the rule that keeps its parameters as seeded and moves the fewest activations
    (`rule_moving`: gathered for a column linear under sequence parallelism, sent to their
    experts by all-to-all under expert parallelism) among those whose splits ``size`` divides
    (the cp axis's: a label padded along the sequence is gathered, not split by a batch of one)."""
    read: dict[str, str] = {}  # how consumers read each node's output
    placed: dict[str, AxisRule] = {}
    routed = routing.graph_region(graph)
    for node in graph:
        if node.kind in (NodeKind.PARAM, NodeKind.INPUT):
            stored, read[node.name] = seeds.get(node.name, (R, R))
            placed[node.name] = (stored,)
            continue
        ins = tuple(read[r.name] for r in node.refs)
        rule = rule_for(node, graph, ins) if node.kind == NodeKind.OP else None
        if node.name in seeds:  # an op seeded split (`rows_indexed`): its whole inputs sliced
            wanted = seeds[node.name][0]
            rule = next((r for r in _slicing(node, graph, ins) if r[0] == wanted), rule)
        if rule is None and sequence and node.op in RESHAPES:
            # a view that no rule keeps split (a Conv1D's flattening of batch and sequence)
            # reads the sequence gathered, as Megatron gathers it before a column linear
            rule = (R,) * (1 + len(ins))
        if rule is None and node.kind == NodeKind.OP:
            # a whole activation read split is sliced on each rank, with no communication:
            # an attention mask or a label made whole follows the batch as DDP's would
            rule = rule_moving(node, graph, ins, most=None if move else 0, size=size)
        placed[node.name] = rule if rule is not None else (R,) * (1 + len(ins))
        read[node.name] = placed[node.name][0]
        if node.name in routed.inside:
            _route_positions(node, placed, read)
            if read[node.name] == P:  # a rank's counts of its own rows: its offsets' too
                continue
        # a parameter's cast (mixed precision) passes a row bias on as read: added on one rank;
        # counts a routed region reads (torchtitan's) are each rank's own there, kept partial
        counted = any(
            u in routed.inside and graph.node(u).op in routing.COUNTS
            for u in graph.users(node.name)
        )
        if read[node.name] == P and param_of(graph, node.name) is None and not counted:
            read[node.name] = _partial_read(graph, node, sequence)
    return placed


def _route_positions(node: Node, placed: dict[str, AxisRule], read: dict[str, str]) -> None:
    """An inverse permutation of a rank's own rows (`autoplan.strategies.routing`) puts its
    own positions (a local ``arange``) where its permutation is split: the ``arange``, placed
    before its reader, follows it."""
    rule = placed[node.name]
    if node.op != routing.INDEX_PUT or len(node.refs) != 3 or shard_dim(rule[3]) != 0:
        return
    positions = node.refs[2].name
    if placed.get(positions) == (R,):
        placed[positions] = (rule[3],)
        read[positions] = rule[3]


def _slicing(node: Node, graph: Graph, ins: tuple[str, ...]) -> list[AxisRule]:
    """``node``'s rules that take its inputs as placed, or whole ones sliced (free)."""
    rules, _ = axis_rules(node, graph)
    return [r for r in rules if all(w == h or h == R for w, h in zip(r[1:], ins, strict=True))]


def _partial_read(graph: Graph, node: Node, sequence: bool) -> str:
    """How ops read ``node``'s partial sums: all-reduced, or with ``sequence`` reduce-scattered
    along the sequence (dim 1 of (batch, seq, ...)); a Conv1D's (tokens, features) read by
    views alone stays partial, to be reduce-scattered once viewed as (batch, seq, features)."""
    if not sequence:
        return R
    if len(node.outputs[0].shape) >= 3:
        return shard(1)
    users = graph.users(node.name)
    return P if users and all(graph.node(u).op in RESHAPES for u in users) else R


def baseline_strategies(
    graph: Graph, layout: Layout, sent: Collection[str] = (), received: Collection[str] = ()
) -> dict[str, NodeStrategies]:
    """Each node's one strategy in the baseline, on mesh `Layout.mesh_shape`. On a pipeline
    stage's graph, the tensors ``received`` are inputs (seeded as the `boundary` placement
    fits them) and the output reads those ``sent`` on as the `boundary` placement fits them."""
    dp, tp = layout.dp, layout.tp
    on_tp = tp_seeds(graph, tp) if tp > 1 else {}
    per_axis = []
    if dp > 1:
        seeds = _dp_seeds(graph, layout, on_tp, received)
        per_axis.append(_propagate(graph, seeds, move=layout.ep > 1))
    if layout.cp > 1:
        seeds = _cp_seeds(graph, layout.cp)
        per_axis.append(_propagate(graph, seeds, move=True, size=layout.cp))
    if tp > 1:
        sequence = layout.sequence_parallel
        per_axis.append(_propagate(graph, on_tp, sequence=sequence, move=sequence))
    per_axis = per_axis or [_propagate(graph, {})]  # one device: all replicated
    mesh_shape = layout.mesh_shape
    space = {}
    for node in graph:
        rules = [placed[node.name] for placed in per_axis]
        strategy = Strategy(
            output=tuple(r[0] for r in rules) if node.outputs else (),
            inputs=tuple(tuple(r[i + 1] for r in rules) for i in range(len(node.refs))),
        )
        if node.kind == NodeKind.PARAM and node.needs_grad and layout.zero_stage in (1, 2):
            state = zero_state(node, strategy.output, layout)
            grad = state if layout.zero_stage == 2 else None
            strategy = replace(strategy, grad=grad, state=state) if state else strategy
        if node.kind == NodeKind.OUTPUT:
            inputs = zip(node.refs, strategy.inputs, strict=True)
            strategy = Strategy(
                (),
                tuple(
                    fitted(boundary(dp, tp), graph.tensor(r).shape) if r.name in sent else spec
                    for r, spec in inputs
                ),
            )
            space[node.name] = NodeStrategies(node.name, (strategy,), "output")
            continue
        if not is_candidate(node, graph, strategy, mesh_shape):
            raise AutoplanError(
                f"the baseline places {node.op} in {node.module_path or 'the top level'!r} "
                f"({node.name}) as {_text(strategy.output)} from {_text(*strategy.inputs)}, "
                f"which does not split evenly on mesh {mesh_shape}; choose other dp/tp degrees"
            )
        space[node.name] = NodeStrategies(node.name, (strategy,), source_of(node, graph))
    if layout.sequence_parallel and tp > 1:
        for name, kept in _gathered_views(graph, space, mesh_shape).items():
            space[name] = replace(space[name], strategies=(kept,))
    if layout.float32_grads:
        for name in weight_copies(graph):
            kept = baseline_copy(graph.node(name), space[name].strategies[0], mesh_shape)
            space[name] = replace(space[name], strategies=(kept,))
        check_copies_read_as_placed(space, graph, mesh_shape)
    return space


def _gathered_views(
    graph: Graph, space: Mapping[str, NodeStrategies], mesh_shape: tuple[int, ...]
) -> dict[str, Strategy]:
    """Under sequence parallelism, the views that read the sequence gathered on the tp axis
    (the last; a Conv1D's flattening of batch and sequence, see `_propagated`) and hand it to
    column linears only, each the only reader of what it views: each strategy keeping its
    output's gradient partial where the output is whole (`kept_where_whole`), as the column
    linears hand it back. So their partial sums pass back through the view to be
    reduce-scattered along the sequence, as Megatron's backward of its all-gather does, not
    all-reduced and then sliced."""
    found = {}
    for node in graph:
        if node.op not in RESHAPES or graph.fan_out(node.refs[0]) != 1:
            continue
        if len(graph.tensor(node.refs[0]).shape) < 3:  # no (batch, sequence, ...) to gather
            continue
        strategy = space[node.name].strategies[0]
        producer = space[node.refs[0].name].strategies[0]
        if strategy.output[-1] != R or producer.output[-1] != shard(1):
            continue
        kept = kept_where_whole(strategy, mesh_shape)
        reads = [
            input_grad(graph.node(u), space[u].strategies[0], i)
            for u in graph.users(node.name)
            for i, r in enumerate(graph.node(u).refs)
            if r.name == node.name
        ]
        if reads and all(grad == kept.grad for grad in reads):
            found[node.name] = kept
    return found


def assignment_of(space: Mapping[str, NodeStrategies]) -> dict[str, Strategy]:
    """The one strategy of each node in ``space``."""
    return {name: ns.strategies[0] for name, ns in space.items()}


def _text(*specs: Spec) -> str:
    return ", ".join("(" + ", ".join(s) + ")" for s in specs)


def mesh_of(dp: int, tp: int, cp: int = 1) -> tuple[int, ...]:
    """``(dp, cp, tp)`` less the axes of one device (``(1,)`` on a single device), the
    axes in Megatron's order."""
    return tuple(n for n in (dp, cp, tp) if n > 1) or (1,)


def boundary(dp: int, tp: int) -> Spec:
    """How tensors cross pipeline stages on mesh `mesh_of(dp, tp)`: each dp group's slice
    of the batch, whole on tp (as Megatron keeps the residual stream between blocks)."""
    return (shard(0),) * (dp > 1) + (R,) * (tp > 1) or (R,)
