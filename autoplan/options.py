"""The options, one frozen, validated dataclass per concern, as torchtitan passes one job
config: `PlanOptions` for planning (the API, the command line, `autoplan.parallelize` and
`autoplan.baseline` take them) and `TrainOptions` for training at run time
(`autoplan.parallelize`, `Workload.parallelize` and `autoplan run`).

Options that need the model or the cluster to be checked (a mesh shape against the device
count, pins against parameter names, microbatches against the batch) are checked where those
are at hand; everything else is checked here, when the options are made.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoplan.costmodel.pricer import OPTIMIZER_STATE
from autoplan.errors import AutoplanError
from autoplan.graph.cut import DEFAULT_MAX_LAYERS
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import frees_activations
from autoplan.modes import Precision, RecomputeMode, ReduceDtype, Schedule, parse_mode
from autoplan.pins import Pin
from autoplan.precision import check_precision
from autoplan.progress import OnProgress
from autoplan.schedules import MULTI_STAGE, V_SHAPED, check_schedule, v_refusal
from autoplan.strategies.float32_grads import check_reduce_dtype


@dataclass(frozen=True)
class PlanOptions:
    """How `autoplan.plan` searches. Every field has a default: ``PlanOptions()`` searches
    everything the cluster allows."""

    mesh_shape: tuple[int, ...] | None = None
    """Pins the logical mesh (of each stage, when pipelined), e.g. ``(2, 2)``. None tries the
    flat mesh and the 2-D meshes whose inner axis stays inside a node, and keeps the fastest."""

    pin: Mapping[str, Pin] = field(default_factory=dict)
    """Parameter FQN (or ``"input:<i>"``, ``"target"``) -> its placement, or
    ``{"storage": ..., "use": ...}`` (ZeRO-3), with ``"state"`` and ``"grad"`` placements for
    ZeRO-1/2; see `autoplan.pins`."""

    optimizer: str = "adamw"
    """The optimizer: "adamw", "adam", "sgd" or "sgd_momentum". The plan counts its state in
    memory and `autoplan.parallelize` builds it (with `TrainOptions.optimizer_options`); the
    one place the optimizer is named."""

    memory_fraction: float = 0.9
    """The share of each device's memory a plan may use, in (0, 1]."""

    time_limit_s: float = 60.0
    """Seconds each ILP solve may take (a pipeline layer's at most
    `autoplan.search.pipeline_search.LAYER_TIME_LIMIT_S`): one stopped there keeps the best
    plan it found, and a mesh or layer whose ILP found none is skipped with a warning, the
    search going on without it; the plan's ``solver.unproven`` lists both."""

    pipeline: bool | None = None
    """None weighs pipeline stages against one stage on every cluster of several devices
    (never with pins); True requires stages, False rules them out.
    Setting ``num_stages`` or ``num_microbatches`` implies True unless this is False."""

    num_stages: int | None = None
    """Pipeline stages (at least 2, dividing the devices); None searches."""

    num_microbatches: int | None = None
    """Microbatches per step (dividing the batch); None starts from twice the most stages
    tried and, on one node, halves while that is faster."""

    schedule: Schedule | None = None
    """"1F1B", "GPipe", "Interleaved1F1B", "ZeroBubble", "ZBV" or "DualPipeV" (any case;
    docs/schedules.md); None takes the fastest that fits."""

    virtual_stages: int | None = None
    """Stages on each device group under "Interleaved1F1B" or "ZeroBubble" (at least 2;
    without a schedule it implies "Interleaved1F1B"), or "ZBV" and "DualPipeV" (exactly 2);
    None tries 2, 3, ... while the layers allow and the step gets faster (and one under
    "ZeroBubble")."""

    max_layers: int = DEFAULT_MAX_LAYERS
    """The step is cut into at most this many layers for the stage search
    (`autoplan.graph.cut`)."""

    mixed_precision: Precision | None = None
    """"bf16" or "fp16": forward and backward compute in that dtype under ``torch.autocast``
    while parameters, gradients and optimizer state stay float32 (`autoplan.precision`; a
    gradient is reduced in float32 at its parameter or in the compute dtype at its cast,
    whichever the plan prices cheaper, unless `reduce_dtype` says); "fp16" trains with dynamic
    loss scaling. "bf16-params": each parameter cast to bf16 where an op reads it and every
    op in bf16, the loss in float32 (FSDP2's ``param_dtype``, Megatron's ``--bf16``). None
    computes in the model's own dtypes."""

    reduce_dtype: ReduceDtype | None = None
    """"fp32": under `mixed_precision`, every trained parameter's gradient is reduced in
    float32 (FSDP2's ``reduce_dtype=torch.float32``, Megatron's
    ``--accumulate-allreduce-grads-in-fp32``; `autoplan.strategies.float32_grads`), never in
    the compute dtype. None lets the planner choose where each is reduced."""

    recompute: RecomputeMode | None = None
    """Activation recomputation (`autoplan.graph.recompute`): "none" keeps every activation
    from forward to backward; "full" recomputes every layer's blocks in backward (Megatron's
    full recomputation); "selective" recomputes only every layer's attention core, from the
    product of queries and keys through softmax to the product with the values (Megatron's
    selective recomputation); "ops" recomputes every layer's blocks but the ops whose outputs
    torchtitan's op-level selective checkpointing saves (attention, every other matrix
    product; `autoplan.graph.saved_ops`), and the planner never chooses it itself. None lets
    the planner choose, layer by layer: the ILP chooses with the strategies how many layers
    recompute and in which mode (selective where it frees activations, or full;
    `autoplan.search.recompute_ilp`), the fastest plan within the memory, which may mix modes;
    a pipeline's layers choose so within the budget of the stage that holds them, and each
    stage keeps the fewest of them that fit the microbatches it holds in flight
    (`autoplan.search.pipeline_search`)."""

    on_progress: OnProgress | None = field(default=None, compare=False)
    """Called as planning goes with an `autoplan.progress.Progress`: ILPs solved of those known
    so far, and the mesh or pipeline (stages, mesh, boundary placement, microbatches) they are
    for. The command line draws it on stderr once planning has run a few seconds. No part of
    the plan."""

    def __post_init__(self) -> None:
        check_budget(self.optimizer, self.memory_fraction)
        object.__setattr__(self, "mixed_precision", check_precision(self.mixed_precision))
        object.__setattr__(
            self, "reduce_dtype", check_reduce_dtype(self.reduce_dtype, self.mixed_precision)
        )
        if self.mesh_shape is not None:
            object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))
        object.__setattr__(self, "pin", types.MappingProxyType(dict(self.pin)))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", check_schedule(self.schedule))
        if self.virtual_stages is not None:
            if self.virtual_stages < 2 or self.schedule not in (None, *MULTI_STAGE):
                raise AutoplanError(
                    f"virtual_stages={self.virtual_stages} (with schedule={self.schedule!r}): "
                    f"give 2 or more, which runs schedule {Schedule.INTERLEAVED} (or "
                    f"{Schedule.ZERO_BUBBLE})"
                )
            object.__setattr__(self, "schedule", self.schedule or Schedule.INTERLEAVED)
            refusal = self.schedule in V_SHAPED and v_refusal(self.schedule, self.virtual_stages)
            if refusal:
                raise AutoplanError(refusal)
        if not self.time_limit_s > 0:
            raise AutoplanError(f"time_limit_s must be > 0 seconds, got {self.time_limit_s}")
        if self.recompute is not None:
            recompute = parse_mode(RecomputeMode, self.recompute, "recompute")
            object.__setattr__(self, "recompute", recompute)
        if self.max_layers < 1:
            raise AutoplanError(f"max_layers must be at least 1, got {self.max_layers}")

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        """The schedules a pipeline may run: `schedule`, or every one."""
        return tuple(Schedule) if self.schedule is None else (self.schedule,)

    def recompute_tries(self, graph: Graph) -> tuple[RecomputeMode, ...]:
        """The recomputation modes to try on ``graph``, in order, until a plan fits: by
        default none, selective where it frees activations (`frees_activations`), full."""
        if self.recompute is not None:
            return (self.recompute,)
        return (
            RecomputeMode.NONE,
            *[RecomputeMode.SELECTIVE] * frees_activations(graph),
            RecomputeMode.FULL,
        )

    @property
    def float32_grads(self) -> bool:
        """Whether every gradient is to be reduced in float32 (`reduce_dtype`)."""
        return self.reduce_dtype == ReduceDtype.FP32

    @property
    def wants_pipeline(self) -> bool | None:
        """`pipeline`, with stage or microbatch counts implying True."""
        if self.pipeline is not False and (self.num_stages or self.num_microbatches):
            return True
        return self.pipeline


def check_budget(optimizer: str, memory_fraction: float) -> None:
    """What every plan's memory depends on: a known optimizer (its state per parameter) and
    the share of device memory a plan may use."""
    if optimizer not in OPTIMIZER_STATE:
        raise AutoplanError(
            f"optimizer {optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE)}"
        )
    if not 0 < memory_fraction <= 1:
        raise AutoplanError(f"memory_fraction must be in (0, 1], got {memory_fraction}")


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class TrainOptions:
    """How a parallel step trains. Every field has a default: ``TrainOptions()`` trains with
    `PlanOptions.optimizer` at torch's settings but a learning rate of 1e-3."""

    optimizer_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimizer `PlanOptions.optimizer` names, e.g. ``{"lr": 3e-4,
    "weight_decay": 0.1}``. Adam and AdamW run torch's fused kernel unless ``foreach=True``,
    SGD runs foreach."""

    make_optimizer: OptimizerFactory | None = field(default=None, compare=False)
    """Builds the optimizer from the step's (DTensor) parameters instead; the plan still
    counts the state of `PlanOptions.optimizer`, so name the closest one there. Not called on
    a rank whose pipeline stages hold no parameter: it steps without an optimizer."""

    max_grad_norm: float | None = None
    """Clips the gradients to this global norm before each optimizer step (as
    ``torch.nn.utils.clip_grad_norm_``); None does not clip."""

    timeout_s: float | None = None
    """The watchdog's limit for one step (`autoplan.execute.watchdog`): a step that runs
    longer, a rank stopped or stuck in a collective, ends the whole job with a message naming
    the ranks. None: ten times the plan's predicted step time, at least 60 s."""

    init_scale: float = 2.0**16
    """fp16 plans' dynamic loss scaling starts at this scale (torch's ``GradScaler``
    semantics and its other defaults)."""

    check_step: bool = True
    """Before the first step, each rank runs its planned step once on fake tensors
    (`autoplan.execute.dry_run`: no memory, no communication), and every rank refuses the plan
    with the same `UnsupportedOpError` if an op cannot run on some rank's placements (its
    seconds are logged, shown with -v; a pipeline's stages run without the messages between
    them). False skips it (`autoplan run --no-check-step`)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "optimizer_options", types.MappingProxyType(dict(self.optimizer_options))
        )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise AutoplanError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise AutoplanError(f"timeout {self.timeout_s:g} s: give a positive number of seconds")
        if not self.init_scale > 0:
            raise AutoplanError(f"init_scale must be > 0, got {self.init_scale}")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body) by field name: what the
    command line's help and the docs show, read from the one place it is written."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for stmt, doc in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(doc.value.value)
    return docs
