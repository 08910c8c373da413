"""Tracing a real model under bf16 autocast: export's one trace at the ATen level
(`autoplan.torch_private.aten_export`) against export then ``run_decompositions``'s retrace
(`autoplan.graph.passes.decomposed`), each in a fresh process, in CPU seconds (the 2-core
host is shared: wall seconds say more of the load than of the trace), with the traced
graph's size and whether its ops match (`tests/test_precision.py`'s comparison).

Prints, and writes to benchmarks/results/trace_speed.json and .md.

    python benchmarks/trace_speed.py [--models llama3-8b,llama3-70b] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autoplan.graph import capture as capture_module  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.plan_rows import load_average, run_fresh  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

PATHS = {"two traces": False, "one ATen trace": True}


def run(model: str, batch: int, path: str) -> dict[str, object]:
    w = load_workload(ROOT / "benchmarks/real_models.py", model=model, batch_size=batch)
    capture_module.ATEN_EXPORT = PATHS[path]
    load = load_average()
    cpu, wall = time.process_time(), time.perf_counter()
    graph = capture_module.capture(w.model, w.example_inputs, precision="bf16")
    return {
        "model": model,
        "batch": batch,
        "path": path,
        "load": load,
        "cpu_s": round(time.process_time() - cpu, 1),
        "wall_s": round(time.perf_counter() - wall, 1),
        "nodes": len(graph),
        "ops": [n.op for n in graph if n.kind == "op"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a case, run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(**json.loads(args.one))), flush=True)
        return
    rows = []
    for model in args.models.split(","):
        found = {}
        for path in PATHS:
            case = {"model": model, "batch": args.batch, "path": path}
            found[path] = run_fresh(__file__, case, args.timeout)
        copies = {"aten.clone.default", "aten.lift_fresh_copy.default"}
        ops = [["copy" if op in copies else op for op in r.get("ops", [])] for r in found.values()]
        for row in found.values():
            row.pop("ops", None)
            row["same_ops"] = ops[0] == ops[1] and bool(ops[0])
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {
        "command": "python benchmarks/trace_speed.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, 2 threads",
        "torch": torch.__version__,
        "trace": "the train step (model and its own loss) of transformers' class at its "
        "published config (benchmarks/real_models.py) on the meta device, under bf16 autocast",
        "cpu_s": "the process's CPU seconds for capture() (export, the passes, the IR), "
        "each path in a fresh process; load: the 1-minute load average as it began",
        "same_ops": "the two graphs' ops alike, in order (a constant's copy is lift_fresh_copy "
        "in one, clone in the other)",
    }
    columns = ["model", "batch", "path", "load", "cpu_s", "wall_s", "nodes", "same_ops"]
    title = "Tracing under autocast: one ATen trace or two"
    write_results("trace_speed", title, meta, rows, columns)


if __name__ == "__main__":
    main()
