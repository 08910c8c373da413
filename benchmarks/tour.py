"""The README's tour, priced: the planner's plan of transformers' Llama ("small": 4 blocks,
hidden 256, 8 heads and 4 key-value heads; batch 32 of 512 tokens) on one DGX A100 node,
against the conventional plans a person would write for it: Megatron's (the README's dp=2 x
tp=4, with sequence parallelism too), torchtitan's (``style="torchtitan"``: sequence
parallelism and FSDP over dp), DDP and FSDP (dp=8, ZeRO-3). All priced by the same cost
model; ``ratio`` is each plan's predicted step time over the planner's.

Prints, and writes to benchmarks/results/tour.json and .md.

    python benchmarks/tour.py
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

WORKLOAD = {"size": "small", "batch_size": 32, "seq_len": 512}
# ample for each ILP to finish on a loaded 2-core machine: the figures are the optimum's
OPTIONS = autoplan.PlanOptions(time_limit_s=900.0)
CLUSTER = "dgx-a100-80gb.json"
# name -> autoplan.baseline's degrees
BASELINES: dict[str, dict[str, Any]] = {
    "Megatron dp=2 tp=4": {"dp": 2, "tp": 4},
    "Megatron dp=2 tp=4 sp": {"dp": 2, "tp": 4, "sequence_parallel": True},
    "torchtitan dp=2 tp=4": {"dp": 2, "tp": 4, "style": "torchtitan"},
    "torchtitan dp=4 tp=2": {"dp": 4, "tp": 2, "style": "torchtitan"},
    "DDP dp=8": {"dp": 8, "tp": 1},
    "FSDP dp=8": {"dp": 8, "tp": 1, "zero_stage": 3},
}


def _row(name: str, plan: autoplan.Plan, planned_s: float, seconds: float) -> dict[str, Any]:
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.mesh.axes, plan.mesh.shape, strict=True))
    return {
        "plan": name,
        "mesh": mesh,
        "step_ms": round(plan.predicted.step_time_s * 1e3, 4),
        "memory_mib": round(plan.predicted.peak_memory_bytes / 2**20, 2),
        "ratio": round(plan.predicted.step_time_s / planned_s, 4),
        "solver": plan.solver.status,
        "seconds": round(seconds, 2),
    }


def main() -> None:
    w = load_workload(ROOT / "examples" / "hf_llama.py", **WORKLOAD)
    cluster = autoplan.Cluster.load(ROOT / "costmodels" / CLUSTER)
    start = time.perf_counter()
    planned = w.plan(cluster, OPTIONS)
    planned_s = planned.predicted.step_time_s
    rows = [_row("planner", planned, planned_s, time.perf_counter() - start)]
    for name, degrees in BASELINES.items():
        start = time.perf_counter()
        rows.append(
            _row(name, w.baseline(cluster, **degrees), planned_s, time.perf_counter() - start)
        )
        print(rows[-1], flush=True)
    meta = {
        "command": "python benchmarks/tour.py",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "workload": "examples/hf_llama.py " + " ".join(f"{k}={v}" for k, v in WORKLOAD.items()),
        "cluster": f"costmodels/{CLUSTER}",
        "options": f"PlanOptions(time_limit_s={OPTIONS.time_limit_s})",
        "ratio": "the plan's predicted step time / the planner's (same cost model)",
    }
    columns = ["plan", "mesh", "step_ms", "memory_mib", "ratio", "solver", "seconds"]
    write_results(
        "tour", "The README's tour: the planner against the conventional plans", meta, rows, columns
    )


if __name__ == "__main__":
    main()
