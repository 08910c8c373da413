"""The planned step run once on fake tensors, before any process trains.

A rank's step is built and run here exactly as training builds and runs it (`build_runtime`,
then `train_step`: forward, backward, gradient clipping, the optimizer step), but on a shell
of the model whose parameters are meta tensors, under ``FakeTensorMode``: every op runs its
shape function only, and the collectives do not reach the process group (c10d's ops on fake
tensors return at once on the calling rank, torch 2.13.0), so no memory is allocated, no
rank waits for another, and an op the executor cannot run on this rank's placements raises
here, named, instead of in the first step on some rank.

Ranks differ only by their mesh coordinate, and two coordinates whose every mesh axis is split
the same number of ways run the same code on shards of the same shapes: `roles` keeps one
rank per pipeline row and per pattern of first/middle/last positions on the other axes (a
shard's offset, and the size of an uneven split's last block, are what a coordinate changes).
`check_plan` runs them all in one process on the "fake" process group at the plan's world
size; `check_rank` runs the rank a job's process group gives, inside that job.

A pipelined plan's rank builds its stages as training does (`PipelineRunner`: torch's
``PipelineStage`` around each `StageModule`), but torch's schedule, whose stages first agree
by messages on how to learn each other's shapes, gives way to `_Unsent`: each stage runs two
microbatches through torch's own stage code, forward from the buffers it receives into and
backward from the gradients it receives into (fake tensors of the shapes the plan's stage
boundary gives), the last stage from its loss; then the step goes on as training's does
(the gradients reduced, clipped, the optimizer step). Not run: the messages between
stages, and the schedule's order of microbatches.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import multiprocessing
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.export import ExportedProgram
from torch.utils._pytree import tree_map

from autoplan.errors import AutoplanError, UnsupportedOpError, error_class
from autoplan.execute import interpreter, op_calls
from autoplan.execute.pipeline import PipelineRunner
from autoplan.execute.runtime import build_runtime, plan_mesh, train_step
from autoplan.graph.capture import export_step, microbatch
from autoplan.graph.convert import graph_from_export, module_path
from autoplan.graph.flops import GROUPED_MMS
from autoplan.options import TrainOptions
from autoplan.planfile.schema import Plan
from autoplan.schedules import SPLIT_BACKWARD
from autoplan.torch_private import STATIC_STAGES, FakeValues, fake_world, static_stages

log = logging.getLogger(__name__)

# the executor's modules whose frames hold the op being run (`PlanInterpreter._step` and below)
_OP_MODULES = (interpreter.__file__, op_calls.__file__)


def meta_shell(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes
    (nothing of their data is copied; tied parameters stay tied)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = tensor.detach().to("meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(model, memo)


def roles(shape: tuple[int, ...], axes: tuple[str, ...]) -> list[int]:
    """One rank per distinct role on a mesh of ``shape`` with ``axes``: its pipeline row
    (stage group) and, on each of the other axes, whether it holds the first block of a
    split, the last (the short one of an uneven split) or one between (those get shards of
    the same shapes at other offsets). At most ``3**axes`` ranks per pipeline row, whatever
    the world size."""
    seen: dict[tuple[int, ...], int] = {}
    for rank in range(math.prod(shape)):
        coordinate, rest = [], rank
        for size in reversed(shape):
            coordinate.append(rest % size)
            rest //= size
        coordinate.reverse()
        key = tuple(
            c if a == "pp" else (0 if c == 0 else 2 if c == size - 1 else 1)
            for c, a, size in zip(coordinate, axes, shape, strict=True)
        )
        seen.setdefault(key, rank)
    return sorted(seen.values())


def check_rank(
    model: nn.Module,
    ep: ExportedProgram,
    plan: Plan,
    example_inputs: Any,
    example_target: Any,
    *,
    mesh: DeviceMesh,
    optimizer: str,
    train: TrainOptions,
    gradless: frozenset[str] = frozenset(),
) -> None:
    """Run one train step of this process's rank on ``mesh`` (`plan_mesh`: the job's, which
    the step then trains on) on fake tensors, as the job would; an op it cannot run raises
    `UnsupportedOpError` naming the rank, the op and the module. ``ep``: the step traced at
    the shape a stage runs (one microbatch for pipelined plans); the example batch is the
    whole batch."""
    if not checkable(plan):
        return
    shell = meta_shell(model)
    with FakeValues(allow_non_fake_inputs=True) as mode:
        try:
            run = build_runtime(shell, ep, plan, mesh, optimizer, train, _keep, gradless=gradless)
            if run.pipeline is not None:
                run.pipeline.schedule = _Unsent(run.pipeline)
            inputs, target = tree_map(
                lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                (example_inputs, example_target),
            )
            train_step(run, inputs, target, train.max_grad_norm)
        except AutoplanError:
            raise
        except Exception as e:  # whatever torch raises: one clear error naming where
            raise UnsupportedOpError(_refusal(dist.get_rank(), plan, e)) from e


def checkable(plan: Plan) -> bool:
    """Whether the check can run ``plan``'s step: a pipeline's only where this torch's stages
    can be made ready without messages (`STATIC_STAGES`, torch 2.13 on; `_Unsent`), and
    not where a grouped matmul sends its rows to their experts: how many go to each rank
    is data (`execute/experts.py`), which fake tensors do not hold."""
    nodes = plan.nodes
    routed = [c for c in plan.collectives if c.kind == "all_to_all" and c.node in nodes]
    if any(nodes[c.node].op in GROUPED_MMS for c in routed):
        log.info(
            "the planned step is not run on fake tensors: its grouped matmuls send their "
            "rows to their experts by counts that fake tensors do not hold"
        )
        return False
    if plan.pipeline is None or STATIC_STAGES:
        return True
    log.info(
        "the planned step is not run on fake tensors: torch %s cannot ready a pipeline's "
        "stages without messages between them (2.13 and later can)",
        torch.__version__,
    )
    return False


class _Unsent:
    """The check's stand-in for a pipeline's schedule (`Stepper`): each of this rank's stages
    runs its first two microbatches (the first makes each gradient, the second adds to it;
    the others repeat the second) through torch's own stage code, the schedule's steps less
    their messages: forward on what the stage made to receive into, its loss on the last
    stage, backward from the gradients it made to receive into (split in the inputs' and the
    weights' where the schedule splits it). Torch's schedule cannot run on fake tensors: its
    stages vote on how to learn each other's shapes by messages whose values fake tensors do
    not carry (torch 2.13.0), and the plan's stages need no vote (`static_stages`)."""

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner
        assert runner.plan.pipeline is not None
        self.split = runner.plan.pipeline.schedule in SPLIT_BACKWARD

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None) -> None:
        count = self.runner.num_microbatches
        stages = self.runner.stages
        static_stages(stages, count)
        chunks, _ = split_args_kwargs_into_chunks(args, None, count)
        for chunk in range(min(count, 2)):
            outputs = {
                s.stage_index: s.forward_one_chunk(chunk, chunks[chunk] if s.is_first else ())
                for s in stages
            }
            for s in reversed(stages):
                loss = None
                if s.is_last:
                    # the loss is the stage's output: the schedule's target is a placeholder
                    loss = self.runner.stage_loss(outputs[s.stage_index], target)
                    if losses is not None:
                        losses.append(loss)
                s.backward_one_chunk(chunk, loss=loss, full_backward=not self.split)
                if self.split:
                    s.backward_weight_one_chunk(chunk)
        for s in stages:
            s.clear_runtime_states()


def _keep(model: nn.Module) -> None:
    """The shell's parameters are left as they are made (their values are never read)."""


def check_plan(
    model: nn.Module,
    ep: ExportedProgram,
    plan: Plan,
    example_inputs: Any,
    example_target: Any = None,
    *,
    optimizer: str = "adamw",
    train: TrainOptions | None = None,
    gradless: frozenset[str] = frozenset(),
) -> list[int]:
    """Run the planned step of every role of ``plan`` (`roles`) in
    this process, on fake tensors and the "fake" process group at the plan's world size
    (none may be initialized here); returns the ranks checked. Raises `UnsupportedOpError`
    at the first rank that cannot run its step."""
    if dist.is_initialized():
        raise AutoplanError(
            "check_plan runs every rank's step in this process on a fake process group, but "
            "this process has joined a job; call it before init_process_group (or let each "
            "rank check its own step: parallelize does)"
        )
    if not checkable(plan):
        return []
    checked = roles(plan.mesh.shape, plan.mesh.axes)
    start = time.perf_counter()
    for rank in checked:
        check = functools.partial(
            check_rank,
            model,
            ep,
            plan,
            example_inputs,
            example_target,
            optimizer=optimizer,
            train=train or TrainOptions(),
            gradless=gradless,
        )
        _forked(rank, plan, check)
    log.info(
        "the planned step ran on fake tensors for %d of %d ranks (one per role) in %.1f s",
        len(checked),
        len(plan.mesh.ranks),
        time.perf_counter() - start,
    )
    return checked


def check_traced(
    model: nn.Module,
    plan: Plan,
    example_inputs: Any,
    example_target: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    optimizer: str = "adamw",
) -> list[int]:
    """`check_plan` of ``model``'s step traced as a rank runs it: at one microbatch's shape
    for a pipelined plan (the whole batch otherwise), with the tensors no gradient flows to."""
    count = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
    ep = export_step(model, inputs, loss_fn, target, plan.mixed_precision)
    graph = graph_from_export(ep, plan.mixed_precision)
    gradless = frozenset(n.name for n in graph if not n.needs_grad)
    return check_plan(
        model, ep, plan, example_inputs, example_target, optimizer=optimizer, gradless=gradless
    )


def agree_on_check(check: Callable[[], None]) -> None:
    """Run ``check`` (`check_rank` of this job's rank) on every rank of the job; if it fails
    on any, every rank raises the first failing rank's error, of its class (never a rank
    left waiting in the first step for one that stopped). Its seconds are logged."""
    start = time.perf_counter()
    outcome: tuple[str, str] | None = None
    try:
        check()
    except AutoplanError as e:
        outcome = (type(e).__name__, str(e))
    except Exception as e:  # the check's own failure: told on every rank, not a hang
        outcome = (
            "AutoplanError",
            f"the check of the planned step failed on rank {dist.get_rank()}: {e!r}; "
            "TrainOptions(check_step=False) (--no-check-step) skips it",
        )
    outcomes: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    failed = [o for o in outcomes if o is not None]
    if failed:
        kind, message = failed[0]
        raise error_class(kind)(message)
    log.info("the planned step ran on fake tensors in %.1f s", time.perf_counter() - start)


def _refusal(rank: int, plan: Plan, error: BaseException) -> str:
    """What failed where: the rank's stages (pipelined plans), the op and module the
    interpreter was running (forward), or the op torch names (backward, the optimizer), and
    what to do."""
    error, node = _failing_node(error)
    first = next((line for line in str(error).splitlines() if line.strip()), "").rstrip(".")
    what = f"{type(error).__name__}: {first}"
    if node is not None:
        placed = plan.nodes.get(node.name)
        where = (
            f"op {node.target} ({node.name}) in module {module_path(node) or '(top level)'!r}, "
            f"placed inputs {placed.inputs if placed else '?'} -> "
            f"{placed.output if placed else '?'}"
        )
        advice = (
            "pin what that module reads replicated (PlanOptions.pins, --pin: its parameters, "
            'or "input:0" for the batch) so that the op runs whole on every rank, or report the '
            "op to autoplan with this message"
        )
    else:
        where = "building the step, backward or the optimizer step (outside the traced forward)"
        # no op of the plan to pin: what failed is the executor's own (or torch's) work
        other = (
            "other pipeline stages (PlanOptions.num_stages, --stages) or " if plan.pipeline else ""
        )
        advice = (
            f"report it to autoplan with this message; a plan of {other}another mesh "
            "(PlanOptions.mesh_shape, --mesh) may not meet it"
        )
    return (
        f"rank {rank}{_stages_of(rank, plan)} of the plan cannot run its step: {where}: "
        f"{what}. The check ran the planned step on fake tensors before training "
        f"(TrainOptions.check_step, --no-check-step to skip it). What to do: {advice}"
    )


def _stages_of(rank: int, plan: Plan) -> str:
    """`` (stage 1)``: the stages ``rank`` runs, for a pipelined plan; empty otherwise."""
    if plan.pipeline is None:
        return ""
    stages = plan.group_stages(rank // math.prod(plan.mesh.shape[1:]))  # its row of "pp"
    return f" (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"


def _failing_node(error: BaseException) -> tuple[BaseException, torch.fx.Node | None]:
    """The fx node the interpreter was running when ``error`` or one of its causes was raised
    (innermost), and that error; else None and the innermost cause (torch's pipeline stage
    raises its own error from its forward's or backward's, which names the op)."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    for cause in reversed(chain):
        nodes = [
            frame.f_locals["node"]
            for frame, _ in traceback.walk_tb(cause.__traceback__)
            if frame.f_code.co_filename in _OP_MODULES
            and isinstance(frame.f_locals.get("node"), torch.fx.Node)
        ]
        if nodes:
            return cause, nodes[-1]
    return chain[-1], None


def _forked(rank: int, plan: Plan, check: Callable[..., None]) -> None:
    """Run ``check(mesh=...)`` as ``rank`` of a fake world of ``plan``'s size in a forked
    child: each rank's world is made
    and ended in a process of its own, so that no cache of torch's (DTensor's compare meshes
    by value, and hold the process groups of the mesh they saw first) carries one rank's
    groups to the next. The child's error is raised here, of its class."""
    world_size = len(plan.mesh.ranks)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        torch.set_num_threads(1)  # a forked child's first op may hang on the parent's OpenMP
        outcome: tuple[str, str] | None = None
        try:
            with fake_world(rank, world_size):
                check(mesh=plan_mesh(plan, "cpu"))
        except Exception as e:  # sent to the parent, which raises it
            outcome = (type(e).__name__, str(e) if isinstance(e, AutoplanError) else repr(e))
        send.send(outcome)

    process = context.Process(target=child, daemon=True)
    process.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:  # the child ended without a word (killed)
        outcome = ("AutoplanError", "")
    process.join()
    if outcome is not None:
        kind, message = outcome
        raise error_class(kind)(
            message
            or f"the check of rank {rank} ended without an answer (exit code "
            f"{process.exitcode}); run again with TrainOptions(check_step=False) to skip it"
        )
