"""The package's modes, one `StrEnum` per family: the option fields' types and the words the
plan file writes. A member is its string (``Schedule.GPIPE == "GPipe"``), so plans, cluster
files and the command line read and write the same text as before these were types.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from autoplan.errors import AutoplanError


class Mode(StrEnum):
    """A mode: printed, in messages too (``{mode!r}``), as the string the plan file writes."""

    def __repr__(self) -> str:
        return repr(self.value)


M = TypeVar("M", bound=Mode)


class Schedule(Mode):
    """A pipeline schedule, by the name of torch.distributed.pipelining's class
    (`autoplan.schedules`)."""

    ONE_F_ONE_B = "1F1B"  # Schedule1F1B
    GPIPE = "GPipe"  # ScheduleGPipe
    INTERLEAVED = "Interleaved1F1B"  # ScheduleInterleaved1F1B
    ZERO_BUBBLE = "ZeroBubble"  # ScheduleInterleavedZeroBubble (backward split in B and W)
    ZBV = "ZBV"  # ScheduleZBVZeroBubble (split backward, two stages a group in a V)
    DUALPIPE_V = "DualPipeV"  # ScheduleDualPipeV (DeepSeek's DualPipe in a V)


class RecomputeMode(Mode):
    """Activation recomputation of a layer (`autoplan.graph.recompute`)."""

    NONE = "none"  # every activation kept from forward to backward
    FULL = "full"  # the layer's blocks run their forward again in backward (Megatron's full)
    SELECTIVE = "selective"  # only the attention core runs again (Megatron's selective)
    # all but the ops whose outputs torchtitan's op-level selective checkpointing saves
    OPS = "ops"


class BaselineStyle(Mode):
    """Whose hand-written plan a baseline is (`autoplan.baseline`)."""

    MEGATRON = "megatron"  # Megatron-LM: its tp, sequence parallelism and ZeRO as asked
    # torchtitan's Llama plan: tp with sequence parallelism and loss parallelism, FSDP over dp
    TORCHTITAN = "torchtitan"


class Precision(Mode):
    """The dtype a mixed-precision step computes in, and how (`autoplan.precision`)."""

    BF16 = "bf16"  # under autocast
    FP16 = "fp16"  # under autocast, with dynamic loss scaling
    # the parameters cast to bf16 where the step reads them, every op in bf16 (FSDP2's
    # param_dtype, Megatron's --bf16)
    BF16_PARAMS = "bf16-params"


class ReduceDtype(Mode):
    """The dtype every gradient is reduced in under mixed precision
    (`autoplan.strategies.float32_grads`)."""

    FP32 = "fp32"


class Phase(Mode):
    """The part of a train step that issues a collective."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # a forward collective issued again in backward
    GRAD_SYNC = "grad_sync"  # once per step: the gradients' reduction
    UPDATE = "update"  # once per step, after the optimizer step (ZeRO's gather)


class NodeKind(Mode):
    """What a node of the graph IR is (`autoplan.graph.ir`)."""

    PARAM = "param"  # a trainable parameter (or a buffer: ``trainable`` False)
    INPUT = "input"  # a user input or target
    OP = "op"  # an ATen operator
    OUTPUT = "output"  # the graph's result (the loss for a train step)


def parse_mode(kind: type[M], value: str | M, what: str) -> M:
    """``value`` as a member of ``kind``, matched without regard to case; an unknown value is
    an `AutoplanError` naming ``what`` and the known values."""
    for member in kind:
        if str(value).lower() == member.value.lower():
            return member
    known = ", ".join(m.value for m in kind)
    raise AutoplanError(f"{what} {value!r} is not known; use one of {known}")
