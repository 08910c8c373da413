"""ZeroBubble (torch's ScheduleInterleavedZeroBubble): its order, what torch refuses, its
price beside 1F1B's, the planner choosing it and `autoplan show` drawing it. Training under
it: tests/distributed/cases.py ("gpt-zb-")."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import autoplan
from autoplan import PlanOptions
from autoplan.modes import Schedule
from autoplan.planfile.show import summary
from autoplan.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    group_order,
    peak_in_flight,
    schedule_refusal,
    simulate,
)
from autoplan.solvers.stage_problem import pipeline_time
from tests.conftest import example

ZB = Schedule.ZERO_BUBBLE
RUNNABLE = [
    (p, v, count)
    for p in (2, 3, 4)
    for v in (1, 2)
    for count in range(1, 10)
    if not schedule_refusal(ZB, p * v, count, v)
]


@pytest.mark.parametrize(("groups", "v", "count"), RUNNABLE)
def test_every_step_runs_once_and_w_after_its_b(groups: int, v: int, count: int) -> None:
    stages = groups * v
    for g in range(groups):
        order = group_order(ZB, stages, count, g, v)
        assert Counter(order) == Counter(
            (kind, s, m) for kind in "FBW" for s in range(g, stages, groups) for m in range(count)
        )
        assert all(order.index((BACKWARD, s, m)) < order.index((WEIGHT, s, m)) for _, s, m in order)
    # and the groups never wait on each other for ever
    assert len(simulate(ZB, stages, count, [(1.0, 2.0)] * stages, virtual_stages=v)) == (
        3 * stages * count
    )


def test_the_last_stage_puts_its_weight_gradients_off() -> None:
    # 4 stages, 4 microbatches: the last stage sends every input gradient first
    order = group_order(ZB, 4, 4, 3)
    kinds = [kind for kind, _, _ in order]
    assert kinds == [FORWARD, BACKWARD] * 4 + [WEIGHT] * 4


def test_what_torch_refuses_is_refused() -> None:
    assert schedule_refusal(ZB, 2, 7) is not None  # 7 microbatches: rounds of 3 on 2 groups
    assert schedule_refusal(ZB, 4, 2) is None  # fewer microbatches than stages: torch runs it
    assert schedule_refusal(ZB, 4, 4, 2) is None
    assert "dividing the 4 stages" in str(schedule_refusal(ZB, 4, 4, 3))
    assert "or ZeroBubble for more" in str(schedule_refusal("1F1B", 4, 4, 2))


@pytest.mark.parametrize(("stages", "count"), [(4, 4), (4, 8), (8, 8)])
def test_a_smaller_bubble_than_1f1b(stages: int, count: int) -> None:
    # forward 1, backward 2 (input gradients 1, weight gradients 1)
    times = [(1.0, 2.0)] * stages
    one_f_one_b = max(e.end for e in simulate("1F1B", stages, count, times))
    assert one_f_one_b == pytest.approx(pipeline_time([3.0] * stages, count))
    zero_bubble = max(e.end for e in simulate(ZB, stages, count, times))
    busy = 3.0 * count
    assert busy < zero_bubble < one_f_one_b
    # the bubble: 1F1B's (S - 1) stage times, ZeroBubble's at most (S - 1) (F + B)
    assert zero_bubble - busy <= (stages - 1) * 2.0 < one_f_one_b - busy


def test_the_first_stage_runs_its_whole_backward_at_w() -> None:
    events = simulate(ZB, 2, 2, [(1.0, 2.0), (1.0, 2.0)], weight_shares=[0.25, 0.25])
    first = {(e.kind, e.microbatch): e.end - e.start for e in events if e.stage == 0}
    last = {(e.kind, e.microbatch): e.end - e.start for e in events if e.stage == 1}
    assert first[(BACKWARD, 0)] == 0.0 and first[(WEIGHT, 0)] == 2.0
    assert last[(BACKWARD, 0)] == 1.5 and last[(WEIGHT, 0)] == 0.5


def test_activations_stay_until_w_with_the_output_gradients() -> None:
    # the last of 4 stages: 1F1B holds one microbatch; ZeroBubble all 4 until its W steps,
    # and from each B the output gradients its W reads
    assert peak_in_flight(group_order("1F1B", 4, 4, 3), lambda _: 1.0) == 1.0
    order = group_order(ZB, 4, 4, 3)
    assert peak_in_flight(order, lambda _: 1.0) == 4.0
    assert peak_in_flight(order, lambda _: 1.0, lambda _: 0.5) == 6.0


def test_the_planner_chooses_zero_bubble_where_fastest(h100_quad_nodes: autoplan.Cluster) -> None:
    # 4 stages of one GPU, 4 microbatches: 1F1B idles half the step
    w = example("gpt", size="tiny", num_layers=4, batch_size=8, device="meta")
    options = PlanOptions(num_stages=4, num_microbatches=4)
    one = w.plan(h100_quad_nodes, dataclasses.replace(options, schedule="1F1B"))
    plan = w.plan(h100_quad_nodes, options)
    assert one.pipeline is not None and plan.pipeline is not None
    assert plan.pipeline.schedule == ZB and plan.virtual_stages == 1
    assert plan.predicted.step_time_s < one.predicted.step_time_s
    assert plan.pipeline.bubble_fraction < one.pipeline.bubble_fraction
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    shown = summary(plan)
    assert "schedule ZeroBubble" in shown
    assert "Fk / Bk / Wk = forward / input / weight gradients" in shown
    assert "  stage 3 (ranks 3)   .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3" in shown


def test_virtual_stages_keep_zero_bubble(h100_quad_nodes: autoplan.Cluster) -> None:
    options = PlanOptions(schedule="zerobubble", virtual_stages=2)
    assert options.schedules == (ZB,) and options.virtual_stages == 2
    # and the plan keeps them, though a conventional plan of one stage a group is faster
    w = example("gpt", size="small", num_layers=8, batch_size=16, device="meta")
    forced = dataclasses.replace(options, num_stages=4, num_microbatches=4)
    plan = w.plan(h100_quad_nodes, forced)
    assert plan.pipeline is not None and plan.pipeline.schedule == ZB
    assert plan.virtual_stages == 2 and len(plan.stages) == 8


def test_a_stage_sends_no_view_so_the_split_backward_can_detach_it() -> None:
    """Swin's stage output is a reshape of its windows: torch's split backward
    (`stage_backward_input`) detaches a stage's outputs in place, which a view refuses."""
    from autoplan.torch_private import pipeline_sent

    x = torch.randn(4, 6, requires_grad=True)
    sent = pipeline_sent((x * 2).view(2, 12))
    assert not sent._is_view() and sent.is_contiguous()
    sent.sum().backward()  # the gradient still reaches the stage's inputs
    assert x.grad is not None and torch.equal(x.grad, torch.full((4, 6), 2.0))
    sent.detach_()  # what the split backward does next
