"""What a train step runs with on one rank, built whole from a plan that every rank agreed on:
the device mesh, the parameters placed as the plan says, the parallel module (or this rank's
pipeline stages), gradient synchronization, the optimizer over its DTensor parameters, the
watchdog's limit and fp16's loss scaler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.export import ExportedProgram

from autoplan.execute.gradients import GradientReducer
from autoplan.execute.pipeline import PipelineRunner, batch_args
from autoplan.execute.sharded_state import ShardedState
from autoplan.execute.step import (
    ParallelModule,
    Placeholders,
    local_leaves,
    make_optimizer,
    materialize,
)
from autoplan.execute.watchdog import note, step_timeout
from autoplan.modes import Precision
from autoplan.options import TrainOptions
from autoplan.planfile.schema import Plan
from autoplan.precision import LossScaler
from autoplan.torch_private import wait_collective
from autoplan.torch_private.mesh_release import released_at_exit


@dataclass(frozen=True)
class Runtime:
    """One rank's part of a plan, ready to train: exactly one of ``module`` (one stage) and
    ``pipeline`` (pipelined plans) is set."""

    plan: Plan
    mesh: DeviceMesh
    module: ParallelModule | None
    pipeline: PipelineRunner | None
    placeholders: Placeholders
    # None on a rank whose stages hold no parameter (a parameter-free last stage, say): its
    # step updates nothing, but takes part in every collective of the step as the others do
    optimizer: torch.optim.Optimizer | None
    zero: ShardedState  # ZeRO-1/2's parameters updated as shards
    step_limit_s: float  # the watchdog's limit for one step
    loss_scaler: LossScaler | None  # fp16 plans' dynamic loss scaling; None: no scaling
    flops: float = 0.0  # the model's in one step, forward and backward, of the whole batch


def plan_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The device mesh of ``plan`` on this job's ranks (made with real tensors: a mesh's
    ranks are read from them)."""
    mesh = init_device_mesh(device_type, plan.mesh.shape, mesh_dim_names=plan.mesh.axes)
    return released_at_exit(mesh)


def build_runtime(
    model: nn.Module,
    ep: ExportedProgram,
    plan: Plan,
    mesh: DeviceMesh,
    optimizer: str,
    train: TrainOptions,
    init_fn: Callable[[nn.Module], None] | None,
    gradless: frozenset[str] = frozenset(),
    flops: float = 0.0,
) -> Runtime:
    """Place ``model``'s parameters as ``plan`` says (in place, as DTensors) and build what
    its step runs with on ``mesh`` (`plan_mesh`); ``ep`` is the step traced at the shape a
    stage runs (one microbatch for pipelined plans), ``optimizer`` the name
    `PlanOptions.optimizer` gives; ``gradless`` names the traced step's nodes that need no
    gradient (a stage detaches what it receives of them); ``flops`` are the whole batch's
    step's, for MFU."""
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
        zero.read_through(ep, placeholders.params)
        reduced = {**dict(module.named_parameters()), **zero.whole}
        reducer = GradientReducer(reduced, plan, 0, mesh, zero.take_gradients)
        reducer.on_arrival(
            local_leaves(
                module, placeholders, module.interpreter, reducer.accepts_local, zero.whole
            )
        )
        parameters = list(module.parameters())
    made: torch.optim.Optimizer | None = None
    if parameters:  # torch's optimizers refuse an empty list
        made = (
            train.make_optimizer(parameters)
            if train.make_optimizer is not None
            else make_optimizer(optimizer, parameters, train.optimizer_options)
        )
    if zero.whole:  # ZeRO-1/2: the updated shards gathered back after each step
        assert made is not None  # ZeRO splits parameters, so there are some
        made.register_step_post_hook(lambda *_: regather(zero, module, placeholders))
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


def train_step(run: Runtime, inputs: Any, target: Any, max_grad_norm: float | None) -> torch.Tensor:
    """Forward, backward and the optimizer step of one batch on this rank, as the plan says
    (the watchdog's `watched` goes around it); returns the loss, the same on every rank."""
    scaler = run.loss_scaler
    scale = 1.0 if scaler is None else scaler.scale
    if run.pipeline is not None:
        args = batch_args(inputs, target)
        run.placeholders.check(args, batches=run.pipeline.num_microbatches)
        run.pipeline.loss_scale = scale
        loss = run.pipeline.run(args)
    else:
        assert run.module is not None
        loss = run.module(inputs, target)
        note("backward")
        # an explicit seed: autograd's own (ones_like(loss)) would wait for the loss's
        # all-reduce, which is only read after the optimizer step; the loss scale seeds
        # backward as GradScaler's scaled loss does
        loss.backward(torch.full(loss.shape, scale, dtype=loss.dtype, device=loss.device))
    finite = True
    if scaler is not None:
        note("unscaling the gradients (and the all-reduce of their overflow)")
        finite = scaler.unscale(gradients(run))
        scaler.update(finite)
    if max_grad_norm is not None and finite:
        note("gradient clipping (the gradients' norm)")
        clip_gradients(run, max_grad_norm)
    if run.optimizer is not None:  # None: this rank's stages hold nothing to update
        if finite:  # a step whose gradients overflowed is skipped, as GradScaler skips it
            note("the optimizer step (it waits for gradients still being reduced)")
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    note("the loss's all-reduce")
    # long done by now; waited for here so that no step leaves a collective behind
    return wait_collective(loss.detach())


def clip_gradients(run: Runtime, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` does in one process); returns the norm before.

    torch computes the norm of DTensor gradients (its collectives reduce over the stage's
    mesh); across pipeline stages, which hold different parameters, the squared norms are
    summed by hand on the "pp" axis: no DTensor spans stages.
    """
    grads = gradients(run)
    # a rank without gradients (its stages hold no parameter) adds a norm of 0, made on the
    # mesh's device for the all-reduce (torch's norm of no tensors is on the CPU)
    norm = (
        torch.nn.utils.get_total_norm(grads)
        if grads
        else torch.zeros((), device=run.mesh.device_type)
    )
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if run.pipeline is not None:
        # summed in float32 on every stage: one all-reduce needs one dtype on all its ranks,
        # and a stage without gradients knows not the others' (bfloat16 weights, say)
        squared = norm.detach().float() ** 2
        dist.all_reduce(squared, group=run.mesh["pp"].get_group())
        norm = squared.sqrt()
    scale = max_norm / (float(norm) + 1e-6)  # torch's clip_grad_norm_ formula
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return norm


def gradients(run: Runtime) -> list[torch.Tensor]:
    """The gradients of this rank's parameters that have one."""
    if run.optimizer is None:
        return []
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    return [p.grad for p in params if p.grad is not None]


def regather(zero: ShardedState, module: ParallelModule | None, placeholders: Placeholders) -> None:
    """Gather ZeRO-1/2's updated shards: a pipeline at once (its schedule reads the whole
    parameters from several stages), one stage on GPUs in flight, each waited for where the
    next forward first reads it (`PlanInterpreter.awaited`), so that they overlap it. CPU
    ranks (gloo) gather at once: their cores do the copies and sums, so nothing would be
    hidden (`costmodel.step_price` hides none there), and gloo's collectives left in flight
    past the step beside others (a state dict's gathers) aborted a rank in malloc."""
    if module is None or zero.mesh is None or zero.mesh.device_type == "cpu":
        zero.gather()
        return
    zero.gather(wait=False)
    module.interpreter.awaited = {
        p: functools.partial(zero.wait, (fqn,))
        for p, fqn in placeholders.params.items()
        if fqn in zero.pending
    }
