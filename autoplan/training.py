"""What `autoplan run` does on every rank: build the step (resumed from a checkpoint), train,
save checkpoints, and optionally compare with training in one process."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.execute.watchdog import watched
from autoplan.graph.capture import as_tuple
from autoplan.options import PlanOptions
from autoplan.parallel import Step
from autoplan.planfile.schema import Plan
from autoplan.workload import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    seconds: float
    throughput: float
    unit: str  # "tokens/s" for integer inputs of rank 2 (token ids), else "samples/s"


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of a training run (`autoplan.Step.save`)."""

    directory: str | None = None
    """Where checkpoints go, one ``step-NNNNNNNN`` directory each; None saves none."""

    every: int | None = None
    """Save every this many steps (and after the last); None: after the last step only."""

    keep: int | None = None
    """Keep the newest this many checkpoints; None keeps all."""

    resume: bool = False
    """Start from the newest checkpoint in ``directory`` (under this run's plan, whatever
    plan saved it); from the beginning if there is none yet."""

    export_to: str | None = None
    """After training, write the whole parameters and buffers to this ``torch.save`` file."""

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise AutoplanError(f"checkpoint {name}={value}: give at least 1")
        if self.directory is None and (self.every is not None or self.resume):
            raise AutoplanError("--checkpoint-every and --resume need --checkpoint-dir DIR")


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
    checkpointing: Checkpointing | None = None,
    timeout_s: float | None = None,
) -> tuple[Step, Iterator[StepRecord]]:
    """Build the parallel step (planning on rank 0 with ``options`` unless ``plan`` is given),
    resume it from the newest checkpoint if asked, and return it with a generator that trains
    it on the example batch up to ``steps`` steps in all, saving checkpoints as asked.
    ``timeout_s``: the watchdog's limit per step (`autoplan.parallelize`)."""
    ckpt = checkpointing or Checkpointing()
    step = w.parallelize(
        cluster, optimizer_options={"lr": lr}, plan=plan, options=options, timeout_s=timeout_s
    )
    if ckpt.resume:
        assert ckpt.directory is not None
        if step.load(ckpt.directory, missing_ok=True) is None:
            log.info("no checkpoint in %s yet: starting from step 0", ckpt.directory)
    items, unit = _items(w)

    def run() -> Iterator[StepRecord]:
        for i in range(step.steps_done, steps):
            with watched(i + 1, "the barrier before the step", step.step_limit_s):
                dist.barrier()
            start = time.perf_counter()
            loss = step(w.example_inputs, w.example_target).item()
            seconds = time.perf_counter() - start
            yield StepRecord(i + 1, loss, seconds, items / seconds, unit)
            if ckpt.directory is not None and (
                i + 1 == steps or (ckpt.every is not None and (i + 1) % ckpt.every == 0)
            ):
                step.save(ckpt.directory, keep=ckpt.keep)
        if ckpt.export_to is not None:
            step.export(ckpt.export_to)

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
