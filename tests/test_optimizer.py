"""The optimizer a step builds by name: its defaults, its refusals, and the fused kernel's
update with strided gradients equal to torch's default loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autoplan import Cluster, PlanOptions, TrainOptions
from autoplan.errors import AutoplanError
from autoplan.execute.step import make_optimizer
from tests.conftest import example


def test_defaults_and_refusals() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    for name in ("adamw", "adam"):
        fused = make_optimizer(name, params, {})
        assert fused.defaults["fused"] is True and not fused.defaults["foreach"]
        assert fused.defaults["lr"] == 1e-3
    foreach = make_optimizer("adamw", params, {"foreach": True})  # fused would clash
    assert foreach.defaults["foreach"] is True and not foreach.defaults["fused"]
    sgd = make_optimizer("sgd", params, {"lr": 0.1})  # DTensor has no fused SGD rule
    assert sgd.defaults["foreach"] is True and not sgd.defaults["fused"]
    with pytest.raises(AutoplanError, match="optimizer 'lion' is not known"):
        make_optimizer("lion", params, {})


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in column-major memory."""
    return t.t().contiguous().t()


def _trained(params: list[torch.Tensor], grads: list[torch.Tensor], **options: object) -> None:
    opt = make_optimizer("adamw", params, {"lr": 0.1, **options})  # type: ignore[arg-type]
    for _ in range(2):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()


@pytest.mark.usefixtures("one_rank")
def test_fused_update_with_strided_gradients() -> None:
    """The fused default reads a strided gradient right: torch's fused CPU kernel alone gives
    an update off by ~the learning rate here."""
    torch.manual_seed(0)
    start, grad = torch.randn(8, 6), torch.randn(8, 6)
    mesh = init_device_mesh("cpu", (1,))
    want = torch.nn.Parameter(start.clone())
    _trained([want], [grad], foreach=False)  # torch's default loop, contiguous gradient
    plain = torch.nn.Parameter(start.clone())
    _trained([plain], [_strided(grad)])
    sharded = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(1)]))
    local = _strided(grad)
    dt = DTensor.from_local(local, mesh, [Shard(1)], shape=grad.shape, stride=(6, 1))
    assert not dt.to_local().is_contiguous()
    _trained([sharded], [dt])
    assert (plain.detach() - want.detach()).abs().max() < 1e-6
    assert (sharded.detach().full_tensor() - want.detach()).abs().max() < 1e-6


@pytest.mark.usefixtures("one_rank")
def test_the_optimizer_named_in_plan_options_is_counted_and_built(cpu4: Cluster) -> None:
    """`PlanOptions.optimizer` is the one place the optimizer is named: the plan counts its
    state and the step builds it, with `TrainOptions.optimizer_options`."""
    one = dataclasses.replace(cpu4, devices_per_node=1, name="cpu-gloo-1")
    built = {}
    for name in ("sgd", "adamw"):
        w = example("mlp")
        step = w.parallelize(
            one,
            options=PlanOptions(optimizer=name),
            train=TrainOptions(optimizer_options={"lr": 0.1}),
        )
        step(w.example_inputs, w.example_target)
        built[name] = step
    sgd, adamw = built["sgd"], built["adamw"]
    assert type(sgd.optimizer) is torch.optim.SGD and type(adamw.optimizer) is torch.optim.AdamW
    assert sgd.optimizer.defaults["lr"] == 0.1
    assert sgd.plan is not None and adamw.plan is not None
    # AdamW keeps two float32 copies of every parameter that SGD does not
    params = sum(p.numel() for p in example("mlp").model.parameters()) * 4
    extra = adamw.plan.predicted.peak_memory_bytes - sgd.plan.predicted.peak_memory_bytes
    assert extra == pytest.approx(2 * params)


def test_sgd_with_momentum_is_named_so_the_plan_counts_it() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(AutoplanError, match="sgd_momentum"):
        make_optimizer("sgd", params, {"momentum": 0.9})
    assert make_optimizer("sgd_momentum", params, {}).defaults["momentum"] == 0.9
