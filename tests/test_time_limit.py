"""A time limit never loses a plan: a mesh whose ILP finds no plan within it is skipped, one
stopped with a plan keeps it, the search goes on, and the plan says which parts were not
proven optimal (issue 34)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pulp
import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.errors import SolverTimeLimitError
from autoplan.planfile.sections import SKIPPED, STOPPED, Unproven
from autoplan.planfile.show import summary
from autoplan.search import intra_op
from autoplan.workload import Workload
from tests.conftest import example
from tests.test_ilp import _stopped_at_first_plan

ONE_STAGE = PlanOptions(pipeline=False)


@pytest.fixture(scope="module")
def mlp() -> Workload:
    # on cpu4 the candidate meshes are (4,) and (2, 2); at these sizes (2, 2) is the faster
    return example("mlp", batch_size=512, hidden=512)


@pytest.fixture(scope="module")
def proven(mlp: Workload, cpu4: autoplan.Cluster) -> autoplan.Plan:
    return mlp.plan(cpu4, ONE_STAGE)


def _cut_short_on(mesh: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """The ILP of ``mesh`` given a nanosecond: HiGHS stops with no plan (tests/test_ilp.py)."""
    solve = intra_op.solve_problem

    def cut(*args: Any, **kwargs: Any) -> intra_op.IntraOpResult:
        if args[5] == mesh:
            return solve(*args[:6], 1e-9)
        return solve(*args, **kwargs)

    monkeypatch.setattr(intra_op, "solve_problem", cut)


def test_a_plan_proven_optimal_has_no_unproven_field(proven: autoplan.Plan) -> None:
    assert proven.mesh.shape == (2, 2) and proven.solver.status == "optimal"
    assert proven.solver.unproven == ()
    assert "unproven" not in json.loads(proven.to_json())["solver"]
    assert "not proven optimal" not in summary(proven)


def test_a_mesh_without_a_plan_in_time_is_skipped_and_the_others_searched(
    mlp: Workload,
    cpu4: autoplan.Cluster,
    proven: autoplan.Plan,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _cut_short_on((4,), monkeypatch)
    with caplog.at_level(logging.WARNING, logger=autoplan.api.__name__):
        plan = mlp.plan(cpu4, ONE_STAGE)
    # the first mesh's ILP found nothing: the search went on to the next, and kept its plan
    assert plan.mesh == proven.mesh and plan.nodes == proven.nodes
    assert plan.solver.meshes_tried == proven.solver.meshes_tried
    assert plan.solver.unproven == (Unproven("mesh (4,)", SKIPPED, 60.0),)
    assert "mesh (4,): the ILP found no plan within the 60 s time limit; skipped" in caplog.text
    again = autoplan.Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    line = "  not proven optimal: mesh (4,): skipped, no plan found within the 60 s time limit"
    assert line in summary(plan).splitlines()


def test_a_mesh_stopped_with_a_plan_keeps_it_with_its_gap(
    mlp: Workload, cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pulp.HiGHS, "callSolver", _stopped_at_first_plan)
    plan = mlp.plan(cpu4, ONE_STAGE)
    stopped = plan.solver.unproven
    assert [u.part for u in stopped] == ["mesh (4,)", "mesh (2, 2)"]
    assert all(u.outcome == STOPPED for u in stopped)
    assert all(u.gap is not None and u.gap >= 0 for u in stopped)
    assert plan.solver.status == "time_limit"
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    lines = [line for line in summary(plan).splitlines() if "not proven optimal" in line]
    assert len(lines) == 2 and all("stopped at the 60 s time limit, gap <= " in x for x in lines)


def test_every_mesh_cut_short_asks_for_a_longer_time_limit(
    mlp: Workload, cpu4: autoplan.Cluster
) -> None:
    options = PlanOptions(pipeline=False, time_limit_s=1e-9)
    with pytest.raises(SolverTimeLimitError) as raised:
        mlp.plan(cpu4, options)
    message = str(raised.value)
    assert "no plan within time_limit_s=1e-09 on mesh (4,), mesh (2, 2)" in message
    assert "PlanOptions.time_limit_s, --time-limit" in message


def test_pipelines_are_searched_after_every_mesh_is_cut_short(
    mlp: Workload, cpu4: autoplan.Cluster
) -> None:
    # stages of one device each need no ILP: the pipeline search finds a plan regardless
    plan = mlp.plan(cpu4, PlanOptions(time_limit_s=1e-9))
    assert plan.pipeline is not None
    assert [(u.part, u.outcome) for u in plan.solver.unproven] == [
        ("mesh (4,)", SKIPPED),
        ("mesh (2, 2)", SKIPPED),
    ]
