"""Activation recomputation in the executor: a plan's recomputed layers
(`autoplan.planfile.sections.RecomputedLayer`) run as regions of the graph under
``torch.utils.checkpoint`` (non-reentrant): their ops' saved tensors are dropped after forward
and made again in backward by running the region once more. The interpreter runs a region
(`autoplan.execute.interpreter.PlanInterpreter._recompute`) from the values it read, with the
random draws it made, so the second run computes the same tensors; its forward collectives are
issued again, as the plan lists them (phase "recompute"). A layer's ops run as one region
where the graph allows (`gathered`): an attention core's mask, made between its scores and its
softmax, runs before it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


@dataclass(frozen=True)
class RecomputedRegion:
    """A contiguous run of one recomputed layer's ops (with their ``getitem`` nodes)."""

    nodes: tuple[torch.fx.Node, ...]
    reads: tuple[str, ...]  # the values it reads from outside it, in order of first read


def gathered(nodes: Sequence[torch.fx.Node], layer_of: Mapping[str, int]) -> list[torch.fx.Node]:
    """``nodes`` (in graph order) with the nodes between a recomputed layer's first op and its
    last (their names -> the layer, ``layer_of``) that read none of its ops, directly or
    through others there, moved ahead of its first op, in order: what is left there (the
    layer's ops, their ``getitem`` nodes) is then one run."""
    last = {layer_of[n.name]: i for i, n in enumerate(nodes) if n.name in layer_of}
    order: list[torch.fx.Node] = []
    i = 0
    while i < len(nodes):
        layer = layer_of.get(nodes[i].name)
        if layer is None:
            order.append(nodes[i])
            i += 1
            continue
        run: list[torch.fx.Node] = []
        after: set[str] = set()  # the layer's ops so far and the nodes that read them
        for node in nodes[i : last[layer] + 1]:
            reads = {r.name for r in node.all_input_nodes}
            if layer_of.get(node.name) == layer or not reads.isdisjoint(after):
                after.add(node.name)
                run.append(node)
            else:
                order.append(node)
        order += run
        i = last[layer] + 1
    return order


def with_regions(
    nodes: Sequence[torch.fx.Node], layer_of: Mapping[str, int]
) -> list[torch.fx.Node | RecomputedRegion]:
    """``nodes`` in order, each contiguous run of one recomputed layer's ops (their names ->
    the layer, ``layer_of``) replaced by its `RecomputedRegion`."""
    steps: list[torch.fx.Node | RecomputedRegion] = []
    run: list[torch.fx.Node] = []
    current: int | None = None

    def close() -> None:
        if run:
            inside = {n.name for n in run}
            reads = [r.name for n in run for r in n.all_input_nodes if r.name not in inside]
            steps.append(RecomputedRegion(tuple(run), tuple(dict.fromkeys(reads))))
            run.clear()

    for node in nodes:
        layer = layer_of.get(node.name)
        if layer is None and node.target is operator.getitem and run:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.name in {n.name for n in run}:
                run.append(node)
                continue
        if layer is None or layer != current:
            close()
            current = layer
        if layer is None:
            steps.append(node)
        else:
            run.append(node)
    close()
    return steps


def checkpointed(body: Callable[[], None]) -> None:
    """Run ``body`` under non-reentrant checkpointing, to be run whole again in backward (not
    stopped early once the tensors backward needs are made: the collectives it issues are
    then those the plan lists)."""
    with set_checkpoint_early_stop(False):
        checkpoint(body, use_reentrant=False)
