"""`autoplan run`'s account of training: a line per step (loss, time, throughput, MFU) and a
summary against the plan's predictions, from plain `StepRecord` lists."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autoplan
from autoplan.cli.progress_line import StepLine
from autoplan.options import TrainOptions
from autoplan.planfile.sections import Predicted
from autoplan.training import (
    Comparison,
    Distance,
    StepRecord,
    compute_dtype,
    distance,
    float32_rounding,
    mfu,
    one_process,
    summarize,
)
from tests.conftest import example, plan_example


@pytest.fixture(scope="module")
def plan(cpu4: autoplan.Cluster) -> autoplan.Plan:
    """A plan predicting 10 ms and 3 MiB per device."""
    planned = plan_example("mlp", cpu4, (4,), batch_size=8, hidden=16)
    predicted = Predicted(0.010, 0.008, 0.002, 3 * 2**20, 2**30)
    return dataclasses.replace(planned, predicted=predicted)


def _records(seconds: list[float]) -> list[StepRecord]:
    return [
        StepRecord(i + 1, 2.0 - 0.1 * i, s, 1000 / s, "tokens/s", 0.2 * 0.012 / s)
        for i, s in enumerate(seconds)
    ]


def test_step_line_has_loss_time_throughput_and_mfu() -> None:
    r = _records([0.012])[0]
    assert r.line(5) == "step 1/5  loss 2.000000      12.0 ms  83,333 tokens/s  MFU 20.00%"
    assert dataclasses.replace(r, step=3, mfu=None).line(12).endswith("tokens/s")


def test_summary_is_the_median_after_the_first_step(plan: autoplan.Plan) -> None:
    # the first step (builds caches) is left out; the median of 12, 16 and 14 ms is 14 ms
    s = summarize(_records([0.5, 0.012, 0.016, 0.014]), plan, None)
    assert s.steps == (2, 3, 4) and s.step_s == pytest.approx(0.014)
    assert s.throughput == pytest.approx(1000 / 0.014)
    assert s.mfu == pytest.approx(0.2 * 0.012 / 0.014)
    assert s.lines() == [
        "summary (median of steps 2-4):",
        "  step time    measured 14.000 ms, predicted 10.000 ms: x1.40 of predicted",
        "  throughput   71,429 tokens/s, MFU 17.14%",
        "  peak memory  not measured (predicted 3.00 MiB per device; on CPU ranks a run of "
        "3 steps or more traces its last)",
    ]


def test_a_traced_step_is_timed_only_where_no_other_is(plan: autoplan.Plan) -> None:
    # the last step's memory traced (slow for it): the median is of the steps between
    records = _records([0.5, 0.012, 0.016, 0.014, 0.090])
    records[-1] = dataclasses.replace(records[-1], peak_bytes=4.5 * 2**20)
    assert records[-1].line(5).endswith("memory traced: 4.50 MiB")
    s = summarize(records, plan, 4.5 * 2**20)
    assert s.steps == (2, 3, 4) and s.step_s == pytest.approx(0.014)
    assert s.lines()[3] == (
        "  peak memory  measured 4.50 MiB (MemTracker's peak of live tensors over the last "
        "step, the largest rank), predicted 3.00 MiB: x1.50 of predicted"
    )
    alone = [dataclasses.replace(_records([0.020])[0], peak_bytes=2**20)]
    assert summarize(alone, plan, 2**20).steps == (1,)


def test_summary_of_one_step_with_measured_memory(plan: autoplan.Plan) -> None:
    s = summarize(_records([0.020]), plan, 6 * 2**20)
    assert s.lines()[0] == "summary (step 1):"
    assert s.lines()[1].endswith("x2.00 of predicted")
    assert s.lines()[3] == (
        "  peak memory  measured 6.00 MiB (torch.cuda.max_memory_allocated, the largest rank), "
        "predicted 3.00 MiB: x2.00 of predicted"
    )


def test_mfu_is_flops_over_the_clusters_peak(cpu4: autoplan.Cluster) -> None:
    peak = cpu4.peak_flops("float32") * cpu4.num_devices
    assert mfu(peak / 2, 1.0, cpu4, "float32") == pytest.approx(0.5)
    model = example("mlp", batch_size=2, hidden=4).model
    assert compute_dtype(model, None) == "float32"
    assert compute_dtype(model, "bf16") == "bfloat16"


def test_step_line_prints_plain_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    line = StepLine(2)
    for r in _records([0.012, 0.010]):
        line(r)
    line.end()
    assert capsys.readouterr().out.splitlines() == [r.line(2) for r in _records([0.012, 0.010])]


def test_step_line_redraws_one_line_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    line = StepLine(4)
    line.redraw = True  # as on a terminal
    for r in _records([0.012, 0.010]):
        line(r)
    line.end()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.endswith("\n")
    assert out.startswith("\r[#####...............] step 1/4")
    assert f"\r[##########..........] {_records([0.012, 0.010])[1].line(4)}\x1b[K\n" in out


def test_the_check_allows_what_float32_rounding_alone_makes() -> None:
    """cpmant's 4 ranks against one process (`autoplan run --check`): past 1e-5, but within
    twice how far one process in float32 is from one in float64 (measured: 7.7e-5, 2.0e-4)."""
    plain = Comparison(3.81e-6, 9.63e-5, mixed=False, update=3e-3)
    assert not plain.ok and "(tolerance 1e-5): FAILED" in str(plain)
    named = dataclasses.replace(plain, worst="h.0.attn.bias")
    assert str(named).endswith("FAILED (largest at h.0.attn.bias)")
    rounded = dataclasses.replace(plain, rounding=Distance(7.7e-5, 2.0e-4, 1e-3))
    assert rounded.ok and rounded.tolerances == (1.54e-4, 4e-4)
    assert "largest parameter difference 9.63e-05 (tolerance 4.0e-04) or" in str(rounded)
    assert not dataclasses.replace(rounded, param=5e-4).ok
    # rounding under 5e-6 leaves the tolerance at 1e-5
    assert dataclasses.replace(plain, rounding=Distance(1e-7, 2e-6, 0.0)).tolerances == (1e-5, 1e-5)


def test_the_check_allows_rounding_that_adam_amplifies_in_a_few_weights() -> None:
    """focalnet's 4 ranks against one process: a few weights with gradients near zero, which
    Adam moves by up to a full step, differ by more than one process's rounding makes them;
    each tensor's update as a whole is within twice rounding's (measured: 1.4e-3 against
    2.6e-3 in float64). A tensor updated wrongly differs by its whole update."""
    focal = Comparison(3e-8, 3.25e-5, False, Distance(1.9e-8, 1.1e-5, 2.6e-3), update=1.4e-3)
    assert focal.ok
    assert "relative difference of a tensor's update 1.40e-03 (tolerance 5.2e-03)" in str(focal)
    assert not dataclasses.replace(focal, update=0.5).ok  # one tensor half wrong
    assert not dataclasses.replace(focal, loss=1e-3).ok  # the losses must still agree


def test_a_run_is_measured_by_its_largest_difference_and_its_worst_tensor() -> None:
    initial = {"a": torch.zeros(4), "b": torch.zeros(2)}
    reference = ([1.0, 0.5], {"a": torch.tensor([1.0, 1.0, 1.0, 1.0]), "b": torch.ones(2)})
    run = ([1.0, 0.5 + 1e-6], {"a": torch.tensor([1.0, 1.0, 1.0, 1.1]), "b": torch.zeros(2)})
    found, worst = distance(run, reference, initial)
    assert worst == "b" and found.param == pytest.approx(1.0)
    assert found.update == pytest.approx(1.0)  # b's update is all missing
    assert found.loss == pytest.approx(1e-6)


def _float32_only(module: object, args: tuple[torch.Tensor, ...]) -> None:
    if args[0].dtype == torch.float64:
        raise RuntimeError("no float64 kernel")


def test_float32_rounding_is_measured_against_float64() -> None:
    from tests.models import dropout

    w = example("mlp", batch_size=8, hidden=8)
    sgd = TrainOptions(optimizer_options={"lr": 1e-2})
    reference = one_process(lambda: w, 3, "sgd", sgd)
    found = float32_rounding(lambda: w, 3, "sgd", sgd, reference)
    assert found is not None and 0 < max(found.loss, found.param) < 1e-6  # float32's digits
    assert 0 < found.update < 1e-3  # relative to each tensor's update
    # without float64 kernels (grouped matmuls), by the same steps on the batch reversed
    narrow = example("mlp", batch_size=8, hidden=8)
    narrow.model.register_forward_pre_hook(_float32_only)
    reference = one_process(lambda: narrow, 3, "sgd", sgd)
    reversed_only = float32_rounding(lambda: narrow, 3, "sgd", sgd, reference)
    assert reversed_only is not None and 0 < max(reversed_only.loss, reversed_only.param) < 1e-6
    # a model that draws random numbers draws others in float64: no measure of rounding
    random = dropout.workload(batch_size=8, hidden=8, p=0.5)
    reference = one_process(lambda: random, 2, "sgd", sgd)
    assert float32_rounding(lambda: random, 2, "sgd", sgd, reference) is None
