"""The model zoo (tests/models/zoo.py: Hugging Face models nobody here wrote): each planned on 4
CPU ranks and on one 8-GPU A100 node, then trained 3 steps on 4 local gloo ranks under its own
plan and checked against one process (`autoplan run --check`, tolerance 1e-5).

Prints, and writes to benchmarks/results/zoo.json and .md, per model: parameters, graph nodes,
plan time and chosen mesh on each cluster, and whether training matched one process.

    python benchmarks/zoo.py [--models gpt2,llama] [--no-train]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from tests.models.zoo import NAMES, workload  # noqa: E402

BATCH = {"batch_size": 64, "seq_len": 32}  # what the distributed tests train
CLUSTERS = {"cpu4": ("cpu-gloo-4.json", 1), "a100x8": ("dgx-a100-80gb.json", 1)}


def _layout(plan: autoplan.Plan) -> str:
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.mesh.axes, plan.mesh.shape, strict=True))
    return f"{mesh}, {len(plan.collectives)} collectives"


def _planned(model: str) -> dict[str, object]:
    w = workload(model, **BATCH)
    row: dict[str, object] = {
        "model": model,
        "params_M": round(sum(p.numel() for p in w.model.parameters()) / 1e6, 3),
    }
    for name, (path, nodes) in CLUSTERS.items():
        cluster = autoplan.Cluster.load(ROOT / "costmodels" / path, num_nodes=nodes)
        start = time.perf_counter()
        plan = w.plan(cluster)
        row[f"{name}_plan_s"] = round(time.perf_counter() - start, 2)
        row[f"{name}_plan"] = _layout(plan)
    return row


def _trained(model: str) -> str:
    """`autoplan run --check`'s verdict, with its largest differences."""
    sets = [f"--set={k}={v}" for k, v in {"model": model, **BATCH}.items()]
    cmd = [sys.executable, "-m", "autoplan.cli", "-q", "run", str(ROOT / "tests/models/zoo.py")]
    cmd += ["--cluster", str(ROOT / "costmodels/cpu-gloo-4.json"), "--steps", "3", "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + sets, capture_output=True, text=True, env=env, cwd=ROOT)
    found = re.search(
        r"largest loss difference (\S+), largest parameter difference (\S+) .*: (\w+)", proc.stdout
    )
    if found is None:
        return f"failed (exit {proc.returncode})"
    return f"{found.group(3)} (loss {found.group(1)}, params {found.group(2)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(NAMES))
    parser.add_argument("--no-train", action="store_true", help="plan only")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        row = _planned(model)
        if not args.no_train:
            row["trains_exactly_4_ranks"] = _trained(model)
        print(row, flush=True)
        rows.append(row)
    columns = ["model", "params_M"]
    columns += [f"{c}_{k}" for c in CLUSTERS for k in ("plan", "plan_s")]
    columns += [] if args.no_train else ["trains_exactly_4_ranks"]
    meta = {
        "command": "python benchmarks/zoo.py" + (" --no-train" if args.no_train else ""),
        "batch": BATCH,
        "torch": torch.__version__,
        "host": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    write_results("zoo", "Model zoo: planned and trained exactly", meta, rows, columns)


if __name__ == "__main__":
    main()
