"""What the plan-time check costs (autoplan/execute/dry_run.py): each role's planned step run
once on fake tensors, in one process on the fake process group, for conventional plans
(`autoplan.baseline`) of two zoo models, of examples/gpt.py pipelined and of Llama 3 8B (meta
device) on 64 simulated A100s.

Prints, and writes to benchmarks/results/dry_run.json and .md: per case, the seconds to trace
and plan, the roles checked out of the world's ranks, and the check's seconds in all and per
role (each role in a forked child: its fake world, the step's build, forward, backward and
optimizer step).

    python benchmarks/dry_run.py [--cases zoo-gpt2,llama3-8b]
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
from autoplan.execute.dry_run import check_plan  # noqa: E402
from autoplan.graph.capture import export_step, microbatch  # noqa: E402
from autoplan.graph.convert import graph_from_export  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.plan_rows import load_average  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

COLUMNS = ["case", "plan", "trace_s", "plan_s", "roles", "world", "check_s", "per_role_s"]
# name -> (workload file, its options, baseline degrees)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, int]]] = {
    "zoo-gpt2": (
        "tests/models/zoo.py",
        {"model": "gpt2", "batch_size": 64, "seq_len": 128},
        {"dp": 16, "tp": 4},
    ),
    "zoo-llama": (
        "tests/models/zoo.py",
        {"model": "llama", "batch_size": 64, "seq_len": 128},
        {"dp": 32, "tp": 2, "zero_stage": 3},
    ),
    "gpt-pp": (
        "examples/gpt.py",
        {"size": "small", "num_layers": 4, "batch_size": 64, "seq_len": 128},
        {"dp": 8, "tp": 4, "pp": 2},
    ),
    "llama3-8b": (
        "benchmarks/real_models.py",
        {"model": "llama3-8b", "batch_size": 8, "seq_len": 2048},
        {"dp": 8, "tp": 8},
    ),
}


def measure(name: str, cluster: autoplan.Cluster) -> dict[str, Any]:
    path, options, degrees = CASES[name]
    w = load_workload(ROOT / path, **options)
    start = time.perf_counter()
    plan = w.baseline(cluster, **degrees)  # type: ignore[arg-type]
    plan_s = time.perf_counter() - start
    count = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    start = time.perf_counter()
    inputs, target = microbatch(w.example_inputs, count), microbatch(w.example_target, count)
    ep = export_step(w.model, inputs, w.loss_fn, target, plan.mixed_precision)
    graph = graph_from_export(ep, plan.mixed_precision)
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    gradless = frozenset(n.name for n in graph if not n.needs_grad)
    checked = check_plan(w.model, ep, plan, w.example_inputs, w.example_target, gradless=gradless)
    check_s = time.perf_counter() - start
    return {
        "case": name,
        "plan": ", ".join(f"{k}={v}" for k, v in degrees.items()),
        "trace_s": round(trace_s, 1),
        "plan_s": round(plan_s, 1),
        "roles": len(checked),
        "world": len(plan.mesh.ranks),
        "check_s": round(check_s, 1),
        "per_role_s": round(check_s / len(checked), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=8)
    meta = {
        "command": "python benchmarks/dry_run.py " + " ".join(sys.argv[1:]),
        "cluster": "costmodels/dgx-a100-80gb.json, 8 nodes (64 GPUs), fake process group",
        "load": load_average(),
        "note": "one process on a shared 2-core machine; each role in a forked child",
    }
    rows = []
    for name in args.cases.split(","):
        rows.append(measure(name, cluster))
        print(rows[-1], flush=True)
    write_results("dry_run", "The plan-time check on fake tensors: its cost", meta, rows, COLUMNS)


if __name__ == "__main__":
    main()
