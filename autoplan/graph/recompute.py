"""Activation recomputation: which ops of a step run their forward again in backward, instead
of keeping their outputs from forward to backward (Megatron's "full" recomputation,
``torch.utils.checkpoint``).

The unit is a layer (`autoplan.graph.cut`), one per repeated block (``blocks.3``) however
the stage search merges blocks, or one of the step's balanced runs of ops when the model has
no blocks. A recomputed layer recomputes its ops from the step's first op in a block to its
last (all its ops when the model has no blocks): the embedding, the head and the loss keep
their outputs, as in Megatron. What a recomputed layer keeps from forward to backward is what
its recomputed ops send out of the layer (read by other ops); the rest of their outputs live
only while its backward runs, one layer at a time. Its backward runs its forward again: the
ops' time and the forward collectives issued inside it, twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from autoplan.graph.blocks import block_of
from autoplan.graph.cut import Layer, cut_layers
from autoplan.graph.ir import OP, Graph

# PlanOptions.recompute's choices (None: only where nothing fits without); a plan's recomputed
# layer is FULL, one not recomputed has no entry
FULL = "full"
MODES = ("none", FULL)


def recompute_layers(graph: Graph, max_layers: int) -> tuple[Layer, ...]:
    """The layers recomputation chooses among: one per block when the model has blocks,
    else the step's ``max_layers`` balanced runs of ops (`cut_layers`)."""
    has_blocks = any(block_of(n) is not None for n in graph if n.kind == OP)
    return cut_layers(graph, len(graph) if has_blocks else max_layers)


def recomputed_ops(graph: Graph, layer: Layer) -> tuple[str, ...]:
    """The ops of ``layer`` that recompute their forward when it is recomputed: those from the
    step's first op inside a block to its last (all when the model has no blocks), so that
    the embedding, the head and the loss stay out, and ops between blocks (an activation
    applied outside them) stay in."""
    span = graph.memo("recomputed span", lambda: _recomputed_span(graph))
    return tuple(n for n in layer.nodes if n in span)


def _recomputed_span(graph: Graph) -> frozenset[str]:
    ops = [n for n in graph if n.kind == OP]
    inside = [i for i, n in enumerate(ops) if block_of(n) is not None]
    first, last = (inside[0], inside[-1]) if inside else (0, len(ops) - 1)
    return frozenset(n.name for n in ops[first : last + 1])


@dataclass(frozen=True)
class Recompute:
    """The recomputed layers of a step, for pricing (`autoplan.strategies.pricing.Pricer`)
    and for the plan (`autoplan.planfile.sections.RecomputedLayer`)."""

    layers: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (layer name, its recomputed ops)
    layer_of: Mapping[str, int] = field(default_factory=dict)  # recomputed op -> its layer
    kept: frozenset[str] = frozenset()  # recomputed ops whose outputs leave their layer
    # the ILP counts a dropped output at this share of its bytes: it sees the layers' mean,
    # the step's price the largest layer (`autoplan.search.step_price.price_step`)
    share: float = 1.0

    @staticmethod
    def of(graph: Graph, layers: Iterable[tuple[str, Sequence[str]]]) -> Recompute:
        """(layer name, its recomputed ops (`recomputed_ops`)) for each recomputed layer."""
        chosen = tuple((name, tuple(ops)) for name, ops in layers if ops)
        layer_of = {op: i for i, (_, ops) in enumerate(chosen) for op in ops}
        kept = frozenset(
            name
            for name, i in layer_of.items()
            if any(layer_of.get(u) != i for u in graph.users(name))
        )
        return Recompute(chosen, layer_of, kept, 1.0 / max(len(chosen), 1))

    @staticmethod
    def every_layer(graph: Graph, layers: Iterable[Layer]) -> Recompute:
        """Every layer of ``layers`` recomputed."""
        return Recompute.of(graph, ((la.name, recomputed_ops(graph, la)) for la in layers))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def recomputes(self, name: str) -> bool:
        return name in self.layer_of

    def drops(self, name: str) -> bool:
        """Whether ``name``'s output is freed after forward and made again in backward."""
        return name in self.layer_of and name not in self.kept


NO_RECOMPUTE = Recompute()


def chosen(graph: Graph, max_layers: int, recompute: bool) -> Recompute:
    """Every layer of ``graph`` (`recompute_layers`) recomputed, or none."""
    if not recompute:
        return NO_RECOMPUTE
    return graph.memo(
        ("every layer recomputed", max_layers),
        lambda: Recompute.every_layer(graph, recompute_layers(graph, max_layers)),
    )
