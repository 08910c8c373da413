"""Re-pricing plans: unchanged plans keep their numbers, edits change exactly what they imply."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.cli.main import main
from autoplan.errors import PlanFormatError
from autoplan.planfile.sections import ParamPlan
from tests.conftest import ROOT, example


def _megatron(cluster: autoplan.Cluster) -> tuple[autoplan.Plan, autoplan.Workload]:
    w = example("mlp", batch_size=4, hidden=2048)
    plan = w.plan(cluster, options=PlanOptions(mesh_shape=(4,)))
    return plan, w


def test_a_plan_estimated_on_its_own_cluster_keeps_its_numbers(cpu4: autoplan.Cluster) -> None:
    plan, w = _megatron(cpu4)
    again = autoplan.estimate(
        plan, cpu4, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
    )
    assert again.predicted == plan.predicted
    assert again.collectives == plan.collectives


def test_an_edit_is_priced(cpu4: autoplan.Cluster) -> None:
    plan, w = _megatron(cpu4)
    axis = plan.mesh.axes[0]
    assert plan.params["layers.0.weight"].storage == {axis: "S(0)"}
    # keep layer 0's weight whole on every device; ops still read their column split
    params = dict(plan.params)
    params["layers.0.weight"] = dataclasses.replace(params["layers.0.weight"], storage={axis: "R"})
    nodes = dict(plan.nodes)
    weight = "p_model_layers_0_weight"
    nodes[weight] = dataclasses.replace(nodes[weight], output={axis: "R"})
    edited = dataclasses.replace(plan, params=params, nodes=nodes)
    priced = autoplan.estimate(
        edited, cpu4, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
    )
    new = [c for c in priced.collectives if c not in plan.collectives]
    # its column-split gradient is gathered back to the whole weight: 2048 x 2048 fp32
    assert [(c.kind, c.phase, c.bytes, c.tensor) for c in new] == [
        ("all_gather", "grad_sync", 2048 * 2048 * 4, weight)
    ]
    weight_and_state = 2048 * 2048 * 4 * 4  # param, grad, two Adam moments
    # and, while its reader's backward runs, the gradient made split as it reads the weight,
    # beside the gathered one
    assert priced.predicted.peak_memory_bytes - plan.predicted.peak_memory_bytes == pytest.approx(
        weight_and_state * 3 / 4 + 2048 * 2048 * 4 / 4
    )
    assert isinstance(priced.params["layers.0.weight"], ParamPlan)


def test_another_model_is_refused(cpu4: autoplan.Cluster) -> None:
    plan, _ = _megatron(cpu4)
    other = example("mlp", batch_size=4, hidden=1024)
    with pytest.raises(PlanFormatError, match="another model"):
        autoplan.estimate(
            plan,
            cpu4,
            other.model,
            other.example_inputs,
            loss_fn=other.loss_fn,
            example_target=other.example_target,
        )


def test_cli_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file, priced_file = tmp_path / "plan.json", tmp_path / "priced.json"
    common = ["--set", "batch_size=4", "--set", "hidden=1024"]
    cluster = str(ROOT / "costmodels/cpu-gloo-4.json")
    mlp = str(ROOT / "examples/mlp.py")
    assert main(["-q", "plan", mlp, "--cluster", cluster, *common, "-o", str(plan_file)]) == 0
    capsys.readouterr()
    code = main(
        [
            "-q",
            "estimate",
            mlp,
            "--plan",
            str(plan_file),
            "--cluster",
            cluster,
            *common,
            "-o",
            str(priced_file),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and priced_file.exists()
    first = autoplan.Plan.from_json(str(plan_file))
    assert autoplan.Plan.from_json(str(priced_file)).predicted == first.predicted


def test_a_pipelined_plan_is_estimated_stage_by_stage(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="small", num_layers=2, batch_size=8, seq_len=32)
    plan = w.plan(cpu4, options=PlanOptions(pipeline=True, num_stages=2, num_microbatches=4))
    args = (w.model, w.example_inputs)
    kw = {"loss_fn": w.loss_fn, "example_target": w.example_target}
    assert autoplan.estimate(plan, cpu4, *args, **kw) == plan  # its own numbers, exactly
    slow = dataclasses.replace(
        cpu4,
        intra_node=dataclasses.replace(cpu4.intra_node, bandwidth=cpu4.intra_node.bandwidth / 10),
    )
    priced = autoplan.estimate(plan, slow, *args, **kw)
    assert priced.pipeline is not None and plan.pipeline is not None
    assert priced.predicted.step_time_s > plan.predicted.step_time_s
    assert priced.nodes == plan.nodes and priced.mesh == plan.mesh  # decisions unchanged
    sends = [s.predicted.time_s for s in priced.stages if s.predicted is not None]
    assert sends[0] > plan.stages[0].predicted.time_s  # type: ignore[union-attr]
