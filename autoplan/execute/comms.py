"""Record the collectives a step really issues, to compare with the plan's list."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoplan.graph.flops import GROUPED_MMS
from autoplan.planfile.schema import CollectivePlan, Plan
from autoplan.planfile.sections import ONCE_PER_STEP
from autoplan.torch_private import (
    C10D_ALL_REDUCE,
    FUNCTIONAL_COLLECTIVES,
    TorchDispatchMode,
    resolve_process_group,
    unbox_process_group,
)

_functional = FUNCTIONAL_COLLECTIVES
# functional collective -> (our kind, index of its group-name argument)
_KINDS = {
    _functional.all_reduce.default: ("all_reduce", 2),
    _functional.all_gather_into_tensor.default: ("all_gather", 2),
    _functional.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    _functional.all_to_all_single.default: ("all_to_all", 3),
}


# the bytes a fidelity check counts for an all-to-all of routed rows (a grouped matmul's
# dispatch, `execute/experts.py`): how many rows each rank sends depends on the routing, so
# those are compared by kind, axes and number, the plan pricing their balanced expectation
ROUTED = -1


@dataclass(frozen=True)
class Issued:
    kind: str
    axes: tuple[str, ...]  # the group's mesh axes, as the plan names them
    bytes: int  # as the plan counts them: all_gather its output, the others their input
    op: str  # the DTensor op (or redistribute) that issued it, for reports
    routed: int = 0  # of an all-to-all of routed rows (`bytes` ROUTED): its input's bytes


class CollectiveRecorder(TorchDispatchMode):
    """A dispatch mode that notes every functional collective DTensor issues on ``mesh``, and
    the in-place all-reduces of gradient buckets."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        names = mesh.mesh_dim_names or ()
        # by the ranks of the group, not its name: DTensor may run an op on another mesh equal
        # to this one (its caches compare meshes by value), whose groups have other names; a
        # bucket's group may span several axes (their flattened group)
        self.axes_of: dict[tuple[int, ...], tuple[str, ...]] = {
            tuple(sorted(mesh[axes].mesh.flatten().tolist())): axes
            for n in range(len(names), 0, -1)
            for axes in itertools.combinations(names, n)
        }
        self.issued: list[Issued] = []
        self._op = "redistribute"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor run first and lower the op to local ops and collectives, which then
            # come back through this mode (as CommDebugMode does)
            self._op = str(func)
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func is C10D_ALL_REDUCE:  # a gradient bucket's (execute/gradients.py)
            (flat,) = args[0]
            group = unbox_process_group(args[1])
            self._note("all_reduce", group, flat.numel() * flat.element_size(), "bucket")
        elif func in _KINDS:
            kind, group_arg = _KINDS[func]
            tensor: torch.Tensor = args[0]
            nbytes = tensor.numel() * tensor.element_size()
            if kind == "all_gather":
                nbytes *= int(args[1])
            routed = kind == "all_to_all" and args[1] is not None
            if routed:  # split sizes of its own: the routing's (execute/experts.py)
                nbytes, routed_bytes = ROUTED, nbytes
            group = resolve_process_group(args[group_arg])
            self._note(kind, group, nbytes, self._op, routed_bytes if routed else 0)
            self._op = "redistribute"
        return out

    def _note(
        self, kind: str, group: dist.ProcessGroup, nbytes: int, op: str, routed: int = 0
    ) -> None:
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        axes = self.axes_of.get(ranks, (f"ranks {list(ranks)}",))
        self.issued.append(Issued(kind, axes, nbytes, op, routed))


def planned(plan: Plan) -> Counter[tuple[str, tuple[str, ...], int]]:
    """What one step of ``plan`` issues on this rank's stages (several, interleaved): forward
    and backward collectives once per microbatch, gradient synchronization and ZeRO's gathers
    after the update once."""
    counts: Counter[tuple[str, tuple[str, ...], int]] = Counter()
    for c, times in _mine(plan):
        counts[(c.kind, c.axes, ROUTED if _routed(plan, c) else c.bytes)] += times
    return counts


def planned_routed_bytes(plan: Plan) -> int:
    """The bytes of the all-to-alls of routed rows one step of ``plan`` issues on this rank,
    as priced: each rank sending its own rows. Summed over the ranks, exactly what they
    send (every row leaves once and comes back once), however the routing spreads them."""
    return sum(c.bytes * times for c, times in _mine(plan) if _routed(plan, c))


def _mine(plan: Plan) -> list[tuple[CollectivePlan, int]]:
    """This rank's stages' collectives, each with how often a step issues it."""
    rank = dist.get_rank()
    mine = {s for s, stage in enumerate(plan.stages) if rank in stage.ranks}
    times = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    return [
        (c, 1 if c.phase in ONCE_PER_STEP else times) for c in plan.collectives if c.stage in mine
    ]


def _routed(plan: Plan, c: CollectivePlan) -> bool:
    node = plan.nodes.get(c.node)
    return c.kind == "all_to_all" and node is not None and node.op in GROUPED_MMS


def issued(records: Iterable[Issued]) -> Counter[tuple[str, tuple[str, ...], int]]:
    return Counter((r.kind, r.axes, r.bytes) for r in records)


def issued_routed_bytes(records: Iterable[Issued]) -> int:
    """The bytes this rank's all-to-alls of routed rows sent (`planned_routed_bytes`)."""
    return sum(r.routed for r in records)
