from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import autoplan
from autoplan.workload import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def example(name: str, **options: object) -> Workload:
    return load_workload(ROOT / "examples" / f"{name}.py", **options)


def plan_workload(w: Workload, cluster: autoplan.Cluster, **plan_options: Any) -> autoplan.Plan:
    """`autoplan.plan` of a workload: its model, inputs, loss and target."""
    return autoplan.plan(
        w.model,
        w.example_inputs,
        cluster,
        loss_fn=w.loss_fn,
        example_target=w.example_target,
        **plan_options,
    )


def plan_example(
    name: str, cluster: autoplan.Cluster, mesh: tuple[int, ...] | None, **options: object
) -> autoplan.Plan:
    return plan_workload(example(name, **options), cluster, mesh_shape=mesh)


@pytest.fixture(scope="session")
def cpu4() -> autoplan.Cluster:
    return autoplan.Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")


@pytest.fixture(scope="session")
def a100() -> autoplan.Cluster:
    return autoplan.Cluster.load(ROOT / "costmodels" / "dgx-a100-80gb.json")
