"""Buffers that forward updates: batch norm's running statistics (batch norm in training traced
as its reductions, SyncBatchNorm's statistics over a split batch) and counters, written back
after forward. Their training on 4 gloo ranks against one process is in
tests/distributed/cases.py (zoo-cnn-train*, counters-*)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplan
from autoplan import PlanOptions
from autoplan.errors import BufferWriteError, TraceError
from autoplan.graph.capture import capture, export_step
from autoplan.modes import NodeKind
from autoplan.workload import load_workload
from tests.conftest import ROOT

CLUSTER = ROOT / "costmodels" / "cpu-gloo-4.json"


def _cnn(**norm: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        nn.BatchNorm2d(4, **norm),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def test_batch_norm_in_training_writes_its_running_statistics() -> None:
    graph = capture(_cnn(), torch.randn(8, 3, 8, 8), F.cross_entropy, torch.randint(0, 3, (8,)))
    written = [w.buffer for w in graph.writes]
    assert sorted(written) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    ops = [n.op for n in graph if n.kind == NodeKind.OP]
    assert not any("batch_norm" in op for op in ops)  # its reductions, which split by batch
    assert ops.count("aten.mean.dim") == 2  # the mean, then the variance
    # the output reads each written value, then the loss
    (output,) = [n for n in graph if n.kind == NodeKind.OUTPUT]
    assert output.refs[:-1] == tuple(w.value for w in graph.writes)
    assert graph.node(output.refs[-1].name).op == "aten.cross_entropy_loss.default"


@pytest.mark.parametrize(
    ("norm", "shape"),
    [
        (nn.BatchNorm2d(4), (8, 4, 5, 5)),
        (nn.BatchNorm1d(4, momentum=0.3), (6, 4)),
        (nn.BatchNorm1d(4, momentum=0.3), (6, 4, 3)),
        (nn.BatchNorm2d(4, affine=False), (8, 4, 5, 5)),
        (nn.BatchNorm2d(4, track_running_stats=False), (8, 4, 5, 5)),
    ],
)
def test_batch_norm_as_reductions_is_torchs(norm: nn.Module, shape: tuple[int, ...]) -> None:
    # the traced step run in one process (export's module writes the buffers back) against
    # torch's kernel: outputs, gradients and the running statistics after two steps
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 1
    ref = copy.deepcopy(norm)
    traced = export_step(norm, (x,), lambda out, t: (out * t).sum(), x.cos()).module()
    for _ in range(2):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        got, want = traced(xs[0], x.cos()), (ref(xs[1]) * x.cos()).sum()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-5)
    buffers = {n.removeprefix("model."): b for n, b in traced.named_buffers()}
    assert buffers.keys() == dict(ref.named_buffers()).keys()
    for name, want_buffer in ref.named_buffers():
        torch.testing.assert_close(buffers[name], want_buffer, rtol=1e-6, atol=1e-7)


def test_batch_norm_under_bf16_autocast_normalizes_in_float32() -> None:
    # as torch's kernel: a bf16 input (a convolution's, under autocast) normalized in float32,
    # its output bf16 again; the running statistics float32
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), torch.randn(8, 3, 6, 6)
    ref = copy.deepcopy(model)
    traced = export_step(model, (x,), precision="bf16").module()
    got = traced(x)
    with torch.autocast("cpu", torch.bfloat16):
        want = ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    for name, buffer in ref.named_buffers():
        torch.testing.assert_close(dict(traced.named_buffers())[f"model.{name}"], buffer)


def test_eval_batch_norm_stays_one_op_and_writes_nothing() -> None:
    graph = capture(_cnn().eval(), torch.randn(8, 3, 8, 8))
    assert graph.writes == ()
    assert any(n.op == "aten.batch_norm.default" for n in graph)


class _WritesParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x).sum()


class _WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x).sum()


@pytest.mark.parametrize(
    ("model", "named"), [(_WritesParameter(), "lin.weight"), (_WritesInput(), "input 0")]
)
def test_writes_into_parameters_or_inputs_are_refused_by_name(model: nn.Module, named: str) -> None:
    with pytest.raises(TraceError, match=f"writes in place into {named}.*register_buffer"):
        capture(model, (torch.randn(8, 4),))


def test_a_model_writing_buffers_plans_without_pipelines() -> None:
    w = load_workload(ROOT / "tests" / "models" / "counters.py", batch_size=16)
    with pytest.raises(BufferWriteError, match=r"\(tokens_per_expert, calls\).*pipeline=False"):
        w.plan(CLUSTER, PlanOptions(pipeline=True))
    plan = w.plan(CLUSTER)  # pipelines are not weighed
    assert plan.pipeline is None and len(plan.stages) == 1


def test_the_plan_lists_batch_norms_all_reduces_over_the_split_batch() -> None:
    # DDP's split of the batch: each batch norm all-reduces its mean and its variance (one
    # value per channel) in forward, and their gradients in backward; the running statistics
    # written are replicated already
    w = load_workload(ROOT / "tests" / "models" / "zoo.py", model="cnn-train", batch_size=16)
    plan = w.baseline(autoplan.Cluster.load(CLUSTER), dp=4, tp=1)
    per_channel = {32, 64}  # float32 per channel of the two norms (8 and 16 channels)
    reduced = [(c.phase, c.tensor) for c in plan.collectives if c.bytes in per_channel]
    means = {"mean", "mean_1", "mean_2", "mean_3"}
    assert {t for phase, t in reduced if phase == "forward"} == means
    assert len([t for phase, t in reduced if phase == "backward"]) >= 4
    assert not [
        c for c in plan.collectives if c.node == "output" and c.tensor != "cross_entropy_loss"
    ]
    output = plan.nodes["output"]
    assert all(set(spec.values()) == {"R"} for spec in output.inputs)
    assert autoplan.Plan.from_json(plan.to_json()) == plan  # the output's reads, all of them
