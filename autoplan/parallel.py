"""`autoplan.parallelize`: plan (or load a plan) and build the train step on every rank."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.export import ExportedProgram

from autoplan.api import plan_graph, refuse_pipelined_writes
from autoplan.cluster.model import Cluster
from autoplan.errors import (
    AutoplanError,
    InfeasiblePlanError,
    MeshShapeError,
    PlanFormatError,
    error_class,
)
from autoplan.estimate import derive
from autoplan.execute import checkpoint
from autoplan.execute.checkpoint import Restored
from autoplan.execute.dry_run import agree_on_check, check_rank
from autoplan.execute.pipeline import PipelineRunner
from autoplan.execute.placements import held_layouts, logical
from autoplan.execute.runtime import (
    Runtime,
    build_runtime,
    clip_gradients,
    plan_mesh,
    train_step,
)
from autoplan.execute.step import ParallelModule
from autoplan.execute.watchdog import watched
from autoplan.graph.capture import export_step, keywords, microbatch
from autoplan.graph.convert import graph_from_export
from autoplan.graph.diagnose import refuse_non_loss
from autoplan.graph.ir import Graph
from autoplan.options import PlanOptions, TrainOptions
from autoplan.planfile.schema import Plan
from autoplan.precision import LossScaler
from autoplan.search.pipeline_search import GraphForMicrobatches
from autoplan.units import fmt_bytes
from autoplan.version import torch_release

log = logging.getLogger(__name__)


class _Planned(logging.Filter):
    """Drops DTensor's warnings about collectives the plan chose and priced: gloo's all-to-all
    run as an all-gather (the cost model prices it so), and a redistribution over two mesh
    axes run as one collective per axis (the plan lists one per axis)."""

    KNOWN = ("CPU process group does not support alltoall yet", "While redistributing from")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.KNOWN)


_PLANNED = _Planned()


def init_distributed(cluster: Cluster) -> None:
    """Join the process group torchrun describes (gloo on CPU clusters, NCCL on GPUs)."""
    for name in ("_collective_utils", "_redistribute"):
        # added once: a logger does not add a filter it has
        logging.getLogger(f"torch.distributed.tensor.{name}").addFilter(_PLANNED)
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise AutoplanError(
            "autoplan.parallelize runs on every rank of a torchrun job; launch with "
            "`autoplan run FILE --nproc N` or `torchrun --nproc-per-node N your_script.py`"
        )
    if cluster.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(cluster.backend)


def _device_type(cluster: Cluster) -> str:
    return "cuda" if cluster.backend == "nccl" else "cpu"


def _agree_on_plan(what: str, make: Callable[[], Plan]) -> Plan:
    """Rank 0 makes the plan (``what`` it does, for errors); every rank gets the same one, or
    the same error, of the same class (never a hang)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", make().to_json())
        except AutoplanError as e:
            box[0] = (type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    status, payload = box[0]
    if status != "ok":
        raise error_class(status)(f"{what} failed on rank 0: {payload}")
    return Plan.from_json(payload)


class Step:
    """``loss = step(inputs, target)``: forward, backward and optimizer step, as the plan says.

    The step is built at `parallelize` when it is given example inputs, else at its first call
    from that batch's shapes (as Alpa does). Built, ``step.module`` is the parallel module (its
    forward returns the loss, and gradients are synchronized as they arrive) for users who
    write their own loop, None for pipelined plans (``step.pipeline``); ``step.optimizer`` the
    optimizer over its DTensor parameters (None on a rank whose pipeline stages hold no
    parameter: nothing to update); ``step.plan`` the plan in use; ``step.steps_done``
    the steps taken (counted by calls, and restored by `load`); ``step.resumed_from`` the
    checkpoint `load` restored (its step, its path, the ranks that saved it).
    """

    def __init__(
        self,
        model: nn.Module,
        cluster: Cluster,
        *,
        loss_fn: Callable[..., torch.Tensor] | None,
        plan: Plan | str | Path | None,
        init_fn: Callable[[nn.Module], None] | None,
        options: PlanOptions,
        train: TrainOptions,
    ) -> None:
        self._model = model
        self.cluster = cluster
        self._loss_fn = loss_fn
        self._given_plan = plan
        self._init_fn = init_fn
        self.options = options
        self.train = train
        self._runtime: Runtime | None = None
        self._keywords: tuple[str, ...] = ()  # the names of inputs passed by keyword
        self.steps_done = 0
        self.resumed_from: Restored | None = None

    @property
    def runtime(self) -> Runtime:
        """What the step runs with (`autoplan.execute.runtime`); an error before it is built."""
        if self._runtime is None:
            raise AutoplanError(
                "the step is not built yet: pass example_inputs to parallelize, or call it once"
            )
        return self._runtime

    @property
    def plan(self) -> Plan | None:
        return None if self._runtime is None else self._runtime.plan

    @property
    def mesh(self) -> DeviceMesh | None:
        return None if self._runtime is None else self._runtime.mesh

    @property
    def module(self) -> ParallelModule | None:
        return None if self._runtime is None else self._runtime.module

    @property
    def pipeline(self) -> PipelineRunner | None:
        return None if self._runtime is None else self._runtime.pipeline

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return None if self._runtime is None else self._runtime.optimizer

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16 plans' loss scaler (``skipped`` counts the steps skipped for overflow)."""
        return None if self._runtime is None else self._runtime.loss_scaler

    @property
    def step_limit_s(self) -> float:
        """The watchdog's limit for one step, set from the plan when built."""
        return 0.0 if self._runtime is None else self._runtime.step_limit_s

    @property
    def flops(self) -> float:
        """The model's FLOPs in one step, forward and backward of the whole batch, without
        recomputation (what MFU counts); 0.0 before the step is built."""
        return 0.0 if self._runtime is None else self._runtime.flops

    @property
    def max_grad_norm(self) -> float | None:
        return self.train.max_grad_norm

    def build(self, example_inputs: Any, example_target: Any) -> None:
        """Trace, plan (or check the given plan) and build what the step runs with."""
        init_distributed(self.cluster)
        check_world(self.cluster, dist.get_world_size())
        self._keywords = keywords(example_inputs)
        given = self._given_plan
        if given is not None and not isinstance(given, Plan):
            given = Plan.from_json(str(given))
        precision = given.mixed_precision if given is not None else self.options.mixed_precision
        ep = export_step(self._model, example_inputs, self._loss_fn, example_target, precision)
        refuse_non_loss(ep, self._model, self._loss_fn is not None)  # a step trains a loss
        graph = graph_from_export(ep, precision)
        flops = sum(n.flops + n.bwd_flops for n in graph)  # of the whole batch

        def export_microbatch(count: int) -> ExportedProgram:
            if count == 1:  # the whole batch: the step just exported
                return ep
            inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
            return export_step(self._model, inputs, self._loss_fn, target, precision)

        def graph_for(count: int) -> Graph:
            # the graph just traced: rank 0 does not trace the model a second time
            return graph if count == 1 else graph_from_export(export_microbatch(count), precision)

        if given is not None:
            plan = _agree_on_plan(
                "checking the plan",
                lambda: check_given_plan(given, graph_for, self.cluster, self.options),
            )
        else:
            plan = _agree_on_plan(
                "planning", lambda: plan_graph(graph, self.cluster, self.options, graph_for)
            )
        if plan.pipeline is not None:
            refuse_pipelined_writes(graph)  # a pipeline given as a plan
            # stages run one microbatch at a time: the step traced at that shape
            ep = export_microbatch(plan.pipeline.num_microbatches)
            graph = graph_from_export(ep, precision)
        _check_provenance(plan, graph.fingerprint, self.cluster)
        world = dist.get_world_size()
        if len(plan.mesh.ranks) != world:
            raise AutoplanError(
                f"the plan is for {len(plan.mesh.ranks)} devices but this job has {world} ranks; "
                f"launch with --nproc {len(plan.mesh.ranks)} or plan for {world} devices"
            )
        gradless = frozenset(n.name for n in graph if not n.needs_grad)
        mesh = plan_mesh(plan, _device_type(self.cluster))
        if self.train.check_step:  # each rank its own step, on fake tensors; all agree
            agree_on_check(
                functools.partial(
                    check_rank,
                    self._model,
                    ep,
                    plan,
                    example_inputs,
                    example_target,
                    mesh=mesh,
                    optimizer=self.options.optimizer,
                    train=self.train,
                    gradless=gradless,
                )
            )
        self._runtime = build_runtime(
            self._model,
            ep,
            plan,
            mesh,
            self.options.optimizer,
            self.train,
            self._init_fn,
            gradless=gradless,
            flops=flops,
        )

    def __call__(self, inputs: Any, target: Any = None) -> torch.Tensor:
        if self._runtime is None:
            self.build(inputs, target)  # plan from the first batch's shapes, as Alpa does
        run = self.runtime
        if keywords(inputs) != self._keywords:
            raise AutoplanError(
                f"the step was traced with inputs {self._keywords or 'by position'}, got "
                f"{keywords(inputs) or 'inputs by position'}; pass the batch as it was traced"
            )
        with watched(self.steps_done + 1, "forward", run.step_limit_s):
            loss = train_step(run, inputs, target, self.train.max_grad_norm)
        self.steps_done += 1
        return loss

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most ``max_norm``; returns
        the norm before (`autoplan.execute.runtime.clip_gradients`)."""
        return clip_gradients(self.runtime, max_norm)

    def save(self, directory: str | Path, *, keep: int | None = None, extra: Any = None) -> Path:
        """Save a checkpoint on every rank (`autoplan.execute.checkpoint`): each rank writes its
        shards of the parameters, buffers and optimizer state into
        ``directory/step-<steps_done>``, with the step count, rank 0's random state and
        ``extra`` (JSON: a data loader's position). Keeps the newest ``keep`` checkpoints (all
        if None). Returns the checkpoint's path."""
        optimizer = self._built("save")
        layouts = held_layouts(self.runtime.plan)
        return checkpoint.save(
            directory,
            self._model,
            optimizer,
            self.steps_done,
            keep=keep,
            extra=extra,
            layouts=layouts,
        )

    def load(self, directory: str | Path, *, missing_ok: bool = False) -> Restored | None:
        """Load the newest checkpoint in ``directory`` (or the checkpoint ``directory``) on
        every rank, saved under this plan or any other plan of the same model; returns its
        step count and ``extra``, and continues counting from there. With ``missing_ok``,
        a directory without a checkpoint loads nothing and returns None."""
        optimizer = self._built("load")
        layouts = held_layouts(self.runtime.plan)
        restored = checkpoint.load(
            directory, self._model, optimizer, missing_ok=missing_ok, layouts=layouts
        )
        if restored is not None:
            self.steps_done = restored.step
            self.resumed_from = restored
            self.runtime.zero.gather()  # ZeRO-1/2: the shards loaded, the whole parameters
        return restored

    def export(self, path: str | Path) -> None:
        """Write the whole parameters and buffers as one ``torch.save`` file (rank 0 writes
        it), which ``model.load_state_dict(torch.load(path))`` reads in one process."""
        checkpoint.export(path, self.state_dict())

    def _built(self, action: str) -> torch.optim.Optimizer | None:
        if self._runtime is None:
            raise AutoplanError(
                f"cannot {action} a step that is not built yet: pass example_inputs to "
                f"parallelize, or {action} after the first step"
            )
        return self._runtime.optimizer

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded parameters and buffers (gathered on every rank)."""
        if self._runtime is None:
            return {k: v.detach().clone() for k, v in self._model.state_dict().items()}
        if self._runtime.pipeline is not None:
            return self._runtime.pipeline.state_dict()
        assert self._runtime.module is not None
        self._runtime.zero.wait()  # ZeRO-1/2's gathers still in flight after the last step
        layouts = held_layouts(self._runtime.plan)  # in the model's order (placements.py)
        return {
            k: (logical(v, layouts[k]) if k in layouts else v).full_tensor().detach().clone()
            if isinstance(v, DTensor)
            else v.detach().clone()
            for k, v in self._runtime.module.state_dict().items()
        }


def check_given_plan(
    plan: Plan | str | Path,
    graph_for: GraphForMicrobatches,
    cluster: Cluster,
    options: PlanOptions,
) -> Plan:
    """A plan given to train with, checked against the model and ``cluster`` (it must be the
    cluster it was made for), its collectives and buckets derived from its placements
    (`autoplan.estimate.derive`). ``graph_for(count)``: the step traced at ``count``
    microbatches."""
    given = plan if isinstance(plan, Plan) else Plan.from_json(str(plan))
    derived = derive(
        given,
        graph_for,
        cluster,
        optimizer=options.optimizer,
        memory_fraction=options.memory_fraction,
    )
    _check_cluster(given, cluster)
    _check_fits(derived, cluster, options.memory_fraction)
    return derived


def _check_fits(plan: Plan, cluster: Cluster, memory_fraction: float) -> None:
    """Refuse a plan predicted to need more memory per device than the limit (as `autoplan
    estimate` warns), before anything is built or trained."""
    need, limit = plan.predicted.peak_memory_bytes, plan.predicted.memory_limit_bytes
    if need > limit:
        raise InfeasiblePlanError(
            f"the plan does not fit: it needs {fmt_bytes(need)} per device (predicted), but a "
            f"device of cluster {cluster.name!r} offers {fmt_bytes(limit)} "
            f"({cluster.device.tensor_bytes_words(memory_fraction)}); plan again "
            "(autoplan plan), edit the plan to shard or recompute more, or raise "
            "--memory-fraction (PlanOptions.memory_fraction)"
        )


def check_world(cluster: Cluster, world: int) -> None:
    """The job's processes are the cluster's devices (every rank checks it before tracing, so
    that all raise the same error, and nothing is planned for devices the job lacks)."""
    if cluster.num_devices != world:
        raise MeshShapeError(
            f"cluster {cluster.name!r} has {cluster.num_devices} devices but this job has "
            f"{world} processes; start {cluster.num_devices} (--nproc {cluster.num_devices}, "
            f"torchrun --nproc-per-node {cluster.num_devices}) or give a cluster of {world}"
        )


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise AutoplanError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad): "
            "there is nothing to train; give it parameters (autoplan plan and estimate work "
            "without them)"
        )


def _check_provenance(plan: Plan, graph_fingerprint: str, cluster: Cluster) -> None:
    got = plan.provenance
    refusal = got.graph_refusal(graph_fingerprint, torch_release())
    if refusal is not None:
        raise PlanFormatError(refusal)
    _check_cluster(plan, cluster)


def _check_cluster(plan: Plan, cluster: Cluster) -> None:
    got = plan.provenance
    if got.cluster_fingerprint != cluster.fingerprint():
        raise PlanFormatError(
            f"the plan was made for cluster {got.cluster!r} ({got.cluster_fingerprint}), not "
            f"{cluster.name!r} ({cluster.fingerprint()}); plan again for this cluster"
        )


def parallelize(
    model: nn.Module,
    cluster: Cluster | str | Path,
    *,
    example_inputs: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    plan: Plan | str | Path | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    options: PlanOptions | None = None,
    train: TrainOptions | None = None,
) -> Step:
    """Make ``model`` train on ``cluster`` as a plan says; call on every rank under torchrun.

    The model's parameters are replaced in place by DTensors (as torch's
    ``parallelize_module`` does); ``step.state_dict()`` gives them back whole.

    Without ``example_inputs`` the model is traced and planned at the first call, from that
    batch's shapes. ``plan`` (a `Plan` or a JSON path) skips planning: rank 0 checks it
    against the model and cluster and derives its collectives and gradient buckets from its
    placements (`autoplan.estimate.derive`; what the plan lists of them is not used).
    ``options`` go to `autoplan.plan` (`PlanOptions`: mesh, pins, pipeline, the optimizer
    ...); ``train`` says how the step trains (`TrainOptions`: the optimizer's settings,
    gradient clipping, the watchdog's limit, fp16's loss scaling). A plan in fp16 trains with
    dynamic loss scaling (torch's ``GradScaler`` semantics): ``step.loss_scaler.skipped``
    counts the steps skipped because their gradients overflowed on some rank. The gradients
    of bucketed parameters are views of their bucket's buffer, valid until the next backward.
    """
    check_trainable(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise AutoplanError(
            "the model's parameters are already DTensors: it was parallelized before (they are "
            "replaced in place); pass a freshly built model"
        )
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    step = Step(
        model,
        cluster,
        loss_fn=loss_fn,
        plan=plan,
        init_fn=init_fn,
        options=options or PlanOptions(),
        train=train or TrainOptions(),
    )
    if example_inputs is not None:
        step.build(example_inputs, example_target)
    return step
