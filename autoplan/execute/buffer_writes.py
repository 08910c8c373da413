"""The buffers forward updates, written back after forward on every rank, as one process's
forward writes them in place (batch norm's running statistics, counters; the graph's
`autoplan.graph.ir.Write` s).

The traced step is functional: it reads each buffer's old value and returns the new one
beside the loss. The new value is placed as the plan places the step's output reads
(replicated: the collective that takes, an all-reduce of per-rank partial counts say, is in
the plan's list), then as the buffer is stored, and copied into the buffer's local shard.
Forward reads the buffers from the module at every step, so the next step sees the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from autoplan.execute.placements import reachable, to_dtensor
from autoplan.graph.convert import WRAPPED
from autoplan.planfile.schema import Plan
from autoplan.torch_private import redistribute


@dataclass(frozen=True)
class BufferWrite:
    index: int  # the value's position among the step's outputs
    buffer: str  # the buffer's FQN
    placements: tuple[Placement, ...]  # as the plan places the output's read of it


class BufferWrites:
    """The step's outputs: which is the loss, and which buffer each other one updates."""

    def __init__(self, ep: ExportedProgram, plan: Plan) -> None:
        specs = ep.graph_signature.output_specs
        (output,) = [n for n in ep.graph.nodes if n.op == "output"]
        reads = [to_dtensor(spec, plan.stage_axes) for spec in plan.nodes[output.name].inputs]
        self.writes = tuple(
            BufferWrite(i, (spec.target or "").removeprefix(WRAPPED), reads[i])
            for i, spec in enumerate(specs)
            if spec.kind == OutputKind.BUFFER_MUTATION
        )
        (self.loss,) = [i for i, s in enumerate(specs) if s.kind == OutputKind.USER_OUTPUT]

    @torch.no_grad()
    def write(self, module: nn.Module, outputs: Sequence[object], mesh: DeviceMesh) -> None:
        """Write each updated buffer of ``module`` from the step's ``outputs``."""
        if not self.writes:
            return
        buffers = dict(module.named_buffers())
        for w in self.writes:
            value, buffer = outputs[w.index], buffers[w.buffer]
            if isinstance(value, DTensor):
                goal = reachable(value.placements, w.placements)
                if tuple(value.placements) != goal:
                    value = redistribute(value, mesh, goal)
                if isinstance(buffer, DTensor):
                    value = value.redistribute(mesh, buffer.placements)
                value = value.to_local()
            assert isinstance(value, torch.Tensor)
            local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
            local.copy_(value)
