"""`autoplan show`: the pipeline schedule's timeline, the text summary and the picture; where
the time goes (``--top``); `autoplan diff`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.cli.main import main
from autoplan.errors import AutoplanError
from autoplan.estimate import price_stages_ops
from autoplan.graph.capture import capture_microbatches
from autoplan.planfile.breakdown import Breakdown, breakdown, by_layer, top_lines, top_ops
from autoplan.planfile.diff import Change, diff, diff_lines
from autoplan.planfile.picture import render_png
from autoplan.planfile.sections import Pipeline
from autoplan.planfile.show import fmt_time, schedule_grid, summary
from autoplan.schedules import Event, simulate, stage_order
from autoplan.units import fmt_bytes
from tests.conftest import ROOT, example, plan_example


def _steps(events: tuple[Event, ...], stage: int) -> list[tuple[str, int, float, float]]:
    return [(e.kind, e.microbatch, e.start, e.end) for e in events if e.stage == stage]


def _row(events: tuple[Event, ...], stage: int) -> str:
    """A stage's unit slots as "F0 F1 . B0 ...", "." idle."""
    slots = ["."] * round(max(e.end for e in events))
    for e in events:
        if e.stage == stage:
            assert e.end == e.start + 1
            slots[round(e.start)] = f"{e.kind}{e.microbatch}"
    return " ".join(slots)


# 2 stages x 3 microbatches, worked out by hand from each stage's order and its inputs
@pytest.mark.parametrize(
    ("schedule", "stage0", "stage1"),
    [
        ("GPipe", "F0 F1 F2 . . B0 B1 B2", ". F0 F1 F2 B0 B1 B2 ."),
        # stage 0 warms up with 2 forwards, stage 1 (the last) with 1
        ("1F1B", "F0 F1 . B0 F2 B1 . B2", ". F0 B0 F1 B1 F2 B2 ."),
    ],
)
def test_two_stages_three_microbatches_by_hand(schedule: str, stage0: str, stage1: str) -> None:
    events = simulate(schedule, 2, 3)
    assert (_row(events, 0), _row(events, 1)) == (stage0, stage1)


def test_durations_stretch_the_slots() -> None:
    # stage 0: forward 1, backward 2; stage 1: forward 2, backward 4 (seconds)
    events = simulate("1F1B", 2, 2, [(1.0, 2.0), (2.0, 4.0)])
    assert _steps(events, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7, 9), ("B", 1, 13, 15)]
    assert _steps(events, 1) == [("F", 0, 1, 3), ("B", 0, 3, 7), ("F", 1, 7, 9), ("B", 1, 9, 13)]


def test_stages_sharing_processors_run_faster_alone() -> None:
    # two stages of 1 s steps on processors that run one stage alone at twice the speed of
    # two at once (CPU ranks sharing cores); GPipe, 2 microbatches, by hand
    events = simulate("GPipe", 2, 2, [(1.0, 1.0)] * 2, lambda running: 2.0 if running == 1 else 1.0)
    assert _steps(events, 0) == [("F", 0, 0, 0.5), ("F", 1, 0.5, 1.5), ("B", 0, 2.5, 3.5),
                                 ("B", 1, 3.5, 4.0)]  # fmt: skip
    assert _steps(events, 1) == [("F", 0, 0.5, 1.5), ("F", 1, 1.5, 2.0), ("B", 0, 2.0, 2.5),
                                 ("B", 1, 2.5, 3.5)]  # fmt: skip
    same = simulate("GPipe", 2, 2, [(1.0, 1.0)] * 2, lambda running: 1.0)
    assert same == simulate("GPipe", 2, 2, [(1.0, 1.0)] * 2)  # sum + (B - 1) max: 6 s
    assert max(e.end for e in same) == 6.0


def test_1f1b_order_is_torchs() -> None:
    # Schedule1F1B: min(B, S - s) forwards, then backward/forward pairs, then the backwards
    assert stage_order("1F1B", 4, 6, 1) == (
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2),
        ("F", 5), ("B", 3), ("B", 4), ("B", 5),
    )  # fmt: skip
    assert stage_order("1F1B", 4, 2, 0) == (("F", 0), ("F", 1), ("B", 0), ("B", 1))


@pytest.mark.parametrize(
    ("schedule", "num_stages", "num_microbatches"),
    list(itertools.product(("GPipe", "1F1B"), (1, 2, 3, 5), (1, 2, 4, 7))),
)
def test_timeline_keeps_order_and_dependencies(
    schedule: str, num_stages: int, num_microbatches: int
) -> None:
    durations = [(1.0 + 0.3 * s, 2.5 - 0.2 * s) for s in range(num_stages)]
    events = simulate(schedule, num_stages, num_microbatches, durations)
    end = {(e.kind, e.stage, e.microbatch): e.end for e in events}
    assert len(end) == len(events) == 2 * num_stages * num_microbatches
    for s in range(num_stages):
        mine = [e for e in events if e.stage == s]
        order = stage_order(schedule, num_stages, num_microbatches, s)
        assert [(e.kind, e.microbatch) for e in mine] == list(order)
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine))  # one thing at a time
    for e in events:
        assert e.end - e.start == pytest.approx(durations[e.stage][e.kind == "B"])
        if e.kind == "B":
            assert end[("F", e.stage, e.microbatch)] <= e.start
        source = e.stage - 1 if e.kind == "F" else e.stage + 1
        assert end.get((e.kind, source, e.microbatch), 0.0) <= e.start


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(AutoplanError, match="Interleaved"):
        simulate("Interleaved", 2, 2)


def _labels(num_stages: int) -> list[str]:
    return [f"stage {s} (ranks {4 * s}-{4 * s + 3})" for s in range(num_stages)]


def test_grid_of_16_microbatches_on_8_stages_fits_and_is_whole() -> None:
    lines = schedule_grid(Pipeline("1F1B", 16, 0.3), _labels(8))
    assert max(map(len, lines)) <= 100
    assert not any("left out" in line for line in lines)
    row0 = "".join(line.split(")", 1)[1] for line in lines if line.startswith("  stage 0 "))
    assert row0.split() == [
        *(f"F{m}" for m in range(8)), *["."] * 7, "B0",
        *itertools.chain.from_iterable((f"F{m + 8}", f"B{m + 1}") for m in range(8)),
        *itertools.chain.from_iterable((".", f"B{m}") for m in range(9, 16)),
    ]  # fmt: skip


def test_grid_past_the_limits_leaves_out_the_middle() -> None:
    lines = schedule_grid(Pipeline("1F1B", 40, 0.3), _labels(12))
    assert lines[-1] == "  (left out: stages 4-7, slots 23-78)"
    assert "  stage 11 (ranks 44-47)" in "\n".join(lines)
    assert not any(line.startswith("  stage 5 ") for line in lines)
    assert max(map(len, lines)) <= 100


@pytest.fixture(scope="module")
def pipelined(cpu4: autoplan.Cluster) -> autoplan.Plan:
    w = example("gpt", size="small", num_layers=2, batch_size=8, seq_len=32)
    return w.plan(
        cpu4,
        options=PlanOptions(pipeline=True, num_stages=2, num_microbatches=4, schedule="1F1B"),
    )


def test_summary_of_a_pipelined_plan_shows_stages_and_grid(pipelined: autoplan.Plan) -> None:
    text = summary(pipelined)
    lines = text.splitlines()
    assert "pipeline: 2 stages, 4 microbatches, schedule 1F1B, predicted bubble" in text
    stage_rows = [line.split() for line in lines if line.startswith(("  0  ", "  1  "))]
    assert [row[:3] for row in stage_rows] == [["0", "0-1", "blocks.0"], ["1", "2-3", "blocks.1"]]
    assert all({"KiB", "MiB", "GiB"} & set(row) for row in stage_rows)  # memory, with its unit
    assert any(line.startswith("  stage 0 -> 1 sends ") for line in lines)
    assert "  stage 0 (ranks 0-1)  F0 F1  . B0 F2 B1 F3 B2  . B3" in lines
    assert "  stage 1 (ranks 2-3)   . F0 B0 F1 B1 F2 B2 F3 B3  ." in lines


def test_summary_of_a_plan_without_pipeline_has_no_stages(cpu4: autoplan.Cluster) -> None:
    plan = plan_example("mlp", cpu4, (2, 2), batch_size=8, hidden=32)
    lines = summary(plan).splitlines()
    assert lines[1].startswith("mesh: ")
    assert lines[2:4] == ["", "parameters (as used by ops; storage when it differs):"]
    assert not any("pipeline" in line or "F0" in line for line in lines)
    with pytest.raises(AutoplanError, match="no pipeline stages"):
        render_png(plan, "unused.png")


def test_render_png_writes_a_png(pipelined: autoplan.Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.png"
    render_png(pipelined, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_summary_counts_the_gradient_buckets(cpu4: autoplan.Cluster) -> None:
    plan = plan_example("mlp", cpu4, (4,), batch_size=65536, hidden=32)
    line = "  (12 gradients all-reduced in 1 bucket(s), up to 25.00 MiB each, the first 1.00 MiB)"
    assert line in summary(plan)


@pytest.fixture(scope="module")
def gpt_tp(cpu4: autoplan.Cluster) -> tuple[autoplan.Plan, Breakdown]:
    """examples/gpt.py (tiny) on a 2 x 2 mesh, data parallel, and its price op by op."""
    w = example("gpt", batch_size=64)
    plan = w.plan(cpu4, options=PlanOptions(mesh_shape=(2, 2)))
    graph_for = capture_microbatches(w.model, w.example_inputs, w.loss_fn, w.example_target)
    return plan, breakdown(plan, price_stages_ops(plan, graph_for, cpu4))


def test_top_ops_add_up_to_the_plans_prediction(gpt_tp: tuple[autoplan.Plan, Breakdown]) -> None:
    plan, b = gpt_tp
    assert plan.pipeline is None and plan.collectives
    assert b.compute_s == pytest.approx(plan.predicted.compute_s, rel=1e-9)
    assert b.comm_s == pytest.approx(plan.predicted.comm_s, rel=1e-9)
    assert b.memory_bytes == pytest.approx(plan.predicted.peak_memory_bytes, rel=1e-9)
    # the layers' sums are the ops'
    layers = by_layer(b)
    assert sum(o.time_s for o in layers) == pytest.approx(sum(o.time_s for o in b.ops))
    assert {o.layer for o in layers} >= {"blocks.0", "blocks.1", "head"}
    top = top_ops(b, 5)
    assert len(top) == 5
    times = [o.time_s for o in top]
    assert times == sorted(times, reverse=True)
    assert times[0] == max(o.time_s for o in b.ops)
    # an op's collectives are the plan's for that op
    named = [o for o in b.ops if o.collectives]
    assert named and all(o.comm_s > 0 for o in named)
    assert {o.node for o in named} <= {c.node for c in plan.collectives}


def test_top_ops_of_a_pipeline_add_up_per_microbatch(
    pipelined: autoplan.Plan, cpu4: autoplan.Cluster
) -> None:
    w = example("gpt", size="small", num_layers=2, batch_size=8, seq_len=32)
    graph_for = capture_microbatches(w.model, w.example_inputs, w.loss_fn, w.example_target)
    b = breakdown(pipelined, price_stages_ops(pipelined, graph_for, cpu4))
    assert b.per_microbatch and {o.stage for o in b.ops} == {0, 1}
    assert b.compute_s == pytest.approx(pipelined.predicted.compute_s, rel=1e-9)
    assert b.comm_s == pytest.approx(pipelined.predicted.comm_s, rel=1e-9)
    # what stage 1 receives is its own row, not stage 0's op of that name
    received = [o for o in b.ops if o.op == "received"]
    assert received and all(o.stage == 1 for o in received)
    assert top_lines(pipelined, b, 3)[0].startswith("where the time goes (per microbatch, all")


def test_top_lines_rank_ops_and_show_the_totals(gpt_tp: tuple[autoplan.Plan, Breakdown]) -> None:
    plan, b = gpt_tp
    lines = top_lines(plan, b, 3)
    assert lines[0].startswith("where the time goes (per step;")
    assert lines[1].split()[:3] == ["op", "kind", "layer"]
    assert lines[2].split()[0] == top_ops(b, 1)[0].node
    assert lines[5] == ""
    assert lines[6] == f"by layer (3 of {len(by_layer(b))}):"
    sums = next(line for line in lines if line.startswith("sums: "))
    assert sums == (
        f"sums: compute {fmt_time(b.compute_s)}, communication {fmt_time(b.comm_s)}; "
        f"plan predicts {fmt_time(plan.predicted.compute_s)}, {fmt_time(plan.predicted.comm_s)}"
    )


def test_cli_show_top_prices_the_plan_again(
    gpt_tp: tuple[autoplan.Plan, Breakdown], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpt.json"
    gpt_tp[0].save(str(path))
    cluster = str(ROOT / "costmodels/cpu-gloo-4.json")
    workload = str(ROOT / "examples/gpt.py")
    assert main(["show", str(path), "--top", "4"]) == 2  # no model to price it with
    assert "add --workload FILE" in capsys.readouterr().err
    top = ["--top", "4", "--workload", workload, "--set", "batch_size=64", "--cluster", cluster]
    picture = tmp_path / "top.png"
    assert main(["show", str(path), *top, "--png", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "where the time goes (per step;" in out and "by layer (4 of" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def mlp_meshes(cpu4: autoplan.Cluster) -> tuple[autoplan.Plan, autoplan.Plan]:
    """examples/mlp.py planned on a (4,) mesh (data parallel) and a (2, 2) one (tensor
    parallel on the second axis)."""
    return (
        plan_example("mlp", cpu4, (4,), batch_size=256, hidden=256),
        plan_example("mlp", cpu4, (2, 2), batch_size=256, hidden=256),
    )


def test_diff_names_the_changed_placements_and_the_cost(
    mlp_meshes: tuple[autoplan.Plan, autoplan.Plan],
) -> None:
    a, b = mlp_meshes
    d = diff(a, b)
    # the two axes of cpu4's (2, 2) mesh cost alike: either may be tp
    assert sorted(b.mesh.axes) == ["dp", "tp"]
    mesh = " x ".join(f"{axis}=2" for axis in b.mesh.axes)
    placed = ", ".join("tp=S(0)" if axis == "tp" else "dp=R" for axis in b.mesh.axes)
    assert d.layout[0] == Change("mesh", "dp=4", mesh)
    assert d.params[0] == Change("layers.0.weight", "[dp=R]", f"[{placed}]")
    assert len(d.params) == 12  # every weight and bias: split on tp
    assert d.step_time_s == (a.predicted.step_time_s, b.predicted.step_time_s)
    assert {(c.phase, c.kind) for c in d.collectives} >= {("forward", "all_reduce")}
    lines = diff_lines(d, "a.json", "b.json")
    assert lines[:2] == ["from a.json to b.json:", f"  mesh             dp=4  ->  {mesh}"]
    x, y = d.step_time_s
    step = next(line for line in lines if line.startswith("  step time"))
    assert fmt_time(x) in step and fmt_time(y) in step and f"x{y / x:.2f}" in step


def test_diff_of_a_plan_with_itself_is_empty(
    mlp_meshes: tuple[autoplan.Plan, autoplan.Plan],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = mlp_meshes[0]
    assert diff(a, a).same
    path = tmp_path / "a.json"
    a.save(str(path))
    assert main(["diff", str(path), str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path} and {path} make the same decisions")


def test_bytes_keep_their_unit_at_every_scale() -> None:
    """A small device's numbers never read "0.00 GiB" (issue 38)."""
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1.29 * 2**20) == "1.29 MiB"
    assert fmt_bytes(2.11 * 2**20) == "2.11 MiB"
    assert fmt_bytes(3.6 * 2**30) == "3.60 GiB"
    assert fmt_bytes(5 * 2**10) == "5.00 KiB"
    assert all(not fmt_bytes(n).startswith("0.00") for n in (1, 1000, 2**20 - 1, 2**30 + 1))


def test_constants_of_repeated_layers_share_a_line_as_their_parameters_do(
    cpu4: autoplan.Cluster,
) -> None:
    import dataclasses

    from autoplan.planfile.sections import ParamPlan

    plan = plan_example("mlp", cpu4, (4,))
    replicated = {a: "R" for a in plan.mesh.axes}
    # export numbers the constants forward makes across the model: two per layer here
    constants = {
        f"blocks.{i}.attn.lifted_tensor_{2 * i + j}": ParamPlan(
            replicated, replicated, (0,) if j == 0 else (3,), "float32"
        )
        for i in range(3)
        for j in range(2)
    }
    lines = summary(dataclasses.replace(plan, params={**plan.params, **constants})).splitlines()
    shown = [line for line in lines if "lifted_tensor" in line]
    # of two shapes (no elements, 3): not one line, which would show one shape for both
    assert len(shown) == 6
    same_shape = {name: p for name, p in constants.items() if p.shape == (3,)}
    lines = summary(dataclasses.replace(plan, params={**plan.params, **same_shape})).splitlines()
    assert [line.split()[0] for line in lines if "lifted_tensor" in line] == [
        "blocks.*.attn.lifted_tensor_*"
    ]
