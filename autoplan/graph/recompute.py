"""Activation recomputation: which ops of a step run their forward again in backward, instead
of keeping their outputs from forward to backward (``torch.utils.checkpoint``): Megatron's
"full" recomputation (a layer's ops) or its "selective" one (a layer's attention core), or
torchtitan's op-level selective checkpointing ("ops": a layer's ops but those it saves).

The unit is a layer (`autoplan.graph.cut`), one per repeated block (``blocks.3``) however
the stage search merges blocks, or one of the step's balanced runs of ops when the model has
no blocks. A recomputed layer recomputes its ops from the step's first op in a block to its
last (all its ops when the model has no blocks): the embedding, the head and the loss keep
their outputs, as in Megatron. What a recomputed layer keeps from forward to backward is what
its recomputed ops send out of the layer (read by other ops); the rest of their outputs live
only while its backward runs, one layer at a time. Its backward runs its forward again: the
ops' time and the forward collectives issued inside it, twice.

Selective recomputation recomputes only each layer's attention core (`attention_core`): the
ops from the product of queries and keys through the scale, mask, softmax and dropout to the
product with the values (or a fused ``scaled_dot_product_attention``). Their outputs of
sequence-squared size are dropped and made again at a small compute cost (Megatron's
selective activation recomputation).

Op-level recomputation ("ops") recomputes a layer's ops (as full recomputation) but those
whose outputs torchtitan's op-level selective checkpointing saves (`saved_ops`: attention,
every other matrix product, ...). The layer runs as one region, as under full recomputation,
under torch's selective checkpointing (`autoplan.execute.checkpointed`): the saved ops'
outputs are kept from forward to backward whole, and their forward is not run again in
backward; the rest of the region's outputs are dropped and made again, the saved ops'
inputs among them (`Recompute.mixed`). The saved ops' forward collectives are issued again
in backward, as the recomputed ops' are: backward needs their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from autoplan.errors import AutoplanError
from autoplan.graph.blocks import block_of
from autoplan.graph.cut import Layer, cut_layers
from autoplan.graph.ir import Graph
from autoplan.graph.saved_ops import FUSED_ATTENTION, saved_ops
from autoplan.modes import NodeKind, RecomputeMode

# PlanOptions.recompute's choices (None: the planner's ILP chooses); a plan's recomputed
# layer is full or selective, one not recomputed has no entry

SOFTMAX = frozenset({"aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default"})
# the products that start and end an eager attention core: scores = Q K^T, context = P V
PRODUCTS = frozenset(
    {"aten.matmul.default", "aten.bmm.default", "aten.baddbmm.default", "aten.einsum.default"}
)


def recompute_layers(graph: Graph, max_layers: int) -> tuple[Layer, ...]:
    """The layers recomputation chooses among: one per block when the model has blocks,
    else the step's ``max_layers`` balanced runs of ops (`cut_layers`)."""
    has_blocks = any(block_of(n) is not None for n in graph if n.kind == NodeKind.OP)
    return cut_layers(graph, len(graph) if has_blocks else max_layers)


def recomputed_ops(graph: Graph, layer: Layer, mode: str = RecomputeMode.FULL) -> tuple[str, ...]:
    """The ops of ``layer`` that recompute their forward when it is recomputed in ``mode``.
    Full: those from the step's first op inside a block to its last (all when the model has
    no blocks), so that the embedding, the head and the loss stay out, and ops between blocks
    (an activation applied outside them) stay in. Selective: its attention cores'
    (`attention_core`); a model without any is refused. Ops: full's but those torchtitan's
    op-level selective checkpointing saves (`saved_ops`), which are those of full: the region
    that runs again, and `Recompute.mixed` tells the saved ones."""
    if mode == RecomputeMode.SELECTIVE:
        core = _memo_core(graph)
        if not core:
            raise AutoplanError(
                'recompute="selective" recomputes attention\'s core (softmax(Q K^T) V, or '
                "scaled_dot_product_attention), but the model has none: no softmax between "
                'two matrix products. Use recompute="full" (every layer) or "none"'
            )
        return tuple(n for n in layer.nodes if n in core)
    span = graph.memo("recomputed span", lambda: _recomputed_span(graph))
    return tuple(n for n in layer.nodes if n in span)


def _recomputed_span(graph: Graph) -> frozenset[str]:
    ops = [n for n in graph if n.kind == NodeKind.OP]
    inside = [i for i, n in enumerate(ops) if block_of(n) is not None]
    first, last = (inside[0], inside[-1]) if inside else (0, len(ops) - 1)
    return frozenset(n.name for n in ops[first : last + 1])


def attention_core(graph: Graph) -> frozenset[str]:
    """The ops of the step's attention cores: each fused ``scaled_dot_product_*`` op, and for
    each softmax whose input comes from a matrix product (Q K^T) and whose output goes to one
    (with V), through ops of its module, the ops of that module on the paths from the first
    product to the second (the scores, scale, mask, softmax, casts and dropout, both products
    included). A mask made elsewhere is read, not recomputed."""
    found: set[str] = set()

    def is_product(name: str) -> bool:
        return graph.node(name).op in PRODUCTS

    for node in graph:
        if node.kind != NodeKind.OP:
            continue
        if node.op.startswith(FUSED_ATTENTION):
            found.add(node.name)
            continue
        if node.op not in SOFTMAX:
            continue
        module = node.module_path
        _, scores = _walk(graph, node.name, module, False, is_product)
        _, context = _walk(graph, node.name, module, True, is_product)
        if len(scores) == 1 and len(context) == 1:
            after, _ = _walk(graph, scores[0], module, True, context[0].__eq__)
            before, _ = _walk(graph, context[0], module, False, scores[0].__eq__)
            found |= after & before
    return frozenset(found)


def frees_activations(graph: Graph) -> bool:
    """Whether selective recomputation frees anything: some op of an attention core whose
    output only the core reads (a fused attention op's output leaves it, and is kept)."""
    core = _memo_core(graph)
    return any(set(graph.users(n)) <= core for n in core)


def _memo_core(graph: Graph) -> frozenset[str]:
    return graph.memo("attention core", lambda: attention_core(graph))


def _walk(
    graph: Graph, start: str, module: str, forward: bool, end: Callable[[str], bool]
) -> tuple[set[str], list[str]]:
    """The ops of ``module`` reached from ``start`` (included) through its users
    (``forward``) or its inputs, not passing the ops where ``end`` holds; with those ends."""
    seen, ends, todo = {start}, [], [start]
    while todo:
        name = todo.pop()
        refs = graph.node(name).refs
        near = graph.users(name) if forward else tuple(dict.fromkeys(r.name for r in refs))
        for other in near:
            node = graph.node(other)
            if other in seen or node.kind != NodeKind.OP or node.module_path != module:
                continue
            seen.add(other)
            if end(other):
                ends.append(other)
            else:
                todo.append(other)
    return seen, ends


@dataclass(frozen=True)
class Recompute:
    """The recomputed layers of a step, each in its mode (a pipeline's stages may differ),
    for pricing (`autoplan.costmodel.pricer.Pricer`) and for the plan
    (`autoplan.planfile.sections.RecomputedLayer`)."""

    # (layer name, its mode, its region's ops (`recomputed_ops` in that mode))
    layers: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    layer_of: Mapping[str, int] = field(default_factory=dict)  # op of a region -> its layer
    kept: frozenset[str] = frozenset()  # recomputed ops whose outputs leave their region
    # ops of a region whose outputs are kept whole and that do not run again (mode "ops")
    saved: frozenset[str] = frozenset()
    # the ILP counts a dropped output at this share of its bytes: it sees the regions' mean,
    # the step's price the largest region (`autoplan.costmodel.step_price.price_step`)
    share: float = 1.0

    @staticmethod
    def of(
        graph: Graph, layers: Iterable[tuple[str, Sequence[str]]], mode: str = RecomputeMode.FULL
    ) -> Recompute:
        """(layer name, its region's ops (`recomputed_ops` in ``mode``)) for each
        recomputed layer."""
        return Recompute.mixed(graph, ((name, mode, ops) for name, ops in layers))

    @staticmethod
    def mixed(graph: Graph, layers: Iterable[tuple[str, str, Sequence[str]]]) -> Recompute:
        """(layer name, its mode, its region's ops) for each recomputed layer: one region
        each, made again whole in backward but for its saved ops (mode "ops", `saved_ops`)."""
        chosen = tuple((name, mode, tuple(ops)) for name, mode, ops in layers if ops)
        layer_of = {op: i for i, (_, _, ops) in enumerate(chosen) for op in ops}
        saved = frozenset(
            op
            for _, mode, ops in chosen
            if mode == RecomputeMode.OPS
            for op in saved_ops(graph, ops)
        )
        kept = frozenset(
            name
            for name, i in layer_of.items()
            if name not in saved and any(layer_of.get(u) != i for u in graph.users(name))
        )
        return Recompute(chosen, layer_of, kept, saved, 1.0 / max(len(chosen), 1))

    @staticmethod
    def every_layer(
        graph: Graph, layers: Iterable[Layer], mode: str = RecomputeMode.FULL
    ) -> Recompute:
        """Every layer of ``layers`` recomputed in ``mode``."""
        ops = ((la.name, recomputed_ops(graph, la, mode)) for la in layers)
        return Recompute.of(graph, ops, mode)

    def within(self, nodes: Collection[str]) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        """Those of its layers whose ops are among ``nodes`` (one pipeline stage's): a
        pipeline's recomputation is its stages' together (`Recompute.mixed`)."""
        return tuple(layer for layer in self.layers if layer[2][0] in nodes)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def recomputes(self, name: str) -> bool:
        """Whether ``name``'s forward runs again in backward."""
        return name in self.layer_of and name not in self.saved

    def reruns(self, name: str) -> bool:
        """Whether ``name`` is in a region, whose forward collectives are issued again in
        backward (a saved op's too: backward needs its inputs)."""
        return name in self.layer_of

    def drops(self, name: str) -> bool:
        """Whether ``name``'s output is freed after forward and made again in backward."""
        return self.recomputes(name) and name not in self.kept


NO_RECOMPUTE = Recompute()


def chosen(graph: Graph, max_layers: int, mode: str) -> Recompute:
    """Every layer of ``graph`` (`recompute_layers`) recomputed in ``mode``, or none (mode none)."""
    if mode == RecomputeMode.NONE:
        return NO_RECOMPUTE
    return graph.memo(
        ("every layer recomputed", max_layers, mode),
        lambda: Recompute.every_layer(graph, recompute_layers(graph, max_layers), mode),
    )
