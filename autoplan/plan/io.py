"""Plan <-> JSON. Output is canonical (sorted keys, fixed float formatting), so the same plan
always gives the same bytes; input is validated field by field, and every problem raises
`PlanFormatError` naming the field (``nodes.linear_1.inputs[0].tp``) and what was expected.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from autoplan.errors import PlanFormatError
from autoplan.plan.schema import (
    PLAN_VERSION,
    CollectivePlan,
    Mesh,
    NodePlan,
    ParamPlan,
    Placements,
    Plan,
    Predicted,
    Provenance,
    SolverInfo,
    Stage,
)
from autoplan.strategies.placement import is_placement


def plan_to_json(plan: Plan) -> str:
    """Keys in a fixed order: dataclass field order, parameters and nodes in graph order."""
    return json.dumps(_round(asdict(plan)), indent=1) + "\n"


def _round(value: Any) -> Any:
    """Floats to 6 significant digits: stable across platforms, ample for predictions."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v) for v in value]
    return value


class _Field:
    """A JSON value with the path that led to it, for error messages."""

    def __init__(self, value: Any, path: str) -> None:
        self.value = value
        self.path = path

    def fail(self, expected: str) -> PlanFormatError:
        shown = json.dumps(self.value)[:60] if self.value is not _MISSING else "nothing"
        return PlanFormatError(f"plan field {self.path}: expected {expected}, found {shown}")

    def __getitem__(self, key: str) -> _Field:
        obj = self.obj()
        return _Field(obj.get(key, _MISSING), f"{self.path}.{key}" if self.path else key)

    def obj(self) -> dict[str, Any]:
        if not isinstance(self.value, dict):
            raise self.fail("an object")
        return self.value

    def items(self) -> list[tuple[str, _Field]]:
        return [(k, self[k]) for k in self.obj()]

    def list(self) -> list[_Field]:
        if not isinstance(self.value, list):
            raise self.fail("a list")
        return [_Field(v, f"{self.path}[{i}]") for i, v in enumerate(self.value)]

    def str(self) -> str:
        if not isinstance(self.value, str):
            raise self.fail("a string")
        return self.value

    def int(self) -> int:
        if not isinstance(self.value, int) or isinstance(self.value, bool) or self.value < 0:
            raise self.fail("a non-negative integer")
        return self.value

    def float(self) -> float:
        if not isinstance(self.value, int | float) or isinstance(self.value, bool):
            raise self.fail("a number")
        return float(self.value)

    def placements(self, axes: tuple[str, ...]) -> Placements:
        found = {}
        for axis, f in self.items():
            if axis not in axes:
                raise f.fail(f"a mesh axis ({', '.join(axes)})")
            text = f.str()
            if not is_placement(text):
                raise f.fail('a placement: "R", "P" or "S(<dim>)"')
            found[axis] = text
        if set(found) != set(axes):
            raise self.fail(f"a placement for every mesh axis ({', '.join(axes)})")
        return found


_MISSING = object()


def plan_from_json(
    source: str, *, graph_fingerprint: str | None = None, cluster_fingerprint: str | None = None
) -> Plan:
    text = source
    if not source.lstrip().startswith("{"):
        if not os.path.isfile(source):
            raise PlanFormatError(f"plan file {source} does not exist (and it is not JSON text)")
        with open(source) as f:
            text = f.read()
    try:
        doc = _Field(json.loads(text), "")
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"plan is not valid JSON: {e.msg} at line {e.lineno}") from e
    version = doc["version"]
    if version.value != PLAN_VERSION:
        raise version.fail(f"version {PLAN_VERSION} (this autoplan reads only that version)")
    plan = _read_plan(doc)
    for name, expected in (("graph", graph_fingerprint), ("cluster", cluster_fingerprint)):
        found = getattr(plan.provenance, f"{name}_fingerprint")
        if expected is not None and found != expected:
            raise PlanFormatError(
                f"plan field provenance.{name}_fingerprint is {found} but the {name} at hand has "
                f"{expected}: the plan was made for another {'model or input shapes' if name == 'graph' else 'cluster'}; "
                "re-plan (autoplan plan ...) for this one"
            )
    return plan


def _read_plan(doc: _Field) -> Plan:
    p = doc["provenance"]
    provenance = Provenance(
        autoplan=p["autoplan"].str(),
        torch=p["torch"].str(),
        graph_fingerprint=p["graph_fingerprint"].str(),
        cluster_fingerprint=p["cluster_fingerprint"].str(),
        cluster=p["cluster"].str(),
    )
    m = doc["mesh"]
    mesh = Mesh(
        axes=tuple(a.str() for a in m["axes"].list()),
        shape=tuple(s.int() for s in m["shape"].list()),
        ranks=tuple(r.int() for r in m["ranks"].list()),
    )
    if len(mesh.axes) != len(mesh.shape) or len(set(mesh.axes)) != len(mesh.axes):
        raise m["axes"].fail(f"{len(mesh.shape)} distinct axis names, one per mesh dimension")
    total = 1
    for s in mesh.shape:
        total *= s
    if len(mesh.ranks) != total:
        raise m["ranks"].fail(f"{total} ranks (the product of mesh.shape)")
    stages = tuple(
        Stage(ranks=tuple(r.int() for r in s["ranks"].list()), nodes=tuple(n.str() for n in s["nodes"].list()))
        for s in doc["stages"].list()
    )
    params = {
        name: ParamPlan(
            placements=f["placements"].placements(mesh.axes),
            storage=f["storage"].placements(mesh.axes),
            shape=tuple(s.int() for s in f["shape"].list()),
            dtype=f["dtype"].str(),
        )
        for name, f in doc["params"].items()
    }
    nodes = {}
    for name, f in doc["nodes"].items():
        output = f["output"]
        nodes[name] = NodePlan(
            op=f["op"].str(),
            module=f["module"].str(),
            output=output.placements(mesh.axes) if output.obj() else {},
            inputs=tuple(i.placements(mesh.axes) for i in f["inputs"].list()),
            rule=f["rule"].str(),
        )
    collectives = []
    for f in doc["collectives"].list():
        c = CollectivePlan(
            kind=f["kind"].str(),
            bytes=f["bytes"].int(),
            axis=f["axis"].str(),
            phase=f["phase"].str(),
            node=f["node"].str(),
            tensor=f["tensor"].str(),
        )
        if c.axis not in mesh.axes:
            raise f["axis"].fail(f"a mesh axis ({', '.join(mesh.axes)})")
        if c.node not in nodes:
            raise f["node"].fail("the name of a node in nodes")
        collectives.append(c)
    pr = doc["predicted"]
    predicted = Predicted(
        step_time_s=pr["step_time_s"].float(),
        compute_s=pr["compute_s"].float(),
        comm_s=pr["comm_s"].float(),
        peak_memory_bytes=pr["peak_memory_bytes"].float(),
        memory_limit_bytes=pr["memory_limit_bytes"].float(),
    )
    s = doc["solver"]
    solver = SolverInfo(
        status=s["status"].str(),
        objective=s["objective"].float(),
        solve_time_s=s["solve_time_s"].float(),
        num_variables=s["num_variables"].int(),
        num_constraints=s["num_constraints"].int(),
        num_groups=s["num_groups"].int(),
        meshes_tried=tuple(tuple(d.int() for d in m.list()) for m in s["meshes_tried"].list()),
    )
    return Plan(provenance, mesh, stages, params, nodes, tuple(collectives), predicted, solver)
