"""What `autoplan run` does on every rank: build the step (resumed from a checkpoint), train,
save checkpoints, and optionally compare with training in one process."""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.execute import checkpoint
from autoplan.execute.live_memory import live_tensors, tracked_peak
from autoplan.execute.step import make_optimizer
from autoplan.execute.watchdog import watched
from autoplan.graph.capture import as_tuple
from autoplan.options import PlanOptions, TrainOptions
from autoplan.parallel import Step, init_distributed
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import fmt_bytes, fmt_time
from autoplan.precision import COMPUTE_DTYPES
from autoplan.torch_private.flex_op import eager_flex_attention
from autoplan.workload import Workload

log = logging.getLogger(__name__)

# on CPU ranks, a run of more steps than this traces its last one's memory (`memory_traced`):
# the first step warms up and the traced one is slow, so one between them is timed
TRACED_AFTER = 2


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    seconds: float
    throughput: float
    unit: str  # "tokens/s" for integer inputs of rank 2 (token ids), else "samples/s"
    # model FLOPs per second over the cluster's peak for the compute dtype (`mfu`); None
    # where the step's FLOPs are not known
    mfu: float | None = None
    # this rank's peak of live tensor memory over the step, where MemTracker measured it
    # (`memory_traced`: the last step of a run on CPU ranks, slower for the tracking)
    peak_bytes: float | None = None

    def line(self, steps: int) -> str:
        """``step   3/5  loss 4.123456  12.3 ms  1,234 tokens/s  MFU 0.12%`` (of ``steps``),
        and ``  memory traced: 21.3 MiB`` where it was."""
        mfu = "" if self.mfu is None else f"  MFU {100 * self.mfu:.2f}%"
        peak = "" if self.peak_bytes is None else f"  memory traced: {fmt_bytes(self.peak_bytes)}"
        width = len(str(steps))
        return (
            f"step {self.step:>{width}}/{steps}  loss {self.loss:.6f}  "
            f"{self.seconds * 1e3:8.1f} ms  {self.throughput:,.0f} {self.unit}{mfu}{peak}"
        )


def compute_dtype(model: torch.nn.Module, precision: str | None) -> str:
    """The dtype the step's matmuls run in: the mixed precision's, else the model's first
    floating-point parameter's (float32 for a model without one)."""
    if precision is not None:
        return str(COMPUTE_DTYPES[precision]).removeprefix("torch.")
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def mfu(flops: float, seconds: float, cluster: Cluster, dtype: str) -> float:
    """Model FLOPs utilization: ``flops`` done in ``seconds`` over the peak of all the
    cluster's devices for ``dtype`` (`Cluster.peak_flops`)."""
    return flops / seconds / (cluster.peak_flops(dtype) * cluster.num_devices)


@dataclass(frozen=True)
class RunSummary:
    """A training run against its plan's predictions: the median step time of the steps after
    the first (which builds caches and warms up; the first alone if it is the only one) and
    the peak memory per device."""

    steps: tuple[int, ...]  # the steps the median is of
    step_s: float
    predicted_step_s: float
    throughput: float  # at the median step time
    unit: str
    mfu: float | None
    # the largest rank's peak: torch.cuda.max_memory_allocated on GPUs, MemTracker's peak of
    # live tensors over the last step on CPUs (`memory_traced`); None where not measured
    peak_memory_bytes: float | None
    predicted_memory_bytes: float
    peak_memory_source: str = "torch.cuda.max_memory_allocated"

    def lines(self) -> list[str]:
        first, last = self.steps[0], self.steps[-1]
        which = f"step {first}" if first == last else f"median of steps {first}-{last}"
        mfu = "" if self.mfu is None else f", MFU {100 * self.mfu:.2f}%"
        ratio = self.step_s / self.predicted_step_s if self.predicted_step_s else float("nan")
        predicted = fmt_bytes(self.predicted_memory_bytes)
        memory = (
            f"  peak memory  not measured (predicted {predicted} per device; on CPU ranks "
            f"a run of {TRACED_AFTER + 1} steps or more traces its last)"
            if self.peak_memory_bytes is None
            else f"  peak memory  measured {fmt_bytes(self.peak_memory_bytes)} "
            f"({self.peak_memory_source}, the largest rank), predicted {predicted}: "
            f"x{self.peak_memory_bytes / self.predicted_memory_bytes:.2f} of predicted"
        )
        return [
            f"summary ({which}):",
            f"  step time    measured {fmt_time(self.step_s)}, predicted "
            f"{fmt_time(self.predicted_step_s)}: x{ratio:.2f} of predicted",
            f"  throughput   {self.throughput:,.0f} {self.unit}{mfu}",
            memory,
        ]


def summarize(
    records: Sequence[StepRecord], plan: Plan, peak_memory_bytes: float | None
) -> RunSummary:
    """``records`` (at least one) against ``plan``'s predictions; a step whose memory was
    traced is timed slow for it, and counts only where no other step is left."""
    timed = [r for r in records if r.peak_bytes is None] or list(records)
    kept = timed[1:] or timed
    step_s = statistics.median(r.seconds for r in kept)
    median = min(kept, key=lambda r: (abs(r.seconds - step_s), r.step))
    return RunSummary(
        steps=tuple(r.step for r in kept),
        step_s=step_s,
        predicted_step_s=plan.predicted.step_time_s,
        throughput=median.throughput * median.seconds / step_s,
        unit=median.unit,
        mfu=None if median.mfu is None else median.mfu * median.seconds / step_s,
        peak_memory_bytes=peak_memory_bytes,
        predicted_memory_bytes=plan.predicted.peak_memory_bytes,
        peak_memory_source=(
            "torch.cuda.max_memory_allocated"
            if records[-1].peak_bytes is None
            else "MemTracker's peak of live tensors over the last step"
        ),
    )


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of a training run (`autoplan.Step.save`)."""

    directory: str | None = None
    """Where checkpoints go, one ``step-NNNNNNNN`` directory each; None saves none."""

    every: int | None = None
    """Save every this many steps (and after the last); None: after the last step only."""

    keep: int | None = None
    """Keep the newest this many checkpoints; None keeps all."""

    resume: bool = False
    """Start from the newest checkpoint in ``directory`` (under this run's plan, whatever
    plan saved it); from the beginning if there is none yet."""

    export_to: str | None = None
    """After training, write the whole parameters and buffers to this ``torch.save`` file."""

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise AutoplanError(f"checkpoint {name}={value}: give at least 1")
        if self.directory is None and (self.every is not None or self.resume):
            raise AutoplanError("--checkpoint-every and --resume need --checkpoint-dir DIR")


def _items(w: Workload) -> tuple[int, str]:
    x = as_tuple(w.example_inputs)[0]
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 2:
        return x.numel(), "tokens/s"
    return (x.shape[0] if isinstance(x, torch.Tensor) else 1), "samples/s"


def train(
    w: Workload,
    cluster: Cluster,
    steps: int,
    *,
    plan: Plan | str | None = None,
    options: PlanOptions | None = None,
    train_options: TrainOptions | None = None,
    checkpointing: Checkpointing | None = None,
) -> tuple[Step, Iterator[StepRecord]]:
    """Build the parallel step (planning on rank 0 with ``options`` unless ``plan`` is given),
    resume it from the newest checkpoint if asked, and return it with a generator that trains
    it on the example batch up to ``steps`` steps in all, saving checkpoints as asked."""
    ckpt = checkpointing or Checkpointing()
    if ckpt.directory is not None:  # before planning: found now, not at the first save
        init_distributed(cluster)
        checkpoint.check_writable(ckpt.directory)
    step = w.parallelize(cluster, plan=plan, options=options, train=train_options)
    if ckpt.resume:
        assert ckpt.directory is not None
        if step.load(ckpt.directory, missing_ok=True) is None:
            log.info("no checkpoint in %s yet: starting from step 0", ckpt.directory)
    items, unit = _items(w)
    assert step.plan is not None
    dtype = compute_dtype(w.model, step.plan.mixed_precision)

    def call() -> float:
        return step(w.example_inputs, w.example_target).item()

    # the last step traced slow, so that at least one more than the first is timed
    traced = memory_traced(cluster) and steps - step.steps_done > TRACED_AFTER

    def run() -> Iterator[StepRecord]:
        for i in range(step.steps_done, steps):
            with watched(i + 1, "the barrier before the step", step.step_limit_s):
                dist.barrier()
            start = time.perf_counter()
            peak: float | None = None
            if traced and i + 1 == steps:
                loss, parts = tracked_peak(call, *live_tensors())
                peak = parts["Total"]
            else:
                loss = call()
            seconds = time.perf_counter() - start
            used = mfu(step.flops, seconds, cluster, dtype) if step.flops else None
            yield StepRecord(i + 1, loss, seconds, items / seconds, unit, used, peak)
            if ckpt.directory is not None and (
                i + 1 == steps or (ckpt.every is not None and (i + 1) % ckpt.every == 0)
            ):
                step.save(ckpt.directory, keep=ckpt.keep)
        if ckpt.export_to is not None:
            step.export(ckpt.export_to)

    return step, run()


def memory_traced(cluster: Cluster) -> bool:
    """Whether a run measures its last step's memory with MemTracker: on CPU ranks (gloo),
    where torch's allocator counts no peak; GPUs have ``torch.cuda.max_memory_allocated``."""
    return cluster.backend != "nccl"


def one_process(
    make: Callable[[], Workload],
    steps: int,
    optimizer: str,
    train_options: TrainOptions,
    precision: str | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train the same workload in this process alone, as the reference: with the same
    optimizer, under ``torch.autocast`` for a mixed ``precision``, and fp16 with torch's
    ``GradScaler``."""
    w = make()
    model = copy.deepcopy(w.model)
    return _trained(w, model, steps, optimizer, train_options, precision)


def _trained(
    w: Workload,
    model: torch.nn.Module,
    steps: int,
    optimizer: str,
    train_options: TrainOptions,
    precision: str | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = make_optimizer(optimizer, list(model.parameters()), train_options.optimizer_options)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    losses = []
    for _ in range(steps):
        # FlexAttention's operator uncompiled (its dense forward and backward, which torch's
        # function refuses on the CPU with gradients): what autoplan's ranks run
        # (torch_private/flex_op.py)
        with eager_flex_attention():
            loss = w.loss(model, precision)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


class Distance(NamedTuple):
    """How far one run's training is from another's (the reference), both from the same
    parameters: the largest loss difference, the largest parameter difference, and the largest
    relative difference of one tensor's update (the difference over how far the reference
    moved it: one weight that Adam moves by a full step either way counts little, a tensor
    updated wrongly counts fully)."""

    loss: float
    param: float
    update: float


def distance(
    run: tuple[list[float], dict[str, torch.Tensor]],
    reference: tuple[list[float], dict[str, torch.Tensor]],
    initial: Mapping[str, torch.Tensor],
) -> tuple[Distance, str]:
    """`Distance` of ``run`` from ``reference`` (losses and final state, both from the state
    ``initial``), and the state entry of its largest parameter difference."""
    (losses, state), (ref_losses, ref_state) = run, reference
    loss = max((abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), default=0.0)
    param, worst, update = 0.0, "", 0.0
    for k, v in ref_state.items():
        diff = state[k].double() - v.double()
        largest = diff.abs().max().item() if diff.numel() else 0.0
        if largest > param:
            param, worst = largest, k
        if v.is_floating_point() and largest > 0:
            moved = (v.double() - initial[k].double()).norm().item()
            update = max(update, diff.norm().item() / moved if moved else math.inf)
    return Distance(loss, param, update), worst


def float32_rounding(
    make: Callable[[], Workload],
    steps: int,
    optimizer: str,
    train_options: TrainOptions,
    reference: tuple[list[float], dict[str, torch.Tensor]],
) -> Distance | None:
    """How far rounding alone moves one process's training (``reference``, of `one_process`):
    its `Distance` from the same steps in float64, or in float32 with the batch in reverse
    order (the same sums in another order, as a parallel run adds them; this measure needs no
    float64 kernels, which grouped matmuls lack), whichever is more, measure by measure. None
    where neither runs alike: a model without float64 kernels whose batch cannot be reversed,
    or one whose first losses differ by more than rounding (a model that draws random numbers
    draws others)."""
    found = [
        d
        for variant in (_widened, _reversed)
        if (d := _moved(make(), steps, optimizer, train_options, reference, variant)) is not None
    ]
    return Distance(*map(max, zip(*found, strict=True))) if found else None


def _widened(w: Workload) -> Workload:
    """The workload in float64."""

    def wide(x: object) -> object:
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    model = copy.deepcopy(w.model).double()
    return Workload(
        model, tree_map(wide, w.example_inputs), w.loss_fn, tree_map(wide, w.example_target)
    )


def _reversed(w: Workload) -> Workload:
    """The workload with its batch in reverse order: every input and target tensor whose
    first dim is the first input's."""
    tensors = [x for x in as_tuple(w.example_inputs) if isinstance(x, torch.Tensor) and x.dim()]
    batch = tensors[0].shape[0] if tensors else 0

    def flip(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch:
            return x.flip(0)
        return x

    model = copy.deepcopy(w.model)
    return Workload(
        model, tree_map(flip, w.example_inputs), w.loss_fn, tree_map(flip, w.example_target)
    )


def _moved(
    w: Workload,
    steps: int,
    optimizer: str,
    train_options: TrainOptions,
    reference: tuple[list[float], dict[str, torch.Tensor]],
    variant: Callable[[Workload], Workload],
) -> Distance | None:
    """The `Distance` of ``variant`` of the workload from ``reference``; None where it does
    not run or its first loss differs past rounding."""
    run = variant(w)
    initial = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    try:
        trained = _trained(run, run.model, steps, optimizer, train_options)
    except RuntimeError:  # an op without a float64 kernel, a dtype the model fixes
        return None
    first, ref_first = trained[0][0], reference[0][0]
    if abs(first - ref_first) > 1e-5 * abs(first):
        return None
    return distance(trained, reference, initial)[0]


@dataclass(frozen=True)
class Comparison:
    """How far a run is from one process's (`one_process`): in the model's dtypes the largest
    loss and parameter differences, within 1e-5, or within twice how far rounding alone
    moves one process (``rounding``, `float32_rounding`) where that is more, the parameters
    by their largest difference or by the largest relative difference of a tensor's update
    (``update``, `Distance`): some models amplify rounding (Adam's first steps move a weight
    whose gradient is near zero by a full step either way); in mixed precision, whose sums in
    another order round otherwise, the largest loss difference relative to the loss (within
    1e-4) and the parameters' updates' difference relative to their norm (within 0.1; see
    docs/mixed-precision.md)."""

    loss: float
    param: float
    mixed: bool
    rounding: Distance | None = None
    worst: str = ""  # the state entry of the largest parameter difference (not in mixed)
    update: float = 0.0  # `Distance.update` (not in mixed)

    @property
    def tolerances(self) -> tuple[float, float]:
        """Of the loss and of the parameters' differences."""
        if self.mixed:
            return 1e-4, 0.1
        rounding = self.rounding or Distance(0.0, 0.0, 0.0)
        return max(1e-5, 2 * rounding.loss), max(1e-5, 2 * rounding.param)

    @property
    def ok(self) -> bool:
        loss_tol, param_tol = self.tolerances
        by_update = self.rounding is not None and self.update <= 2 * self.rounding.update
        return self.loss <= loss_tol and (self.param <= param_tol or by_update)

    def __str__(self) -> str:
        if self.mixed:
            text = (
                f"largest relative loss difference {self.loss:.2e} (tolerance 1e-4), "
                f"parameter updates' relative difference {self.param:.2e} (tolerance 0.1)"
            )
        elif self.rounding is None:
            text = (
                f"largest loss difference {self.loss:.2e}, largest parameter difference "
                f"{self.param:.2e} (tolerance 1e-5)"
            )
        else:
            loss_tol, param_tol = self.tolerances
            text = (
                f"largest loss difference {self.loss:.2e} (tolerance {loss_tol:.1e}), largest "
                f"parameter difference {self.param:.2e} (tolerance {param_tol:.1e}) or largest "
                f"relative difference of a tensor's update {self.update:.2e} (tolerance "
                f"{2 * self.rounding.update:.1e}): twice what rounding alone moves one process, "
                "in float64 or its batch reversed, where over 1e-5"
            )
        at = f" (largest at {self.worst})" if self.worst and not self.ok else ""
        return f"check against one process: {text}: {'OK' if self.ok else 'FAILED'}{at}"


def compare(
    losses: list[float],
    state: dict[str, torch.Tensor],
    reference: tuple[list[float], dict[str, torch.Tensor]],
    initial: dict[str, torch.Tensor],
    mixed: bool,
) -> Comparison:
    """A run's losses and final ``state`` against one process's (``reference``), both from
    the parameters ``initial``."""
    ref_losses, ref_state = reference
    if not mixed:
        found, worst = distance((losses, state), reference, initial)
        return Comparison(found.loss, found.param, mixed, worst=worst, update=found.update)
    pairs = list(zip(losses, ref_losses, strict=True))
    loss = max((abs(a - b) / abs(b) for a, b in pairs), default=0.0)
    diff = sum(((state[k] - v).double() ** 2).sum().item() for k, v in ref_state.items())
    moved = sum(((v - initial[k]).double() ** 2).sum().item() for k, v in ref_state.items())
    return Comparison(loss, (diff / moved) ** 0.5 if moved else diff**0.5, mixed)
