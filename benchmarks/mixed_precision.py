"""Mixed precision as the planner prices it: GPTs of examples/gpt.py (on the meta device)
planned on one node of 8 A100s (costmodels/dgx-a100-80gb.json) in float32 and in bf16
(`PlanOptions(mixed_precision="bf16")`), each plan's predicted step time, compute time,
memory per device and collective bytes.

Prints, and writes to benchmarks/results/mixed_precision.json and .md.

    python benchmarks/mixed_precision.py [--sizes 125m,350m] [--batch 8]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.planfile.show import fmt_bytes, fmt_time  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="125m,350m")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    rows = []
    for size in args.sizes.split(","):
        w = load_workload(ROOT / "examples/gpt.py", size=size, batch_size=args.batch, device="meta")
        for precision in (None, "bf16"):
            start = time.perf_counter()
            plan = w.plan(cluster, autoplan.PlanOptions(mixed_precision=precision))
            seconds = time.perf_counter() - start
            p = plan.predicted
            axes = zip(plan.mesh.axes, plan.mesh.shape, strict=True)
            row = {
                "gpt": size,
                "precision": precision or "float32",
                "mesh": " x ".join(f"{a}={s}" for a, s in axes),
                "step": fmt_time(p.step_time_s),
                "compute": fmt_time(p.compute_s),
                "communication": fmt_time(p.comm_s),
                "memory": fmt_bytes(p.peak_memory_bytes),
                "bytes moved": fmt_bytes(sum(c.bytes for c in plan.collectives)),
                "planning": f"{seconds:.1f} s",
            }
            print(row, flush=True)
            rows.append(row)
    meta = {
        "cluster": f"{cluster.name}, {cluster.num_devices} GPUs (simulated: plans, not runs)",
        "workload": f"examples/gpt.py on meta, batch {args.batch} sequences of 2048",
        "command": "python benchmarks/mixed_precision.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    columns = list(rows[0])
    write_results("mixed_precision", "Mixed precision: float32 and bf16 plans", meta, rows, columns)


if __name__ == "__main__":
    main()
