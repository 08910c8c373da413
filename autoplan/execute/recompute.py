"""Activation recomputation in the executor: a plan's recomputed layers
(`autoplan.planfile.sections.RecomputedLayer`) run as regions of the graph under
``torch.utils.checkpoint`` (non-reentrant): their ops' saved tensors are dropped after forward
and made again in backward by running the region once more. The interpreter runs a region
(`autoplan.execute.interpreter.PlanInterpreter._recompute`) from the values it read, with the
random draws it made, so the second run computes the same tensors; its forward collectives are
issued again, as the plan lists them (phase "recompute").
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


@dataclass(frozen=True)
class Region:
    """A contiguous run of one recomputed layer's ops (with their ``getitem`` nodes)."""

    nodes: tuple[torch.fx.Node, ...]
    reads: tuple[str, ...]  # the values it reads from outside it, in order of first read


def with_regions(
    graph: torch.fx.Graph, layer_of: Mapping[str, int]
) -> list[torch.fx.Node | Region]:
    """The graph's nodes in order, each contiguous run of one recomputed layer's ops (their
    names -> the layer, ``layer_of``) replaced by its `Region`."""
    steps: list[torch.fx.Node | Region] = []
    run: list[torch.fx.Node] = []
    current: int | None = None

    def close() -> None:
        if run:
            inside = {n.name for n in run}
            reads = [r.name for n in run for r in n.all_input_nodes if r.name not in inside]
            steps.append(Region(tuple(run), tuple(dict.fromkeys(reads))))
            run.clear()

    for node in graph.nodes:
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
