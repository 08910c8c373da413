"""What `autoplan run` does on every rank: build the step, train, and optionally compare with
training in one process."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoplan.cluster.model import Cluster
from autoplan.graph.capture import as_tuple
from autoplan.options import PlanOptions
from autoplan.parallel import Step
from autoplan.planfile.schema import Plan
from autoplan.workload import Workload


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    seconds: float
    throughput: float
    unit: str  # "tokens/s" for integer inputs of rank 2 (token ids), else "samples/s"


def _items(w: Workload) -> tuple[int, str]:
    x = as_tuple(w.example_inputs)[0]
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 2:
        return x.numel(), "tokens/s"
    return (x.shape[0] if isinstance(x, torch.Tensor) else 1), "samples/s"


def train(
    w: Workload,
    cluster: Cluster,
    steps: int,
    lr: float,
    *,
    plan: Plan | str | None = None,
    options: PlanOptions | None = None,
) -> tuple[Step, Iterator[StepRecord]]:
    """Build the parallel step (planning on rank 0 with ``options`` unless ``plan`` is given)
    and return it with a generator that trains ``steps`` steps on the example batch."""
    step = w.parallelize(cluster, optimizer_options={"lr": lr}, plan=plan, options=options)
    items, unit = _items(w)

    def run() -> Iterator[StepRecord]:
        for i in range(steps):
            dist.barrier()
            start = time.perf_counter()
            loss = step(w.example_inputs, w.example_target).item()
            seconds = time.perf_counter() - start
            yield StepRecord(i + 1, loss, seconds, items / seconds, unit)

    return step, run()


def one_process(
    make: Callable[[], Workload], steps: int, lr: float
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train the same workload in this process alone, as the reference."""
    w = make()
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = w.loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}
