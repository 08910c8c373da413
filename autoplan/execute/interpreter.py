"""Run the traced graph over DTensors, placing every op's inputs as the plan says.

Each op's tensor inputs are redistributed to the plan's placements before the op runs (the
only place the executor communicates in forward; backward communication is the autograd
mirror of these redistributions and of DTensor's op rules). Ops that create tensors
(``arange``) get replicated outputs. If DTensor's rule places an output differently from
the plan, the output is moved to the plan's placement and the difference is logged: the
plan's collectives list then misses that move, which the fidelity tests catch.

ZeRO-3's gathers are issued ahead, as FSDP2 prefetches (`checkpointed.gathers_ahead`): on GPUs
in flight, each waited for by the first op that reads it; on CPU ranks at once.

The ops `execute/op_calls.py` finds local (no partial sums, the local result the local shard of
the result) run on this rank's shards as plain torch, as do the replicated ops that keep their
output's gradient partial (the plan's ``grad``), cross-entropy (its targets' total weight
all-reduced as soon as they are there) and the grouped matmul of split experts
(execute/experts.py). A run of such ops meets DTensor where a tensor must be redistributed or
a DTensor op reads it (``from_local``/``to_local``: backward places gradients by `grad_spec`).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.export import ExportedProgram

from autoplan.execute.checkpointed import (
    RecomputedRegion,
    Selective,
    gathered,
    gathers_ahead,
    with_regions,
)
from autoplan.execute.context import attention, causal_offsets, grouped_heads
from autoplan.execute.experts import (
    dispatch_axes,
    dispatched_grouped_mm,
    first_experts,
    local_grouped_mm,
    routed_region,
)
from autoplan.execute.flex_shards import flex_starts, local_flex_attention
from autoplan.execute.op_arguments import Arguments, last_uses, map_tensors, tensor_inputs
from autoplan.execute.op_calls import (
    CROSS_ENTROPY,
    MEAN,
    SIZED,
    SPLITS,
    Summed,
    call_op,
    class_weights,
    local_cross_entropy,
    local_embedding,
    local_shape,
    local_slice,
    local_split,
    local_total_weight,
    reduction,
    runs_locally,
)
from autoplan.execute.placements import (
    boundary_placements,
    from_dtensor,
    gradient_to,
    reachable,
    to_dtensor,
)
from autoplan.execute.randomness import Draws, is_random
from autoplan.execute.vocab import VocabShard, vocab_shard
from autoplan.planfile.schema import Plan
from autoplan.strategies.dtensor_rules import register_missing_rules
from autoplan.strategies.placement import grad_spec
from autoplan.strategies.routing import routes_locally
from autoplan.torch_private import from_local, redistribute
from autoplan.torch_private.flex_op import FLEX_ATTENTION

log = logging.getLogger(__name__)


# tensor name -> (placement[, gradient placement]) -> the tensor so placed
Placed = dict[str, dict[Any, Any]]


@dataclass(frozen=True, slots=True)
class Local:
    """A tensor kept as this rank's shard, placed as the plan says (a local op's output, or
    ``run``'s input: a batch sliced locally, a parameter's local leaf). ``grad`` is the
    placement its gradient may have (partial where a leaf's bucket reduces it, or where a
    replicated op keeps it so), None for the same as ``placements``."""

    tensor: torch.Tensor
    placements: tuple[Placement, ...]
    grad: tuple[Placement, ...] | None = None


class PlanInterpreter:
    """Runs the nodes of one stage of the plan (the whole graph when it has one stage) on
    that stage's mesh."""

    def __init__(self, ep: ExportedProgram, plan: Plan, mesh: DeviceMesh, stage: int = 0) -> None:
        register_missing_rules()
        self.graph = ep.graph
        self.plan = plan
        self.mesh = mesh
        self.device = torch.device(mesh.device_type)
        self.draws = Draws(mesh)
        axes = plan.stage_axes
        self.nodes = frozenset(plan.stages[stage].nodes)
        self.sent = plan.stages[stage].sent
        # how each tensor sent on is placed (a scalar whole, whatever the boundary splits)
        self.boundary = {
            n.name: boundary_placements(plan.stages[stage].boundary, axes, n.meta["val"].shape)
            for n in ep.graph.nodes
            if n.name in self.sent
        }
        self.inputs: dict[str, list[tuple[Placement, ...]]] = {}
        self.outputs: dict[str, tuple[Placement, ...]] = {}
        # the gradient placement of each input, as the planner has it (for local ops)
        self.grads: dict[str, list[tuple[Placement, ...]]] = {}
        # replicated ops that keep their output's gradient partial: where they keep it
        self.kept: dict[str, tuple[Placement, ...]] = {}
        self.local: set[str] = set()
        self.routed = routed_region(self.graph)
        for name, node in plan.nodes.items():
            self.inputs[name] = [to_dtensor(p, axes) for p in node.inputs]
            if node.output:
                self.outputs[name] = to_dtensor(node.output, axes)
                out = tuple(node.output[a] for a in axes)
                kept = tuple(node.grad[a] for a in axes) if node.grad else None
                specs = [tuple(i[a] for a in axes) for i in node.inputs]
                self.grads[name] = [
                    to_dtensor(dict(zip(axes, grad_spec(i, out, kept), strict=True)), axes)
                    for i in specs
                ]
                if node.grad:
                    self.kept[name] = to_dtensor(node.grad, axes)
        self.arguments: dict[str, Arguments] = {}
        self.reads: dict[str, list[str]] = {}  # tensor inputs, by op
        for fx_node in self.graph.nodes:
            name = fx_node.name
            if name not in self.nodes:
                continue
            self.reads[name] = [n.name for n in tensor_inputs(fx_node)]
            shape, args = None, None
            # a replicated op run whole on every rank is exact on local tensors, and only so
            # does its backward keep a partial gradient partial; a routed region's ops route
            # this rank's own rows (`autoplan.strategies.routing`)
            planned = plan.nodes.get(name)
            routed = (
                name in self.routed
                and planned is not None
                and routes_locally([tuple(p.values()) for p in (*planned.inputs, planned.output)])
            )
            if name in self.outputs and (
                name in self.kept
                or routed
                or runs_locally(fx_node, self.inputs[name], self.outputs[name])
            ):
                self.local.add(name)
                if fx_node.target in SIZED:  # a local view's or factory's size argument
                    shape = local_shape(fx_node, self.outputs[name], mesh.shape)
                elif routed and fx_node.target is torch.ops.aten.arange.default:
                    # this rank's own positions: arange(end) of its rows
                    (end,) = local_shape(fx_node, self.outputs[name], mesh.shape)
                    traced = Arguments.of(fx_node, self.device)
                    self.arguments[name] = replace(traced, args=(end, *traced.args[1:]))
                    continue
                elif fx_node.target in SPLITS:  # a local split's pieces
                    shape = local_split(fx_node, self.inputs[name][0], mesh.shape)
                # a slice of a fused projection's piece: its local bounds
                args = local_slice(fx_node, self.inputs[name], mesh.shape)
            self.arguments[name] = Arguments.of(fx_node, self.device, shape, args)
        # local embeddings and cross-entropies with the vocabulary split: this rank's piece
        self.vocab: dict[str, VocabShard] = {
            n.name: shard
            for n in self.graph.nodes
            if n.name in self.local and (shard := vocab_shard(n, self.inputs[n.name], mesh))
        }
        self.offsets = causal_offsets(self.graph, plan, self.local, mesh)  # context parallel
        self.heads = grouped_heads(self.graph, plan, self.local, mesh)  # key-value heads whole
        self.flex = flex_starts(self.graph, plan, self.local, mesh)  # FlexAttention split
        self.experts = first_experts(self.graph, self.inputs, self.local, mesh)  # experts split
        self.dispatch = dispatch_axes(self.graph, self.inputs, self.local)  # rows sent to them

        recomputed = {
            n: i for i, layer in enumerate(plan.recompute) for n in layer.nodes if n in self.nodes
        }
        order = gathered(list(self.graph.nodes), recomputed)
        self.last_uses = last_uses(order, keep=self.sent)
        self.steps = with_regions(order, recomputed)  # this stage's recomputed layers
        self.regions = Selective({n for layer in plan.recompute for n in layer.saved})
        params = set(ep.graph_signature.inputs_to_parameters)
        self.ahead = gathers_ahead(self.steps, params, self.reads, self.inputs, self.outputs)
        self.in_flight = mesh.device_type != "cpu"  # ZeRO-3's gathers left in flight
        # placeholder -> what finishes its value, still in flight (a ZeRO gather after the
        # optimizer's step, `ShardedState.wait`): called where the step first reads it
        self.awaited: dict[str, Callable[[], None]] = {}

        # local mean cross-entropies, by each tensor their total weight needs (target, weights)
        self.weighed: dict[str, list[torch.fx.Node]] = {}
        for fx_node in self.graph.nodes:
            loss = fx_node.target is CROSS_ENTROPY and reduction(fx_node) == MEAN
            if loss and fx_node.name in self.local:
                for needed in self._weight_inputs(fx_node):
                    self.weighed.setdefault(needed.name, []).append(fx_node)

    @staticmethod
    def _weight_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
        weights = class_weights(node)
        return [node.args[1], *([weights] if weights is not None else [])]

    def local_gradient(self, placeholder: str) -> tuple[Placement, ...] | None:
        """The placement of ``placeholder``'s gradient where every op that reads it runs
        locally on it as stored (its placement, the same gradient placement for each use),
        else None: then it can be a plain local leaf of autograd, no DTensor on its path."""
        grads: set[tuple[Placement, ...]] = set()
        (source,) = [n for n in self.graph.nodes if n.name == placeholder]
        for node in source.users:
            if node.name not in self.local:
                return None
            uses = zip(
                tensor_inputs(node), self.inputs[node.name], self.grads[node.name], strict=True
            )
            for read, target, grad in uses:
                if read.name == placeholder:
                    if tuple(target) != self.outputs[placeholder]:
                        return None
                    grads.add(tuple(grad))
        return grads.pop() if len(grads) == 1 else None

    def _place(self, value: Any, target: Sequence[Placement], async_op: bool = False) -> Any:
        if not isinstance(value, DTensor):
            return value
        goal = reachable(value.placements, target)
        if tuple(value.placements) == goal:
            return value
        return redistribute(value, self.mesh, goal, async_op)

    def _gather_ahead(self, at: int, env: dict[str, Any], placed: Placed) -> None:
        """Issue the ZeRO-3 gathers `gathers_ahead` puts at ``at`` (in flight on GPUs)."""
        for name, target in self.ahead.get(at, ()):
            if name not in env or target in placed.get(name, {}):
                continue
            if name in self.awaited:  # its ZeRO-1/2 gather after the update, first
                self.awaited.pop(name)()
            dtensor = self._dtensor(name, env, placed)
            placed.setdefault(name, {})[target] = self._place(dtensor, target, self.in_flight)

    def run(self, values: Mapping[str, Any]) -> Any:
        """``values``: the stage's placeholders (parameters, and the batch on the first stage)
        and the tensors it received, by name. Returns the graph's output on the last stage,
        else the local shards to send, placed as the plan's boundary (`_sent`)."""
        env: dict[str, Any] = dict(values)
        # one redistribution per (tensor, placement), shared by every op that needs it, so
        # backward reduces the summed gradient once, as the plan counts it
        placed: Placed = {}
        totals: dict[str, Summed] = {}  # a cross-entropy's total weight, summing

        def weigh(name: str) -> None:
            """Start summing the total weight of each loss that ``name`` completes."""
            for loss in self.weighed.get(name, ()):
                needed = self._weight_inputs(loss)
                if loss.name not in totals and all(n.name in env for n in needed):
                    totals[loss.name] = self._total_weight(loss, env, placed)

        for name in values:
            weigh(name)
        self._gather_ahead(-1, env, placed)
        for at, item in enumerate(self.steps):
            reads = item.reads if isinstance(item, RecomputedRegion) else self.reads.get(item.name)
            for read in reads or ():
                if read in self.awaited:
                    self.awaited.pop(read)()
            if isinstance(item, RecomputedRegion):
                self._recompute(item, at, env, placed, totals, weigh)
                continue
            if item.op == "placeholder" or item.name in env:
                continue
            if item.op == "output":
                self._finish_awaited()
                if self.sent:
                    break
                return map_tensors(item.args[0], lambda n: self._dtensor(n.name, env, placed))
            self._step(item, env, placed, totals, weigh)
        self._finish_awaited()
        return tuple(self._sent(name, env, placed) for name in self.sent)

    def _finish_awaited(self) -> None:
        """Nothing stays in flight past the step (what it never read)."""
        while self.awaited:
            self.awaited.popitem()[1]()

    def _step(
        self,
        node: torch.fx.Node,
        env: dict[str, Any],
        placed: Placed,
        totals: dict[str, Summed],
        weigh: Callable[[str], None] | None,
    ) -> None:
        """Run one op (``weigh``: start summing the loss weights it completes; None when the
        op runs again in backward, where those sums are done)."""
        if node.target is operator.getitem:
            source: Any = node.args[0]
            if source.name in env:
                env[node.name] = env[source.name][node.args[1]]
        elif node.name in self.local:
            total = totals.get(node.name)
            total_weight = total.value() if total is not None else None
            env[node.name] = self._call_local(node, env, placed, total_weight)
        elif node.name in self.nodes:
            env[node.name] = self._call(node, env, placed)
        if weigh is not None and node.name in self.weighed:
            weigh(node.name)
        for dead in self.last_uses.get(node.name, ()):
            env.pop(dead, None)
            placed.pop(dead, None)

    def _recompute(
        self,
        region: RecomputedRegion,
        at: int,
        env: dict[str, Any],
        placed: Placed,
        totals: dict[str, Summed],
        weigh: Callable[[str], None],
    ) -> None:
        """Run a recomputed region under ``torch.utils.checkpoint``: in backward it runs again
        from the values it read (and their placements made before it), drawing the same random
        numbers, and its ops' saved tensors come from that run; each run first issues the
        region's ZeRO-3 gathers (``at``: its index in `steps`)."""
        env_in = {n: env[n] for n in region.reads if n in env}
        placed_in = {n: dict(placed[n]) for n in region.reads if n in placed}
        start = self.draws.state
        runs = 0

        def body() -> None:
            nonlocal runs
            runs += 1
            if runs == 1:
                self._gather_ahead(at, env, placed)
                self.regions.forward(region, lambda n: self._step(n, env, placed, totals, weigh))
                return
            ahead, self.draws.state = self.draws.state, start
            again_env = dict(env_in)
            again_placed = {n: dict(p) for n, p in placed_in.items()}
            self._gather_ahead(at, again_env, again_placed)
            for node in region.nodes:
                self._step(node, again_env, again_placed, totals, None)
            self.draws.state = ahead

        self.regions.checkpoint(body)

    def _sent(self, name: str, env: dict[str, Any], placed: Placed) -> torch.Tensor:
        """This rank's shard of ``name`` placed as the boundary, its gradient expected alike.
        A local op's output already so placed goes as it is: a DTensor round trip
        (``from_local``, then ``to_local``, and both again in backward) would cost CPU time in
        every microbatch."""
        value, boundary = env[name], self.boundary[name]
        if isinstance(value, Local) and value.placements == boundary and value.grad is None:
            return value.tensor
        dtensor = self._place(self._dtensor(name, env, placed), boundary)
        return _local_value(dtensor)

    def _dtensor(self, name: str, env: dict[str, Any], placed: Placed) -> Any:
        """``name``'s value as a DTensor (one per local tensor: backward then reduces the
        gradients of all its DTensor users once)."""
        value = env[name]
        if not isinstance(value, Local):
            return value
        placements = placed.setdefault(name, {})
        if "dtensor" not in placements:
            # backward: the DTensor users' gradients, summed, join the local ones placed alike
            placements["dtensor"] = from_local(
                value.tensor, self.mesh, value.placements, value.grad
            )
        return placements["dtensor"]

    def _placed(
        self, name: str, target: tuple[Placement, ...], env: dict[str, Any], placed: Placed
    ) -> Any:
        """``name``'s value redistributed to ``target`` (once per tensor and placement)."""
        if target not in placed.get(name, {}):
            dtensor = self._dtensor(name, env, placed)
            placed.setdefault(name, {})[target] = self._place(dtensor, target)
        return placed[name][target]

    def _total_weight(self, loss: torch.fx.Node, env: dict[str, Any], placed: Placed) -> Summed:
        """``loss``'s total weight: this rank's part, summed along the axes its target splits."""
        target, *weights = (
            _local_value(self._placed(n.name, tuple(p), env, placed))
            for n, p in zip(self._weight_inputs(loss), self.inputs[loss.name][1:], strict=False)
        )
        local = local_total_weight(loss, target, weights[0] if weights else None)
        axes = [a for a, p in enumerate(self.inputs[loss.name][1]) if isinstance(p, Shard)]
        return Summed(local, [self.mesh.get_group(a) for a in axes])

    def _call_local(
        self,
        node: torch.fx.Node,
        env: dict[str, Any],
        placed: Placed,
        total: torch.Tensor | None = None,
    ) -> Local | list[Local]:
        """Run ``node`` on this rank's shards, its output placed as planned."""
        name = node.name

        def fetch(read: str, target: tuple[Placement, ...], grad: tuple[Placement, ...]) -> Any:
            value = env[read]
            if (
                isinstance(value, Local)
                and value.placements == target
                and (value.grad or value.placements) == grad
            ):
                return value.tensor  # nothing to move in forward or backward
            key = (target, grad)
            if key not in placed.get(read, {}):
                dt = self._placed(read, target, env, placed)
                # backward: the local gradient is placed as the planner says it is
                local = dt.to_local(grad_placements=grad) if isinstance(dt, DTensor) else dt
                placed[read][key] = local
            return placed[read][key]

        reads = zip(self.reads[name], self.inputs[name], self.grads[name], strict=True)
        args, kwargs = self.arguments[name].fill([fetch(*read) for read in reads])
        placements = self.outputs[node.name]
        if node.target is CROSS_ENTROPY:
            out = local_cross_entropy(node, args, kwargs, total, self.vocab.get(name))
        elif name in self.vocab:
            out = local_embedding(node, args, self.vocab[name])
        elif node.target is FLEX_ATTENTION:
            out = local_flex_attention(args, self.flex.get(name))
        elif name in self.offsets or name in self.heads:
            out = attention(args, kwargs, self.offsets.get(name), self.heads.get(name))
        elif name in self.dispatch:
            group = self.mesh.get_group(self.dispatch[name])
            out = dispatched_grouped_mm(node.target, args, kwargs, group)  # type: ignore[arg-type]
        elif name in self.experts:
            out = local_grouped_mm(node.target, args, kwargs, self.experts[name])  # type: ignore[arg-type]
        else:
            out = self._call_op(node, args, kwargs, placements)
        kept = self.kept.get(node.name)
        if isinstance(out, list | tuple):  # broadcast_tensors
            return [Local(t, placements, kept) for t in out]
        return Local(out, placements, kept)

    def _call(self, node: torch.fx.Node, env: dict[str, Any], placed: Placed) -> Any:
        reads = zip(self.reads[node.name], self.inputs[node.name], strict=True)
        args, kwargs = self.arguments[node.name].fill(
            [self._placed(read, target, env, placed) for read, target in reads]
        )
        planned = self.outputs.get(node.name)
        out = self._call_op(node, args, kwargs, planned)
        if planned is None:
            return out
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
            return DTensor.from_local(
                out, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False
            )
        if isinstance(out, DTensor) and from_dtensor(out.placements) != from_dtensor(planned):
            log.debug(
                "%s: DTensor placed its output %s, the plan %s", node.name, out.placements, planned
            )
            out = self._place(out, planned)
        if isinstance(out, DTensor) and out.requires_grad:
            out.register_hook(gradient_to(self.mesh, planned))
        return out

    def _call_op(
        self,
        node: torch.fx.Node,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Sequence[Placement] | None,
    ) -> Any:
        if output is None or not is_random(node):
            return call_op(node, args, kwargs)
        with self.draws.drawing(output):
            return call_op(node, args, kwargs)


def _local_value(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
