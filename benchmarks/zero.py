"""ZeRO stages priced: GPTs on one node of 8 A100s (80 GB), data parallel over the 8, with the
optimizer state whole (ZeRO-0), split (ZeRO-1), with the gradients (ZeRO-2), with the
parameters (ZeRO-3): `autoplan.baseline(dp=8, tp=1, zero_stage=...)`, predicted step time and
memory per device by the cost model. Then the planner, data parallel (every parameter read
whole, its storage and state free): what it splits, its time and memory.

Prints, and writes to benchmarks/results/zero.json and .md.

    python benchmarks/zero.py [--sizes 1.3b,2.7b,7b] [--batch 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan import PlanOptions  # noqa: E402
from autoplan.errors import InfeasiblePlanError  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

GiB = 2**30


def _row(size: str, layout: str, plan: autoplan.Plan, fits: bool) -> dict[str, Any]:
    split = [p for p in plan.params.values() if p.state]
    return {
        "size": size,
        "plan": layout,
        "step_ms": round(plan.predicted.step_time_s * 1e3, 2),
        "GiB_per_device": round(plan.predicted.peak_memory_bytes / GiB, 2),
        "fits_90%": "yes" if fits else "no",
        "state_split": f"{len(split)} of {len(plan.params)}",
        "zero3_stored": sum(
            any(v != "R" for v in p.storage.values()) for p in plan.params.values()
        ),
    }


def _baselines(w: Workload, size: str, a100: autoplan.Cluster) -> list[dict[str, Any]]:
    # devices of 100 times the memory, the same speed: a baseline that does not fit is priced
    device = dataclasses.replace(a100.device, memory_bytes=a100.device.memory_bytes * 100)
    roomy = dataclasses.replace(a100, device=device)
    rows = []
    for stage in (0, 1, 2, 3):
        plan = w.baseline(roomy, dp=8, tp=1, zero_stage=stage)
        fits = plan.predicted.peak_memory_bytes <= 0.9 * a100.device.memory_bytes
        rows.append(_row(size, f"baseline zero_stage={stage}", plan, fits))
    return rows


def _planned(w: Workload, size: str, a100: autoplan.Cluster) -> dict[str, Any]:
    names = [n for n, _ in w.model.named_parameters()]
    pins = {"input:0": "S(0)", "target": "S(0)", **{n: {"use": "R"} for n in names}}
    start = time.perf_counter()
    try:
        plan = w.plan(a100, PlanOptions(mesh_shape=(8,), pin=pins, pipeline=False))
    except InfeasiblePlanError:
        return {"size": size, "plan": "planner, data parallel", "fits_90%": "no"}
    row = _row(size, "planner, data parallel", plan, True)
    row["plan_s"] = round(time.perf_counter() - start, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1.3b,2.7b,7b")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    a100 = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    rows = []
    for size in args.sizes.split(","):
        w = load_workload(ROOT / "examples/gpt.py", size=size, batch_size=args.batch, device="meta")
        for row in [*_baselines(w, size, a100), _planned(w, size, a100)]:
            print(row, flush=True)
            rows.append(row)
    meta = {
        "command": "python benchmarks/zero.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "cluster": "costmodels/dgx-a100-80gb.json, 1 node of 8 A100 80 GB",
        "model": f"examples/gpt.py, fp32, AdamW, seq 2048, batch {args.batch}, on meta",
        "figures": "predicted by autoplan's cost model (nothing run); fits: within 90% of 80 GB",
        "state_split": "parameters whose optimizer state is split (ZeRO-1/2)",
        "zero3_stored": "parameters stored split (ZeRO-3)",
    }
    columns = [
        "size",
        "plan",
        "step_ms",
        "GiB_per_device",
        "fits_90%",
        "state_split",
        "zero3_stored",
        "plan_s",
    ]
    write_results("zero", "ZeRO stages on 8 A100s, priced", meta, rows, columns)


if __name__ == "__main__":
    main()
