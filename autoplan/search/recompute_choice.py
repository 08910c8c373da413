"""How many layers a one-stage plan recomputes: the fewest that fit.

The ILP plans the step with every layer recomputed (`autoplan.graph.recompute`); its strategies
are then priced again (`price_step`) with only the first ``k`` layers recomputed, for the least
``k`` at which the step fits. Memory only falls as ``k`` grows (a layer recomputed gives up its
activations but the largest recomputed layer's, which the step still holds once), so ``k`` is
found by bisection; each layer left alone saves its forward's time in backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autoplan.graph.cut import Layer
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import FULL, Recompute, recomputed_ops
from autoplan.search.step_price import PricedStep


def fewest_layers(
    graph: Graph,
    layers: Sequence[Layer],
    price: Callable[[Recompute], PricedStep],
    memory_limit: float,
    mode: str = FULL,
) -> tuple[Recompute, PricedStep] | None:
    """The first ``k`` of ``layers`` recomputed in ``mode``, for the least ``k`` whose step
    (``price``) fits in ``memory_limit``, with that step; None if not even every layer
    recomputed fits."""
    ops = [(layer.name, recomputed_ops(graph, layer, mode)) for layer in layers]
    every = Recompute.of(graph, ops, mode)
    best = (every, price(every))
    if best[1].memory_bytes > memory_limit:
        return None
    low, high = 0, len(ops)  # high fits
    while low < high:
        middle = (low + high) // 2
        recompute = Recompute.of(graph, ops[:middle], mode)
        step = price(recompute)
        if step.memory_bytes <= memory_limit:
            high, best = middle, (recompute, step)
        else:
            low = middle + 1
    return best
