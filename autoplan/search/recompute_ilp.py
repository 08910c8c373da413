"""Recomputation chosen by the intra-op ILP, with the strategies (`autoplan.solvers.problem.
Recomputation`): how many of each set of identical layers recompute, and in which mode.

Identical layers (`units`: the same canonical ops, as `autoplan.graph.blocks` shares their
decisions) share their strategies in the ILP, so what it chooses for them is a count per mode:
the first ``n`` layers of a unit recompute in the first mode, the next ones in the second
(`chosen`), as Megatron's "block" method recomputes its first layers. Per decision group and
strategy, a mode costs the recomputed forward's time and frees the activations its layer drops
(`recomputations`, from `Pricer` with one layer recomputed). The ILP counts the largest
recomputed layer's activations held again during its backward; it does not count the forward
collectives that a recomputed op issues again (`price_step` does: the plan is priced again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoplan.costmodel.pricer import Pricer
from autoplan.graph.blocks import BlockSharing
from autoplan.graph.cut import Layer
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import Recompute, frees_activations, recompute_layers, recomputed_ops
from autoplan.modes import RecomputeMode
from autoplan.solvers.problem import Grouping, IntraOpProblem, Recomputation
from autoplan.strategies.space import NodeStrategies


@dataclass(frozen=True)
class RecomputeChoice:
    """What the ILP may recompute: the step's layers (`recompute_layers`) in ``modes``."""

    layers: tuple[Layer, ...]
    modes: tuple[str, ...]  # full and selective, in the order `chosen` fills layers
    # the share of the activations a recomputed layer holds again during its backward that
    # the ILP counts: all of them in one stage; a pipeline stage of k layers holds one
    # layer's at a time (`RangeCost.of`), so each of its layers, planned alone, counts 1 / k
    holds: float = 1.0

    @staticmethod
    def of(graph: Graph, max_layers: int, holds: float = 1.0) -> RecomputeChoice:
        """Every layer of ``graph`` (`recompute_layers`), selective where that frees
        activations (`frees_activations`), and full."""
        modes = (RecomputeMode.SELECTIVE,) * frees_activations(graph) + (RecomputeMode.FULL,)
        return RecomputeChoice(recompute_layers(graph, max_layers), modes, holds)

    def within(self, nodes: frozenset[str]) -> RecomputeChoice | None:
        """Its layers among ``nodes`` (a pipeline stage's layer), or None if none is."""
        layers = tuple(layer for layer in self.layers if layer.nodes[0] in nodes)
        return dataclasses.replace(self, layers=layers) if layers else None

    def units(self, sharing: BlockSharing) -> list[tuple[Layer, ...]]:
        """The layers grouped by their canonical ops: identical layers, in order."""
        found: dict[tuple[str, ...], list[Layer]] = {}
        for layer in self.layers:
            key = tuple(sharing.rep(n) for n in layer.nodes)
            found.setdefault(key, []).append(layer)
        return [tuple(layers) for layers in found.values()]

    def recomputations(
        self,
        problem: IntraOpProblem,
        graph: Graph,
        sharing: BlockSharing,
        space: Mapping[str, NodeStrategies],
        grouping: Grouping,
        pricer: Pricer,
        in_flight: float = 1.0,
    ) -> tuple[Recomputation, ...]:
        """One `Recomputation` (named by its mode) per unit and mode that recomputes
        something, over ``problem``'s groups: their extra time and freed bytes (times
        ``in_flight``) and what one layer holds again (`holds`), priced on the unit's first
        layer."""
        sizes = [len(c) for c in problem.node_costs]
        found = []
        for u, layers in enumerate(self.units(sharing)):
            first, copies = layers[0], len(layers)
            for mode in self.modes:
                ops = recomputed_ops(graph, first, mode)
                if not ops:
                    continue
                again = pricer.recomputing(Recompute.of(graph, [(first.name, ops)], mode))
                time, freed, held = ([[0.0] * k for k in sizes] for _ in range(3))
                for name in ops:
                    node, rep = graph.node(name), sharing.rep(name)
                    g = grouping.group_of[rep]
                    for k, j in enumerate(grouping.pick[rep]):
                        s = space[rep].strategies[j]
                        time[g][k] += (
                            again.node_time(node, s) - pricer.node_time(node, s)
                        ) * copies
                        if again.recompute.drops(name):
                            saved = pricer.activation_memory(node, s)
                            freed[g][k] += saved * copies * in_flight
                            held[g][k] += saved * self.holds
                frozen = (tuple(map(tuple, rows)) for rows in (time, freed, held))
                found.append(Recomputation(mode, u, copies, *frozen))
        return tuple(found)

    def chosen(
        self, graph: Graph, sharing: BlockSharing, ways: Sequence[Recomputation],
        counts: Sequence[int],
    ) -> Recompute:  # fmt: skip
        """The recomputation of ``counts`` (one per `Recomputation` of ``ways``): in each
        unit, its first layers in the first mode chosen, the next in the next."""
        units = self.units(sharing)
        layers: list[tuple[str, str, tuple[str, ...]]] = []
        taken = [0] * len(units)
        for way, n in zip(ways, counts, strict=True):
            unit = units[way.unit]
            for layer in unit[taken[way.unit] : taken[way.unit] + n]:
                layers.append((layer.name, way.name, recomputed_ops(graph, layer, way.name)))
            taken[way.unit] += n
        order = {layer.name: i for i, layer in enumerate(self.layers)}
        return Recompute.mixed(graph, sorted(layers, key=lambda la: order[la[0]]))
