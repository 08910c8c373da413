"""Expert parallelism on this rank's experts: the grouped matmul of index-routed mixtures of
experts (its rules: `autoplan.strategies.grouped_mm`, `autoplan.strategies.routing`).

Rows whole (`local_grouped_mm`):

With the experts' weights split along dim 0, a rank holds experts ``first .. first + E/n``.
The rows are sorted by expert and the offsets are the running counts of rows per expert, so
its experts' rows are one range, ``offs[first - 1] .. offs[first + E/n - 1]``: the rank
multiplies that range by its experts (the same grouped matmul, the offsets shifted to the
range) and leaves the other rows zero. Summed over the ranks that is the whole result, the
partial sum the plan reduces. Backward is autograd's through the same ops: each rank's
experts get exactly their rows' gradients, and the rows' gradient is again a partial sum.

Rows routed by each rank (`dispatched_grouped_mm`): a rank holds its own tokens' rows, sorted
by expert, and their offsets (its own counts, `strategies/routing.py`). Its experts' ranks
get them by all-to-all with uneven split sizes, as torchtitan's and DeepSeek's dispatch: the
counts per expert first (one all-to-all of ``E`` counts), then the rows; each rank multiplies
the rows it got by its experts (regrouped by expert: they come by source rank) and sends the
products back by the reverse all-to-all, where they land in the order they left. Backward is
autograd's through both all-to-alls: the gradients travel the reverse way.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.graph.flops import GROUPED_MMS
from autoplan.strategies.routing import Region, RegionOp, keeps_rows, region
from autoplan.torch_private import functional_all_to_all, functional_all_to_all_autograd


def routed_region(graph: torch.fx.Graph) -> Region:
    """`autoplan.strategies.routing.region` of a traced graph, a multi-output op's outputs
    (``getitem``) read as the op, as the planner's graph reads them."""
    source: dict[str, str] = {}
    ops: list[RegionOp] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        reads = [n for n in node.all_input_nodes]
        if node.target is operator.getitem:
            source[node.name] = source.get(reads[0].name, reads[0].name)
            continue
        tensors = _tensor_reads(node)
        names = [source.get(n.name, n.name) for n in tensors]
        shapes = [getattr(n.meta.get("val"), "shape", ()) for n in (*tensors[:1], node)]
        rows_kept = len(tensors) > 0 and keeps_rows(str(node.target), *shapes)
        ops.append(RegionOp(node.name, str(node.target), tuple(names), rows_kept))
    return region(ops)


def _tensor_reads(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


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
        x, placed = inputs[node.name][0], inputs[node.name][1]
        axes = [a for a, p in enumerate(placed) if _splits_rows(p) and not _splits_rows(x[a])]
        if not axes:
            continue
        index = 0
        for a in axes:
            index = index * mesh.size(a) + coordinate[a]
        experts = node.args[1].meta["val"].shape[0]
        found[node.name] = index * (experts // math.prod(mesh.size(a) for a in axes))
    return found


def dispatch_axes(
    graph: torch.fx.Graph,
    inputs: Mapping[str, Sequence[Sequence[Placement]]],
    local: Collection[str],
) -> dict[str, int]:
    """By grouped matmul run on local shards with its rows and experts split along the same
    mesh axis (`strategies/routing.py`), that axis: its rows go to their experts by
    all-to-all (`dispatched_grouped_mm`)."""
    found = {}
    for node in graph.nodes:
        if node.name in local and str(node.target) in GROUPED_MMS:
            x, w = inputs[node.name][0], inputs[node.name][1]
            axes = [a for a in range(len(x)) if _splits_rows(x[a]) and _splits_rows(w[a])]
            assert len(axes) <= 1, f"{node.name}: rows sent to their experts along {axes}"
            if axes:
                found[node.name] = axes[0]
    return found


def _splits_rows(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0


def dispatched_grouped_mm(
    op: Callable[..., torch.Tensor],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """A grouped matmul ``op`` of this rank's rows (sorted by expert, ``offs`` its own
    offsets), each row multiplied on the rank of ``group`` that holds its expert (the
    ranks' experts in rank order, as many each as this rank's weights hold) and sent back."""
    x, weight, *rest = args
    named = dict(kwargs)
    offs = rest.pop(0) if rest else named.pop("offs")
    num_ranks = group.size()
    counts = torch.diff(offs, prepend=offs.new_zeros(1))  # this rank's rows per expert
    each = [counts.numel() // num_ranks] * num_ranks  # split sizes given: routed (comms.py)
    got = functional_all_to_all(counts, each, each, group).view(num_ranks, -1)
    sent = counts.view(num_ranks, -1).sum(1).tolist()  # rows to each rank
    # the offsets count this rank's own rows (`strategies/routing.py`), all of them
    assert sum(sent) == x.shape[0], f"offsets count {sum(sent)} rows of {x.shape[0]}"
    received = got.sum(1).tolist()  # rows from each rank
    rows = functional_all_to_all_autograd(x, received, sent, group)
    order = by_expert(got)
    ends = got.sum(0).cumsum(0).to(offs.dtype)
    out = op(rows[order], weight, *rest, offs=ends, **named)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return functional_all_to_all_autograd(out[back], sent, received, group)


def by_expert(got: torch.Tensor) -> torch.Tensor:
    """The rows received (``got[s, j]`` from rank ``s`` for this rank's expert ``j``, in
    blocks by source then expert) in the order of their experts, each expert's by source."""
    flat = got.flatten()
    starts = (flat.cumsum(0) - flat).view_as(got).t().flatten()  # blocks by expert, source
    sizes = got.t().flatten()
    first = sizes.cumsum(0) - sizes  # where each block lands, grouped by expert
    total = int(sizes.sum())
    within = torch.arange(total, device=got.device) - first.repeat_interleave(sizes, 0)
    return starts.repeat_interleave(sizes, 0) + within


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
