"""FlexAttention on this rank's shards: torch's operator (`autoplan.torch_private.flex_op`) on
the local queries, keys and values, split by batch or heads as planned
(`autoplan.strategies.attention`), its ``score_mod`` and ``mask_mod`` given the batch and
head indices the local scores have in one process, so that what they compute from them is
one process's."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.planfile.schema import Plan
from autoplan.strategies.attention import flex_offsets
from autoplan.torch_private.flex_op import FLEX_ATTENTION


def flex_starts(
    graph: torch.fx.Graph, plan: Plan, local: Collection[str], mesh: DeviceMesh
) -> dict[str, tuple[int, int]]:
    """By FlexAttention run on local shards split by batch or heads (the ``local`` ops of a
    stage on ``mesh``), the batch and head index of this rank's first query."""
    axes, coordinate = plan.stage_axes, mesh.get_coordinate()
    found = {}
    for node in graph.nodes:
        if node.name not in local or node.target is not FLEX_ATTENTION or coordinate is None:
            continue
        inputs = [tuple(p[a] for a in axes) for p in plan.nodes[node.name].inputs]
        q_shape = tuple(node.args[0].meta["val"].shape)
        starts = flex_offsets(inputs, q_shape, coordinate, mesh.shape)
        if starts != (0, 0):
            found[node.name] = starts
    return found


def _shifted(fn: Callable[..., Any], start: tuple[int, int], leading: int) -> Callable[..., Any]:
    """``fn`` (score_mod: ``leading`` 1, the score first; mask_mod: 0) given the batch and
    head indices plus ``start``."""
    batch, head = start

    def shifted(*args: Any) -> Any:
        b, h = args[leading], args[leading + 1]
        return fn(*args[:leading], b + batch, h + head, *args[leading + 2 :])

    return shifted


def local_flex_attention(args: tuple[Any, ...], start: tuple[int, int] | None) -> Any:
    """The traced FlexAttention call on local tensors (``args`` as traced), its functions
    given one process's indices where this rank's block starts at ``start``."""
    q, k, v, score_mod, block_mask, *rest = args
    if start is not None:
        score_mod = _shifted(score_mod, start, 1)
        block_mask = (*block_mask[:-1], _shifted(block_mask[-1], start, 0))
    return FLEX_ATTENTION(q, k, v, score_mod, block_mask, *rest)
