"""Interleaved 1F1B (virtual stages): torch's order, its price, the planner weighing it, the
plan format, the baseline and the command line. Training under it: tests/distributed/cases.py
("interleaved")."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

import autoplan
from autoplan import PlanOptions
from autoplan.cli.main import main
from autoplan.errors import AutoplanError, PlanFormatError
from autoplan.modes import Schedule
from autoplan.planfile.show import summary
from autoplan.schedules import (
    FORWARD,
    MULTI_STAGE,
    group_order,
    peak_in_flight,
    schedule_refusal,
    simulate,
    stage_order,
)
from autoplan.solvers.stage_problem import interleaved_time, pipeline_time
from tests.conftest import example

RUNNABLE = [
    (p, v, count)
    for p in (2, 3, 4)
    for v in (2, 3)
    for count in range(1, 13)
    if not schedule_refusal(Schedule.INTERLEAVED, p * v, count, v)
]


def _torch_order(groups: int, v: int, count: int, group: int) -> tuple[Any, ...]:
    """The steps torch's ScheduleInterleaved1F1B runs on ``group``, idle slots left out."""
    schedule = object.__new__(ScheduleInterleaved1F1B)  # its order needs no stages or ranks
    schedule.n_local_stages, schedule.pp_group_size = v, groups
    schedule._n_microbatches = count
    schedule.number_of_rounds = max(1, count // groups)
    schedule.microbatches_per_round = count // schedule.number_of_rounds
    actions = schedule._calculate_single_rank_operations(group)
    forward = _ComputationType.FORWARD
    return tuple(
        ("F" if a.computation_type == forward else "B", a.stage_index, a.microbatch_index)
        for a in actions
        if a is not None
    )


@pytest.mark.parametrize(("groups", "v", "count"), RUNNABLE)
def test_each_group_runs_torchs_order(groups: int, v: int, count: int) -> None:
    for g in range(groups):
        assert group_order(Schedule.INTERLEAVED, groups * v, count, g, v) == _torch_order(
            groups, v, count, g
        )


def test_what_torch_refuses_is_refused() -> None:
    assert schedule_refusal(Schedule.INTERLEAVED, 4, 7, 2) is not None  # 3 rounds of 2 groups
    assert schedule_refusal(Schedule.INTERLEAVED, 4, 6, 2) is None
    assert schedule_refusal(Schedule.INTERLEAVED, 8, 3, 2) is None  # fewer microbatches than groups
    assert "2 or more stages on each device group" in str(
        schedule_refusal(Schedule.INTERLEAVED, 4, 4)
    )
    assert "use Interleaved1F1B" in str(schedule_refusal("1F1B", 4, 4, 2))


@pytest.mark.parametrize(("groups", "v", "count"), [(2, 2, 4), (4, 2, 8), (2, 3, 6), (3, 2, 3)])
def test_equal_stages_take_the_priced_time_with_a_smaller_bubble(
    groups: int, v: int, count: int
) -> None:
    chunk = 3.0  # forward 1, backward 2
    stages = groups * v
    events = simulate(Schedule.INTERLEAVED, stages, count, [(1.0, 2.0)] * stages, virtual_stages=v)
    span = max(e.end for e in events)
    assert span == pytest.approx(interleaved_time([chunk] * stages, count, v))
    assert span == pytest.approx((count * v + groups - 1) * chunk)
    # the same layers as 1F1B stages of v chunks each: the bubble is v times longer
    one_f_one_b = pipeline_time([v * chunk] * groups, count)
    assert one_f_one_b - count * v * chunk == pytest.approx(v * (span - count * v * chunk))
    # one step at a time on each device group
    for g in range(groups):
        mine = sorted((e for e in events if e.stage % groups == g), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(mine))


def test_one_stage_a_group_is_1f1b() -> None:
    times = [1.0, 3.0, 2.0]
    assert interleaved_time(times, 5, 1) == pipeline_time(times, 5)
    for s in range(3):
        order = group_order("1F1B", 3, 5, s)
        assert [(k, m) for k, _, m in order] == list(stage_order("1F1B", 3, 5, s))
        assert peak_in_flight(order, lambda _: 1.0) == min(3 - s, 5)


def test_interleaving_holds_more_activations() -> None:
    # group 0 of 2, 2 stages each, 4 microbatches: a round of 2 through stage 0, then
    # stage 2's and 2 more forwards before its first backward
    order = group_order(Schedule.INTERLEAVED, 4, 4, 0, 2)
    assert peak_in_flight(order, lambda _: 1.0) == 5 > 2
    assert order[0] == (FORWARD, 0, 0)


@pytest.fixture(scope="module")
def gpt_across_nodes() -> tuple[autoplan.Workload, autoplan.Cluster]:
    cluster = autoplan.Cluster.load("costmodels/dgx-a100-80gb.json", num_nodes=2)
    return example("gpt", size="1.3b", num_layers=8, batch_size=16, device="meta"), cluster


@pytest.mark.slow
def test_the_planner_interleaves_where_that_is_faster(
    gpt_across_nodes: tuple[autoplan.Workload, autoplan.Cluster],
) -> None:
    # 2 stages of a node each and 2 microbatches: 1F1B idles a third of the step; 8 blocks
    # allow 2 or 4 stages on each node
    w, cluster = gpt_across_nodes
    options = PlanOptions(num_stages=2, num_microbatches=2)
    one = w.plan(cluster, dataclasses.replace(options, schedule="1F1B"))
    plan = w.plan(cluster, options)
    assert one.pipeline is not None and plan.pipeline is not None
    # Interleaved1F1B, or ZeroBubble as interleaved, its weight gradients in the bubble
    assert plan.pipeline.schedule in MULTI_STAGE and plan.virtual_stages in (2, 4)
    assert plan.pipeline.bubble_fraction < one.pipeline.bubble_fraction
    assert plan.predicted.step_time_s < one.predicted.step_time_s
    # stage s on node s mod 2, all of it
    assert plan.mesh.shape == (2, 8) and len(plan.stages) == 2 * plan.virtual_stages
    assert [s.ranks for s in plan.stages] == [tuple(range(8)), tuple(range(8, 16))] * (
        plan.virtual_stages
    )
    # (more microbatches in flight: test_interleaving_holds_more_activations; the two plans' peaks
    # are not comparable, each splitting optimizer state as its own memory suggests)
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    again = autoplan.estimate(
        plan, cluster, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
    )
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert again.pipeline == plan.pipeline
    shown = summary(plan)
    assert f"on 2 device groups, {plan.virtual_stages} each" in shown
    assert "ranks 0-7 run stages 0, 2" in shown and "rank r to rank r-8" in shown


def test_the_baseline_interleaves_as_megatron(
    gpt_across_nodes: tuple[autoplan.Workload, autoplan.Cluster],
) -> None:
    w, cluster = gpt_across_nodes
    options = PlanOptions(num_microbatches=2)
    one = w.baseline(cluster, dp=1, tp=8, pp=2, options=options)
    plan = w.baseline(cluster, dp=1, tp=8, pp=2, virtual_stages=2, options=options)
    assert plan.pipeline is not None and one.pipeline is not None
    assert plan.pipeline.schedule == Schedule.INTERLEAVED and plan.virtual_stages == 2
    assert [s.layers for s in plan.stages] == [
        (f"blocks.{2 * s}", f"blocks.{2 * s + 1}") for s in range(4)
    ]
    assert plan.pipeline.bubble_fraction < one.pipeline.bubble_fraction
    with pytest.raises(AutoplanError, match="virtual_stages=2 applies to pipelines"):
        w.baseline(cluster, dp=2, tp=8, virtual_stages=2)
    with pytest.raises(AutoplanError, match="use Interleaved1F1B"):
        w.baseline(
            cluster, dp=1, tp=8, pp=2, virtual_stages=2, options=PlanOptions(schedule="1F1B")
        )


def _tiny_plan(cpu4: autoplan.Cluster) -> autoplan.Plan:
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    options = PlanOptions(num_stages=2, num_microbatches=2, virtual_stages=2, mesh_shape=(2,))
    return w.plan(cpu4, options)


def test_interleaved_plans_are_checked_on_load(cpu4: autoplan.Cluster) -> None:
    plan = _tiny_plan(cpu4)
    assert plan.virtual_stages == 2 and plan.mesh.shape == (2, 2)
    doc = json.loads(plan.to_json())
    assert "virtual_stages" not in doc["pipeline"]  # the stages and the mesh say it
    bad: dict[str, Any] = json.loads(json.dumps(doc))
    bad["pipeline"]["schedule"] = "1F1B"  # 4 stages on a pp axis of 2
    with pytest.raises(PlanFormatError, match="one stage per index of the mesh's pp axis"):
        autoplan.Plan.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(doc))
    bad["pipeline"]["num_microbatches"] = 3  # 1 round, fine; 5 on 2 groups: 2 rounds, not
    assert autoplan.Plan.from_json(json.dumps(bad)).pipeline is not None
    bad["pipeline"]["num_microbatches"] = 5
    with pytest.raises(PlanFormatError, match="must be a multiple of max"):
        autoplan.Plan.from_json(json.dumps(bad))


def test_a_stage_on_another_group_is_refused(cpu4: autoplan.Cluster) -> None:
    plan = _tiny_plan(cpu4)
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    stages = list(plan.stages)
    stages[2] = dataclasses.replace(stages[2], ranks=(2, 3))  # stage 2 belongs on row 0
    with pytest.raises(PlanFormatError, match=r"stage 2 runs on row 0 of the mesh: \[0, 1\]"):
        autoplan.estimate(
            dataclasses.replace(plan, stages=tuple(stages)),
            cpu4,
            w.model,
            w.example_inputs,
            loss_fn=w.loss_fn,
            example_target=w.example_target,
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"virtual_stages": 1}, "give 2 or more"),
        ({"virtual_stages": 2, "schedule": "GPipe"}, "schedule='GPipe'"),
    ],
)
def test_bad_virtual_stages_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(AutoplanError, match=message):
        PlanOptions(**fields)


def test_virtual_stages_imply_the_schedule() -> None:
    assert PlanOptions(virtual_stages=3).schedule == Schedule.INTERLEAVED
    assert PlanOptions(schedule="interleaved1f1b").schedules == (Schedule.INTERLEAVED,)


def test_the_command_line_interleaves(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    args = ["-q", "plan", "examples/gpt.py", "--cluster", "costmodels/cpu-gloo-4.json"]
    args += ["-o", str(out), "--stages", "2", "--microbatches", "2", "--mesh", "2"]
    args += ["--schedule", "interleaved1f1b", "--virtual-stages", "2"]
    args += ["--set", "size=tiny", "--set", "num_layers=4", "--set", "batch_size=8"]
    assert main(args) == 0
    plan = autoplan.Plan.from_json(str(out))
    assert plan.pipeline is not None and plan.pipeline.schedule == Schedule.INTERLEAVED
    assert plan.virtual_stages == 2
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "schedule Interleaved1F1B" in capsys.readouterr().out
