"""The schedules in a V, two stages on each device group: ZBV (torch's ScheduleZBVZeroBubble)
and DualPipeV (ScheduleDualPipeV). Their orders, what torch refuses, ZBV's timeline and memory
by hand, the planner choosing ZBV and `autoplan show` drawing it. Training under them:
tests/distributed/cases.py ("gpt-zbv-", "gpt-dualpipev-")."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.errors import AutoplanError
from autoplan.modes import Schedule
from autoplan.planfile.show import summary
from autoplan.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    group_order,
    group_stages,
    peak_in_flight,
    schedule_refusal,
    simulate,
    stage_group,
)
from tests.conftest import example

ZBV = Schedule.ZBV
DUALPIPE_V = Schedule.DUALPIPE_V


def test_the_groups_hold_their_stages_in_a_v() -> None:
    assert [stage_group(ZBV, 8, 2, s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [group_stages(ZBV, 8, 2, g) for g in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # interleaved schedules keep stage s on group s mod p
    assert group_stages(Schedule.ZERO_BUBBLE, 8, 2, 1) == (1, 5)


RUNNABLE = [
    (schedule, p, count)
    for schedule in (ZBV, DUALPIPE_V)
    for p in (2, 3, 4)
    for count in (1, 2, 3, 4, 5, 8, 9, 16)
    if not schedule_refusal(schedule, 2 * p, count, 2)
]


@pytest.mark.parametrize(("schedule", "groups", "count"), RUNNABLE)
def test_every_step_runs_once_and_w_after_its_b(schedule: str, groups: int, count: int) -> None:
    stages = 2 * groups
    for g in range(groups):
        order = group_order(schedule, stages, count, g, 2)
        assert Counter(order) == Counter(
            (kind, s, m) for kind in "FBW" for s in (g, stages - 1 - g) for m in range(count)
        )
        assert all(order.index((BACKWARD, s, m)) < order.index((WEIGHT, s, m)) for _, s, m in order)
    # and the groups never wait on each other for ever
    assert len(simulate(schedule, stages, count, [(1.0, 2.0)] * stages, virtual_stages=2)) == (
        3 * stages * count
    )


def test_what_torch_refuses_is_refused() -> None:
    assert schedule_refusal(ZBV, 4, 1, 2) is None  # any microbatch count
    assert schedule_refusal(ZBV, 8, 7, 2) is None
    assert "exactly 2 stages on each device group" in str(schedule_refusal(ZBV, 6, 4, 3))
    assert "exactly 2 stages" in str(schedule_refusal(ZBV, 4, 4, 1))
    with pytest.raises(AutoplanError, match="exactly 2 stages"):
        PlanOptions(schedule="zbv", virtual_stages=3)
    assert PlanOptions(schedule="zbv", virtual_stages=2).schedules == (ZBV,)
    # DualPipeV: a microbatch a stage or more
    assert "at least as many microbatches as stages" in str(schedule_refusal(DUALPIPE_V, 8, 7, 2))
    assert schedule_refusal(DUALPIPE_V, 8, 8, 2) is None
    with pytest.raises(AutoplanError, match="exactly 2 stages"):
        PlanOptions(schedule="dualpipev", virtual_stages=4)


def test_one_microbatch_down_and_up_the_v() -> None:
    # 2 groups, 4 stages of forward 1, backward 2 (B 1, W 1; the first stage's B none, its W
    # all 2): down the groups 0, 1, 1, 0 (0-4), B back up as each stage's B ends (4-5, 5-6;
    # group 1 runs W of stage 2 (6-7) before B of stage 1 (7-8)), then stage 0's W (8-10)
    events = simulate(ZBV, 4, 1, [(1.0, 2.0)] * 4, virtual_stages=2)
    got = {(e.kind, e.stage): (e.start, e.end) for e in events}
    assert [got[(FORWARD, s)] for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert got[(BACKWARD, 3)] == (4, 5) and got[(WEIGHT, 3)] == (5, 6)
    assert got[(BACKWARD, 2)] == (5, 6) and got[(WEIGHT, 2)] == (6, 7)
    assert got[(BACKWARD, 1)] == (7, 8) and got[(WEIGHT, 1)] == (8, 9)
    assert got[(BACKWARD, 0)] == (8, 8) and got[(WEIGHT, 0)] == (8, 10)
    assert max(e.end for e in events) == 10.0


@pytest.mark.parametrize(("groups", "count"), [(2, 4), (4, 8), (4, 16)])
def test_a_smaller_bubble_than_zero_bubble_on_half_the_groups(groups: int, count: int) -> None:
    # the same work as 2p stages in a V or p stages of twice the time: ZBV's bubble is smaller
    # once there are microbatches enough (2p - 1) to fill the V
    zbv = max(e.end for e in simulate(ZBV, 2 * groups, count, [(1.0, 2.0)] * 2 * groups, None, 2))
    one = max(e.end for e in simulate(Schedule.ZERO_BUBBLE, groups, count, [(2.0, 4.0)] * groups))
    busy = 6.0 * count
    assert busy < zbv < one
    # the bubbles: ZeroBubble's (p - 1) forwards of a stage, ZBV's (p - 1) of half a stage
    assert one - busy == 2 * (groups - 1) and zbv - busy == groups - 1


def test_dualpipev_pairs_a_forward_with_a_whole_backward() -> None:
    # group 0 of 2, 4 microbatches: after its warm-up, the forward of stage 0's microbatch 3
    # runs with the whole backward of stage 3's microbatch 1 (B and W at once), one after the
    # other as torch's runtime runs an overlapped pair
    order = group_order(DUALPIPE_V, 4, 4, 0, 2)
    assert order[:7] == (
        (FORWARD, 0, 0), (FORWARD, 0, 1), (FORWARD, 0, 2),
        (FORWARD, 3, 0), (BACKWARD, 3, 0), (WEIGHT, 3, 0), (FORWARD, 3, 1),
    )  # fmt: skip
    assert order[7:10] == ((FORWARD, 0, 3), (BACKWARD, 3, 1), (WEIGHT, 3, 1))


@pytest.mark.parametrize(("groups", "count"), [(2, 4), (2, 8), (4, 8), (4, 32)])
def test_dualpipev_runs_as_long_as_zbv_holding_one_more_microbatch(groups: int, count: int) -> None:
    # equal stages, its pairs one after the other (the overlap that DualPipe gains on GPUs,
    # communication under computation, is not priced): the step of ZBV, each group holding
    # one stage's microbatch more at its peak
    stages, times = 2 * groups, [(1.0, 2.0)] * 2 * groups

    def step(schedule: str) -> float:
        return max(e.end for e in simulate(schedule, stages, count, times, virtual_stages=2))

    assert step(DUALPIPE_V) == step(ZBV)
    for g in range(groups):
        peaks = [
            peak_in_flight(group_order(s, stages, count, g, 2), lambda _: 1.0)
            for s in (ZBV, DUALPIPE_V)
        ]
        assert peaks == [2 * groups, 2 * groups + 1]


def test_activations_stay_until_w_with_the_output_gradients() -> None:
    # group 0 of 2, 2 microbatches: F0 F1 of stage 0 and F0 of stage 3 in flight (3), and from
    # stage 3's B to its W, its output gradients (0.5)
    order = group_order(ZBV, 4, 2, 0, 2)
    assert order[:5] == (
        (FORWARD, 0, 0),
        (FORWARD, 0, 1),
        (FORWARD, 3, 0),
        (BACKWARD, 3, 0),
        (WEIGHT, 3, 0),
    )
    assert peak_in_flight(order, lambda _: 1.0) == 3.0
    assert peak_in_flight(order, lambda _: 1.0, lambda _: 0.5) == 3.5


def test_the_planner_chooses_zbv_where_fastest(h100_quad_nodes: autoplan.Cluster) -> None:
    # 4 device groups of one GPU, 7 microbatches of a GPT whose compute outweighs its sends:
    # 8 stages in a V beat 4 under ZeroBubble (a smaller bubble) and 8 interleaved (one send
    # fewer, the middle stages sharing their GPU); DualPipeV needs 8 microbatches
    w = example("gpt", size="small", num_layers=8, batch_size=224, device="meta")
    options = PlanOptions(num_stages=4, num_microbatches=7)
    plan = w.plan(h100_quad_nodes, options)
    zb = w.plan(h100_quad_nodes, dataclasses.replace(options, schedule="ZeroBubble"))
    assert plan.pipeline is not None and zb.pipeline is not None
    assert plan.pipeline.schedule == ZBV and plan.virtual_stages == 2
    assert plan.predicted.step_time_s < zb.predicted.step_time_s
    assert plan.pipeline.bubble_fraction < zb.pipeline.bubble_fraction
    assert [st.ranks for st in plan.stages] == [(0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,)]
    # the middle stage's output stays on its GPU: its time has no send, its neighbours' have
    sends = [st.predicted.time_s - st.predicted.forward_s - st.predicted.backward_s
             for st in plan.stages if st.predicted is not None]  # fmt: skip
    assert sends[3] == pytest.approx(0.0, abs=1e-12) and min(sends[:3] + sends[4:7]) > 0
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    shown = summary(plan)
    assert "schedule ZBV" in shown
    assert "(in a V: ranks 0 run stages 0, 7; ranks 1 run stages 1, 6;" in shown
    assert "Fk / Bk / Wk = forward / input / weight gradients" in shown
    assert "  stage 3 -> 4 passes " in shown and " on its own ranks" in shown
    # torch's order on the first group: 7 forwards of stage 0 (2p - 1), then the last stage's
    assert "  stage 0 (ranks 0)  F0 F1 F2 F3 F4 F5 F6  .  ." in shown
    assert "  stage 7 (ranks 0)   .  .  .  .  .  .  . F0 B0 W0 F1 B1 W1 F2 B2 W2" in shown


def test_the_planner_chooses_dualpipev_where_fastest(h100_quad_nodes: autoplan.Cluster) -> None:
    # the same GPT in 8 microbatches: DualPipeV's order, its last stage heavier than the
    # others (the head), ends sooner than ZBV's
    w = example("gpt", size="small", num_layers=8, batch_size=256, device="meta")
    plan = w.plan(h100_quad_nodes, PlanOptions(num_stages=4, num_microbatches=8))
    assert plan.pipeline is not None
    assert plan.pipeline.schedule == DUALPIPE_V and plan.virtual_stages == 2


def test_dualpipev_is_planned_and_shown_when_asked(h100_quad_nodes: autoplan.Cluster) -> None:
    w = example("gpt", size="tiny", num_layers=4, batch_size=8, device="meta")
    options = PlanOptions(num_stages=2, num_microbatches=4, schedule="DualPipeV")
    plan = w.plan(h100_quad_nodes, options)
    assert plan.pipeline is not None and plan.pipeline.schedule == DUALPIPE_V
    assert [st.ranks for st in plan.stages] == [(0, 1), (2, 3), (2, 3), (0, 1)]
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    shown = summary(plan)
    assert "schedule DualPipeV" in shown and "(in a V: ranks 0-1 run stages 0, 3;" in shown
    with pytest.raises(AutoplanError, match="at least as many microbatches as stages"):
        w.plan(h100_quad_nodes, dataclasses.replace(options, num_microbatches=2))
