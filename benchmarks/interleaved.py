"""Interleaved 1F1B in the planner: GPTs on simulated A100 clusters planned with 1F1B alone and
with every schedule (Interleaved1F1B among them), the pipeline's shape forced where given.

Prints, and writes to benchmarks/results/interleaved.json and .md: each plan's schedule, stages
per device group, predicted bubble, step time, memory and planning time.

    python benchmarks/interleaved.py [--cases 1.3b:8:16:2:2,7b:32:64]
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
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

# size:layers:gpus[:device groups:microbatches]; global batch of half a sequence per GPU (>= 16)
CASES = "1.3b:8:16:2:2,1.3b:16:32:4:4,7b:32:64,7b:32:64:8:8"


def run(case: str, schedule: str | None) -> dict[str, object]:
    size, layers, gpus, *shape = case.split(":")
    batch = max(16, int(gpus) // 2)
    cluster = autoplan.Cluster.load(
        ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=max(1, int(gpus) // 8)
    )
    w = load_workload(
        ROOT / "examples/gpt.py", size=size, num_layers=int(layers), batch_size=batch,
        device="meta", dtype="bfloat16",
    )  # fmt: skip
    stages, count = (int(shape[0]), int(shape[1])) if shape else (None, None)
    options = PlanOptions(schedule=schedule, num_stages=stages, num_microbatches=count)
    row: dict[str, object] = {
        "case": f"gpt-{size}, {layers} layers, {gpus} GPUs, batch {batch}"
        + (f", {stages} groups x {count} microbatches" if shape else ""),
        "schedules": schedule or "all",
    }
    start = time.perf_counter()
    try:
        plan = w.plan(cluster, options)
    except InfeasiblePlanError as e:
        return {**row, "result": f"does not fit: {str(e)[:80]}"}
    pipeline = plan.pipeline
    return {
        **row,
        "plan_s": round(time.perf_counter() - start, 1),
        "result": "ok",
        "mesh": "x".join(map(str, plan.mesh.shape)),
        "schedule": pipeline.schedule if pipeline else "-",
        "stages_per_group": plan.virtual_stages,
        "microbatches": pipeline.num_microbatches if pipeline else 1,
        "bubble": round(pipeline.bubble_fraction, 3) if pipeline else 0.0,
        "step_s": round(plan.predicted.step_time_s, 4),
        "memory_gib": round(plan.predicted.peak_memory_bytes / 2**30, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=CASES)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for case in args.cases.split(","):
        for schedule in ("1F1B", None):
            row = run(case, schedule)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {
        "command": "python benchmarks/interleaved.py",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "cluster": "costmodels/dgx-a100-80gb.json (8 GPUs per node)",
        "model": "examples/gpt.py, bf16, AdamW; schedules 'all': 1F1B, GPipe, Interleaved1F1B",
        "note": "predictions are analytic (published link and peak figures), not measured",
    }
    columns = [
        "case",
        "schedules",
        "result",
        "plan_s",
        "mesh",
        "schedule",
        "stages_per_group",
        "microbatches",
        "bubble",
        "step_s",
        "memory_gib",
    ]
    write_results("interleaved", "Interleaved 1F1B in the planner", meta, rows, columns)


if __name__ == "__main__":
    main()
