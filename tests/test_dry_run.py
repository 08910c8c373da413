"""The planned step run on fake tensors for every role of a plan, in one process on the fake
process group (autoplan/execute/dry_run.py): an op the executor cannot run is refused at
plan time, named; the zoo's plans run at 8 and 64 GPUs. That the check changes no training
result is tests/test_distributed.py's: every case there trains with it on (the default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import autoplan
from autoplan.errors import UnsupportedOpError
from autoplan.execute import op_calls
from autoplan.execute.dry_run import _refusal, check_plan, check_traced, roles
from autoplan.graph.capture import export_step, microbatch
from autoplan.workload import Workload, load_workload

ROOT = Path(__file__).resolve().parents[1]


def _check(w: Workload, plan: autoplan.Plan) -> list[int]:
    return check_traced(w.model, plan, w.example_inputs, w.example_target, w.loss_fn)


def test_roles_are_pipeline_rows_and_first_middle_last_blocks() -> None:
    assert roles((2, 4), ("dp", "tp")) == [0, 1, 3, 4, 5, 7]
    # 64 ranks, 6 roles: dp's first, a middle and the last row; tp's first and last
    assert roles((32, 2), ("dp", "tp")) == [0, 1, 2, 3, 62, 63]
    # every pipeline row is a role of its own
    checked = roles((4, 2, 8), ("pp", "dp", "tp"))
    assert len(checked) == 4 * 2 * 3
    assert {r // 16 for r in checked} == {0, 1, 2, 3}
    assert roles((1,), ("dp",)) == [0]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).view(-1, 4, 4)
        return torch.bmm(h, h).view(-1, 16)


class _Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class _Squared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, 4, 4)
        return self.out(torch.bmm(h, h).view(-1, 16))


def _without_dtensor_bmm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's crash of issue 33 (``NotImplementedError: Operator ... does not have a
    sharding strategy registered`` from `call_op`), reproduced: DTensor's rule for ``bmm``
    taken away (it has no decomposition either), and the executor made to run it as a DTensor
    op, believing DTensor can (as it believed of ``lift_fresh_copy``)."""
    bmm = torch.ops.aten.bmm.default
    monkeypatch.setattr(op_calls, "LOCAL_OPS", op_calls.LOCAL_OPS - {bmm})
    monkeypatch.setattr(op_calls, "dtensor_runs", lambda op: True)
    propagator = torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator
    for registry in (propagator.op_strategy_funcs, propagator.op_single_dim_strategy_funcs):
        if bmm in registry:
            monkeypatch.delitem(registry, bmm)
    propagator.propagate_op_sharding.cache_clear()


def test_an_op_the_executor_cannot_run_is_refused_at_plan_time(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_without_dtensor_bmm`: the data-parallel plan that runs as it is is refused then,
    before any process trains, with the rank, the op and the module named."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    w = Workload(model, (torch.randn(8, 16),), nn.functional.mse_loss, torch.randn(8, 16))
    plan = w.baseline(cpu4, dp=4, tp=1)
    assert _check(w, plan) == [0, 1, 3]  # bmm of split batches: run locally
    _without_dtensor_bmm(monkeypatch)
    with pytest.raises(UnsupportedOpError) as refused:
        _check(w, plan)
    message = str(refused.value)
    assert "rank 0 " in message and "aten.bmm.default" in message, message
    assert "module '0'" in message and "sharding strategy" in message, message
    assert "{'dp': 'S(0)'}" in message, message  # its planned placements
    assert "pin" in message, message  # what to do


def test_a_planners_plan_runs_on_every_role(cpu4: autoplan.Cluster) -> None:
    w = load_workload(ROOT / "examples/gpt.py", size="tiny", batch_size=8, seq_len=16)
    plan = w.plan(cpu4, options=autoplan.PlanOptions(mesh_shape=(2, 2)))
    assert _check(w, plan) == [0, 1, 2, 3]


def test_a_sequence_parallel_plan_runs_on_every_role(cpu4: autoplan.Cluster) -> None:
    """Its gradient buckets reduce over both axes, in a group made from the mesh's ranks:
    real values, computed for real under the fake mode (zeros would make a group of rank 0
    four times, which new_group refuses)."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="llama", batch_size=8, seq_len=16)
    plan = w.baseline(cpu4, dp=2, tp=2, sequence_parallel=True)
    assert any(len(c.axes) == 2 and c.params for c in plan.collectives)
    assert _check(w, plan) == [0, 1, 2, 3]


def test_a_pipelined_plan_runs_on_every_role(cpu4: autoplan.Cluster) -> None:
    """Each rank's stages run two microbatches through torch's own stage code (forward from
    the buffers they receive into, backward from the gradients they receive), then the
    gradients' reduction and the optimizer step: under 1F1B, and under ZBV, whose stages sit
    in a V (rank 0 holds the first and the last) and whose backward is split in two."""
    w = load_workload(ROOT / "examples/gpt.py", size="tiny", num_layers=4, batch_size=8)
    plan = w.baseline(cpu4, dp=1, tp=2, pp=2, options=autoplan.PlanOptions(num_microbatches=4))
    assert plan.pipeline is not None and _check(w, plan) == [0, 1, 2, 3]
    zbv = autoplan.PlanOptions(num_microbatches=4, schedule="ZBV", virtual_stages=2)
    plan = w.baseline(cpu4, dp=2, tp=1, pp=2, virtual_stages=2, options=zbv)
    assert plan.pipeline is not None and plan.group(len(plan.stages) - 1) == 0
    assert _check(w, plan) == [0, 1, 2, 3]


class _Squash(nn.Module):
    """A layer without parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2


def test_a_stage_without_parameters_runs_without_an_optimizer(cpu4: autoplan.Cluster) -> None:
    """The baseline's second stage holds the parameter-free layers and the loss: its ranks
    build no optimizer (torch's refuses an empty parameter list, which failed the check as
    it would the first step) and step with none, gradient clipping's norm included (theirs
    0 in the all-reduce over "pp")."""
    torch.manual_seed(0)
    model = nn.Sequential(_Up(), _Up(), _Squash(), _Squash())
    w = Workload(model, (torch.randn(8, 16),), nn.functional.mse_loss, torch.randn(8, 16))
    plan = w.baseline(cpu4, dp=2, tp=1, pp=2, options=autoplan.PlanOptions(num_microbatches=2))
    assert plan.pipeline is not None and set(plan.param_stages().values()) == {0}
    assert not any(n.startswith("linear") for n in plan.stages[1].nodes)
    count = plan.pipeline.num_microbatches
    inputs, target = microbatch(w.example_inputs, count), microbatch(w.example_target, count)
    ep = export_step(w.model, inputs, w.loss_fn, target, plan.mixed_precision)
    clipped = autoplan.TrainOptions(max_grad_norm=1.0)
    checked = check_plan(w.model, ep, plan, w.example_inputs, w.example_target, train=clipped)
    assert checked == [0, 1, 2, 3]


def test_an_op_a_later_stage_cannot_run_is_refused(
    cpu4: autoplan.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_without_dtensor_bmm` in a pipeline whose second stage alone runs bmm: the ranks of
    stage 1 are refused (rank 2 is its first), naming the stage, its module and the op; the
    ranks of stage 0, checked first, pass."""
    torch.manual_seed(0)
    model = nn.Sequential(_Up(), _Up(), _Squared())
    w = Workload(model, (torch.randn(8, 16),), nn.functional.mse_loss, torch.randn(8, 16))
    plan = w.baseline(cpu4, dp=2, tp=1, pp=2, options=autoplan.PlanOptions(num_microbatches=2))
    assert [any(n.startswith("bmm") for n in s.nodes) for s in plan.stages] == [False, True]
    assert _check(w, plan) == [0, 1, 2, 3]
    _without_dtensor_bmm(monkeypatch)
    with pytest.raises(UnsupportedOpError) as refused:
        _check(w, plan)
    message = str(refused.value)
    assert message.startswith("rank 2 ") and "stage 1" in message, message
    assert "aten.bmm.default" in message and "module '2'" in message, message
    assert "sharding strategy" in message, message


def test_an_error_torch_wraps_is_told_by_its_cause(cpu4: autoplan.Cluster) -> None:
    """torch's pipeline stage raises its own error from an op's in backward ("Failed to run
    stage backward", the stage's outputs listed): the refusal tells the op's error."""
    model = nn.Sequential(_Up(), _Up(), _Squared())
    w = Workload(model, (torch.randn(8, 16),), nn.functional.mse_loss, torch.randn(8, 16))
    plan = w.baseline(cpu4, dp=2, tp=1, pp=2, options=autoplan.PlanOptions(num_microbatches=2))
    op = NotImplementedError("Operator aten.mm.default does not have a sharding strategy")
    try:
        raise RuntimeError("\n  Failed to run stage backward:\n  Stage output: ...") from op
    except RuntimeError as wrapped:
        message = _refusal(3, plan, wrapped)
    assert message.startswith("rank 3 (stage 1) "), message
    assert "NotImplementedError: Operator aten.mm.default" in message, message
    assert "outside the traced forward" in message, message
    # no op of the plan to pin replicated: the advice is another plan, or a report
    assert "pin" not in message and "--stages" in message, message


# the zoo's attention has 2 key-value heads: tensor parallelism of 2. At 64 ranks (dp=32) as
# at 8 (dp=4) the mesh has its 6 roles: first, middle and last on dp, by 2 on tp
ZOO = ("gpt2", "llama", "mistral", "gemma2", "deepseek-v3")


@pytest.mark.slow
@pytest.mark.parametrize("world", [64])
@pytest.mark.parametrize("model", ZOO)
def test_zoo_plans_run_on_fake_tensors(model: str, world: int) -> None:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=world // 8)
    w = load_workload(ROOT / "tests/models/zoo.py", model=model, batch_size=world, seq_len=16)
    # ZeRO-3 where the parameters split evenly (gpt2's fused attention bias does not)
    plan = w.baseline(cluster, dp=world // 2, tp=2, zero_stage=0 if model == "gpt2" else 3)
    assert _check(w, plan) == roles(plan.mesh.shape, plan.mesh.axes)


@pytest.mark.slow
def test_a_llama_built_on_meta_runs_on_fake_tensors() -> None:
    """Llama as benchmarks/real_models.py builds it (on the meta device, transformers'
    defaults): its traced step moves a buffer to ``meta`` by a positional device and detaches
    its empty key-value cache in place, which the executor's first step would have failed on;
    the check found both (Llama 3 8B at 64 GPUs)."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (8, 16), device="meta")
    w = Workload(model, {"input_ids": ids, "labels": ids})
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    plan = w.baseline(cluster, dp=4, tp=2)
    ep = export_step(w.model, w.example_inputs)
    ops = {n.target for n in ep.graph.nodes}
    assert torch.ops.aten.detach_.default in ops and torch.ops.aten.to.device in ops
    assert _check(w, plan) == roles(plan.mesh.shape, plan.mesh.axes)


def test_autoplan_plan_checks_the_step_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`autoplan plan --check-step` runs one rank per role before writing the plan (a
    pipeline's too, its step traced at one microbatch's shape), and writes none that a rank
    cannot run."""
    from autoplan.cli import plan_command
    from autoplan.cli.main import main

    out = tmp_path / "plan.json"
    cluster = str(ROOT / "costmodels/cpu-gloo-4.json")
    args = ["plan", str(ROOT / "examples/gpt.py"), "--cluster", cluster,
            "--set", "size=tiny", "--set", "batch_size=8", "--set", "seq_len=16",
            "--mesh", "2,2", "--check-step", "-o", str(out)]  # fmt: skip
    assert main(args) == 0 and out.exists()
    assert "the step ran on fake tensors for 4 of 4 ranks" in capsys.readouterr().out
    out.unlink()
    pipelined = ["plan", str(ROOT / "examples/mlp.py"), "--cluster", cluster,
                 "--set", "batch_size=16", "--set", "hidden=64", "--stages", "2",
                 "--microbatches", "2", "--check-step", "-o", str(out)]  # fmt: skip
    assert main(pipelined) == 0 and autoplan.Plan.from_json(str(out)).pipeline is not None
    assert "the step ran on fake tensors for 4 of 4 ranks" in capsys.readouterr().out
    out.unlink()

    def refused(*args: object, **kwargs: object) -> list[int]:
        raise UnsupportedOpError("rank 1 cannot run aten.bmm.default")

    monkeypatch.setattr(plan_command, "check_traced", refused)
    assert main(args) == 2 and not out.exists()
    assert "rank 1 cannot run aten.bmm.default" in capsys.readouterr().err
