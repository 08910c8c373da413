"""Plan <-> JSON: identity, determinism, and refusal of bad documents."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import autoplan
from autoplan.errors import PlanFormatError
from autoplan.planfile.sections import PLAN_VERSION
from autoplan.solvers.problem import SKIPPED, STOPPED, Unproven
from autoplan.version import torch_release
from tests.conftest import ROOT, plan_example


@pytest.fixture(scope="module")
def plan(cpu4: autoplan.Cluster) -> autoplan.Plan:
    return plan_example("gpt", cpu4, (2, 2), size="tiny", batch_size=4)


def test_round_trip_is_identical(plan: autoplan.Plan, tmp_path: Path) -> None:
    text = plan.to_json()
    again = autoplan.Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert autoplan.Plan.from_json(str(path)) == plan


def test_two_runs_give_byte_identical_json(plan: autoplan.Plan, cpu4: autoplan.Cluster) -> None:
    other = plan_example("gpt", cpu4, (2, 2), size="tiny", batch_size=4)
    a, b = json.loads(plan.to_json()), json.loads(other.to_json())
    a["solver"].pop("solve_time_s")  # wall time is the one field that may differ
    b["solver"].pop("solve_time_s")
    assert json.dumps(a) == json.dumps(b)


def test_document_has_the_promised_fields(plan: autoplan.Plan) -> None:
    doc = json.loads(plan.to_json())
    assert doc["version"] == 5
    for key in (
        "provenance",
        "mesh",
        "stages",
        "params",
        "nodes",
        "collectives",
        "predicted",
        "solver",
        "pipeline",
    ):
        assert key in doc
    assert doc["mesh"]["shape"] == [2, 2] and len(doc["mesh"]["ranks"]) == 4
    assert set(doc["predicted"]) >= {"step_time_s", "compute_s", "comm_s", "peak_memory_bytes"}
    assert next(iter(doc["params"])) == "tok_emb.weight"  # graph order, not sorted order


_COLLECTIVE = {
    "kind": "all_reduce",
    "bytes": 4,
    "axes": ["tp0"],
    "phase": "forward",
    "node": "output",
    "tensor": "x",
    "stage": 0,
    "params": [],
}


def test_parts_not_proven_optimal_round_trip(plan: autoplan.Plan) -> None:
    unproven = (
        Unproven("mesh (4,)", SKIPPED, 60.0),
        Unproven("mesh (2, 2)", STOPPED, 60.0, 0.031),
        Unproven("mesh (1, 4)", STOPPED, 60.0),  # CBC: gap unknown
    )
    noted = dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, unproven=unproven))
    text = noted.to_json()
    assert json.loads(text)["solver"]["unproven"][1] == {
        "part": "mesh (2, 2)",
        "outcome": "stopped",
        "time_limit_s": 60.0,
        "gap": 0.031,
    }
    again = autoplan.Plan.from_json(text)
    assert again == noted and again.to_json() == text
    assert [u.describe() for u in unproven] == [
        "mesh (4,): skipped, no plan found within the 60 s time limit",
        "mesh (2, 2): stopped at the 60 s time limit, gap <= 3.10%",
        "mesh (1, 4): stopped at the 60 s time limit, gap unknown",
    ]


_UNPROVEN = {"part": "mesh (4,)", "outcome": "stopped", "time_limit_s": 60.0, "gap": 0.5}


def _corrupt(plan: autoplan.Plan, edit: object) -> str:
    doc = json.loads(plan.to_json())
    edit(doc)  # type: ignore[operator]
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(version=1), "version"),
        (lambda d: d["mesh"].update(shape=[3, 2]), "mesh.ranks"),
        (
            lambda d: d["params"]["head.weight"]["placements"].update(dp0="S(x)"),
            "params.head.weight.placements",
        ),
        (lambda d: d["predicted"].pop("comm_s"), "predicted.comm_s"),
        (
            lambda d: d["collectives"].append(dict(_COLLECTIVE, axes=["zz"])),
            "collectives[].axes[]",
        ),
        (lambda d: d["collectives"].append(dict(_COLLECTIVE, axes=[])), "collectives[].axes"),
        (
            lambda d: d["collectives"].append(dict(_COLLECTIVE, axes=["dp0", "tp0"])),
            "collectives[].axes",
        ),
        (
            lambda d: d["collectives"].append(
                dict(
                    _COLLECTIVE,
                    axes=["tp0", "dp0"],
                    node="gradients",
                    phase="grad_sync",
                    params=["tok_emb_w"],
                )
            ),
            "collectives[].axes",
        ),
        (lambda d: d["collectives"].append(dict(_COLLECTIVE, node="nope")), "collectives[].node"),
        (lambda d: d.update(nodes=[]), "nodes"),
        (
            lambda d: d["collectives"].append(dict(_COLLECTIVE, node="x", params=["tok_emb_w"])),
            "collectives[].node",
        ),
        (
            lambda d: d["collectives"].append(
                dict(_COLLECTIVE, node="gradients", phase="grad_sync", params=["output"])
            ),
            "collectives[].params",
        ),
        (
            lambda d: d["nodes"]["output"].update(grad=dict.fromkeys(d["mesh"]["axes"], "P")),
            "nodes.output.grad",
        ),
        (
            lambda d: d["params"]["head.weight"]["storage"].update(
                tp=d["params"]["head.weight"]["storage"].pop("dp0", "R")
            ),
            "'tp' is not a mesh axis",
        ),
        (
            lambda d: d["solver"].update(unproven=[dict(_UNPROVEN, outcome="lost")]),
            "solver.unproven[].outcome",
        ),
        (
            lambda d: d["solver"].update(unproven=[dict(_UNPROVEN, outcome="skipped")]),
            "solver.unproven[].gap",
        ),
        (
            lambda d: d["solver"].update(unproven=[dict(_UNPROVEN, gap=-0.1)]),
            "solver.unproven[].gap",
        ),
    ],
)
def test_malformed_documents_name_the_field(plan: autoplan.Plan, edit: object, field: str) -> None:
    text = _corrupt(plan, edit)
    with pytest.raises(PlanFormatError, match=field.replace(".", r"\.").replace("[]", r"\[\d+\]")):
        autoplan.Plan.from_json(text)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        autoplan.Plan.from_json('{"version": 1,')
    with pytest.raises(PlanFormatError, match="does not exist"):
        autoplan.Plan.from_json(str(tmp_path / "nope.json"))


def test_a_plan_from_another_torch_release_loads_where_its_graph_is_the_same(
    plan: autoplan.Plan,
) -> None:
    assert plan.provenance.torch == torch_release()
    doc = json.loads(plan.to_json())
    doc["provenance"]["torch"] = "2.11.0" if torch_release() != "2.11.0" else "2.15.0"
    text = json.dumps(doc)
    fp = plan.provenance.graph_fingerprint
    loaded = autoplan.Plan.from_json(text, graph_fingerprint=fp)
    assert loaded.provenance.torch == doc["provenance"]["torch"]
    assert loaded.nodes == plan.nodes
    with pytest.raises(PlanFormatError) as refused:
        autoplan.Plan.from_json(text, graph_fingerprint="0" * 16)
    message = str(refused.value)
    assert f"made under torch {doc['provenance']['torch']} for graph {fp}" in message
    assert f"under torch {torch_release()} this model traces to graph {'0' * 16}" in message
    assert message.endswith("plan again under this torch")


def test_mismatched_fingerprints_are_refused(plan: autoplan.Plan, a100: autoplan.Cluster) -> None:
    text = plan.to_json()
    fp = plan.provenance.graph_fingerprint
    assert autoplan.Plan.from_json(text, graph_fingerprint=fp) == plan
    with pytest.raises(PlanFormatError, match="graph_fingerprint"):
        autoplan.Plan.from_json(text, graph_fingerprint="0" * 16)
    with pytest.raises(PlanFormatError, match="cluster_fingerprint"):
        autoplan.Plan.from_json(text, cluster_fingerprint=a100.fingerprint())


def test_docs_name_the_plan_version_the_code_reads() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = re.findall(r"format (?:version )?(\d+)", "".join(p.read_text() for p in docs))
    assert named and set(named) == {str(PLAN_VERSION)}
