"""What a train step runs with on one rank, built whole from a plan that every rank agreed on:
the device mesh, the parameters placed as the plan says, the parallel module (or this rank's
pipeline stages), gradient synchronization, the optimizer over its DTensor parameters, the
watchdog's limit and fp16's loss scaler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.export import ExportedProgram

from autoplan.execute.gradients import GradientReducer
from autoplan.execute.pipeline import PipelineRunner
from autoplan.execute.sharded_state import ShardedState
from autoplan.execute.step import (
    ParallelModule,
    Placeholders,
    local_leaves,
    make_optimizer,
    materialize,
)
from autoplan.execute.watchdog import step_timeout
from autoplan.modes import Precision
from autoplan.options import TrainOptions
from autoplan.planfile.schema import Plan
from autoplan.precision import LossScaler


@dataclass(frozen=True)
class Runtime:
    """One rank's part of a plan, ready to train: exactly one of ``module`` (one stage) and
    ``pipeline`` (pipelined plans) is set."""

    plan: Plan
    mesh: DeviceMesh
    module: ParallelModule | None
    pipeline: PipelineRunner | None
    placeholders: Placeholders
    optimizer: torch.optim.Optimizer
    zero: ShardedState  # ZeRO-1/2's parameters updated as shards
    step_limit_s: float  # the watchdog's limit for one step
    loss_scaler: LossScaler | None  # fp16 plans' dynamic loss scaling; None: no scaling
    flops: float = 0.0  # the model's in one step, forward and backward, of the whole batch


def build_runtime(
    model: nn.Module,
    ep: ExportedProgram,
    plan: Plan,
    device_type: str,
    optimizer: str,
    train: TrainOptions,
    init_fn: Callable[[nn.Module], None] | None,
    gradless: frozenset[str] = frozenset(),
    flops: float = 0.0,
) -> Runtime:
    """Place ``model``'s parameters as ``plan`` says (in place, as DTensors) and build what
    its step runs with; ``ep`` is the step traced at the shape a stage runs (one microbatch
    for pipelined plans), ``optimizer`` the name `PlanOptions.optimizer` gives; ``gradless``
    names the traced step's nodes that need no gradient (a stage detaches what it receives
    of them); ``flops`` are the whole batch's step's, for MFU."""
    mesh = init_device_mesh(device_type, plan.mesh.shape, mesh_dim_names=plan.mesh.axes)
    module: ParallelModule | None = None
    pipeline: PipelineRunner | None = None
    if plan.pipeline is not None:
        pp = mesh["pp"]
        # this rank's row of the "pp" axis holds stages row, row + p, ... (interleaved; ZBV: in
        # a V)
        params = {
            fqn for fqn, s in plan.param_stages().items() if plan.group(s) == pp.get_local_rank()
        }
        materialize(model, plan, mesh[plan.stage_axes], init_fn, stage_params=params)
        pipeline = PipelineRunner(model, ep, plan, mesh, gradless)
        zero, placeholders = pipeline.zero, pipeline.module.placeholders
        parameters = pipeline.parameters()
    else:
        materialize(model, plan, mesh, init_fn)
        zero = ShardedState.split(model, plan, mesh)
        module = ParallelModule(model, ep, plan, mesh)
        placeholders = module.placeholders
        placeholders.whole = zero.by_placeholder(placeholders.params)
        reduced = {**dict(module.named_parameters()), **zero.whole}
        reducer = GradientReducer(reduced, plan, 0, mesh, zero.take_gradients)
        reducer.on_arrival(
            local_leaves(
                module, placeholders, module.interpreter, reducer.accepts_local, zero.whole
            )
        )
        parameters = list(module.parameters())
    made = (
        train.make_optimizer(parameters)
        if train.make_optimizer is not None
        else make_optimizer(optimizer, parameters, train.optimizer_options)
    )
    if zero.whole:  # ZeRO-1/2: the updated shards gathered back after each step
        made.register_step_post_hook(lambda *_: zero.gather())
    fp16 = plan.mixed_precision == Precision.FP16
    return Runtime(
        plan=plan,
        mesh=mesh,
        module=module,
        pipeline=pipeline,
        placeholders=placeholders,
        optimizer=made,
        zero=zero,
        step_limit_s=step_timeout(plan.predicted.step_time_s, train.timeout_s),
        loss_scaler=LossScaler(init_scale=train.init_scale) if fp16 else None,
        flops=flops,
    )
