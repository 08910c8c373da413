"""`PlanOptions`: validated when made, frozen, and the one way options reach the planner, the
baseline and `parallelize`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.errors import AutoplanError
from autoplan.progress import Progress
from autoplan.search.intra_op import candidate_meshes
from tests.conftest import example


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"optimizer": "lion"}, "optimizer 'lion' is not known"),
        ({"memory_fraction": 0.0}, r"memory_fraction must be in \(0, 1\]"),
        ({"memory_fraction": 1.5}, r"memory_fraction must be in \(0, 1\]"),
        ({"schedule": "zigzag"}, "schedule 'zigzag' is not known"),
        ({"time_limit_s": 0}, "time_limit_s must be > 0"),
        ({"max_layers": 0}, "max_layers must be at least 1"),
    ],
)
def test_bad_options_are_refused_when_made(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(AutoplanError, match=message):
        PlanOptions(**fields)


def test_options_are_normalized_and_frozen() -> None:
    pins = {"layers.0.weight": "R"}
    options = PlanOptions(mesh_shape=[2, 2], schedule="gpipe", pin=pins)  # type: ignore[arg-type]
    assert options.mesh_shape == (2, 2) and options.schedule == "GPipe"
    pins["layers.1.weight"] = "R"  # the caller's dict, changed later, changes nothing
    assert dict(options.pin) == {"layers.0.weight": "R"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.optimizer = "sgd"  # type: ignore[misc]
    assert PlanOptions(num_stages=2).wants_pipeline is True
    assert PlanOptions(num_stages=2, pipeline=False).wants_pipeline is False
    assert PlanOptions().wants_pipeline is None


@pytest.mark.parametrize(
    "fields",
    [
        {"mesh_shape": (4,)},
        {"pin": {"layers.0.weight": "R"}},
        {"pipeline": True},
        {"num_stages": 2},
    ],
)
def test_a_baseline_refuses_what_the_planner_would_search(
    cpu4: autoplan.Cluster, fields: dict[str, Any]
) -> None:
    name = next(iter(fields))
    with pytest.raises(AutoplanError, match=f"leave PlanOptions.{name} unset"):
        example("mlp", batch_size=8, hidden=32).baseline(
            cpu4, dp=4, tp=1, options=PlanOptions(**fields)
        )


def test_the_options_reach_the_planner(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=8, hidden=32)
    assert w.plan(cpu4, PlanOptions(mesh_shape=(2, 2))).mesh.shape == (2, 2)
    sgd = w.plan(cpu4, PlanOptions(mesh_shape=(4,), optimizer="sgd"))
    adamw = w.plan(cpu4, PlanOptions(mesh_shape=(4,)))
    # SGD keeps no state per parameter: less memory for the same placements
    assert sgd.predicted.peak_memory_bytes < adamw.predicted.peak_memory_bytes


def test_planning_reports_its_progress(cpu4: autoplan.Cluster) -> None:
    seen: list[Progress] = []
    options = PlanOptions(pipeline=False, on_progress=seen.append)
    assert options == PlanOptions(pipeline=False)  # no part of what is planned
    example("mlp", batch_size=8, hidden=32).plan(cpu4, options)
    meshes = candidate_meshes(cpu4)
    done = [p for p in seen if p.milestone]
    assert [p.label for p in done] == [
        f"ILP {i}/{len(meshes)}: one stage on mesh {m}" for i, m in enumerate(meshes, 1)
    ]
    assert [p.done for p in done] == [i / len(meshes) for i in range(1, len(meshes) + 1)]
    assert len(seen) == 2 * len(meshes)  # and what it is solving, before each
    assert all(a.elapsed <= b.elapsed for a, b in itertools.pairwise(seen))
