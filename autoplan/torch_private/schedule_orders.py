"""The orders in which torch's zero-bubble and V-shaped pipeline schedules run their steps on
each rank, read from the schedules themselves without stages or a process group (private:
their ``_calculate_single_rank_operations``; see the package's docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _ComputationType as ComputationType


def zero_bubble_order(
    num_groups: int, virtual_stages: int, num_microbatches: int, group: int
) -> list[tuple[str, int, int]]:
    """The (kind, stage, microbatch) steps ScheduleInterleavedZeroBubble runs on rank ``group``
    of ``num_groups``, each holding ``virtual_stages`` stages, in its order without its idle
    slots: kind "F" (forward), "B" (the input gradients) or "W" (the weight gradients).
    Its constructor needs stages on a process group; the order is its
    ``_calculate_single_rank_operations``, which reads only the fields set here."""
    schedule = object.__new__(ScheduleInterleavedZeroBubble)
    rounds = max(1, num_microbatches // num_groups)
    schedule.pp_group_size = num_groups
    schedule.n_local_stages = virtual_stages
    schedule._n_microbatches = num_microbatches
    schedule.number_of_rounds = rounds
    schedule.microbatches_per_round = num_microbatches // rounds
    return _steps(schedule._calculate_single_rank_operations(group))


def zbv_order(num_groups: int, num_microbatches: int, group: int) -> list[tuple[str, int, int]]:
    """The steps ScheduleZBVZeroBubble runs on rank ``group`` of ``num_groups``, each holding
    two stages in a V (``group`` and ``2 num_groups - 1 - group``), as `zero_bubble_order`
    gives ScheduleInterleavedZeroBubble's; its ``_calculate_single_rank_operations`` reads
    only the fields set here."""
    schedule = object.__new__(ScheduleZBVZeroBubble)
    schedule.pp_group_size = num_groups
    schedule.num_stages = 2 * num_groups
    schedule._n_microbatches = num_microbatches
    return _steps(schedule._calculate_single_rank_operations(group))


def dualpipev_order(
    num_groups: int, num_microbatches: int, group: int
) -> list[tuple[str, int, int]]:
    """The steps ScheduleDualPipeV runs on rank ``group`` of ``num_groups`` (two stages in a
    V, as ZBV's), as `zero_bubble_order` gives ScheduleInterleavedZeroBubble's: a forward
    "overlapped" with another microbatch's backward as the two, one after the other, as its
    runtime runs them, and a whole backward as its B and W at once."""
    schedule = object.__new__(ScheduleDualPipeV)
    schedule.pp_group_size = num_groups
    schedule._n_microbatches = num_microbatches
    return _steps(schedule._calculate_single_rank_operations(group))


def _steps(actions: Sequence[Any]) -> list[tuple[str, int, int]]:
    """torch's actions as (kind, stage, microbatch), its idle slots left out: an overlapped
    forward and backward as its two actions in turn, a whole backward as B then W."""
    kinds = {
        ComputationType.FORWARD: ("F",),
        ComputationType.BACKWARD_INPUT: ("B",),
        ComputationType.BACKWARD_WEIGHT: ("W",),
        ComputationType.FULL_BACKWARD: ("B", "W"),
    }
    found = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type == ComputationType.OVERLAP_F_B:
            found += _steps(action.sub_actions)
        elif action.microbatch_index is not None:
            for kind in kinds[action.computation_type]:
                found.append((kind, action.stage_index, action.microbatch_index))
    return found
