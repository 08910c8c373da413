"""Activation recomputation on Megatron-LM's GPTs as Megatron trains them (Narayanan et al.
2021, table 1: 1.7B on 32 A100s, dp 32; 3.6B on 64, dp 32 x tp 2; 7.5B on 128, dp 32 x tp 4;
16 sequences of 2048 a data-parallel rank, bf16) on simulated DGX A100s: Megatron's plan
without and with full recomputation (`autoplan.baseline`); for the 1.7B (tp 1), the planner
held to Megatron's data parallelism by pins; with ``--free``, the planner left free (minutes
each on a 2-core machine; each ILP may take 10 minutes).

    python benchmarks/recompute.py [--free]

Writes benchmarks/results/recompute.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan import PlanOptions  # noqa: E402
from autoplan.errors import InfeasiblePlanError  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

GiB = 2**30
MEGATRON = [("1.7b", 4, 32, 1), ("3.6b", 8, 32, 2), ("7.5b", 16, 32, 4)]  # size, nodes, dp, tp


def _priced(plan: autoplan.Plan) -> str:
    return f"{plan.predicted.peak_memory_bytes / GiB:.1f} GiB, {plan.predicted.step_time_s:.3f} s"


def _case(size: str, nodes: int, dp: int, tp: int, free: bool) -> dict[str, Any]:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=nodes)
    w = load_workload(
        ROOT / "examples/gpt.py", size=size, batch_size=16 * dp, device="meta", dtype="bfloat16"
    )
    row: dict[str, Any] = {"model": f"GPT {size}", "GPUs": dp * tp, "dp x tp": f"{dp} x {tp}"}
    try:
        row["Megatron, no recomputation"] = _priced(w.baseline(cluster, dp=dp, tp=tp))
    except InfeasiblePlanError as e:
        row["Megatron, no recomputation"] = "needs " + str(e).split("needs ")[1].split(" per")[0]
    row["Megatron, full recomputation"] = _priced(
        w.baseline(cluster, dp=dp, tp=tp, recompute="full")
    )
    if tp == 1:
        params = [n for n, _ in w.model.named_parameters()]
        pins = {"input:0": "S(0)", "target": "S(0)", **dict.fromkeys(params, "R")}
        start = time.perf_counter()
        held = w.plan(cluster, PlanOptions(mesh_shape=(dp,), pin=pins))
        row["planner, data parallel"] = (
            f"{_priced(held)}, {len(held.recompute)} layers recomputed "
            f"({time.perf_counter() - start:.0f} s to plan)"
        )
    if free:
        start = time.perf_counter()
        found = w.plan(cluster, PlanOptions(time_limit_s=600))
        stages = len(found.stages)
        row["planner, free"] = (
            f"{_priced(found)}, mesh {found.mesh.shape}, {stages} stage(s), "
            f"{len(found.recompute)} layers recomputed ({time.perf_counter() - start:.0f} s)"
        )
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--free", action="store_true", help="also plan each case unrestricted")
    args = parser.parse_args()
    rows = [_case(*case, args.free) for case in MEGATRON]
    columns = list(dict.fromkeys(c for r in rows for c in r))
    write_results(
        "recompute",
        "Activation recomputation on Megatron-LM's GPTs (simulated DGX A100 80 GB)",
        {
            "command": "python benchmarks/recompute.py" + " --free" * args.free,
            "cost model": "costmodels/dgx-a100-80gb.json, memory_fraction 0.9 (72 GiB)",
            "batch": "16 sequences of 2048 per data-parallel rank, bf16, AdamW",
            "cells": "predicted memory per device, predicted step time",
        },
        rows,
        columns,
    )


if __name__ == "__main__":
    main()
