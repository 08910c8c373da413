"""The planner against every conventional plan: for each model and cluster, the planner's plan
and every baseline `autoplan.baseline` can write (`autoplan.baselines.grid.every_degrees`: dp x
tp x pp x microbatches x ZeRO 0-3 x sequence parallelism x 1F1B or Interleaved1F1B x every
layer recomputed or not, those that divide and fit), all priced by the same cost model
(`autoplan.costmodel.step_price.price_step` and the pipeline formula).

Each case plans twice: with the default options, against every conventional plan; and with
the mesh pinned to each one-stage baseline's mesh (one stage only), against the baselines on
that mesh. ``ratio`` is the planner's step time over the best conventional one: at most
1.001 everywhere is the claim (tests/test_optimality.py checks a few cases in CI).

Prints, and writes to benchmarks/results/vs_baselines.json and .md; with ``--update``, the
rows of the cases and clusters run replace theirs in those files, the others kept (the
commands of both runs written).

    python benchmarks/vs_baselines.py [--cases mlp-large,gpt-small] [--clusters cpu4,a100x8]
        [--update]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan import PlanOptions  # noqa: E402
from autoplan.baselines.grid import (  # noqa: E402
    Degrees,
    batch_of,
    conventional_plans,
    every_degrees,
)
from autoplan.baselines.propagate import mesh_of  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from benchmarks.results_io import RESULTS, write_results  # noqa: E402
from tests.models.zoo import workload as zoo  # noqa: E402

TOLERANCE = 1.001


def _example(name: str, **options: object) -> Callable[[], Workload]:
    return lambda: load_workload(ROOT / "examples" / f"{name}.py", **options)


CASES: dict[str, Callable[[], Workload]] = {
    "mlp-large-batch": _example("mlp", hidden=1024, batch_size=1024, device="meta"),
    "mlp-small-batch": _example("mlp", hidden=1024, batch_size=16, device="meta"),
    "gpt-small": _example("gpt", size="small", batch_size=16, device="meta"),
    "gpt-125m": _example("gpt", size="125m", batch_size=16, seq_len=512, device="meta"),
    "zoo-gpt2": lambda: zoo("gpt2", batch_size=16, seq_len=32),
    "zoo-llama": lambda: zoo("llama", batch_size=16, seq_len=32),
}
CLUSTERS = {
    "cpu4": ("cpu-gloo-4.json", 1),
    "a100x8": ("dgx-a100-80gb.json", 1),
    "a100x64": ("dgx-a100-80gb.json", 8),
    "a100x512": ("dgx-a100-80gb.json", 64),
}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def _layout(plan: autoplan.Plan) -> str:
    mesh = "x".join(map(str, plan.mesh.shape))
    if plan.pipeline is None:
        return mesh
    return f"{mesh}, {plan.pipeline.num_microbatches} mb {plan.pipeline.schedule}"


def compare(case: str, cluster_name: str) -> list[dict[str, object]]:
    path, nodes = CLUSTERS[cluster_name]
    cluster = autoplan.Cluster.load(ROOT / "costmodels" / path, num_nodes=nodes)
    w = CASES[case]()
    graph_for = w.trace
    start = time.perf_counter()
    degrees = every_degrees(cluster.num_devices, batch_of(graph_for(1)))
    plans = list(conventional_plans(graph_for, cluster, degrees))
    baselines_s = time.perf_counter() - start
    rows = []
    variants: list[tuple[str, PlanOptions, list[tuple[Degrees, autoplan.Plan]]]] = [
        ("default", PlanOptions(), plans)
    ]
    meshes = sorted({mesh_of(d.dp, d.tp) for d, _ in plans if d.pp == 1})
    for mesh in meshes:
        on_mesh = [(d, p) for d, p in plans if d.pp == 1 and mesh_of(d.dp, d.tp) == mesh]
        options = PlanOptions(mesh_shape=mesh, pipeline=False)
        variants.append((f"mesh {'x'.join(map(str, mesh))}", options, on_mesh))
    for name, options, rivals in variants:
        start = time.perf_counter()
        plan = w.plan(cluster, options)
        plan_s = time.perf_counter() - start
        row: dict[str, object] = {
            "case": case,
            "cluster": cluster_name,
            "devices": cluster.num_devices,
            "options": name,
            "plan_s": round(plan_s, 2),
            "planned_ms": _ms(plan.predicted.step_time_s),
            "planned": _layout(plan),
            "found_by": "search" if plan.solver.status != "baseline" else "conventional",
            "conventional": len(rivals),
        }
        if rivals:
            best_degrees, best = min(rivals, key=lambda r: r[1].predicted.step_time_s)
            ratio = plan.predicted.step_time_s / best.predicted.step_time_s
            row.update(
                best_ms=_ms(best.predicted.step_time_s),
                best=str(best_degrees),
                ratio=round(ratio, 4),
                verdict="ok" if ratio <= TOLERANCE else "SLOWER",
            )
        if name == "default":
            row["baselines_s"] = round(baselines_s, 2)
        print(row, flush=True)
        rows.append(row)
    return rows


def _earlier(rows: list[dict[str, object]]) -> tuple[list[dict[str, object]], str]:
    """``rows`` in place of the earlier results' rows of their cases and clusters, the
    others kept, in the order of `CLUSTERS` and `CASES`; and the earlier results' command."""
    earlier = json.loads((RESULTS / "vs_baselines.json").read_text())
    ran = {(r["case"], r["cluster"]) for r in rows}
    merged = [r for r in earlier["rows"] if (r["case"], r["cluster"]) not in ran] + rows
    order = {name: i for i, name in enumerate([*CLUSTERS, *CASES])}
    merged.sort(key=lambda r: (order[str(r["cluster"])], order[str(r["case"])]))
    return merged, earlier["meta"]["command"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--update", action="store_true", help="keep the other cases' rows")
    args = parser.parse_args()
    rows = []
    for cluster_name in args.clusters.split(","):
        for case in args.cases.split(","):
            rows += compare(case, cluster_name)
    command = "python benchmarks/vs_baselines.py " + " ".join(sys.argv[1:])
    if args.update:
        kept, earlier = _earlier(rows)
        rows, command = kept, f"{earlier}; then {command}"
    slower = sum(1 for r in rows if r.get("verdict") == "SLOWER")
    kept = sum(1 for r in rows if r["found_by"] == "conventional")
    compared = sum(1 for r in rows if "ratio" in r)
    meta = {
        "command": command,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "clusters": ", ".join(
            f"{k}: costmodels/{p} x {n} node(s)" for k, (p, n) in CLUSTERS.items()
        ),
        "conventional plans": "every dp x tp x pp x microbatches x ZeRO 0-3 x sequence parallel "
        "x 1F1B or Interleaved1F1B (2 stages a device group) x every layer recomputed or not "
        "baseline that divides and fits (autoplan.baselines.grid.every_degrees)",
        "ratio": "planner's predicted step time / the best conventional plan's (same cost model)",
        "plans compared": f"{compared} of {len(rows)} (the others have no conventional plan)",
        "worst ratio": max((r["ratio"] for r in rows if "ratio" in r), default=None),
        "slower than the best conventional plan (ratio > 1.001)": slower,
        "kept from the conventional plans of their shape (autoplan.api), not the search": kept,
    }
    columns = [
        "case", "cluster", "devices", "options", "planned_ms", "planned", "found_by", "best_ms",
        "best", "ratio", "verdict", "conventional", "plan_s", "baselines_s",
    ]  # fmt: skip
    write_results(
        "vs_baselines", "The planner against every conventional plan", meta, rows, columns
    )


if __name__ == "__main__":
    main()
