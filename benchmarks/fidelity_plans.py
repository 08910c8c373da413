"""The plans the fidelity benchmark measures, and how its results describe them.

`MODELS` are the workloads (one per model, the same for every plan of it, so that the plans can
be ranked); `plan_specs` the plans of a model: the planner's own choice, layouts forced by the
distributed tests' options (`tests/distributed/cases.py`: data parallel, Megatron, ZeRO-3, a 2-D
mesh, pipelines) and `autoplan.baseline`'s plans. `layout` names what a plan's mesh axes really
do, and `decisions` what makes two plans the same, so that a duplicate is measured once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import autoplan
from autoplan.modes import NodeKind
from autoplan.workload import Workload
from tests.distributed.cases import (
    data_parallel,
    gpt_megatron,
    mlp_megatron,
    own,
    pipeline,
    zero3,
)

WORLD = 4
# Same workload for every plan of a model, so that the plans can be ranked. Sizes give steps of
# ~0.1-1 s: far above gloo's ~ms latencies and the scheduler noise of 4 ranks on 2 cores.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("examples/mlp.py", {"batch_size": 1024, "hidden": 512, "num_layers": 6}),
    "gpt": (
        "examples/gpt.py",
        {"size": "small", "num_layers": 4, "batch_size": 8, "seq_len": 128},
    ),
}

MakePlan = Callable[[Workload, autoplan.Cluster], autoplan.Plan]


@dataclass(frozen=True)
class PlanSpec:
    name: str
    how: str  # how the plan is obtained, for the reader
    make: MakePlan


def _forced(options: Callable[[Workload], autoplan.PlanOptions]) -> MakePlan:
    return lambda w, cluster: w.plan(cluster, options(w))


def _baseline(dp: int, tp: int, zero_stage: int = 0) -> MakePlan:
    return lambda w, cluster: w.baseline(cluster, dp=dp, tp=tp, zero_stage=zero_stage)


def plan_specs(model: str) -> list[PlanSpec]:
    megatron = mlp_megatron if model == "mlp" else gpt_megatron
    flat = (WORLD,)
    return [
        PlanSpec("own", "autoplan.plan(), nothing forced", _forced(own())),
        PlanSpec("dp", "pins: inputs S(0), params R", _forced(lambda w: data_parallel(w, flat))),
        PlanSpec("tp", "pins: Megatron column/row", _forced(lambda w: megatron(w, flat))),
        PlanSpec("zero3", "pins: params stored S(0), used R", _forced(lambda w: zero3(w, flat))),
        PlanSpec(
            "2x2",
            "mesh_shape=(2, 2), planner's sharding",
            _forced(own((2, 2))),
        ),
        PlanSpec(
            "pp4",
            "pipeline: 4 stages of 1 rank, 4 microbatches, 1F1B",
            _forced(pipeline(stages=4, microbatches=4)),
        ),
        PlanSpec(
            "pp2x2",
            "pipeline: 2 stages on mesh (2,), 4 microbatches, 1F1B",
            _forced(pipeline(stages=2, microbatches=4, mesh=(2,))),
        ),
        PlanSpec(
            "pp2x2-gpipe",
            "pipeline: 2 stages on mesh (2,), 2 microbatches, GPipe",
            _forced(pipeline(stages=2, microbatches=2, schedule="GPipe", mesh=(2,))),
        ),
        PlanSpec("base-dp4", "autoplan.baseline(dp=4, tp=1)", _baseline(dp=4, tp=1)),
        PlanSpec("base-tp4", "autoplan.baseline(dp=1, tp=4)", _baseline(dp=1, tp=4)),
        PlanSpec("base-dp2tp2", "autoplan.baseline(dp=2, tp=2)", _baseline(dp=2, tp=2)),
        PlanSpec(
            "base-zero3",
            "autoplan.baseline(dp=4, tp=1, zero_stage=3)",
            _baseline(dp=4, tp=1, zero_stage=3),
        ),
    ]


def axis_role(plan: autoplan.Plan, axis: str) -> str:
    """What a stage mesh axis does, read from the placements (the plan's own axis names follow
    the costliest op, and a pipeline's stage axis is always called "tp")."""
    params = [p for p in plan.params.values() if p.shape]
    numel = [float(np.prod(p.shape)) for p in params]
    total = sum(numel) or 1.0
    used_split = sum(n for p, n in zip(params, numel, strict=True) if p.placements[axis] != "R")
    stored_only = sum(
        n
        for p, n in zip(params, numel, strict=True)
        if p.placements[axis] == "R" and p.storage[axis] != "R"
    )
    if stored_only > total / 2:
        return "zero"
    if used_split > total / 2:
        return "tp"
    inputs = [n for n in plan.nodes.values() if n.op == NodeKind.INPUT]
    boundaries = [s.boundary.get(axis) for s in plan.stages if s.boundary]
    if any(n.output[axis] == "S(0)" for n in inputs) or "S(0)" in boundaries:
        return "dp"
    return "R"


def layout(plan: autoplan.Plan) -> str:
    """E.g. "tp4", "dp2 x tp2", "pp2 x dp2 (GPipe, 2 mb)": the mesh by what each axis really
    does, and a pipeline's schedule and microbatches."""
    parts = []
    pipe = plan.pipeline
    if pipe is not None:
        parts.append(f"pp{len(plan.stages)}")
    stage_shape = plan.mesh.shape[1:] if pipe is not None else plan.mesh.shape
    for axis, size in zip(plan.stage_axes, stage_shape, strict=True):
        if size > 1:
            parts.append(f"{axis_role(plan, axis)}{size}")
    schedule = f" ({pipe.schedule}, {pipe.num_microbatches} mb)" if pipe is not None else ""
    return " x ".join(parts) + schedule


def decisions(plan: autoplan.Plan) -> str:
    """The plan's decisions without its predictions or solver statistics, to spot duplicates."""
    pipe = plan.pipeline
    return json.dumps(
        {
            "mesh": [plan.mesh.axes, plan.mesh.shape],
            "params": {k: [dict(p.storage), dict(p.placements)] for k, p in plan.params.items()},
            "nodes": {
                k: [dict(n.output), [dict(i) for i in n.inputs], dict(n.grad)]
                for k, n in plan.nodes.items()
            },
            "stages": [[s.ranks, s.nodes, dict(s.boundary)] for s in plan.stages],
            "pipeline": None if pipe is None else [pipe.schedule, pipe.num_microbatches],
        },
        sort_keys=True,
    )
