"""ZeRO-1/2 (`autoplan.strategies.zero_state`): the optimizer state, and ZeRO-2's gradients, split
while the parameters stay whole; planned where memory (or time) asks for it, written in the
plan only when chosen, checked, priced and shown. The parity cases (tests/distributed/cases.py:
*-zero1, *-zero2) train such plans on 4 gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import autoplan
from autoplan import PlanOptions
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import AutoplanError, InfeasiblePlanError, PlanFormatError
from autoplan.planfile.show import summary
from autoplan.strategies.space import Strategy
from autoplan.strategies.zero_state import gathered_dtype
from autoplan.workload import Workload
from tests.conftest import example

GiB = 2**30


def _data_parallel(w: Workload, **param: str) -> dict[str, object]:
    """Pins for data parallelism on a 1-D mesh, each parameter stored whole (and ``param``)."""
    names = [n for n, _ in w.model.named_parameters()]
    return {
        "input:0": "S(0)",
        "target": "S(0)",
        **{n: {"storage": "R", "use": "R", **param} for n in names},
    }


def _zero(plan: autoplan.Plan) -> dict[str, tuple[str, str]]:
    """The parameters whose state is split: (state, grad) on the one axis."""
    return {n: (*p.state.values(), *p.grad.values()) for n, p in plan.params.items() if p.state}


def test_the_planner_splits_the_state_where_memory_needs_it(a100: autoplan.Cluster) -> None:
    """The issue's MLP (6 layers of 1024, batch 1024) on 8 A100s, data parallel: with room,
    the search keeps the parameters whole (it prices no overlap, and the gathers after the
    update cost more than the update saves), but in a budget they do not fit, it splits the
    weights' optimizer state and gradients 8 ways (ZeRO-2), and the plan fits."""
    w = example("mlp", hidden=1024, batch_size=1024, device="meta")
    roomy = w.plan(a100, PlanOptions(mesh_shape=(8,), pin=_data_parallel(w)))
    assert _zero(roomy) == {}
    need = roomy.predicted.peak_memory_bytes
    fraction = need * 0.6 / a100.device.memory_bytes
    tight = PlanOptions(mesh_shape=(8,), pin=_data_parallel(w), memory_fraction=fraction)
    planned = w.plan(a100, tight)
    assert planned.predicted.peak_memory_bytes <= fraction * a100.device.memory_bytes
    split = _zero(planned)
    assert split and all(v == ("S(0)", "S(0)") for v in split.values()), split
    # whole state everywhere (plain data parallelism) does not fit that budget
    whole = PlanOptions(mesh_shape=(8,), pin=_data_parallel(w, state="R"), memory_fraction=fraction)
    with pytest.raises(InfeasiblePlanError):
        w.plan(a100, whole)
    with pytest.raises(InfeasiblePlanError):
        w.baseline(a100, dp=8, tp=1, options=PlanOptions(memory_fraction=fraction))
    zero2 = w.baseline(
        a100, dp=8, tp=1, zero_stage=2, options=PlanOptions(memory_fraction=fraction)
    )
    assert planned.predicted.step_time_s <= zero2.predicted.step_time_s * 1.001


def test_the_planner_splits_the_state_where_it_is_faster(a100: autoplan.Cluster) -> None:
    """Wide layers (8192) on 8 A100s: AdamW's update of a whole weight takes longer than a
    reduce-scatter and all-gather take over the all-reduce, so the weights go ZeRO-2 with
    memory to spare; their biases (32 KiB) stay whole."""
    w = example("mlp", hidden=8192, batch_size=256, device="meta")
    planned = w.plan(a100, PlanOptions(mesh_shape=(8,), pin=_data_parallel(w)))
    assert set(_zero(planned)) == {f"layers.{i}.weight" for i in range(6)}
    dp = w.baseline(a100, dp=8, tp=1)
    assert planned.predicted.step_time_s < dp.predicted.step_time_s
    kinds = {(c.kind, c.phase) for c in planned.collectives if c.tensor.endswith("weight")}
    assert kinds == {("reduce_scatter", "grad_sync"), ("all_gather", "update")}


def test_memory_and_update_are_priced_on_the_shard(a100: autoplan.Cluster) -> None:
    w = example("mlp", hidden=64, batch_size=64, device="meta")
    graph = w.trace()
    weight = next(n for n in graph if n.kind == "param" and n.target == "layers.0.weight")
    pricer = Pricer(a100, (8,), "adamw")
    whole, split = ("R",), ("S(0)",)
    dp = Strategy(whole, ())
    zero1, zero2 = Strategy(whole, (), None, split), Strategy(whole, (), split, split)
    elems, size = 64 * 64, 4
    assert pricer.node_memory(weight, dp) == elems * size * 4  # param, grad, two moments
    # the parameter, its gradient (whole, or its shard), the shard's moments and master copy
    assert pricer.node_memory(weight, zero1) == (elems + elems + elems / 8 * 3) * size
    assert pricer.node_memory(weight, zero2) == (elems + elems / 8 + elems / 8 * 3) * size
    assert pricer.node_time(weight, zero2) < pricer.node_time(weight, dp)
    gathers = pricer.internal(weight, zero2)
    assert [(p.collective.kind, p.phase) for p in gathers] == [("all_gather", "update")]
    assert pricer.internal(weight, dp) == ()


def test_a_plan_writes_the_state_only_where_split(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=64, hidden=32)
    plain = w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin=_data_parallel(w)))
    text = plain.to_json()
    assert '"state"' not in text and '"grad": {\n' not in text.split('"nodes"')[0]
    pins = _data_parallel(w, state="S(0)", grad="S(0)")
    zero2 = w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin=pins))
    params = json.loads(zero2.to_json())["params"]
    assert params["layers.0.weight"]["state"] == params["layers.0.weight"]["grad"] == {"dp": "S(0)"}
    again = autoplan.Plan.from_json(zero2.to_json())
    assert again == zero2 and again.to_json() == zero2.to_json()
    # re-priced from its placements: the same collectives and numbers
    priced = autoplan.estimate(
        again, cpu4, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
    )
    assert priced.collectives == zero2.collectives and priced.predicted == zero2.predicted
    zero1 = w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin=_data_parallel(w, state="S(0)")))
    assert set(_zero(zero1).values()) == {("S(0)",)}
    assert {c.kind for c in zero1.collectives if c.phase == "grad_sync"} == {"all_reduce"}


def test_hand_edits_of_the_state_are_checked(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=64, hidden=32)
    plan = w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin=_data_parallel(w)))
    weight = plan.params["layers.0.weight"]

    def edited(**fields: object) -> autoplan.Plan:
        params = {**plan.params, "layers.0.weight": dataclasses.replace(weight, **fields)}
        return dataclasses.replace(plan, params=params)

    def estimate(p: autoplan.Plan) -> autoplan.Plan:
        return autoplan.estimate(
            p, cpu4, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
        )

    # ZeRO-1 by hand: the state split, the collectives derived (a gather after the update)
    priced = estimate(edited(state={"dp": "S(0)"}))
    gathered = [c for c in priced.collectives if c.phase == "update"]
    assert [(c.kind, c.tensor) for c in gathered] == [("all_gather", "p_model_layers_0_weight")]
    with pytest.raises(PlanFormatError, match=r"layers.0.weight.state is \[dp=S\(1\)\].*S\(0\)"):
        estimate(edited(state={"dp": "S(1)"}))  # dim 0 divides: the state splits along it
    with pytest.raises(PlanFormatError, match="the state's placement"):
        autoplan.Plan.from_json(edited(state={"dp": "S(0)"}, grad={"dp": "S(1)"}).to_json())
    with pytest.raises(PlanFormatError, match="goes with a state placement"):
        autoplan.Plan.from_json(edited(grad={"dp": "S(0)"}).to_json())
    with pytest.raises(PlanFormatError, match=r"state is P on axis dp.*not as partial sums"):
        estimate(edited(state={"dp": "P"}))


@pytest.mark.parametrize(
    ("pin", "message"),
    [
        ({"state": "S(0)"}, "give its storage too"),
        ({"storage": "R", "grad": "S(0)"}, "kept as stored .ZeRO-1. or as its state"),
        ({"storage": "R", "state": "S(1)"}, "with that state and gradient"),
        ({"storage": "R", "zero": 2}, "unknown keys"),
    ],
)
def test_bad_zero_pins_are_refused(
    cpu4: autoplan.Cluster, pin: dict[str, object], message: str
) -> None:
    w = example("mlp", batch_size=64, hidden=32)
    with pytest.raises(AutoplanError, match=message):
        w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin={"layers.0.weight": pin}))


def test_show_says_it_in_words(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=64, hidden=32)
    plan = w.baseline(cpu4, dp=4, tp=1, zero_stage=1)
    text = summary(plan)
    assert "ZeRO-1 state [dp=S(0)]" in text
    assert (
        "ZeRO-1: the optimizer state of 12 parameter(s) (6336 elements) split 4 ways on dp; "
        "gradients all-reduced whole, the updated shards all-gathered after the optimizer step"
    ) in text
    assert "update     all_gather" in text


def _chunk_numel(shape: tuple[int, ...], dim: int, parts: int) -> int:
    """The elements of the largest piece torch.chunk (DTensor's Shard) cuts ``shape`` into."""
    return max(c.numel() for c in torch.empty(shape, device="meta").chunk(parts, dim))


def test_a_state_no_dim_of_which_divides_is_split_unevenly(a100: autoplan.Cluster) -> None:
    """Widths of 12 on 8 ranks: no dim divides, yet the state is split along its largest dim
    as torch.chunk cuts it (Megatron's distributed optimizer shards a padded buffer), not kept
    whole; each rank is priced for the largest piece."""
    w = example("mlp", hidden=12, batch_size=64, device="meta")
    graph = w.trace()
    pricer = Pricer(a100, (8,), "adamw")
    plan = w.baseline(a100, dp=8, tp=1, zero_stage=1)
    for node in graph.params:
        state = plan.params[node.target].state
        assert state == {"dp": "S(0)"}, node.target  # 12 rows: the largest dim, uneven
        strategy = Strategy(("R",), (), None, ("S(0)",))
        elems = math.prod(node.output.shape)
        shard = _chunk_numel(node.output.shape, 0, 8)
        assert shard * 8 > elems  # uneven: the largest piece is more than an eighth
        assert pricer.node_memory(node, strategy) == (2 * elems + 3 * shard) * 4
        # DTensor pads the shards to the largest for its gather (as a 4-rank run issued)
        gathers = [p.collective for p in pricer.internal(node, strategy)]
        assert [(c.kind, c.nbytes) for c in gathers] == [("all_gather", 8 * shard * 4)]
    # a hand-edited uneven state is accepted as the baseline writes it
    again = autoplan.Plan.from_json(plan.to_json())
    priced = autoplan.estimate(
        again, a100, w.model, w.example_inputs, loss_fn=w.loss_fn, example_target=w.example_target
    )
    assert priced.predicted == plan.predicted


def test_a_pipelined_zero1_keeps_a_dp_shard_of_the_state(a100: autoplan.Cluster) -> None:
    """A GPT in 2 stages of 3 data-parallel ranks, whose dims (64, 128, 16) 3 divides none
    of: each stage's memory under ZeRO-1 is the plain one less, for every parameter, its two
    moments made a shard of three with the shard's own copy (float32: 4 bytes each)."""
    cluster = dataclasses.replace(a100, devices_per_node=3).with_nodes(2)
    w = example("gpt", batch_size=12, device="meta")
    options = PlanOptions(num_microbatches=4)
    plain = w.baseline(cluster, dp=3, tp=1, pp=2, options=options)
    zero1 = w.baseline(cluster, dp=3, tp=1, pp=2, zero_stage=1, options=options)
    saved = 0
    for name, param in w.model.named_parameters():
        state = zero1.params[name].state
        assert state, name
        dim = int(state["dp"][2])
        shape = tuple(param.shape)
        saved += (2 * math.prod(shape) - 3 * _chunk_numel(shape, dim, 3)) * 4
    assert plain.stages[0].predicted and zero1.stages[0].predicted
    by_stage = [
        p.predicted.memory_bytes - q.predicted.memory_bytes  # type: ignore[union-attr]
        for p, q in zip(plain.stages, zero1.stages, strict=True)
    ]
    assert sum(by_stage) == pytest.approx(saved, rel=1e-9)
    assert all(b > 0 for b in by_stage)


def test_a_weight_read_only_cast_is_gathered_in_the_cast_dtype() -> None:
    """ZeRO's gather after the update moves a weight in the narrower float dtype that all
    its reads cast it to; any other read, two targets, or a widening cast keep its own."""
    assert gathered_dtype("float32", ["bfloat16", "bfloat16"]) == "bfloat16"
    assert gathered_dtype("float32", ["bfloat16", None]) == "float32"
    assert gathered_dtype("float32", ["bfloat16", "float16"]) == "float32"
    assert gathered_dtype("bfloat16", ["float32"]) == "bfloat16"
    assert gathered_dtype("float32", ["int64"]) == "float32"
    assert gathered_dtype("float32", []) == "float32"
