"""Every private torch API autoplan uses, in one place, pinned to torch 2.13.0.

tests/test_strategies.py and tests/test_distributed.py exercise each of them, so a torch
upgrade that moves one fails there, not deep inside a plan or a training run.

- DTensor's per-mesh-axis ("single-dim") sharding rules and their placeholder types: the
  planner reads DTensor's own rules instead of copying them (strategies/dtensor_rules.py).
- `register_single_dim_strategy` / `RuntimeSchemaInfo`: teach DTensor the CPU flash-attention
  op, which torch 2.13 has no rule for.
- `_MaskPartial`: the masked partial of a row-split embedding, which the planner must skip.
- `AsyncCollectiveTensor.wait`: the plain tensor behind a functional collective's result, so a
  bucket is waited for once rather than at each of its gradients' slices.
- `functional_all_reduce`: the functional all-reduce DTensor's redistribute issues, called
  directly for the reported loss (execute/step.py).
- `queue_backward_callback`: run a function when the current backward ends, as DDP and FSDP
  do to wait for their gradient reductions (execute/gradients.py).
- `TorchDispatchMode`, the functional collective ops and c10d's in-place all-reduce op (with
  the process group its arguments box): record the collectives a step really issues, as
  torch's own CommDebugMode does (execute/comms.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops._embedding_ops import _MaskPartial as MaskPartial
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder as ShardingPlaceholder,
)
from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy
from torch.utils._python_dispatch import TorchDispatchMode

FUNCTIONAL_COLLECTIVES = torch.ops._c10d_functional
C10D_ALL_REDUCE = torch.ops.c10d.allreduce_.default  # (tensors, boxed group, op, ...)
queue_backward_callback = torch.autograd.Variable._execution_engine.queue_callback

__all__ = [
    "C10D_ALL_REDUCE",
    "FUNCTIONAL_COLLECTIVES",
    "MaskPartial",
    "RuntimeSchemaInfo",
    "ShardingPlaceholder",
    "TensorMeta",
    "TorchDispatchMode",
    "functional_all_reduce",
    "queue_backward_callback",
    "register_single_dim_strategy",
    "resolve_process_group",
    "single_dim_strategy_funcs",
    "unbox_process_group",
    "wait_collective",
]


def single_dim_strategy_funcs() -> dict[Any, Any]:
    """DTensor's registry: ATen op -> its single-dim strategy."""
    funcs: dict[Any, Any] = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    return funcs


def wait_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor: a functional collective's pending result waited for."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def unbox_process_group(boxed: Any) -> dist.ProcessGroup:
    """The process group a c10d op's arguments carry as a TorchScript object."""
    group: dist.ProcessGroup = dist.ProcessGroup.unbox(boxed)
    return group
