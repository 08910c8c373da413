"""Training as the distributed tests do it: in one process as the reference, and in parallel
on a copy of the workload's model."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

import autoplan
from autoplan.execute.step import OPTIMIZERS
from autoplan.workload import Workload

STEPS = 3
# Adam turns a gradient element of ~1e-10 into a step of ~lr, so float32 rounding noise (a few
# 1e-9 after reductions in another order) moves such elements by up to ~2e-5 at lr=1e-3. At
# lr=1e-4 the noise stays below 1e-5 while any real error (a wrong or missing reduction,
# a misplaced shard) still moves parameters by ~lr per step, ten times the tolerance.
LR = 1e-4
TRAIN = autoplan.TrainOptions(optimizer_options={"lr": LR})  # as `reference` trains


def reference(
    w: Workload,
    max_grad_norm: float | None = None,
    optimizer: str = "adamw",
    options: dict[str, float] | None = None,
    steps: int = STEPS,
    precision: str | None = None,
    init_scale: float = 2.0**16,
) -> dict[str, Any]:
    """``w`` trained ``steps`` steps in this process alone: losses, first gradients, params.
    With a mixed ``precision``, forward and loss run in it (`Workload.loss`), and fp16 with
    torch's ``GradScaler`` (from ``init_scale``): the steps it skipped and its
    scales are returned too."""
    model = copy.deepcopy(w.model)
    opt = OPTIMIZERS[optimizer](model.parameters(), **(options or {"lr": LR}))  # type: ignore[arg-type]
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=precision == "fp16")
    losses, grads, scales = [], {}, []
    for i in range(steps):
        loss = w.loss(model, precision)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return {"losses": losses, "grads": grads, "params": dict(model.state_dict()), "scales": scales}


def parallel(w: Workload, c: autoplan.Cluster, **options: Any) -> autoplan.Step:
    """`Workload.parallelize` of ``w`` with a copy of its model, so that ``w``'s stays whole."""
    return dataclasses.replace(w, model=copy.deepcopy(w.model)).parallelize(c, **options)


def layout_keyword(layout: autoplan.PlanOptions | autoplan.Plan) -> dict[str, Any]:
    """`autoplan.parallelize`'s keyword for a case's layout: a plan, or options to plan with."""
    return {"plan": layout} if isinstance(layout, autoplan.Plan) else {"options": layout}
