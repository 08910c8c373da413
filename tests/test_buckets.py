"""Gradient buckets: which gradients share one all-reduce, in which order, and what they cost."""

from __future__ import annotations

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.costmodel.pricer import Pricer
from autoplan.strategies.buckets import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Bucket,
    GradientSync,
    make_buckets,
)
from autoplan.strategies.placement import Collective
from tests.conftest import example, plan_example


def _sync(
    name: str, nbytes: int, axes: tuple[int, ...] = (0,), dtype: str = "float32"
) -> GradientSync:
    return GradientSync(name, dtype, tuple(Collective("all_reduce", (a,), nbytes) for a in axes))


def test_buckets_fill_in_backward_order_up_to_the_cap() -> None:
    syncs = [_sync(f"p{i}", 40) for i in range(5)]
    assert make_buckets(syncs, cap=100, first_cap=100) == [
        Bucket(("p0", "p1"), (0,), 80),
        Bucket(("p2", "p3"), (0,), 80),
        Bucket(("p4",), (0,), 40),
    ]


def test_a_gradient_larger_than_the_cap_has_a_bucket_of_its_own() -> None:
    syncs = [_sync("a", 30), _sync("big", 500), _sync("c", 30)]
    assert [b.params for b in make_buckets(syncs, cap=100, first_cap=100)] == [
        ("a",),
        ("big",),
        ("c",),
    ]


def test_the_first_bucket_of_each_axes_and_dtype_is_smaller_as_in_ddp() -> None:
    syncs = [_sync(f"p{i}", 40) for i in range(4)] + [_sync("h", 20, dtype="bfloat16")]
    buckets = make_buckets(syncs, cap=100, first_cap=50)
    assert [b.params for b in buckets] == [("p0",), ("p1", "p2"), ("p3",), ("h",)]


def test_buckets_hold_one_dtype_and_one_set_of_axes_and_come_in_the_order_they_fill() -> None:
    syncs = [
        _sync("p0", 4),
        _sync("p1", 4, axes=(1,)),
        _sync("p2", 4, axes=(1, 0)),
        _sync("p3", 2, dtype="bfloat16"),
        _sync("p4", 4),
    ]
    assert make_buckets(syncs, cap=100, first_cap=100) == [
        Bucket(("p1",), (1,), 4),
        Bucket(("p2",), (0, 1), 4),
        Bucket(("p3",), (0,), 2),
        Bucket(("p0", "p4"), (0,), 8),  # its last gradient arrives last
    ]


def test_only_all_reduce_gradients_are_bucketed() -> None:
    assert _sync("w", 8, axes=(0, 1)).bucket_axes == (0, 1)
    zero = GradientSync("w", "float32", (Collective("reduce_scatter", (0,), 8),))
    assert zero.bucket_axes is None
    assert GradientSync("w", "float32", ()).bucket_axes is None


def test_a_bucket_over_several_axes_is_one_all_reduce_over_their_ranks_together(
    cpu4: autoplan.Cluster,
) -> None:
    (bucket,) = make_buckets([_sync("a", 4096, axes=(0, 1)), _sync("b", 4096, axes=(0, 1))])
    assert bucket.collective == Collective("all_reduce", (0, 1), 8192)
    pricer = Pricer(cpu4, (2, 2), "adamw")
    flat = Pricer(cpu4, (4,), "adamw")
    assert pricer.collective_s(bucket.collective) == flat.collective_s(
        Collective("all_reduce", (0,), 8192)
    )
    assert pricer.grad_sync_s(_sync("a", 4096, axes=(0, 1))) == flat.grad_sync_s(_sync("a", 4096))


def test_a_data_parallel_plan_on_a_2d_mesh_buckets_over_both_axes(
    cpu4: autoplan.Cluster,
) -> None:
    plan = plan_example("mlp", cpu4, (2, 2), batch_size=65536, hidden=32)
    grad_syncs = [c for c in plan.collectives if c.phase == "grad_sync"]
    assert grad_syncs and all(c.axes == ("dp0", "dp1") and c.params for c in grad_syncs)


def test_the_ilp_prices_a_bucketed_gradient_by_its_bytes_and_a_bucket_by_its_latency(
    cpu4: autoplan.Cluster,
) -> None:
    pricer = Pricer(cpu4, (4,), "adamw")
    latency, per_byte = pricer.bucket_line((0,))
    for nbytes in (FIRST_BUCKET_BYTES, BUCKET_BYTES, 4096):  # the alpha-beta line, exactly
        issued = pricer.collective_s(Collective("all_reduce", (0,), nbytes))
        assert latency + per_byte * nbytes == pytest.approx(issued, rel=1e-12)
    assert latency > 0 and per_byte > 0
    small = _sync("b", 1024)
    assert pricer.grad_sync_s(small) == 1024 * per_byte  # its buckets' latency priced apart
    big = _sync("w", 2 * BUCKET_BYTES)
    assert pricer.grad_sync_s(big) == 2 * BUCKET_BYTES * per_byte
    zero = GradientSync("w", "float32", (Collective("reduce_scatter", (0,), 1024),))
    assert pricer.grad_sync_s(zero) == pricer.collective_s(zero.collectives[0])


def test_a_data_parallel_mlp_reduces_all_its_gradients_in_one_bucket(
    cpu4: autoplan.Cluster,
) -> None:
    plan = plan_example("mlp", cpu4, (4,), batch_size=65536, hidden=32)
    (bucket,) = [c for c in plan.collectives if c.phase == "grad_sync"]
    assert (bucket.kind, bucket.axes, bucket.node, bucket.tensor) == (
        "all_reduce",
        ("dp",),
        "gradients",
        "bucket0",
    )
    # backward produces the last layer's gradients first (each layer's weight is first used
    # by its transpose, then its bias by the addmm)
    expected = [f"layers.{i}.{p}" for i in reversed(range(6)) for p in ("bias", "weight")]
    assert [plan.nodes[n].module for n in bucket.params] == expected
    assert bucket.bytes == sum(4 * (32 * 32 + 32) for _ in range(6))


def test_a_frozen_parameter_has_no_gradient_to_reduce_or_store(cpu4: autoplan.Cluster) -> None:
    pins = {"input:0": "S(0)", "target": "S(0)"}
    trained = example("mlp", batch_size=64, hidden=32).plan(
        cpu4,
        options=PlanOptions(pin=pins, mesh_shape=(4,)),
    )
    w = example("mlp", batch_size=64, hidden=32)
    w.model.get_parameter("layers.0.weight").requires_grad_(False)
    frozen = w.plan(cpu4, options=PlanOptions(pin=pins, mesh_shape=(4,)))
    assert trained.provenance.graph_fingerprint != frozen.provenance.graph_fingerprint

    def bucketed(plan: autoplan.Plan) -> set[str]:
        return {plan.nodes[p].module for c in plan.collectives for p in c.params}

    assert "layers.0.weight" in bucketed(trained)
    assert bucketed(frozen) == bucketed(trained) - {"layers.0.weight"}
    # its optimizer state is not stored, 32 x 32 floats x 2 AdamW moments, nor its slice of
    # its bucket's buffer, nor its gradient made (which counts as far as the step's peak
    # holds it)
    saved = trained.predicted.peak_memory_bytes - frozen.predicted.peak_memory_bytes
    assert 32 * 32 * 4 * 3 <= saved <= 32 * 32 * 4 * 4
