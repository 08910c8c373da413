"""Capture: trace a model (and optionally its loss) into the graph IR with torch.export.

Tracing is non-strict `torch.export.export`, which runs the model on fake tensors: a model
built under ``torch.device("meta")`` is traced without any parameter memory, and a model with
real weights is never copied. The ATen graph of the forward (loss included) is kept at the
level export gives it (``aten.linear``, ``aten.scaled_dot_product_attention`` ...); backward
costs are derived per op (see `flops`), since the backward of each op mirrors its forward.

This module traces; the exported step then goes through `passes` (regions inlined, made
functional where it writes, batch norm in training made of its reductions, checks dropped,
tied parameters, refusals), `diagnose` explains what could not be traced, and
`convert` makes the IR.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from autoplan.errors import BatchSplitError, TraceError
from autoplan.graph.batch_norm import trains_batch_norm
from autoplan.graph.convert import graph_from_export
from autoplan.graph.diagnose import (
    explain_trace_failure,
    refuse_data_dependent,
    refuse_float_indices,
    refuse_mixed_dtypes,
)
from autoplan.graph.fake import on_fake_cpu
from autoplan.graph.ir import Graph
from autoplan.graph.passes import (
    casts_to_readers,
    decomposed,
    drop_checks,
    inline_regions,
    mutates,
    refuse_other_writes,
    tie_parameters,
)
from autoplan.modes import Precision
from autoplan.precision import autocast_device, computing, loss_input, model_input
from autoplan.torch_private.aten_export import ATEN_EXPORT, export_aten
from autoplan.torch_private.flex_op import traced_flex_attention


class TrainStep(nn.Module):
    """``model`` followed by ``loss_fn(output, target)``: the module that gets traced. Without
    a ``loss_fn`` the model computes its own loss: its output, or the output's ``loss``
    (Hugging Face's ``ModelOutput``, or a dict with a "loss"). The last ``len(keywords)``
    inputs are passed to ``model`` by those names (see `keywords`). With a ``precision``
    (`autoplan.precision`) model and loss run in it: under ``torch.autocast`` of its dtype,
    or (bf16-params) on the parameters and inputs cast to bf16, the loss on a float32 output."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None,
        keywords: tuple[str, ...] = (),
        precision: str | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keywords = keywords
        self.precision = precision
        self.device_type = autocast_device(model.parameters())

    def forward(self, *args: Any) -> Any:
        with computing(self.precision, self.model, self.device_type):
            return self._loss(*args)

    def _loss(self, *args: Any) -> Any:
        inputs, target = (args, None) if self.loss_fn is None else (args[:-1], args[-1])
        inputs = tuple(model_input(self.precision, a) for a in inputs)
        positional = len(inputs) - len(self.keywords)
        named = dict(zip(self.keywords, inputs[positional:], strict=True))
        output = self.model(*inputs[:positional], **named)
        if self.loss_fn is not None:
            return self.loss_fn(loss_input(self.precision, output), target)
        if isinstance(output, Mapping) and "loss" in output:
            return output["loss"]
        return output


def keywords(example_inputs: Any) -> tuple[str, ...]:
    """The names of the inputs passed by keyword: a mapping's keys, sorted (``model(**inputs)``,
    as Hugging Face models are called); none for a tensor, tuple or list."""
    if not isinstance(example_inputs, Mapping):
        return ()
    names = tuple(sorted(example_inputs))
    if not all(isinstance(n, str) for n in names):
        raise TraceError(
            f"example inputs given as a mapping must have argument names as keys, got {names}"
        )
    return names


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """The inputs as positional values: a mapping's in the order of `keywords`."""
    if isinstance(example_inputs, Mapping):
        return tuple(example_inputs[name] for name in keywords(example_inputs))
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def batch_size(example_inputs: Any, example_target: Any = None) -> int:
    """The step's batch as the traced graph gives it (`autoplan.baselines.grid.batch_of`):
    dim 0 of its first input with dims (1 without one)."""
    args = (*as_tuple(example_inputs), example_target)
    return next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)


def microbatch(batch: Any, count: int) -> Any:
    """The first of ``count`` equal microbatches of ``batch`` (tensors split along dim 0;
    tuples, lists and mappings element by element); what a pipeline stage sees per step. One
    microbatch is the batch itself: a tensor given twice (token ids as their own labels) stays
    one tensor, which export traces otherwise than two."""
    if count == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        if not batch.dim():
            return batch
        if count < 1 or batch.shape[0] % count:
            raise BatchSplitError(
                f"a batch of {batch.shape[0]} (dim 0 of {str(batch.dtype).removeprefix('torch.')}"
                f"{list(batch.shape)}) does not split into {count} equal microbatches: use a "
                f"number of microbatches that divides {batch.shape[0]}"
            )
        return batch[: batch.shape[0] // count]
    if isinstance(batch, tuple | list):
        return type(batch)(microbatch(b, count) for b in batch)
    if isinstance(batch, Mapping):
        return {name: microbatch(b, count) for name, b in batch.items()}
    return batch


def step_args(
    model: nn.Module, example_inputs: Any, example_target: Any, with_loss: bool
) -> tuple[Any, ...]:
    """The positional arguments of `TrainStep`, on the meta device if the model is on meta."""
    args = as_tuple(example_inputs)
    if with_loss:
        if example_target is None:
            raise TraceError(
                "a loss_fn was given without example_target; pass the target batch too, e.g. "
                "plan(model, x, cluster, loss_fn=F.mse_loss, example_target=y)"
            )
        args = (*args, example_target)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    return args


def export_step(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    precision: str | None = None,
) -> ExportedProgram:
    """Export the train step (under autocast for a ``precision``, `autoplan.precision`); a
    failure becomes a `TraceError` that names the user's line. Under autocast the step is
    exported at the ATen level in one trace, where autocast's casts are ops
    (`autoplan.torch_private.aten_export`); a torch without that export traces it and then
    retraces it so (`decomposed`)."""
    args = step_args(model, example_inputs, example_target, loss_fn is not None)
    wrapper = TrainStep(model, loss_fn, keywords(example_inputs), precision)
    # under autocast, traced at the ATen level at once: its casts are ops from the start
    at_aten = precision is not None and ATEN_EXPORT
    try:
        with (
            traced_flex_attention(),
            on_fake_cpu(wrapper, args, precision is not None) as fake_args,
        ):
            if at_aten:
                ep = export_aten(wrapper, fake_args)
            else:
                ep = torch.export.export(wrapper, fake_args, strict=False)
    except Exception as e:  # torch raises many types here; all become one clear error
        raise TraceError(explain_trace_failure(model, e, args)) from e
    if precision is not None and not at_aten:  # autocast's region inlined, its casts ops
        ep = decomposed(ep)
    inline_regions(ep)
    if mutates(ep) or trains_batch_norm(ep.graph):
        ep = decomposed(ep)
    refuse_other_writes(ep)
    refuse_float_indices(ep, model, args)
    refuse_mixed_dtypes(ep, model, args)
    drop_checks(ep)
    refuse_data_dependent(ep, model)  # what only the dropped checks read is gone
    tie_parameters(ep)
    if precision == Precision.BF16_PARAMS:
        casts_to_readers(ep)
    return ep


def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    precision: str | None = None,
) -> Graph:
    """Trace ``model`` (and ``loss_fn`` applied to its output and ``example_target``), under
    autocast for a mixed ``precision``."""
    ep = export_step(model, example_inputs, loss_fn, example_target, precision)
    return graph_from_export(ep, precision)


def capture_microbatches(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    precision: str | None = None,
) -> Callable[[int], Graph]:
    """``capture`` of the step at a number of microbatches: ``at(count)`` traces it on the
    first of ``count`` microbatches of the example batch (`microbatch`)."""

    def at(count: int) -> Graph:
        inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
        return capture(model, inputs, loss_fn, target, precision)

    return at
