"""ZeRO-1/2 as the plan places it (`autoplan.strategies.zero_state`): the parameters whose optimizer
state the plan splits are updated shard by shard, and gathered back whole after the step.

For each such parameter the model's ``nn.Parameter`` becomes its *shard*: a DTensor placed as
the plan's ``state``, holding a copy of this rank's part of the values. The optimizer, the
gradient clipping, the checkpoints and ``state_dict`` see only these shards, so the optimizer's
state is split with them, and a checkpoint holds each parameter and its state by FQN as under
any other plan. Forward reads the *whole* parameter instead (placed as stored, a leaf of its
own): its gradient is synchronized as the plan says (`GradientReducer`: all-reduced in a
bucket for ZeRO-1, reduce-scattered for ZeRO-2), then handed to the shard (`take_gradients`:
ZeRO-1's whole gradient cut to the shard's part, ZeRO-2's already that). After the optimizer
steps the shards, `gather` all-gathers them into the whole parameters (the plan's "update"
collectives), as it does after a checkpoint is loaded into the shards.

A parameter that forward only reads through casts to one narrower float dtype (mixed
precision's bf16 copy of a float32 master weight) is gathered in that dtype
(`autoplan.strategies.zero_state.gathered_dtype`): half the bytes, and the same values where
forward reads them, as Megatron's distributed optimizer gathers its bf16 parameters. After
the optimizer's step the gathers may be left in flight (`gather(wait=False)`) and each waited
for where the next forward first reads its parameter (`wait`; `PlanInterpreter.awaited`), as
Megatron's --overlap-param-gather does: on GPUs they run while the forward computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.export import ExportedProgram

from autoplan.execute.placements import to_dtensor
from autoplan.execute.watchdog import note
from autoplan.planfile.schema import Plan
from autoplan.strategies.zero_state import gathered_dtype


class ShardedState:
    """The ZeRO-1/2 parameters of one stage: their shards (the model's parameters now) and
    the whole parameters forward reads, by FQN."""

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        self.mesh = mesh
        self.whole: dict[str, DTensor] = {}
        self.shards: dict[str, DTensor] = {}  # the model's parameters (nn.Parameter DTensors)
        self.gathered: dict[str, torch.dtype] = {}  # by FQN: the dtype its gather moves
        self.pending: dict[str, DTensor] = {}  # by FQN: the gathers in flight

    @classmethod
    def split(cls, model: nn.Module, plan: Plan, mesh: DeviceMesh) -> ShardedState:
        """Replace ``model``'s ZeRO-1/2 parameters (as `materialize` placed them: as stored)
        by their shards."""
        self = cls(mesh)
        axes = plan.stage_axes
        placed: dict[int, nn.Parameter] = {}  # by id of the parameter replaced: tied ones once
        for fqn, param in model.named_parameters(remove_duplicate=False):
            entry = plan.params.get(fqn)
            if entry is None or not entry.state or not isinstance(param, DTensor):
                continue  # not ZeRO-1/2, or another pipeline stage's (a meta tensor)
            owner_name, _, leaf = fqn.rpartition(".")
            owner = model.get_submodule(owner_name)
            if id(param) not in placed:
                placed[id(param)] = self._split(fqn, param, to_dtensor(entry.state, axes))
            setattr(owner, leaf, placed[id(param)])
        return self

    @torch.no_grad()
    def _split(self, fqn: str, param: DTensor, state: tuple[Placement, ...]) -> nn.Parameter:
        # splitting a stored-whole axis is a local cut: no communication
        part = param.redistribute(self.mesh, state).to_local()
        shard = DTensor.from_local(
            part.clone(memory_format=torch.contiguous_format),  # its own memory, contiguous
            self.mesh,
            state,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
        whole = param.detach().requires_grad_(param.requires_grad)
        assert isinstance(whole, DTensor)
        self.whole[fqn] = whole
        made = nn.Parameter(shard, requires_grad=param.requires_grad)
        assert isinstance(made, DTensor)
        self.shards[fqn] = made
        return made

    def read_through(self, ep: ExportedProgram, params: Mapping[str, str]) -> None:
        """Gather each parameter in the dtype the step ``ep`` reads it in (``params``:
        placeholder -> FQN; `gathered_dtype`)."""
        cast = torch.ops.aten._to_copy.default
        for node in ep.graph.nodes:
            fqn = params.get(node.name)
            if node.op != "placeholder" or fqn not in self.whole:
                continue
            reads = [
                str(user.meta["val"].dtype).removeprefix("torch.") if user.target is cast else None
                for user in node.users
            ]
            stored = str(self.whole[fqn].dtype).removeprefix("torch.")
            dtype = getattr(torch, gathered_dtype(stored, reads))
            if dtype != self.whole[fqn].dtype:
                self.gathered[fqn] = dtype

    def by_placeholder(self, params: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """The whole parameters by the step's placeholder (``params``: placeholder -> FQN)."""
        return {p: self.whole[fqn] for p, fqn in params.items() if fqn in self.whole}

    @torch.no_grad()
    def take_gradients(self, fqns: Iterable[str] | None = None) -> None:
        """Give each shard its part of the whole parameter's synchronized gradient (added to
        one already there: backward passes accumulate); of ``fqns`` only (an interleaved
        pipeline stage's, once its gradients are reduced), or of all."""
        assert self.mesh is not None or not self.whole
        for fqn in self.whole if fqns is None else fqns:
            whole = self.whole[fqn]
            grad = whole.grad
            if grad is None:
                continue
            whole.grad = None
            shard = self.shards[fqn]
            if not isinstance(grad, DTensor):
                raise AssertionError(f"{fqn}: its whole parameter's gradient is no DTensor")
            if tuple(grad.placements) != shard.placements:
                # ZeRO-1: its part of the all-reduced gradient, copied out of the bucket
                # (which the next backward pass fills again)
                part = grad.redistribute(self.mesh, shard.placements).to_local()
                grad = DTensor.from_local(
                    part.clone(memory_format=torch.contiguous_format),
                    self.mesh,
                    shard.placements,
                    run_check=False,
                    shape=shard.shape,
                    stride=shard.stride(),
                )
            shard.grad = grad if shard.grad is None else shard.grad + grad

    @torch.no_grad()
    def gather(self, wait: bool = True) -> None:
        """All-gather the shards into the whole parameters (after the optimizer's step, or a
        checkpoint's load), in the same order on every rank; left in flight unless ``wait``
        (then `wait` finishes each)."""
        assert self.mesh is not None or not self.whole
        self.wait()  # the previous step's, if its forward never ran
        for fqn, whole in self.whole.items():
            shard = self.shards[fqn]
            dtype = self.gathered.get(fqn, shard.dtype)
            moved = shard if shard.dtype == dtype else shard.to(dtype)
            assert isinstance(moved, DTensor)
            self.pending[fqn] = moved.redistribute(self.mesh, whole.placements, async_op=True)
        if wait:
            self.wait()

    @torch.no_grad()
    def wait(self, fqns: Iterable[str] | None = None) -> None:
        """Finish the gathers in flight (of ``fqns`` only, or all): the whole parameters
        take their values."""
        for fqn in list(self.pending) if fqns is None else fqns:
            full = self.pending.pop(fqn, None)
            if full is None:
                continue
            note(f"the gather of {fqn} after the optimizer step (ZeRO)")
            self.whole[fqn].to_local().copy_(full.to_local())
