"""A workload: a model with example inputs, loss and target. Examples expose ``workload()``."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan.api import plan
from autoplan.baselines import baseline
from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError
from autoplan.estimate import estimate
from autoplan.execute.step import OptimizerFactory
from autoplan.graph.capture import TrainStep, step_args
from autoplan.options import PlanOptions
from autoplan.parallel import Step, parallelize
from autoplan.planfile.schema import Plan


@dataclass(frozen=True)
class Workload:
    """A model with an example batch: ``loss_fn(model(*example_inputs), example_target)`` is
    one step's loss (without ``loss_fn``, the model's output is)."""

    model: nn.Module
    example_inputs: tuple[Any, ...]
    loss_fn: Callable[..., torch.Tensor] | None = None
    example_target: Any = None

    def loss(self, model: nn.Module | None = None) -> torch.Tensor:
        """One step's loss as it is traced: ``loss_fn(model(*example_inputs), example_target)``,
        or the model's own output without a ``loss_fn``. ``model`` (a copy, to train apart)
        defaults to the workload's."""
        model = self.model if model is None else model
        with_loss = self.loss_fn is not None
        args = step_args(model, self.example_inputs, self.example_target, with_loss)
        return TrainStep(model, self.loss_fn)(*args)

    def plan(self, cluster: Cluster | str | Path, options: PlanOptions | None = None) -> Plan:
        """`autoplan.plan` of this workload."""
        return plan(
            self.model,
            self.example_inputs,
            cluster,
            loss_fn=self.loss_fn,
            example_target=self.example_target,
            options=options,
        )

    def baseline(
        self,
        cluster: Cluster | str | Path,
        *,
        dp: int,
        tp: int,
        pp: int = 1,
        zero_stage: int = 0,
        options: PlanOptions | None = None,
    ) -> Plan:
        """`autoplan.baseline` of this workload."""
        return baseline(
            self.model,
            self.example_inputs,
            cluster,
            dp=dp,
            tp=tp,
            pp=pp,
            zero_stage=zero_stage,
            loss_fn=self.loss_fn,
            example_target=self.example_target,
            options=options,
        )

    def parallelize(
        self,
        cluster: Cluster | str | Path,
        *,
        optimizer: str | OptimizerFactory = "adamw",
        optimizer_options: Mapping[str, Any] | None = None,
        plan: Plan | str | Path | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        max_grad_norm: float | None = None,
        options: PlanOptions | None = None,
        timeout_s: float | None = None,
    ) -> Step:
        """`autoplan.parallelize` of this workload: its model's parameters become DTensors."""
        return parallelize(
            self.model,
            cluster,
            example_inputs=self.example_inputs,
            loss_fn=self.loss_fn,
            example_target=self.example_target,
            optimizer=optimizer,
            optimizer_options=optimizer_options,
            plan=plan,
            init_fn=init_fn,
            max_grad_norm=max_grad_norm,
            options=options,
            timeout_s=timeout_s,
        )

    def estimate(self, plan: Plan | str | Path, cluster: Cluster | str | Path) -> Plan:
        """`autoplan.estimate` of a plan made for this workload."""
        return estimate(
            plan,
            cluster,
            self.model,
            self.example_inputs,
            loss_fn=self.loss_fn,
            example_target=self.example_target,
        )


def load_workload(path: str | Path, **options: Any) -> Workload:
    """Import a Python file and call its ``workload(**options)``.

    Options are passed only if the function accepts them, so ``--set batch_size=8`` works for
    examples that take ``batch_size`` and is reported for those that do not.
    """
    path = Path(path)
    if not path.is_file():
        raise AutoplanError(f"workload file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"autoplan_workload_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    make = getattr(module, "workload", None)
    if make is None:
        raise AutoplanError(
            f"{path} has no function `workload()`; define one returning autoplan.Workload "
            "(see examples/mlp.py)"
        )
    accepted = inspect.signature(make).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise AutoplanError(
            f"{path}: workload() does not take {', '.join(unknown)}; it takes "
            f"{', '.join(accepted) or 'no options'}"
        )
    result = make(**options)
    if not isinstance(result, Workload):
        raise AutoplanError(f"{path}: workload() returned {type(result).__name__}, not Workload")
    return result
