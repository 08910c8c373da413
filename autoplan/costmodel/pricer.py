"""What a strategy costs over one whole train step, on one logical mesh of a cluster.

* An op's time is its forward + backward FLOPs and bytes under the roofline, with its
  transcendental work, divided by the number of devices that split the work (the product of
  the mesh axes on which any of its tensors is split or partial; a replicated axis repeats the
  work), plus the framework's work per op (views and parameters included; see
  `autoplan.costmodel.timing`).
* A parameter's time is its optimizer update on the locally stored shard; its memory is the
  stored shard with its gradient and optimizer state. Under ZeRO-1/2 (`strategies.zero`) the
  update runs on the state's shard and is gathered back (`internal`); its memory is the
  parameter as stored, its gradient as kept, and the shard's state and master copy.
* An op's memory is the shard of each of its outputs that backward keeps (saved by it or a
  reader; `autoplan.graph.saved`) and of what its backward saves besides; views keep nothing.
  An attention split along the sequence keeps its keys and values gathered (`keys_memory`).
* A recomputed op (`autoplan.graph.recompute`) runs its forward twice, and keeps its output
  only where it leaves its layer; the rest the ILP counts at the recomputation's share (a
  mode given for every layer; where the ILP chooses, `autoplan.search.recompute_ilp`).
* An edge's time is the forward redistribution from the producer's placement to the one the
  consumer needs, plus the backward redistribution of the gradient (`grad_spec`) back to
  where the producer keeps it (its placement, or partial: `Strategy.grad_target`). For a
  parameter that backward step is gradient synchronization: an all-reduce to replicated
  storage or a reduce-scatter to sharded (ZeRO) storage. Every collective but a gradient
  bucket's all-reduce goes through DTensor's redistribution and pays its measured overhead,
  and the ranks' measured skew at a collective that blocks the step (`sync_overhead`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from autoplan.cluster.model import Cluster
from autoplan.costmodel.issued import Phased, dispatch_collectives, loss_collectives
from autoplan.costmodel.tiles import matmul_tile_share
from autoplan.costmodel.timing import (
    activation_time,
    collective_time,
    compute_time,
    host_overhead,
    redistribute_overhead,
    sync_overhead,
    with_overhead,
)
from autoplan.graph.flops import GROUPED_MMS
from autoplan.graph.ir import Node, TensorInfo, itemsize
from autoplan.graph.recompute import NO_RECOMPUTE, Recompute
from autoplan.modes import NodeKind, Phase
from autoplan.strategies.attention import context_axes
from autoplan.strategies.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientSync
from autoplan.strategies.placement import (
    Collective,
    R,
    Spec,
    local_numel,
    movable,
    redistribute,
    shard_dim,
)
from autoplan.strategies.space import Strategy, input_grad

# Optimizer state kept per parameter element, in parameter elements (Adam: exp_avg, exp_avg_sq)
OPTIMIZER_STATE = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}
# a move to or from a strided split of unequal pieces ("S(d)x4:1:1"), which DTensor has no
# placement for and the executor holds as a plain split of its pieces' shares side by side
# (execute/placements.py): made from the parameter by the ops that keep it, cut into its
# pieces by a split, never moved. Priced so that no plan moves one (`movable` refuses those
# that do, read from a file)
UNMOVABLE_S = 10.0


class Pricer:
    """Prices strategies and edges for one (cluster, logical mesh, optimizer)."""

    def __init__(
        self,
        cluster: Cluster,
        mesh_shape: tuple[int, ...],
        optimizer: str,
        recompute: Recompute = NO_RECOMPUTE,
    ) -> None:
        if optimizer not in OPTIMIZER_STATE:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE)}"
            )
        self.cluster = cluster
        self.mesh_shape = mesh_shape
        self.optimizer = optimizer
        self.state_per_elem = OPTIMIZER_STATE[optimizer]
        self.recompute = recompute
        self.has_all_to_all = cluster.backend != "gloo"
        self._redistribute = lru_cache(maxsize=None)(self._redistribute_uncached)
        self._link = lru_cache(maxsize=None)(lambda axes: cluster.axis_link(mesh_shape, axes))
        self._nodes = lru_cache(maxsize=None)(lambda axes: cluster.axis_nodes(mesh_shape, axes))
        self._all_reduce_s = lru_cache(maxsize=None)(
            lambda axes, nbytes: self.collective_s(Collective("all_reduce", axes, nbytes))
        )

    def recomputing(self, recompute: Recompute) -> Pricer:
        """The same prices for a step recomputing ``recompute``."""
        return Pricer(self.cluster, self.mesh_shape, self.optimizer, recompute)

    # ------------------------------------------------------------------ nodes

    def split_factor(self, strategy: Strategy) -> int:
        factor = 1
        for axis, size in enumerate(self.mesh_shape):
            specs = (strategy.output, *strategy.inputs)
            if any(s and s[axis] != R for s in specs):
                factor *= size
        return factor

    def node_time(self, node: Node, strategy: Strategy) -> float:
        if node.kind == NodeKind.PARAM:
            if not node.needs_grad:
                return 0.0
            updated = strategy.state or strategy.output  # ZeRO-1/2: its shard alone
            elems = local_numel(updated, node.output.shape, self.mesh_shape)
            size = itemsize(node.output.dtype)
            # update reads param, grad and state, writes param and state
            update_bytes = elems * size * (3 + 2 * self.state_per_elem)
            update = compute_time(self.cluster, 4.0 * elems, update_bytes, node.output.dtype)
            return with_overhead(self.cluster, update)  # its gradient's accumulation node
        if node.kind != "op":
            return 0.0
        again = self.recompute.recomputes(node.name)  # its forward runs again in backward
        if node.is_view and not node.bytes_moved:  # nothing to do (a cast copies its bytes)
            return with_overhead(self.cluster, 0.0, "view") * (2 if again else 1)
        f = self.split_factor(strategy)
        dtype = node.outputs[0].dtype if node.outputs else "float32"
        # backward moves about twice the forward's bytes (grad in, grad out, saved input);
        # one that computes nothing (a residual add's, graph/flops.py) moves nothing
        moved = node.bytes_moved * (3.0 if node.needs_grad and node.bwd_flops else 1.0)
        useful = self.tile_share(node, strategy)
        flops = (node.flops + node.bwd_flops) / f
        seconds = compute_time(self.cluster, flops, moved / f, dtype, useful)
        transcendental = node.transcendental * itemsize(dtype) / f
        activation = activation_time(self.cluster, transcendental, dtype)
        total = with_overhead(self.cluster, seconds + activation, node.op)
        if again:
            total += self.forward_time(node, strategy)
        return total

    def forward_time(self, node: Node, strategy: Strategy) -> float:
        """Of an op's `node_time`, one forward: its forward's FLOPs and bytes under the
        roofline and half its transcendental work (0 for parameters and inputs)."""
        if node.kind != "op":
            return 0.0
        if node.is_view and not node.bytes_moved:  # nothing to do (a cast copies its bytes)
            return with_overhead(self.cluster, 0.0, "view")
        f = self.split_factor(strategy)
        dtype = node.outputs[0].dtype if node.outputs else "float32"
        useful = self.tile_share(node, strategy, backward=False)
        forward = compute_time(self.cluster, node.flops / f, node.bytes_moved / f, dtype, useful)
        transcendental = node.transcendental * itemsize(dtype) / f
        activation = activation_time(self.cluster, transcendental, dtype)
        return with_overhead(self.cluster, forward + activation / 2, node.op)

    def tile_share(self, node: Node, strategy: Strategy, backward: bool = True) -> float:
        """Of ``node``'s work, the share inside its results' GPU tiles (`matmul_tile_share`);
        1 on CPU ranks."""
        if self.cluster.backend == "gloo":
            return 1.0
        return matmul_tile_share(node, strategy, self.mesh_shape, backward)

    def backward_time(self, node: Node, strategy: Strategy) -> float:
        """Of an op's `node_time`, what runs in backward: its gradients and, recomputed, its
        forward again (0 for parameters, whose update runs after backward)."""
        if node.kind != "op" or not node.needs_grad:
            return 0.0
        return max(0.0, self.node_time(node, strategy) - self.forward_time(node, strategy))

    def host_time(self, node: Node) -> float:
        """On GPUs, the host's work to issue ``node`` (`host_overhead`; 0 on CPU ranks, where
        `node_time` holds it): a step's compute takes at least its nodes' sum
        (`step_price.price_step`). The same for every strategy of the node."""
        if node.kind == NodeKind.PARAM:
            return host_overhead(self.cluster) if node.needs_grad else 0.0
        if node.kind != "op":
            return 0.0
        seconds = host_overhead(self.cluster, "view" if node.is_view else node.op)
        return 2 * seconds if self.recompute.recomputes(node.name) else seconds

    def internal(
        self,
        node: Node,
        strategy: Strategy,
        ins: Sequence[TensorInfo] = (),
        gathered: str | None = None,
    ) -> tuple[Phased, ...]:
        """Collectives an op issues beyond redistributing its inputs (``ins``: its tensor
        inputs, in `Node.refs` order).

        A batch-split cross-entropy with mean reduction divides by its targets' total weight
        over the whole batch: the executor sums that scalar along the axes that split the
        targets in forward, one all-reduce per axis, as soon as the targets are there
        (execute/op_calls.py). A cross-entropy split along the classes (the vocabulary)
        all-reduces, along each axis that splits them, the maximum of each element's logits
        and then its target's logit with its sum of exponentials (execute/vocab.py).

        A parameter whose optimizer state is split (ZeRO-1/2, `autoplan.strategies.zero_state`) is
        gathered back from its updated shards after the optimizer step (phase "update"), in
        ``gathered`` (`autoplan.strategies.zero_state.param_gathered_dtype`; None: its own).
        """
        if node.kind == NodeKind.PARAM:
            if strategy.state is None:
                return ()
            info = node.output
            size = itemsize(gathered or info.dtype)
            found, _ = self._redistribute(strategy.state, strategy.output, info.shape, size)
            return tuple(Phased(c, Phase.UPDATE) for c in found)
        if node.op in GROUPED_MMS:
            return dispatch_collectives(node, strategy, ins, self.mesh_shape, self.recompute)
        return loss_collectives(node, strategy, ins, self.mesh_shape, self.recompute)

    def internal_time(
        self,
        node: Node,
        strategy: Strategy,
        ins: Sequence[TensorInfo] = (),
        gathered: str | None = None,
    ) -> float:
        """Seconds of `internal`'s collectives: the loss's issued as they are, a ZeRO
        parameter's gather through DTensor's redistribution."""
        return sum(
            self.redistribution_s(p.collective)
            if p.phase == "update"
            else self.collective_s(p.collective)
            for p in self.internal(node, strategy, ins, gathered)
        )

    def collective_s(self, c: Collective) -> float:
        """Seconds of one collective over the ranks along its mesh axes."""
        size = math.prod(self.mesh_shape[a] for a in c.axes)
        link, nodes = self._link(c.axes), self._nodes(c.axes)
        return collective_time(self.cluster, c.kind, c.nbytes, size, link, nodes)

    def redistribution_s(self, c: Collective) -> float:
        """Seconds of one collective that the executor issues through DTensor's redistribution
        (every one but a gradient bucket's all-reduce and the loss's total weight): the
        collective and the measured `redistribute_overhead`. The step waits for it: see
        `sync_s`."""
        seconds = self.collective_s(c)
        if seconds == 0.0:
            return seconds
        return seconds + redistribute_overhead(self.cluster, c.nbytes)

    @property
    def sync_s(self) -> float:
        """Seconds the step waits for the ranks' skew where it blocks on collectives right after
        computing (the measured `sync_overhead`; 0.0 where not measured): once for the
        redistributions an op's inputs need in forward, once for a tensor's gradient in
        backward, and once for the parameters' gradients (`gradients_s`)."""
        return sync_overhead(self.cluster)

    def phased_s(self, p: Phased) -> float:
        """Seconds of one gradient synchronization of the step: a bucket's all-reduce (it names
        the bucket's parameters) as issued, any other as redistributed."""
        if p.params:
            return self.collective_s(p.collective)
        return self.redistribution_s(p.collective)

    def gradients_s(self, phased: Sequence[Phased]) -> float:
        """Seconds of the step's gradient synchronization (`step_price.price_step`): each
        collective's `phased_s`, and one wait for the ranks' skew where any gradient is reduced
        outside the buckets. The executor issues those reductions asynchronously as backward
        produces them, as DDP does its buckets', and the step waits for them once, at the
        optimizer (ZeRO-3 charged a wait per parameter measured 0.73-0.90x its prediction)."""
        unbucketed = any(not p.params for p in phased)
        return sum(self.phased_s(p) for p in phased) + (self.sync_s if unbucketed else 0.0)

    def node_memory(self, node: Node, strategy: Strategy) -> float:
        if node.kind in (NodeKind.PARAM, NodeKind.INPUT):
            info = node.output
            elems = local_numel(strategy.output, info.shape, self.mesh_shape)
            size = itemsize(info.dtype)
            if node.kind == NodeKind.INPUT or not node.needs_grad:
                return float(elems * size)
            if strategy.state is None:
                return float(elems * size * (2 + self.state_per_elem))
            # ZeRO-1/2: the whole parameter, its gradient as kept, and its shard's state with
            # the shard's own copy that the optimizer steps
            grads = local_numel(strategy.grad_target, info.shape, self.mesh_shape)
            shard = local_numel(strategy.state, info.shape, self.mesh_shape)
            return float((elems + grads + shard * (1 + self.state_per_elem)) * size)
        saved = self.activation_memory(node, strategy)
        return saved * self.recompute.share if self.recompute.drops(node.name) else saved

    def gradient_memory(self, node: Node, strategy: Strategy) -> float:
        """Of `node_memory`, a trained parameter's gradient as kept (0 for the rest)."""
        if node.kind != NodeKind.PARAM or not node.needs_grad:
            return 0.0
        placed = strategy.output if strategy.state is None else strategy.grad_target
        elems = local_numel(placed, node.output.shape, self.mesh_shape)
        return float(elems * itemsize(node.output.dtype))

    def bucket_memory(self, node: Node, strategy: Strategy) -> float:
        """The ILP's estimate of a parameter's share of the gradient buckets' buffers
        (`autoplan.costmodel.held`): its gradient as kept, where it is stored replicated
        along an axis of several devices and not reduce-scattered (ZeRO-2), so that its
        gradient is all-reduced, in a bucket. A plan's price counts the buckets it makes."""
        if node.kind != NodeKind.PARAM or not node.needs_grad:
            return 0.0
        if strategy.grad_target != strategy.output:
            return 0.0
        if not any(p == R and n > 1 for p, n in zip(strategy.output, self.mesh_shape, strict=True)):
            return 0.0
        return self.gradient_memory(node, strategy)

    def memory_floor(self, node: Node) -> float:
        """A floor under `node_memory` of ``node`` whatever its strategy: every tensor split
        over all the mesh's devices (ZeRO's copies are more), a dropped activation nothing.
        Searches rule out with it what cannot fit before planning it."""
        devices = math.prod(self.mesh_shape)
        if node.kind in (NodeKind.PARAM, NodeKind.INPUT):
            info = node.output
            copies = (
                1 if node.kind == NodeKind.INPUT or not node.needs_grad else 2 + self.state_per_elem
            )
            return info.nbytes * copies / devices
        if self.recompute.drops(node.name):
            return 0.0
        whole = Strategy((R,) * len(self.mesh_shape), ())
        return self.activation_memory(node, whole) / devices

    def activation_memory(self, node: Node, strategy: Strategy) -> float:
        """The bytes of an op's outputs that backward keeps (`Node.kept`; all of them for an
        op that selective checkpointing saves, `Recompute.saved`), with what its own backward
        saves besides (`saved_extra_memory`); 0 for parameters and inputs."""
        if node.kind != "op":
            return 0.0
        kept: Sequence[int] | None = node.kept
        if node.name in self.recompute.saved:
            kept = range(len(node.outputs))
        if kept is None:  # not known: a new tensor that a gradient flows to
            if node.is_view or not node.needs_grad:
                return 0.0
            kept = range(len(node.outputs))
        saved = sum(
            local_numel(strategy.output, node.outputs[j].shape, self.mesh_shape)
            * itemsize(node.outputs[j].dtype)
            for j in kept
        )
        return (
            float(saved)
            + self.saved_extra_memory(node, strategy)
            + self.keys_memory(node, strategy)
        )

    def saved_extra_memory(self, node: Node, strategy: Strategy) -> float:
        """What an op's backward saves that is none of its inputs and outputs (a norm's
        statistics, a loss's log-probabilities), split as the op's largest tensor is
        (`Node.kept_extra_like`)."""
        if not node.kept_extra_bytes:
            return 0.0
        like = node.kept_extra_like
        spec = strategy.inputs[like] if 0 <= like < len(strategy.inputs) else strategy.output
        split = math.prod(
            n for n, p in zip(self.mesh_shape, spec, strict=True) if shard_dim(p) is not None
        )
        return node.kept_extra_bytes / split

    def keys_memory(self, node: Node, strategy: Strategy) -> float:
        """Under context parallelism (`autoplan.strategies.attention`), the keys and values
        an attention's backward keeps as gathered: whole along the axes that split its
        queries by the sequence, split as they are read on the others (`Node.keys_bytes`)."""
        if len(strategy.inputs) < 2 or not node.keys_bytes:
            return 0.0
        if not context_axes(strategy.inputs, len(node.outputs[0].shape)):
            return 0.0
        keys = strategy.inputs[1]
        split = math.prod(
            n for n, p in zip(self.mesh_shape, keys, strict=True) if shard_dim(p) is not None
        )
        return node.keys_bytes / split

    # ------------------------------------------------------------------ edges

    def _redistribute_uncached(
        self, src: Spec, dst: Spec, shape: tuple[int, ...], size: int
    ) -> tuple[tuple[Collective, ...], float]:
        found = tuple(
            c  # an axis of one device moves nothing (a pipeline stage of one device has one)
            for c in redistribute(src, dst, shape, size, self.mesh_shape, self.has_all_to_all)
            if self.mesh_shape[c.axes[0]] > 1
        )
        seconds = sum(self.redistribution_s(c) for c in found)
        if not movable(src, dst):
            seconds += UNMOVABLE_S
        return found, seconds

    def forward(
        self, tensor: TensorInfo, src: Strategy, dst: Strategy, index: int
    ) -> tuple[float, tuple[Collective, ...]]:
        """Moving ``tensor`` from the producer's placement into input ``index`` of ``dst``."""
        found, seconds = self._redistribute(
            src.output, dst.inputs[index], tensor.shape, itemsize(tensor.dtype)
        )
        return seconds, found

    def gradient(
        self, tensor: TensorInfo, grad: Spec, src: Strategy
    ) -> tuple[float, tuple[Collective, ...]]:
        """Bringing a gradient placed ``grad`` back to the producer's placement."""
        found, seconds = self._redistribute(
            grad, src.grad_target, tensor.shape, itemsize(tensor.dtype)
        )
        return seconds, found

    def edge(
        self,
        producer: Node,
        tensor: TensorInfo,
        src: Strategy,
        consumer: Node,
        dst: Strategy,
        index: int,
        once: float = 1.0,
    ) -> float:
        """An edge's time for the ILP: moving the tensor into input ``index`` of ``dst`` and its
        gradient back (`read_s`, `grad_s`, which weighs a parameter's by ``once``). For a
        tensor with one reader; one read by several is moved once per placement they read it
        in, and their gradients summed before one reduction back (`autoplan.search.intra_op`
        prices those as shared costs)."""
        placement = dst.inputs[index]
        seconds = self.read_s(tensor, src, placement)
        if producer.needs_grad:
            seconds += self.grad_s(producer, tensor, src, input_grad(consumer, dst, index), once)
        return seconds

    def read_s(self, tensor: TensorInfo, src: Strategy, placement: Spec) -> float:
        """Moving ``tensor`` from the producer's placement to ``placement`` in forward, with a
        wait for the ranks' skew if anything moves: `price_step` waits once per op whose
        inputs move, so the ILP prices an op with several moved inputs a little high."""
        found, seconds = self._redistribute(
            src.output, placement, tensor.shape, itemsize(tensor.dtype)
        )
        return seconds + self.sync_s if found else seconds

    def grad_s(
        self, producer: Node, tensor: TensorInfo, src: Strategy, grad: Spec, once: float = 1.0
    ) -> float:
        """Bringing a gradient placed ``grad`` back to where the producer keeps it, with a
        wait for the ranks' skew if anything moves; for a parameter, its gradient
        synchronization (`grad_sync_s`), once per step: weighed by ``once`` against the work
        of each microbatch (1 / microbatches in a pipeline stage's ILP, as the stage DP
        amortizes it)."""
        seconds, found = self.gradient(tensor, grad, src)
        if producer.kind == NodeKind.PARAM:
            return once * self.grad_sync_s(GradientSync(producer.name, tensor.dtype, found))
        return seconds + self.sync_s if found else seconds

    def bucketed(
        self, producer: Node, tensor: TensorInfo, src: Strategy, grad: Spec
    ) -> GradientSync | None:
        """A parameter's gradient synchronization from ``grad``, if it goes into a bucket
        (`autoplan.strategies.buckets`: all-reduces alone)."""
        if producer.kind != NodeKind.PARAM:
            return None
        _, found = self.gradient(tensor, grad, src)
        sync = GradientSync(producer.name, tensor.dtype, found)
        return sync if sync.bucket_axes is not None else None

    def bucket_line(self, axes: tuple[int, ...]) -> tuple[float, float]:
        """A gradient bucket's all-reduce along ``axes`` as seconds = latency + bytes x
        seconds per byte: the line through a first bucket's time (`FIRST_BUCKET_BYTES`) and
        a full one's (`BUCKET_BYTES`), exact under the alpha-beta model. The ILP prices each
        bucketed gradient's bytes (`grad_sync_s`) and each bucket's latency apart
        (`autoplan.solvers.problem.BucketCost`)."""
        first = self._all_reduce_s(axes, FIRST_BUCKET_BYTES)
        per_byte = (self._all_reduce_s(axes, BUCKET_BYTES) - first) / (
            BUCKET_BYTES - FIRST_BUCKET_BYTES
        )
        return max(0.0, first - per_byte * FIRST_BUCKET_BYTES), per_byte

    def grad_sync_s(self, sync: GradientSync) -> float:
        """A parameter's gradient synchronization as the ILP prices it, before buckets exist:
        a bucketable all-reduce at its bytes' share of a bucket (`bucket_line`; the buckets'
        latencies are priced apart), any other collective as issued."""
        axes = sync.bucket_axes
        if axes is None:
            return sum(self.phased_s(Phased(c, Phase.GRAD_SYNC)) for c in sync.collectives)
        return sync.collectives[0].nbytes * self.bucket_line(axes)[1]
