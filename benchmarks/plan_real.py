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
        [--per-gpu 0.5,2] [--clusters a100,h100] [--cases llama3-405b@512@h100@2,...]
        [--timeout 600] [--results plan_real]

By default every model on 64 and 512 A100s and H100s at 0.5 and 2 sequences a GPU (48
cases); ``--cases`` names cases instead, each ``model@gpus[@cluster[@sequences a GPU]]``
(the cluster and sequences a GPU default to the first of ``--clusters`` and ``--per-gpu``).
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
from benchmarks.real_models import MODELS  # noqa: E402
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


def _case(text: str, kind: str, per: float) -> tuple[str, int, str, float]:
    """``model@gpus[@cluster[@per_gpu]]`` as (model, gpus, cluster, sequences a GPU)."""
    model, gpus, *rest = text.split("@")
    if model not in MODELS or (rest and rest[0] not in CLUSTERS) or len(rest) > 2:
        raise SystemExit(f"case {text!r}: write model@gpus[@cluster[@per_gpu]] with a model of "
                         f"{', '.join(MODELS)} and a cluster of {', '.join(CLUSTERS)}")  # fmt: skip
    return model, int(gpus), rest[0] if rest else kind, float(rest[1]) if len(rest) > 1 else per


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default="64,512")
    parser.add_argument("--per-gpu", default="0.5,2")
    parser.add_argument("--clusters", default="a100,h100")
    parser.add_argument(
        "--cases",
        help="model@gpus[@cluster[@per_gpu]], comma-separated, in place of the grid of "
        "--models x --gpus x --clusters x --per-gpu",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take")
    parser.add_argument(
        "--results", default="plan_real", help="the results' name in benchmarks/results/"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a case, run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(**json.loads(args.one))), flush=True)
        return
    logging.basicConfig(level=logging.WARNING)
    kinds, pers = args.clusters.split(","), [float(p) for p in args.per_gpu.split(",")]
    cases = (
        [_case(c, kinds[0], pers[0]) for c in args.cases.split(",")]
        if args.cases
        else [
            (model, int(gpus), kind, per)
            for kind in kinds
            for model in args.models.split(",")
            for gpus in args.gpus.split(",")
            for per in pers
        ]
    )
    rows = []
    for model, gpus, kind, per in cases:
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
        "(batch) the GPUs times the case's sequences per GPU (at least 4)",
        "plan_s": "the planner's wall time in one fresh process (imports and building the "
        "model excluded); load: the machine's 1-minute load average when the case started",
        "note": "predictions are analytic (published link and peak figures), not measured",
    }
    columns = ["model", "params_b", "cluster", "gpus", "batch", "load", *PLAN_COLUMNS, "phases"]
    write_results(args.results, "Planning benchmark: transformers models", meta, rows, columns)


if __name__ == "__main__":
    main()
