"""Gradient synchronization as the plan lists it: each gradient brought to its parameter's
storage placement, the plan's gradient buckets as one all-reduce each.

A bucket's gradients (local shards) are copied into one flat buffer, which is all-reduced
along the bucket's axes, and each gradient becomes a view of its slice. The buffer is the
bucket's for the whole run, as DDP's are: a fresh one each step is new pages for the kernel to
map and zero, every step. A gradient therefore
stays valid only until the next backward pass writes over it. DTensor has no bucketed
reduction of its own (DDP and FSDP each write theirs over plain tensors), so the bucketing is
ours. The collective is torch's: c10d's in-place all-reduce, as DDP's reducer issues it
(DTensor's redistribute is a functional, out-of-place all-reduce: one more copy of the whole
bucket), on the group of the bucket's axis, or
on a group of the ranks along all its axes together (`_group`: one all-reduce rather than one
per axis, as strategies/buckets.py explains).

A parameter whose every use runs locally on its stored shard has a plain local leaf in the
step (`autoplan.execute.step.local_leaves`): autograd accumulates its gradient as a plain tensor,
which goes into its bucket as it is (or, where it needs no synchronization, becomes the
parameter's gradient). A DTensor on that path would cost its to_local's backward and a DTensor
AccumulateGrad a parameter and step (benchmarks/results/executor_costs.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from autoplan.errors import AutoplanError
from autoplan.execute.placements import to_dtensor
from autoplan.execute.watchdog import note
from autoplan.planfile.schema import Plan
from autoplan.torch_private import queue_backward_callback


@dataclass
class _Bucket:
    name: str
    fqns: tuple[str, ...]  # in the order of the flat buffer
    axes: tuple[str, ...]
    group: dist.ProcessGroup  # the ranks along ``axes`` (flattened, for several)
    arrived: set[str] = field(default_factory=set)
    flat: torch.Tensor | None = None  # the gradients, flat: allocated once, reused each step
    work: dist.Work | None = None  # the in-place all-reduce of ``flat``, in flight
    # the gradients as DTensor views of ``flat``, made once: c10d reduces ``flat`` in place
    views: dict[str, DTensor] = field(default_factory=dict)


def gradient_to_storage(
    param: torch.Tensor, storage: tuple[Any, ...], mesh: DeviceMesh, async_op: bool
) -> None:
    """Reduce ``param``'s gradient to the parameter's storage placement (the plan's grad_sync
    all-reduce or reduce-scatter), if it is not there already."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != storage:
        param.grad = grad.redistribute(mesh, storage, async_op=async_op)


class GradientReducer:
    """The gradient synchronization of one stage's parameters (DTensors, by FQN)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        plan: Plan,
        stage: int,
        mesh: DeviceMesh,
        then: Callable[[], None] | None = None,
    ) -> None:
        """``params``: the tensors whose gradients to reduce, by FQN (a ZeRO-1/2 parameter's
        whole one, `autoplan.execute.sharded_state`); ``then``: called once they all are reduced."""
        self.params = dict(params)
        self.mesh = mesh
        self.axes = plan.stage_axes
        # where each gradient goes: its storage placement (ZeRO-2: its state's)
        self.storage = {f: to_dtensor(plan.params[f].gradient, self.axes) for f in self.params}
        self._then = then
        buckets = [c for c in plan.collectives if c.params and c.stage == stage]
        groups = {a: _group(mesh, a) for a in sorted({c.axes for c in buckets})}
        self.buckets = [  # issued in this order on every rank
            _Bucket(c.tensor, tuple(plan.nodes[p].module for p in c.params), c.axes, groups[c.axes])
            for c in buckets
        ]
        self.bucket_of = {fqn: b for b in self.buckets for fqn in b.fqns}
        self.leaves: dict[str, torch.Tensor] = {}  # local leaves, by FQN (see on_arrival)
        self._issued = 0
        self._callback_queued = False
        self._earlier: dict[str, torch.Tensor] = {}  # gradients of earlier backward passes

    def accepts_local(self, fqn: str, grad: tuple[Placement, ...]) -> bool:
        """Whether ``fqn``'s gradient may come as a plain local tensor placed ``grad``: as
        stored (nothing to synchronize), or partial exactly where its bucket all-reduces it."""
        bucket = self.bucket_of.get(fqn)
        if bucket is None:
            return grad == self.storage[fqn]
        return grad == self._bucketed(fqn, bucket)

    def _bucketed(self, fqn: str, bucket: _Bucket) -> tuple[Placement, ...]:
        """The placement of ``fqn``'s gradient as its bucket takes it: partial along the
        bucket's axes, as stored along the others."""
        expected = list(self.storage[fqn])
        for axis in bucket.axes:
            expected[self.axes.index(axis)] = Partial()
        return tuple(expected)

    def on_arrival(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Reduce each gradient as soon as backward has accumulated it, asynchronously (a
        bucket once all its gradients are in), and wait for them all when backward ends.
        ``leaves``: as `use_leaves` takes them.

        Several backward passes before an optimizer step accumulate, as in one process: a
        gradient already reduced is set aside while backward computes the new one, which is
        reduced alone and then added to it."""
        self.use_leaves(leaves)
        for fqn, param in self.params.items():

            def set_aside(grad: torch.Tensor, fqn: str = fqn) -> torch.Tensor:
                param = self.params[fqn]
                if param.grad is not None:
                    # a bucketed gradient is a view of the buffer the new one is packed into
                    earlier = param.grad
                    self._earlier[fqn] = earlier.clone() if fqn in self.bucket_of else earlier
                    param.grad = None
                return grad

            def hook(_: torch.Tensor, fqn: str = fqn) -> None:
                self._arrived(fqn)

            leaf = self.leaves.get(fqn, param)
            if not leaf.requires_grad:  # frozen: no gradient to reduce
                continue
            leaf.register_hook(set_aside)  # runs before the gradient is accumulated
            leaf.register_post_accumulate_grad_hook(hook)

    def use_leaves(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """The parameters' local leaves (`accepts_local`), whose gradients are plain local
        tensors, by FQN."""
        self.leaves = dict(leaves)

    def reduce_now(self) -> None:
        """Reduce every gradient now (a pipeline's, after its schedule)."""
        for fqn, param in self.params.items():
            if fqn in self.bucket_of:
                continue
            if fqn in self.leaves:
                if self.leaves[fqn].grad is not None:
                    param.grad = self._as_dtensor(fqn, self._take_local(fqn))  # as stored
            else:  # in flight while the next ones are issued; the optimizer waits for it
                gradient_to_storage(param, self.storage[fqn], self.mesh, async_op=True)
        self._finish()

    def _take_local(self, fqn: str) -> torch.Tensor:
        """The local leaf's gradient, taken from it (the next backward starts afresh)."""
        leaf = self.leaves[fqn]
        grad = leaf.grad
        assert grad is not None
        leaf.grad = None
        return grad

    def _check_trained(self, fqn: str) -> None:
        if not self.params[fqn].requires_grad:
            raise AutoplanError(
                f"{fqn} was frozen after the step was planned, and the plan reduces its "
                "gradient: a parameter must keep the requires_grad it had when the step was "
                "planned (plan again after freezing or unfreezing parameters)"
            )

    def _as_dtensor(self, fqn: str, local: torch.Tensor) -> DTensor:
        param = self.params[fqn]
        return DTensor.from_local(
            local,
            self.mesh,
            self.storage[fqn],
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def _arrived(self, fqn: str) -> None:
        param = self.params[fqn]
        if not self._callback_queued:
            queue_backward_callback(self._finish)
            self._callback_queued = True
        bucket = self.bucket_of.get(fqn)
        if bucket is None and fqn in self.leaves:
            self._check_trained(fqn)
            param.grad = self._as_dtensor(fqn, self._take_local(fqn))  # placed as stored
            return
        if bucket is None:
            # asynchronous, as DDP's bucket reductions are: the rest of backward runs while
            # it is in flight, and the optimizer waits for it when it reads it
            gradient_to_storage(param, self.storage[fqn], self.mesh, async_op=True)
            return
        bucket.arrived.add(fqn)
        # in plan order, so that every rank issues the same collectives in the same order
        while self._issued < len(self.buckets):
            nxt = self.buckets[self._issued]
            if len(nxt.arrived) < len(nxt.fqns):
                break
            self._issue(nxt)

    def _finish(self) -> None:
        """Issue the buckets not issued yet, then give every bucketed parameter its reduced
        gradient."""
        self._callback_queued = False
        while self._issued < len(self.buckets):
            self._issue(self.buckets[self._issued])
        self._issued = 0
        for bucket in self.buckets:
            self._unpack(bucket)
        for fqn, earlier in self._earlier.items():
            param = self.params[fqn]
            param.grad = earlier if param.grad is None else earlier + param.grad
        self._earlier.clear()
        if self._then is not None:
            self._then()

    @torch.no_grad()
    def _issue(self, bucket: _Bucket) -> None:
        shards: list[torch.Tensor] = []
        for fqn in bucket.fqns:
            if fqn in self.leaves:
                self._check_trained(fqn)
                shards.append(self._take_local(fqn))
                continue
            grad = self.params[fqn].grad
            if not isinstance(grad, DTensor):
                raise AutoplanError(
                    f"backward produced no gradient for {fqn}, which the plan reduces in "
                    f"{bucket.name}: a parameter must keep the requires_grad it had when the "
                    "step was planned (plan again after freezing or unfreezing parameters)"
                )
            self._check(fqn, tuple(grad.placements), bucket)
            shards.append(grad.to_local())
        pieces = [s.reshape(-1) for s in shards]
        if bucket.flat is None:
            bucket.flat = torch.cat(pieces)
        else:
            torch.cat(pieces, out=bucket.flat)
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self._issued += 1

    def _check(self, fqn: str, got: tuple[Placement, ...], bucket: _Bucket) -> None:
        """A bucket's gradients are partial sums along its axes and placed as their storage
        along the others."""
        if self._bucketed(fqn, bucket) != got:
            raise RuntimeError(
                f"the gradient of {fqn} is placed {got}, but the plan buckets it as partial "
                f"along {list(bucket.axes)} and stored {self.storage[fqn]}: the planner and "
                "the executor disagree (a bug)"
            )

    @torch.no_grad()
    def _unpack(self, bucket: _Bucket) -> None:
        assert bucket.work is not None and bucket.flat is not None
        note(f"the all-reduce of gradient bucket {bucket.name} on {'+'.join(bucket.axes)}")
        bucket.work.wait()
        # the same views of the same buffer every step (not every gradient wrapped as a
        # DTensor afresh, which costs CPU time per gradient and step)
        if not bucket.views:
            bucket.views = self._views(bucket, bucket.flat)
        for fqn, grad in bucket.views.items():
            self.params[fqn].grad = grad
        bucket.work = None
        bucket.arrived.clear()

    def _views(self, bucket: _Bucket, reduced: torch.Tensor) -> dict[str, DTensor]:
        """Each gradient of ``bucket`` as a DTensor view of its slice of ``reduced``."""
        views, offset = {}, 0
        for fqn in bucket.fqns:
            local = _local(self.params[fqn])
            piece = reduced[offset : offset + local.numel()].view(local.shape)
            views[fqn] = self._as_dtensor(fqn, piece)
            offset += local.numel()
        return views


def _group(mesh: DeviceMesh, axes: tuple[str, ...]) -> dist.ProcessGroup:
    """This rank's process group along ``axes`` of ``mesh`` together. For several axes it is
    made here, by the ranks in it alone, rather than by DeviceMesh's ``_flatten``: a flattened
    mesh changes how DTensor redistributes on it (S(0), S(0) -> R, R became one all-gather),
    which the planner would then have to follow."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    ranks = sorted(mesh[axes].mesh.flatten().tolist())
    return dist.new_group(ranks, use_local_synchronization=True)


def _local(param: torch.Tensor) -> torch.Tensor:
    assert isinstance(param, DTensor)
    return param.to_local()
