"""Pipelined plans: each rank runs its stage as a torch.distributed.pipelining.PipelineStage.

The world mesh is ("pp", *stage axes); stage ``s`` runs on row ``s``, with the rest of the mesh
as its own DeviceMesh (interleaved 1F1B: row ``s mod p``, each rank running its row's stages
under torch's ScheduleInterleaved1F1B or ScheduleInterleavedZeroBubble, each with its own
gradient reducer; ZBV and DualPipeV: rows ``s`` and ``2 p - 1 - s``, in a V, under
ScheduleZBVZeroBubble or ScheduleDualPipeV, which place the stages so themselves and pass the
middle stage's output on in place). Tensors cross stages as local shards laid out as the plan's
boundary placement: rank ``i`` of a stage sends to rank ``i`` of the next (the "pp" group of its
column), so the pipelining library only ever sees plain tensors. The batch (and the target,
which travels with the activations to the loss) enters the first stage; the last stage returns
each microbatch's loss, and the sum of the microbatches' gradients over their count is the batch
mean's. A parameter that every op of its stage reads locally as stored trains as a plain local
leaf, as in a one-stage step (`autoplan.execute.step.local_leaves`): no DTensor on its path in
any microbatch.

ZeroBubble splits each backward into the inputs' gradients and, later, the weights'
(torch's ``stage_backward_input`` / ``stage_backward_weight``), which compute gradients for
the tensors the stage module's ``parameters()`` yields and nothing else: a stage module
yields the tensors its step really trains (`StageModule.trained`: local leaves, ZeRO's whole
parameters, the DTensor parameters otherwise), not the user's module's. The gradients are
reduced after the schedule as under every schedule (`GradientReducer.reduce_now`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.export import ExportedProgram

from autoplan.execute.gradients import GradientReducer
from autoplan.execute.interpreter import Local, PlanInterpreter
from autoplan.execute.placements import boundary_placements, held_layouts, logical
from autoplan.execute.sharded_state import ShardedState
from autoplan.execute.step import Placeholders, _global_loss, local_leaves
from autoplan.execute.watchdog import note
from autoplan.graph.capture import as_tuple
from autoplan.modes import Schedule
from autoplan.planfile.schema import Plan
from autoplan.torch_private import pipeline_received, pipeline_sent, pipeline_wire_dtype

SCHEDULE_CLASSES: dict[str, type[PipelineScheduleSingle]] = {
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.GPIPE: ScheduleGPipe,
}
# the schedules that take a list of stages (several a rank, or the backward split)
MULTI_SCHEDULE_CLASSES: dict[str, type[PipelineScheduleMulti]] = {
    Schedule.INTERLEAVED: ScheduleInterleaved1F1B,
    Schedule.ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    Schedule.ZBV: ScheduleZBVZeroBubble,
    Schedule.DUALPIPE_V: ScheduleDualPipeV,
}


class Stepper(Protocol):
    """What runs the microbatches of a step through this rank's stages: torch's schedule
    (the dry run's stand-in, `autoplan.execute.dry_run`, runs them without communication)."""

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None) -> Any: ...


class StageModule(nn.Module):
    """The user's modules (this stage's parameters as DTensors, the others on meta); its
    forward runs this stage's part of the traced step on local shards in and out."""

    def __init__(
        self,
        model: nn.Module,
        ep: ExportedProgram,
        plan: Plan,
        mesh: DeviceMesh,
        index: int,
        gradless: frozenset[str] = frozenset(),
    ) -> None:
        """``gradless``: the graph's tensors no gradient flows to (`Node.needs_grad`)."""
        super().__init__()
        self.model = model
        stage = plan.stages[index]
        self.mesh = mesh
        self.interpreter = PlanInterpreter(ep, plan, mesh, index)
        self.placeholders = Placeholders(ep, plan, mesh)
        self.is_first = index == 0
        self.is_last = index == len(plan.stages) - 1
        self._boundary = stage.boundary
        self._axes = plan.stage_axes
        metas = {n.name: n.meta["val"] for n in ep.graph.nodes if "val" in n.meta}
        self._received = [(name, metas[name]) for name in stage.received]
        # received tensors that need no gradient (rotary tables made from buffers): the library
        # makes every float one it receives require one, and a local op would then hand such a
        # tensor a partial gradient to reduce, which the plan neither lists nor needs
        self._gradless = gradless & set(stage.received)
        self._sent = [metas[name] for name in stage.sent]
        self._loss = metas[next(n for n in ep.graph.nodes if n.op == "output").args[0][0].name]
        # the tensors this stage's backward computes gradients for (the runner knows them)
        self.trained: list[torch.Tensor] = []

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The user's module's parameters (every stage's; the others on meta, which keeps
        PipelineStage from moving the module), then the tensors this stage trains
        (`trained`), for which torch's split backward computes the weights' gradients (module
        docstring)."""
        yield from super().parameters(recurse)
        yield from self.trained  # type: ignore[misc]  # local leaves are plain tensors

    def _placements(self, meta: torch.Tensor) -> tuple[Placement, ...]:
        """How a tensor shaped as ``meta`` crosses the stage boundary."""
        return boundary_placements(self._boundary, self._axes, meta.shape)

    def _local(self, meta: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped as this rank's shard of a boundary tensor, in the dtype it
        crosses stages as (with a gradient if floating-point: the metadata the library sends
        by)."""
        dtype = pipeline_wire_dtype(meta.dtype)
        whole = torch.distributed.tensor.empty(
            meta.shape, dtype=dtype, device_mesh=self.mesh, placements=self._placements(meta)
        )
        return whole.to_local().requires_grad_(dtype.is_floating_point)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """What the stage receives per microbatch (the pipelining library's static shapes)."""
        if self.is_first:
            specs = [self.placeholders.specs[name] for name in self.placeholders.user_inputs]
            return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)
        return tuple(self._local(meta) for _, meta in self._received)

    def example_outputs(self) -> tuple[torch.Tensor, ...]:
        if self.is_last:
            return (torch.empty((1,), dtype=self._loss.dtype),)
        return tuple(self._local(meta) for meta in self._sent)

    def forward(self, *args: torch.Tensor) -> Any:
        if self.is_first:
            values = self.placeholders.values(self.model, args)
        else:
            values = self.placeholders.values(self.model, ())
            # local shards placed as the boundary: the interpreter wraps one in a DTensor
            # only where a DTensor op or a redistribution reads it
            for (name, meta), local in zip(self._received, args, strict=True):
                received = pipeline_received(local, meta.dtype)
                if name in self._gradless:
                    received = received.detach()  # the library sends back zeros for it
                elif received.requires_grad:
                    # its gradient is sent back as it comes: contiguous, as a send needs
                    # (a permuted one, ConvNeXt's or Swin's, is not)
                    received.register_hook(torch.Tensor.contiguous)
                values[name] = Local(received, self._placements(meta))
        out = self.interpreter.run(values)
        if self.is_last:
            (loss,) = out
            # shape (1,): the schedule concatenates the microbatches' outputs
            return _global_loss(loss).reshape(1)
        return tuple(pipeline_sent(t) for t in out)


class PipelineRunner:
    """One train step of a pipelined plan on this rank: the schedule over the microbatches,
    then each gradient brought to its parameter's storage placement."""

    def __init__(
        self,
        model: nn.Module,
        ep: ExportedProgram,
        plan: Plan,
        world: DeviceMesh,
        gradless: frozenset[str] = frozenset(),
    ) -> None:
        """``gradless``: the graph's tensors no gradient flows to (`Node.needs_grad`)."""
        assert plan.pipeline is not None
        self.plan = plan
        pp = world["pp"]
        # this rank's stages: its row of the "pp" axis, and every p-th after it (interleaved;
        # ZBV: the V's way back)
        self.indices = plan.group_stages(pp.get_local_rank())
        self.mesh = world[plan.stage_axes]
        self.zero = ShardedState.split(model, plan, self.mesh)  # ZeRO-1/2's shards and wholes
        self.modules = [StageModule(model, ep, plan, self.mesh, s, gradless) for s in self.indices]
        for module in self.modules:
            module.placeholders.whole = self.zero.by_placeholder(module.placeholders.params)
            self.zero.read_through(ep, module.placeholders.params)
        self.module = self.modules[0]
        self.num_microbatches = plan.pipeline.num_microbatches
        self.stages = [
            PipelineStage(
                module,
                s,
                len(plan.stages),
                torch.device(world.device_type),
                input_args=module.example_inputs(),
                output_args=module.example_outputs(),
                group=pp.get_group(),
            )
            for s, module in zip(self.indices, self.modules, strict=True)
        ]
        # the schedule would scale only the parameters' own gradients, not the local leaves'
        # (`run` scales both)
        self.schedule: Stepper
        if plan.pipeline.schedule in MULTI_SCHEDULE_CLASSES:
            self.schedule = MULTI_SCHEDULE_CLASSES[plan.pipeline.schedule](
                list(self.stages), self.num_microbatches, loss_fn=self.stage_loss, scale_grads=False
            )
        else:
            self.schedule = SCHEDULE_CLASSES[plan.pipeline.schedule](
                self.stages[0], self.num_microbatches, loss_fn=self.stage_loss, scale_grads=False
            )
        self.loss_scale = 1.0  # backward starts from the loss times this (fp16 loss scaling)
        self.is_first = self.modules[0].is_first
        self.is_last = self.modules[-1].is_last
        self._last_rank = plan.stages[-1].ranks[0]
        owner = plan.param_stages()
        named = [(fqn, p) for fqn, p in model.named_parameters() if isinstance(p, DTensor)]
        self.reducers = []
        for s, module in zip(self.indices, self.modules, strict=True):
            mine: dict[str, torch.Tensor] = {fqn: p for fqn, p in named if owner[fqn] == s}
            wholes = {fqn: w for fqn, w in self.zero.whole.items() if owner[fqn] == s}
            mine.update(wholes)  # a ZeRO-1/2 parameter's gradient is its whole one's
            then = functools.partial(self.zero.take_gradients, tuple(wholes))
            reducer = GradientReducer(mine, plan, s, self.mesh, then)
            reducer.use_leaves(
                local_leaves(
                    model, module.placeholders, module.interpreter, reducer.accepts_local, wholes
                )
            )
            module.trained = [
                reducer.leaves.get(fqn, p) for fqn, p in mine.items() if p.requires_grad
            ]
            self.reducers.append(reducer)

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        """The parameters of this rank's stages that train as plain local leaves, by FQN."""
        return {fqn: t for r in self.reducers for fqn, t in r.leaves.items()}

    @property
    def _loss_factor(self) -> float:
        """What backward starts from, per microbatch loss: 1, or under loss scaling the scale
        over the microbatch count. The gradients in flight then have the size of one
        process's over the whole batch, whose loss is the microbatches' mean (a microbatch's
        loss alone has gradients ``num_microbatches`` times theirs, which overflow float16
        where one process's do not), and their sum is the batch mean's, scaled."""
        return 1.0 if self.loss_scale == 1.0 else self.loss_scale / self.num_microbatches

    def stage_loss(self, output: torch.Tensor, _target: object) -> torch.Tensor:
        """The last stage computes the plan's loss itself (not as a view of its output:
        torch's split backward detaches the loss in place, which a view refuses)."""
        loss = output[0].clone()
        return loss if self._loss_factor == 1.0 else loss * self._loss_factor

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.model.parameters() if isinstance(p, DTensor)]

    def run(self, args: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward and backward over the whole batch; returns its mean loss on every rank."""
        losses: list[torch.Tensor] = []
        stages = ", ".join(map(str, self.indices))
        note(
            f"the pipeline schedule of stage(s) {stages} (forward and backward; activations "
            "and their gradients to and from the neighbouring stages)"
        )
        inputs = tuple(args) if self.is_first else ()
        if self.is_last:
            # one placeholder target per microbatch: the loss is already the stage's output
            self.schedule.step(*inputs, target=torch.zeros(self.num_microbatches), losses=losses)
        else:
            self.schedule.step(*inputs)
        if self.loss_scale == 1.0:  # else the loss's factor has taken the mean
            self._mean_of_microbatches()
        for reducer in self.reducers:
            reducer.reduce_now()
        note(f"the loss's broadcast from the last stage (rank {self._last_rank})")
        loss = torch.zeros(())
        if self.is_last:
            loss = torch.stack([x.detach() for x in losses]).mean() / self._loss_factor
        dist.broadcast(loss, src=self._last_rank)
        return loss

    @torch.no_grad()
    def _mean_of_microbatches(self) -> None:
        """Each microbatch's loss is its mean: the summed gradients over their count are
        the batch mean's."""
        for tensor in [*self.leaves.values(), *self.zero.whole.values(), *self.parameters()]:
            if tensor.grad is not None:
                tensor.grad.div_(self.num_microbatches)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole, on every rank: each stage gathers its own and
        its first rank broadcasts them."""
        owner = self.plan.param_stages()
        layouts = held_layouts(self.plan)
        out = {}
        device = self.mesh.device_type
        for fqn, tensor in self.module.model.state_dict().items():
            s = _owner(owner, fqn)
            if s in self.indices:
                if fqn in layouts:  # in the model's order (placements.py)
                    tensor = logical(tensor, layouts[fqn])
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                whole = whole.detach().to(device).contiguous()
            else:
                whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dist.broadcast(whole, src=self.plan.stages[s].ranks[0])
            out[fqn] = whole.clone()
        return out


def batch_args(inputs: Any, target: Any) -> tuple[Any, ...]:
    return as_tuple(inputs) + (() if target is None else (target,))


def _owner(owner: Mapping[str, int], fqn: str) -> int:
    """The stage that holds state-dict entry ``fqn``. An entry a module's state-dict hook
    makes (torchtitan saves its fused q|k|v projection as ``wq``, ``wk``, ``wv``) is the
    stage's of that module's own parameters."""
    if fqn in owner:
        return owner[fqn]
    parts = fqn.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end]) + "."
        stages = {s for name, s in owner.items() if name.startswith(prefix)}
        if len(stages) == 1:
            return stages.pop()
    raise KeyError(f"no stage holds {fqn!r} or a module it is saved from")
