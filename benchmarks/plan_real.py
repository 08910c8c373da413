"""Planning benchmark on models we did not write: transformers' Llama 3 (8B, 70B, 405B),
Qwen2.5-7B, Mixtral 8x7B and a DeepSeek-V3-sized MoE at their published sizes
(`benchmarks/real_models.py`), on simulated A100 and H100 clusters, in bf16 mixed precision
with AdamW and 2048-token sequences, each case planned in a fresh process.

Prints, and writes to benchmarks/results/plan_real.json and .md: planning time and where it
went (trace, strategies, ILP build, solve, pricing), the plan's shape, the parts of the search
not proven optimal, and the predicted step time, throughput and model FLOP/s per GPU. The
machine's load average is recorded with each case: times are an idle machine's only where it
is low.

    python benchmarks/plan_real.py [--models llama3-8b,qwen2.5-7b] [--gpus 64,512]
        [--per-gpu 0.5,2] [--clusters a100,h100] [--cases llama3-405b@512,...] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.plan_rows import (  # noqa: E402
    CLUSTERS,
    PLAN_COLUMNS,
    load_average,
    phase_split,
    plan_fields,
    planning_meta,
    run_fresh,
)
from benchmarks.results_io import write_results  # noqa: E402

SEQ_LEN = 2048


def run(model: str, kind: str, gpus: int, batch: int) -> dict[str, object]:
    cluster = autoplan.Cluster.load(ROOT / "costmodels" / CLUSTERS[kind], num_nodes=gpus // 8)
    w = load_workload(ROOT / "benchmarks/real_models.py", model=model, batch_size=batch)
    num_params = sum(p.numel() for p in w.model.parameters())
    row: dict[str, object] = {
        "model": model,
        "params_b": round(num_params / 1e9, 1),
        "cluster": kind,
        "gpus": gpus,
        "batch": batch,
        "load": load_average(),
    }
    options = autoplan.PlanOptions(mixed_precision="bf16")
    start = time.perf_counter()
    with phase_split() as phases:
        try:
            plan = w.plan(cluster, options)
        except AutoplanError as e:
            row.update(plan_s=round(time.perf_counter() - start, 1), result=type(e).__name__)
            row.update(detail=str(e)[:200])
            return row
    row["plan_s"] = round(time.perf_counter() - start, 1)
    row.update(plan_fields(plan, batch * SEQ_LEN, num_params, gpus))
    split = phases.get("phases", "")
    traced = re.search(r"trace ([\d.]+) s", split)
    row.update(trace_s=float(traced.group(1)) if traced else "", phases=split)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-8b,qwen2.5-7b,mixtral-8x7b,llama3-70b")
    parser.add_argument("--gpus", default="64,512")
    parser.add_argument("--per-gpu", default="0.5")
    parser.add_argument("--clusters", default="a100")
    parser.add_argument(
        "--cases", help="model@gpus pairs, comma-separated, in place of --models x --gpus"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a case, run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(**json.loads(args.one))), flush=True)
        return
    logging.basicConfig(level=logging.WARNING)
    pairs = (
        [(m, int(g)) for m, g in (c.split("@") for c in args.cases.split(","))]
        if args.cases
        else [(m, int(g)) for m in args.models.split(",") for g in args.gpus.split(",")]
    )
    rows = []
    for kind in args.clusters.split(","):
        for model, gpus in pairs:
            for per in (float(p) for p in args.per_gpu.split(",")):
                batch = max(4, int(gpus * per))
                case = {"model": model, "kind": kind, "gpus": gpus, "batch": batch}
                row = run_fresh(__file__, case, args.timeout)
                print(json.dumps(row), flush=True)
                rows.append(row)
    meta = {
        **planning_meta("plan_real.py"),
        "models": "transformers' own classes at their published configs "
        "(benchmarks/real_models.py), random weights on the meta device",
        "training": f"bf16 mixed precision, AdamW, {SEQ_LEN}-token sequences, global batch "
        f"{args.per_gpu} sequences per GPU (at least 4)",
        "plan_s": "the planner's wall time in one fresh process (imports and building the "
        "model excluded); load: the machine's 1-minute load average when the case started",
        "note": "predictions are analytic (published link and peak figures), not measured",
    }
    columns = ["model", "params_b", "cluster", "gpus", "batch", "load", *PLAN_COLUMNS, "phases"]
    write_results("plan_real", "Planning benchmark: transformers models", meta, rows, columns)


if __name__ == "__main__":
    main()
