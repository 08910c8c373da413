"""Forward and backward FLOPs of an ATen op from its tensor shapes.

Matrix-like ops count 2 FLOPs per multiply-add; their backward computes the gradient of each
differentiable input, each costing about the forward. Everything else is counted as one FLOP
per output element (forward and backward), which only matters through the roofline's
memory-bound term anyway; but an add of tensors of its output's shape and dtype (a residual
add) does nothing in backward, which passes the gradient on unchanged (the cost model prices
an op with no backward FLOPs as moving no bytes in backward).

Ops that evaluate a transcendental function per element (GELU's erf, SiLU's and softmax's exp)
are compute-bound where the roofline's one FLOP per element says memory-bound: by hand, GELU's
forward and backward on a CPU core took ~9x the time of moving their bytes. `transcendental`
counts those elements, which the cost model prices at the profiled speed of GELU.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.graph.ir import TensorInfo

# a mixture of experts' grouped matmul, ``(x (S, K), w (E, K, N), offs (E,)) -> (S, N)``, as
# transformers traces it: torch's in bfloat16, else its own fallback (a custom op);
# strategies/grouped_mm.py has their rule
GROUPED_MMS = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


# attention's ops: scaled dot-product attention's, and FlexAttention's (its score_mod's and
# mask's few element-wise ops per score are left out, as an attention mask's are)
_ATTENTION = ("scaled_dot_product", "_scaled_dot_product", "flex_attention")


def op_flops(
    op: str, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], grads: Sequence[bool]
) -> tuple[float, float]:
    """(forward, backward) FLOPs; ``grads[i]`` says whether input ``i`` receives a gradient."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    out_numel = sum(o.numel for o in outputs)
    if name in ("linear", "mm", "addmm", "matmul", "bmm", "baddbmm") or op in GROUPED_MMS:
        # the two matrix operands (addmm's first input is the bias); each needing a gradient
        # costs one more matmul of the forward's size. A grouped matmul (x (S, K), experts'
        # w (E, K, N), offsets) multiplies each of its S rows by one expert's (K, N)
        a = 1 if name in ("addmm", "baddbmm") else 0
        fwd = 2.0 * out_numel * inputs[a].shape[-1]
        return fwd, fwd * (grads[a] + grads[a + 1])
    if name.startswith(_ATTENTION):
        q, k = inputs[0], inputs[1]
        batch = _prod(q.shape[:-2])
        tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        dv = inputs[2].shape[-1]
        fwd = 2.0 * batch * tq * tk * (d + dv)  # Q K^T and (softmax) V
        return fwd, 2.0 * fwd if any(grads[:3]) else 0.0
    if name in ("convolution", "conv1d", "conv2d", "conv3d"):
        # per output element: one multiply-add per (in_channels/groups * kernel) weight
        fwd = 2.0 * out_numel * _prod(inputs[1].shape[1:])
        return fwd, fwd * (grads[0] + grads[1])
    if name == "add" and all(
        i.shape == o.shape and i.dtype == o.dtype for i in inputs for o in outputs
    ):
        # a residual add's backward hands its output's gradient on to both inputs as it is
        return float(out_numel), 0.0
    return float(out_numel), float(out_numel) if any(grads) else 0.0


# one transcendental evaluation per element of the (first) output
_PER_OUTPUT = {"gelu", "silu", "sigmoid", "tanh", "exp", "log", "erf", "softmax", "log_softmax"}
_PER_OUTPUT |= {f"_{n}" for n in ("softmax", "log_softmax")}


def transcendental(op: str, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> float:
    """Elements through which ``op``'s forward evaluates a transcendental function: an
    activation's or softmax's output, cross-entropy's logits, attention's scores."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    if name in _PER_OUTPUT and outputs:
        return float(outputs[0].numel)
    if name == "cross_entropy_loss" and inputs:
        return float(inputs[0].numel)  # log_softmax over the logits
    if name.startswith(_ATTENTION) and len(inputs) > 1:
        q, k = inputs[0], inputs[1]
        return float(_prod(q.shape[:-1]) * k.shape[-2])  # softmax over the scores
    return 0.0
