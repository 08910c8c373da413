"""Cost-model fidelity: does a plan's predicted step time (`plan.predicted.step_time_s`) match
the step time measured when the plan is trained, and does it rank plans as they really rank?

On 4 local CPU ranks (gloo), the host is profiled first (`autoplan profile --nproc 4`, ~4.5
minutes, written to benchmarks/results/fidelity-profile.json: the host's speed drifts by ~10%
between runs, so the profile is taken right before measuring, and a matmul timed after each
round of measurements says how far it drifted since), then every plan of the MLP and GPT
examples (data parallel, Megatron tensor parallel, ZeRO-3, 2-D, pipelines, the planner's own
choice and `autoplan.baseline`'s plans) is planned on rank 0, broadcast, built, and trained, all
in one torchrun job, in interleaved rounds.

    python benchmarks/fidelity.py            # starts torchrun itself; ~7 minutes on 2 cores
    python benchmarks/fidelity.py --committed-profile   # with costmodels/cpu-gloo-4-profiled.json
    python benchmarks/fidelity.py --render   # only rewrite fidelity.md from fidelity.json

The plans are in `fidelity_plans.py`, how they are measured in `fidelity_measure.py`, the
statistics and the report in `fidelity_report.py`, and what the model misses and why in
`fidelity_notes.md`, which the report ends with.

Prints one line per plan, and writes benchmarks/results/fidelity.json and .md: each plan's
predicted and measured time and their ratio (measured / predicted), the median absolute relative
error (|predicted - measured| / measured), the Spearman rank correlation (per model and pooled),
the planner's own plan against the fastest measured one, and how busy the machine was (load
average before, during and after; the CPU share other processes took while measuring).
Targets (issue 5): rank correlation >= 0.9, median error <= 15%, own plan within 1.10x of the
fastest measured plan.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from benchmarks.fidelity_measure import (  # noqa: E402
    PROBE_N,
    ROUNDS,
    STEPS,
    WARMUP,
    load,
    measure_model,
)
from benchmarks.fidelity_plans import MODELS, WORLD  # noqa: E402
from benchmarks.fidelity_report import BUSY_ELSEWHERE, render, write  # noqa: E402
from benchmarks.results_io import RESULTS  # noqa: E402
from benchmarks.steps import torchrun  # noqa: E402

CLUSTER = "costmodels/cpu-gloo-4-profiled.json"  # with --committed-profile
PROFILED = "benchmarks/results/fidelity-profile.json"  # profiled by each run


def _meta(
    cluster_file: str,
    measuring: dict[str, dict[str, Any]],
    load_before: list[float],
    started: float,
) -> dict[str, Any]:
    """How the plans were measured, for the results' header."""
    return {
        "command": "python benchmarks/fidelity.py",
        "ranks": WORLD,
        "backend": "gloo",
        "cluster": (
            f"{cluster_file}, profiled by `autoplan profile --nproc {WORLD}` right before measuring"
            if cluster_file == PROFILED
            else cluster_file
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "workloads": {m: f"{path} {options}" for m, (path, options) in MODELS.items()},
        "steps": (
            f"per plan: {WARMUP} warm-up steps, then {ROUNDS} interleaved rounds of 1 untimed "
            f"+ {STEPS} timed steps; a step is the slowest rank's wall time after a barrier; "
            "measured_s is the median, iqr_s the interquartile range"
        ),
        "ratio": "measured_s / predicted_s; error = |predicted_s - measured_s| / measured_s",
        "cpu_s": (
            "CPU seconds of all ranks together per step (median); gloo waits sleep, so this "
            "is compute and framework work; busy = cpu_s / (cores x measured_s), the share "
            "of the machine the step kept busy"
        ),
        "same_as": (
            "the same decisions as an earlier plan: measured once, left out of the statistics"
        ),
        "load_average_1_5_15min": {"before": load_before, "after": load()},
        "measuring": measuring,
        "measuring_keys": (
            "load_average: 1/5/15-min load before and after each round (this job's own "
            "threads count, so it says little); cpu_share_of_other_processes: the CPU "
            "share taken by other processes while the plans were measured (from /proc; "
            f"above {BUSY_ELSEWHERE} the figures are suspect); plain_torch_s: the model "
            "trained by plain torch in one process, one thread, the others idle; "
            "plain_predicted_s: the cost model's time for that (planned for one device, "
            f"at a whole core); probe_vs_profile: a {PROBE_N}^3 float32 matmul timed as the "
            "profile times its curve, after each round, median, over the profile's time "
            "for it (above 1: the host ran slower while measuring than while profiling)"
        ),
        "wall_s": round(time.time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument(
        "--committed-profile",
        action="store_true",
        help=f"price the plans with {CLUSTER} instead of profiling the host first",
    )
    how.add_argument(
        "--render",
        action="store_true",
        help="only rewrite fidelity.md (and the summary) from benchmarks/results/fidelity.json",
    )
    args = parser.parse_args()
    if args.render:
        print("\n".join(render()))
        return
    if "RANK" not in os.environ:
        env = {"FIDELITY_STARTED": str(time.time())}
        if not args.committed_profile:
            # the host's speed drifts by ~10% between runs: profile it right before measuring
            profile = [sys.executable, "-m", "autoplan.cli", "profile", f"--nproc={WORLD}"]
            subprocess.run([*profile, "-o", str(ROOT / PROFILED)], check=True)
            env["FIDELITY_CLUSTER"] = PROFILED
        torchrun(__file__, WORLD, env)
    started = float(os.environ.get("FIDELITY_STARTED", time.time()))
    load_before = load()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cluster_file = os.environ.get("FIDELITY_CLUSTER", CLUSTER)
    cluster = autoplan.Cluster.load(ROOT / cluster_file)
    rows: list[dict[str, Any]] = []
    measuring: dict[str, dict[str, Any]] = {}
    for model in MODELS:
        model_rows, measuring[model] = measure_model(model, cluster)
        rows += model_rows
    if dist.get_rank() == 0:
        meta = _meta(cluster_file, measuring, load_before, started)
        summary = write(rows, meta)
        print(json.dumps({k: v for k, v in summary.items() if k != "verdicts"}, indent=1))
        print("\n".join(summary["verdicts"]))
        print(f"wall time {meta['wall_s']} s; results in {RESULTS}/fidelity.{{json,md}}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
