from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import autoplan
from autoplan import PlanOptions
from autoplan.workload import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def example(name: str, **options: object) -> Workload:
    return load_workload(ROOT / "examples" / f"{name}.py", **options)


def plan_example(
    name: str, cluster: autoplan.Cluster, mesh: tuple[int, ...] | None, **options: object
) -> autoplan.Plan:
    return example(name, **options).plan(cluster, options=PlanOptions(mesh_shape=mesh))


@pytest.fixture(scope="session")
def cpu4() -> autoplan.Cluster:
    return autoplan.Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")


@pytest.fixture(scope="session")
def a100() -> autoplan.Cluster:
    return autoplan.Cluster.load(ROOT / "costmodels" / "dgx-a100-80gb.json")


@pytest.fixture(scope="session")
def h100_quad_nodes() -> autoplan.Cluster:
    """H100s in nodes of 4: the pipeline schedules' tests plan 4 device groups of one GPU."""
    h100 = autoplan.Cluster.load(ROOT / "costmodels" / "h100-sxm-8.json")
    return dataclasses.replace(h100, devices_per_node=4)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A process group of this process alone (DTensors on a mesh of one device)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
