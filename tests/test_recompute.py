"""Activation recomputation: chosen where nothing fits without it, priced, written per layer,
read back and shown. (Training with it, on 4 and 2 gloo ranks: tests/test_distributed.py.)"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import autoplan
from autoplan import PlanOptions
from autoplan.cli.main import main
from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import PricedStep, price_step
from autoplan.errors import AutoplanError, InfeasiblePlanError, PlanFormatError
from autoplan.execute.checkpointed import RecomputedRegion, gathered, with_regions
from autoplan.graph.capture import export_step
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import Recompute, attention_core, recompute_layers, recomputed_ops
from autoplan.modes import NodeKind
from autoplan.planfile.check import assignment_of
from autoplan.planfile.show import summary
from autoplan.search.recompute_choice import least
from autoplan.workload import load_workload
from tests.conftest import ROOT, example

GPT = {"size": "small", "num_layers": 2, "batch_size": 4, "seq_len": 64}


@pytest.fixture(scope="module")
def tensor_parallel(cpu4: autoplan.Cluster) -> tuple[autoplan.Plan, autoplan.Plan]:
    """Megatron's tensor-parallel GPT over 4 ranks, without and with full recomputation."""
    w = example("gpt", **GPT)
    return w.baseline(cpu4, dp=1, tp=4), w.baseline(cpu4, dp=1, tp=4, recompute="full")


def test_unknown_modes_are_refused(cpu4: autoplan.Cluster) -> None:
    with pytest.raises(AutoplanError, match="recompute 'some' is not known; use one of none, full"):
        PlanOptions(recompute="some")
    with pytest.raises(AutoplanError, match="recompute 'yes' is not known; use one of none, full"):
        example("gpt", **GPT).baseline(cpu4, dp=4, tp=1, recompute="yes")


def test_every_block_recomputes_and_only_blocks(
    tensor_parallel: tuple[autoplan.Plan, autoplan.Plan],
) -> None:
    plain, full = tensor_parallel
    assert plain.recompute == ()
    assert [layer.layer for layer in full.recompute] == ["blocks.0", "blocks.1"]
    for i, layer in enumerate(full.recompute):
        assert layer.mode == "full"
        # every op of the block, in graph order (the embedding, head and loss stay outside)
        ops = [
            n
            for n, p in full.nodes.items()
            if f"{p.module}.".startswith(f"blocks.{i}.") and p.op not in ("param", "output")
        ]
        assert list(layer.nodes) == ops


def test_recomputation_trades_time_for_memory(
    tensor_parallel: tuple[autoplan.Plan, autoplan.Plan],
) -> None:
    plain, full = tensor_parallel
    assert plain.nodes == full.nodes and plain.params == full.params  # one layout
    assert full.predicted.compute_s > plain.predicted.compute_s
    assert full.predicted.comm_s > plain.predicted.comm_s  # the blocks' all-reduces, again
    assert full.predicted.peak_memory_bytes < plain.predicted.peak_memory_bytes
    # the recomputed forward issues the forward collectives of the recomputed ops again
    recomputed = {n for layer in full.recompute for n in layer.nodes}

    def listed(phase: str, only: set[str] | None = None) -> Counter[tuple[object, ...]]:
        return Counter(
            (c.kind, c.axes, c.bytes, c.node, c.tensor)
            for c in full.collectives
            if c.phase == phase and (only is None or c.node in only)
        )

    assert listed("recompute") == listed("forward", recomputed) and listed("recompute")
    rest = [dataclasses.replace(c, phase="-") for c in full.collectives if c.phase != "recompute"]
    assert rest == [dataclasses.replace(c, phase="-") for c in plain.collectives]


def test_plans_read_back_and_show_it(
    tensor_parallel: tuple[autoplan.Plan, autoplan.Plan], cpu4: autoplan.Cluster, tmp_path: Path
) -> None:
    plain, full = tensor_parallel
    assert '"recompute"' not in plain.to_json()  # plans without it are written as before
    path = tmp_path / "plan.json"
    full.save(str(path))
    assert autoplan.Plan.from_json(str(path)) == full
    assert example("gpt", **GPT).estimate(str(path), cpu4) == full  # re-priced alike
    text = summary(full)
    assert "activation recomputation (full): 2 layer(s), blocks.0, blocks.1 (" in text
    assert "recompute " in text  # its collectives
    assert "recomputation" not in summary(plain)


def _first_param(doc: dict[str, Any]) -> str:
    return next(n for n, p in doc["nodes"].items() if p["op"] == "param")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda doc: {"mode": "some"}, r"recompute\[0\]\.mode.*one of full, selective"),
        (lambda doc: {"nodes": [_first_param(doc)]}, r"recompute\[0\]\.nodes\[0\].*an op node"),
        (lambda doc: {"nodes": []}, r"recompute\[0\]\.nodes"),
        (lambda doc: {"nodes": ["no_such_node"]}, r"an op node"),
    ],
)
def test_malformed_recomputation_is_refused(
    tensor_parallel: tuple[autoplan.Plan, autoplan.Plan],
    edit: Callable[[dict[str, Any]], dict[str, Any]],
    message: str,
) -> None:
    doc = json.loads(tensor_parallel[1].to_json())
    doc["recompute"][0].update(edit(doc))
    with pytest.raises(PlanFormatError, match=message):
        autoplan.Plan.from_json(json.dumps(doc))


def test_ops_between_blocks_recompute(cpu4: autoplan.Cluster) -> None:
    """The MLP's blocks are its Linear layers (``layers.3``); the ReLUs between them recompute
    with them, the loss after the last does not."""
    w = example("mlp")
    found = w.baseline(cpu4, dp=4, tp=1, recompute="full")
    ops = [n for n in w.trace() if n.kind == NodeKind.OP]
    recomputed = [n for layer in found.recompute for n in layer.nodes]
    assert len(found.recompute) == sum(1 for n in ops if n.op == "aten.linear.default") > 2
    assert [n for n in recomputed if "relu" in n] == [n.name for n in ops if "relu" in n.op]
    assert recomputed == [n.name for n in ops[: len(recomputed)]]  # from the first op on


def test_without_blocks_every_op_recomputes(cpu4: autoplan.Cluster) -> None:
    w = load_workload(ROOT / "tests/models/zoo.py", model="cnn", batch_size=8)
    found = w.baseline(cpu4, dp=4, tp=1, recompute="full")
    recomputed = [n for layer in found.recompute for n in layer.nodes]
    assert len(found.recompute) > 1
    assert recomputed == [n.name for n in w.trace() if n.kind == NodeKind.OP]


def test_each_layer_recomputed_costs_time_and_frees_memory(cpu4: autoplan.Cluster) -> None:
    """Time grows with each layer recomputed, and memory falls from the second on (one
    recomputed layer's activations are held while its backward runs): what lets `least`
    find the fewest layers of a pipeline stage that fit by bisection."""
    w = example("gpt", size="small", num_layers=4, batch_size=4, seq_len=64)
    graph = w.trace()
    assignment = assignment_of(w.baseline(cpu4, dp=1, tp=4), graph)

    def price(recompute: Recompute) -> PricedStep:
        return price_step(graph, assignment, Pricer(cpu4, (4,), "adamw", recompute))

    layers = recompute_layers(graph, 16)
    ops = [(layer.name, recomputed_ops(graph, layer)) for layer in layers]
    steps = [price(Recompute.of(graph, ops[:k])) for k in range(len(ops) + 1)]
    assert len(steps) == 5
    assert steps[1].memory_bytes == steps[0].memory_bytes
    for fewer, more in itertools.pairwise(steps):
        assert more.time_s > fewer.time_s
        assert more.memory_bytes < fewer.memory_bytes or fewer is steps[0]

    def fits(limit: float) -> Callable[[int], bool]:
        return lambda k: steps[k].memory_bytes <= limit

    assert least(len(ops), fits(steps[2].memory_bytes)) == 2
    assert least(len(ops), fits(steps[0].memory_bytes)) == 0
    assert least(len(ops), fits(steps[-1].memory_bytes - 1)) is None


@pytest.mark.slow
def test_megatron_gpt_1_7b_fits_only_with_recomputation() -> None:
    """Megatron-LM's 1.7B GPT as Megatron trains it: data parallel over 32 A100s, 16
    sequences of 2048 each, bf16, the A100s' whole memory less the allocator's margin (68
    GiB). Without recomputation it needs 80.3 GiB a device (its gradient buckets' buffers
    and the loss's backward's float32 gradients with the rest), so Megatron recomputes every
    block; the planner, held to data
    parallelism, chooses some blocks to recompute (with the strategies, in its ILP), and is
    faster."""
    a100 = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=4)
    w = example("gpt", size="1.7b", batch_size=512, device="meta", dtype="bfloat16")
    whole = PlanOptions(memory_fraction=1.0)
    with pytest.raises(InfeasiblePlanError, match=r"needs 80\.29 GiB"):
        w.baseline(a100, dp=32, tp=1, options=whole)
    megatron = w.baseline(a100, dp=32, tp=1, recompute="full", options=whole)
    assert len(megatron.recompute) == 24
    params = [n for n, _ in w.model.named_parameters()]
    # Megatron's data parallelism: every parameter and its optimizer state whole (the planner
    # would rather split the state, ZeRO-2, and fit without recomputing)
    replicated = {"storage": "R", "use": "R", "state": "R"}
    pins = {"input:0": "S(0)", "target": "S(0)", **dict.fromkeys(params, replicated)}
    found = w.plan(a100, PlanOptions(mesh_shape=(32,), pin=pins, memory_fraction=1.0))
    recomputed = {layer.layer for layer in found.recompute}
    assert recomputed < {f"blocks.{i}" for i in range(24)} and recomputed
    limit = found.predicted.memory_limit_bytes
    assert megatron.predicted.peak_memory_bytes < found.predicted.peak_memory_bytes <= limit
    assert found.predicted.step_time_s < megatron.predicted.step_time_s


@pytest.mark.slow
def test_the_ilp_mixes_modes_where_no_single_mode_fits(cpu4: autoplan.Cluster) -> None:
    """Eager-attention GPT of 3 blocks on 4 ranks in 0.55% of a device's memory: every
    attention core recomputed does not fit, and the ILP, choosing each block's recomputation
    with the strategies, recomputes some blocks whole and others' cores only."""
    w = example("gpt", size="small", num_layers=3, batch_size=8, seq_len=128, attention="eager")
    options = PlanOptions(mesh_shape=(4,), memory_fraction=0.0055, pipeline=False)
    found = w.plan(cpu4, options)
    assert {layer.layer for layer in found.recompute} == {"blocks.0", "blocks.1", "blocks.2"}
    assert {layer.mode for layer in found.recompute} == {"full", "selective"}
    assert found.predicted.peak_memory_bytes <= found.predicted.memory_limit_bytes
    with pytest.raises(InfeasiblePlanError):
        w.plan(cpu4, dataclasses.replace(options, recompute="selective"))
    again = w.estimate(found, cpu4).predicted  # re-priced alike
    assert (again.step_time_s, again.peak_memory_bytes) == (
        found.predicted.step_time_s,
        found.predicted.peak_memory_bytes,
    )
    assert autoplan.Plan.from_json(found.to_json()) == found


def test_cli_plans_with_recompute_and_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    mlp, cpu4 = ROOT / "examples/mlp.py", ROOT / "costmodels/cpu-gloo-4.json"
    args = ["-q", "plan", str(mlp), "--cluster", str(cpu4), "--set", "hidden=64", "--mesh", "4"]
    assert main([*args, "--recompute", "full", "-o", str(out)]) == 0
    assert main(["show", str(out)]) == 0
    assert "activation recomputation (full): 6 layer(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's refusal, naming the choices
        main([*args, "--recompute", "some", "-o", str(out)])
    assert (
        "invalid choice: 'some' (choose from 'none', 'full', 'selective', 'ops')"
        in capsys.readouterr().err
    )
    # the MLP has no attention to recompute selectively: refused, naming the way out
    assert main([*args, "--recompute", "selective", "-o", str(out)]) != 0
    assert 'the model has none: no softmax between two matrix products. Use recompute="full"' in (
        capsys.readouterr().err
    )


def test_pipelines_recompute_each_stage_and_reprice_alike(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="tiny", num_layers=4, batch_size=8)
    options = PlanOptions(num_stages=2, num_microbatches=4, mesh_shape=(2,), recompute="full")
    found = w.plan(cpu4, options)
    assert [layer.layer for layer in found.recompute] == [f"blocks.{i}" for i in range(4)]
    for layer in found.recompute:  # each layer on one stage
        assert sum(set(layer.nodes) <= set(stage.nodes) for stage in found.stages) == 1
    plain = w.plan(cpu4, dataclasses.replace(options, recompute="none"))
    assert found.stages[0].predicted is not None and plain.stages[0].predicted is not None
    assert found.stages[0].predicted.time_s > plain.stages[0].predicted.time_s
    assert w.estimate(found, cpu4) == found


@pytest.mark.slow
def test_each_pipeline_stage_recomputes_only_what_its_microbatches_in_flight_need() -> None:
    # 4 stages of 2 blocks, 8 microbatches: under 1F1B stage s holds 4 - s of them in flight.
    # In 40 MiB a device the first stage recomputes both its blocks, the second one of its
    # two (the first), the others none
    base = autoplan.Cluster.load(ROOT / "costmodels" / "dgx-a100-80gb.json")
    # 40 MiB, of which 36 the plan may use (no allocator margin)
    device = dataclasses.replace(base.device, memory_bytes=40 * 2**20, allocator_margin=0.0)
    cluster = dataclasses.replace(base, device=device, devices_per_node=4, name="small")
    w = example("gpt", size="small", num_layers=8, batch_size=16, seq_len=64)
    options = PlanOptions(num_stages=4, num_microbatches=8, mesh_shape=(1,))
    found = w.plan(cluster, options)

    def recomputed(plan: autoplan.Plan) -> list[list[str]]:
        return [
            [la.layer for la in plan.recompute if set(la.nodes) <= set(stage.nodes)]
            for stage in plan.stages
        ]

    assert recomputed(found) == [["blocks.0", "blocks.1"], ["blocks.2"], [], []]
    assert {la.mode for la in found.recompute} == {"full"}
    limit = found.predicted.memory_limit_bytes
    assert all(s.predicted is not None and s.predicted.memory_bytes <= limit for s in found.stages)
    with pytest.raises(InfeasiblePlanError, match="no pipeline fits"):
        w.plan(cluster, dataclasses.replace(options, recompute="none"))
    every = w.plan(cluster, dataclasses.replace(options, recompute="full", schedule="1F1B"))
    assert recomputed(every) == [[f"blocks.{2 * s}", f"blocks.{2 * s + 1}"] for s in range(4)]
    assert found.predicted.step_time_s < every.predicted.step_time_s
    assert autoplan.Plan.from_json(found.to_json()) == found
    assert w.estimate(found, cluster) == found  # re-priced alike
    assert "activation recomputation (full): 3 layer(s), blocks.0" in summary(found)


def test_a_stage_plans_its_layers_for_the_microbatches_it_holds(cpu4: autoplan.Cluster) -> None:
    # 2 one-block stages of 4 microbatches: the first holds 2 in flight. In 0.28% of each
    # device's memory the first block's fastest plan fits the last stage only, and half the
    # memory holds no plan of it: no pipeline fitted before each stage's layers were also
    # planned with their activations counted once per microbatch the stage holds
    w = example("gpt", **GPT)
    options = PlanOptions(
        num_stages=2, num_microbatches=4, memory_fraction=0.0028, recompute="none"
    )
    found = w.plan(cpu4, options)
    assert found.pipeline is not None and not found.recompute
    limit = found.predicted.memory_limit_bytes
    assert all(s.predicted is not None and s.predicted.memory_bytes <= limit for s in found.stages)


# ---------------------------------------------------------------- selective recomputation


def _eager_gpt2() -> autoplan.Workload:
    """GPT-2 with eager attention and dropout on the attention probabilities."""
    return load_workload(
        ROOT / "tests/models/zoo.py", model="gpt2-dropout", batch_size=8, seq_len=64
    )


def test_attention_cores_of_eager_attention() -> None:
    """Each layer's core runs from the product reading Q and K to the one reading V, through
    the scale, the mask's add, softmax, a cast and dropout; the mask, made outside the layer's
    attention, and the projections stay out."""
    graph = _eager_gpt2().trace()
    core = attention_core(graph)
    layers = recompute_layers(graph, 16)
    found = [recomputed_ops(graph, layer, "selective") for layer in layers]
    found = [ops for ops in found if ops]
    assert len(found) == 2  # one per block
    for ops in found:
        kinds = [graph.node(n).op for n in ops]
        assert kinds == [
            "aten.matmul.default",
            "aten.mul.Tensor",
            "aten.add.Tensor",
            "aten.softmax.int",
            "aten.to.dtype",
            "aten.dropout.default",
            "aten.matmul.default",
        ]
        scores, context = graph.node(ops[0]), graph.node(ops[-1])
        assert {r.name for r in scores.refs}.isdisjoint(core)  # Q and K come from outside
        assert graph.node(ops[-2]).name in {r.name for r in context.refs}
        assert any(graph.users(ops[-1]))  # the context leaves the core
    assert sorted(n for ops in found for n in ops) == sorted(core)


def test_attention_core_of_fused_attention() -> None:
    """GPT's blocks call F.scaled_dot_product_attention: that op is the core."""
    graph = example("gpt", **GPT).trace()
    core = attention_core(graph)
    assert len(core) == 2
    assert {graph.node(n).op for n in core} == {"aten.scaled_dot_product_attention.default"}


def test_selective_without_attention_is_refused(cpu4: autoplan.Cluster) -> None:
    w = example("mlp")
    message = r"recompute=\"selective\" recomputes attention's core .* the model has none"
    with pytest.raises(AutoplanError, match=message):
        w.baseline(cpu4, dp=4, tp=1, recompute="selective")
    with pytest.raises(AutoplanError, match=message):
        w.plan(cpu4, PlanOptions(mesh_shape=(4,), recompute="selective"))


@pytest.fixture(scope="module")
def eager_modes(cpu4: autoplan.Cluster) -> dict[str, autoplan.Plan]:
    """Eager-attention GPT-2, data parallel over 4 ranks, in each recomputation mode."""
    w = _eager_gpt2()
    return {m: w.baseline(cpu4, dp=4, tp=1, recompute=m) for m in ("none", "selective", "full")}


def test_selective_lies_between_none_and_full(eager_modes: dict[str, autoplan.Plan]) -> None:
    """Recomputing the attention cores frees their sequence-squared activations for a part of
    full recomputation's extra compute; full frees more, for more."""
    none, selective, full = (eager_modes[m] for m in ("none", "selective", "full"))
    assert none.nodes == selective.nodes == full.nodes  # one layout
    assert [layer.mode for layer in selective.recompute] == ["selective", "selective"]
    memory = [p.predicted.peak_memory_bytes for p in (none, selective, full)]
    compute = [p.predicted.compute_s for p in (none, selective, full)]
    time = [p.predicted.step_time_s for p in (none, selective, full)]
    assert memory[0] > memory[1] > memory[2]
    assert compute[0] < compute[1] < compute[2]
    assert time[0] < time[1] < time[2]
    # a seventh of a layer's ops, the cheap ones: under half full recomputation's extra work
    assert compute[1] - compute[0] < 0.5 * (compute[2] - compute[0])


def test_selective_plans_read_back_and_show_it(
    eager_modes: dict[str, autoplan.Plan], cpu4: autoplan.Cluster, tmp_path: Path
) -> None:
    selective = eager_modes["selective"]
    path = tmp_path / "plan.json"
    selective.save(str(path))
    doc = json.loads(path.read_text())
    assert [layer["mode"] for layer in doc["recompute"]] == ["selective", "selective"]
    assert autoplan.Plan.from_json(str(path)) == selective
    assert _eager_gpt2().estimate(str(path), cpu4) == selective  # re-priced alike
    assert "activation recomputation (selective): 2 layer(s)" in summary(selective)
    doc["recompute"][1]["mode"] = "full"  # each layer its own mode (a pipeline's stages differ)
    mixed = autoplan.Plan.from_json(json.dumps(doc))
    assert [layer.mode for layer in mixed.recompute] == ["selective", "full"]
    assert "activation recomputation (full/selective): 2 layer(s)" in summary(mixed)


@pytest.mark.slow
def test_planner_recomputes_selectively_when_asked(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="tiny", num_layers=2, batch_size=8)
    found = w.plan(cpu4, PlanOptions(mesh_shape=(4,), recompute="selective"))
    assert [(layer.mode, len(layer.nodes)) for layer in found.recompute] == [("selective", 1)] * 2
    piped = w.plan(
        cpu4, PlanOptions(num_stages=2, num_microbatches=2, mesh_shape=(2,), recompute="selective")
    )
    assert [layer.layer for layer in piped.recompute] == ["blocks.0", "blocks.1"]
    assert {layer.mode for layer in piped.recompute} == {"selective"}


def test_a_core_with_its_mask_between_runs_as_one_region() -> None:
    """GPT's eager attention makes its causal mask between the scores and the softmax: the
    executor runs the mask first, and the core's ops as one region under checkpoint."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) * 0.5
        future = v.new_ones(4, 4).tril() == 0
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ v

    nodes = list(torch.fx.symbolic_trace(attention).graph.nodes)
    names = [n.name for n in nodes]
    core = ["matmul", "mul", "masked_fill", "softmax", "matmul_1"]
    assert names.index("tril") < names.index("masked_fill")  # made between: two runs
    assert (
        sum(isinstance(s, RecomputedRegion) for s in with_regions(nodes, dict.fromkeys(core, 0)))
        == 2
    )
    order = gathered(nodes, dict.fromkeys(core, 0))
    assert sorted(n.name for n in order) == sorted(names)
    steps = with_regions(order, dict.fromkeys(core, 0))
    (region,) = [s for s in steps if isinstance(s, RecomputedRegion)]
    assert [n.name for n in region.nodes] == core
    assert "eq" in region.reads  # the mask, made before it
    ran = [s.name for s in steps if not isinstance(s, RecomputedRegion)]
    assert ran.index("new_ones") < ran.index("tril") < ran.index("eq")  # in their order
    placed: set[str] = set()
    for node in order:  # still in an order that computes each input before its readers
        assert {r.name for r in node.all_input_nodes} <= placed
        placed.add(node.name)


@pytest.mark.slow
def test_by_default_attention_cores_recompute_before_whole_layers(cpu4: autoplan.Cluster) -> None:
    """Eager-attention GPT-2 on 256-token sequences, held to data parallelism: with every
    attention core recomputed it needs 16.8 MiB a device, with every layer 12.9 MiB, and
    without 22.8. By default the planner recomputes the cores where they are enough, faster
    than whole layers, and whole layers where they are not."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="gpt2-dropout", batch_size=8, seq_len=256)
    pins = {"input:0": "S(0)", "input:1": "S(0)", **{n: "R" for n, _ in w.model.named_parameters()}}
    device = cpu4.device.memory_bytes

    def planned(mib: float, recompute: str | None = None) -> autoplan.Plan:
        options = PlanOptions((4,), pin=pins, memory_fraction=mib * 2**20 / device)
        return w.plan(cpu4, dataclasses.replace(options, recompute=recompute))

    with pytest.raises(InfeasiblePlanError):
        planned(20, "none")
    selective, full = planned(20), planned(15)
    assert [layer.mode for layer in selective.recompute] == ["selective"] * 2
    assert [layer.mode for layer in full.recompute] == ["full"] * 2
    assert selective.predicted.step_time_s < full.predicted.step_time_s
    assert planned(20, "full").predicted.step_time_s == full.predicted.step_time_s
    with pytest.raises(InfeasiblePlanError, match="attention core recomputed"):
        planned(15, "selective")


# ---------------------------------------------------------------- op-level recomputation


@pytest.fixture(scope="module")
def llama() -> tuple[autoplan.Workload, Graph]:
    """transformers' Llama (linears without bias, fused attention) and its traced step."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="llama", batch_size=8, seq_len=64)
    return w, w.trace()


def _short(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def test_ops_saves_attention_and_every_other_product(
    llama: tuple[autoplan.Workload, Graph],
) -> None:
    """As torchtitan's op-level selective checkpointing: in each Llama block the first,
    third, fifth and seventh linear (q, v, gate, down: ``mm`` each, counted in order) and
    the attention keep their outputs; k, o and up, the norms, rotary embeddings, SiLU and
    residual adds are recomputed. A linear with a bias runs ``addmm``, always saved: of
    GPT's, whose q, k and v have none, only k recomputes."""
    graph = llama[1]
    layers = [la for la in recompute_layers(graph, 16) if recomputed_ops(graph, la)]
    assert len(layers) == 2
    saved = Recompute.every_layer(graph, layers, "ops").saved
    big = ("aten.linear.default", "aten.scaled_dot_product_attention.default")
    for layer in layers:
        full = recomputed_ops(graph, layer)
        assert recomputed_ops(graph, layer, "ops") == full  # one region, as full's
        kept = [(_short(graph.node(n).op), n in saved) for n in full if graph.node(n).op in big]
        assert kept == [
            ("linear", True),  # q
            ("linear", False),  # k
            ("linear", True),  # v
            ("scaled_dot_product_attention", True),
            ("linear", False),  # o
            ("linear", True),  # gate
            ("linear", False),  # up
            ("linear", True),  # down
        ]
        # everything else of the block recomputes
        assert all(graph.node(n).op in big for n in full if n in saved)
        recomputed = {_short(graph.node(n).op) for n in full if n not in saved}
        assert {"rsqrt", "silu", "add.Tensor", "mul.Tensor"} <= recomputed
    gpt = example("gpt", **GPT).trace()
    gpt_saved = Recompute.every_layer(gpt, recompute_layers(gpt, 16), "ops").saved
    for layer in recompute_layers(gpt, 16):
        full = recomputed_ops(gpt, layer)
        kept = [(gpt.node(n).module_path, n in gpt_saved) for n in full if gpt.node(n).op in big]
        assert [(path.split(".", 2)[-1], saved) for path, saved in kept] == [
            ("attn.q", True),
            ("attn.k", False),
            ("attn.v", True),
            ("attn", True),
            ("attn.proj", True),
            ("mlp.fc", True),
            ("mlp.proj", True),
        ]


def test_ops_runs_each_layer_as_one_region_keeping_saved_outputs(
    llama: tuple[autoplan.Workload, Graph], cpu4: autoplan.Cluster, tmp_path: Path
) -> None:
    """A block recomputed op by op runs as one region, as under full recomputation, its saved
    ops within: their outputs are kept whole and they do not run again, while their inputs
    made in the region (a saved product's) are dropped with the rest; the step is priced
    between no recomputation and full, in memory and in time; the plan writes the mode and
    the saved ops and reads them back."""
    w, graph = llama
    layers = recompute_layers(graph, 16)
    ops = Recompute.every_layer(graph, layers, "ops")
    full = Recompute.every_layer(graph, layers, "full")
    assert len(set(full.layer_of.values())) == len(set(ops.layer_of.values())) == 2
    assert ops.layer_of == full.layer_of and ops.share == full.share == 1 / 2
    # the regions priced are those the executor runs under checkpoint, saved ops within
    nodes = list(export_step(w.model, w.example_inputs, w.loss_fn, w.example_target).graph.nodes)
    layer_of = {op: i for i, (_, _, layer) in enumerate(ops.layers) for op in layer}
    run = with_regions(gathered(nodes, layer_of), layer_of)
    executed = {
        frozenset(n.name for n in s.nodes if n.name in layer_of)
        for s in run
        if isinstance(s, RecomputedRegion)
    }
    priced: dict[int, set[str]] = {}
    for op, region in ops.layer_of.items():
        priced.setdefault(region, set()).add(op)
    assert executed == {frozenset(r) for r in priced.values()}
    assert ops.saved and ops.saved <= set(ops.layer_of)
    assert not any(ops.recomputes(n) or ops.drops(n) for n in ops.saved)
    for name in ops.kept:  # read by an op outside its region
        region = ops.layer_of[name]
        assert any(ops.layer_of.get(u) != region for u in graph.users(name))
    products = [n for n in graph if n.op == "aten.linear.default" and n.name in ops.saved]
    assert len(products) == 2 * 4 and all(
        ops.drops(r.name) for n in products for r in n.refs if ops.recomputes(r.name)
    )
    plan = w.baseline(cpu4, dp=4, tp=1, recompute="ops")
    assert [layer.mode for layer in plan.recompute] == ["ops", "ops"]
    assert [layer.nodes for layer in plan.recompute] == [la[2] for la in ops.layers]
    assert [layer.saved for layer in plan.recompute] == [
        tuple(n for n in la[2] if n in ops.saved) for la in ops.layers
    ]
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert autoplan.Plan.from_json(str(path)) == plan
    assert "activation recomputation (ops): 2 layer(s)" in summary(plan)
    assignment = assignment_of(plan, graph)
    priced = [
        price_step(graph, assignment, Pricer(cpu4, (4,), "adamw", r))
        for r in (Recompute(), ops, full)
    ]
    none, by_ops, whole = priced
    assert none.memory_bytes > by_ops.memory_bytes > whole.memory_bytes
    # a saved op's outputs are kept whole (torch's selective checkpointing stores them),
    # whether or not its users' backward reads them
    kept = Pricer(cpu4, (4,), "adamw", ops)
    for n in products:
        outputs = sum(t.nbytes for t in graph.node(n.name).outputs) / 4  # batch split
        assert kept.activation_memory(n, assignment[n.name]) == outputs
    assert none.time_s < by_ops.time_s < whole.time_s
