"""Checkpoints across plans, run by the worker: 3 steps under one plan, a save, a new step
under another plan (or, from the 2-rank run, another rank count) that loads it, and 3 more
steps must train as 6 steps in one process; a save cut short leaves the last one as it was;
the exported file is the model's whole state dict."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autoplan
from autoplan.errors import AutoplanError
from autoplan.execute.checkpoint import latest
from autoplan.workload import Workload, load_workload
from tests.distributed.cases import (
    GPT,
    ROOT,
    baseline_plan,
    data_parallel,
    gpt_megatron,
    pipeline,
    zero3,
    zero12,
)
from tests.distributed.training import TRAIN, layout_keyword, parallel, reference

HALF = 3  # steps before the save, and after the load
GPT_FILE = ROOT / "examples" / "gpt.py"
WORKLOAD = {**GPT, "batch_size": 8}  # every layout's batch and microbatches divide it
Layout = Callable[[Workload], autoplan.PlanOptions | autoplan.Plan]


def _step(w: Workload, c: autoplan.Cluster, layout: Layout) -> autoplan.Step:
    return parallel(w, c, train=TRAIN, **layout_keyword(layout(w)))


def _train(step: autoplan.Step, w: Workload, steps: int) -> list[float]:
    return [step(w.example_inputs, w.example_target).item() for _ in range(steps)]


def _resumed(
    w: Workload,
    c: autoplan.Cluster,
    layout: Layout,
    directory: Path,
    before: list[float],
    ref: dict[str, Any],
) -> dict[str, Any]:
    """A new step under ``layout`` loads ``directory`` and trains the second half: its
    differences from one process's 6 steps, with the losses before the save."""
    step = _step(w, c, layout)
    progress = step.load(directory)
    assert progress is not None
    losses = before + _train(step, w, HALF)
    params = step.state_dict()
    return {
        "step": progress.step,
        "extra": progress.extra,
        "loaded": progress.path.name,
        "loss": max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)),
        "param": max((params[n] - v).abs().max().item() for n, v in ref["params"].items()),
    }


def _crash_mid_save(step: autoplan.Step, directory: Path) -> str:
    """A save whose shards are written (on rank 1 only its own) but whose metadata never is,
    as a crash leaves it: the error every rank sees."""
    write = dcp.FileSystemWriter.write_data

    def written_then_crash(self: Any, *args: Any, **kwargs: Any) -> Any:
        write(self, *args, **kwargs).wait()
        raise OSError("the disk went away")

    with mock.patch.object(
        dcp.FileSystemWriter,
        "write_data",
        written_then_crash if dist.get_rank() == 1 else write,
    ):
        try:
            step.save(directory)
        except AutoplanError as e:
            return str(e)
    return "no error"


def _load_error(w: Workload, c: autoplan.Cluster, directory: Path) -> list[str]:
    """The error loading ``directory`` into ``w``'s model (data parallel) gives, as every
    rank saw it."""
    step = _step(w, c, lambda w: data_parallel(w, (4,)))
    try:
        step.load(directory)
        error = "no error"
    except AutoplanError as e:
        error = str(e)
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, error)
    return seen


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def checkpoints(c: autoplan.Cluster, shared: Path) -> dict[str, Any]:
    """Every rank runs this; rank 0's result is reported. ``shared``: a directory both
    torchruns see (the 2-rank one, which runs first, saves there for the 4-rank one)."""
    world = dist.get_world_size()
    w = load_workload(GPT_FILE, **WORKLOAD)
    ref = reference(w, steps=2 * HALF)
    found: dict[str, Any] = {}
    if world == 2:
        first = _step(w, c, lambda w: gpt_megatron(w, (2,)))
        before = _train(first, w, HALF)
        first.save(shared / "from-2", extra={"batches": HALF})
        found["tp->pipeline"] = _resumed(
            w, c, pipeline(stages=2, microbatches=2), shared / "from-2", before, ref
        )
        (shared / "from-2-losses.txt").write_text(" ".join(map(repr, before)))
        return found
    directory = shared / "from-4"
    # 2-D: tensor parallel inside, data parallel across
    first = _step(w, c, baseline_plan(dp=2, tp=2))
    before = _train(first, w, HALF)
    first.save(directory, extra={"batches": HALF})
    after_save = _train(first, w, 1)
    crashes: list[Any] = [None] * world
    dist.all_gather_object(crashes, _crash_mid_save(first, directory))
    found["crash"] = crashes
    found["after_crash"] = _names(directory)
    found["latest_after_crash"] = str(latest(directory)).rpartition("/")[2]
    layouts: dict[str, Layout] = {
        "dp": lambda w: data_parallel(w, (4,)),
        "zero3": lambda w: zero3(w, (4,)),
        "pipeline-2x2": pipeline(stages=2, microbatches=2, mesh=(2,)),
        "tp": lambda w: gpt_megatron(w, (4,)),
        # loaded into the shards, the whole parameters gathered from them
        "zero1": zero12(1),
    }
    for name, layout in layouts.items():
        found[f"2x2->{name}"] = _resumed(w, c, layout, directory, before, ref)
    # saved under ZeRO-2 (each rank's shards of the optimizer state), resumed data parallel
    sharded = _step(w, c, zero12(2))
    before_zero = _train(sharded, w, HALF)
    sharded.save(shared / "from-zero2", extra={"batches": HALF})
    found["zero2->dp"] = _resumed(
        w, c, lambda w: data_parallel(w, (4,)), shared / "from-zero2", before_zero, ref
    )
    found["wrong_model"] = {
        what: _load_error(load_workload(GPT_FILE, **{**WORKLOAD, **change}), c, directory)
        for what, change in (("fewer layers", {"num_layers": 1}), ("narrower", {"size": "tiny"}))
    }
    if (shared / "from-2").exists():  # saved by the 2-rank run: another process group
        losses_2 = [float(x) for x in (shared / "from-2-losses.txt").read_text().split()]
        found["2 ranks tp->2x2"] = _resumed(
            w, c, baseline_plan(dp=2, tp=2), shared / "from-2", losses_2, ref
        )
    # the first step goes on: 6 steps straight, then a save that replaces step 4's wreck and
    # keeps only itself, and the export
    straight = before + after_save + _train(first, w, 2 * HALF - first.steps_done)
    found["straight"] = max(abs(a - b) for a, b in zip(straight, ref["losses"], strict=True))
    first.save(directory, keep=1)
    found["kept"] = _names(directory)
    first.export(shared / "model.pt")
    if dist.get_rank() == 0:
        exported = torch.load(shared / "model.pt")
        fresh = load_workload(GPT_FILE, **WORKLOAD).model
        fresh.load_state_dict(exported)  # strict: every key, every shape
        found["export"] = max(
            (exported[n] - v).abs().max().item() for n, v in ref["params"].items()
        )
        found["export_types"] = sorted({type(v).__name__ for v in exported.values()})
    return found
