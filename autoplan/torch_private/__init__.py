"""Every private torch API autoplan uses, in one place, for torch 2.11 to 2.15.

tests/test_strategies.py and tests/test_distributed.py exercise each of them, so a torch
release that moves one fails there (tools/torch_matrix.sh runs the tests under each release),
not deep inside a plan or a training run. Where releases differ, this module finds out what
the torch at hand has rather than comparing version numbers.

- DTensor's sharding rules on one mesh axis and their placeholder types: the planner reads
  DTensor's own rules instead of copying them (strategies/dtensor_rules.py). torch 2.13 and
  later state most rules per mesh axis ("single-dim strategies"); torch 2.11 states them over
  the whole mesh, and they are asked on a one-axis mesh instead (`dtensor_axis_rules`).
- `dtensor_runs`: whether DTensor can run an op at all (a rule, a handler of its own, or a
  decomposition into ops it has rules for); the executor runs the others on local tensors.
- `register_single_dim_strategy` / `RuntimeSchemaInfo`: teach DTensor the CPU flash-attention
  op, which torch 2.13 has no rule for.
- `StridedShard` (``_StridedShard(d, split_factor=k)``): a strided split "S(d)xk", each rank's
  share of every one of ``k`` pieces (execute/placements.py).
- `_MaskPartial`: the masked partial of a row-split embedding, which the planner must skip.
- `from_local`: `DTensor.from_local` whose backward places the gradient as asked, which torch
  2.13 on takes as `grad_placements=` and torch 2.11 does not: there an autograd function of
  our own does what 2.13's does (execute/interpreter.py).
- `redistribute`: `DTensor.redistribute`, its gradient made contiguous (DTensor labels the
  gradient it redistributes with the strides of the one it came from), that also makes a
  replicated tensor partial where a plan says so (DTensor's public `redistribute` refuses a
  partial target: only its op rules make partials, and which operand of an op they move
  differs between releases: 2.13's add of a replicated and a partial tensor makes the
  replicated one partial, 2.11's all-reduces the partial one).
- `all_gather_single` / `reduce_scatter_single`: torch 2.13's names for
  `all_gather_into_tensor` / `reduce_scatter_tensor`, the only ones torch 2.11 has (2.13 warns
  at the old names); the profiler times them (profile/ops.py).
- `pipeline_wire_dtype` / `pipeline_sent` / `pipeline_received`: torch 2.11's pipelining
  makes every tensor a stage receives require a gradient, and a stage waits for a gradient
  for every tensor it sends; 2.13 on leaves non-float tensors out of backward. Under 2.11 an
  integer tensor crosses stages as the float64 view of its int64 values, and the stage that
  receives it hands back a zero gradient (execute/pipeline.py).
- `static_stages`: PipelineStages made ready to run microbatches as a schedule makes them
  when every stage was given its shapes (the warm-up vote's STATIC outcome, torch 2.13 on),
  without the vote's messages between stages, which fake tensors cannot carry
  (execute/dry_run.py); `STATIC_STAGES`: whether the torch at hand has that mode.
- `aten_export.export_aten`: a step exported at the ATen level in one trace, the level
  `run_decompositions` retraces to (autocast's casts ops from the start; aten_export.py).
- `zero_bubble_order` / `zbv_order` / `dualpipev_order`: the steps
  ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV run on each rank
  (their ``_calculate_single_rank_operations``), computed without stages or a process group,
  so the planner times the order torch runs rather than a copy of it (autoplan/schedules.py;
  they live in this package's schedule_orders.py).
- `fake_world`: the "fake" process group (torch's test-suite store) of any size in one
  process, with DTensor's caches cleared when it ends: they compare meshes by value and would
  hand the next world's equal mesh the specs of this one, whose groups are gone
  (execute/dry_run.py). `FakeValues`: ``FakeTensorMode`` that answers a read of a value
  (``.item()``, ``float(t)``) with zero, where the step reads one.
- `AsyncCollectiveTensor.wait`: the plain tensor behind a functional collective's result, so a
  bucket is waited for once rather than at each of its gradients' slices.
- `functional_all_reduce`: the functional all-reduce DTensor's redistribute issues, called
  directly for the reported loss (execute/step.py).
- `queue_backward_callback`: run a function when the current backward ends, as DDP and FSDP
  do to wait for their gradient reductions (execute/gradients.py).
- `TorchDispatchMode`, the functional collective ops and c10d's in-place all-reduce op (with
  the process group its arguments box): record the collectives a step really issues, as
  torch's own CommDebugMode does (execute/comms.py).
- `MemTracker`: the peak of live tensor memory during a call, by kind, which CPU ranks have
  no allocator count of (execute/live_memory.py).
- `FakeTensorMode` / `reparametrize_module`: trace a meta model on fake CPU tensors, which
  autocast has kernels for (graph/fake.py).
- `non_finite_check_and_unscale`: GradScaler's fused unscale and inf/nan check
  (precision.py).
- `released_at_exit`: a mesh's ``_pg_registry`` cleared at exit, so that a destroyed gloo
  group ends while Python still runs (this package's mesh_release.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from torch.distributed._functional_collectives import (
    all_to_all_single as functional_all_to_all,
)
from torch.distributed._functional_collectives import (
    all_to_all_single_autograd as functional_all_to_all_autograd,
)
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.pipelining import _utils as pipelining_utils
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops._embedding_ops import _MaskPartial as MaskPartial
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder as ShardingPlaceholder,
)
from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy
from torch.distributed.tensor._redistribute import (
    clear_redistribute_planner_cache,
    redistribute_local_tensor,
)
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoplan.torch_private.schedule_orders import dualpipev_order as dualpipev_order
from autoplan.torch_private.schedule_orders import zbv_order as zbv_order
from autoplan.torch_private.schedule_orders import zero_bubble_order as zero_bubble_order

FUNCTIONAL_COLLECTIVES = torch.ops._c10d_functional
C10D_ALL_REDUCE = torch.ops.c10d.allreduce_.default  # (tensors, boxed group, op, ...)
queue_backward_callback = torch.autograd.Variable._execution_engine.queue_callback
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

__all__ = [
    "C10D_ALL_REDUCE",
    "FUNCTIONAL_COLLECTIVES",
    "STATIC_STAGES",
    "FakeTensorMode",
    "MaskPartial",
    "MemTracker",
    "RuntimeSchemaInfo",
    "ShardingPlaceholder",
    "StridedShard",
    "TensorMeta",
    "TorchDispatchMode",
    "all_gather_single",
    "dtensor_axis_rules",
    "dtensor_runs",
    "dualpipev_order",
    "from_local",
    "functional_all_reduce",
    "functional_all_to_all",
    "functional_all_to_all_autograd",
    "non_finite_check_and_unscale",
    "pipeline_received",
    "pipeline_sent",
    "pipeline_wire_dtype",
    "queue_backward_callback",
    "redistribute",
    "reduce_scatter_single",
    "register_single_dim_strategy",
    "reparametrize_module",
    "resolve_process_group",
    "static_stages",
    "unbox_process_group",
    "wait_collective",
    "zbv_order",
    "zero_bubble_order",
]


# DTensor's rule for an op on one mesh axis: (op, args, kwargs), tensors as their TensorMeta
# (a list of them for a tensor list) -> placement lists [outputs..., tensor args...], where a
# placement may be a ShardingPlaceholder standing for Shard
AxisRuleFunc = Callable[..., list[list[Any]]]


def dtensor_axis_rules(op: torch._ops.OpOverload) -> AxisRuleFunc | None:
    """DTensor's sharding rule for ``op`` on one mesh axis, None if DTensor has none."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    info = propagator.op_single_dim_strategy_funcs.get(op)
    if info is not None:
        func: AxisRuleFunc = info.func
        return func
    if _rules_are_whole_mesh() and op in propagator.op_strategy_funcs:
        return _one_axis_rules
    return None


def dtensor_runs(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor can run ``op`` on DTensors: a rule (per mesh axis or over the whole
    mesh), a handler of its own, or a decomposition (explicit, or composite ops that
    decompose before DTensor sees them); the others raise NotImplementedError at run time."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    return (
        op in propagator.op_single_dim_strategy_funcs
        or op in propagator.op_strategy_funcs
        or op in DTensor._op_dispatcher._custom_op_handlers
        or _decomposes(op)
    )


def _decomposes(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor runs ``op`` by its decomposition (torch 2.13 on; 2.11 runs composite
    ops so, which decompose before DTensor's dispatch)."""
    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
    except ImportError:
        return op._can_decompose()
    return bool(DecompShardingStrategy.has_decomp(op))


@functools.cache
def _rules_are_whole_mesh() -> bool:
    """Whether this torch states its elementwise rules over the whole mesh (torch 2.11) rather
    than per mesh axis (2.13 on, where an op still stated over the whole mesh has no rule the
    planner reads, as it had none before)."""
    registry = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    return torch.ops.aten.add.Tensor not in registry


@functools.cache
def _one_axis_mesh() -> DeviceMesh:
    # two ranks and no process group: a rule reads only the mesh's shape
    return DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)


def _one_axis_rules(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[list[Any]]:
    """A whole-mesh rule asked on a one-axis mesh, once with every tensor replicated, once
    with every tensor partial and once with every tensor split on each dim, as DTensor asks
    it at run time (a tensor too small for a dim stays replicated). A rule that refuses one
    such placement (a view that cannot split a merged dim) still gives the others."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    ndim = max((len(m.shape) for m in _metas((*args, *kwargs.values()))), default=0)
    rules: list[list[Any]] = []
    for offered in (Replicate(), Partial(), *(Shard(d) for d in range(ndim))):

        def strategy(value: Any, offered: Placement = offered) -> Any:
            if isinstance(value, TensorMeta):
                fits = not isinstance(offered, Shard) or offered.dim < len(value.shape)
                spec = DTensorSpec(_one_axis_mesh(), (offered if fits else Replicate(),), value)
                return OpStrategy([OpSpec(spec)])
            if isinstance(value, list | tuple) and value and isinstance(value[0], TensorMeta):
                return TupleStrategy([strategy(v) for v in value])
            return value

        schema = OpSchema(
            op,
            tuple(strategy(a) for a in args),
            {k: strategy(v) for k, v in kwargs.items()},
            schema_info=propagator.op_to_schema_info.get(op),
        )
        try:
            found = propagator.op_strategy_funcs[op](schema)
        except Exception:  # this placement refused; the others may still do
            continue
        if isinstance(found, OpStrategy):
            rules.extend(_placement_lists(found))
    return rules


def _metas(values: Sequence[Any]) -> list[TensorMeta]:
    found: list[TensorMeta] = []
    for v in values:
        if isinstance(v, TensorMeta):
            found.append(v)
        elif isinstance(v, list | tuple):
            found.extend(_metas(v))
    return found


def _placement_lists(strategy: OpStrategy) -> list[list[Any]]:
    lists = []
    for spec in strategy.strategies:
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        if spec.input_specs is not None:
            placed = [*(o for o in outs if o is not None), *spec.input_specs]
            lists.append([s.placements[0] for s in placed])
    return lists


_FROM_LOCAL_PLACES_GRADIENTS = "grad_placements" in inspect.signature(DTensor.from_local).parameters


def from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    grad_placements: tuple[Placement, ...] | None,
) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False)``, whose backward hands
    ``local`` its gradient placed as ``grad_placements`` (None: DTensor's default, partial
    sums reduced)."""
    if grad_placements is None:
        return DTensor.from_local(local, mesh, placements, run_check=False)
    if _FROM_LOCAL_PLACES_GRADIENTS:
        return DTensor.from_local(
            local, mesh, placements, run_check=False, grad_placements=grad_placements
        )
    placed: DTensor = _FromLocal.apply(local, mesh, placements, grad_placements)
    return placed


class _FromLocal(torch.autograd.Function):
    """torch 2.13's ``from_local(grad_placements=...)`` for torch 2.11, whose ``from_local``
    reduces a partial gradient: forward is ``from_local``; backward moves the gradient to
    ``grad_placements`` (partial stays partial) and hands on its local shard."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        grad_placements: tuple[Placement, ...],
    ) -> DTensor:
        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        ctx.set_materialize_grads(False)
        return DTensor.from_local(local, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[torch.Tensor | None, None, None, None]:
        if grad is None:
            return None, None, None, None
        local = grad._local_tensor
        if tuple(grad.placements) != ctx.grad_placements:
            goal = DTensorSpec(ctx.mesh, ctx.grad_placements, tensor_meta=grad._spec.tensor_meta)
            local = redistribute_local_tensor(local, grad._spec, goal)
        return local, None, None, None


def redistribute(
    tensor: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...], async_op: bool = False
) -> DTensor:
    """``tensor.redistribute(mesh, placements, async_op=async_op)`` (in flight, waited for
    where an op first reads it, when ``async_op``), where ``placements`` may also make a
    replicated or split axis partial: a split one is gathered, then each rank keeps its part of
    the replicated value (the sum's 1/n, as DTensor's own rules do inside an op: no
    communication). A tensor of integers stays replicated there, for the op's rule to read:
    its 1/n would be floats, DTensor's too (under torch 2.15 a plan places BART's token ids
    partial where ``new_zeros`` reads only their dtype)."""
    whole = tuple(
        Replicate() if isinstance(p, Partial) and p != c else p
        for c, p in zip(tensor.placements, placements, strict=True)
    )
    if whole != tuple(tensor.placements):
        tensor = tensor.redistribute(mesh, whole, async_op=async_op)
        if tensor.requires_grad:
            tensor.register_hook(_contiguous)
    if whole == placements or not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    partial: DTensor = _Partitioned.apply(tensor, placements)
    return partial


def _contiguous(grad: DTensor) -> DTensor:
    """``grad`` with its local part and its label contiguous. DTensor's backward of a
    redistribution labels the gradient it gathers or reduces (its local part contiguous) with
    the strides of the incoming one: a permuted one (ConvNeXt's channels-last blocks) makes the
    label and the local part differ; permuted back, the label says contiguous where the local
    part is not, and a view of it fails. Local, and so no collective: DTensor's own
    ``contiguous`` of a partial gradient would all-reduce it."""
    contiguous = torch.empty(grad.shape, device="meta").stride()
    if grad._local_tensor.is_contiguous() and grad.stride() == contiguous:
        return grad
    local = grad._local_tensor.contiguous()
    return DTensor.from_local(
        local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
        stride=contiguous,
    )  # fmt: skip


class _Partitioned(torch.autograd.Function):
    """A replicated DTensor made partial (``redistribute_local_tensor``, as DTensor's op rules
    do it). Backward hands the gradient on unchanged: the partial tensor holds the replicated
    one's value, so its gradient is the input's, placed as the ops that made it place it (a sum
    over a split batch partial along the batch's axes, for a gradient bucket to reduce), as
    when DTensor's op rule makes the partial inside the op."""

    @staticmethod
    def forward(ctx: Any, tensor: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.set_materialize_grads(False)
        spec = tensor._spec
        goal = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
        local = redistribute_local_tensor(tensor._local_tensor, spec, goal)
        meta = spec.tensor_meta
        assert meta is not None
        return DTensor.from_local(
            local, spec.mesh, placements, run_check=False, shape=meta.shape, stride=meta.stride
        )

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[DTensor | None, None]:
        return grad, None


# whether pipelining records which tensors crossing stages require a gradient (2.13 on)
_PIPELINE_SKIPS_NON_FLOAT = hasattr(pipelining_utils, "_TensorMeta")


def pipeline_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` crosses pipeline stages as."""
    if _PIPELINE_SKIPS_NON_FLOAT or dtype.is_floating_point or dtype.is_complex:
        return dtype
    return torch.float64


def pipeline_sent(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, and no view: the zero-bubble schedules' split backward detaches a
    stage's outputs in place, which a view refuses) as a stage sends it to the next."""
    tensor = tensor.contiguous()
    if tensor._is_view():
        tensor = tensor.clone()
    if pipeline_wire_dtype(tensor.dtype) == tensor.dtype:
        return tensor
    return tensor.to(torch.int64).view(torch.float64)


def pipeline_received(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` that a stage received in ``buffer``."""
    if buffer.dtype == dtype:
        return buffer
    buffer.grad = torch.zeros_like(buffer)  # the gradient the sending stage waits for
    return buffer.detach().view(torch.int64).to(dtype)


# whether pipeline stages given their shapes skip metadata inference (torch 2.13 on)
_STATIC_MODE = getattr(getattr(pipelining_utils, "InferenceMode", None), "STATIC", None)
STATIC_STAGES = _STATIC_MODE is not None


def static_stages(stages: Sequence[Any], num_microbatches: int) -> None:
    """Make ``stages`` (PipelineStages, in this rank's order) ready to run microbatches as the
    schedule makes them when each stage was given what it receives and sends: their buffers
    made from those shapes, no metadata exchanged (`STATIC_STAGES` says this torch can)."""
    assert STATIC_STAGES
    for stage in stages:
        stage.has_backward = True  # what a schedule with a loss function sets in its step
        stage._inference_mode = _STATIC_MODE
        stage._prepare_forward_infra(num_microbatches, None, None, has_backward=True)
    for stage in reversed(stages):
        stage._prepare_backward_infra(num_microbatches)


def wait_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor: a functional collective's pending result waited for."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def unbox_process_group(boxed: Any) -> dist.ProcessGroup:
    """The process group a c10d op's arguments carry as a TorchScript object."""
    group: dist.ProcessGroup = dist.ProcessGroup.unbox(boxed)
    return group


def non_finite_check_and_unscale(
    grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place, setting ``found`` to 1 where any is not
    finite (GradScaler's own op)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of a job of ``world_size`` on the "fake" process group (its
    collectives return at once, their outputs unwritten)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        clear_redistribute_planner_cache()


class FakeValues(FakeTensorMode):
    """Fake tensors whose values, where the step reads one (a random draw's seed, the
    gradients' norm, fp16's overflow flag), are zero: the step then takes the path of finite
    gradients within the clipping norm, and the shapes are what a real step has. An op of
    real tensors alone (a mesh's ranks, which a process group is made of) runs for real."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype is torch.bool else 0
        return super().__torch_dispatch__(func, types, args, kwargs)
