"""Plan <-> JSON. Output is canonical: a fixed key order, and floats in Python's shortest
exact form so they read back bit for bit; the same plan always gives the same bytes. Input is
validated field by field (`autoplan.jsonfields`), and every problem raises `PlanFormatError`
naming the plan (its file, or "plan"), the field (``nodes.linear_1.inputs[0].tp``) and what was
expected.

The reader builds the plan's sections (`autoplan.planfile.sections`) and returns them as the
plan's fields, by name; `autoplan.planfile.schema.Plan.from_json` builds the plan from them and
`Plan.to_json` hands its plain data to `plan_text`. This module never imports the plan, which
imports it: the imports run one way.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from autoplan.errors import PlanFormatError
from autoplan.graph.cut import SEND
from autoplan.jsonfields import JsonField
from autoplan.modes import NodeKind, Phase, RecomputeMode, Schedule
from autoplan.planfile.sections import (
    PLAN_VERSION,
    CollectivePlan,
    Mesh,
    NodePlan,
    ParamPlan,
    Pipeline,
    Placements,
    Predicted,
    Provenance,
    RecomputedLayer,
    SolverInfo,
    Stage,
    StagePredicted,
)
from autoplan.precision import COMPUTE_DTYPES
from autoplan.schedules import MULTI_STAGE, V_SHAPED, schedule_refusal
from autoplan.solvers.problem import OUTCOMES, SKIPPED, STOPPED, Unproven
from autoplan.strategies.buckets import GRADIENTS
from autoplan.strategies.float32_grads import SPLIT_COPIES
from autoplan.strategies.placement import is_placement
from autoplan.strategies.space import RESHAPES
from autoplan.version import torch_release

__all__ = ["OPTIONAL_PARAM_FIELDS", "plan_text", "read_plan"]

# a parameter's fields that a plan writes only when set (`autoplan.strategies.zero_state`)
OPTIONAL_PARAM_FIELDS = ("grad", "state")

# a recomputed layer's mode (a layer not recomputed has no entry); a pipeline's stages may differ
RECOMPUTE_MODES = (RecomputeMode.FULL, RecomputeMode.SELECTIVE, RecomputeMode.OPS)


def plan_text(data: dict[str, Any]) -> str:
    """A plan's plain data (`dataclasses.asdict`) as JSON. Keys in a fixed order: dataclass
    field order, parameters and nodes in graph order."""
    return json.dumps(data, indent=1) + "\n"


def read_plan(
    source: str, *, graph_fingerprint: str | None = None, cluster_fingerprint: str | None = None
) -> dict[str, Any]:
    """The fields of the plan in `source` (JSON text or a file path), validated, as `Plan`'s
    keyword arguments; refused if made for another graph or cluster than the fingerprints
    given."""
    text, name = source, "plan"
    if not source.lstrip().startswith("{"):
        if not os.path.isfile(source):
            raise PlanFormatError(f"plan file {source} does not exist (and it is not JSON text)")
        with open(source) as f:
            text, name = f.read(), source
    try:
        doc = JsonField(json.loads(text), name, PlanFormatError)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{name} is not valid JSON: {e.msg} at line {e.lineno}") from e
    version = doc["version"]
    if version.value != PLAN_VERSION:
        raise version.fail(f"{PLAN_VERSION} (this autoplan reads only that version)")
    fields = _read_fields(doc)
    provenance = fields["provenance"]
    if graph_fingerprint is not None:
        refusal = provenance.graph_refusal(graph_fingerprint, torch_release())
        if refusal is not None:
            raise doc["provenance"]["graph_fingerprint"].problem(refusal)
    if cluster_fingerprint is not None and provenance.cluster_fingerprint != cluster_fingerprint:
        raise doc["provenance"]["cluster_fingerprint"].problem(
            f"{provenance.cluster_fingerprint}, but the cluster at hand has "
            f"{cluster_fingerprint}: the plan was made for another cluster; re-plan "
            "(autoplan plan ...) for this one"
        )
    return fields


def _check_kept_gradient(f: JsonField, node: NodePlan) -> None:
    """A gradient may be kept partial only on axes where the op is replicated (each rank runs
    it whole on the same values), and elsewhere kept as the output is placed, which only a
    cast runs exactly on its shards (a weight copy under float32 gradient reduction,
    `autoplan.strategies.float32_grads`), and a reshape (`RESHAPES`: a sequence-parallel
    baseline's flattening of the gathered sequence): anything else would train on wrong
    gradients."""
    if not node.output or set(node.grad) != set(node.output) or "P" not in node.grad.values():
        raise f["grad"].fail('"P" on some axes and as the output is placed on the others, or {}')
    for axis, kept in node.grad.items():
        placed = [node.output[axis], *(spec[axis] for spec in node.inputs)]
        if kept == "P" and any(p != "R" for p in placed):
            raise f["grad"].problem(
                f"the op is not replicated on axis {axis!r}, where it keeps its gradient "
                "partial; make it {} (no gradient placement)"
            )
        if kept != "P" and kept != node.output[axis].replace("P", "R"):
            raise f["grad"].fail('"P" on some axes and as the output is placed on the others')
        if kept not in ("R", "P") and node.op not in SPLIT_COPIES and node.op not in RESHAPES:
            raise f["grad"].problem(
                f"only a cast or a reshape keeps its gradient partial while split (axis "
                f"{axis!r}); make it {{}}"
            )


def _read_fields(doc: JsonField) -> dict[str, Any]:
    p = doc["provenance"]
    provenance = Provenance(
        autoplan=p["autoplan"].text(),
        torch=p["torch"].text(),
        graph_fingerprint=p["graph_fingerprint"].text(),
        cluster_fingerprint=p["cluster_fingerprint"].text(),
        cluster=p["cluster"].text(),
    )
    m = doc["mesh"]
    mesh = Mesh(
        axes=tuple(a.text() for a in m["axes"].elements()),
        shape=tuple(s.integer() for s in m["shape"].elements()),
        ranks=tuple(r.integer() for r in m["ranks"].elements()),
    )
    if len(mesh.axes) != len(mesh.shape) or len(set(mesh.axes)) != len(mesh.axes):
        raise m["axes"].fail(f"{len(mesh.shape)} distinct axis names, one per mesh dimension")
    total = math.prod(mesh.shape)
    if len(mesh.ranks) != total:
        raise m["ranks"].fail(f"a list of {total} ranks (the product of mesh.shape)")
    pipeline = _read_pipeline(doc["pipeline"])
    if pipeline is not None and (mesh.axes[:1] != ("pp",) or mesh.shape[0] < 2):
        raise m["axes"].fail('axes whose first is "pp", of size >= 2 (the plan has a pipeline)')
    axes = mesh.axes[1:] if pipeline is not None else mesh.axes
    stages = tuple(_read_stage(f, axes) for f in doc["stages"].elements())
    groups = mesh.shape[0] if pipeline is not None else 1
    interleaved = pipeline is not None and pipeline.schedule in MULTI_STAGE
    if len(stages) != groups and not (interleaved and len(stages) % groups == 0):
        raise doc["stages"].fail(
            "a list of one stage per index of the mesh's pp axis (or one; "
            f"{' or '.join(s for s in MULTI_STAGE if s not in V_SHAPED)}: several per index, "
            f"stage s on index s mod {groups}; {' or '.join(V_SHAPED)}: two per index, in a V)"
        )
    if pipeline is not None:
        refusal = schedule_refusal(
            pipeline.schedule, len(stages), pipeline.num_microbatches, len(stages) // groups
        )
        if refusal:
            raise doc["pipeline"].problem(refusal)
    params = {name: _read_param(f, axes) for name, f in doc["params"].items()}
    nodes = {}
    for name, f in doc["nodes"].items():
        output = f["output"]
        nodes[name] = NodePlan(
            op=f["op"].text(),
            module=f["module"].text(),
            output=_placements(output, axes) if output.obj() else {},
            inputs=tuple(_placements(i, axes) for i in f["inputs"].elements()),
            rule=f["rule"].text(),
            grad=_placements(f["grad"], axes) if f["grad"].obj() else {},
        )
        if nodes[name].grad:
            _check_kept_gradient(f, nodes[name])
    collectives = []
    for f in doc["collectives"].elements():
        c = CollectivePlan(
            kind=f["kind"].text(),
            bytes=f["bytes"].integer(),
            axes=tuple(a.text() for a in f["axes"].elements()),
            phase=Phase(f["phase"].one_of(tuple(Phase))),
            node=f["node"].text(),
            tensor=f["tensor"].text(),
            stage=f["stage"].integer(),
            params=tuple(p.text() for p in f["params"].elements()),
        )
        _check_axes(f["axes"], c, axes)
        if c.stage >= len(stages):
            raise f["stage"].fail(f"a stage index below {len(stages)}")
        if c.params:
            _check_bucket(f, c, nodes)
        elif c.node not in nodes and not (c.node == SEND and pipeline is not None):
            raise f["node"].fail(f"the name of a node in nodes (or {SEND!r}: a stage's send)")
        collectives.append(c)
    pr = doc["predicted"]
    predicted = Predicted(
        step_time_s=pr["step_time_s"].number(),
        compute_s=pr["compute_s"].number(),
        comm_s=pr["comm_s"].number(),
        peak_memory_bytes=pr["peak_memory_bytes"].number(),
        memory_limit_bytes=pr["memory_limit_bytes"].number(),
        allocator_margin=margin.number() if (margin := pr.get("allocator_margin")) else 0.0,
    )
    s = doc["solver"]
    solver = SolverInfo(
        status=s["status"].text(),
        objective=s["objective"].number(),
        solve_time_s=s["solve_time_s"].number(),
        num_variables=s["num_variables"].integer(),
        num_constraints=s["num_constraints"].integer(),
        num_groups=s["num_groups"].integer(),
        meshes_tried=tuple(
            tuple(d.integer() for d in m.elements()) for m in s["meshes_tried"].elements()
        ),
        unproven=_read_unproven(s.get("unproven")),
    )
    return dict(
        provenance=provenance,
        mesh=mesh,
        stages=stages,
        params=params,
        nodes=nodes,
        collectives=tuple(collectives),
        predicted=predicted,
        solver=solver,
        pipeline=pipeline,
        mixed_precision=_read_precision(doc.get("mixed_precision")),
        recompute=_read_recompute(doc.get("recompute"), nodes, stages),
    )


def _read_precision(f: JsonField | None) -> str | None:
    if f is None:
        return None
    return f.one_of(tuple(COMPUTE_DTYPES))


def _read_unproven(f: JsonField | None) -> tuple[Unproven, ...]:
    """The parts of the search not proven optimal (absent: none)."""
    if f is None:
        return ()
    found = []
    for e in f.elements():
        outcome = SKIPPED if e["outcome"].one_of(OUTCOMES) == SKIPPED else STOPPED
        gap = e.get("gap")
        if gap is not None and (outcome == SKIPPED or not gap.number() >= 0):
            raise gap.fail("a number >= 0 for a part stopped, or null")
        found.append(
            Unproven(
                part=e["part"].text(non_empty=True),
                outcome=outcome,
                time_limit_s=e["time_limit_s"].number(),
                gap=None if gap is None else gap.number(),
            )
        )
    return tuple(found)


def _read_param(f: JsonField, axes: tuple[str, ...]) -> ParamPlan:
    optional = {}
    for key in OPTIONAL_PARAM_FIELDS:
        given = f.get(key)
        optional[key] = _placements(given, axes) if given is not None and given.obj() else {}
    param = ParamPlan(
        placements=_placements(f["placements"], axes),
        storage=_placements(f["storage"], axes),
        shape=tuple(s.integer() for s in f["shape"].elements()),
        dtype=f["dtype"].text(),
        **optional,
    )
    if param.grad and not param.state:
        raise f["grad"].problem("a gradient placement goes with a state placement (ZeRO-2)")
    if param.grad and param.grad != param.state:
        raise f["grad"].fail("the state's placement (ZeRO-2), or no grad field (as stored)")
    return param


def _read_recompute(
    f: JsonField | None, nodes: Mapping[str, NodePlan], stages: tuple[Stage, ...]
) -> tuple[RecomputedLayer, ...]:
    """The recomputed layers, each of ops of one stage, in its own mode (absent: none)."""
    if f is None:
        return ()
    stage_of = {n: s for s, stage in enumerate(stages) for n in stage.nodes}
    found: list[RecomputedLayer] = []
    for e in f.elements():
        saved = e.get("saved")  # written only when some are
        layer = RecomputedLayer(
            layer=e["layer"].text(),
            mode=e["mode"].one_of(RECOMPUTE_MODES),
            nodes=tuple(n.text() for n in e["nodes"].elements(min_count=1)),
            saved=tuple(n.text() for n in saved.elements()) if saved is not None else (),
        )
        if saved is not None and not set(layer.saved) <= set(layer.nodes):
            raise saved.fail("names of ops in nodes")
        for i, name in enumerate(layer.nodes):
            if name not in nodes or nodes[name].op in (
                NodeKind.PARAM,
                NodeKind.INPUT,
                NodeKind.OUTPUT,
            ):
                raise e["nodes"].elements()[i].fail("the name of an op node in nodes")
        if len({stage_of.get(n) for n in layer.nodes}) != 1:
            raise e["nodes"].fail("ops of one stage")
        found.append(layer)
    return tuple(found)


def _check_axes(f: JsonField, c: CollectivePlan, axes: tuple[str, ...]) -> None:
    """One mesh axis of a stage; several, in mesh order, only for a gradient bucket (which
    is all-reduced over their ranks together)."""
    names = ", ".join(axes)
    for i, axis in enumerate(c.axes):
        if axis not in axes:
            raise f.elements()[i].fail(f"a mesh axis of a stage ({names})")
    if not c.axes:
        raise f.fail(f"a list of one mesh axis of a stage ({names})")
    if len(c.axes) > 1:
        if not c.params:
            raise f.fail("a list of one mesh axis (several only for a gradient bucket)")
        order = sorted(set(c.axes), key=axes.index)
        if list(c.axes) != order:
            raise f.fail(f"distinct mesh axes in mesh order ({', '.join(order)})")


def _check_bucket(f: JsonField, c: CollectivePlan, nodes: Mapping[str, NodePlan]) -> None:
    """A gradient bucket: an all-reduce of parameters' gradients, issued by no op."""
    if c.node != GRADIENTS:
        raise f["node"].fail(f"{GRADIENTS!r} for a gradient bucket (one with params)")
    if c.kind != "all_reduce" or c.phase != Phase.GRAD_SYNC:
        raise f["kind"].fail("all_reduce, of phase grad_sync, for a gradient bucket")
    for i, name in enumerate(c.params):
        if name not in nodes or nodes[name].op != NodeKind.PARAM:
            raise f["params"].elements()[i].fail("the name of a parameter node in nodes")


def _read_stage(f: JsonField, axes: tuple[str, ...]) -> Stage:
    boundary = f["boundary"]
    p = f["predicted"]
    predicted = None
    if p.value is not None:
        predicted = StagePredicted(
            time_s=p["time_s"].number(),
            forward_s=p["forward_s"].number(),
            backward_s=p["backward_s"].number(),
            memory_bytes=p["memory_bytes"].number(),
        )
    return Stage(
        ranks=tuple(r.integer() for r in f["ranks"].elements()),
        nodes=tuple(n.text() for n in f["nodes"].elements()),
        layers=tuple(n.text() for n in f["layers"].elements()),
        received=tuple(n.text() for n in f["received"].elements()),
        sent=tuple(n.text() for n in f["sent"].elements()),
        boundary=_placements(boundary, axes) if boundary.obj() else {},
        predicted=predicted,
    )


def _read_pipeline(f: JsonField) -> Pipeline | None:
    if f.value is None:
        return None
    schedule = f["schedule"].one_of(tuple(Schedule))
    count = f["num_microbatches"].integer(minimum=1)
    return Pipeline(schedule, count, f["bubble_fraction"].number())


def _placements(f: JsonField, axes: tuple[str, ...]) -> Placements:
    """A placement for each of the mesh axes `axes`, keyed by axis name."""
    found = {}
    for axis, placement in f.items():
        if axis not in axes:
            raise f.problem(f"{axis!r} is not a mesh axis; the mesh has {', '.join(axes)}")
        text = placement.text()
        if not is_placement(text):
            raise placement.fail('a placement: "R", "P", "S(<dim>)" or "S(<dim>)x<pieces>"')
        found[axis] = text
    if set(found) != set(axes):
        raise f.fail(f"a placement for every mesh axis ({', '.join(axes)})")
    return {axis: found[axis] for axis in axes}  # in mesh order, however the file has them
