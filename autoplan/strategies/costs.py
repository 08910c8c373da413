"""What a strategy costs over one whole train step, on one logical mesh of a cluster.

* An op's time is its forward + backward FLOPs and bytes under the roofline, divided by the
  number of devices that split the work (the product of the mesh axes on which any of its
  tensors is split or partial; a replicated axis repeats the work).
* A parameter's time is its optimizer update on the locally stored shard; its memory is the
  stored shard with its gradient and optimizer state.
* An op's memory is its output shard, which backward keeps (views keep nothing new).
* An edge's time is the forward redistribution from the producer's placement to the one the
  consumer needs, plus the backward redistribution of the gradient (`grad_spec`) back to the
  producer's placement. For a parameter that backward step is gradient synchronization: an
  all-reduce to replicated storage or a reduce-scatter to sharded (ZeRO) storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from autoplan.cluster import Cluster, Link
from autoplan.costmodel import collective_time, compute_time
from autoplan.graph.ir import INPUT, OUTPUT, PARAM, Node, TensorInfo, itemsize
from autoplan.strategies.placement import (
    Collective,
    R,
    Spec,
    grad_spec,
    local_numel,
    redistribute,
    without_partial,
)
from autoplan.strategies.space import Strategy

# Optimizer state kept per parameter element, in parameter elements (Adam: exp_avg, exp_avg_sq)
OPTIMIZER_STATE = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True)
class Phased:
    """A collective with the phase of the step that issues it."""

    collective: Collective
    phase: str  # "forward" | "backward" | "grad_sync"


class StepCosts:
    """Prices strategies and edges for one (cluster, logical mesh, optimizer)."""

    def __init__(self, cluster: Cluster, mesh_shape: tuple[int, ...], optimizer: str) -> None:
        if optimizer not in OPTIMIZER_STATE:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE)}"
            )
        self.cluster = cluster
        self.mesh_shape = mesh_shape
        self.state_per_elem = OPTIMIZER_STATE[optimizer]
        self.links: tuple[Link, ...] = tuple(
            cluster.axis_link(mesh_shape, a) for a in range(len(mesh_shape))
        )
        self._redistribute = lru_cache(maxsize=None)(self._redistribute_uncached)

    # ------------------------------------------------------------------ nodes

    def split_factor(self, strategy: Strategy) -> int:
        factor = 1
        for axis, size in enumerate(self.mesh_shape):
            specs = (strategy.output, *strategy.inputs)
            if any(s and s[axis] != R for s in specs):
                factor *= size
        return factor

    def node_time(self, node: Node, strategy: Strategy) -> float:
        if node.kind == PARAM:
            if not node.needs_grad:
                return 0.0
            elems = local_numel(strategy.output, node.output.shape, self.mesh_shape)
            size = itemsize(node.output.dtype)
            # update reads param, grad and state, writes param and state
            update_bytes = elems * size * (3 + 2 * self.state_per_elem)
            return compute_time(self.cluster, 4.0 * elems, update_bytes, node.output.dtype)
        if node.kind != "op" or node.is_view:
            return 0.0
        f = self.split_factor(strategy)
        dtype = node.outputs[0].dtype if node.outputs else "float32"
        # backward moves about twice the forward's bytes (grad in, grad out, saved input)
        moved = node.bytes_moved * (3.0 if node.needs_grad else 1.0)
        return compute_time(self.cluster, (node.flops + node.bwd_flops) / f, moved / f, dtype)

    def node_memory(self, node: Node, strategy: Strategy) -> float:
        if node.kind in (PARAM, INPUT):
            info = node.output
            elems = local_numel(strategy.output, info.shape, self.mesh_shape)
            if node.kind == INPUT or not node.needs_grad:
                return float(elems * itemsize(info.dtype))
            return float(elems * itemsize(info.dtype) * (2 + self.state_per_elem))
        if node.kind == OUTPUT or node.is_view or not node.needs_grad:
            return 0.0
        return float(
            sum(
                local_numel(strategy.output, o.shape, self.mesh_shape) * itemsize(o.dtype)
                for o in node.outputs
            )
        )

    # ------------------------------------------------------------------ edges

    def _redistribute_uncached(
        self, src: Spec, dst: Spec, shape: tuple[int, ...], size: int
    ) -> tuple[tuple[Collective, ...], float]:
        found = redistribute(src, dst, shape, size, self.mesh_shape)
        seconds = sum(
            collective_time(
                self.cluster, c.kind, c.nbytes, self.mesh_shape[c.axis], self.links[c.axis]
            )
            for c in found
        )
        return found, seconds

    def edge(
        self,
        producer: Node,
        tensor: TensorInfo,
        src: Strategy,
        consumer: Node,
        dst: Strategy,
        index: int,
    ) -> tuple[float, tuple[Phased, ...]]:
        """Time and collectives of moving ``tensor`` from ``producer`` into input ``index``."""
        size = itemsize(tensor.dtype)
        need = dst.inputs[index]
        fwd, seconds = self._redistribute(src.output, need, tensor.shape, size)
        phased = [Phased(c, "forward") for c in fwd]
        if producer.needs_grad and consumer.kind != OUTPUT:
            grad = grad_spec(need, dst.output)
            bwd, bwd_seconds = self._redistribute(
                grad, without_partial(src.output), tensor.shape, size
            )
            seconds += bwd_seconds
            phase = "grad_sync" if producer.kind == PARAM else "backward"
            phased += [Phased(c, phase) for c in bwd]
        return seconds, tuple(phased)


def total_bytes(phased: tuple[Phased, ...]) -> int:
    return sum(p.collective.nbytes for p in phased)


def devices(mesh_shape: tuple[int, ...]) -> int:
    return math.prod(mesh_shape)
