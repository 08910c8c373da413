"""Compute fidelity on one GPU: does a one-GPU plan's predicted step time match a real training
step on that GPU, priced with the GPU's own profile?

One GPU has nothing to communicate with, so this checks what the fidelity benchmark on CPU
ranks cannot: the compute curves (matmul, element-wise, activation) and `op_overhead` that
`autoplan profile --nproc 1` measured on the GPU, against whole steps of the GPT and MLP
examples (forward, backward, fused AdamW) in bfloat16 and float32, from launch-bound to
compute-bound sizes. Three steps, because the measuring machine (a lent GPU) and this host do
not share a torch:

    python benchmarks/gpu_steps.py plans .gpu        # here: each case's one-GPU plan, as JSON
    python benchmarks/gpu_steps.py measure .gpu -o steps.json   # on the GPU machine
    python benchmarks/gpu_steps.py report steps.json --cluster costmodels/h100-sxm-8-profiled.json

`measure` times each case's step in plain torch (3 untimed steps, then the median of 10, each
ended by a synchronize) and, where `plans` wrote the case's plan, through autoplan's executor on
a one-rank NCCL group (`autoplan.parallelize` with the plan). `report` plans each case for one
GPU of the profiled cluster (on meta tensors) and writes benchmarks/results/gpu_steps.json and
.md: predicted and measured seconds, their ratio (measured / predicted), the median absolute
error and the rank correlation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.stats import median_error, spearman  # noqa: E402
from benchmarks.steps import median_seconds, one_device, plain_step  # noqa: E402

GPT = "examples/gpt.py"
MLP = "examples/mlp.py"
# launch-bound to compute-bound: small models whose kernels are shorter than their launches,
# GPT-2/3 sizes at 1024 tokens, float32 (no TF32, as torch's default) and bfloat16
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-small-b8-fp32": (GPT, {"size": "small", "batch_size": 8, "seq_len": 128}),
    "gpt-125m-b4-bf16": (GPT, {"size": "125m", "batch_size": 4, "seq_len": 1024}),
    "gpt-125m-b16-bf16": (GPT, {"size": "125m", "batch_size": 16, "seq_len": 1024}),
    "gpt-125m-b8-fp32": (GPT, {"size": "125m", "batch_size": 8, "seq_len": 1024}),
    "gpt-350m-b8-bf16": (GPT, {"size": "350m", "batch_size": 8, "seq_len": 1024}),
    "gpt-1.3b-b4-bf16": (GPT, {"size": "1.3b", "batch_size": 4, "seq_len": 1024}),
    "mlp-512x6-b1024": (MLP, {"hidden": 512, "num_layers": 6, "batch_size": 1024}),
    "mlp-2048x8-b4096": (MLP, {"hidden": 2048, "num_layers": 8, "batch_size": 4096}),
    "mlp-4096x8-b8192": (MLP, {"hidden": 4096, "num_layers": 8, "batch_size": 8192}),
}
WARMUP = 3
STEPS = 10
LR = 1e-4
ONE_GPU_CLUSTER = "cluster.json"  # in the plans folder, beside <case>.json


def workload(case: str, device: str) -> Workload:
    path, options = CASES[case]
    dtype = {"dtype": "bfloat16"} if case.endswith("bf16") else {}
    return load_workload(ROOT / path, device=device, **options, **dtype)


def plan_case(case: str, cluster: autoplan.Cluster) -> autoplan.Plan:
    w = workload(case, "meta")
    return w.plan(cluster)


def write_plans(folder: Path, cluster_path: str) -> None:
    """Each case's one-GPU plan, and the one-GPU cluster they were made for, into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    cluster = one_device(autoplan.Cluster.load(cluster_path))
    cluster.save(folder / ONE_GPU_CLUSTER)
    for case in CASES:
        plan_case(case, cluster).save(str(folder / f"{case}.json"))
        print(f"wrote {folder / case}.json")


def _plain(w: Workload) -> float:
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=LR, fused=True)
    step = plain_step(w.model, optimizer, w.loss_fn, w.example_inputs, w.example_target)
    return median_seconds(step, WARMUP, STEPS, cuda=True)


def _executor(w: Workload, folder: Path, case: str) -> float:
    step = w.parallelize(
        folder / ONE_GPU_CLUSTER,
        train=autoplan.TrainOptions(optimizer_options={"lr": LR}),
        plan=folder / f"{case}.json",
    )
    return median_seconds(
        lambda: step(w.example_inputs, w.example_target), WARMUP, STEPS, cuda=True
    )


def measure(folder: Path, out: Path) -> None:
    """Time every case on this machine's GPU, in plain torch and through the executor."""
    if not torch.cuda.is_available():
        raise SystemExit("measure needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    found: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": {},
    }
    for case in CASES:
        row: dict[str, Any] = {"plain_s": _plain(workload(case, "cuda"))}
        torch.cuda.empty_cache()
        try:
            row["executor_s"] = _executor(workload(case, "cuda"), folder, case)
        except Exception as e:  # a foreign torch may fail anywhere: record it
            row["executor_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
        found["cases"][case] = row
        print(case, row, flush=True)
        out.write_text(json.dumps(found, indent=1) + "\n")  # what was measured survives a crash
    dist.destroy_process_group()


def report(measured_path: Path, cluster_path: str) -> None:
    """Predicted against measured, into benchmarks/results/gpu_steps.{json,md}."""
    measured = json.loads(measured_path.read_text())
    cluster = one_device(autoplan.Cluster.load(cluster_path))
    rows = []
    for case, found in measured["cases"].items():
        seconds = plan_case(case, cluster).predicted.step_time_s
        row = {
            "case": case,
            "predicted_s": round(seconds, 5),
            "plain_s": round(found["plain_s"], 5),
            "ratio": round(found["plain_s"] / seconds, 3),
        }
        if "executor_s" in found:
            row["executor_s"] = round(found["executor_s"], 5)
            row["executor_ratio"] = round(found["executor_s"] / seconds, 3)
        rows.append(row)
        print(row)
    predicted = [r["predicted_s"] for r in rows]
    plain = [r["plain_s"] for r in rows]
    meta = {
        "what": "one-GPU training steps (forward, backward, fused AdamW) of the examples: "
        "predicted by the planner with the GPU's profile against measured in plain torch and "
        "through autoplan's executor (`python benchmarks/gpu_steps.py`, module docstring)",
        "measured on": f"{measured['device']}, torch {measured['torch']}",
        "cluster": f"{cluster_path}, one device of it",
        "median error (plain)": f"{median_error(predicted, plain):.1%}",
        "rank correlation (plain)": round(spearman(predicted, plain), 3),
        "executor failed": _failures(measured) or "nowhere",
    }
    columns = ["case", "predicted_s", "plain_s", "ratio", "executor_s", "executor_ratio"]
    write_results("gpu_steps", "Compute fidelity on one GPU", meta, rows, columns)
    print("\n".join(f"{k}: {v}" for k, v in meta.items()))


def _failures(measured: dict[str, Any]) -> str:
    """The executor's errors, each once (its case-specific details dropped), with its cases."""
    cases: dict[str, list[str]] = {}
    for case, found in measured["cases"].items():
        if "executor_error" in found:
            cases.setdefault(found["executor_error"].split(" (")[0], []).append(case)
    return "; ".join(f"{error} ({', '.join(names)})" for error, names in cases.items())


def matmul_efficiency(cluster_path: str, datasheet_path: str) -> None:
    """The profile's matmul rates against the datasheet's peaks, size by size, into
    benchmarks/results/gpu_matmul.{json,md}."""
    curves = autoplan.Cluster.load(cluster_path).curves.matmul
    peak = autoplan.Cluster.load(datasheet_path).device.peak_flops
    rows = []
    for i, flops in enumerate(curves["float32"].xs):
        row: dict[str, Any] = {"n": round((flops / 2) ** (1 / 3))}
        for dtype, curve in sorted(curves.items()):
            if i < len(curve.xs):
                rate = curve.xs[i] / curve.seconds[i]
                row[f"{dtype} TFLOP/s"] = round(rate / 1e12, 1)
                row[f"{dtype} of peak"] = f"{rate / peak[dtype]:.0%}"
        rows.append(row)
    meta = {
        "what": "n x n @ n x n matmuls as `autoplan profile` timed them (cold operands, median "
        "of 3 passes, made monotone in time), against the datasheet's peak",
        "profile": cluster_path,
        "peaks (TFLOP/s)": ", ".join(f"{d} {p / 1e12:g}" for d, p in sorted(peak.items()))
        + f" ({datasheet_path})",
    }
    write_results("gpu_matmul", "Matmul efficiency of one GPU", meta, rows, list(rows[0]))
    for row in rows:
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plans", help="write each case's one-GPU plan into FOLDER")
    p.add_argument("folder", type=Path)
    p.add_argument("--cluster", default="costmodels/h100-sxm-8.json")
    m = sub.add_parser("measure", help="time each case on this machine's GPU")
    m.add_argument("folder", type=Path, help="where `plans` wrote the plans")
    m.add_argument("-o", "--output", type=Path, required=True)
    r = sub.add_parser("report", help="compare with the predictions; write the results")
    r.add_argument("measured", type=Path)
    r.add_argument("--cluster", default="costmodels/h100-sxm-8-profiled.json")
    r.add_argument("--datasheet", default="costmodels/h100-sxm-8.json", help="the peaks")
    args = parser.parse_args()
    if args.command == "plans":
        write_plans(args.folder, args.cluster)
    elif args.command == "measure":
        measure(args.folder, args.output)
    else:
        report(args.measured, args.cluster)
        matmul_efficiency(args.cluster, args.datasheet)


if __name__ == "__main__":
    main()
