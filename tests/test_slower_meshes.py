"""A one-stage mesh left unsolved where its ILP without the memory limit or recomputation,
which bounds every plan of it from below, is slower than the pipeline found (issue 34)."""

from __future__ import annotations

import logging
import math

import pytest

import autoplan
from autoplan import PlanOptions, api
from autoplan.costmodel.pricer import Pricer
from autoplan.graph.blocks import find_sharing
from autoplan.graph.recompute import NO_RECOMPUTE
from autoplan.search.mesh_plans import MeshPlan, Slower, solve_mesh
from autoplan.search.recompute_ilp import RecomputeChoice
from autoplan.solvers.evaluate import min_memory
from autoplan.solvers.problem import IntraOpSolution, lower_bound
from tests.conftest import example


def _solution(objective: float, status: str, gap: float | None) -> IntraOpSolution:
    return IntraOpSolution((0,), objective, status, 0.1, 1, 1, gap=gap)


def test_the_lower_bound_of_a_solve() -> None:
    # optimal: its objective; stopped at 8.0 with a gap of 25%: the optimum is >= 6.0
    assert lower_bound(_solution(8.0, "optimal", None)) == 8.0
    assert lower_bound(_solution(8.0, "time_limit", 0.25)) == 6.0
    assert lower_bound(_solution(8.0, "time_limit", None)) == 0.0  # the solver did not say


def test_a_mesh_whose_every_plan_is_slower_is_left_unsolved(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="tiny", num_layers=2, batch_size=16, seq_len=128)
    graph = w.trace()
    sharing = find_sharing(graph)
    pricer = Pricer(cpu4, (4,), "adamw", NO_RECOMPUTE)
    choice = RecomputeChoice.of(graph, 16)
    # without a memory limit: the fastest plan, and its objective the least of any plan's
    fastest = solve_mesh(graph, sharing, pricer, math.inf, 60.0, recompute=choice)
    assert isinstance(fastest, MeshPlan) and fastest.result.solution.status == "optimal"
    objective = fastest.result.solution.objective
    # in 90% of the least memory any plan without recomputation needs, only plans that
    # recompute fit: slower than the fastest
    limit = 0.9 * min_memory(fastest.result.problem)
    tight = solve_mesh(graph, sharing, pricer, limit, 60.0, recompute=choice)
    assert isinstance(tight, MeshPlan) and any(tight.result.solution.recomputed)
    assert tight.result.solution.objective > objective
    # slower than a pipeline of half its bound: left there, its bound that objective
    slower = solve_mesh(graph, sharing, pricer, limit, 60.0, recompute=choice,
                        slower_than=objective / 2)  # fmt: skip
    assert slower == Slower(pytest.approx(objective))
    # a pipeline no faster than the bound: solved as before
    kept = solve_mesh(graph, sharing, pricer, limit, 60.0, recompute=choice,
                      slower_than=objective * 1.0001)  # fmt: skip
    assert isinstance(kept, MeshPlan) and kept.result.assignment == tight.result.assignment


def test_the_one_stage_search_leaves_meshes_slower_than_the_pipeline_found(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # in 0.21% of a device's memory neither mesh's fastest one-stage plan fits (0.23% and
    # 0.25%, against 0.19% for the lightest); the pipelines are searched first, and with
    # the factor made tiny every mesh's bound is over it: neither is solved further
    monkeypatch.setattr(api, "SLOWER_BY", 1e-9)
    w = example("mlp", batch_size=512, hidden=512)
    with caplog.at_level(logging.INFO, logger=api.__name__):
        plan = w.plan(cpu4, PlanOptions(memory_fraction=0.0021))
    assert plan.pipeline is not None
    for mesh in ("(4,)", "(2, 2)"):
        assert f"mesh {mesh}: at least " in caplog.text
    assert caplog.text.count("times the pipeline found; not solved further") == 2
    assert plan.predicted.peak_memory_bytes <= plan.predicted.memory_limit_bytes
