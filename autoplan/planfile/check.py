"""A plan checked against the model and the cluster it is used with (`check_plan`): what a
person may have edited by hand is refused, with the field and the fix, before any rank acts
on it. `autoplan show`, `autoplan estimate` and `autoplan run` (and `autoplan.estimate`,
`autoplan.parallelize`) all call it, with what they have: the file alone, the cluster, the
traced step.

What is checked, beyond the field-by-field reading of `autoplan.planfile.io`:
* the mesh: its ranks are 0..N-1, each once; each stage runs on its row of the mesh; N is the
  cluster's device count (with a cluster);
* the parameters: every parameter (and buffer) of the model, and only those, with the model's
  shape and dtype; each placement exists for the tensor's rank, splits it evenly on the mesh,
  and is "R" on an axis of size 1; stored split or whole, never as partial sums;
* the ops (with the traced step): every node of the step, and only those; each node's
  placements are one of the strategies the planner has for that op on that mesh
  (`autoplan.strategies.space`), so every op runs exactly; each stage reads only nodes of
  itself and of the stages before it, and its boundary placement is one a pipeline can have.

A parameter's placements are written twice: in ``params`` (by name: how it is stored, and
how the first op reading it reads it) and in ``nodes`` (the parameter node's output, that
op's input). ``params`` is what a person edits: `check_plan` writes it into the nodes, and
logs each node entry it changes. Everything else derivable (collectives, gradient buckets,
what stages send, predictions) is derived again from the placements by `autoplan.estimate`'s
`derive`, never read from the file.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import replace

from autoplan.cluster.model import Cluster
from autoplan.errors import PlanFormatError
from autoplan.graph.ir import Graph, Node
from autoplan.modes import NodeKind
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import Placements
from autoplan.search.stage_layout import boundary_specs
from autoplan.strategies import routing
from autoplan.strategies.float32_grads import kept_where_whole, weight_copies
from autoplan.strategies.placement import R, Spec, is_valid, movable, shard_dim
from autoplan.strategies.space import RESHAPES, Strategy, node_strategies
from autoplan.strategies.zero_state import is_valid_state
from autoplan.version import torch_release

log = logging.getLogger(__name__)

__all__ = ["assignment_of", "check_plan"]

_SHOWN = 3  # names or strategies a message lists before "and N more"


def check_plan(plan: Plan, graph: Graph | None = None, cluster: Cluster | None = None) -> Plan:
    """``plan``, refused with a `PlanFormatError` that names the field and the fix if it does
    not fit ``cluster``'s devices or the traced step ``graph`` (each checked where given);
    with ``graph``, its ``params`` section written into its nodes."""
    _check_mesh(plan, cluster)
    if graph is not None:
        _check_names(plan, graph)
    else:
        _check_param_entries(plan)
    _check_param_placements(plan)
    if graph is None:
        return plan
    plan = _params_into_nodes(plan, graph)
    _check_stages(plan, graph)
    _check_strategies(plan, graph)
    _check_routed(plan, graph)
    _check_unmoved(plan, graph)
    return plan


def _check_unmoved(plan: Plan, graph: Graph) -> None:
    """No tensor split strided into unequal pieces ("S(d)x4:1:1") is moved: DTensor has no
    such placement, and the executor holds it only as the ops that keep it make it."""
    axes = plan.stage_axes
    for node in graph:
        inputs = plan.nodes[node.name].inputs
        for ref, wanted in zip(node.refs, inputs, strict=True):
            have = _spec(plan.nodes[ref.name].output, axes)
            if not movable(have, _spec(wanted, axes)):
                raise PlanFormatError(
                    f"plan field nodes.{node.name}.inputs reads {ref.name} as {_fmt(wanted)}, "
                    f"placed {_fmt(plan.nodes[ref.name].output)}: a strided split of unequal "
                    "pieces is never moved; place both alike, or neither so (plan again)"
                )


def _fmt(spec: Placements) -> str:
    return ", ".join(f"{axis}={p}" for axis, p in spec.items())


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _stage_shape(plan: Plan) -> tuple[int, ...]:
    return plan.mesh.shape[1:] if plan.pipeline is not None else plan.mesh.shape


def _check_mesh(plan: Plan, cluster: Cluster | None) -> None:
    ranks, size = plan.mesh.ranks, len(plan.mesh.ranks)
    if list(ranks) != list(range(size)):
        raise PlanFormatError(
            f"plan field mesh.ranks is {list(ranks)}: the mesh lies row-major over the ranks "
            f"in order; write {list(range(size))}"
        )
    per_stage = math.prod(_stage_shape(plan))
    for s, stage in enumerate(plan.stages):
        g = plan.group(s)
        row = ranks[g * per_stage : (g + 1) * per_stage]
        if stage.ranks != row:
            raise PlanFormatError(
                f"plan field stages[{s}].ranks is {list(stage.ranks)}, but stage {s} runs on "
                f"row {g} of the mesh: {list(row)}; write that"
            )
    if cluster is not None and size != cluster.num_devices:
        raise PlanFormatError(
            f"plan field mesh.shape is {list(plan.mesh.shape)}: {size} devices, but cluster "
            f"{cluster.name!r} has {cluster.num_devices}; plan again for this cluster "
            f"(autoplan plan ...), or use it with {size} devices (autoplan run: --nproc {size})"
        )


def _check_names(plan: Plan, graph: Graph) -> None:
    """The plan's parameters and nodes are the traced step's."""
    refusal = plan.provenance.graph_refusal(graph.fingerprint, torch_release())
    if refusal is not None:
        raise PlanFormatError(f"plan field provenance.graph_fingerprint: {refusal}")
    params = {n.target: n for n in graph.params}
    for name in plan.params:
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise PlanFormatError(
                f"plan field params names {name!r}, which is not a parameter or buffer of the "
                f"model{hint} (the model's: {_listed(params)})"
            )
    missing = [name for name in params if name not in plan.params]
    if missing:
        raise PlanFormatError(
            f"plan field params has no entry for {_listed(missing)}, which the model has: give "
            "each of the model's parameters and buffers its placements (or plan again)"
        )
    for name, node in params.items():
        p = plan.params[name]
        if (p.shape, p.dtype) != (node.output.shape, node.output.dtype):
            raise PlanFormatError(
                f"plan field params.{name} is {list(p.shape)} {p.dtype}, but the model's is "
                f"{list(node.output.shape)} {node.output.dtype}: plan again for this model"
            )
    names = {n.name for n in graph}
    unknown = [name for name in plan.nodes if name not in names]
    if unknown:
        raise PlanFormatError(
            f"plan field nodes names {_listed(unknown)}, not nodes of this model's traced step; "
            "the nodes are the step's, as the planner wrote them"
        )
    missing = [n.name for n in graph if n.name not in plan.nodes]
    if missing:
        raise PlanFormatError(
            f"plan field nodes has no entry for {_listed(missing)}: it was made for another "
            "model; plan again for this one"
        )


def _check_param_entries(plan: Plan) -> None:
    """Without the model: the parameters in ``params`` are those of the parameter nodes."""
    in_nodes = [n.module for n in plan.nodes.values() if n.op == NodeKind.PARAM]
    for name in plan.params:
        if name not in in_nodes:
            close = difflib.get_close_matches(name, in_nodes, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise PlanFormatError(
                f"plan field params names {name!r}, which is not a parameter of the model the "
                f"plan was made for (its nodes name {_listed(in_nodes)}){hint}"
            )
    missing = [name for name in in_nodes if name not in plan.params]
    if missing:
        raise PlanFormatError(
            f"plan field params has no entry for {_listed(missing)}, a parameter of the model "
            "the plan was made for: give each parameter its placements (or plan again)"
        )


def _check_param_placements(plan: Plan) -> None:
    """Each parameter's placements exist for its shape and split it evenly on the mesh."""
    axes, shape = plan.stage_axes, _stage_shape(plan)
    for name, p in plan.params.items():
        fields = [("storage", p.storage), ("placements", p.placements)]
        fields += [("state", p.state)] if p.state else []
        for field, spec in fields:
            what = f"plan field params.{name}.{field}"
            for axis, size in zip(axes, shape, strict=True):
                placement = spec[axis]
                d = shard_dim(placement)
                if size == 1 and placement != R:
                    raise PlanFormatError(
                        f'{what} is {placement} on axis {axis}, of size 1: write "R" there (one '
                        "device holds the whole tensor)"
                    )
                if field in ("storage", "state") and d is None and placement != R:
                    raise PlanFormatError(
                        f"{what} is {placement} on axis {axis}: a parameter is stored split "
                        '("S(d)", "S(d)xk") or whole ("R"), not as partial sums'
                    )
                if d is not None and d >= len(p.shape):
                    raise PlanFormatError(
                        f"{what} is {placement} on axis {axis}, but {name} has "
                        f"{len(p.shape)} dim(s) (shape {list(p.shape)}): split a dim from 0 to "
                        f'{len(p.shape) - 1}, or write "R"'
                        if p.shape
                        else f'{what} is {placement} on axis {axis}, but {name} is a scalar: "R"'
                    )
            named = tuple(spec[a] for a in axes)
            valid = is_valid_state if field == "state" else is_valid
            if not valid(named, p.shape, shape):
                raise PlanFormatError(
                    f"{what} is [{_fmt(spec)}], which does not split {name} (shape "
                    f"{list(p.shape)}) evenly on mesh {dict(zip(axes, shape, strict=True))}: "
                    "each split dim must be divisible by the sizes of the axes splitting it"
                )


def _params_into_nodes(plan: Plan, graph: Graph) -> Plan:
    """The plan with each parameter node's output its ``params`` storage, and its first
    reader's input its ``params`` placements (as `autoplan.planfile.assemble` writes them)."""
    nodes = dict(plan.nodes)

    def write(node: str, field: str, old: Placements, new: Placements, source: str) -> None:
        if dict(old) != dict(new):
            log.warning(
                "plan: %s [%s] is used for nodes.%s.%s, which was [%s] (a parameter's placements "
                "are read from params)",
                source,
                _fmt(new),
                node,
                field,
                _fmt(old),
            )

    for param in graph.params:
        p = plan.params[param.target]
        entry = nodes[param.name]
        write(param.name, "output", entry.output, p.storage, f"params.{param.target}.storage")
        nodes[param.name] = replace(entry, output=dict(p.storage))
        users = graph.users(param.name)
        if not users:
            continue
        reader = nodes[users[0]]
        slot = [r.name for r in graph.node(users[0]).refs].index(param.name)
        if slot >= len(reader.inputs):
            continue  # refused with the reader's own entry (`_check_strategies`)
        field = f"inputs[{slot}]"
        source = f"params.{param.target}.placements"
        write(users[0], field, reader.inputs[slot], p.placements, source)
        inputs = list(reader.inputs)
        inputs[slot] = dict(p.placements)
        nodes[users[0]] = replace(reader, inputs=tuple(inputs))
    return replace(plan, nodes=nodes)


def _check_stages(plan: Plan, graph: Graph) -> None:
    """Every node in one stage, read only by its own and later stages; one boundary placement
    that pipelines have."""
    stage_of: dict[str, int] = {}
    for s, stage in enumerate(plan.stages):
        for name in stage.nodes:
            if name not in plan.nodes:
                raise PlanFormatError(
                    f"plan field stages[{s}].nodes lists {name}, which is not a node of the "
                    "step (nor in the plan's nodes)"
                )
            if name in stage_of:
                raise PlanFormatError(
                    f"plan field stages[{s}].nodes lists {name}, which stages[{stage_of[name]}] "
                    "lists too: each node runs in one stage"
                )
            stage_of[name] = s
    missing = [n.name for n in graph if n.name not in stage_of]
    if missing:
        raise PlanFormatError(
            f"plan field stages lists no stage for {_listed(missing)}: every node of the step "
            "runs in one stage"
        )
    for node in graph:
        for ref in node.refs:
            if stage_of[ref.name] > stage_of[node.name]:
                s = stage_of[node.name]
                raise PlanFormatError(
                    f"plan field stages[{s}].nodes has {node.name}, which reads {ref.name} of "
                    f"the later stage {stage_of[ref.name]}: a stage reads only its own nodes and "
                    "those of earlier stages; move one of them"
                )
    if plan.pipeline is None:
        return
    shape, axes = _stage_shape(plan), plan.stage_axes
    allowed = boundary_specs(shape)
    for s, stage in enumerate(plan.stages):
        spec = tuple(stage.boundary.get(a, "") for a in axes)
        if spec not in allowed or stage.boundary != plan.stages[0].boundary:
            choices = " or ".join(f"[{_fmt(dict(zip(axes, b, strict=True)))}]" for b in allowed)
            raise PlanFormatError(
                f"plan field stages[{s}].boundary is [{_fmt(stage.boundary)}]: tensors pass "
                f"between stages batch-split on the outer axes or whole, the same for every "
                f"stage: {choices}"
            )


def _spec(placements: Placements, axes: tuple[str, ...]) -> Spec:
    return tuple(placements[a] for a in axes)


def _strategy(plan: Plan, node: Node) -> Strategy:
    """A node's strategy as the plan writes it; a parameter's ZeRO-1/2 state and gradient
    placements from its params entry."""
    entry, axes = plan.nodes[node.name], plan.stage_axes
    grad = _spec(entry.grad, axes) if entry.grad else None
    state = None
    if node.kind == NodeKind.PARAM and node.target in plan.params:
        param = plan.params[node.target]
        grad = _spec(param.grad, axes) if param.grad else None
        state = _spec(param.state, axes) if param.state else None
    return Strategy(
        output=_spec(entry.output, axes) if node.outputs else (),
        inputs=tuple(_spec(p, axes) for p in entry.inputs),
        grad=grad,
        state=state,
    )


def assignment_of(plan: Plan, graph: Graph) -> dict[str, Strategy]:
    """Each node's strategy as the (checked) plan writes it."""
    return {n.name: _strategy(plan, n) for n in graph}


def _shown(s: Strategy, node: Node, axes: tuple[str, ...]) -> str:
    def named(spec: Spec) -> str:
        return f"[{', '.join(f'{a}={p}' for a, p in zip(axes, spec, strict=True))}]"

    inputs = ", ".join(named(i) for i in s.inputs) or "nothing"
    kept = f", its gradient kept {named(s.grad)}" if s.grad else ""
    return f"reads {inputs} -> {named(s.output)}{kept}" if node.outputs else f"reads {inputs}"


def _check_routed(plan: Plan, graph: Graph) -> None:
    """No tensor of a routed region (each rank's own rows in its own order,
    `autoplan.strategies.routing`) is read placed otherwise on an axis that routes it: that
    would take them for the one-process tensor's shards."""
    region = routing.graph_region(graph)
    axes = plan.stage_axes
    for node in graph:
        for i, ref in enumerate(node.refs):
            counted = node.name in region.inside and node.op in routing.COUNTS
            if ref.name not in region.inside and not counted:
                continue
            made = _spec(plan.nodes[ref.name].output, axes)
            read = _spec(plan.nodes[node.name].inputs[i], axes)
            if ref.name not in region.inside:
                if routing.makes_counts(made, read):
                    raise PlanFormatError(
                        f"plan field nodes.{node.name}.inputs[{i}] reads {ref.name} as "
                        f"{_fmt(plan.nodes[node.name].inputs[i])} from "
                        f"{_fmt(plan.nodes[ref.name].output)}: a routed region's partial "
                        "counts must be each rank's own counts as computed; read it as placed"
                    )
                continue
            if routing.moves_routed_rows(made, read):
                raise PlanFormatError(
                    f"plan field nodes.{node.name}.inputs[{i}] reads {ref.name} as "
                    f"{_fmt(plan.nodes[node.name].inputs[i])}, but {ref.name} holds each "
                    f"rank's own routed rows ({_fmt(plan.nodes[ref.name].output)}), which no "
                    "redistribution turns into the whole tensor's shards; read it as placed "
                    "or place the whole routed region (from its sort) otherwise"
                )


def _check_strategies(plan: Plan, graph: Graph) -> None:
    """Each node's placements are a strategy its op has on the stage's mesh."""
    axes, shape = plan.stage_axes, _stage_shape(plan)
    for node in graph:
        entry = plan.nodes[node.name]
        what = f"plan field nodes.{node.name}"
        if len(entry.inputs) != len(node.refs):
            raise PlanFormatError(
                f"{what}.inputs has {len(entry.inputs)} placement(s), but {node.op} reads "
                f"{len(node.refs)} tensor(s): one placement per tensor it reads"
            )
        if bool(entry.output) != bool(node.outputs):
            raise PlanFormatError(
                f"{what}.output must be {'a placement' if node.outputs else '{}'} ({node.op})"
            )
        strategy = _strategy(plan, node)
        candidates = node_strategies(node, graph, shape).strategies
        if strategy in candidates or _kept_partial_where_whole(
            strategy, node, graph, shape, candidates
        ):
            continue
        if strategy.state is not None:
            _refuse_state(node, strategy, candidates, axes)
        closest = sorted(candidates, key=lambda c: _distance(c, strategy))[:_SHOWN]
        shown = "; ".join(_shown(c, node, axes) for c in closest)
        where = f" in {node.module_path}" if node.module_path else ""
        params = [
            graph.node(r.name).target
            for r in node.refs
            if graph.node(r.name).kind == NodeKind.PARAM
        ]
        pin = f" or plan again with --pin {params[0]}=... to fix it" if params else ""
        raise PlanFormatError(
            f"{what} ({node.op}{where}) {_shown(strategy, node, axes)} on mesh "
            f"{dict(zip(axes, shape, strict=True))}, which is not one of its strategies (a split "
            "must exist in the tensor, divide it evenly, and be one the op computes exactly); "
            f"the closest it has: {shown}. Edit the plan "
            f"to one of them (a parameter's placements in params){pin}"
        )


def _kept_partial_where_whole(
    strategy: Strategy,
    node: Node,
    graph: Graph,
    shape: tuple[int, ...],
    candidates: Collection[Strategy],
) -> bool:
    """Whether ``strategy`` is a weight copy's or a reshape's candidate keeping its gradient
    partial where its output is whole, as plans that reduce every gradient in float32 place
    weight copies (`autoplan.strategies.float32_grads`) and sequence-parallel baselines the
    views that read the sequence gathered (`autoplan.baselines.propagate`)."""
    if strategy.grad is None or (node.op not in RESHAPES and node.name not in weight_copies(graph)):
        return False
    placed = replace(strategy, grad=None)
    return placed in candidates and strategy == kept_where_whole(placed, shape)


def _refuse_state(
    node: Node, strategy: Strategy, candidates: Iterable[Strategy], axes: tuple[str, ...]
) -> None:
    """A parameter's ZeRO-1/2 state placement that is not one of its candidates."""
    states = [c.state for c in candidates if c.output == strategy.output and c.state]
    given = dict(zip(axes, strategy.state or (), strict=True))
    shown = " or ".join(f"[{_fmt(dict(zip(axes, s, strict=True)))}]" for s in dict.fromkeys(states))
    raise PlanFormatError(
        f"plan field params.{node.target}.state is [{_fmt(given)}]: a parameter's optimizer "
        "state (ZeRO-1/2) is split along the first dim its storage leaves whole that divides "
        "evenly (else the largest, unevenly), on axes where it is stored whole; "
        + (f"write {shown}, or drop the field" if shown else "drop the field (none fits)")
    )


def _distance(a: Strategy, b: Strategy) -> int:
    """How many placements differ (output, inputs and kept gradient)."""

    def flat(s: Strategy) -> list[str]:
        return [*s.output, *(p for i in s.inputs for p in i), *(s.grad or ())]

    fa, fb = flat(a), flat(b)
    return sum(x != y for x, y in zip(fa, fb, strict=False)) + abs(len(fa) - len(fb))
