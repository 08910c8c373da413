"""What the planning benchmarks (`plan_gpt`, `plan_real`) record of each case: the plan's shape
and prediction as one row, each case planned in a fresh process as a user plans."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import autoplan

# the simulated clusters the planning benchmarks plan for
CLUSTERS = {"a100": "dgx-a100-80gb.json", "h100": "h100-sxm-8.json"}


def planning_meta(script: str) -> dict[str, str]:
    """What a planning benchmark's results say of how they were made: the command as run,
    the machine, torch and the cluster files."""
    return {
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "clusters": ", ".join(f"costmodels/{f}" for f in CLUSTERS.values()) + " (8 GPUs per node)",
    }


# the columns of a planned case, after the benchmark's own
PLAN_COLUMNS = [
    "trace_s",
    "plan_s",
    "result",
    "mesh",
    "axes",
    "stages",
    "microbatches",
    "schedule",
    "recomputed_layers",
    "bubble",
    "ilp_groups",
    "ilp_variables",
    "solve_s",
    "unproven",
    "step_s",
    "comm_share",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "memory_gib",
    "limit_gib",
]


def plan_fields(plan: autoplan.Plan, tokens: int, num_params: int, gpus: int) -> dict[str, object]:
    """The row of a plan for ``tokens`` a step of a model of ``num_params`` on ``gpus``."""
    model_flops = 6 * num_params * tokens  # forward and backward, no recomputation
    step_s = plan.predicted.step_time_s
    return {
        "result": "ok",
        "mesh": "x".join(map(str, plan.mesh.shape)),
        "axes": ",".join(plan.mesh.axes),
        "stages": len(plan.stages),
        "microbatches": plan.pipeline.num_microbatches if plan.pipeline else 1,
        "schedule": plan.pipeline.schedule if plan.pipeline else "",
        "recomputed_layers": len(plan.recompute),
        "bubble": round(plan.pipeline.bubble_fraction, 3) if plan.pipeline else 0.0,
        "ilp_groups": plan.solver.num_groups,
        "ilp_variables": plan.solver.num_variables,
        "solve_s": round(plan.solver.solve_time_s, 2),
        "unproven": len(plan.solver.unproven),
        "step_s": round(step_s, 4),
        "comm_share": round(plan.predicted.comm_s / step_s, 3),
        "tokens_per_s": round(tokens / step_s),
        "model_tflops_per_gpu": round(model_flops / step_s / gpus / 1e12, 1),
        "memory_gib": round(plan.predicted.peak_memory_bytes / 2**30, 1),
        "limit_gib": round(plan.predicted.memory_limit_bytes / 2**30, 1),
    }


@contextmanager
def phase_split() -> Iterator[dict[str, str]]:
    """Within, the planner's account of where its seconds went (its "planned in" line) is
    kept in the dict given, as ``{"phases": "trace 2.1 s, ..."}``."""
    found: dict[str, str] = {}

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = re.match(r"planned in [\d.]+ s: (.*)", record.getMessage())
            if m:
                found["phases"] = m.group(1)

    logger = logging.getLogger("autoplan.api")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_fresh(script: str | Path, case: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``script --one CASE`` in a fresh process, ``case`` the keyword arguments of its run:
    its last line of output, a JSON row; a case that runs past ``timeout_s`` or fails is
    ``case`` with a result saying so."""
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--one", json.dumps(case)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return case | {"result": f"over {timeout_s:g} s"}
    if done.returncode != 0:
        return case | {"result": "failed", "detail": done.stderr.strip().splitlines()[-1][:200]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def load_average() -> float:
    """The machine's load over the last minute: planning times are for an idle machine only
    where it is low."""
    return round(os.getloadavg()[0], 1)
