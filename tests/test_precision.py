"""Mixed precision (autoplan/precision.py): the step traced under autocast, priced with its
casts and bf16 activations over float32 master weights, recorded in the plan and shown; the
loss scaler's arithmetic. Training against one process under autocast is in
tests/distributed/cases.py (the "-bf16" and "-fp16" cases)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import autoplan
from autoplan import PlanOptions
from autoplan.api import plan_graph
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import AutoplanError, PlanFormatError, TraceError
from autoplan.graph import capture as capture_module
from autoplan.graph.capture import capture
from autoplan.graph.ir import Graph, NodeKind
from autoplan.planfile.sections import CollectivePlan
from autoplan.planfile.show import summary
from autoplan.precision import LossScaler
from autoplan.strategies.float32_grads import weight_copies
from autoplan.strategies.placement import R
from autoplan.strategies.space import Strategy
from autoplan.workload import Workload, load_workload
from tests.conftest import ROOT, example

CAST = "aten._to_copy.default"
VIEW = "aten.view.default"


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(AutoplanError, match="mixed precision 'fp8' is not known"):
        PlanOptions(mixed_precision="fp8")
    assert PlanOptions().mixed_precision is None


def test_the_step_is_traced_with_autocasts_casts() -> None:
    """Parameters stay float32 (the master weights); each is cast to bf16 where a matmul reads
    it; the matmuls compute in bf16 and the loss in float32, as autocast runs them."""
    w = example("mlp", batch_size=8, hidden=16, num_layers=2)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target, "bf16")
    assert graph.precision == "bf16"
    assert {p.output.dtype for p in graph.params} == {"float32"}
    linears = [n for n in graph if n.op == "aten.linear.default"]
    assert linears and {n.output.dtype for n in linears} == {"bfloat16"}
    casts = [n for n in graph if n.op == CAST]
    cast_params = {graph.node(n.refs[0].name).target for n in casts if n.refs}
    assert {p.target for p in graph.params} <= cast_params
    loss = next(n for n in graph if n.op == "aten.mse_loss.default")
    assert loss.output.dtype == "float32"
    plain = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    assert plain.fingerprint != graph.fingerprint and not any(n.op == CAST for n in plain)


def test_bf16_params_casts_each_parameter_once_and_computes_every_op_in_bf16(
    cpu4: autoplan.Cluster,
) -> None:
    """The bf16-params mode (FSDP2's param_dtype, Megatron's --bf16): each float32 parameter
    is cast to bf16 once, just before the op that reads it (a tied one before each of its two
    readers); every op then computes in bf16, the residual stream and the norms too; the
    output goes back to float32 for the loss. Its step is priced below autocast's, which
    casts the activations too, and the plan says how it computes."""
    w = example("gpt", size="tiny", num_layers=2, batch_size=4, seq_len=16)
    w.model.head.weight = w.model.tok_emb.weight  # tied, as GPT-2's
    graph = w.trace(precision="bf16-params")
    assert graph.precision == "bf16-params"
    params = {p.name: p for p in graph.params}
    assert {p.output.dtype for p in params.values()} == {"float32"}
    nodes = list(graph)
    casts = [n for n in nodes if n.op == CAST]
    cast_params = Counter(n.refs[0].name for n in casts if n.refs[0].name in params)
    tied = {n.name for n in graph.params if n.target == "tok_emb.weight"}
    assert len(tied) == 1
    assert cast_params == {p: 1 + (p in tied) for p in params}
    assert len(casts) == sum(cast_params.values()) + 1  # and the logits back to float32
    for cast in casts[:-1]:  # each just before its reader (after its other casts)
        after = next(n for n in nodes[nodes.index(cast) :] if n.op != CAST)
        assert cast.name in {r.name for r in after.refs}, (cast.name, after.name)
        assert cast.module_path == after.module_path  # in its layer, for the stage cut
    computed = [n for n in graph if n.kind == NodeKind.OP and n.op not in (CAST, VIEW)]
    float32 = {n.op for n in computed if n.outputs and n.output.dtype == "float32"}
    assert float32 == {"aten.cross_entropy_loss.default"}, float32
    loss = float(w.loss(precision="bf16-params"))
    assert loss == pytest.approx(float(w.loss()), rel=1e-2)
    autocast = w.trace(precision="bf16")
    plans = [plan_graph(g, cpu4, PlanOptions(mesh_shape=(4,))) for g in (graph, autocast)]
    assert plans[0].predicted.compute_s < plans[1].predicted.compute_s
    assert "bf16 compute on the parameters cast to bf16" in summary(plans[0])
    assert autoplan.Plan.from_json(plans[0].to_json()).mixed_precision == "bf16-params"


@pytest.mark.slow
def test_a_meta_model_traces_as_the_real_one() -> None:
    """Autocast has no meta kernels: a meta model is traced on fake CPU tensors, to the same
    graph as the same model with weights (tied embedding and head included)."""
    options = {"size": "tiny", "num_layers": 1, "batch_size": 2, "seq_len": 16}
    real = example("gpt", **options)
    meta = example("gpt", **options, device="meta")
    got = capture(meta.model, meta.example_inputs, meta.loss_fn, meta.example_target, "bf16")
    want = capture(real.model, real.example_inputs, real.loss_fn, real.example_target, "bf16")
    assert got.fingerprint == want.fingerprint
    assert all(p.is_meta for p in meta.model.parameters())  # put back after the trace


def test_memory_counts_bf16_copies_over_float32_master_weights(cpu4: autoplan.Cluster) -> None:
    """A weight costs 4 bytes, its gradient 4 and AdamW's state 8 (float32), and its bf16 copy,
    kept for backward where the input's gradient needs it (not the first layer's), 2 more;
    the activations between the matmuls are bf16 (the ReLU's output, which its backward
    keeps; not the linear's, which nothing keeps)."""
    w = example("mlp", batch_size=8, hidden=16, num_layers=2)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target, "bf16")
    pricer = Pricer(cpu4, (1,), "adamw")
    whole = Strategy(output=(R,), inputs=())
    weight = next(n for n in graph.params if n.target == "layers.0.weight")
    assert pricer.node_memory(weight, whole) == 16 * 16 * (4 + 4 + 8)
    cast = next(n for n in graph if n.op == CAST and n.refs[0].name == weight.name)
    assert pricer.node_memory(cast, Strategy(output=(R,), inputs=((R,),))) == 0
    second = next(n for n in graph.params if n.target == "layers.1.weight")
    cast = next(n for n in graph if n.op == CAST and n.refs[0].name == second.name)
    assert pricer.node_memory(cast, Strategy(output=(R,), inputs=((R,),))) == 16 * 16 * 2
    linear = next(n for n in graph if n.op == "aten.linear.default")
    assert pricer.node_memory(linear, Strategy((R,), ((R,), (R,), (R,)))) == 0
    relu = next(n for n in graph if n.op == "aten.relu.default")
    assert pricer.node_memory(relu, Strategy((R,), ((R,),))) == 8 * 16 * 2


@pytest.mark.slow
def test_bf16_matmuls_are_priced_at_the_bf16_rate(a100: autoplan.Cluster) -> None:
    """On an A100 (bf16 tensor cores: 16x float32's peak) the same plan's compute in bf16 is
    priced far below float32's; at a batch whose activations outweigh the weights it needs
    less memory (bf16 activations; the weights' bf16 copies add 2 bytes to float32's 16), and
    the plan records and shows its precision. The planner's plans of the two may differ
    (float32's spends less memory on ZeRO, faster for its longer update), so the memory is
    compared on one plan, data parallelism."""
    w = example("gpt", size="small", num_layers=2, batch_size=64, seq_len=256)
    full = w.plan(a100, PlanOptions(mesh_shape=(8,)))
    mixed = w.plan(a100, PlanOptions(mesh_shape=(8,), mixed_precision="bf16"))
    assert full.mixed_precision is None and mixed.mixed_precision == "bf16"
    assert mixed.predicted.compute_s < 0.5 * full.predicted.compute_s
    dp_full, dp_mixed = (
        w.baseline(a100, dp=8, tp=1, options=PlanOptions(mixed_precision=p)) for p in (None, "bf16")
    )
    assert dp_mixed.predicted.peak_memory_bytes < dp_full.predicted.peak_memory_bytes
    assert "mixed precision: bf16" in summary(mixed) and "mixed" not in summary(full)


def test_the_plan_records_its_precision(cpu4: autoplan.Cluster, tmp_path: Path) -> None:
    """Written and read back; a plan in the model's own dtypes has no key for it (plans stay
    byte-identical to those written before mixed precision); estimate traces as the plan."""
    w = example("mlp", batch_size=8, hidden=16, num_layers=2)
    plan = w.plan(cpu4, PlanOptions(mesh_shape=(4,), mixed_precision="fp16"))
    assert autoplan.Plan.from_json(plan.to_json()) == plan
    assert '"mixed_precision": "fp16"' in plan.to_json()
    plain = dataclasses.replace(plan, mixed_precision=None)
    assert "mixed_precision" not in plain.to_json()
    assert autoplan.Plan.from_json(plain.to_json()).mixed_precision is None
    again = w.estimate(plan, cpu4)
    assert again.mixed_precision == "fp16" and again.params == plan.params
    bad = plan.to_json().replace('"mixed_precision": "fp16"', '"mixed_precision": "fp8"')
    with pytest.raises(AutoplanError, match="mixed_precision"):
        autoplan.Plan.from_json(bad)


def test_a_models_own_autocast_region_is_traced_under_mixed_precision() -> None:
    """A region under the model's own autocast is refused in the model's dtypes, and taken
    (its casts inlined) when the whole step runs under autocast."""

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.fc(x).float().sum()

    w = Workload(Own(), (torch.randn(4, 8),))
    refusal = r"torch\.autocast\('cpu', dtype=torch\.bfloat16\).*mixed_precision=\"bf16\""
    with pytest.raises(TraceError, match=refusal):
        capture(w.model, w.example_inputs)
    graph = capture(w.model, w.example_inputs, precision="bf16")
    assert any(n.op == CAST for n in graph)


def test_loss_scaler_backs_off_and_grows_as_grad_scaler() -> None:
    """GradScaler's rule, worked by hand from a scale of 8 growing every 2 good steps: an
    overflow halves the scale and restarts the count."""
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scales = []
    for finite in (False, True, True, True, False, True):
        scaler.update(finite)
        scales.append(scaler.scale)
    assert scales == [4.0, 4.0, 8.0, 8.0, 4.0, 4.0] and scaler.skipped == 2


@pytest.mark.slow
def test_cli_plans_in_mixed_precision(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", str(ROOT / "examples/mlp.py"), "--cluster"]
    args += [str(ROOT / "costmodels/cpu-gloo-4.json"), "--mixed-precision", "bf16"]
    run = [sys.executable, "-m", "autoplan.cli", "-q", *args, "-o", str(out)]
    subprocess.run(run, check=True, capture_output=True, text=True, cwd=ROOT)
    assert autoplan.Plan.from_json(str(out)).mixed_precision == "bf16"
    shown = subprocess.run(
        [sys.executable, "-m", "autoplan.cli", "show", str(out)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert "mixed precision: bf16" in shown.stdout


def test_reduce_dtype_is_checked() -> None:
    with pytest.raises(AutoplanError, match="reduce_dtype 'bf16' is not known; use 'fp32'"):
        PlanOptions(mixed_precision="bf16", reduce_dtype="bf16")
    with pytest.raises(AutoplanError, match=r'needs mixed precision.*mixed_precision="bf16"'):
        PlanOptions(reduce_dtype="fp32")
    assert PlanOptions(mixed_precision="fp16", reduce_dtype="fp32").float32_grads
    assert not PlanOptions(mixed_precision="bf16").float32_grads


def _reductions_at_copies(plan: autoplan.Plan, graph: Graph) -> list[CollectivePlan]:
    """The plan's collectives that sum gradients at a weight copy (in the compute dtype)."""
    copies = weight_copies(graph)
    return [
        c
        for c in plan.collectives
        if c.tensor in copies and c.kind in ("all_reduce", "reduce_scatter")
    ]


@pytest.mark.slow
def test_float32_reduction_prices_4_bytes_a_gradient(a100: autoplan.Cluster) -> None:
    """A 1.3B GPT block on 8 A100s in bf16: the planner gathers each weight after its cast and
    reduce-scatters its gradient in bf16 there; under reduce_dtype="fp32" no gradient is
    reduced at a weight copy, the parameters' reduce-scatters (grad_sync) move float32, twice
    the bytes, and the step costs more. (The two plans may place other parameters, such as
    the vocabulary's, differently.)"""
    w = example("gpt", size="1.3b", num_layers=1, batch_size=8, device="meta")
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target, "bf16")
    free = w.plan(a100, PlanOptions(mesh_shape=(8,), mixed_precision="bf16"))
    fp32 = w.plan(a100, PlanOptions(mesh_shape=(8,), mixed_precision="bf16", reduce_dtype="fp32"))
    in_bf16 = _reductions_at_copies(free, graph)
    assert in_bf16 and {c.kind for c in in_bf16} == {"reduce_scatter"}
    assert _reductions_at_copies(fp32, graph) == []

    copied = {graph.node(c.tensor).refs[0].name for c in in_bf16}  # the parameters cast
    synced = [
        c
        for c in fp32.collectives
        if (c.phase, c.kind) == ("grad_sync", "reduce_scatter") and c.tensor in copied
    ]
    assert sum(c.bytes for c in synced) == 2 * sum(c.bytes for c in in_bf16)
    # in compute and communication (the ILP's objective; the step's time hides what overlaps,
    # which the ILP does not see: docs/status.md)
    cost = fp32.predicted.compute_s + fp32.predicted.comm_s
    assert cost > free.predicted.compute_s + free.predicted.comm_s


def test_baselines_reduce_in_float32_under_the_option(cpu4: autoplan.Cluster) -> None:
    """Megatron's dp=2 tp=2 in bf16 all-reduces its weights' gradients along dp in bf16, at
    their casts; under reduce_dtype="fp32" each split cast keeps its gradient partial along
    dp, reduced in float32 at the parameter; the plan reads back as written."""
    w = example("gpt", size="small", num_layers=2, batch_size=4, seq_len=64)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target, "bf16")
    bf16 = PlanOptions(mixed_precision="bf16")
    free = w.baseline(cpu4, dp=2, tp=2, options=bf16)
    fp32 = w.baseline(cpu4, dp=2, tp=2, options=dataclasses.replace(bf16, reduce_dtype="fp32"))
    assert {c.axes for c in _reductions_at_copies(free, graph)} == {("dp",)}
    assert _reductions_at_copies(fp32, graph) == []
    split = [fp32.nodes[n] for n in weight_copies(graph) if fp32.nodes[n].output["tp"][0] == "S"]
    assert split and all(n.grad == {"dp": "P", "tp": n.output["tp"]} for n in split)
    assert autoplan.Plan.from_json(fp32.to_json()) == fp32
    edited = json.loads(fp32.to_json())  # kept partial along tp too, where the cast is split
    name = next(n for n in weight_copies(graph) if fp32.nodes[n].output["tp"][0] == "S")
    edited["nodes"][name]["grad"]["tp"] = "P"
    with pytest.raises(PlanFormatError, match="not replicated on axis 'tp'"):
        autoplan.Plan.from_json(json.dumps(edited))


@pytest.mark.slow
def test_cli_takes_reduce_dtype(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", str(ROOT / "examples/mlp.py"), "--cluster"]
    args += [str(ROOT / "costmodels/cpu-gloo-4.json"), "-o", str(out)]
    run = [sys.executable, "-m", "autoplan.cli", "-q", *args, "--reduce-dtype", "fp32"]
    refused = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and "needs mixed precision" in refused.stderr
    subprocess.run([*run, "--mixed-precision", "bf16"], check=True, capture_output=True, cwd=ROOT)
    assert autoplan.Plan.from_json(str(out)).mixed_precision == "bf16"


def _traced_alike(graph: Graph) -> list[tuple[object, ...]]:
    """What a plan reads of each op, in order, its inputs by position (names aside): export's
    one ATen trace names a constant's copy ``lift_fresh_copy``, where the retrace made it a
    ``clone``, and the two number the clones after it apart."""
    position = {n.name: i for i, n in enumerate(n for n in graph if n.kind == "op")}
    copies = ("aten.clone.default", "aten.lift_fresh_copy.default")
    return [
        (
            "copy" if n.op in copies else n.op,
            n.module_path,
            n.outputs,
            n.flops,
            n.bwd_flops,
            n.needs_grad,
            tuple(position.get(r.name, r.name) for r in n.refs),
        )
        for n in graph
        if n.kind == "op"
    ]


def test_one_aten_trace_gives_the_two_traces_step(
    monkeypatch: pytest.MonkeyPatch, cpu4: autoplan.Cluster
) -> None:
    """Under autocast the step is exported at the ATen level in one trace
    (`autoplan.torch_private.aten_export`), no longer exported and then retraced by
    ``run_decompositions``: the same ops, casts, shapes, module paths and wiring, and the
    same plan."""
    w = load_workload(ROOT / "examples" / "hf_llama.py", size="small", batch_size=4, seq_len=8)
    ids = w.example_inputs["input_ids"]  # labels apart: export picks either of one tensor
    inputs = {"input_ids": ids, "labels": ids.clone()}
    found = {}
    for once in (False, True):
        monkeypatch.setattr(capture_module, "ATEN_EXPORT", once)
        graph = capture(w.model, inputs, precision="bf16")
        plan = plan_graph(graph, cpu4, PlanOptions(mixed_precision="bf16"))
        found[once] = (_traced_alike(graph), len(list(graph.params)), plan.predicted)
    assert any(op[0] == CAST for op in found[True][0])
    assert found[True] == found[False]
