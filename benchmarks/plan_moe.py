"""Planning benchmark for mixtures of experts: the 64-expert GPT of examples/moe.py (24
layers, d 2048, experts of hidden 8192, top-2) on simulated A100 clusters, planned by
autoplan and compared with GShard's plan (`autoplan.baseline(dp=N, tp=1, ep=N)`: experts
split over all GPUs, tokens sent by all-to-all) and with plain data parallelism, all priced by
the same cost model.

Prints, and writes to benchmarks/results/plan_moe.json and .md: planning time, the chosen
mesh and stages, the experts' placement, and each plan's predicted step time and memory.

    python benchmarks/plan_moe.py [--gpus 64] [--layers 24] [--batch 128]
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
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.planfile.show import fmt_bytes, fmt_time  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402


def priced(plan: autoplan.Plan, experts_weight: str = "w_in") -> dict[str, object]:
    """A plan's row: its mesh, stages, how a weight of the experts (the first parameter whose
    name ends so) is stored, its predicted step time and memory per GPU."""
    experts = {
        axis: placement
        for name, p in plan.params.items()
        if name.endswith(experts_weight)
        for axis, placement in p.storage.items()
    }
    return {
        "mesh": " x ".join(
            f"{a}={s}" for a, s in zip(plan.mesh.axes, plan.mesh.shape, strict=True)
        ),
        "stages": len(plan.stages),
        "experts": ", ".join(f"{a}={p}" for a, p in experts.items()),
        "step_s": plan.predicted.step_time_s,
        "memory": plan.predicted.peak_memory_bytes,
    }


def run(gpus: int, layers: int, batch: int) -> list[dict[str, object]]:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=gpus // 8)
    w = load_workload(
        ROOT / "examples/moe.py",
        size="64e",
        num_layers=layers,
        batch_size=batch,
        device="meta",
        dtype="bfloat16",
    )
    rows: list[dict[str, object]] = []
    start = time.perf_counter()
    plan = w.plan(cluster)
    rows.append({"plan": "autoplan", "plan_s": round(time.perf_counter() - start, 1)})
    rows[-1].update(priced(plan))
    for name, degrees in (
        (f"GShard (dp={gpus}, ep={gpus})", {"dp": gpus, "tp": 1, "ep": gpus}),
        (f"data parallel (dp={gpus})", {"dp": gpus, "tp": 1}),
    ):
        row: dict[str, object] = {"plan": name, "plan_s": "-"}
        try:
            row.update(priced(w.baseline(cluster, **degrees)))
        except AutoplanError as e:
            row.update({"mesh": "-", "stages": "-", "experts": "-", "step_s": None, "memory": None})
            row["error"] = str(e).split(";")[0][:120]
        rows.append(row)
    return rows


COLUMNS = ["plan", "planning", "mesh", "stages", "experts stored", "predicted step", "memory/GPU"]


def shown(r: dict[str, object]) -> dict[str, object]:
    """A row as the results table shows it."""
    step, memory = r["step_s"], r["memory"]
    return {
        "plan": r["plan"],
        "planning": f"{r['plan_s']} s",
        "mesh": r["mesh"],
        "stages": r["stages"],
        "experts stored": r["experts"],
        "predicted step": fmt_time(step) if isinstance(step, float) else r.get("error", "-"),
        "memory/GPU": fmt_bytes(memory) if isinstance(memory, float) else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    rows = run(args.gpus, args.layers, args.batch)
    title = (
        f"64-expert GPT ({args.layers} layers, top-2, batch {args.batch} x 2048, bf16) on "
        f"{args.gpus} simulated A100s"
    )
    report("plan_moe", title, args, rows)


def report(
    name: str, title: str, args: argparse.Namespace, rows: list[dict[str, object]], **meta: str
) -> None:
    """Print ``rows`` as `shown` and write them to benchmarks/results/``name``, the command
    (``--gpus``, ``--layers``, ``--batch``) and ``meta`` in the header."""
    table = [shown(r) for r in rows]
    for r in table:
        print(" | ".join(str(r[c]) for c in COLUMNS))
    header = {
        "command": f"python benchmarks/{name}.py --gpus {args.gpus} --layers {args.layers} "
        f"--batch {args.batch}",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "torch": torch.__version__,
        **meta,
    }
    write_results(name, title, header, table, COLUMNS)


if __name__ == "__main__":
    main()
