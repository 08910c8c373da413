"""The peak of the live tensor memory a process holds during a call, as torch's MemTracker
counts it (`torch.distributed._tools.mem_tracker`: every tensor's storage from its making to
its last reference, by kind). On CPU ranks, where torch's allocator keeps no peak, `autoplan
run` measures its last step so; `benchmarks/memory_truth.py` checks the planner's memory
predictions with it."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from autoplan.torch_private import MemTracker

T = TypeVar("T")


def live_tensors() -> list[torch.Tensor]:
    """Every tensor with storage this process holds now (parameters, optimizer states, a
    rank's gradient buckets' buffers, its inputs' shards, ...): MemTracker sees only those
    made while it tracks and those it is given. Fake tensors (a rank's check of its plan on
    fakes) hold none."""
    gc.collect()
    with warnings.catch_warnings():
        # the isinstance of a deprecated module attribute (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    found = []
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if not isinstance(local, FakeTensor) and local.device.type != "meta":
            found.append(t)
    return found


def tracked_peak(call: Callable[[], T], *held: Any) -> tuple[T, dict[str, int]]:
    """``call()``'s result and MemTracker's peak snapshot of it: bytes by kind and "Total".
    ``held``: what the process holds from before (tensors, modules, optimizers), counted from
    the start; a module or an optimizer named after the tensors `live_tensors` found gives
    them MemTracker's own kinds (parameters, optimizer states)."""
    tracker = MemTracker()
    tracker.track_external(*held)
    with tracker, warnings.catch_warnings():
        # its module hooks find a module gone by backward (the loss's wrapper)
        warnings.filterwarnings("ignore", "Module is None")
        result = call()
    snapshots = tracker.get_tracker_snapshot("peak")
    (snapshot,) = (s for device, s in snapshots.items() if device.type != "meta")
    return result, {getattr(k, "value", str(k)): v for k, v in snapshot.items()}
