"""Batch norm in training mode as the reductions it is made of, so that its statistics are the
whole batch's however the plan splits the batch (torch's SyncBatchNorm semantics).

torch's batch norm kernel normalizes by the statistics of the tensor it is given: run on a
rank's shard of a split batch, by that shard's. Traced as ops the planner has rules for, its
statistics are two means over the batch and spatial dims (``mean.dim``, whose value over a
split dim is a partial sum, `autoplan.strategies.rules`), each all-reduced where the plan
splits the batch: per channel, the mean, then the mean of the squared deviations from it. The
plan prices and lists those all-reduces (and their mirror in backward) as it does every
redistribution, and weighs them against normalizing a gathered batch on every rank. Forward
and backward are then one process's, up to rounding (the variance computed in two passes,
not as the difference of two means, which cancels).

The running statistics are updated as torch updates them, from the batch's statistics:
``(1 - momentum) * running + momentum * statistic``, the variance unbiased (times ``n / (n -
1)``, ``n`` the elements per channel); the values written back go out as the step's buffer
writes (`autoplan.graph.ir.Write`). Batch norm in eval mode stays one op: each sample is
normalized alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_aten = torch.ops.aten


def _normalized(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` normalized by its statistics over every dim but the channels' (dim 1), scaled
    and shifted; with the mean, biased variance and inverse standard deviation (kept dims).
    A half-precision ``x`` (bf16 or fp16, under autocast) is normalized in float32 and the
    output cast back, as torch's kernel accumulates and returns it."""
    dtype = x.dtype
    if dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    dims = [0, *range(2, x.dim())]
    mean = torch.mean(x, dims, keepdim=True)
    centered = x - mean
    var = torch.mean(centered * centered, dims, keepdim=True)
    invstd = torch.rsqrt(var + eps)
    out = centered * invstd
    channels = [1, -1] + [1] * (x.dim() - 2)
    if weight is not None:
        out = out * weight.view(channels)
    if bias is not None:
        out = out + bias.view(channels)
    return out.to(dtype), mean, var, invstd


def _functional(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``_native_batch_norm_legit_functional``: the output, the batch's mean and inverse
    standard deviation, and the updated running mean and variance."""
    assert training, "eval-mode batch norm traces as _native_batch_norm_legit_no_training"
    out, mean, var, invstd = _normalized(x, weight, bias, eps)
    # the running statistics take no gradient (torch's kernel updates them outside autograd)
    batch_mean, batch_var = mean.detach().view(-1), var.detach().view(-1)
    count = x.numel() // x.shape[1]  # more than one: torch refuses fewer in training
    unbiased = count / (count - 1)
    new_mean = running_mean * (1 - momentum) + batch_mean.to(running_mean.dtype) * momentum
    new_var = running_var * (1 - momentum) + batch_var.to(running_var.dtype) * (momentum * unbiased)
    return out, mean.view(-1), invstd.view(-1), new_mean, new_var


def _without_statistics(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``_native_batch_norm_legit.no_stats`` (``track_running_stats=False``): the output, the
    batch's mean and inverse standard deviation."""
    del training, momentum  # always the batch's statistics, none kept
    out, mean, _, invstd = _normalized(x, weight, bias, eps)
    return out, mean.view(-1), invstd.view(-1)


# what `autoplan.graph.passes.decomposed` decomposes (functionalized, batch norm in training
# becomes one of these)
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    _aten._native_batch_norm_legit_functional.default: _functional,
    _aten._native_batch_norm_legit.no_stats: _without_statistics,
}


def trains_batch_norm(graph: torch.fx.Graph) -> bool:
    """Whether a batch norm of ``graph`` normalizes by the batch's statistics (training mode),
    which only the decomposition makes exact over a split batch."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _aten.batch_norm.default:
            training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
            if training:
                return True
    return False
