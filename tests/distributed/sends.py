"""The sends a pipelined step issues between stages, against those its plan implies: each
stage sends every tensor its plan lists as ``sent`` to the same position of the next stage's
ranks once per microbatch, and every floating-point tensor it ``received`` back as a gradient
(interleaved 1F1B: from each of the rank's stages, ``v`` times 1F1B's sends; ZBV: but between
its middle stages, which share their ranks)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase

from autoplan.execute.pipeline import PipelineRunner

Send = tuple[str, int, int, int]  # (forward | backward, stage, peer rank, bytes)


@contextlib.contextmanager
def recorded_sends() -> Iterator[list[Send]]:
    """Every send torch's pipeline stages post while in the block, on this rank."""
    found: list[Send] = []
    forward, backward = _PipelineStageBase.get_fwd_send_ops, _PipelineStageBase.get_bwd_send_ops

    def noted(kind: str, method: Any) -> Any:
        def wrapper(stage: _PipelineStageBase, chunk: int) -> list[dist.P2POp]:
            ops: list[dist.P2POp] = method(stage, chunk)
            for op in ops:
                nbytes = op.tensor.numel() * op.tensor.element_size()
                found.append((kind, stage.stage_index, op.peer, nbytes))
            return ops

        return wrapper

    _PipelineStageBase.get_fwd_send_ops = noted("forward", forward)  # type: ignore[method-assign]
    _PipelineStageBase.get_bwd_send_ops = noted("backward", backward)  # type: ignore[method-assign]
    try:
        yield found
    finally:
        _PipelineStageBase.get_fwd_send_ops = forward  # type: ignore[method-assign]
        _PipelineStageBase.get_bwd_send_ops = backward  # type: ignore[method-assign]


def planned_sends(runner: PipelineRunner) -> Counter[Send]:
    """The sends of one step of ``runner``'s plan on this rank."""
    plan = runner.plan
    assert plan.pipeline is not None
    count = plan.pipeline.num_microbatches
    rank = dist.get_rank()
    sends: Counter[Send] = Counter()
    for s, module in zip(runner.indices, runner.modules, strict=True):
        at = plan.stages[s].ranks.index(rank)
        # ZBV's middle stages, on one rank, pass on in place: no send either way
        if s + 1 < len(plan.stages) and plan.stages[s + 1].ranks[at] != rank:
            peer = plan.stages[s + 1].ranks[at]
            for meta in module._sent:
                sends["forward", s, peer, _local_bytes(module, meta)] += count
        if s > 0 and plan.stages[s - 1].ranks[at] != rank:
            peer = plan.stages[s - 1].ranks[at]
            for _, meta in module._received:
                if meta.dtype.is_floating_point:
                    sends["backward", s, peer, _local_bytes(module, meta)] += count
    return sends


def _local_bytes(module: Any, meta: torch.Tensor) -> int:
    """Bytes of this rank's shard of a boundary tensor, as the plan's boundary lays it out."""
    local: torch.Tensor = module._local(meta)
    return local.numel() * local.element_size()


def send_text(sends: Counter[Send]) -> list[str]:
    return [
        f"{n} x {kind} send of stage {stage} to rank {peer}, {nbytes} B"
        for (kind, stage, peer, nbytes), n in sorted(sends.items())
    ]
