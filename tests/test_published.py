"""benchmarks/published.py: its table of published runs is well-formed, and a run (shrunk to
a few small layers) is priced end to end with the degrees it states."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autoplan
from benchmarks.published import OPTIONS, build, clusters, figure, row_of
from benchmarks.published_configs import CONFIGS, Model, Published, megatron_flops

TINY_LLAMA = Model("llama", 2, 256, 8, 8, 512, 1024, 128)
TINY_GPT = Model("gpt", 2, 256, 8, 8, 1024, 1024, 128)


def test_every_row_is_well_formed() -> None:
    assert len(CONFIGS) >= 12
    assert len({c.name for c in CONFIGS}) == len(CONFIGS)
    for c in CONFIGS:
        assert c.source.startswith("https://") and "row" in c.source, c.name
        assert c.published > 0 and c.hardware, c.name
        # the degrees multiply to the GPUs, in whole nodes of 8
        assert c.dp * c.tp * c.pp == c.num_gpus and c.num_gpus % 8 == 0, c.name
        # every dp rank runs whole microbatches; a pipeline gets at least one per stage
        assert c.global_batch == c.dp * c.micro_batch * c.num_microbatches, c.name
        assert c.num_microbatches >= c.pp and c.model.num_layers >= c.pp, c.name
        assert c.model.num_heads % c.tp == 0 and c.model.num_kv_heads % c.tp == 0, c.name
        assert c.zero_stage in (0, 1, 2, 3), c.name


def test_megatron_flops_of_a_gpt() -> None:
    # 72 B s L h^2 (1 + s/6h + V/12Lh): Megatron's count for a GPT with a 4h MLP
    m = Model("gpt", 24, 2048, 16, 16, 4 * 2048, 131072, 4096)
    b, s, n, h, v = 192, 4096, 24, 2048, 131072
    expected = 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
    assert megatron_flops(m, b) == pytest.approx(expected)


def _priced_with_its_degrees(config: Published) -> None:
    model, inputs, loss_fn, target = build(config.model, config.global_batch)
    cluster = clusters(config)["datasheet"]
    plan = autoplan.baseline(
        model, inputs, cluster, dp=config.dp, tp=config.tp, zero_stage=config.zero_stage,
        sequence_parallel=config.sequence_parallel, recompute=config.recompute,
        loss_fn=loss_fn, example_target=target, options=OPTIONS,
    )  # fmt: skip
    assert plan.mesh.shape == (config.dp, config.tp)
    assert cluster.num_devices == config.num_gpus
    value = figure(config, plan.predicted.step_time_s)
    assert value > 0 and math.isfinite(value)


def test_a_shrunk_megatron_run_is_priced_with_its_degrees() -> None:
    config = replace(CONFIGS[7], model=TINY_GPT, global_batch=96)  # the 7.1B row's degrees
    assert (config.dp, config.tp, config.zero_stage) == (48, 2, 2)
    _priced_with_its_degrees(config)


@pytest.mark.slow
def test_a_shrunk_torchtitan_run_is_priced_with_its_degrees() -> None:
    config = replace(CONFIGS[2], model=TINY_LLAMA, global_batch=16, micro_batch=2)
    assert (config.dp, config.tp, config.zero_stage) == (8, 8, 3)
    _priced_with_its_degrees(config)


@pytest.mark.slow
def test_a_row_accumulating_gradients_is_extended_from_two_prices() -> None:
    config: Published = replace(CONFIGS[6], model=TINY_GPT)
    assert config.pp == 1 and config.num_microbatches == 4
    row = row_of(config)
    assert "error" not in row
    predicted = float(str(row["predicted"]))
    assert predicted > 0 and math.isfinite(predicted)
    assert row["ratio"] == pytest.approx(predicted / config.published, abs=2e-3)
