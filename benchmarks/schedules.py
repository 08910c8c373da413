"""Every pipeline schedule on one GPT under one cost model: GPTs of 32 and 64 layers on 16
simulated A100s in 16 device groups of one GPU, 32 microbatches (enough, 2p - 1 = 31, to fill
ZBV's V; DualPipeV needs 2p = 32). The schedules of one stage a group run 16 stages;
Interleaved1F1B, ZeroBubble with 2 stages a group, ZBV and DualPipeV run 32 (of 32 layers:
one layer each, the planner's split the conventional one; of 64, the planner's own).

For each schedule, two plans: the conventional one (Megatron's even split of the layers,
`autoplan.baselines`, priced under that schedule) and the planner's with that schedule
forced; then the planner free to choose. Prints, and writes to benchmarks/results/schedules.json
and .md: each plan's schedule, stages per group, predicted bubble, step time and peak memory
per device, and the planning time.

    python benchmarks/schedules.py [--size 1.3b] [--layers 32,64] [--microbatches 32]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan import PlanOptions  # noqa: E402
from autoplan.errors import InfeasiblePlanError  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

GROUPS = 16
# (schedule, stages per device group)
SCHEDULES = [
    ("1F1B", 1),
    ("GPipe", 1),
    ("ZeroBubble", 1),
    ("Interleaved1F1B", 2),
    ("ZeroBubble", 2),
    ("ZBV", 2),
    ("DualPipeV", 2),
]


def _row(plan: autoplan.Plan, start: float) -> dict[str, object]:
    pipeline = plan.pipeline
    assert pipeline is not None
    return {
        "plan_s": round(time.perf_counter() - start, 1),
        "result": "ok",
        "schedule": pipeline.schedule,
        "stages": len(plan.stages),
        "stages_per_group": plan.virtual_stages,
        "bubble": round(pipeline.bubble_fraction, 3),
        "step_s": round(plan.predicted.step_time_s, 4),
        "memory_gib": round(plan.predicted.peak_memory_bytes / 2**30, 2),
    }


def run(
    w: Workload,
    cluster: autoplan.Cluster,
    layers: int,
    how: str,
    schedule: str | None,
    v: int,
    count: int,
) -> dict[str, object]:
    row: dict[str, object] = {"layers": layers, "plan": how, "schedules": schedule or "all"}
    start = time.perf_counter()
    try:
        if how == "conventional":
            options = PlanOptions(schedule=schedule, num_microbatches=count)
            plan = w.baseline(cluster, dp=1, tp=1, pp=GROUPS, virtual_stages=v, options=options)
        else:
            plan = w.plan(
                cluster,
                PlanOptions(
                    schedule=schedule,
                    num_stages=GROUPS,
                    num_microbatches=count,
                    virtual_stages=v if v > 1 else None,
                    max_layers=layers,  # each block a layer of the stage search
                ),
            )
    except InfeasiblePlanError as e:
        return {**row, "result": f"does not fit: {str(e)[:80]}"}
    return {**row, **_row(plan, start)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1.3b")
    parser.add_argument("--layers", default="32,64")
    parser.add_argument("--microbatches", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=GROUPS // 8)
    rows = []
    runs = [(how, s, v) for s, v in SCHEDULES for how in ("conventional", "planner")]
    for layers in map(int, args.layers.split(",")):
        w = load_workload(
            ROOT / "examples/gpt.py", size=args.size, num_layers=layers,
            batch_size=args.microbatches, device="meta", dtype="bfloat16",
        )  # fmt: skip
        for how, schedule, v in [*runs, ("planner", None, 1)]:
            row = run(w, cluster, layers, how, schedule, v, args.microbatches)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {
        "command": "python benchmarks/schedules.py",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "cluster": f"costmodels/dgx-a100-80gb.json, {GROUPS // 8} nodes of 8 GPUs",
        "model": f"examples/gpt.py gpt-{args.size} of {args.layers} layers, bf16, AdamW, batch "
        f"{args.microbatches} in {args.microbatches} microbatches",
        "pipeline": f"{GROUPS} device groups of 1 GPU; 2 stages a group: {2 * GROUPS} stages",
        "conventional": "Megatron's even split of the layers (autoplan.baselines), same schedule",
        "note": "predictions are analytic (published link and peak figures), not measured",
    }
    columns = [
        "layers",
        "plan",
        "schedules",
        "result",
        "plan_s",
        "schedule",
        "stages",
        "stages_per_group",
        "bubble",
        "step_s",
        "memory_gib",
    ]
    write_results("schedules", "Pipeline schedules under one cost model", meta, rows, columns)


if __name__ == "__main__":
    main()
