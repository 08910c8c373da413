"""A time limit never loses a plan: a mesh whose ILP finds no plan within it is skipped, one
stopped with a plan keeps it, one that chose recomputation and found none is planned again
with its layers recomputed whole (a one-stage mesh and a pipeline layer alike), the search
goes on, and the plan says which parts were not proven optimal (issue 34)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import Any

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.errors import SolverTimeLimitError
from autoplan.planfile.show import summary
from autoplan.search import intra_op, layer_plans, mesh_plans
from autoplan.solvers.problem import SKIPPED, STOPPED, Unproven
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

    monkeypatch.setattr(mesh_plans, "solve_problem", cut)


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
    import highspy

    monkeypatch.setattr(highspy.Highs, "run", _stopped_at_first_plan(highspy.Highs.run))
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
    assert str(raised.value) == (
        "the ILP solver found no plan within the time limit (mesh (4,): skipped, no plan "
        "found within the 1e-09 s time limit; mesh (2, 2): skipped, no plan found within the "
        "1e-09 s time limit): raise the time limit (PlanOptions.time_limit_s, --time-limit)."
    )


def test_every_pipeline_cut_short_asks_for_a_longer_time_limit(
    mlp: Workload, cpu4: autoplan.Cluster
) -> None:
    # two stages of two devices: every layer's ILP has choices, and a nanosecond for them
    with pytest.raises(SolverTimeLimitError) as raised:
        mlp.plan(cpu4, PlanOptions(num_stages=2, time_limit_s=1e-9))
    message = str(raised.value)
    assert "2 stages of mesh (2,), boundary R, 4 microbatches, 3 layer ILPs: skipped" in message
    assert "a pipeline layer's ILP stops at 2 s at most" in message


def test_pipelines_are_searched_after_every_mesh_is_cut_short(
    mlp: Workload, cpu4: autoplan.Cluster
) -> None:
    # stages of one device each need no ILP: the pipeline search finds a plan regardless
    plan = mlp.plan(cpu4, PlanOptions(time_limit_s=1e-9))
    assert plan.pipeline is not None and math.prod(plan.mesh.shape[1:]) == 1
    unproven = plan.solver.unproven
    assert [u.part for u in unproven[:2]] == ["mesh (4,)", "mesh (2, 2)"]
    # and the layers of the stages of two devices, each configuration once
    assert unproven[2].part == "2 stages of mesh (2,), boundary R, 8 microbatches, 3 layer ILPs"
    assert len(unproven) > 2 and all(u.outcome == SKIPPED for u in unproven)


def test_pipeline_layers_stopped_with_a_plan_are_listed_with_their_gap(
    mlp: Workload, cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the layers' ILPs are small enough for HiGHS's presolve: said to stop, with gaps of 1-2%
    solve = intra_op.solve_problem
    gaps = iter([0.01, 0.02] * 100)

    def stopped(*args: Any, **kwargs: Any) -> intra_op.IntraOpResult:
        found = solve(*args, **kwargs)
        solution = dataclasses.replace(found.solution, status="time_limit", gap=next(gaps))
        return dataclasses.replace(found, solution=solution)

    monkeypatch.setattr(mesh_plans, "solve_problem", stopped)
    plan = mlp.plan(cpu4, PlanOptions(num_stages=2))
    assert plan.pipeline is not None
    unproven = plan.solver.unproven
    assert unproven and all(u.outcome == STOPPED for u in unproven)
    assert all(u.part.startswith("2 stages of mesh (2,), boundary ") for u in unproven)
    # one line a configuration, its layers counted, the largest gap of their ILPs
    assert all(re.search(r", \d+ layer ILPs$", u.part) and u.gap == 0.02 for u in unproven)
    assert len({u.part for u in unproven}) == len(unproven)


def test_a_mesh_whose_priced_peak_is_over_the_limit_is_solved_again_then_left(
    mlp: Workload,
    cpu4: autoplan.Cluster,
    proven: autoplan.Plan,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The ILP counts memory as a sum over ops; the plan's peak is priced over time
    (`price_step`). Where the two disagree and the peak is over the limit, the mesh is solved
    again within the limit less what the ILP did not see, and where that plan is over too, the
    ILP's plan is no plan: the search takes another mesh or a conventional plan of that mesh
    (priced by the baselines, as it fits), never a plan that would not fit."""
    price = mesh_plans.price_step

    def over_on_2x2(*args: Any) -> Any:
        step = price(*args)
        if args[2].mesh_shape == (2, 2):
            return dataclasses.replace(step, memory_bytes=step.memory_bytes + 2**50)
        return step

    monkeypatch.setattr(mesh_plans, "price_step", over_on_2x2)
    with caplog.at_level(logging.INFO):
        plan = mlp.plan(cpu4, ONE_STAGE)
    assert proven.mesh.shape == (2, 2)
    assert plan.mesh.shape == (4,) or plan.solver.status == "baseline"
    assert plan.predicted.peak_memory_bytes <= plan.predicted.memory_limit_bytes
    again = r"mesh \(2, 2\): the ILP's plan is priced at .* over the limit .*; solved again"
    assert re.search(again, caplog.text)
    assert "mesh (2, 2): its ILP's plans are priced at" in caplog.text


def _recomputation_cut_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ILP that chooses which layers recompute is given a nanosecond; the others run
    as asked."""
    solve = intra_op.solve_problem

    def cut(*args: Any, **kwargs: Any) -> intra_op.IntraOpResult:
        if args[3].recompute:
            return solve(*args[:6], 1e-9)
        return solve(*args, **kwargs)

    monkeypatch.setattr(mesh_plans, "solve_problem", cut)


def test_a_mesh_whose_recomputation_is_not_chosen_in_time_recomputes_every_layer(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the setup of tests/test_recompute.py's mixed modes: only some recomputation fits
    w = example("gpt", size="small", num_layers=3, batch_size=8, seq_len=128, attention="eager")
    options = PlanOptions(mesh_shape=(4,), memory_fraction=0.0055, pipeline=False)
    _recomputation_cut_short(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=autoplan.api.__name__):
        found = w.plan(cpu4, options)
    assert "planned with every layer recomputed" in caplog.text
    assert {(layer.layer, layer.mode) for layer in found.recompute} == {
        (f"blocks.{i}", "full") for i in range(3)
    }
    assert found.predicted.peak_memory_bytes <= found.predicted.memory_limit_bytes
    assert found.solver.unproven == (Unproven("mesh (4,)", STOPPED, 60.0),)


def test_a_pipeline_layer_whose_recomputation_is_not_chosen_in_time_recomputes_whole(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # two one-block stages of two devices in 0.3% of a device's memory: the layers' ILPs
    # must choose recomputation (their plans without it do not fit), and are given a
    # nanosecond for it; before, such a layer was skipped and no pipeline was found
    w = example("gpt", size="small", num_layers=2, batch_size=8, seq_len=128, attention="eager")
    options = PlanOptions(num_stages=2, num_microbatches=4, mesh_shape=(2,), memory_fraction=0.003)
    _recomputation_cut_short(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=layer_plans.__name__):
        found = w.plan(cpu4, options)
    assert "the ILP found no plan in 2 s; planned recomputed whole" in caplog.text
    assert found.pipeline is not None and found.recompute
    # every layer recomputed whole, then each stage trimmed to the fewest that fit
    assert {layer.mode for layer in found.recompute} == {"full"}
    assert found.predicted.peak_memory_bytes <= found.predicted.memory_limit_bytes
    whole = [u for u in found.solver.unproven if u.part.endswith(", recomputed whole")]
    assert whole and all(u.outcome == STOPPED and u.gap is None for u in whole)
    assert re.search(r", \d+ layer ILPs?, recomputed whole$", whole[0].part)
    line = f"  not proven optimal: {whole[0].part}: stopped at the 2 s time limit, gap unknown"
    assert line in summary(found).splitlines()
