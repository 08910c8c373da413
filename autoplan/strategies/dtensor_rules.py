"""Adapter over DTensor's own per-mesh-axis sharding rules.

DTensor's rule for an ATen op on one mesh axis is a list of placement lists
``[outputs..., tensor args...]`` built from the args' shapes. This is exactly our per-axis
rule, so we call it and translate DTensor placements to "R" / "P" / "S(d)". The private pieces
it needs, and how each torch release states its rules, are in `autoplan.torch_private`; tests
pin its behaviour.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoplan.graph.ir import Ref, TensorInfo
from autoplan.graph.saved import resolve
from autoplan.strategies.placement import P, R, shard
from autoplan.torch_private import (
    MaskPartial,
    RuntimeSchemaInfo,
    ShardingPlaceholder,
    TensorMeta,
    dtensor_axis_rules,
    register_single_dim_strategy,
)

log = logging.getLogger(__name__)

AxisRule = tuple[str, ...]  # (output, tensor input 0, tensor input 1, ...) on one mesh axis


def resolve_op(op: str) -> torch._ops.OpOverload | None:
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor`` (None if it is not an ATen op)."""
    return resolve(op) if op.startswith("aten.") and op.count(".") == 2 else None


def has_rule(op: str) -> bool:
    overload = resolve_op(op)
    return overload is not None and dtensor_axis_rules(overload) is not None


def _meta(info: TensorInfo) -> TensorMeta:
    stride = []
    acc = 1
    for s in reversed(info.shape):
        stride.append(acc)
        acc *= max(s, 1)
    return TensorMeta(torch.Size(info.shape), tuple(reversed(stride)), getattr(torch, info.dtype))


def _schema_value(value: Any, tensors: dict[Ref, TensorInfo]) -> Any:
    if isinstance(value, Ref):
        return _meta(tensors[value])
    if isinstance(value, tuple):
        return [_schema_value(v, tensors) for v in value]
    return value


def _placement(p: Any, ndim: int) -> str | None:
    if isinstance(p, Replicate):
        return R
    if isinstance(p, MaskPartial):
        # a row-split embedding's output is a sum only after DTensor masks it, at reduction
        # time; DTensor's rules for other ops do not take it as a partial, so a plan that fed
        # it on as "P" would run differently from its plan. Our embedding rule plans that
        # split, run masked on local tensors (execute/vocab.py).
        return None
    if isinstance(p, Partial):
        # "P" is a partial sum. DTensor's rules with mean partials (a + b is a mean partial
        # when a is and b is replicated) do not hold for sums, and max/min partials of
        # monotone ops are not linear at all (relu of a sum is not the sum of relus).
        return P if p.reduce_op == "sum" else None
    if isinstance(p, ShardingPlaceholder | Shard):
        return shard(p.dim % ndim) if ndim else None
    return None


def axis_rules(
    op: str,
    args: Sequence[Any],
    kwargs: Sequence[tuple[str, Any]],
    tensors: dict[Ref, TensorInfo],
    num_outputs: int,
    out_ndim: int,
    in_ndims: Sequence[int],
) -> list[AxisRule] | None:
    """DTensor's single-axis strategies as (output, inputs...) tuples, or None if it has none.

    Multi-output ops keep only strategies that place every output alike.
    """
    overload = resolve_op(op)
    rule = dtensor_axis_rules(overload) if overload is not None else None
    if rule is None:
        return None
    args_schema = tuple(_schema_value(a, tensors) for a in args)
    kwargs_schema = {k: _schema_value(v, tensors) for k, v in kwargs}
    try:
        raw = rule(overload, args_schema, kwargs_schema)
    except Exception as e:  # a rule that cannot handle these args: fall back to ours/replicate
        log.debug("DTensor rule for %s failed: %s", op, e)
        return None
    rules: list[AxisRule] = []
    for placements in raw:
        outs = [_placement(p, out_ndim) for p in placements[:num_outputs]]
        ins = [_placement(p, nd) for p, nd in zip(placements[num_outputs:], in_ndims, strict=False)]
        if len(ins) != len(in_ndims) or None in outs or None in ins or len(set(outs)) != 1:
            continue
        rules.append((outs[0], *ins))  # type: ignore[arg-type]
    return rules


def _attention_axis_rules(num_outputs: int, metas: list[Any]) -> list[list[Any]]:
    """Split batch (dim 0) or heads (dim 1) of every tensor alike; a mask whose batch or head
    extent is 1 stays replicated."""
    rules = []
    for dim in (0, 1):
        row: list[Any] = [ShardingPlaceholder(dim)] * num_outputs
        for meta in metas:
            broadcast = len(meta.shape) <= dim or meta.shape[dim] == 1
            row.append(Replicate() if broadcast else ShardingPlaceholder(dim))
        rules.append(row)
    return rules


def _tensor_metas(args: Any, kwargs: Any) -> list[Any]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, TensorMeta)]


_registered = False


def register_missing_rules() -> None:
    """Teach DTensor the CPU flash-attention op and its backward (torch 2.13 has no rule), so
    head- or batch-split attention runs on gloo exactly as planned. Idempotent."""
    global _registered
    if _registered:
        return
    aten = torch.ops.aten

    @register_single_dim_strategy(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        schema_info=RuntimeSchemaInfo(3, static_kwargkey=["scale"]),
    )
    def _forward(op: Any, args: Any, kwargs: Any) -> list[list[Any]]:
        return _attention_axis_rules(2, _tensor_metas(args, kwargs))  # out, logsumexp

    @register_single_dim_strategy(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        schema_info=RuntimeSchemaInfo(6, static_kwargkey=["scale"]),
    )
    def _backward(op: Any, args: Any, kwargs: Any) -> list[list[Any]]:
        return _attention_axis_rules(3, _tensor_metas(args, kwargs))  # grad q, k, v

    _registered = True
