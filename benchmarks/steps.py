"""The training steps the benchmarks time, and how they time them.

- `plain_step`: a step of plain torch (forward, loss, backward, optimizer step);
- `autoplan_step`: autoplan's step of a copy of a workload's model, on its example batch;
- `one_device`: a cluster's first device alone, what a step in one process is priced on;
- `timed`, `median_seconds`: wall and CPU seconds of calls of a step, ranks aligned by a
  barrier where they run together, CUDA work waited for;
- `torchrun`: a benchmark script started again on local ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist
from torch import nn

import autoplan
from autoplan.workload import Workload

Step = Callable[[], object]


class Times(NamedTuple):
    wall: list[float]  # seconds of each call
    cpu: list[float]  # this process's CPU seconds (all its threads) of each call


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None,
    inputs: tuple[Any, ...],
    target: Any,
) -> Step:
    """One training step of `model` in plain torch: `loss_fn(model(*inputs), target)`, its
    backward, the optimizer's step, the gradients set to None."""
    assert loss_fn is not None

    def step() -> None:
        loss_fn(model(*inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def autoplan_step(
    w: Workload,
    cluster: autoplan.Cluster,
    lr: float,
    *,
    plan: autoplan.Plan | None = None,
    options: autoplan.PlanOptions | None = None,
) -> Step:
    """autoplan's step (AdamW at `lr`) of a copy of `w`'s model, so that `w`'s own stays as it
    is for the next step built from it; on `w`'s example batch. Call on every rank."""
    copied = dataclasses.replace(w, model=copy.deepcopy(w.model))
    step = copied.parallelize(
        cluster,
        plan=plan,
        options=options,
        train=autoplan.TrainOptions(optimizer_options={"lr": lr}),
    )
    return lambda: step(w.example_inputs, w.example_target)


def one_device(cluster: autoplan.Cluster) -> autoplan.Cluster:
    """`cluster` cut to its first device: what one process alone is priced on."""
    return dataclasses.replace(cluster, num_nodes=1, devices_per_node=1, name=f"{cluster.name}[:1]")


def timed(step: Step, count: int, *, barrier: bool = False, cuda: bool = False) -> Times:
    """Wall and CPU seconds of each of `count` calls of `step`, each started after a barrier
    that aligns the ranks if `barrier`, and with the GPU idle and ended by a synchronize if
    `cuda`. A rank waiting in gloo sleeps, so its CPU time is its compute and framework work,
    not its waiting."""
    found = Times([], [])
    for _ in range(count):
        if barrier:
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        found.wall.append(time.perf_counter() - start)
        found.cpu.append(time.process_time() - start_cpu)
    return found


def median_seconds(step: Step, warmup: int, count: int, *, cuda: bool = False) -> float:
    """The median wall seconds of `count` calls of `step` after `warmup` untimed ones."""
    timed(step, warmup, cuda=cuda)
    return statistics.median(timed(step, count, cuda=cuda).wall)


def torchrun(script: str | Path, nproc: int, env: Mapping[str, str] | None = None) -> NoReturn:
    """Start `script` again under torchrun on `nproc` local ranks, each with one thread
    (OMP_NUM_THREADS=1) and `env` beside the environment, and exit with its status."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    sys.exit(subprocess.run(cmd, env=full).returncode)
