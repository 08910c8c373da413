"""A workload: a model with example inputs, loss and target. Examples expose ``workload()``."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
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
from autoplan.graph.capture import TrainStep, capture, keywords, microbatch, step_args
from autoplan.graph.ir import Graph
from autoplan.modes import BaselineStyle, RecomputeMode
from autoplan.options import PlanOptions, TrainOptions
from autoplan.parallel import Step, parallelize
from autoplan.planfile.schema import Plan


@dataclass(frozen=True)
class Workload:
    """A model with an example batch: ``loss_fn(model(*example_inputs), example_target)`` is
    one step's loss (without ``loss_fn``, the model's output is); inputs given as a mapping
    are passed by name, ``model(**example_inputs)``."""

    model: nn.Module
    example_inputs: Any
    loss_fn: Callable[..., torch.Tensor] | None = None
    example_target: Any = None

    def loss(self, model: nn.Module | None = None, precision: str | None = None) -> torch.Tensor:
        """One step's loss as it is traced: ``loss_fn(model(*example_inputs), example_target)``,
        or the model's own output without a ``loss_fn``, in a mixed ``precision`` (or the
        model's dtypes). ``model`` (a copy, to train apart) defaults to the workload's."""
        model = self.model if model is None else model
        with_loss = self.loss_fn is not None
        args = step_args(model, self.example_inputs, self.example_target, with_loss)
        return TrainStep(model, self.loss_fn, keywords(self.example_inputs), precision)(*args)

    def trace(self, num_microbatches: int = 1, precision: str | None = None) -> Graph:
        """The step traced (`autoplan.graph.capture`) at the shape of one of
        ``num_microbatches`` microbatches, under autocast for a mixed ``precision``: what the
        planner and the baselines place."""
        return capture(
            self.model,
            microbatch(self.example_inputs, num_microbatches),
            self.loss_fn,
            microbatch(self.example_target, num_microbatches),
            precision,
        )

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
        virtual_stages: int = 1,
        zero_stage: int = 0,
        sequence_parallel: bool = False,
        ep: int = 1,
        cp: int = 1,
        recompute: str = RecomputeMode.NONE,
        style: str = BaselineStyle.MEGATRON,
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
            virtual_stages=virtual_stages,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            ep=ep,
            cp=cp,
            recompute=recompute,
            style=style,
            loss_fn=self.loss_fn,
            example_target=self.example_target,
            options=options,
        )

    def parallelize(
        self,
        cluster: Cluster | str | Path,
        *,
        plan: Plan | str | Path | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        options: PlanOptions | None = None,
        train: TrainOptions | None = None,
    ) -> Step:
        """`autoplan.parallelize` of this workload: its model's parameters become DTensors."""
        return parallelize(
            self.model,
            cluster,
            example_inputs=self.example_inputs,
            loss_fn=self.loss_fn,
            example_target=self.example_target,
            plan=plan,
            init_fn=init_fn,
            options=options,
            train=train,
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
    examples that take ``batch_size`` and is reported for those that do not. A file that does
    not import, or a ``workload()`` that raises, is reported with the exception and the line
    of the file where it arose.
    """
    path = Path(path)
    if not path.is_file():
        raise AutoplanError(f"workload file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"autoplan_workload_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise AutoplanError(f"{path}, line {e.lineno}: {e.msg}; fix the workload file") from None
    except Exception as e:  # the user's module: any exception is theirs to see, in one line
        raise AutoplanError(f"{path} could not be imported{_raised(e, path)}") from e
    make = getattr(module, "workload", None)
    if make is None:
        raise AutoplanError(
            f"{path} has no function `workload()`; define one returning autoplan.Workload "
            "(see examples/mlp.py)"
        )
    if not callable(make):
        raise AutoplanError(
            f"{path}: workload is {type(make).__name__}, not a function; define `def "
            "workload(...)` returning autoplan.Workload (see examples/mlp.py)"
        )
    accepted = inspect.signature(make).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise AutoplanError(
            f"{path}: workload() does not take {', '.join(unknown)}; it takes "
            f"{', '.join(accepted) or 'no options'}"
        )
    try:
        result = make(**options)
    except AutoplanError:
        raise
    except Exception as e:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise AutoplanError(
            f"{path}: workload({given}) failed{_raised(e, path)}; check the options (--set)"
        ) from e
    if not isinstance(result, Workload):
        raise AutoplanError(f"{path}: workload() returned {type(result).__name__}, not Workload")
    if not isinstance(result.model, nn.Module):
        raise AutoplanError(
            f"{path}: workload() returned a Workload whose model is "
            f"{type(result.model).__name__}, not a torch.nn.Module"
        )
    return result


def _raised(e: Exception, path: Path) -> str:
    """ " at FILE:LINE: Type: message" for an exception ``e`` raised from the file ``path``
    (the innermost line of that file in its traceback)."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if Path(f.filename).resolve() == path.resolve()
    ]
    where = f" at {path}:{frames[-1].lineno}" if frames else ""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{where}: {type(e).__name__}: {first}" if first else f"{where}: {type(e).__name__}"
