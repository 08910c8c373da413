"""Run the traced graph over DTensors, placing every op's inputs as the plan says.

Each op's tensor inputs are redistributed to the plan's placements before the op runs (the
only place the executor communicates in forward; backward communication is the autograd
mirror of these redistributions and of DTensor's op rules). Ops that create tensors
(``arange``) get replicated outputs. If DTensor's rule places an output differently from
the plan, the output is moved to the plan's placement and the difference is logged: the
plan's collectives list then misses that move, which the fidelity tests catch.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement
from torch.export import ExportedProgram

from autoplan.execute.placements import from_dtensor, reachable, to_dtensor
from autoplan.plan.schema import Plan
from autoplan.strategies.dtensor_rules import register_missing_rules

log = logging.getLogger(__name__)


def _map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every fx Node in ``value`` (lists and tuples walked in order)."""
    if isinstance(value, torch.fx.Node):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


_MEAN = 1  # torch's Reduction.MEAN
_SUM = 2
# DTensor runs these by decomposition, and on a split batch the backward of the mean divides
# by the local element count (gradients n times too large); a sum over the global count is
# exact. torch 2.13.0.
_ELEMENTWISE_LOSSES = {
    torch.ops.aten.mse_loss.default,
    torch.ops.aten.l1_loss.default,
    torch.ops.aten.smooth_l1_loss.default,
    torch.ops.aten.huber_loss.default,
}


def _call_op(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if target in _ELEMENTWISE_LOSSES and isinstance(args[0], DTensor):
        reduction = args[2] if len(args) > 2 else kwargs.get("reduction", _MEAN)
        if reduction == _MEAN:
            rest = args[3:] if len(args) > 3 else ()
            summed = target(args[0], args[1], _SUM, *rest, **kwargs)
            return summed / args[0].numel()
    return target(*args, **kwargs)


Placed = dict[tuple[str, tuple[Placement, ...]], Any]  # (tensor, placement) -> redistributed


class PlanInterpreter:
    """Runs the nodes of one stage of the plan (the whole graph when it has one stage) on
    that stage's mesh."""

    def __init__(self, ep: ExportedProgram, plan: Plan, mesh: DeviceMesh, stage: int = 0) -> None:
        register_missing_rules()
        self.graph = ep.graph
        self.plan = plan
        self.mesh = mesh
        self.device = torch.device(mesh.device_type)
        axes = plan.stage_axes
        self.nodes = frozenset(plan.stages[stage].nodes)
        self.sent = plan.stages[stage].sent
        self.boundary = to_dtensor(plan.stages[stage].boundary, axes) if self.sent else ()
        self.inputs: dict[str, list[tuple[Placement, ...]]] = {}
        self.outputs: dict[str, tuple[Placement, ...]] = {}
        for name, node in plan.nodes.items():
            self.inputs[name] = [to_dtensor(p, axes) for p in node.inputs]
            if node.output:
                self.outputs[name] = to_dtensor(node.output, axes)

    def _place(self, value: Any, target: Sequence[Placement]) -> Any:
        if not isinstance(value, DTensor):
            return value
        goal = reachable(value.placements, target)
        return value if tuple(value.placements) == goal else value.redistribute(self.mesh, goal)

    def _retarget(self, value: Any) -> Any:
        # graphs traced on the meta device carry device=meta in factory calls
        return self.device if isinstance(value, torch.device) else value

    def run(self, values: Mapping[str, Any]) -> Any:
        """``values``: the stage's placeholders (parameters, and the batch on the first stage)
        and the tensors it received, by name. Returns the graph's output on the last stage,
        else the tensors to send, placed as the plan's boundary."""
        env: dict[str, Any] = dict(values)
        # one redistribution per (tensor, placement), shared by every op that needs it, so
        # backward reduces the summed gradient once, as the plan counts it
        placed: Placed = {}
        for node in self.graph.nodes:
            if node.op == "placeholder" or node.name in env:
                continue
            if node.op == "output":
                if self.sent:
                    break
                return _map_tensors(node.args[0], lambda n: env[n.name])
            if node.target is operator.getitem:
                if node.args[0].name in env:
                    env[node.name] = env[node.args[0].name][node.args[1]]
            elif node.name in self.nodes:
                env[node.name] = self._call(node, env, placed)
        return tuple(self._place(env[name], self.boundary) for name in self.sent)

    def _call(self, node: torch.fx.Node, env: dict[str, Any], placed: Placed) -> Any:
        targets = iter(self.inputs[node.name])

        def fetch(n: torch.fx.Node) -> Any:
            target = tuple(next(targets))
            key = (n.name, target)
            if key not in placed:
                placed[key] = self._place(env[n.name], target)
            return placed[key]

        args = _map_tensors(node.args, fetch)
        kwargs = {k: self._retarget(_map_tensors(v, fetch)) for k, v in node.kwargs.items()}
        out = _call_op(node.target, args, kwargs)
        planned = self.outputs.get(node.name)
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
            out.register_hook(self._gradient_to(planned))
        return out

    def _gradient_to(self, planned: Sequence[Placement]) -> Callable[[Any], Any]:
        """Backward mirrors forward: the gradient of an op's output, summed over its users, is
        brought to the output's planned placement (a partial one reduced to replicated) before
        the op's backward runs, so DTensor's backward rules never choose another reduction."""
        goal = tuple(Replicate() if isinstance(p, Partial) else p for p in planned)

        def hook(grad: Any) -> Any:
            if isinstance(grad, DTensor) and tuple(grad.placements) != goal:
                return grad.redistribute(self.mesh, goal)
            return grad

        return hook
