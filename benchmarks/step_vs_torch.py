"""Step time of autoplan's data- and tensor-parallel plans against the same strategies written
directly with torch (DDP; parallelize_module with Colwise/RowwiseParallel), measured in one
run on 4 local CPU ranks (gloo). Target: autoplan within 10% of torch. Every step runs
AdamW: autoplan's default (fused), and torch's both by torch's default (a loop over the
parameters on CPU) and fused, so that the ratios show what the optimizer is worth apart.

    python benchmarks/step_vs_torch.py            # starts torchrun itself

Writes benchmarks/results/step_vs_torch.json and .md.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.stats import quartiles  # noqa: E402
from benchmarks.steps import Step, autoplan_step, plain_step, timed, torchrun  # noqa: E402
from tests.distributed.cases import data_parallel, mlp_megatron  # noqa: E402

WARMUP, ROUNDS, STEPS_PER_ROUND, LR = 3, 10, 4, 1e-4
# (strategy, example, its options): the first MLP of each strategy compute-heavy enough that
# per-op overheads are visible but small; the second data-parallel MLP has 16x the FLOPs per
# sample, to show how much of the ratio is a fixed cost per step; the GPT has many more
# parameters (57), ops and a loss that needs its global token count
SETUPS: list[tuple[str, str, dict[str, Any]]] = [
    ("data parallel", "mlp", {"batch_size": 8192, "hidden": 256, "num_layers": 6}),
    ("data parallel", "mlp", {"batch_size": 2048, "hidden": 1024, "num_layers": 6}),
    ("data parallel", "gpt", {"size": "small", "num_layers": 4, "batch_size": 8, "seq_len": 128}),
    ("tensor parallel", "mlp", {"batch_size": 64, "hidden": 2048, "num_layers": 6}),
]


def _rounds(steps: dict[str, Step]) -> dict[str, list[float]]:
    """Per round, the median seconds of one step of each, measured in interleaved rounds (a
    few steps of each per round), so that a change in the machine's load touches them alike.
    Each round starts one later in the list, so that none always runs after the same other
    (two identical autoplan steps measured 2% apart when each kept its place)."""
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for step in steps.values():
        timed(step, WARMUP, barrier=True)
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times = timed(steps[name], STEPS_PER_ROUND, barrier=True).wall
            rounds[name].append(statistics.median(times))
    return rounds


def _iqr(values: list[float]) -> str:
    q1, q3 = quartiles(values)
    return f"{q1:.3f}-{q3:.3f}"


def _torch_step(
    model: nn.Module, w: Workload, x: torch.Tensor, y: torch.Tensor, fused: bool | None
) -> Step:
    """AdamW by torch's default (``fused=None``: a loop over the parameters on CPU) or fused,
    autoplan's default."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
    return plain_step(model, opt, w.loss_fn, (x,), y)


def _ddp(w: Workload, bucket_cap_mb: float = 25.0, fused: bool | None = None) -> Step:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = (t.chunk(world)[rank] for t in (w.example_inputs[0], w.example_target))
    model = DistributedDataParallel(copy.deepcopy(w.model), bucket_cap_mb=bucket_cap_mb)
    return _torch_step(model, w, x, y, fused)


def _tensor_parallel(w: Workload, fused: bool | None = None) -> Step:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = copy.deepcopy(w.model)
    plan = {
        f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
        for i in range(len(model.layers))  # type: ignore[arg-type]
    }
    parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    return _torch_step(model, w, w.example_inputs[0], w.example_target, fused)


def main() -> None:
    if "RANK" not in os.environ:
        torchrun(__file__, 4)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cluster = autoplan.Cluster.load(ROOT / "costmodels/cpu-gloo-4.json")
    rows = []
    # DDP with (almost) no bucketing, one all-reduce per parameter: what DDP gains by its buckets
    baselines: dict[str, list[tuple[str, Callable[[Workload], Step]]]] = {
        "data parallel": [
            ("DistributedDataParallel", _ddp),
            ("DistributedDataParallel, fused AdamW", lambda w: _ddp(w, fused=True)),
            ("DistributedDataParallel, buckets off", lambda w: _ddp(w, bucket_cap_mb=1e-4)),
        ],
        "tensor parallel": [
            ("parallelize_module Colwise/Rowwise", _tensor_parallel),
            (
                "parallelize_module Colwise/Rowwise, fused AdamW",
                lambda w: _tensor_parallel(w, fused=True),
            ),
        ],
    }
    for name, example, size in SETUPS:
        w = load_workload(ROOT / f"examples/{example}.py", **size)
        layout = data_parallel if name == "data parallel" else mlp_megatron
        steps = {"autoplan": autoplan_step(w, cluster, LR, options=layout(w, (4,)))}
        steps.update((baseline, make(w)) for baseline, make in baselines[name])
        rounds = _rounds(steps)
        ours = rounds.pop("autoplan")
        for baseline, theirs in rounds.items():
            # the ratio of each round (measured minutes apart at most), then their median:
            # the machine's load drifts between rounds more than within one
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            rows.append(
                {
                    "strategy": name,
                    "model": f"{example} " + ", ".join(f"{k} {v}" for k, v in size.items()),
                    "autoplan_s": round(statistics.median(ours), 5),
                    "torch": baseline,
                    "torch_s": round(statistics.median(theirs), 5),
                    "ratio": round(statistics.median(ratios), 3),
                    "ratio_iqr": _iqr(ratios),
                }
            )
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        meta = {
            "command": "python benchmarks/step_vs_torch.py",
            "ranks": 4,
            "backend": "gloo",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
            "steps": f"{ROUNDS} interleaved rounds of {STEPS_PER_ROUND} steps of each (each round "
            f"starting one later in the list), after {WARMUP} warm-up; *_s: median over rounds of "
            "each round's median step",
            "ratio": "median over rounds of autoplan's round median / torch's; ratio_iqr: the "
            "interquartile range of those per-round ratios",
            "optimizer": "AdamW; autoplan's default is fused, torch's (on CPU) a loop over "
            "the parameters, and the rows marked 'fused AdamW' give torch the fused kernel",
            "target": "ratio <= 1.10",
        }
        columns = ["strategy", "model", "autoplan_s", "torch", "torch_s", "ratio", "ratio_iqr"]
        write_results("step_vs_torch", "autoplan vs torch, step time", meta, rows, columns)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
