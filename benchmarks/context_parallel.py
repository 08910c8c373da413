"""Context parallelism at long sequences: transformers' Llama 3 8B (`benchmarks/real_models.py`)
on one 128k-token sequence, bf16 mixed precision, AdamW, on 64 simulated H100s
(costmodels/h100-sxm-8.json, 8 nodes), planned in one stage on each mesh with and without
attention split along the sequence (the ILP's space with the rule left out), and the
conventional ``baseline(tp=8, cp=8)``, without and with every layer recomputed.

Prints, and writes to benchmarks/results/context_parallel.json and .md: for each plan, its
predicted step time (compute and communication), its memory per device against the limit,
and how its attentions are placed.

    python benchmarks/context_parallel.py [--seq-len 131072] [--meshes 8x8,64] [--timeout 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.baselines.build import baseline_of_graph  # noqa: E402
from autoplan.baselines.propagate import Layout  # noqa: E402
from autoplan.costmodel.pricer import Pricer  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.graph.blocks import find_sharing  # noqa: E402
from autoplan.graph.cut import DEFAULT_MAX_LAYERS  # noqa: E402
from autoplan.graph.ir import Graph  # noqa: E402
from autoplan.graph.recompute import FUSED_ATTENTION  # noqa: E402
from autoplan.modes import RecomputeMode  # noqa: E402
from autoplan.search.mesh_plans import SpaceFilter, solve_mesh  # noqa: E402
from autoplan.search.recompute_ilp import RecomputeChoice  # noqa: E402
from autoplan.strategies.attention import context_axes  # noqa: E402
from autoplan.strategies.space import NodeStrategies  # noqa: E402
from autoplan.workload import load_workload  # noqa: E402
from benchmarks.plan_rows import load_average  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

GiB = 2**30
COLUMNS = [
    "plan", "mesh", "attention", "fits", "recomputed", "step_s", "compute_s", "comm_s",
    "memory_gib", "limit_gib", "solver", "solve_s",
]  # fmt: skip


def _without_cp(graph: Graph) -> SpaceFilter:
    def restrict(space: dict[str, NodeStrategies]) -> dict[str, NodeStrategies]:
        out = dict(space)
        for name, ns in space.items():
            node = graph.node(name)
            if node.op.startswith(FUSED_ATTENTION):
                ndim = len(node.outputs[0].shape)
                kept = tuple(s for s in ns.strategies if not context_axes(s.inputs, ndim))
                out[name] = dataclasses.replace(ns, strategies=kept)
        return out

    return restrict


def _attention(graph: Graph, inputs: list[tuple[str, ...]]) -> str:
    return "; ".join(sorted({" ".join(f"({', '.join(spec)})" for spec in s[:3]) for s in inputs}))


def planned(
    graph: Graph,
    cluster: autoplan.Cluster,
    mesh: tuple[int, ...],
    cp: bool,
    limit: float,
    timeout: float,
) -> dict[str, object]:
    pricer = Pricer(cluster, mesh, "adamw")
    start = time.perf_counter()
    restrict = None if cp else _without_cp(graph)
    recompute = RecomputeChoice.of(graph, DEFAULT_MAX_LAYERS)
    sharing = find_sharing(graph)
    found = solve_mesh(graph, sharing, pricer, limit, timeout, restrict, recompute=recompute)
    row: dict[str, object] = {
        "plan": "planner" + ("" if cp else ", no context parallelism"),
        "mesh": "x".join(map(str, mesh)),
        "solve_s": round(time.perf_counter() - start, 1),
        "limit_gib": round(limit / GiB, 1),
    }
    if isinstance(found, float):
        return {**row, "fits": f"no: needs {found / GiB:.1f} GiB"}
    step, assignment = found.step, found.result.assignment
    layers = found.pricer.recompute.layers
    attention = [assignment[n.name].inputs for n in graph if n.op.startswith(FUSED_ATTENTION)]
    return {
        **row,
        "attention": _attention(graph, attention),
        "fits": "yes",
        "solver": found.result.solution.status
        + (f" (gap {gap:.1%})" if (gap := found.result.solution.gap) else ""),
        "step_s": round(step.compute_s + step.comm_s, 4),
        "compute_s": round(step.compute_s, 4),
        "comm_s": round(step.comm_s, 4),
        "memory_gib": round(step.memory_bytes / GiB, 1),
        "recomputed": ", ".join(
            f"{n} {mode}"
            for mode in sorted({m for _, m, _ in layers})
            if (n := sum(m == mode for _, m, _ in layers))
        ),
    }


def conventional(
    graph: Graph, cluster: autoplan.Cluster, tp: int, cp: int, recompute: RecomputeMode
) -> dict[str, object]:
    name = f"baseline(tp={tp}, cp={cp}, recompute={recompute})"
    row: dict[str, object] = {"plan": name, "mesh": f"{cp}x{tp}"}
    start = time.perf_counter()
    try:
        plan = baseline_of_graph(graph, cluster, Layout(dp=1, tp=tp, cp=cp, recompute=recompute))
    except AutoplanError as e:
        return {**row, "fits": f"no: {e}"}
    p = plan.predicted
    attention = [n.inputs for n in plan.nodes.values() if n.op.startswith(FUSED_ATTENTION)]
    specs = [[tuple(placements.values()) for placements in inputs] for inputs in attention]
    return {
        **row,
        "attention": _attention(graph, specs),  # type: ignore[arg-type]
        "fits": "yes",
        "step_s": round(p.step_time_s, 4),
        "compute_s": round(p.compute_s, 4),
        "comm_s": round(p.comm_s, 4),
        "memory_gib": round(p.peak_memory_bytes / GiB, 1),
        "limit_gib": round(p.memory_limit_bytes / GiB, 1),
        "solve_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--meshes", default="8x8")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    cluster = autoplan.Cluster.load(ROOT / "costmodels" / "h100-sxm-8.json", num_nodes=8)
    limit = cluster.device.memory_bytes * autoplan.PlanOptions().memory_fraction
    meta = {
        "command": "python benchmarks/context_parallel.py " + " ".join(sys.argv[1:]),
        "model": "transformers' Llama 3 8B (benchmarks/real_models.py), meta device",
        "step": f"1 sequence of {args.seq_len} tokens, bf16 mixed precision, AdamW",
        "cluster": "costmodels/h100-sxm-8.json, 8 nodes (64 GPUs)",
        "load": load_average(),
        "note": "predictions of the cost model, not measurements; one stage, the ILP "
        "choosing which layers recompute",
    }
    start = time.perf_counter()
    w = load_workload(
        ROOT / "benchmarks/real_models.py", model="llama3-8b", batch_size=1, seq_len=args.seq_len
    )
    graph = w.trace(precision="bf16")
    meta["trace_s"] = round(time.perf_counter() - start, 1)
    rows = []
    for text in args.meshes.split(","):
        mesh = tuple(int(n) for n in text.split("x"))
        for cp in (True, False):
            rows.append(planned(graph, cluster, mesh, cp, limit, args.timeout))
            print(rows[-1], flush=True)
    for recompute in (RecomputeMode.NONE, RecomputeMode.FULL):
        rows.append(conventional(graph, cluster, 8, 8, recompute))
        print(rows[-1], flush=True)
    write_results(
        "context_parallel", "Context parallelism: Llama 3 8B at 128k tokens", meta, rows, COLUMNS
    )


if __name__ == "__main__":
    main()
