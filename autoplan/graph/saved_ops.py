"""Which ops of a layer torchtitan's op-level selective activation checkpointing saves
(``torchtitan.distributed.activation_checkpoint.SelectiveAC``, torchtitan 0.3.0): the rest
of the layer runs its forward again in backward (`autoplan.graph.recompute`, mode "ops").

Its policy sees the ATen ops a block dispatches, below autograd, and saves the outputs of:
the ops torch's partitioner counts compute-intensive (``mm``, ``addmm``, ``bmm``,
convolution, ``_scaled_mm``, the flash and efficient attention kernels), every scaled
dot-product attention kernel, ``max`` (a float8 scale's amax) and ``topk`` (an MoE router's
choice), and the reduce-scatter and all-to-all collectives; except every second ``mm`` of the
block, counted from its first, which is recomputed. Everything else is recomputed.

Our graph keeps the composite ops that export keeps, so each is mapped to the kernel it
dispatches: a linear with a bias to ``addmm`` (saved; its input two- or three-dimensional and
contiguous), one without to ``mm`` (counted); ``matmul`` of a matrix by a weight matrix to
``mm``, of two batches of matrices to ``bmm``; ``einsum`` to ``bmm``; a convolution to
``convolution``. The collectives are no ops of our graph: the executor issues them where the
plan's placements differ, and a recomputed op's forward collectives are issued again (phase
"recompute").
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.graph.ir import Graph, Node

FUSED_ATTENTION = ("aten.scaled_dot_product_", "aten._scaled_dot_product_")
# saved whatever their count: compute-intensive kernels, amax, and the router's topk
ALWAYS_SAVED = frozenset(
    {
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.einsum.default",
        "aten._scaled_mm.default",
        "aten.convolution.default",
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.max.default",
        "aten.topk.default",
    }
)


def saved_ops(graph: Graph, ops: Sequence[str]) -> frozenset[str]:
    """The ops of ``ops`` (one layer's, in graph order) whose outputs the policy saves: the
    always-saved kernels and the first, third, fifth ... matrix product (``mm``)."""
    saved: set[str] = set()
    products = 0
    for name in ops:
        node = graph.node(name)
        kernel = _kernel(graph, node)
        if kernel == "mm":
            products += 1
            if products % 2 == 1:
                saved.add(name)
        elif kernel == "saved":
            saved.add(name)
    return frozenset(saved)


def _kernel(graph: Graph, node: Node) -> str:
    """What ``node`` dispatches: "mm" (an ``mm``), "saved" (an always-saved kernel) or ""
    (anything else)."""
    if node.op.startswith(FUSED_ATTENTION) or node.op in ALWAYS_SAVED:
        return "saved"
    if node.op == "aten.mm.default":
        return "mm"
    if node.op == "aten.linear.default":
        has_bias = len(node.refs) > 2
        return "saved" if has_bias else "mm"
    if node.op == "aten.matmul.default" and len(node.refs) == 2:
        first, second = (len(graph.tensor(r).shape) for r in node.refs)
        if first >= 2 and second == 2:
            return "mm"
        if first >= 3 and second >= 3:
            return "saved"
    return ""
