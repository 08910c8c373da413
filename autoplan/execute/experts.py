"""Expert parallelism on this rank's experts: the grouped matmul of index-routed mixtures of
experts (its rule: `autoplan.strategies.grouped_mm`).

With the experts' weights split along dim 0, a rank holds experts ``first .. first + E/n``.
The rows are sorted by expert and the offsets are the running counts of rows per expert, so
its experts' rows are one range, ``offs[first - 1] .. offs[first + E/n - 1]``: the rank
multiplies that range by its experts (the same grouped matmul, the offsets shifted to the
range) and leaves the other rows zero. Summed over the ranks that is the whole result, the
partial sum the plan reduces. Backward is autograd's through the same ops: each rank's
experts get exactly their rows' gradients, and the rows' gradient is again a partial sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.graph.flops import GROUPED_MMS


def first_experts(
    graph: torch.fx.Graph,
    inputs: Mapping[str, Sequence[Sequence[Placement]]],
    local: Collection[str],
    mesh: DeviceMesh,
) -> dict[str, int]:
    """By grouped matmul run on local shards (``local``) with its experts (input 1) split as
    planned (``inputs``), this rank's first expert. A dim split along several axes is cut
    outer axis first, as DTensor cuts it."""
    coordinate = mesh.get_coordinate()
    found = {}
    for node in graph.nodes:
        if node.name not in local or str(node.target) not in GROUPED_MMS or coordinate is None:
            continue
        placed = inputs[node.name][1]
        axes = [a for a, p in enumerate(placed) if isinstance(p, Shard) and p.dim == 0]
        if not axes:
            continue
        index = 0
        for a in axes:
            index = index * mesh.size(a) + coordinate[a]
        experts = node.args[1].meta["val"].shape[0]
        found[node.name] = index * (experts // math.prod(mesh.size(a) for a in axes))
    return found


def local_grouped_mm(
    op: Callable[..., torch.Tensor], args: Sequence[Any], kwargs: dict[str, Any], first: int
) -> torch.Tensor:
    """A grouped matmul ``op`` of the rows routed to this rank's experts (``first`` on, as
    many as its weights hold), the other rows zero: a partial sum over the ranks."""
    x, weight, *rest = args
    named = dict(kwargs)
    offs = rest.pop(0) if rest else named.pop("offs")
    ends = offs[first : first + weight.shape[0]]
    start = int(offs[first - 1]) if first else 0
    stop = int(ends[-1])
    mine = op(x[start:stop], weight, *rest, offs=ends - start, **named)
    return F.pad(mine, (0, 0, start, x.shape[0] - stop))
