"""Mixed precision: the step computes in bfloat16 or float16 under torch's autocast while the
parameters, their gradients and the optimizer state stay float32 (the master weights).

The step is traced under ``torch.autocast`` (`autoplan.graph.capture`): the traced graph then
holds every cast autocast makes as an op of its own (``aten._to_copy`` of each float32
parameter to the compute dtype where a matmul reads it, of the loss's input back to float32).
The planner prices and places those casts like any op, so a plan may gather a parameter after
its cast (the 2-byte copy, as FSDP2's ``param_dtype`` does) or before; the executor runs them
as the graph says. The gradients of the float32 parameters come back float32 through the
casts' backward: a plan reduces a gradient in float32 at its parameter (FSDP2's
``reduce_dtype=float32``), or in bf16 at the cast's output where that is priced cheaper;
``PlanOptions(reduce_dtype="fp32")`` rules the latter out (`autoplan.strategies.float32_grads`).

float16's narrow range needs loss scaling (`LossScaler`): torch's ``GradScaler`` semantics
across ranks.

"bf16-params" computes as torchtitan (FSDP2's ``param_dtype=torch.bfloat16``) and Megatron
(``--bf16``) train: each floating-point parameter is cast to bf16 once a step, where the step
first reads it, and every op then runs in bf16 (the residual stream and the norms' outputs
too, where autocast keeps them float32); the model's floating-point inputs are cast to bf16
(FSDP2's ``cast_forward_inputs``) and its output back to float32 for the loss, as torchtitan's
loss and Megatron's cross-entropy compute it. No autocast: the graph's casts are the
parameters' and those, and the master weights, gradients and state stay float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import AutoplanError
from autoplan.modes import Precision
from autoplan.torch_private import (
    non_finite_check_and_unscale,
    reparametrize_module,
    wait_collective,
)

# the dtype each mixed precision computes in
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
    Precision.BF16_PARAMS: torch.bfloat16,
}


def check_precision(name: str | None) -> Precision | None:
    """``name`` as a known precision (or None: the model's own dtypes)."""
    if name is None:
        return None
    if name not in tuple(Precision):
        raise AutoplanError(
            f"mixed precision {name!r} is not known; use one of {sorted(Precision)} "
            "(or None to compute in the model's own dtypes)"
        )
    return Precision(name)


def autocast_device(tensors: Iterable[torch.Tensor]) -> str:
    """The autocast device type for a step over ``tensors``: "cuda" if any is on a GPU, else
    "cpu" (meta tensors are traced as CPU ones: autocast has no meta kernels)."""
    return "cuda" if any(t.is_cuda for t in tensors) else "cpu"


@contextmanager
def computing(precision: str | None, module: torch.nn.Module, device_type: str) -> Iterator[None]:
    """Runs the body, a step of ``module``, in ``precision``: under ``torch.autocast(device_type,
    compute dtype)`` for bf16 and fp16; for bf16-params, with ``module``'s floating-point
    parameters replaced by their bf16 casts (one cast a tensor, so tied parameters stay one);
    as it is for None."""
    if precision is None:
        yield
        return
    dtype = COMPUTE_DTYPES[precision]
    if precision != Precision.BF16_PARAMS:
        with torch.autocast(device_type, dtype=dtype):
            yield
        return
    named = list(module.named_parameters(remove_duplicate=False))
    cast: dict[int, torch.Tensor] = {}
    for _, p in named:
        if id(p) not in cast and p.is_floating_point() and p.dtype != dtype:
            cast[id(p)] = p.to(dtype)
    with reparametrize_module(module, {n: cast[id(p)] for n, p in named if id(p) in cast}):
        yield


def model_input(precision: str | None, value: object) -> object:
    """A step's input to the model as ``precision`` passes it: a floating-point tensor in bf16
    for bf16-params, else as given."""
    if precision != Precision.BF16_PARAMS or not isinstance(value, torch.Tensor):
        return value
    return value.to(COMPUTE_DTYPES[precision]) if value.is_floating_point() else value


def loss_input(precision: str | None, output: object) -> object:
    """The model's output as ``precision`` passes it to the loss: a floating-point tensor in
    float32 for bf16-params, else as given (a model that takes its own loss, or returns a
    structure, computes the loss in the dtype it chooses)."""
    if precision != Precision.BF16_PARAMS or not isinstance(output, torch.Tensor):
        return output
    return output.float() if output.is_floating_point() else output


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics and defaults: the loss
    is scaled by `scale` before backward, the gradients unscaled before the optimizer step;
    a step whose gradients hold an inf or NaN on any rank is skipped (the optimizer does not
    run) and the scale multiplied by `backoff_factor`; after `growth_interval` steps in a row
    without one, the scale grows by `growth_factor`."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0  # steps skipped for gradients that overflowed, in all

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` (this rank's; DTensors or local) by the scale; whether all ranks'
        gradients are finite. Every rank must call it: the verdict is all-reduced over the
        world, which covers every stage of a pipeline."""
        local = [wait_collective(g.to_local() if isinstance(g, DTensor) else g) for g in grads]
        found = torch.zeros(1, device=local[0].device if local else "cpu")
        if local:
            inv = torch.full((), 1.0 / self.scale, device=local[0].device)
            non_finite_check_and_unscale(local, found, inv)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return not bool(found.item())

    def update(self, finite: bool) -> None:
        """The scale after a step whose gradients were ``finite`` (GradScaler.update)."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
