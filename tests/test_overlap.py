"""The gradients' reductions that backward hides, and the ZeRO gathers that forward hides, as
the executor issues them."""

from __future__ import annotations

import pytest

import autoplan
from autoplan.costmodel.overlap import (
    AsyncGather,
    AsyncReduction,
    backward_timeline,
    forward_hidden_s,
    hidden_s,
)
from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import PricedStep
from autoplan.estimate import price_stages_ops
from autoplan.graph.capture import capture_microbatches
from tests.conftest import example


def test_backward_runs_the_graph_reversed() -> None:
    ends = backward_timeline(["a", "b", "c"], {"a": 1.0, "b": 2.0, "c": 4.0})
    assert ends == {"c": 4.0, "b": 6.0, "a": 7.0}


def test_collectives_run_one_after_another_and_only_what_outlasts_backward_shows() -> None:
    # ends at 2 + 3 = 5, then max(5, 4) + 1 = 6, then max(6, 9) + 5 = 14: 4 s past backward
    issued = [AsyncReduction(2.0, 3.0), AsyncReduction(4.0, 1.0), AsyncReduction(9.0, 5.0)]
    assert hidden_s(10.0, issued) == pytest.approx(9.0 - 4.0)
    # queued behind the first: 6, then 11
    queued = [AsyncReduction(1.0, 5.0), AsyncReduction(2.0, 5.0)]
    assert hidden_s(10.0, queued) == pytest.approx(9.0)
    assert hidden_s(10.0, [AsyncReduction(10.0, 2.0)]) == 0.0  # ready as backward ends
    assert hidden_s(10.0, []) == 0.0


def _dp_step(cluster: autoplan.Cluster) -> tuple[PricedStep, Pricer]:
    w = example("mlp", batch_size=4096, hidden=2048)
    plan = w.baseline(cluster, dp=8, tp=1)
    graph_for = capture_microbatches(w.model, w.example_inputs, w.loss_fn, w.example_target)
    (step,) = price_stages_ops(plan, graph_for, cluster)
    return step, Pricer(cluster, plan.mesh.shape, "adamw")


def test_a_data_parallel_step_on_gpus_hides_all_but_its_last_buckets(
    a100: autoplan.Cluster,
) -> None:
    step, pricer = _dp_step(a100)
    buckets = [p for _, _, p in step.collectives if p.params]
    assert len(buckets) > 2  # 16 MB weights: several 25 MB buckets
    rest = step.rest
    assert 0.0 < rest.hidden_s < rest.gradients_s
    assert step.time_s == pytest.approx(step.compute_s + step.comm_s - rest.hidden_s)
    # the last bucket holds the first layer's weight, whose gradient backward makes last
    # (its first user, a transpose, does nothing in backward on a GPU): none of it is hidden
    exposed = rest.gradients_s - rest.hidden_s
    assert exposed >= pricer.phased_s(buckets[-1]) * (1 - 1e-9)
    # and an earlier bucket is: each runs while the layers below compute their gradients
    assert exposed < rest.gradients_s - pricer.phased_s(buckets[0])


def test_cpu_ranks_hide_nothing(cpu4: autoplan.Cluster) -> None:
    step, _ = _dp_step(cpu4.with_nodes(2))
    assert step.rest.gradients_s > 0.0
    assert step.rest.hidden_s == 0.0
    assert step.time_s == step.compute_s + step.comm_s


def test_forward_stalls_only_where_a_gather_is_not_done() -> None:
    # gathers end at 2, 3, 7; op 0 (1 s) needs none, op 1 (1 s) gather 0: starts at 2, ends
    # at 3; op 2 (3 s) gather 2: starts at 7, ends at 10: 4 s of 7 exposed (10 - 5 busy)
    forward = [(1.0, []), (1.0, [0]), (3.0, [2])]
    at_start = [AsyncGather(0, s) for s in (2.0, 1.0, 4.0)]
    assert forward_hidden_s(forward, at_start) == pytest.approx(7.0 - 5.0)
    two = [AsyncGather(0, 2.0), AsyncGather(0, 3.0)]
    assert forward_hidden_s([(10.0, []), (1.0, [0, 1])], two) == pytest.approx(5.0)
    # one nobody reads is waited for at the end
    assert forward_hidden_s([(1.0, [])], [AsyncGather(0, 3.0)]) == pytest.approx(1.0)
    assert forward_hidden_s([(1.0, [])], []) == 0.0


def test_a_gather_issued_ahead_starts_when_forward_reaches_its_op() -> None:
    # op 0 (4 s); gather 0 (3 s) issued at op 1's start (4), ends at 7, op 1 (1 s) needs
    # none, op 2 (2 s) waits for it: 7 to 9, 2 s of its 3 exposed (9 - 7 busy)
    forward = [(4.0, []), (1.0, []), (2.0, [0])]
    assert forward_hidden_s(forward, [AsyncGather(1, 3.0)]) == pytest.approx(3.0 - 2.0)
    # issued at forward's start it hides whole behind op 0
    assert forward_hidden_s(forward, [AsyncGather(0, 3.0)]) == pytest.approx(3.0)
    # one issued at the start (0-3), the second at op 1 (4-6), which op 2 waits for: 6 to 8
    queued = [AsyncGather(0, 3.0), AsyncGather(1, 2.0)]
    waits = [(4.0, []), (1.0, []), (2.0, [1])]
    assert forward_hidden_s(waits, queued) == pytest.approx(5.0 - 1.0)


def _zero1_step(cluster: autoplan.Cluster, precision: str | None) -> tuple[PricedStep, int]:
    """A ZeRO-1 MLP on 8 ranks, and the bytes of its update gathers."""
    w = example("mlp", batch_size=4096, hidden=2048)
    options = autoplan.PlanOptions(mixed_precision=precision)
    plan = w.baseline(cluster, dp=8, tp=1, zero_stage=1, options=options)
    graph_for = capture_microbatches(
        w.model, w.example_inputs, w.loss_fn, w.example_target, precision
    )
    (step,) = price_stages_ops(plan, graph_for, cluster)
    gathered = sum(p.collective.nbytes for _, _, p in step.collectives if p.phase == "update")
    return step, gathered


def test_zero1_gathers_while_forward_computes_and_in_bf16_under_it(
    a100: autoplan.Cluster, cpu4: autoplan.Cluster
) -> None:
    """On GPUs the gathers of the updated weights run partly while the next forward
    computes (more is hidden than the gradients' buckets alone); under bf16 the float32
    master weights, which forward reads only cast, are gathered in bf16; CPU ranks hide
    nothing."""
    fp32, fp32_bytes = _zero1_step(a100, None)
    assert fp32.rest.hidden_s > fp32.rest.gradients_s > 0.0
    assert fp32.time_s == pytest.approx(fp32.compute_s + fp32.comm_s - fp32.rest.hidden_s)
    _, bf16_bytes = _zero1_step(a100, "bf16")
    assert bf16_bytes == fp32_bytes // 2  # every weight and bias read through a cast
    cpu, _ = _zero1_step(cpu4.with_nodes(2), None)
    assert cpu.rest.hidden_s == 0.0


def _zero3_step(cluster: autoplan.Cluster, recompute: str) -> PricedStep:
    """A GPT under ZeRO-3 on 8 ranks, every block recomputed in ``recompute``'s mode."""
    w = example("gpt", size="350m", num_layers=2, vocab_size=8192, seq_len=1024, batch_size=64)
    options = autoplan.PlanOptions(recompute=recompute)
    plan = w.baseline(cluster, dp=8, tp=1, zero_stage=3, options=options)
    graph_for = capture_microbatches(w.model, w.example_inputs, w.loss_fn, w.example_target)
    (step,) = price_stages_ops(plan, graph_for, cluster)
    return step


def _seconds(step: PricedStep, pricer: Pricer, phase: str) -> float:
    return sum(pricer.phased_s(p) for _, _, p in step.collectives if p.phase == phase)


def test_zero3_gathers_issued_ahead_run_while_forward_computes(
    a100: autoplan.Cluster, cpu4: autoplan.Cluster
) -> None:
    """ZeRO-3's gathers, issued ahead as the executor issues them, hide behind forward (and,
    recomputed, behind backward with the reductions) on GPUs; CPU ranks hide nothing."""
    pricer = Pricer(a100, (8,), "adamw")
    kept = _zero3_step(a100, "none")
    gathers = _seconds(kept, pricer, "forward")
    assert gathers > 0.0 and _seconds(kept, pricer, "recompute") == 0.0
    reductions = kept.rest.gradients_s
    # more is hidden than the reductions could be alone, and no more than there is
    assert reductions < kept.rest.hidden_s <= reductions + gathers * (1 + 1e-9)
    again = _zero3_step(a100, "full")
    assert 0.0 < _seconds(again, pricer, "recompute") < gathers  # the blocks' alone
    assert again.rest.hidden_s > kept.rest.hidden_s
    assert _zero3_step(cpu4.with_nodes(2), "none").rest.hidden_s == 0.0
