"""Planning benchmark: GPT 125M .. 1T on simulated A100 and H100 clusters of 8 to 3072 GPUs.

Prints, and writes to benchmarks/results/plan_gpt.json and .md: tracing and planning time,
the plan's shape (mesh, pipeline stages, microbatches, predicted bubble), ILP size and the
predicted step time, throughput and model FLOP/s per GPU (or the memory shortfall when nothing
fits). The grid is sizes x GPU counts x global batches (in sequences per GPU); the named
cases are the large trainings of the literature, at their own batches: GPT-3 175B at 1536
sequences on 1024 A100s and Megatron's 1T GPT at 3072 on 3072 A100s.

    python benchmarks/plan_gpt.py [--sizes 1.3b,7b] [--gpus 8,64] [--per-gpu 0.5,2]
        [--clusters a100,h100] [--named 175b@1024x1536,1t@3072x3072 | --named none]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.errors import InfeasiblePlanError  # noqa: E402
from autoplan.graph.capture import capture  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.plan_rows import (  # noqa: E402
    CLUSTERS,
    PLAN_COLUMNS,
    plan_fields,
    planning_meta,
    run_fresh,
)
from benchmarks.results_io import write_results  # noqa: E402

SEQUENCES_PER_GPU = 0.5  # global batch = half a 2048-token sequence per GPU (at least 4)


NAMED = "175b@1024x1536,1t@3072x3072"  # size@gpus x global batch, on A100s
NAMED_VOCAB = 51200  # the named cases' vocabulary, as the literature trained them
TIMEOUT_S = 1800.0  # a case running longer is recorded as such


def run(size: str, gpus: int, kind: str, batch: int, vocab: int | None = None) -> dict[str, object]:
    path = ROOT / "costmodels" / CLUSTERS[kind]
    cluster = autoplan.Cluster.load(path, num_nodes=max(1, gpus // 8))
    vocab_size = {} if vocab is None else {"vocab_size": vocab}
    w = load_workload(
        ROOT / "examples/gpt.py",
        size=size,
        batch_size=batch,
        device="meta",
        dtype="bfloat16",
        **vocab_size,
    )
    start = time.perf_counter()
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    trace_s = time.perf_counter() - start
    num_params = graph.num_params
    row: dict[str, object] = {
        "model": f"gpt-{size}",
        "params_b": round(num_params / 1e9, 2),
        "cluster": kind,
        "gpus": gpus,
        "batch": batch,
        "graph_nodes": len(graph),
        "trace_s": round(trace_s, 2),
    }
    del graph  # planning traces again, as a user's plan() does
    start = time.perf_counter()
    try:
        plan = w.plan(cluster)
    except InfeasiblePlanError as e:
        row.update(
            plan_s=round(time.perf_counter() - start, 2), result="does not fit", detail=str(e)[:160]
        )
        return row
    row["plan_s"] = round(time.perf_counter() - start, 2)
    row.update(plan_fields(plan, batch * 2048, num_params, gpus))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="125m,1.3b,7b,175b")
    parser.add_argument("--gpus", default="8,64,512,1024")
    parser.add_argument("--per-gpu", default=str(SEQUENCES_PER_GPU))
    parser.add_argument("--clusters", default="a100,h100")
    parser.add_argument("--named", default=NAMED)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a case, run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(**json.loads(args.one))), flush=True)
        return
    logging.basicConfig(level=logging.WARNING)
    cases: list[tuple[str, str, int, int, int | None]] = [
        (kind, size, gpus, max(4, int(gpus * float(per))), None)
        for kind in args.clusters.split(",")
        for size in args.sizes.split(",")
        for gpus in (int(g) for g in args.gpus.split(","))
        for per in args.per_gpu.split(",")
    ]
    for named in [] if args.named == "none" else args.named.split(","):
        size, shape = named.split("@")
        gpus, batch = shape.split("x")
        cases.append(("a100", size, int(gpus), int(batch), NAMED_VOCAB))
    rows = []
    for kind, size, gpus, batch, vocab in cases:
        # each case in a fresh process, as a user plans: planned after the others in one
        # process, GPT-3 175B took 60.5 s against 49.0 s alone (what earlier cases leave)
        case = {"size": size, "gpus": gpus, "kind": kind, "batch": batch, "vocab": vocab}
        row = run_fresh(__file__, case, TIMEOUT_S)
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {
        **planning_meta("plan_gpt.py"),
        "model": "bf16 parameters, AdamW, 2048-token sequences; global batch: sequences per "
        f"GPU {args.per_gpu} (at least 4), and the named cases' own (vocabulary {NAMED_VOCAB})",
        "note": "predictions are analytic (published link and peak figures), not measured",
    }
    columns = ["model", "cluster", "gpus", "batch", "graph_nodes", *PLAN_COLUMNS]
    write_results("plan_gpt", "Planning benchmark", meta, rows, columns)


if __name__ == "__main__":
    main()
