"""The parallel module and the train step built from a plan, on every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.export import ExportedProgram

from autoplan.errors import AutoplanError
from autoplan.execute.buffer_writes import BufferWrites
from autoplan.execute.interpreter import Local, PlanInterpreter
from autoplan.execute.placements import Layout, held_layouts, interleave, to_dtensor
from autoplan.graph.capture import as_tuple
from autoplan.planfile.schema import Plan
from autoplan.torch_private import functional_all_reduce

log = logging.getLogger(__name__)

_WRAPPED = "model."
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "sgd_momentum": torch.optim.SGD,
}


class _GlobalLoss(torch.autograd.Function):
    """Forward: the loss every rank reports (partial sums or means reduced). Backward: each
    rank's gradient goes to its own part; DTensor's loss rules already scale that part for
    the whole batch (nll_loss divides by the global total weight; see the interpreter for
    the element-wise losses)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)  # a view: an asynchronous reduction is not waited for here

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _global_loss(out: Any) -> torch.Tensor:
    if not isinstance(out, DTensor):
        return out
    local = out.to_local()
    # reduced along its partial axes by functional all-reduces, started now and waited for
    # when the value is read (after the optimizer step); what DTensor's redistribute issues,
    # at a third of its CPU cost
    value = local.detach()
    for axis, placement in enumerate(out.placements):
        if isinstance(placement, Partial):
            value = functional_all_reduce(value, placement.reduce_op, (out.device_mesh, axis))
    loss: torch.Tensor = _GlobalLoss.apply(local, value)
    return loss


class ParallelModule(nn.Module):
    """The user's modules with DTensor parameters placed as the plan stores them; its forward
    runs the traced train step as the plan says and returns the loss, the same value on every
    rank. Gradients are reduced to each parameter's storage placement as they arrive; the
    buffers forward updates are written after forward (`autoplan.execute.buffer_writes`)."""

    def __init__(self, model: nn.Module, ep: ExportedProgram, plan: Plan, mesh: DeviceMesh) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):  # BART's final_logits_bias
            persistent = name not in model._non_persistent_buffers_set
            self.register_buffer(name, buffer, persistent=persistent)
        self.mesh = mesh
        self.plan = plan
        self.interpreter = PlanInterpreter(ep, plan, mesh)
        self.placeholders = Placeholders(ep, plan, mesh)
        self.writes = BufferWrites(ep, plan)

    def forward(self, inputs: Any, target: Any = None) -> torch.Tensor:
        args = as_tuple(inputs) + (() if target is None else (target,))
        self.placeholders.check(args)
        values = self.placeholders.values(self, args)
        outputs = self.interpreter.run(values)  # the loss, and the buffers' new values
        self.writes.write(self, outputs, self.mesh)
        return _global_loss(outputs[self.writes.loss])


def local_leaves(
    model: nn.Module,
    placeholders: Placeholders,
    interpreter: PlanInterpreter,
    accepts: Callable[[str, tuple[Placement, ...]], bool],
    whole: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Give the step a plain local leaf (sharing its storage) for each parameter of ``model``
    that every op reading it runs locally on as stored, where ``accepts(fqn, gradient
    placement)`` (the gradient reducer's); returns them by FQN. ``whole``: the parameters
    forward reads in place of the model's, by FQN (ZeRO-1/2's, `autoplan.execute.sharded_state`)."""
    named = {**dict(model.named_parameters()), **(whole or {})}
    leaves: dict[str, torch.Tensor] = {}
    for placeholder, fqn in placeholders.params.items():
        param = named.get(fqn)
        if not isinstance(param, DTensor) or not param.requires_grad:
            continue
        grad = interpreter.local_gradient(placeholder)
        stored = tuple(param.placements)
        if grad is None or stored != interpreter.outputs[placeholder]:
            continue
        if accepts(fqn, grad):
            leaves[fqn] = param.to_local().detach().requires_grad_()
            placeholders.leaves[placeholder] = Local(leaves[fqn], stored, grad)
    return leaves


class Placeholders:
    """The exported step's placeholders: parameters and buffers by FQN, then the batch."""

    def __init__(self, ep: ExportedProgram, plan: Plan, mesh: DeviceMesh) -> None:
        sig = ep.graph_signature
        self.params = {k: v.removeprefix(_WRAPPED) for k, v in sig.inputs_to_parameters.items()}
        self.buffers = {k: v.removeprefix(_WRAPPED) for k, v in sig.inputs_to_buffers.items()}
        # tensors that forward makes from Python values (torch.tensor(...)): export lifts them
        # out of the graph; each rank holds them whole, placed as planned when first read
        self.constants = {
            k: ep.constants[v] for k, v in sig.inputs_to_lifted_tensor_constants.items()
        }
        self.placed_constants: dict[str, Any] | None = None
        self.user_inputs = list(sig.user_inputs)
        self.specs = {
            n.name: (tuple(n.meta["val"].shape), n.meta["val"].dtype)
            for n in ep.graph.nodes
            if n.op == "placeholder" and n.name in self.user_inputs
        }
        self.plan = plan
        self.mesh = mesh
        self.leaves: dict[str, Local] = {}  # parameters' local leaves, by placeholder
        # ZeRO-1/2 parameters as forward reads them, by placeholder (`execute.sharded_state`)
        self.whole: dict[str, torch.Tensor] = {}
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # every rank of a stage is on its mesh
        self.coordinate = coordinate

    def values(self, module: nn.Module, args: tuple[Any, ...]) -> dict[str, Any]:
        """Placeholder name -> value: ``module``'s parameters and buffers that the plan's
        stage on this rank reads, and ``args`` (the batch) if it reads them, placed as
        planned (each rank holds the whole batch and keeps its slice: no communication)."""
        if self.placed_constants is None:  # placed once: they never change
            self.placed_constants = self._placed_constants()
        values: dict[str, Any] = {**self.placed_constants, **self.whole, **self.leaves}
        others = {p: f for p, f in {**self.params, **self.buffers}.items() if p not in values}
        if others:  # looked up each step: a user may have replaced a parameter or buffer
            named: dict[str, torch.Tensor] = dict(module.named_parameters())
            named.update(module.named_buffers())
            values.update((p, named[f]) for p, f in others.items() if f in named)
        axes = self.plan.stage_axes
        for placeholder, arg in zip(self.user_inputs, args, strict=bool(args)):
            spec = to_dtensor(self.plan.nodes[placeholder].output, axes)
            device = self.mesh.device_type
            shard = local_shard(arg, spec, self.mesh.shape, self.coordinate)
            values[placeholder] = (
                distribute_tensor(arg.to(device), self.mesh, spec, src_data_rank=None)
                if shard is None
                else Local(shard.to(device), spec)
            )
        return values

    def _placed_constants(self) -> dict[str, Any]:
        axes, nodes = self.plan.stage_axes, self.plan.nodes
        return {
            name: distribute_tensor(
                value.to(self.mesh.device_type),
                self.mesh,
                to_dtensor(nodes[name].output, axes),
                src_data_rank=None,
            )
            for name, value in self.constants.items()
            if name in nodes
        }

    def check(self, args: tuple[Any, ...], batches: int = 1) -> None:
        """``args`` must have the traced shapes (``batches`` times as many rows)."""
        if len(args) != len(self.user_inputs):
            raise AutoplanError(
                f"the step was traced with {len(self.user_inputs)} input(s) (inputs, then the "
                f"target), got {len(args)}"
            )
        for i, (name, arg) in enumerate(zip(self.user_inputs, args, strict=True)):
            shape, dtype = self.specs[name]
            if shape and batches > 1:
                shape = (shape[0] * batches, *shape[1:])
            if not isinstance(arg, torch.Tensor) or tuple(arg.shape) != shape or arg.dtype != dtype:
                got = (
                    f"{tuple(arg.shape)} {arg.dtype}"
                    if isinstance(arg, torch.Tensor)
                    else type(arg).__name__
                )
                raise AutoplanError(
                    f"input {i} is {got}, but the plan was made for {shape} {dtype}; pass batches "
                    "of the planned shape (or plan again for this shape)"
                )


def local_shard(
    tensor: torch.Tensor,
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: Sequence[int],
) -> torch.Tensor | None:
    """The shard of ``tensor`` at ``coordinate`` of the mesh as a view, where every split is
    even (DTensor's shard then, taken without its copy); None where one is not."""
    for i, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim, parts = placement.dim, mesh_shape[i]
            if tensor.shape[dim] % parts:
                return None
            size = tensor.shape[dim] // parts
            tensor = tensor.narrow(dim, coordinate[i] * size, size)
    return tensor


def _held(whole: torch.Tensor, layout: Layout, mesh: DeviceMesh) -> torch.Tensor:
    """A whole parameter in the order its storage holds it (`interleave`)."""
    for axis, dim, ws in layout:
        whole = interleave(whole, dim, ws, mesh.size(axis))
    return whole


def materialize(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh,
    init_fn: Callable[[nn.Module], None] | None,
    stage_params: Collection[str] | None = None,
) -> None:
    """Replace every parameter and buffer of ``model`` by a DTensor with its storage placement;
    with ``stage_params`` (a pipeline stage's FQNs) the others become meta tensors.

    Real weights are distributed from rank 0's copy. Meta weights are created shard by shard
    (the whole tensor never exists) and initialized by ``init_fn(model)`` or, by default, by
    each module's ``reset_parameters()``.
    """
    axes = plan.stage_axes
    device = mesh.device_type
    on_meta = False
    placed: dict[int, torch.Tensor] = {}  # by id of the tensor replaced: tied ones once
    layouts = held_layouts(plan)  # fused projections of unequal pieces, held interleaved
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for fqn, tensor in named:
        owner_name, _, leaf = fqn.rpartition(".")
        owner = model.get_submodule(owner_name)
        if id(tensor) in placed:  # a tied parameter's other name: the same new parameter
            setattr(owner, leaf, placed[id(tensor)])
            continue
        if fqn not in plan.params:
            raise AutoplanError(f"the plan has no placement for {fqn}; was it made for this model?")
        placements = to_dtensor(plan.params[fqn].storage, axes)
        dt: torch.Tensor
        if stage_params is not None and not tensor.is_meta:
            # rank 0 is not on every stage's mesh: every rank takes rank 0's weights first
            whole = tensor.detach().to(device).contiguous()
            torch.distributed.broadcast(whole, src=0)
        else:
            whole = tensor.detach()
        if stage_params is not None and fqn not in stage_params:
            dt = whole.to("meta")  # another stage's: not kept here
        elif tensor.is_meta:
            on_meta = True
            dt = torch.distributed.tensor.empty(
                tensor.shape, dtype=tensor.dtype, device_mesh=mesh, placements=placements
            )
        elif stage_params is not None:
            whole = _held(whole, layouts.get(fqn, ()), mesh)
            dt = distribute_tensor(whole, mesh, placements, src_data_rank=None)
        else:
            whole = _held(tensor.detach().to(device), layouts.get(fqn, ()), mesh)
            dt = distribute_tensor(whole, mesh, placements, src_data_rank=0)
        if isinstance(tensor, nn.Parameter):
            placed[id(tensor)] = nn.Parameter(dt, requires_grad=tensor.requires_grad)
            setattr(owner, leaf, placed[id(tensor)])
        else:
            placed[id(tensor)] = dt
            owner.register_buffer(leaf, dt)
    if on_meta:
        with torch.no_grad():
            if init_fn is not None:
                init_fn(model)
            else:
                for module in model.modules():
                    reset = getattr(module, "reset_parameters", None)
                    if callable(reset):
                        reset()


def make_optimizer(
    optimizer: str, params: list[nn.Parameter], options: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """The optimizer `PlanOptions.optimizer` names, over ``params``, with ``options`` (its
    keyword arguments). SGD's momentum keeps state the plan counts only for "sgd_momentum"
    (default momentum 0.9); "sgd" with momentum is refused rather than planned short."""
    if optimizer not in OPTIMIZERS:
        raise AutoplanError(
            f"optimizer {optimizer!r} is not known; use one of {sorted(OPTIMIZERS)} (or "
            "TrainOptions.make_optimizer)"
        )
    if optimizer == "sgd" and options.get("momentum"):
        raise AutoplanError(
            f"optimizer 'sgd' with momentum={options['momentum']}: momentum keeps a buffer per "
            "parameter that the plan did not count; name PlanOptions(optimizer='sgd_momentum')"
        )
    if optimizer == "sgd_momentum":
        options = {"momentum": 0.9} | dict(options)
    # Adam(W): the fused kernel, one DTensor dispatch for the whole update (DTensor has rules
    # for the fused Adam kernels only); ~3x faster than foreach over GPT's DTensors on one
    # CPU core (benchmarks/executor_costs.py). SGD: foreach, one dispatch per update op rather
    # than one per op and parameter (torch picks either by default only on GPUs). The
    # arithmetic is the same; a user's choice of either one excludes the other.
    defaults: dict[str, Any] = {"lr": 1e-3}
    if optimizer in ("adam", "adamw") and not options.get("foreach"):
        defaults["fused"] = True
    elif not options.get("fused"):
        defaults["foreach"] = True
    made = OPTIMIZERS[optimizer](params, **(defaults | dict(options)))
    if made.defaults.get("fused"):
        made.register_step_pre_hook(_contiguous_gradients)
    return made


@torch.no_grad()  # to_local without autograd's bookkeeping
def _contiguous_gradients(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Every gradient's local shard contiguous: torch's fused CPU Adam(W) reads a gradient's
    memory in order whatever its strides (a strided one gives a silently wrong update; see
    tests/test_optimizer.py). Autograd keeps a gradient strided as its parameter, but a
    DTensor's local shard may come strided out of a redistribution."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local is None or local.is_contiguous():
                continue
            if isinstance(grad, DTensor):
                param.grad = DTensor.from_local(
                    local.contiguous(),
                    grad.device_mesh,
                    grad.placements,
                    run_check=False,
                    shape=grad.shape,
                    stride=grad.stride(),
                )
            else:
                param.grad = local.contiguous()
