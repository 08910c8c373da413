"""Activation recomputation in the executor: a plan's recomputed layers
(`autoplan.planfile.sections.RecomputedLayer`) run as regions of the graph under
``torch.utils.checkpoint`` (non-reentrant): their ops' saved tensors are dropped after forward
and made again in backward by running the region once more. The interpreter runs a region
(`autoplan.execute.interpreter.PlanInterpreter._recompute`) from the values it read, with the
random draws it made, so the second run computes the same tensors; its forward collectives are
issued again, as the plan lists them (phase "recompute"). A layer's ops run as one region
where the graph allows (`gathered`): an attention core's mask, made between its scores and its
softmax, runs before it.

A layer recomputed op by op (mode "ops") runs as one region too, under torch's selective
checkpointing (`Selective`): the kernels its saved ops (`RecomputedLayer.saved`) dispatch keep
their outputs from forward, which backward's run takes instead of calling them again; every
other call, collectives included, runs again.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch._functorch.partitioners import get_default_op_list
from torch._ops import OpOverloadPacket
from torch.distributed.tensor.placement_types import Placement
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from autoplan.errors import AutoplanError

aten = torch.ops.aten
# the kernels torchtitan's op-level policy saves (compute-intensive ones, attention, amax,
# topk; `autoplan.graph.saved_ops`), with the CPU's flash attention: a saved op's calls of
# them keep their outputs
SAVED_KERNELS = frozenset(
    {cast(OpOverloadPacket, op).default for op in get_default_op_list().compute_intensive_ops}
    | {
        aten.linear.default,
        aten.max.default,
        aten.topk.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


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


class Selective:
    """Runs recomputed regions under non-reentrant checkpointing; with saved ops (``saved``, by
    name: mode "ops"), under torch's selective checkpointing, whose policy saves a call of a
    kernel of `SAVED_KERNELS` made while a saved op runs and makes every other call again in
    backward."""

    def __init__(self, saved: Collection[str]) -> None:
        self.saved = saved
        self.op: str | None = None  # the saved op running
        self.kept: set[str] = set()  # the saved ops that saved a call

    def forward(self, region: RecomputedRegion, step: Callable[[torch.fx.Node], None]) -> None:
        """Run ``region``'s ops (``step``) in forward; raise unless each saved one saved a
        call, as it is priced (`autoplan.graph.recompute.Recompute.saved`)."""
        for node in region.nodes:
            self.op = node.name if node.name in self.saved else None
            try:
                step(node)
            finally:
                self.op = None
        missed = [n.name for n in region.nodes if n.name in self.saved and n.name not in self.kept]
        if missed:
            raise AutoplanError(
                f'recompute mode "ops": the saved ops {missed} called none of the kernels '
                "that selective checkpointing saves (autoplan.execute.checkpointed)"
            )

    def policy(self, _: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.op is not None and func in SAVED_KERNELS:
            self.kept.add(self.op)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def checkpoint(self, body: Callable[[], None]) -> None:
        """Run ``body`` under non-reentrant checkpointing, to be run again in backward (not
        stopped early once the tensors backward needs are made: the collectives it issues
        are then those the plan lists), selectively where some ops are saved."""
        with set_checkpoint_early_stop(False):
            if not self.saved:
                checkpoint(body, use_reentrant=False)
                return
            contexts = functools.partial(create_selective_checkpoint_contexts, self.policy)
            checkpoint(body, use_reentrant=False, context_fn=contexts)


def gathers_ahead(
    steps: Sequence[torch.fx.Node | RecomputedRegion],
    params: Collection[str],
    reads: Mapping[str, Sequence[str]],
    inputs: Mapping[str, Sequence[tuple[Placement, ...]]],
    stored: Mapping[str, tuple[Placement, ...]],
) -> dict[int, list[tuple[str, tuple[Placement, ...]]]]:
    """Where the interpreter issues each redistribution of a parameter placeholder (``params``)
    read otherwise than ``stored`` (ZeRO-3's gathers), as FSDP2 prefetches: (placeholder,
    placement) once, in the order first read, at its first reader's recomputed region (its
    index in ``steps``; issued again there in backward) or, read first outside any, at -1
    (forward's start: autograd keeps the gathered copies for backward anyway, so the peak
    holds no more). On GPUs they are left in flight, each waited for by the first op that
    reads it, so that they run while forward computes (`autoplan.costmodel.overlap`); CPU
    ranks gather at once (their cores do the copies and sums, so nothing would be hidden,
    and gloo's collectives left in flight beside others aborted a rank,
    `autoplan.execute.runtime.regather`)."""
    ahead: dict[int, list[tuple[str, tuple[Placement, ...]]]] = {}
    seen: set[tuple[str, tuple[Placement, ...]]] = set()
    for at, item in enumerate(steps):
        region = isinstance(item, RecomputedRegion)
        for node in item.nodes if isinstance(item, RecomputedRegion) else (item,):
            placements = inputs.get(node.name, ())
            for read, target in zip(reads.get(node.name, ()), placements, strict=False):
                key = (read, tuple(target))
                if read in params and key not in seen and key[1] != stored.get(read):
                    seen.add(key)
                    ahead.setdefault(at if region else -1, []).append(key)
    return ahead
