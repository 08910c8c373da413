"""`autoplan.parallelize`: plan (or load a plan) and build the train step on every rank."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.export import ExportedProgram

from autoplan.api import plan_graph
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError, PlanFormatError
from autoplan.estimate import derive
from autoplan.execute import checkpoint
from autoplan.execute.checkpoint import Progress
from autoplan.execute.gradients import GradientReducer
from autoplan.execute.pipeline import PipelineRunner, batch_args
from autoplan.execute.step import (
    OptimizerFactory,
    ParallelModule,
    local_leaves,
    make_optimizer,
    materialize,
)
from autoplan.execute.watchdog import note, step_timeout, watched
from autoplan.execute.zero import ShardedState
from autoplan.graph.capture import export_step, graph_from_export, keywords, microbatch
from autoplan.graph.ir import Graph
from autoplan.options import PlanOptions
from autoplan.planfile.schema import Plan
from autoplan.precision import LossScaler
from autoplan.search.pipeline_search import GraphForMicrobatches
from autoplan.torch_private import wait_collective
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
        error = {c.__name__: c for c in AutoplanError.__subclasses__()}.get(status, AutoplanError)
        raise error(f"{what} failed on rank 0: {payload}")
    return Plan.from_json(payload)


class Step:
    """``loss = step(inputs, target)``: forward, backward and optimizer step, as the plan says.

    ``step.module`` is the parallel module (its forward returns the loss, and gradients are
    synchronized as they arrive) for users who write their own loop; ``step.optimizer`` the
    optimizer over its DTensor parameters; ``step.plan`` the plan in use; ``step.steps_done``
    the steps taken (counted by calls, and restored by `load`).
    """

    def __init__(
        self,
        model: nn.Module,
        cluster: Cluster,
        *,
        loss_fn: Callable[..., torch.Tensor] | None,
        optimizer: str | OptimizerFactory,
        optimizer_options: Mapping[str, Any],
        plan: Plan | str | Path | None,
        init_fn: Callable[[nn.Module], None] | None,
        options: PlanOptions,
        max_grad_norm: float | None = None,
        timeout_s: float | None = None,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        step_timeout(1.0, timeout_s)  # a bad value is refused now, not at the first step
        self._model = model
        self.cluster = cluster
        self._loss_fn = loss_fn
        self._optimizer_spec = optimizer
        self._optimizer_options = optimizer_options
        self.max_grad_norm = max_grad_norm
        self._given_plan = plan
        self._init_fn = init_fn
        self._options = options
        self.module: ParallelModule | None = None  # None for pipelined plans
        self.pipeline: PipelineRunner | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.plan: Plan | None = None
        self.mesh: DeviceMesh | None = None
        self.zero = ShardedState()  # ZeRO-1/2's parameters, once built
        self._keywords: tuple[str, ...] = ()  # the names of inputs passed by keyword
        self.steps_done = 0
        # fp16's loss scaling (a default LossScaler() for fp16 plans); None: no scaling
        self.loss_scaler = loss_scaler
        self._timeout_s = timeout_s
        self.step_limit_s = 0.0  # the watchdog's, set from the plan when built

    def build(self, example_inputs: Any, example_target: Any) -> None:
        """Trace, plan (or check the given plan) and place the parameters."""
        init_distributed(self.cluster)
        self._keywords = keywords(example_inputs)
        given = self._given_plan
        if given is not None and not isinstance(given, Plan):
            given = Plan.from_json(str(given))
        precision = given.mixed_precision if given is not None else self._options.mixed_precision
        ep = export_step(self._model, example_inputs, self._loss_fn, example_target, precision)
        graph = graph_from_export(ep, precision)

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
                lambda: checked_plan(given, graph_for, self.cluster, self._options),
            )
        else:
            plan = _agree_on_plan(
                "planning", lambda: plan_graph(graph, self.cluster, self._options, graph_for)
            )
        if plan.pipeline is not None:
            # stages run one microbatch at a time: the step traced at that shape
            ep = export_microbatch(plan.pipeline.num_microbatches)
            graph = graph_from_export(ep, precision)
        _check_plan(plan, graph.fingerprint, self.cluster)
        world = dist.get_world_size()
        if len(plan.mesh.ranks) != world:
            raise AutoplanError(
                f"the plan is for {len(plan.mesh.ranks)} devices but this job has {world} ranks; "
                f"launch with --nproc {len(plan.mesh.ranks)} or plan for {world} devices"
            )
        self.mesh = init_device_mesh(
            _device_type(self.cluster), plan.mesh.shape, mesh_dim_names=plan.mesh.axes
        )
        self.plan = plan
        if plan.pipeline is not None:
            pp = self.mesh["pp"]
            # this rank's row of the "pp" axis holds stages row, row + p, ... (interleaved)
            params = {
                fqn
                for fqn, s in plan.param_stages().items()
                if s % pp.size() == pp.get_local_rank()
            }
            materialize(
                self._model, plan, self.mesh[plan.stage_axes], self._init_fn, stage_params=params
            )
            gradless = frozenset(n.name for n in graph if not n.needs_grad)
            self.pipeline = PipelineRunner(self._model, ep, plan, self.mesh, gradless)
            self.zero = self.pipeline.zero
            self.placeholders = self.pipeline.module.placeholders
            parameters = self.pipeline.parameters()
        else:
            materialize(self._model, plan, self.mesh, self._init_fn)
            self.zero = ShardedState.split(self._model, plan, self.mesh)
            self.module = ParallelModule(self._model, ep, plan, self.mesh)
            self.module.placeholders.whole = self.zero.by_placeholder(
                self.module.placeholders.params
            )
            reduced = {**dict(self.module.named_parameters()), **self.zero.whole}
            reducer = GradientReducer(reduced, plan, 0, self.mesh, self.zero.take_gradients)
            module = self.module
            reducer.on_arrival(
                local_leaves(
                    module,
                    module.placeholders,
                    module.interpreter,
                    reducer.accepts_local,
                    self.zero.whole,
                )
            )
            self.placeholders = self.module.placeholders
            parameters = list(self.module.parameters())
        self.optimizer = make_optimizer(self._optimizer_spec, parameters, self._optimizer_options)
        if self.zero.whole:  # ZeRO-1/2: the updated shards gathered back after each step
            self.optimizer.register_step_post_hook(lambda *_: self.zero.gather())
        self.step_limit_s = step_timeout(plan.predicted.step_time_s, self._timeout_s)
        if plan.mixed_precision == "fp16" and self.loss_scaler is None:
            self.loss_scaler = LossScaler()

    def __call__(self, inputs: Any, target: Any = None) -> torch.Tensor:
        if self.optimizer is None:
            self.build(inputs, target)  # plan from the first batch's shapes, as Alpa does
        assert self.optimizer is not None
        if keywords(inputs) != self._keywords:
            raise AutoplanError(
                f"the step was traced with inputs {self._keywords or 'by position'}, got "
                f"{keywords(inputs) or 'inputs by position'}; pass the batch as it was traced"
            )
        scale = 1.0 if self.loss_scaler is None else self.loss_scaler.scale
        with watched(self.steps_done + 1, "forward", self.step_limit_s):
            if self.pipeline is not None:
                args = batch_args(inputs, target)
                self.placeholders.check(args, batches=self.pipeline.num_microbatches)
                self.pipeline.loss_scale = scale
                loss = self.pipeline.run(args)
            else:
                assert self.module is not None
                loss = self.module(inputs, target)
                note("backward")
                # an explicit seed: autograd's own (ones_like(loss)) would wait for the loss's
                # all-reduce, which is only read after the optimizer step; the loss scale
                # seeds backward as GradScaler's scaled loss does
                loss.backward(torch.full(loss.shape, scale, dtype=loss.dtype, device=loss.device))
            finite = True
            if self.loss_scaler is not None:
                note("unscaling the gradients (and the all-reduce of their overflow)")
                finite = self.loss_scaler.unscale(self._gradients())
                self.loss_scaler.update(finite)
            if self.max_grad_norm is not None and finite:
                note("gradient clipping (the gradients' norm)")
                self.clip_gradients(self.max_grad_norm)
            if finite:  # a step whose gradients overflowed is skipped, as GradScaler skips it
                note("the optimizer step (it waits for gradients still being reduced)")
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            note("the loss's all-reduce")
            # long done by now; waited for here so that no step leaves a collective behind
            loss = wait_collective(loss.detach())
        self.steps_done += 1
        return loss

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most ``max_norm`` (as
        ``torch.nn.utils.clip_grad_norm_`` does in one process); returns the norm before.

        torch computes the norm of DTensor gradients (its collectives reduce over the stage's
        mesh); across pipeline stages, which hold different parameters, the squared norms are
        summed by hand on the "pp" axis: no DTensor spans stages.
        """
        assert self.mesh is not None
        grads = self._gradients()
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.pipeline is not None:
            squared = norm.detach() ** 2
            dist.all_reduce(squared, group=self.mesh["pp"].get_group())
            norm = squared.sqrt()
        scale = max_norm / (float(norm) + 1e-6)  # torch's clip_grad_norm_ formula
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)
        return norm

    def _gradients(self) -> list[torch.Tensor]:
        """The gradients of this rank's parameters that have one."""
        assert self.optimizer is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [p.grad for p in params if p.grad is not None]

    def save(self, directory: str | Path, *, keep: int | None = None, extra: Any = None) -> Path:
        """Save a checkpoint on every rank (`autoplan.execute.checkpoint`): each rank writes its
        shards of the parameters, buffers and optimizer state into
        ``directory/step-<steps_done>``, with the step count, rank 0's random state and
        ``extra`` (JSON: a data loader's position). Keeps the newest ``keep`` checkpoints (all
        if None). Returns the checkpoint's path."""
        optimizer = self._built("save")
        return checkpoint.save(
            directory, self._model, optimizer, self.steps_done, keep=keep, extra=extra
        )

    def load(self, directory: str | Path, *, missing_ok: bool = False) -> Progress | None:
        """Load the newest checkpoint in ``directory`` (or the checkpoint ``directory``) on
        every rank, saved under this plan or any other plan of the same model; returns its
        step count and ``extra``, and continues counting from there. With ``missing_ok``,
        a directory without a checkpoint loads nothing and returns None."""
        optimizer = self._built("load")
        progress = checkpoint.load(directory, self._model, optimizer, missing_ok=missing_ok)
        if progress is not None:
            self.steps_done = progress.step
            self.zero.gather()  # ZeRO-1/2: the shards loaded, the whole parameters from them
        return progress

    def export(self, path: str | Path) -> None:
        """Write the whole parameters and buffers as one ``torch.save`` file (rank 0 writes
        it), which ``model.load_state_dict(torch.load(path))`` reads in one process."""
        checkpoint.export(path, self.state_dict())

    def _built(self, action: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise AutoplanError(
                f"cannot {action} a step that is not built yet: pass example_inputs to "
                f"parallelize, or {action} after the first step"
            )
        return self.optimizer

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded parameters and buffers (gathered on every rank)."""
        if self.optimizer is None:
            return {k: v.detach().clone() for k, v in self._model.state_dict().items()}
        if self.pipeline is not None:
            return self.pipeline.state_dict()
        assert self.module is not None
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in self.module.state_dict().items()
        }


def checked_plan(
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
    return derived


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise AutoplanError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad): "
            "there is nothing to train; give it parameters (autoplan plan and estimate work "
            "without them)"
        )


def _check_plan(plan: Plan, graph_fingerprint: str, cluster: Cluster) -> None:
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
    optimizer: str | OptimizerFactory = "adamw",
    optimizer_options: Mapping[str, Any] | None = None,
    plan: Plan | str | Path | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    max_grad_norm: float | None = None,
    options: PlanOptions | None = None,
    timeout_s: float | None = None,
    loss_scaler: LossScaler | None = None,
) -> Step:
    """Make ``model`` train on ``cluster`` as a plan says; call on every rank under torchrun.

    The model's parameters are replaced in place by DTensors (as torch's
    ``parallelize_module`` does); ``step.state_dict()`` gives them back whole.

    Without ``example_inputs`` the model is traced and planned at the first call, from that
    batch's shapes. ``plan`` (a `Plan` or a JSON path) skips planning: rank 0 checks it
    against the model and cluster and derives its collectives and gradient buckets from its
    placements (`autoplan.estimate.derive`; what the plan lists of them is not used).
    ``max_grad_norm`` clips gradients to that global norm before each optimizer step (its
    norm reductions are not in the plan's list of collectives). ``options`` go to
    `autoplan.plan` (`PlanOptions`: mesh, pins, pipeline ...); an ``optimizer`` given by name
    is the one whose state the plan counts. ``timeout_s`` bounds each step (default: ten
    times the plan's predicted step time, at least 60 s): a step that runs over, a rank
    stopped or stuck in a collective, ends the whole job with a message naming the ranks,
    the step and what each was waiting in (`autoplan.execute.watchdog`). A plan in fp16
    (``PlanOptions(mixed_precision="fp16")``) trains with dynamic loss scaling:
    ``loss_scaler`` (`autoplan.precision.LossScaler`, torch's ``GradScaler`` semantics and
    defaults unless given) scales the loss, unscales the gradients and skips a step whose
    gradients overflowed on any rank; ``step.loss_scaler.skipped`` counts those steps.

    ``optimizer``: "adamw", "adam" or "sgd" (torch's, over the DTensor parameters, with
    ``optimizer_options`` such as ``lr``; Adam and AdamW run the fused kernel unless
    ``foreach=True``, SGD runs foreach), or a callable that makes one from the parameters.
    The gradients of bucketed parameters are views of their bucket's buffer, valid until the
    next backward pass.
    """
    check_trainable(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise AutoplanError(
            "the model's parameters are already DTensors: it was parallelized before (they are "
            "replaced in place); pass a freshly built model"
        )
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    options = options or PlanOptions()
    if isinstance(optimizer, str) and optimizer != options.optimizer:
        options = replace(options, optimizer=optimizer)
    step = Step(
        model,
        cluster,
        loss_fn=loss_fn,
        optimizer=optimizer,
        optimizer_options=optimizer_options or {},
        plan=plan,
        init_fn=init_fn,
        options=options,
        max_grad_norm=max_grad_norm,
        timeout_s=timeout_s,
        loss_scaler=loss_scaler,
    )
    if example_inputs is not None:
        step.build(example_inputs, example_target)
    return step
