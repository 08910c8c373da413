"""Forward and backward FLOPs of an ATen op from its tensor shapes.

Matrix-like ops count 2 FLOPs per multiply-add; their backward computes the gradient of each
differentiable input, each costing about the forward. Everything else is counted as one FLOP
per output element (forward and backward), which only matters through the roofline's
memory-bound term anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.graph.ir import TensorInfo


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def op_flops(
    op: str, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], num_grad_inputs: int
) -> tuple[float, float]:
    """(forward, backward) FLOPs. ``num_grad_inputs`` counts inputs that receive a gradient."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    out_numel = sum(o.numel for o in outputs)
    if name in ("linear", "mm", "addmm", "matmul", "bmm", "baddbmm"):
        a, b = (inputs[1], inputs[2]) if name in ("addmm", "baddbmm") else (inputs[0], inputs[1])
        # contracted size: last dim of the first operand
        fwd = 2.0 * out_numel * a.shape[-1]
        del b
        return fwd, fwd * max(num_grad_inputs, 0)
    if name.startswith("scaled_dot_product") or name.startswith("_scaled_dot_product"):
        q, k = inputs[0], inputs[1]
        batch = _prod(q.shape[:-2])
        tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        dv = inputs[2].shape[-1]
        fwd = 2.0 * batch * tq * tk * (d + dv)  # Q K^T and (softmax) V
        return fwd, 2.0 * fwd if num_grad_inputs else 0.0
    if name in ("convolution", "conv1d", "conv2d", "conv3d"):
        weight = inputs[1]
        # per output element: one multiply-add per (in_channels/groups * kernel) weight
        fwd = 2.0 * out_numel * _prod(weight.shape[1:])
        return fwd, fwd * max(num_grad_inputs, 0)
    return float(out_numel), float(out_numel) if num_grad_inputs else 0.0
